"""Residual-add inputs (the paper's section 4.3): the two operands of each of a decoder block's two
adds.

Pre-norm blocks (Llama, Gemma, Qwen2, GPT-2) compute
    s = x + attn(norm1(x));  y = s + mlp(norm2(s))
so the add inputs are the block input x, the attention output, the mid-block sum s and the MLP
output. x, attn and mlp are a hook away. s is both the second add's residual and norm2's input, the
same tensor, so norm2's pre-hook rounds it in place: the residual stream is then stored rounded, as
FP8 storage would.

Sandwich-norm blocks add normalised outputs instead:
    s = x + norm_a(attn(...));  y = s + norm_m(mlp(pre_mlp_norm(s)))
(Gemma 2/3: post_attention_layernorm, post_feedforward_layernorm, pre_feedforward_layernorm; OLMo 2
and EXAONE 4 have no pre-MLP norm, so the MLP reads s itself; GLM-4: post_self_attn_layernorm,
post_mlp_layernorm, and post_attention_layernorm is its pre-MLP norm). There the add inputs are
those norms' outputs, and s is the input of the pre-MLP norm (or of the MLP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

TENSORS = ("input", "attn_out", "mid", "mlp_out")
_ATTN, _MLP, _NORM2 = ("self_attn", "attn"), ("mlp",), ("post_attention_layernorm", "ln_2")


def _child(block: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next(
        (getattr(block, n) for n in names if isinstance(getattr(block, n, None), nn.Module)), None
    )


def add_inputs(block: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(the module whose output is the attention add input, the one whose output is the MLP add
    input, the one whose input is the mid-block sum s) for either layout above."""
    attn, mlp, norm2 = (_child(block, names) for names in (_ATTN, _MLP, _NORM2))
    post_mlp = _child(block, ("post_feedforward_layernorm", "post_mlp_layernorm"))
    if post_mlp is None:  # pre-norm
        return attn, mlp, norm2
    post_attn = _child(block, ("post_self_attn_layernorm",))
    if post_attn is not None:  # GLM-4: its post_attention_layernorm is the pre-MLP norm
        return post_attn, post_mlp, norm2
    pre_mlp = _child(block, ("pre_feedforward_layernorm",))
    return norm2, post_mlp, mlp if pre_mlp is None else pre_mlp


def residual_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Decoder blocks with either layout above, by module name."""
    return {
        name: m
        for name, m in model.named_modules()
        if all(_child(m, names) is not None for names in (_ATTN, _MLP, _NORM2))
    }


def install(model: nn.Module, quantizers: dict[str, dict[str, Callable]]) -> list:
    """Hook each block's residual-add inputs: block name -> {tensor: callable}. Returns the hook
    handles."""
    blocks, handles = residual_blocks(model), []
    for name, qs in quantizers.items():
        block = blocks[name]
        if "input" in qs:
            q = qs["input"]

            def pre(module, args, kwargs, q=q):
                if args:
                    return (q(args[0]), *args[1:]), kwargs
                return args, kwargs | {"hidden_states": q(kwargs["hidden_states"])}

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        attn_out, mlp_out, mid_reader = add_inputs(block)
        for tensor, child in (("attn_out", attn_out), ("mlp_out", mlp_out)):
            if tensor in qs:

                def post(module, args, output, q=qs[tensor]):
                    return (q(output[0]), *output[1:]) if isinstance(output, tuple) else q(output)

                handles.append(child.register_forward_hook(post))
        if "mid" in qs:

            def mid(module, args, q=qs["mid"]):
                with torch.no_grad():
                    args[0].copy_(q(args[0]))  # in place: the residual operand is this same tensor

            handles.append(mid_reader.register_forward_pre_hook(mid))
    return handles
