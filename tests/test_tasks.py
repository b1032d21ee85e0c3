"""Cloze construction and the bootstrap intervals (task scoring itself is lm-evaluation-harness's: test_harness.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import TEXT

from ptq.evaluation import harness, stats
from ptq.evaluation.data import Corpus, load_corpus
from ptq.evaluation.tasks import build_cloze, cloze_rows, subsample
from ptq.models.loading import load_model

LINES = re.sub(r"([.!?]) ", r"\1\n", TEXT * 3)  # one sentence a line: what cloze items are cut from


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def varied_rows(n: int) -> list[dict]:
    words = TEXT.split()
    return [
        {
            "context": " ".join(words[i : i + 6]),
            "choices": [words[i + 6], words[i + 9], words[i + 13] + " " + words[i + 2]],
            "label": i % 3,
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------------------------------------
# Statistics


def test_bootstrap_interval_matches_binomial_and_narrows():
    rng = np.random.default_rng(1)
    widths = []
    for n in (100, 400, 1600):
        units = (rng.random(n) < 0.3).astype(float)
        e = stats.estimate(units)
        p = units.mean()
        assert e["stderr"] == pytest.approx(np.sqrt(p * (1 - p) / n), rel=0.1)
        assert e["ci"][0] < p < e["ci"][1]
        widths.append(e["ci"][1] - e["ci"][0])
    assert widths[0] > 1.5 * widths[1] > 2.25 * widths[2]  # ~1/sqrt(n)
    assert stats.estimate(units) == stats.estimate(units)  # fixed seed


def test_paired_delta():
    rng = np.random.default_rng(2)
    base = (rng.random(300) < 0.5).astype(float)
    same = stats.paired_delta(base, base.copy(), stats.difference)
    assert same["delta"] == 0 and same["ci"] == [0, 0] and not same["significant"]
    worse = base.copy()
    worse[np.flatnonzero(base)[:40]] = 0  # 40 of 300 items flip from right to wrong
    d = stats.paired_delta(base, worse, stats.difference)
    assert d["delta"] == pytest.approx(-40 / 300) and d["significant"] and d["ci"][1] < 0
    nll = rng.normal(3, 0.3, 50)
    ppl = stats.paired_delta(nll, nll + 0.01, stats.ratio_pct_of_exp)
    assert ppl["delta"] == pytest.approx(100 * (np.exp(0.01) - 1)) and ppl["significant"]


def test_a_share_of_documents_has_a_wilson_interval_not_the_bootstraps_degenerate_one():
    """Per-document 0/1 scores (acc, exact_match): the percentile bootstrap's interval collapses at the edge (6 of 6
    right gave [1, 1], 19 of 20 [0.85, 1]: over the binomial it held p = 0.97 45% of the times at n = 20). Their
    interval is Wilson's score interval, checked against scipy; other per-document values keep the bootstrap."""
    from scipy.stats import binom, binomtest

    # what results.json's task intervals are made of (harness.add_task_metrics)
    values = {"a": [1.0] * 6, "b": [1.0] * 5 + [0.0]}
    models = {
        name: harness.ModelTasks(
            results={"t": {"acc,none": float(np.mean(v))}},
            samples={"t": {"acc,none": np.array(v)}},
            doc_hashes={"t": [f"h{i}" for i in range(6)]},
            choices={"t": [2] * 6},
            responses={},
        )
        for name, v in values.items()
    }
    run = harness.HarnessRun(models, {}, {}, {"t": {"acc": True}}, {}, 4)
    tasks = [{"name": "t", "n": 6, "metrics": ["acc"], "higher_is_better": {"acc": True}}]
    for name, k in (("a", 6), ("b", 5)):
        entry = {"name": name}
        harness.add_task_metrics(entry, run, tasks, baseline=None if name == "a" else "a")
        wilson = binomtest(k, 6).proportion_ci(0.95, method="wilson")
        assert entry["tasks"]["t"]["acc_ci"] == pytest.approx([wilson.low, wilson.high], abs=1e-12)

    for k, n in ((6, 6), (0, 6), (19, 20), (98, 100), (30, 100)):
        units = np.array([1.0] * k + [0.0] * (n - k))
        wilson = binomtest(k, n).proportion_ci(0.95, method="wilson")
        e = stats.estimate_share(units)
        assert e["value"] == k / n and e["n"] == n
        assert e["ci"] == pytest.approx([wilson.low, wilson.high], abs=1e-12)
    # its coverage over the binomial itself, at n = 20, p = 0.97: near 95% (the bootstrap's was 45%)
    n, p = 20, 0.97
    intervals = [stats.estimate_share([1.0] * k + [0.0] * (n - k))["ci"] for k in range(n + 1)]
    covered = sum(binom.pmf(k, n, p) for k, (lo, hi) in enumerate(intervals) if lo <= p <= hi)
    assert covered > 0.94
    few = stats.estimate_share([1.0, 1.0, 1.0])  # below MIN_UNITS: no interval, as everywhere
    assert all(np.isnan(few["ci"]))
    scores = np.array([0.2, 0.5, 1.3, 0.9, 0.4])  # not 0/1: the bootstrap's interval
    assert stats.estimate_share(scores) == stats.estimate(scores)


