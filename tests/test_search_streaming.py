"""ptq search --low-memory: the search run layer by layer from disk (ptq.search.search.Scorer with
ptq.execution.streaming.LayerByLayer) writes the in-memory search's record, number for number, on
tiny random models of every supported family it reads (GPT-OSS is refused); an interrupted one
resumes to the same result.

Why exactly equal: each decoder layer, as it is read, is quantized by the same quantize_variants
as the whole model in memory, each configuration runs the same modules swapped in, and the same
float32 ops run on the same batches in the same order (tests/test_streaming.py says why for
compare); a configuration's layers before its first quantized one give the baseline's outputs in
both."""

from __future__ import annotations

import json

import families
import pytest
from test_search import FAMILY_RUN, _search

from ptq.execution import streaming

TWO = {"recipes": "fp8-e4m3,fp8-dynamic"}
# GPT-OSS's checkpoints store its experts fused with biases: --low-memory refuses to read them
FUSED = "gpt_oss"
# what differs between two runs of the same search: when, with what, and how long it took
UNCOMPARED = ("cost", "created", "versions")


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread for these tests: their models are tiny, and on a few cores shared with
    other jobs, threads waiting on one another took most of their time (both searches of a test
    run alike either way)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _save(family, path):
    families.build(family).save_pretrained(path)
    families.make_tokenizer().save_pretrained(path)
    return path


def _both(ptq_run, model_dir, text_file, tmp_path, **flags) -> tuple[dict, dict]:
    """search.json of the in-memory search and of the same search with --low-memory."""
    records = {}
    for mode in ("in_memory", "low_memory"):
        out = tmp_path / mode
        code, _, err = _search(ptq_run, model_dir, text_file, out, **{mode: True}, **flags)
        assert code in (0, 1), err
        records[mode] = json.loads((out / "search.json").read_text())
    return records["in_memory"], records["low_memory"]


@pytest.mark.parametrize("family", sorted(set(families.FAMILIES) - {FUSED}))
def test_low_memory_search_writes_the_in_memory_record(
    family, ptq_run, text_file, tmp_path, monkeypatch
):
    """Every family (dense, GPT-2's Conv1D, mixture-of-experts, MLA), two recipes: the record of
    `ptq search --low-memory` is the in-memory one's, every float equal, from the sensitivities
    through the curves to the held-out verdict and its baselines. --max-kl 0 is met only by every
    unit in 16-bit: the bisection runs to the end of the ladder through configurations of all
    three levels, and the amax ranking's selection too. The configurations' decoder layers before
    their first quantized one are not run layer by layer either."""
    skipped = []
    runs = streaming.LayerByLayer.runs

    def counted(self, name, layer):
        if not (ran := runs(self, name, layer)):
            skipped.append((name, layer))
        return ran

    monkeypatch.setattr(streaming.LayerByLayer, "runs", counted)
    model_dir = _save(family, tmp_path / family)
    whole, streamed = _both(
        ptq_run, model_dir, text_file, tmp_path, max_kl="0", **FAMILY_RUN, **TWO
    )
    assert set(whole) == set(streamed)
    for key in whole.keys() - set(UNCOMPARED):
        assert streamed[key] == whole[key], key
    assert streamed["cost"]["forwards"] == whole["cost"]["forwards"]
    assert streamed["cost"]["low_memory"] and not whole["cost"]["low_memory"]
    assert streamed["cost"]["chunks"] == whole["cost"]["chunks"]
    assert len(whole["curve"]) > 4 and whole["amax_curve"]  # the bisection ran, on both rankings
    assert any(u["sensitivity"]["fp8-dynamic"] > 0 for u in whole["units"])
    assert skipped  # some configuration started past the first decoder layer


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_low_memory_search_with_a_budget_between_the_ends(family, ptq_run, text_file, tmp_path):
    """A budget a quarter of the whole recipe's KL: a choice between the ends of the curve (units at
    each level, the amax and random baselines held out), the same with --low-memory."""
    model_dir = _save(family, tmp_path / family)
    free = tmp_path / "free"
    code, _, err = _search(
        ptq_run, model_dir, text_file, free, max_ppl_increase="1000%", **FAMILY_RUN, **TWO
    )
    assert code in (0, 1), err
    budget = f"{json.loads((free / 'search.json').read_text())['curve'][0]['kl'] / 4:.3g}"
    whole, streamed = _both(
        ptq_run, model_dir, text_file, tmp_path, max_kl=budget, **FAMILY_RUN, **TWO
    )
    for key in whole.keys() - set(UNCOMPARED):
        assert streamed[key] == whole[key], key
    assert 0 < len(whole["chosen"]) < len(whole["units"])
    assert {b["name"] for b in whole["baselines"]} >= {"amax", "random:0", "amax:budget"}


