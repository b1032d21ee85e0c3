"""The evaluation loop against an independent numpy computation of its metrics."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import TEXT
from torch import nn

from ptq.evaluation.evaluate import Scores, evaluate


class Bigram(nn.Module):
    """A model whose next-token logits depend on the current token only: logits = table[token]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(params=["eager", "compiled"])
def metric_kernels(request, monkeypatch):
    """The loop's metrics as eager ops (the tests' default, PTQ_COMPILE=0) and fused by torch.compile (the default)."""
    import ptq.evaluation.evaluate
    from ptq.quantization.quantize import fused

    compiled = request.param == "compiled"
    kernels = tuple(
        fused(f, compile=compiled)
        for f in (
            ptq.evaluation.evaluate._scores,
            ptq.evaluation.evaluate._probs,
            ptq.evaluation.evaluate._cross,
        )
    )
    monkeypatch.setattr(ptq.evaluation.evaluate, "_kernels", kernels)
    return request.param


def test_perplexity_accuracy_kl_and_agreement_match_numpy(metric_kernels):
    rng = np.random.default_rng(0)
    vocab, n, length = 11, 5, 9
    base_table = rng.normal(size=(vocab, vocab)).astype(np.float32) * 3
    other_table = base_table + rng.normal(size=(vocab, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, size=(n, length))
    models = {
        "base": Bigram(torch.from_numpy(base_table)),
        "other": Bigram(torch.from_numpy(other_table)),
        "same": Bigram(torch.from_numpy(base_table.copy())),
    }
    scores = evaluate(models, torch.from_numpy(ids), batch_size=2)  # 5 windows: batches of 2, 2, 1

    context, targets = ids[:, :-1], ids[:, 1:]
    base_logp = np_log_softmax(base_table.astype(np.float64)[context])
    for name, table in (("base", base_table), ("other", other_table)):
        logp = np_log_softmax(table.astype(np.float64)[context])
        nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
        s = scores[name]
        assert s.tokens == targets.size
        assert s.perplexity == pytest.approx(np.exp(nll.mean()), rel=1e-5)
        assert s.accuracy == pytest.approx((logp.argmax(-1) == targets).mean())
        np.testing.assert_allclose(s.window_nll, nll.mean(-1), rtol=1e-5)
    kl = (
        np.exp(base_logp) * (base_logp - np_log_softmax(other_table.astype(np.float64)[context]))
    ).sum(-1)
    assert scores["other"].kl_div == pytest.approx(kl.mean(), rel=1e-4)
    np.testing.assert_allclose(scores["other"].window_kl, kl.mean(-1), rtol=1e-4)
    agree = base_table[context].argmax(-1) == other_table[context].argmax(-1)
    assert scores["other"].top1_agreement == pytest.approx(agree.mean())
    assert (
        scores["same"].kl_div == 0.0 and scores["same"].top1_agreement == 1.0
    )  # an identical model: exactly


def test_the_kl_of_the_same_distributions_is_never_negative(metric_kernels):
    """Logits shifted by a constant are the same distributions (KL 0); the difference of the two rounded sums went
    below 0 by about 1e-8 in some windows, printed as "KL -7.69e-09" by quantize's noise floor."""
    rng = np.random.default_rng(0)
    vocab = 50
    base = rng.normal(size=(vocab, vocab)).astype(np.float32) * 3
    shifted = base + np.float32(0.37)
    ids = rng.integers(0, vocab, size=(6, 33))
    models = {"base": Bigram(torch.from_numpy(base)), "shifted": Bigram(torch.from_numpy(shifted))}
    scores = evaluate(models, torch.from_numpy(ids), batch_size=2)["shifted"]
    assert min(scores.window_kl) >= 0 and 0 <= scores.kl_div < 1e-7


def test_tokens_a_model_rules_out_count_zero_in_the_kl(metric_kernels):
    # Logits of -inf (a vocabulary entry masked out, in both models): p = 0 there, and 0 log 0 counts 0, as numpy's
    # sum over the other tokens; a NaN from 0 * -inf would spoil the whole KL.
    rng = np.random.default_rng(1)
    vocab = 7
    base_table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    other_table = base_table + 0.3 * rng.normal(size=(vocab, vocab)).astype(np.float32)
    base_table[:, 5] = other_table[:, 5] = -np.inf
    ids = rng.integers(0, 5, size=(3, 6))
    models = {
        "base": Bigram(torch.from_numpy(base_table)),
        "other": Bigram(torch.from_numpy(other_table)),
    }
    scores = evaluate(models, torch.from_numpy(ids), batch_size=2)

    context = ids[:, :-1]
    kept = [v for v in range(vocab) if v != 5]
    base_logp = np_log_softmax(base_table.astype(np.float64)[context][..., kept])
    other_logp = np_log_softmax(other_table.astype(np.float64)[context][..., kept])
    kl = (np.exp(base_logp) * (base_logp - other_logp)).sum(-1)
    assert scores["other"].kl_div == pytest.approx(kl.mean(), rel=1e-4)
    assert scores["base"].perplexity == pytest.approx(
        np.exp(-np.take_along_axis(base_logp, ids[:, 1:, None], -1).mean()), rel=1e-5
    )


def test_a_position_whose_logits_are_not_numbers_is_never_right(metric_kernels):
    """A variant with a NaN or +inf logit in some rows (a non-saturating format's overflow): those positions predict
    nothing, so they count wrong for accuracy and never agree with the baseline; argmax read a NaN as the largest
    logit, so a NaN row whose next token was 0 counted right. Positions with finite logits score as before."""
    rng = np.random.default_rng(2)
    vocab = 6
    base_table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    base_table[:, 0] = 5.0  # every position's top-1 is token 0, in both models
    other_table = base_table.copy()
    other_table[1, 0] = np.nan  # after token 1: a NaN, where argmax read token 0, the right one
    other_table[2, 0] = np.inf  # after token 2: +inf
    ids = np.array([[1, 0, 2, 0, 3, 0, 4, 0], [0, 1, 0, 2, 0, 5, 0, 0]])
    models = {
        "base": Bigram(torch.from_numpy(base_table)),
        "other": Bigram(torch.from_numpy(other_table)),
    }
    scores = evaluate(models, torch.from_numpy(ids), batch_size=1)

    context, targets = ids[:, :-1], ids[:, 1:]
    finite = ~np.isin(context, (1, 2))
    assert scores["base"].accuracy == pytest.approx((targets == 0).mean())
    assert scores["other"].accuracy == pytest.approx(((targets == 0) & finite).mean())
    assert scores["other"].top1_agreement == pytest.approx(finite.mean())
    np.testing.assert_allclose(scores["other"].window_correct, ((targets == 0) & finite).mean(-1))
    assert math.isnan(scores["other"].perplexity) and math.isnan(scores["other"].kl_div)


def test_perplexity_past_the_float_range_is_inf_not_an_error():
    # math.exp raises OverflowError above ~709.78; a collapsed variant's mean NLL gets there, and numpy says inf
    with np.errstate(over="ignore"):
        assert Scores(tokens=10, nll_sum=7200.0).perplexity == np.exp(np.float64(720.0)) == math.inf
    assert Scores(tokens=10, nll_sum=7090.0).perplexity == pytest.approx(
        np.exp(np.float64(709.0)), rel=1e-12
    )


def collapse(name: str, nats: float):
    """A stand-in for ptq.commands.measure.evaluate whose variant `name` scores `nats` worse on every token."""
    import ptq.commands.measure

    real = ptq.commands.measure.evaluate

    def evaluate_collapsed(models, input_ids, batch_size=4):
        scores = real(models, input_ids, batch_size)
        s = scores[name]
        per_window = input_ids.shape[1] - 1
        s.window_nll = [v + nats for v in s.window_nll]
        s.window_nll_sum = [v + nats * per_window for v in s.window_nll_sum]
        s.nll_sum = sum(s.window_nll_sum)
        return scores

    return evaluate_collapsed


def test_compare_with_a_collapsed_variant_reports_inf_and_fails_the_gate(
    ptq_cli, ptq_run, tiny_model, tmp_path, monkeypatch, recwarn
):
    import ptq.commands.measure

    monkeypatch.setattr(ptq.commands.measure, "evaluate", collapse("fp8-e4m3", 800.0))
    other = tmp_path / "other.txt"  # evaluation text apart from the calibration text
    other.write_text(" ".join(reversed(TEXT.split())) * 3)
    out = tmp_path / "out"
    code, _, err = ptq_run(
        "compare", tiny_model, recipes="fp8-e4m3", eval_data=other, max_ppl_increase="5%", out=out
    )
    assert code == 1, err  # the gate fails; the run does not crash
    assert "Traceback" not in err
    assert not [
        str(w.message) for w in recwarn if "/ptq/" in w.filename
    ]  # no overflow warning from ptq's numbers
    text = (out / "results.json").read_text()
    r = json.loads(text)  # Python's json reads the Infinity it writes (as it reads NaN)
    v = r["variants"][0]
    assert (
        v["perplexity"] == math.inf
        and v["ppl_delta_pct"] == math.inf
        and '"perplexity": Infinity' in text
    )
    assert v["perplexity_ci"] == [math.inf, math.inf] and v["ppl_delta_pct_ci"] == [
        math.inf,
        math.inf,
    ]
    assert v["ppl_delta_significant"] is True and math.isfinite(r["baseline"]["perplexity"])
    (check,) = [c for c in r["gates"]["checks"] if c["metric"] == "ppl_delta_pct"]
    assert check["value"] == math.inf and check["passed"] is False and r["gates"]["passed"] is False
    report = (out / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| fp8-e4m3"))
    assert "| inf |" in row and "+inf%" in row and "❌" in row
    assert (out / "report-metrics.png").stat().st_size > 0
    # `ptq report` reads the file back and judges it the same way
    code, md, err = ptq_cli("report", out / "results.json")
    assert code == 1 and "+inf%" in md, err
