"""The one evaluation loop: every variant sees the same windows, batch by batch, and is scored against
the next tokens and against the baseline's next-token distribution. Full-vocabulary logits live for one
batch only, so memory does not grow with the data.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.execution import batching
from ptq.execution.devices import input_device
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
    window_kl: list[float] = field(default_factory=list)  # per window: mean KL vs the baseline (variants only)
    window_agree: list[float] = field(default_factory=list)  # per window: top-1 agreement (variants only)
    # Per window: the summed NLL and KL that nll_sum and kl_sum add one window at a time, in window order, so
    # that the sums do not depend on how windows were batched or shared between processes (merge_scores).
    window_nll_sum: list[float] = field(default_factory=list, repr=False)
    window_kl_sum: list[float] = field(default_factory=list, repr=False)

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


def _scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of one window: NLL of the next token, and the top-1 token."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logits.argmax(-1)


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


def _cross(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum_v p log q per position, q = softmax(logits)."""
    return (p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


# Each fused into a few loops over the vocabulary (no [seq_len, vocab] temporaries). The baseline's
# sum p log p goes through the same kernel as the variants' sum p log q, so an identical model's KL is 0.
_kernels = (fused(_scores), fused(_probs), fused(_cross))


def evaluate(models: dict[str, nn.Module], input_ids: torch.Tensor, batch_size: int | None = 4) -> dict[str, Scores]:
    """Score each model on the windows `input_ids` [n, seq_len]. The first model is the baseline that
    KL divergence and top-1 agreement are measured against. Each window predicts its tokens 1..L-1.
    batch_size None: automatic (ptq.execution.batching), halved and the batch retried when it runs out of GPU memory;
    an explicit one that does not fit stops with one line. The scores do not depend on the batch size."""
    names = list(models)
    scores = {name: Scores() for name in names}
    devices = {name: input_device(models[name]) for name in names}
    device = devices[names[0]]  # where the scores are computed (the baseline's device)
    auto = batch_size is None
    size = batching.auto_batch_size(models[names[0]], input_ids.shape[1], len(input_ids), len(names)) if auto else batch_size
    start = 0
    with torch.inference_mode(), progress("evaluating", len(input_ids) * len(names), input_ids.shape[1]) as advance:
        while start < len(input_ids):
            batch = input_ids[start:start + size].to(device)
            kept = copy.deepcopy(scores)  # a batch counts whole or not at all
            error = None
            try:
                base = None
                for name in names:
                    logits = models[name](input_ids=batch.to(devices[name])).logits.to(device)
                    base = score_logits(scores[name], logits, batch[:, 1:], base, versus=len(names) > 1)
                    del logits
            except torch.cuda.OutOfMemoryError as e:
                error = str(e)
            if error is not None:
                scores, base = kept, None
                estimate = len(batch) * batching.window_bytes(models[names[0]].config, batch.shape[1],
                                                              next(models[names[0]].parameters()).dtype, len(names))
                size = batching.back_off(size, auto, f"evaluating {len(names)} model(s) on {len(batch)} window(s) of "
                                         f"{batch.shape[1]} tokens", error, estimate)
                continue
            del base
            advance(len(batch) * len(names))
            start += len(batch)
    return scores


def merge_scores(parts: list[Scores]) -> Scores:
    """The Scores of consecutive shares of the windows, as one run over all of them: the same additions in the
    same order (score_logits adds one window at a time)."""
    out = Scores()
    for p in parts:
        out.tokens += p.tokens
        out.correct += p.correct
        out.agree += p.agree
        for v in p.window_nll_sum:
            out.nll_sum += v
        for v in p.window_kl_sum:
            out.kl_sum += v
        for name in ("window_nll", "window_correct", "window_kl", "window_agree", "window_nll_sum", "window_kl_sum"):
            getattr(out, name).extend(getattr(p, name))
    return out


def score_logits(s: Scores, logits: torch.Tensor, targets: torch.Tensor, base: tuple | None, versus: bool = True) -> tuple:
    """Add one batch to `s`: `logits` [b, L, vocab] of the windows whose next tokens are `targets` [b, L-1].
    `base` is what this returned for the baseline on the same batch (None: this is the baseline). versus=False:
    no variant will be scored against this baseline (its probabilities are not computed)."""
    scores_of, probs_of, cross = _kernels
    # Full-vocabulary work one window at a time: besides these logits and the baseline's probabilities,
    # only per-position results are kept.
    nll, top1, kl, probs = [], [], [], []
    for i, row in enumerate(logits):
        row = row[:-1]
        row_nll, row_top1 = scores_of(row, targets[i])
        nll.append(row_nll)
        top1.append(row_top1)
        if base is None and not versus:
            continue
        if base is None:
            p = probs_of(row)
            probs.append((p, cross(p, row)))
        else:  # KL(baseline || variant) = sum p log p - sum p log q, per position
            p, p_logp = base[0][i]
            kl.append(p_logp - cross(p, row))
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
    s.agree += (top1 == base[1]).sum().item()
    s.window_kl += kl.mean(-1).tolist()
    s.window_agree += (top1 == base[1]).double().mean(-1).tolist()
    return base


# ----------------------------------------------------------------------------------------------
# Tasks: log-likelihood of each choice's continuation, batched, every variant on the same batch.
#
# An item's choices share their context, so an item is packed into ONE row: the tokens the choices
# have in common (their longest common token prefix, usually the context) once, then each choice's own
# tokens one after the other. A 4D attention mask lets each choice's tokens see the shared prefix and
# themselves only, and position ids restart each choice right after the prefix, so every choice is
# scored exactly as if it were alone, while the prefix is computed once. One row per item, rows padded
# to the batch's longest: scoring N items costs ceil(N / batch_size) forward passes per variant.


@dataclass(frozen=True)
class PackedItem:
    tokens: list[int]  # shared prefix, then each choice's own tokens
    segments: list[int]  # 0 for the shared prefix, c + 1 for choice c
    positions: list[int]  # position ids: choice tokens continue from the end of the prefix
    targets: list[list[tuple[int, int]]]  # per choice: (row index whose logits predict it, token id)
    sequences: list[list[int]]  # per choice: context + continuation tokens, as if scored alone


def encode_pair(tokenizer, context: str, continuation: str, bos: bool) -> tuple[list[int], list[int]]:
    """Tokens of a (context, continuation) pair as lm-evaluation-harness makes them (HFLM._encode_pair):
    trailing spaces of the context move to the continuation, the pair is encoded whole, and the
    continuation is what follows the context's own encoding. An empty context becomes the EOS token;
    a model whose tokenizer adds BOS gets BOS first, as in the perplexity windows."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    whole, context_ids = encode(context + continuation), encode(context)
    continuation_ids = whole[len(context_ids):]
    if bos:
        context_ids = [tokenizer.bos_token_id, *context_ids]
    elif not context_ids:
        context_ids = [tokenizer.eos_token_id]
    if not continuation_ids:
        raise PtqError(f"a continuation tokenizes to nothing: {continuation!r}")
    return context_ids, continuation_ids


def pack_item(tokenizer, contexts: tuple[str, ...], continuations: tuple[str, ...], bos: bool,
              max_len: int | None = None) -> PackedItem:
    pairs = [encode_pair(tokenizer, c, t, bos) for c, t in zip(contexts, continuations)]
    seqs = [ctx + cont for ctx, cont in pairs]
    shared = 0
    while all(len(s) > shared and s[shared] == seqs[0][shared] for s in seqs):
        shared += 1
    length = shared + sum(len(s) - shared for s in seqs)
    cut = 0  # tokens dropped from the left when the row is longer than the model's context (as the harness does)
    if max_len is not None and length > max_len:
        cut = length - max_len
        if cut > min(len(ctx) for ctx, _ in pairs) - 1:
            raise PtqError(f"an item of {length} tokens does not fit the model's context of {max_len} tokens "
                           "even with its context truncated")
    tokens, segments, positions = seqs[0][cut:shared], [0] * (shared - cut), list(range(shared - cut))
    targets = []
    for c, ((ctx, _), seq) in enumerate(zip(pairs, seqs)):
        offset = len(tokens)
        tokens += seq[shared:]
        segments += [c + 1] * (len(seq) - shared)
        positions += list(range(shared - cut, len(seq) - cut))
        row = lambda k, offset=offset: k - cut if k < shared else offset + k - shared  # noqa: E731  seq index -> row index
        targets.append([(row(k - 1), seq[k]) for k in range(len(ctx), len(seq))])
    return PackedItem(tokens, segments, positions, targets, seqs)


def collate(items: list[PackedItem], pad_id: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rows padded to the longest, with the 4D additive mask (0: may attend, dtype min: may not)."""
    width = max(len(p.tokens) for p in items)
    pad = lambda values, fill: [v + [fill] * (width - len(v)) for v in values]  # noqa: E731
    input_ids = torch.tensor(pad([p.tokens for p in items], pad_id))
    segments = torch.tensor(pad([p.segments for p in items], -1))
    positions = torch.tensor(pad([p.positions for p in items], 0))
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (segments[:, None, :] == segments[:, :, None]) | (segments[:, None, :] == 0)  # [b, query, key]
    mask = torch.zeros(len(items), 1, width, width, dtype=dtype).masked_fill(~(causal & same)[:, None], torch.finfo(dtype).min)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}