def test_search_goes_layer_by_layer_when_the_model_and_its_copies_do_not_fit(
    ptq_run, tiny_model, text_file, tmp_path, monkeypatch
):
    """As compare does: without --low-memory or --in-memory, a checkpoint whose float32 copies (the
    model and its quantized copies) do not fit in memory is searched layer by layer, with a note,
    to the in-memory result; --in-memory refuses it then."""
    from ptq.runtime import resources

    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "whole", max_kl="0.00005")
    assert code in (0, 1), err
    params = resources.checkpoint_parameters(tiny_model)
    # one float32 copy fits; the model and its quantized copies (2.5 copies) do not
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 * 2)
    out = tmp_path / "auto"
    code, _, err = _search(ptq_run, tiny_model, text_file, out, max_kl="0.00005", quiet=None)
    assert code in (0, 1), err
    assert "searching layer by layer from disk (--low-memory)" in " ".join(err.split())
    whole = json.loads((tmp_path / "whole" / "search.json").read_text())
    streamed = json.loads((out / "search.json").read_text())
    for key in whole.keys() - set(UNCOMPARED):
        assert streamed[key] == whole[key], key
    assert (
        streamed["cost"]["low_memory"]
        and "layer by layer from disk" in (out / "search.md").read_text()
    )
    code, _, err = _search(
        ptq_run, tiny_model, text_file, tmp_path / "b", max_kl="0.00005", in_memory=True
    )
    assert code == 2 and "needs at least" in err and not (tmp_path / "b").exists(), err


def test_a_checkpoint_that_cannot_be_read_layer_by_layer_is_refused_in_one_line(
    ptq_run, text_file, tmp_path
):
    model_dir = _save(FUSED, tmp_path / FUSED)
    out = tmp_path / "search"
    code, _, err = _search(ptq_run, model_dir, text_file, out, max_kl="0", low_memory=True)
    assert code == 2 and "stored fused" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_interrupted_low_memory_search_resumes_to_the_same_result(
    ptq_run, tiny_model, text_file, tmp_path, monkeypatch
):
    """Ctrl-C in the middle of a search layer by layer: the state beside OUT, --resume continues
    it without scoring those configurations again, to the in-memory search's result."""
    from ptq.commands.search import state_path
    from ptq.search import search

    budget = {"max_kl": "0.00005"}
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "whole", **budget)
    assert code in (0, 1), err
    calls, evaluate = [], search.evaluate

    def interrupted(run, *args, **kwargs):
        calls.append(len(run.names) - 1)  # the configurations of this chunk
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(run, *args, **kwargs)

    monkeypatch.setattr(search, "evaluate", interrupted)
    out = tmp_path / "search"
    flags = {"force": None, "low_memory": True} | budget
    code, _, err = _search(ptq_run, tiny_model, text_file, out, **flags)
    assert code == 130 and "--resume" in err, err
    assert not out.exists() and state_path(out).is_file()
    scored = sum(calls[:2])  # the chunks scored before the interruption
    calls.clear()
    code, _, err = _search(ptq_run, tiny_model, text_file, out, resume=True, **flags)
    assert code in (0, 1), err
    assert not state_path(out).exists()
    whole = json.loads((tmp_path / "whole" / "search.json").read_text())
    resumed = json.loads((out / "search.json").read_text())
    for key in whole.keys() - set(UNCOMPARED):
        assert resumed[key] == whole[key], key
    assert resumed["cost"]["reused"] == whole["cost"]["reused"] + scored
    assert resumed["cost"]["forwards"] < whole["cost"]["forwards"]


def test_a_changed_checkpoint_is_not_the_search_resumed(tmp_path):
    """A search layer by layer knows its model by the checkpoint's contents (its weights are never
    in memory whole): one weight changed, the fingerprint is another."""
    import safetensors.torch

    path = _save("llama", tmp_path / "llama")
    first = streaming.load_streamed(str(path)).model.ptq_checkpoint.digest()
    assert streaming.load_streamed(str(path)).model.ptq_checkpoint.digest() == first
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    tensors["model.norm.weight"][0] += 1
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert streaming.load_streamed(str(path)).model.ptq_checkpoint.digest() != first
