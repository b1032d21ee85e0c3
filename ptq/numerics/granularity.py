"""Granularity: which elements of a tensor share one scale (after torchao's
quantization/granularity.py).

Each granularity is a small frozen dataclass. A weight is [out, in] (in: the reduction dimension);
an activation is [..., in]. The scale of a tensor is computed on a *grouped view* of it, in which
every set of elements that shares a scale spans the reduced dimensions, so that the scale broadcasts
back without being expanded:

    PerTensor()         one scale                            scale []
    PerChannel()        one per output row (weights)         scale [out, 1]
    PerToken()          one per row (activations)            scale [..., 1]
    PerGroup(32)        one per 32 consecutive elements      scale [..., in/32] (stored),
                        along the reduction dim (MX, 1x128)  view [..., in/32, 32]
    PerBlock(128, 128)  one per 128 x 128 tile (weights)     scale [ceil(out/128), ceil(in/128)]
    PerHead()           one per attention head (the KV       scale [1, heads, 1, 1] over
                        cache's K and V; static)             [batch, heads, tokens, dim]

A dimension that is not a multiple of the group or block is padded with zeros, which change no amax:
the last group or tile is partial, as compressed-tensors and vLLM lay out their scales (ceil
division).

E8M0 scales (OCP Microscaling v1.0: an 8-bit power of two 2^(u - 127), u = 255 is NaN) are chosen by
one rule here, `e8m0_scale`: the smallest power of two that does not clip the group's amax.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ptq.numerics.formats import exact_exp2


@dataclass(frozen=True)
class PerTensor:
    def describe(self) -> str:
        return "per-tensor"


@dataclass(frozen=True)
class PerChannel:
    def describe(self) -> str:
        return "per-channel"


@dataclass(frozen=True)
class PerToken:
    def describe(self) -> str:
        return "per-token"


@dataclass(frozen=True)
class PerGroup:
    size: int  # consecutive elements along the reduction (last) dimension

    def describe(self) -> str:
        return f"per-group-{self.size}"


@dataclass(frozen=True)
class PerBlock:
    rows: int
    cols: int

    def describe(self) -> str:
        return f"per-block-{self.rows}x{self.cols}"


@dataclass(frozen=True)
class PerHead:
    def describe(self) -> str:
        return "per-head"


Granularity = PerTensor | PerChannel | PerToken | PerGroup | PerBlock | PerHead


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def grouped(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """x viewed so that `amax_of` reduces each set of elements sharing a scale (padded with zeros as
    needed)."""
    if isinstance(g, PerGroup):
        x = _pad_to(x, -1, g.size)
        return x.reshape(*x.shape[:-1], x.shape[-1] // g.size, g.size)
    if isinstance(g, PerBlock):
        x = _pad_to(_pad_to(x, 0, g.rows), 1, g.cols)
        return x.reshape(x.shape[0] // g.rows, g.rows, x.shape[1] // g.cols, g.cols)
    return x


def ungrouped(q: torch.Tensor, g: Granularity, shape: torch.Size) -> torch.Tensor:
    """The inverse of `grouped`: back to `shape`, padding dropped."""
    if isinstance(g, PerGroup):
        q = q.reshape(*q.shape[:-2], -1)
        return q[..., : shape[-1]] if q.shape[-1] != shape[-1] else q
    if isinstance(g, PerBlock):
        q = q.reshape(q.shape[0] * q.shape[1], q.shape[2] * q.shape[3])
        return q[: shape[0], : shape[1]] if q.shape != shape else q
    return q


def amax_of(view: torch.Tensor, g: Granularity) -> torch.Tensor:
    """max |x| of each set sharing a scale, in float32, shaped to broadcast over the grouped
    view."""
    a = view.detach().abs()
    if isinstance(g, PerTensor):
        return a.amax().float()
    if isinstance(g, PerBlock):
        return a.amax(dim=(1, 3), keepdim=True).float()
    return a.amax(dim=-1, keepdim=True).float()  # channel, token, group: along the last dim


def stored(scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """A scale as checkpoints store it: [] / [out, 1] / [out, in/G] / [ceil(out/R), ceil(in/C)]."""
    if isinstance(g, PerGroup):
        return scale.squeeze(-1)
    if isinstance(g, PerBlock):
        return scale.squeeze(3).squeeze(1)
    return scale


def broadcastable(scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """The inverse of `stored`: a stored scale shaped to broadcast over the grouped view."""
    if isinstance(g, PerGroup):
        return scale.unsqueeze(-1)
    if isinstance(g, PerBlock):
        return scale.unsqueeze(1).unsqueeze(3)
    return scale


E8M0_BIAS = 127
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127  # u = 0 .. 254; u = 255 is NaN


def e8m0_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The E8M0 scale 2^k of a group: the smallest power of two with amax / 2^k <= fmt_max, so no
    element of the group clips (k = ceil(log2(amax / fmt_max)), computed from the float32 bits,
    exactly).

    For E4M3 (max 448 = 1.75 * 2^8) and amax = m * 2^e (1 <= m < 2): k = e - 8, or e - 7 when m >
    1.75. The OCP MX v1.0 reference takes k = e - 8 always and clamps elements in (448, 512) * 2^k
    to 448; compressed-tensors' generate_mx_scales takes e - 7 from m >= 1.75 (so it differs from
    this rule only when amax is exactly 448 * 2^j). vLLM 0.32's MXFP8 input quantization computes
    ceil(log2(amax / 448)) in float32 (utils/mxfp8_utils.py): where amax is a few ulps above 448 *
    2^j the division rounds down to 448 * 2^j, it takes k one lower and clamps the group's largest
    element (448.0009 -> 448): dynamic inputs only, weights are read from the checkpoint's bytes. A
    zero group gets 2^0. k is clamped to E8M0's range [-127, 127]."""
    amax = amax.float()
    bits = amax.view(torch.int32)
    # float32 subnormals (and zero) read as -127: clamped below anyway
    exponent = (bits >> 23) - 127
    mantissa = bits & 0x7FFFFF
    # fmt_max = 1.m_max * 2^e_max; the group fits 2^(e - e_max) exactly when its mantissa is <=
    # m_max's (read from fmt_max's float32 bits in Python: constants of a compiled graph, not
    # tensors)
    max_bits = struct.unpack("<I", struct.pack("<f", fmt_max))[0]
    e_max, m_max = (max_bits >> 23) - 127, max_bits & 0x7FFFFF
    k = exponent - e_max + (mantissa > m_max).to(torch.int32)
    k = torch.where(amax > 0, k, 0).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    # from the bits: exp2 is approximate on some devices (Triton's ex2.approx flushes 2^-127, a
    # subnormal, to 0)
    return exact_exp2(k.to(torch.int32))


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales as E8M0 bytes (uint8, u = log2(scale) + 127), as MX checkpoints
    store them."""
    exponent = (scale.float().view(torch.int32) >> 23) - 127
    return (exponent + E8M0_BIAS).to(torch.uint8)
