"""Attention's batched matmuls: quantize Q and K before Q.K^T, and the softmax output P and V before
P.V.

transformers dispatches every attention layer through ALL_ATTENTION_FUNCTIONS by the name in
`config._attn_implementation` ("eager", "sdpa", ...). We register one more, "ptq": the eager
computation with a hook point on each matmul input. A layer whose module carries a `ptq_attention`
(an AttentionQuant) has those inputs passed through its quantizers; any other runs unchanged. Fused
SDPA kernels never expose P, so a model switched to "ptq" computes attention the eager way (same
math), and the masks are built the eager way too. Calibration of an SDPA model instead switches to
"ptq-observe-sdpa": the observers see Q, K, V and P (computed for them alone) and the output is
SDPA's, with SDPA's masks, so the calibration forward is the baseline's to the bit whatever the
recipes cover (for an eager model, "ptq" is already its math, bit for bit). Works for every
architecture whose attention layer calls the attention interface with (module, query, key, value,
mask, scaling=...): Llama, Gemma, Qwen2, GPT-2, ...

K and V arrive after RoPE and after the KV-cache update: what is quantized here is exactly what a
cache stores, so `kv_cache` quantization is applied at the same point, before the matmul quantizers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

IMPLEMENTATION = "ptq"
OBSERVING = "ptq-observe-sdpa"  # calibration of an SDPA model: observers, and SDPA's own output
TENSORS = ("query", "key", "value", "probs")


class AttentionQuant(nn.Module):
    """The quantizers of one attention layer: tensor name -> a callable on that tensor (nn.Modules
    for real quantization, any callable for observers); a missing name is left as is."""

    def __init__(
        self, quantizers: dict[str, Callable], kv_cache: dict[str, Callable] | None = None
    ):
        super().__init__()
        self.quantizers = nn.ModuleDict(
            {k: v for k, v in quantizers.items() if isinstance(v, nn.Module)}
        )
        self.callables = {k: v for k, v in quantizers.items() if not isinstance(v, nn.Module)}
        self.kv_cache = nn.ModuleDict(
            {k: v for k, v in (kv_cache or {}).items() if isinstance(v, nn.Module)}
        )
        self.kv_callables = {
            k: v for k, v in (kv_cache or {}).items() if not isinstance(v, nn.Module)
        }

    def apply(self, tensor: str, x: torch.Tensor) -> torch.Tensor:
        q = self.quantizers[tensor] if tensor in self.quantizers else self.callables.get(tensor)
        return x if q is None else q(x)

    def apply_cache(self, tensor: str, x: torch.Tensor) -> torch.Tensor:
        q = self.kv_cache[tensor] if tensor in self.kv_cache else self.kv_callables.get(tensor)
        return x if q is None else q(x)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, L, d] -> [b, kv_heads * n_rep, L, d] (grouped-query attention), as transformers
    does."""
    if n_rep == 1:
        return x
    b, h, length, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, length, d).reshape(b, h * n_rep, length, d)


def quantized_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention, with the matmul inputs passed through the layer's
    AttentionQuant; Gemma 2's logit soft-capping (`softcap`) and GPT-OSS's attention sinks (`s_aux`)
    as their own eager functions compute them."""
    aq: AttentionQuant | None = getattr(module, "ptq_attention", None)
    if aq is not None:
        key, value = aq.apply_cache("key", key), aq.apply_cache("value", value)
        query, key, value = aq.apply("query", query), aq.apply("key", key), aq.apply("value", value)
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = _softcapped(torch.matmul(query, key.transpose(2, 3)) * scaling, softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = _softmax(scores, s_aux, query.dtype if s_aux is None else value.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    if aq is not None:
        probs = aq.apply("probs", probs)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Q.K^T * scaling soft-capped, tanh(s / cap) * cap (Gemma 2), before the mask as in the eager
    order."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores) in float32; with attention sinks (GPT-OSS: one learned logit per head), each
    row's softmax over its scores and its head's sink, less the row's max, in the scores' dtype, the
    sink's share then dropped."""
    if sinks is None:
        return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    sinks = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(dtype)


def _observed_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The softmax output P, as the eager computation makes it, from SDPA's mask: boolean (True
    attends), None (SDPA's causal shortcut, query and key aligned at the start) or additive."""
    scores = _softcapped(torch.matmul(query, key.transpose(2, 3)) * scaling, softcap)
    if attention_mask is None:
        q_len, k_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(
            k_len - q_len
        )
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask
    return _softmax(scores, sinks, query.dtype)


def observed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
):
    """Calibration: show Q, K, V and P to the layer's observers, return SDPA's output (the
    baseline's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    aq: AttentionQuant | None = getattr(module, "ptq_attention", None)
    if aq is not None:
        for tensor, x in (("query", query), ("key", key), ("value", value)):
            aq.apply(tensor, x)
        if "probs" in aq.callables or "probs" in aq.quantizers:
            n_rep = getattr(module, "num_key_value_groups", 1)
            aq.apply(
                "probs",
                _observed_probs(
                    query,
                    _repeat_kv(key, n_rep),
                    attention_mask,
                    query.size(-1) ** -0.5 if scaling is None else scaling,
                    kwargs.get("softcap"),
                    kwargs.get("s_aux"),
                ),
            )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs
    )


def register(implementation: str = IMPLEMENTATION) -> None:
    """Make "ptq" (eager-style masks) or "ptq-observe-sdpa" (SDPA's masks) a known attention
    implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    function, mask = (
        (observed_attention, sdpa_mask)
        if implementation == OBSERVING
        else (quantized_attention, eager_mask)
    )
    AttentionInterface.register(implementation, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(implementation, mask)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The self-attention layers that dispatch through the attention interface, by module name."""
    found = {}
    for name, module in model.named_modules():
        source = sys.modules.get(type(module).__module__)
        if (
            type(module).__name__.endswith("Attention")
            and hasattr(source, "ALL_ATTENTION_FUNCTIONS")
            and not getattr(module, "is_cross_attention", False)
        ):
            found[name] = module
    return found


def other_attention(model: nn.Module) -> dict[str, str]:
    """Attention layers that do not dispatch through the attention interface (their own
    softmax(QK^T)V code), by module name -> class name: ptq cannot quantize their matmul inputs or
    KV cache."""
    found, taken = {}, attention_modules(model)
    for name, module in model.named_modules():
        within = any(name.startswith(f"{outer}.") for outer in (*taken, *found))
        if type(module).__name__.endswith("Attention") and name not in taken and not within:
            if not getattr(module, "is_cross_attention", False):
                found[name] = type(module).__name__
    return found


def set_implementation(model: nn.Module, implementation: str) -> str:
    """Switch the model's attention implementation; returns the previous one."""
    if implementation.startswith(IMPLEMENTATION):
        register(implementation)
    previous = model.config._attn_implementation
    model.config._attn_implementation = implementation
    return previous


def install(model: nn.Module, layers: dict[str, AttentionQuant], observe: bool = False) -> None:
    """Attach each layer's AttentionQuant and switch the model to the "ptq" implementation; with
    observe=True (calibration), an SDPA model to the one that returns SDPA's output."""
    modules = attention_modules(model)
    for name, aq in layers.items():
        modules[name].ptq_attention = aq
    if layers:
        sdpa = model.config._attn_implementation == "sdpa"
        set_implementation(model, OBSERVING if observe and sdpa else IMPLEMENTATION)


def uninstall(model: nn.Module, previous: str) -> None:
    for module in attention_modules(model).values():
        if hasattr(module, "ptq_attention"):
            del module.ptq_attention
    model.config._attn_implementation = previous