def _choice_scores(model: nn.Module, items: list[PackedItem], pad_id: int, device) -> list[tuple[list[float], list[bool]]]:
    """One forward pass for all `items`: per item, per choice, (summed log-likelihood, greedy)."""
    dtype = next(model.parameters()).dtype
    batch = {k: v.to(device) for k, v in collate(items, pad_id, dtype).items()}
    logits = model(**batch).logits
    where = [(b, r, t) for b, p in enumerate(items) for choice in p.targets for r, t in choice]
    b_idx, r_idx, tok = (torch.tensor(x, device=device) for x in zip(*where))
    logp = torch.log_softmax(logits[b_idx, r_idx].float(), dim=-1)
    del logits
    token_logp = logp.gather(-1, tok[:, None]).squeeze(-1).double().tolist()
    token_greedy = (logp.argmax(-1) == tok).tolist()
    out, i = [], 0
    for p in items:
        lls, greedy = [], []
        for choice in p.targets:
            lls.append(sum(token_logp[i:i + len(choice)]))
            greedy.append(all(token_greedy[i:i + len(choice)]))
            i += len(choice)
        out.append((lls, greedy))
    return out


def check_packing(model: nn.Module, item: PackedItem, pad_id: int, device) -> None:
    """Packing relies on the model honouring a custom 4D attention mask and position ids. Check once, on
    the baseline, that the packed row scores each choice as a plain forward of that choice alone does."""
    packed, _ = _choice_scores(model, [item], pad_id, device)[0]
    for seq, choice, ll in zip(item.sequences, item.targets, packed):
        logits = model(input_ids=torch.tensor([seq], device=device)).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        start = len(seq) - len(choice)
        alone = sum(logp[k - 1, seq[k]].item() for k in range(start, len(seq)))
        if abs(alone - ll) > 1e-3 * (1 + abs(alone)):
            raise PtqError(f"this model does not honour custom attention masks (packed {ll:.4f} vs alone {alone:.4f} "
                           "nats): task scoring cannot batch its choices")


