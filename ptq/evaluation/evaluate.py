"""The one evaluation loop: every variant sees the same windows, batch by batch, and is scored
against the next tokens and against the baseline's next-token distribution. Full-vocabulary logits
live for one batch only, so memory does not grow with the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ptq.execution import batching
from ptq.execution.executors import WholeModels
from ptq.progress import progress
from ptq.quantization.quantize import fused


@dataclass
class Scores:
    """Running sums for one variant; metrics are read from the properties."""

    tokens: int = 0
    nll_sum: float = 0.0
    correct: int = 0
    kl_sum: float = 0.0  # KL(baseline || variant), nats, summed over predicted positions
    agree: int = 0  # positions where the variant's top-1 token equals the baseline's
    window_nll: list[float] = field(default_factory=list)  # mean NLL of each window, for intervals
    window_correct: list[float] = field(default_factory=list)  # per window: next-token accuracy
    # per window: mean KL vs the baseline (variants only)
    window_kl: list[float] = field(default_factory=list)
    # per window: top-1 agreement (variants only)
    window_agree: list[float] = field(default_factory=list)
    # Per window: the summed NLL and KL that nll_sum and kl_sum add one window at a time, in window
    # order, so that the sums do not depend on how windows were batched or shared between processes
    # (merge_scores).
    window_nll_sum: list[float] = field(default_factory=list, repr=False)
    window_kl_sum: list[float] = field(default_factory=list, repr=False)

    @property
    def perplexity(self) -> float:
        """exp(mean NLL); inf past the float range (a mean NLL above ~709.78 nats: a collapsed
        variant), as numpy would give, so that the report says so and a gate fails rather than the
        run stopping."""
        try:
            return math.exp(self.nll_sum / self.tokens)
        except OverflowError:
            return math.inf

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens

    @property
    def kl_div(self) -> float:
        return self.kl_sum / self.tokens

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.tokens

    def add(self, later: Scores) -> None:
        """Append the Scores of the windows that follow these: the same additions in the same order
        as scoring them here (score_logits adds one window at a time), so the sums do not depend on
        the batching."""
        self.tokens += later.tokens
        self.correct += later.correct
        self.agree += later.agree
        for v in later.window_nll_sum:
            self.nll_sum += v
        for v in later.window_kl_sum:
            self.kl_sum += v
        for name in (
            "window_nll",
            "window_correct",
            "window_kl",
            "window_agree",
            "window_nll_sum",
            "window_kl_sum",
        ):
            getattr(self, name).extend(getattr(later, name))


# the top-1 token of a position whose logits are not finite: never the target, never agrees
NO_PREDICTION = -1


def _scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per position of one window: NLL of the next token, the top-1 token, and the log-softmax's
    parts (max logit m and log sum exp(logits - m)) that _probs and _cross take instead of reducing
    again. A position whose logits hold a NaN or +inf (a non-saturating format's overflow) has a NaN
    or inf NLL and predicts nothing (NO_PREDICTION): argmax would read a NaN as the largest logit,
    and count the position right where it is token 0."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    log_s = torch.log(torch.exp(x - m).sum(-1, keepdim=True))
    nll = log_s - (x.gather(-1, targets.unsqueeze(-1)) - m)
    top1 = torch.where(torch.isfinite(m + log_s).squeeze(-1), x.argmax(-1), NO_PREDICTION)
    return nll.squeeze(-1), top1, m.squeeze(-1), log_s.squeeze(-1)


def _probs(logits: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """softmax(logits), from _scores' m and log_s."""
    return torch.exp(logits.float() - m.unsqueeze(-1) - log_s.unsqueeze(-1))


def _cross(
    p: torch.Tensor, logits: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor
) -> torch.Tensor:
    """sum_v p log q per position, q = softmax(logits) = exp(logits - m - log_s): one pass, no exp.
    Terms with p = 0 count 0 (0 log 0), also where a logit is -inf."""
    terms = torch.where(p > 0, p * (logits.float() - m.unsqueeze(-1)), 0.0)
    return terms.sum(-1) - log_s * p.sum(-1)


# Each fused into a few loops over the vocabulary (no [seq_len, vocab] temporaries); only _scores
# reduces with exp, once per window and model (the others reuse its m and log_s). Every model's NLL
# comes from the same kernel, alone or next to others, and the baseline's sum p log p goes through
# the same kernel as the variants' sum p log q, so an identical model's KL is 0.
_kernels = (fused(_scores), fused(_probs), fused(_cross))


