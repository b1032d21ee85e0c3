"""Accuracy tasks, batched scoring and intervals: scored against hand computation from the model's own
log-likelihoods (one plain forward per choice), on the tiny model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import TEXT

from ptq.errors import PtqError
from ptq.evaluation import stats
from ptq.evaluation.data import Corpus, load_corpus
from ptq.evaluation.evaluate import encode_pair, evaluate_tasks, pack_item
from ptq.evaluation.tasks import (
    ADAPTERS,
    Item,
    Task,
    build_cloze,
    item_correct,
    load_jsonl_task,
    parse_task_specs,
    rows_to_task,
    subsample,
)
from ptq.models.loading import load_model

LINES = re.sub(r"([.!?]) ", r"\1\n", TEXT * 3)  # one sentence a line: what cloze items are cut from


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load_model(str(tiny_model))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def varied_rows(n: int) -> list[dict]:
    words = TEXT.split()
    return [{"context": " ".join(words[i:i + 6]), "choices": [words[i + 6], words[i + 9], words[i + 13] + " " + words[i + 2]],
             "label": i % 3} for i in range(n)]


def logliks_by_hand(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """Harness tokenization, one plain forward of context + continuation, no batching, no packing."""
    ctx, cont = encode_pair(tokenizer, context, continuation, bos=False)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    picked = [logp[len(ctx) + j - 1] for j in range(len(cont))]
    return sum(p[t].item() for p, t in zip(picked, cont)), all(p.argmax().item() == t for p, t in zip(picked, cont))


# ----------------------------------------------------------------------------------------------
# Scoring


def test_hand_checked_jsonl_scores_exactly(tiny, tmp_path):
    rows = [{"context": "Who's there? Nay, answer", "choices": ["me", "the king", "cold"], "label": 0},
            {"context": "For this relief much thanks: 'tis bitter", "choices": ["cold", "heart and bed"], "label": 1},
            {"context": "", "choices": ["Long live", "stand"], "label": 1}]
    task = load_jsonl_task("hand", write_jsonl(tmp_path / "hand.jsonl", rows))
    run = evaluate_tasks({"m": tiny.model}, [task], tiny.tokenizer, batch_size=2)
    scores = run.scores["m"]["hand"]
    acc, acc_norm = [], []
    for row, got in zip(rows, scores.loglik):
        expected = [logliks_by_hand(tiny.model, tiny.tokenizer, row["context"], " " + c)[0] for c in row["choices"]]
        assert got == pytest.approx(expected, abs=1e-4)
        acc.append(float(np.argmax(expected) == row["label"]))
        acc_norm.append(float(np.argmax(np.array(expected) / [len(c) for c in row["choices"]]) == row["label"]))
    correct = item_correct(task, scores)
    assert correct["acc"].tolist() == acc and correct["acc_norm"].tolist() == acc_norm
    assert run.forward_passes == {"m": 2}


def test_partial_evaluation_and_greedy_match_plain_forwards(tiny):
    """Choices with different contexts (winogrande) and greedy items are scored as if alone."""
    wino = Item(("Long live the king! You come", "Long live the queen! You come"), (" most carefully",) * 2, 0)
    greedy = Item(("'Tis now struck twelve; get thee to",), (" bed",), 0)
    tasks = [Task("w", "choice", [wino], "", 1, 0.5, ""), Task("g", "greedy", [greedy], "", 1, 0.0, "")]
    run = evaluate_tasks({"m": tiny.model}, tasks, tiny.tokenizer, batch_size=8)
    for c, ctx in enumerate(wino.contexts):
        assert run.scores["m"]["w"].loglik[0][c] == pytest.approx(logliks_by_hand(tiny.model, tiny.tokenizer, ctx, " most carefully")[0], abs=1e-4)
    ll, is_greedy = logliks_by_hand(tiny.model, tiny.tokenizer, greedy.contexts[0], " bed")
    assert run.scores["m"]["g"].loglik[0][0] == pytest.approx(ll, abs=1e-4)
    assert run.scores["m"]["g"].greedy[0][0] == is_greedy
    assert run.forward_passes == {"m": 1}  # two tasks' items share one batch


def test_shared_prefix_is_computed_once(tiny):
    item = Item(("Who's there? Nay, answer me",) * 3, (" stand", " and unfold", " yourself"), 0)
    packed = pack_item(tiny.tokenizer, item.contexts, item.continuations, bos=False)
    context_len = len(encode_pair(tiny.tokenizer, item.contexts[0], item.continuations[0], False)[0])
    assert len(packed.tokens) == sum(len(s) for s in packed.sequences) - 2 * context_len
    assert packed.positions[:context_len] == list(range(context_len))
    assert all(packed.positions[packed.segments.index(c + 1)] == context_len for c in range(3))


def test_forward_passes_are_items_over_batch(tiny, tmp_path):
    task = load_jsonl_task("mc", write_jsonl(tmp_path / "mc.jsonl", varied_rows(10)))
    calls = []
    hook = tiny.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        run = evaluate_tasks({"a": tiny.model}, [task], tiny.tokenizer, batch_size=4)
    finally:
        hook.remove()
    assert run.forward_passes == {"a": 3}  # ceil(10 / 4)
    assert len(calls) == 3 + run.check_passes  # and nothing else: the one-time packing check is counted apart


def test_context_truncated_on_the_left_when_too_long(tiny):
    long_context = TEXT * 2
    packed = pack_item(tiny.tokenizer, (long_context,), (" cold",), bos=False, max_len=100)
    assert len(packed.tokens) == 100 and packed.positions == list(range(100))
    with pytest.raises(PtqError, match="does not fit"):
        pack_item(tiny.tokenizer, ("a",), (" " + TEXT,), bos=False, max_len=50)


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
        assert 200 <= len(context) <= 600 and (context.startswith("\n") or LINES.startswith(context) or "\n" + context in LINES)
        assert re.search(rf"\b{word}\b", context, re.IGNORECASE)
        start = LINES.index(context + target, previous_end)  # in order, and not overlapping the previous passage
        assert LINES[start + len(context + target)] in ".!?"  # the word ended a sentence and a line
        previous_end = start + len(context + target)
    words = [i.continuations[0].strip() for i in task.items]
    assert task.chance == max(words.count(w) for w in set(words)) / len(words)
    small = subsample(task, 3)
    assert [i for i in small.items] == [task.items[round(k * len(task.items) / 3)] for k in range(3)]
    assert small.available == len(task.items)


def test_adapters_on_hand_made_rows():
    hellaswag = rows_to_task("hellaswag", [{
        "activity_label": "Making a cake", "ctx_a": "A woman adds flour.", "ctx_b": "she",
        "endings": ["mixes it [title] well.", "eats  the bowl.", "leaves.", "sings [step] loudly."], "label": "2"}], "", str)
    item = hellaswag.items[0]
    assert item.contexts[0] == "Making a cake: A woman adds flour. She"
    assert item.continuations == (" mixes it. well.", " eats the bowl.", " leaves.", " sings loudly.")
    assert item.label == 2 and item.norm_lengths == (15, 14, 7, 13) and hellaswag.metrics == ("acc", "acc_norm")

    piqa = rows_to_task("piqa", [{"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0}], "", str)
    assert piqa.items[0].contexts[0] == "Question: Open a jar\nAnswer:" and piqa.items[0].continuations[1] == " eat the lid"

    arc = rows_to_task("arc_easy", [{"question": "What is ice?", "choices": {"text": ["water", "fire"], "label": ["A", "B"]},
                                     "answerKey": "A"}], "", str)
    assert arc.items[0].label == 0 and arc.items[0].contexts[0] == "Question: What is ice?\nAnswer:"

    wino = rows_to_task("winogrande", [{"sentence": "The cup broke the glass because _ was hard.", "option1": "the cup",
                                        "option2": "the glass", "answer": "1"}], "", str)
    assert wino.items[0].contexts == ("The cup broke the glass because the cup", "The cup broke the glass because the glass")
    assert wino.items[0].continuations == (" was hard.", " was hard.") and wino.metrics == ("acc",)

    lambada = rows_to_task("lambada_openai", [{"text": "he opened the door and saw the door"}], "", str)
    assert lambada.kind == "greedy" and lambada.items[0].contexts == ("he opened the door and saw the",)
    assert lambada.items[0].continuations == (" door",)
    assert set(ADAPTERS) == {"hellaswag", "piqa", "arc_easy", "winogrande", "lambada_openai"}


def test_task_specs():
    assert parse_task_specs("cloze, hellaswag=h.jsonl,dir/my.jsonl,piqa") == [
        ("cloze", None), ("hellaswag", "h.jsonl"), ("my", "dir/my.jsonl"), ("piqa", None)]
    for bad, message in [("nope", "unknown task"), ("cloze,cloze", "twice"), ("x=", "bad task"), (",", "no tasks")]:
        with pytest.raises(PtqError, match=message):
            parse_task_specs(bad)


# ----------------------------------------------------------------------------------------------
# Commands


def test_compare_with_itself_gives_zero_deltas(ptq_cli, tiny_model, tmp_path):
    recipe = tmp_path / "bf16-again.yaml"
    recipe.write_text("name: bf16-again\ndescription: the baseline again\ntargets: [Linear]\nignore: []\n"
                      "weights: {format: bf16}\ninputs: {format: bf16}\n")
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    mc = write_jsonl(tmp_path / "mc.jsonl", varied_rows(12))
    code, out, err = ptq_cli("compare", tiny_model, "--recipes", recipe, "--eval-data", text, "--seq-len", "32",
                             "--max-windows", "6", "--tasks", f"cloze,mc={mc}", "--out", tmp_path / "out", "-q")
    assert code == 0, err
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    v = r["variants"][0]
    assert v["ppl_delta_pct"] == 0 and v["ppl_delta_pct_ci"] == [0, 0] and not v["ppl_delta_significant"]
    assert not v["accuracy_delta_significant"]
    assert set(v["task_deltas"]) == {"cloze", "mc"}
    for metrics in v["task_deltas"].values():
        for d in metrics.values():
            assert d["delta"] == 0 and d["ci"] == [0, 0] and d["significant"] is False
    assert set(v["tasks"]["mc"]) == {"acc", "acc_stderr", "acc_ci", "acc_norm", "acc_norm_stderr", "acc_norm_ci", "n"}
    assert r["baseline"]["perplexity_ci"][0] <= r["baseline"]["perplexity"] <= r["baseline"]["perplexity_ci"][1]
    assert r["task_scoring"]["forward_passes"]["bf16"] == r["task_scoring"]["expected_forward_passes"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Task accuracy" in report and "## Intervals (95%)" in report and "| mc | acc_norm | 12 |" in report
    assert "task accuracy" in out


def test_eval_one_configuration(ptq_cli, tiny_model, tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    small, large = (write_jsonl(tmp_path / f"mc{n}.jsonl", varied_rows(n)) for n in (15, 120))
    code, out, err = ptq_cli("eval", tiny_model, "--recipe", "fp8-e4m3", "--calib-data", text, "--calib-samples", "2",
                             "--eval-data", text, "--seq-len", "32", "--max-windows", "4", "--batch-size", "16",
                             "--tasks", f"small={small},large={large}", "--out", tmp_path / "out", "-q")
    assert code == 0, err
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    c = r["config"]
    assert r["command"] == "eval" and c["name"] == "fp8-e4m3" and r["calibration"] is not None
    width = {name: c["tasks"][name]["acc_ci"][1] - c["tasks"][name]["acc_ci"][0] for name in ("small", "large")}
    assert width["large"] < width["small"]  # intervals narrow as items grow
    assert r["task_scoring"]["forward_passes"] == {"fp8-e4m3": -(-135 // 16)}
    assert "# ptq eval" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("task, message", [
    ("mc={bad}", "line 2: not valid JSON"),
    ("mc={wrong}", "line 1: expected the fields 'context, choices, label'"),
    ("hellaswag={label}", "line 1: 'label' must be an integer index"),
    ("mc=missing.jsonl", "does not exist"),
    ("squad", "unknown task 'squad'"),
])
def test_bad_task_input_is_one_line(ptq_cli, tiny_model, tmp_path, task, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n{oops\n')
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "a"}])
    label = write_jsonl(tmp_path / "label.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 2}])
    out_dir = tmp_path / "out"
    code, _, err = ptq_cli("eval", tiny_model, "--tasks", task.format(bad=bad, wrong=wrong, label=label), "--out", out_dir, "-q")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out_dir.exists()


def test_hub_task_offline_is_one_line(ptq_cli, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code, _, err = ptq_cli("eval", tiny_model, "--tasks", "piqa", "--out", tmp_path / "out", "-q")
    assert code == 2 and "cannot load task 'piqa'" in err and "piqa=rows.jsonl" in err


@pytest.mark.model
def test_cloze_on_the_default_model_is_far_above_chance():
    loaded = load_model(None)
    task = subsample(build_cloze(load_corpus(None, "evaluation")), 60)
    run = evaluate_tasks({"bf16": loaded.model}, [task], loaded.tokenizer, batch_size=12)
    acc = item_correct(task, run.scores["bf16"]["cloze"])["acc"].mean()
    assert acc > 3 * task.chance, (acc, task.chance)
    assert run.forward_passes == {"bf16": 5}