# ----------------------------------------------------------------------------------------------
# Task construction


def test_cloze_construction():
    corpus = Corpus([LINES, "too short.\n"], "lines", "0" * 64)
    task = build_cloze(corpus)
    assert task.kind == "greedy" and len(task.items) > 5
    assert build_cloze(corpus).items == task.items  # deterministic
    previous_end = 0
    for item in task.items:
        (context,), (target,) = item.contexts, item.continuations
        word = target[1:]
        assert target == " " + word and re.fullmatch("[a-z]{3,}", word)
        assert 200 <= len(context) <= 600 and (
            context.startswith("\n") or LINES.startswith(context) or "\n" + context in LINES
        )
        assert re.search(rf"\b{word}\b", context, re.IGNORECASE)
        start = LINES.index(
            context + target, previous_end
        )  # in order, and not overlapping the previous passage
        assert LINES[start + len(context + target)] in ".!?"  # the word ended a sentence and a line
        previous_end = start + len(context + target)
    words = [i.continuations[0].strip() for i in task.items]
    assert task.chance == max(words.count(w) for w in set(words)) / len(words)
    small = subsample(task, 3)
    assert [i for i in small.items] == [
        task.items[round(k * len(task.items) / 3)] for k in range(3)
    ]
    assert small.available == len(task.items)


@pytest.mark.model
def test_cloze_on_the_default_model_is_far_above_chance(tmp_path):
    """lm-eval scores ptq's cloze items (the shipped ptq_cloze task's construction) on the offline model."""
    loaded = load_model(None)
    task = subsample(build_cloze(load_corpus(None, "evaluation")), 40)
    assert cloze_rows(task)[0]["target"] == task.items[0].continuations[0].strip()
    suite = harness.prepare(
        "cloze", lambda: load_corpus(None, "evaluation"), tmp_path, max_items=40
    )
    run = harness.run({"bf16": loaded.model}, loaded.tokenizer, suite, 12)
    acc = run.models["bf16"].results["cloze"]["acc,none"]
    assert run.models["bf16"].samples["cloze"]["acc,none"].size == 40
    assert acc > 2 * task.chance, (acc, task.chance)  # 0.3 vs 0.1 on these 40 items


def test_the_cloze_chance_is_that_of_the_items_limit_scores(tmp_path):
    """The cloze task's note gave the chance of all its items while --limit scored only the first of them (8.7% for
    300 items where the 8 scored gave 12.5%): it is the chance of the items scored, lm-eval's first ceil(n * limit)
    for a fraction, else the first `limit`."""

    from ptq.evaluation.tasks import Item, Task, scored_chance

    targets = ["sea", "sea", "sky", "sun", "sun", "sun", "sea", "oak"]
    items = [Item((f"passage {i}",), (" " + w,), 0) for i, w in enumerate(targets)]
    task = Task("cloze", "greedy", items, "test", len(items), 3 / 8, "most frequent word", ())
    assert scored_chance(task, None) == (3 / 8, 8)  # sun, 3 of 8
    assert scored_chance(task, 2) == (1.0, 2)  # sea, sea
    assert scored_chance(task, 0.3) == (2 / 3, 3)  # ceil(2.4) = 3: sea, sea, sky
    assert scored_chance(task, 100) == (3 / 8, 8)
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    suite = harness.prepare(f"cloze={text}", None, tmp_path / "work", max_items=None, limit=4)
    built = build_cloze(load_corpus(str(text), role="evaluation"))
    chance = scored_chance(built, 4)[0]
    assert (
        f"chance {100 * chance:.1f}%" in suite.notes["cloze"][-1]
        and "over the 4 items --limit scores" in (suite.notes["cloze"][-1])
    )
