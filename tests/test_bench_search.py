"""The search section of `make bench` on a tiny model: one line, the search's forwards and wall time
as multiples of one evaluation of the same model and windows."""

from __future__ import annotations

import re

from families import make_tokenizer

from benchmarks.bench import search_cost
from ptq import progress


def test_search_cost_is_a_multiple_of_one_evaluation(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "QUIET", True)
    (text,) = search_cost(
        make_tokenizer(), tmp_path, layers=1, hidden=64, windows=4, seq_len=16, budget="0"
    )
    assert text.startswith("INFO  search (random Llama 1 layers x 64") and "\n" not in text
    found = re.search(r"([\d.]+)x one evaluation's window forwards \((\d+) / 8\)", text)
    assert found, text
    # budget 0: every unit kept; the sensitivity alone is a forward per unit and search window
    assert float(found.group(1)) > 1 and int(found.group(2)) > 8
    assert re.search(r"[\d.]+x its wall time", text) and "no target" in text