@dataclass
class TaskRun:
    scores: dict  # variant -> task name -> ItemScores
    forward_passes: dict  # variant -> forward passes used for task scoring
    check_passes: int  # extra plain forward passes of the one-time packing check (baseline only)
    batch_size: int | None = None  # items per forward pass at the end (an automatic one may have been halved)


def evaluate_tasks(models: dict[str, nn.Module], tasks: list, tokenizer, batch_size: int | None = 8,
                   max_len: int | None = None, share=None) -> TaskRun:
    """Score every item of every task with each model. Items of all tasks are packed, sorted by length
    (less padding) and batched; each batch goes through every model before the next batch is made.
    share(n): the positions, in that order, this process scores (ptq.execution.distributed.share); the other items' scores
    are None."""
    from ptq.evaluation.data import tokenizer_adds_bos
    from ptq.evaluation.tasks import ItemScores

    names = list(models)
    device = input_device(models[names[0]])
    bos = tokenizer_adds_bos(tokenizer)
    pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    packed = [(t, i, pack_item(tokenizer, item.contexts, item.continuations, bos, max_len))
              for t, task in enumerate(tasks) for i, item in enumerate(task.items)]
    order = sorted(range(len(packed)), key=lambda j: -len(packed[j][2].tokens))
    if share is not None:
        order = [order[k] for k in share(len(order))]
    results = {name: [[None] * len(task.items) for task in tasks] for name in names}
    passes = dict.fromkeys(names, 0)
    check_passes = 0
    with torch.inference_mode():
        multi = next((p for _, _, p in packed if len(p.sequences) > 1), None)
        if multi is not None:
            check_packing(models[names[0]], multi, pad_id, device)
            check_passes = 1 + len(multi.sequences)
        auto = batch_size is None
        width = max((len(packed[j][2].tokens) for j in order), default=1)
        size = batching.auto_batch_size(models[names[0]], width, len(packed), len(names)) if auto else batch_size
        start = 0
        with progress("scoring tasks", len(packed) * len(names)) as advance:
            while start < len(order):
                batch = [packed[j] for j in order[start:start + size]]
                error = None
                try:  # a retried batch rewrites the same items' results
                    for name in names:
                        for (t, i, _), scored in zip(batch, _choice_scores(models[name], [p for _, _, p in batch], pad_id, device)):
                            results[name][t][i] = scored
                except torch.cuda.OutOfMemoryError as e:
                    error = str(e)
                if error is not None:
                    size = batching.back_off(size, auto, f"scoring {len(batch)} task item(s) of up to {width} tokens "
                                             f"with {len(names)} model(s)", error)
                    continue
                for name in names:
                    passes[name] += 1
                advance(len(batch) * len(names))
                start += len(batch)
    scores = {name: {task.name: ItemScores([r[0] if r else None for r in per_task], [r[1] if r else None for r in per_task])
                     for task, per_task in zip(tasks, results[name])} for name in names}
    return TaskRun(scores, passes, check_passes, size if packed else batch_size)
