"""The evaluation loop against an independent numpy computation of its metrics."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from ptq.evaluation.evaluate import evaluate


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
        for f in (ptq.evaluation.evaluate._scores, ptq.evaluation.evaluate._probs, ptq.evaluation.evaluate._cross)
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
    kl = (np.exp(base_logp) * (base_logp - np_log_softmax(other_table.astype(np.float64)[context]))).sum(-1)
    assert scores["other"].kl_div == pytest.approx(kl.mean(), rel=1e-4)
    np.testing.assert_allclose(scores["other"].window_kl, kl.mean(-1), rtol=1e-4)
    agree = base_table[context].argmax(-1) == other_table[context].argmax(-1)
    assert scores["other"].top1_agreement == pytest.approx(agree.mean())
    assert scores["same"].kl_div == 0.0 and scores["same"].top1_agreement == 1.0  # an identical model: exactly


def test_tokens_a_model_rules_out_count_zero_in_the_kl(metric_kernels):
    # Logits of -inf (a vocabulary entry masked out, in both models): p = 0 there, and 0 log 0 counts 0, as numpy's
    # sum over the other tokens; a NaN from 0 * -inf would spoil the whole KL.
    rng = np.random.default_rng(1)
    vocab = 7
    base_table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    other_table = base_table + 0.3 * rng.normal(size=(vocab, vocab)).astype(np.float32)
    base_table[:, 5] = other_table[:, 5] = -np.inf
    ids = rng.integers(0, 5, size=(3, 6))
    models = {"base": Bigram(torch.from_numpy(base_table)), "other": Bigram(torch.from_numpy(other_table))}
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