def evaluate(
    models: dict[str, nn.Module] | object, input_ids: torch.Tensor, batch_size: int | None = 4
) -> dict[str, Scores]:
    """Score each model on the windows `input_ids` [n, seq_len]. The first model is the baseline
    that KL divergence and top-1 agreement are measured against. Each window predicts its tokens
    1..L-1. models: the models, each run whole (ptq.execution.executors.WholeModels), or an executor
    (LayerByLayer: one decoder layer at a time, ptq.execution.streaming). batch_size None: automatic
    (ptq.execution.batching); on a GPU out-of-memory it is halved and the windows not yet scored run
    again (the batch, or with LayerByLayer every layer from the first); an explicit one that does
    not fit stops with one line. The scores do not depend on the batch size."""
    run = WholeModels(models) if isinstance(models, dict) else models
    names = run.names
    scores = {name: Scores() for name in names}
    seq_len = input_ids.shape[1]
    auto = batch_size is None
    # each variant's config
    estimated = list(run.models.values()) if isinstance(run, WholeModels) else run.model
    size = (
        batching.auto_batch_size(estimated, seq_len, len(input_ids), len(names))
        if auto
        else batch_size
    )
    done = 0  # windows scored
    with (
        torch.inference_mode(),
        progress("evaluating", run.steps(len(input_ids)), seq_len) as advance,
    ):
        while done < len(input_ids):
            error = None
            try:
                for batch, outputs in run.forward(input_ids[done:], size, advance=advance):
                    # A batch counts whole or not at all: scored apart, added once all its models
                    # are scored
                    batch_scores = {name: Scores() for name in names}
                    base = None
                    for name, logits in outputs:
                        base = score_logits(
                            batch_scores[name], logits, batch[:, 1:], base, versus=len(names) > 1
                        )
                        del logits
                    del base
                    for name in names:
                        scores[name].add(batch_scores[name])
                    done += len(batch)
            except torch.cuda.OutOfMemoryError as e:
                error = str(e)
            if error is not None:
                estimate = min(size, len(input_ids) - done) * batching.window_bytes(
                    run.model.config, seq_len, run.dtype, len(names)
                )
                size = batching.back_off(
                    size,
                    auto,
                    f"evaluating {len(names)} model(s) on "
                    f"{min(size, len(input_ids) - done)} window(s) of {seq_len} tokens",
                    error,
                    estimate,
                    run.ways_out,
                )
    return scores


def merge_scores(parts: list[Scores]) -> Scores:
    """The Scores of consecutive shares of the windows, as one run over all of them."""
    out = Scores()
    for p in parts:
        out.add(p)
    return out


def gather_scores(scores: dict[str, Scores]) -> dict[str, Scores]:
    """Each variant's Scores merged over the torchrun processes' shares of the windows, window by
    window in their order (ptq.runtime.distributed); the scores themselves in one process."""
    from ptq.runtime import distributed

    parts = distributed.gather(scores)
    return {name: merge_scores([p[name] for p in parts]) for name in scores}


def score_logits(
    s: Scores, logits: torch.Tensor, targets: torch.Tensor, base: tuple | None, versus: bool = True
) -> tuple:
    """Add one batch to `s`: `logits` [b, L, vocab] of the windows whose next tokens are `targets`
    [b, L-1]. `base` is what this returned for the baseline on the same batch (None: this is the
    baseline). versus=False: no variant will be scored against this baseline (its probabilities are
    not computed)."""
    scores_of, probs_of, cross = _kernels
    # Full-vocabulary work one window at a time: besides these logits and the baseline's
    # probabilities, only per-position results are kept.
    nll, top1, kl, probs = [], [], [], []
    for i, row in enumerate(logits):
        row = row[:-1]
        row_nll, row_top1, m, log_s = scores_of(row, targets[i])
        nll.append(row_nll)
        top1.append(row_top1)
        if base is None and not versus:
            continue
        if base is None:
            p = probs_of(row, m, log_s)
            probs.append((p, cross(p, row, m, log_s)))
        else:  # KL(baseline || variant) = sum p log p - sum p log q, per position
            p, p_logp = base[0][i]
            # >= 0 as a KL is: the difference of two sums, rounded, went below by 1e-9 where the
            # models agree
            kl.append((p_logp - cross(p, row, m, log_s)).clamp_min(0))
    nll, top1 = torch.stack(nll), torch.stack(top1)  # [b, L-1]
    s.tokens += targets.numel()
    sums = nll.double().sum(-1).tolist()
    s.window_nll_sum += sums
    for v in sums:
        s.nll_sum += v
    s.correct += (top1 == targets).sum().item()
    s.window_nll += nll.double().mean(-1).tolist()
    s.window_correct += (top1 == targets).double().mean(-1).tolist()
    if base is None:
        return probs, top1  # the baseline's [per window: (probabilities, sum of p log p)], top-1
    kl = torch.stack(kl).double()
    sums = kl.sum(-1).tolist()
    s.window_kl_sum += sums
    for v in sums:
        s.kl_sum += v
    agree = (top1 == base[1]) & (top1 != NO_PREDICTION)
    s.agree += agree.sum().item()
    s.window_kl += kl.mean(-1).tolist()
    s.window_agree += agree.double().mean(-1).tolist()
    return base
