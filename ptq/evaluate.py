"""The one evaluation loop: every variant sees the same windows, batch by batch, and is scored against
the next tokens and against the baseline's next-token distribution. Full-vocabulary logits live for one
batch only, so memory does not grow with the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ptq.progress import progress


@dataclass
class Scores:
    """Running sums for one variant; metrics are read from the properties."""

    tokens: int = 0
    nll_sum: float = 0.0
    correct: int = 0
    kl_sum: float = 0.0  # KL(baseline || variant), nats, summed over predicted positions
    agree: int = 0  # positions where the variant's top-1 token equals the baseline's
    window_nll: list[float] = field(default_factory=list)  # mean NLL of each window, for intervals

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens)

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens

    @property
    def kl_div(self) -> float:
        return self.kl_sum / self.tokens

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.tokens


def evaluate(models: dict[str, nn.Module], input_ids: torch.Tensor, batch_size: int = 4) -> dict[str, Scores]:
    """Score each model on the windows `input_ids` [n, seq_len]. The first model is the baseline that
    KL divergence and top-1 agreement are measured against. Each window predicts its tokens 1..L-1."""
    names = list(models)
    scores = {name: Scores() for name in names}
    device = next(models[names[0]].parameters(), torch.empty(0)).device
    with torch.inference_mode(), progress("evaluating", len(input_ids) * len(names), input_ids.shape[1]) as advance:
        for batch in input_ids.split(batch_size):
            batch = batch.to(device)
            targets = batch[:, 1:]
            base_logp = base_top1 = None
            for name in names:
                logits = models[name](input_ids=batch).logits[:, :-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                del logits
                nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [b, L-1]
                top1 = logp.argmax(-1)
                s = scores[name]
                s.tokens += targets.numel()
                s.nll_sum += nll.double().sum().item()
                s.correct += (top1 == targets).sum().item()
                s.window_nll += nll.double().mean(-1).tolist()
                if base_logp is None:
                    base_logp, base_top1 = logp, top1
                else:
                    s.kl_sum += (base_logp.exp() * (base_logp - logp)).sum(-1).double().sum().item()
                    s.agree += (top1 == base_top1).sum().item()
                advance(len(batch))
    return scores
