"""Number formats and the pure tensor functions that quantize to them.

One table of constants (FORMATS) and a handful of functions over torch tensors:

    amax -> compute_scale -> quantize (grid values) -> to_storage (fp8/int8/bf16 tensor)
                             fake_quantize = dequantize(quantize(...))
                             (simulation in forward passes)

Everything is computed in float32 and is vectorised, so it runs the same on CPU and CUDA. Rounding
is done arithmetically (round to nearest, ties to even) rather than by torch's dtype casts, whose
overflow behaviour differs between versions and devices (torch 2.13 CPU saturates inf -> 448 when
casting to float8_e4m3fn; older versions return NaN). One exception, the hot one: saturating E4M3
clamps to +-448 first, so that nothing can overflow, and then casts (eager ops, GPUs) or, in a fused
CPU loop, rounds by Veltkamp's split (_split_round), which Inductor vectorises where it does not the
cast.

int8 convention: symmetric, scale = amax / 127, codes in [-127, 127] (the NVIDIA ModelOpt
convention). `lowest=-128` widens the clamp to the full int8 range, as the activation kernels of
vLLM and compressed-tensors saturate (ptq.quantization.engines, rule 3); weights never use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptq.errors import PtqError
from ptq.numerics import kernels


@dataclass(frozen=True)
class NumberFormat:
    name: str  # "e4m3", "e5m2", "int8", "bf16", "fp16"
    kind: str  # "float" or "int"
    exponent_bits: int  # 0 for int8
    mantissa_bits: int  # stored fraction bits; 7 magnitude bits for int8
    bias: int  # exponent bias (0 for int8)
    max: float  # largest finite magnitude
    min_normal: float  # smallest normal magnitude (1.0 for int8, which has no subnormals)
    has_inf: bool  # whether overflow can be represented as +-inf
    torch_dtype: torch.dtype  # storage dtype
    scaled: bool  # 8-bit formats need a per-tensor/per-channel scale; 16-bit ones use none
    bits: int  # 8 or 16


FORMATS: dict[str, NumberFormat] = {
    # OCP / NVIDIA "e4m3fn": no infinities, a single NaN code (S.1111.111), so max is 1.110 * 2^8.
    "e4m3": NumberFormat(
        "e4m3", "float", 4, 3, 7, 448.0, 2.0**-6, False, torch.float8_e4m3fn, True, 8
    ),
    # IEEE-like: S.11111.00 is inf, so max is 1.11 * 2^15.
    "e5m2": NumberFormat(
        "e5m2", "float", 5, 2, 15, 57344.0, 2.0**-14, True, torch.float8_e5m2, True, 8
    ),
    "int8": NumberFormat("int8", "int", 0, 7, 0, 127.0, 1.0, False, torch.int8, True, 8),
    "bf16": NumberFormat(
        "bf16",
        "float",
        8,
        7,
        127,
        (2.0 - 2.0**-7) * 2.0**127,
        2.0**-126,
        True,
        torch.bfloat16,
        False,
        16,
    ),
    "fp16": NumberFormat(
        "fp16", "float", 5, 10, 15, 65504.0, 2.0**-14, True, torch.float16, False, 16
    ),
}

_ALIASES = {
    "fp8-e4m3": "e4m3",
    "float8_e4m3fn": "e4m3",
    "fp8-e5m2": "e5m2",
    "float8_e5m2": "e5m2",
    "bfloat16": "bf16",
    "float16": "fp16",
}


def get_format(name: str) -> NumberFormat:
    """The format called `name` (case-insensitive; aliases such as "fp8-e4m3" or "bfloat16"
    accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        known = ", ".join([*FORMATS, *_ALIASES])
        raise PtqError(f"unknown number format '{name}' (known: {known})")
    return FORMATS[key]


def exact_exp2(k: torch.Tensor) -> torch.Tensor:
    """2.0**k as float32 for an int32 tensor k in [-149, 127], built from the bit pattern.

    torch.exp2 / torch.pow are not guaranteed exact on every device, and the bf16 quantum
    in its subnormal range (2**-133) is itself a float32 subnormal, so build both cases by hand.
    """
    normal = ((k + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(k) << (k + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(k >= -126, normal, subnormal)


def _to_float32(x: torch.Tensor) -> torch.Tensor:
    """x as float32, from which rounding to any format of ptq is that of x itself. Every dtype but
    float64 converts exactly. A float64 is rounded to odd (toward zero, the last bit set where bits
    were dropped): rounding it on to a format of 22 significant bits or fewer then equals rounding
    the float64 once, where rounding to nearest twice can make a tie that x is not on (1.0625 +
    2^-40 rounds to 1.0625 in float32, then to the even 1.0 in E4M3; it is nearer 1.125)."""
    if x.dtype != torch.float64:
        return x.float()
    y = x.float()
    bits = y.view(torch.int32)
    # rounded away from zero: one ulp back
    bits = torch.where(y.double().abs() > x.abs(), bits - 1, bits)
    return torch.where(y.double() != x, bits | 1, bits).view(torch.float32)  # NaN: stays NaN


def _split_round(x: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """x (float32, |x| <= fmt.max) rounded to nearest even on fmt's grid, by float arithmetic alone.

    Normal range: Veltkamp's split, c = x * (2^(24 - p) + 1) and c - (c - x), rounds x to p =
    mantissa_bits + 1 significant bits (exact in binary32 arithmetic that rounds each operation to
    nearest even and fuses none: Inductor's CPU flags, -ffp-contract=off). Below min_normal the grid
    is fixed-point, with the subnormal quantum.
    """
    c = x * float(2 ** (23 - fmt.mantissa_bits) + 1)
    normal = c - (c - x)
    quantum = fmt.min_normal * 2.0**-fmt.mantissa_bits  # a power of two: the products are exact
    subnormal = torch.round(x * (1 / quantum)) * quantum
    return torch.where(x.abs() < fmt.min_normal, subnormal, normal)


def round_to_format(
    x: torch.Tensor,
    fmt: NumberFormat,
    saturate: bool = True,
    flush_subnormals: bool = False,
    lowest: float | None = None,
) -> torch.Tensor:
    """Round x to the nearest value of `fmt` (ties to even); returns float32 values on fmt's grid.

    Overflow (a *rounded* magnitude above fmt.max): saturate=True gives +-fmt.max;
    saturate=False gives +-inf if the format has infinities, else NaN (E4M3).
    Infinite inputs stay infinite for formats that have inf (E5M2, bf16, fp16) in both modes;
    for E4M3 they saturate to +-max, or become NaN when not saturating. NaN stays NaN, and
    the sign of zero is kept.

    The 16-bit baseline should behave like an IEEE cast (overflow -> inf): pass saturate=False
    for bf16/fp16. flush_subnormals=True makes magnitudes below fmt.min_normal signed zero,
    as TPUs do for bf16.

    int8 rounds to integers and always clamps to [-127, 127], or [lowest, 127] (`saturate` and
    `flush_subnormals` do not apply: there is no inf and there are no subnormals); NaN stays NaN.
    Rounding first and clamping to integer bounds equals clamping first and rounding (vLLM's order).

    Any float dtype is rounded once, exactly: float64 too (see _to_float32).
    """
    x = _to_float32(x)
    if saturate and not flush_subnormals and fmt.torch_dtype == torch.float8_e4m3fn:
        # Every matmul input of an FP8 recipe comes here. Clamped to +-max first, nothing can
        # overflow (where the cast differs between versions); NaN stays NaN, and +-inf saturates as
        # below. Within +-max both ways round to nearest even, bit for bit the arithmetic below
        # (checked against ml_dtypes for every float32 in [-480, 480], eager and compiled): the cast
        # in eager ops and on GPUs (which convert in hardware), the split in a fused CPU loop, where
        # Inductor vectorises float arithmetic on every x86 CPU but the float8 conversion only with
        # AVX-512 (without it the split is about twice as fast).
        x = x.clamp(-fmt.max, fmt.max)
        if (
            x.device.type == "cpu"
            and torch.compiler.is_compiling()
            and kernels.strict_cpu_arithmetic
        ):
            return _split_round(x, fmt)
        return x.to(fmt.torch_dtype).float()
    if fmt.kind == "int":
        return torch.round(x).clamp(-fmt.max if lowest is None else lowest, fmt.max)

    a = x.abs()
    if flush_subnormals:
        # Flushing the input is enough: an input >= min_normal cannot round below it
        # (min_normal is on the grid and rounding is monotonic), so no output is subnormal.
        a = torch.where(a < fmt.min_normal, 0.0, a)

    # Unbiased exponent straight from the float32 bits, clamped up to the format's smallest
    # normal exponent so that values in the subnormal range share its fixed quantum (zero and
    # float32 subnormals have biased exponent 0 and clamp up too). The upper clamp only
    # matters for inf/NaN, which are dealt with below.
    e = ((a.view(torch.int32) >> 23) - 127).clamp(1 - fmt.bias, 127)
    quantum = exact_exp2(e - fmt.mantissa_bits)
    # Dividing and multiplying by a power of two is exact; torch.round is half-to-even.
    # A magnitude that rounds past float32's max becomes inf here, not NaN: it is an overflow.
    r = torch.round(a / quantum) * quantum

    # Round first, then handle overflow (the ONNX Cast order); NaN compares False and stays NaN.
    overflow = r > fmt.max
    if saturate:
        r = torch.where(overflow, fmt.max, r)
        if fmt.has_inf:
            r = torch.where(torch.isinf(a), a, r)  # an infinite input is not an overflow
    else:
        r = torch.where(overflow, float("inf") if fmt.has_inf else float("nan"), r)
    return torch.copysign(r, x)


def compute_scale(amax: torch.Tensor | float, fmt: NumberFormat) -> torch.Tensor:
    """Scale that maps amax onto fmt.max: amax / fmt.max in float32 (scalar or per-channel).

    Where that is zero or subnormal, usable_scale's rule. 16-bit formats are not scaled: all ones.
    Raises ValueError for negative or non-finite amax (callers validate user data first).
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"amax must be finite and non-negative, got {amax}")
    if not fmt.scaled:
        return torch.ones_like(amax)
    return usable_scale(amax / fmt.max)


def usable_scale(scale: torch.Tensor) -> torch.Tensor:
    """amax / max made a scale every consumer can use. Zero (an all-zero tensor or token, or an amax
    so small that the division underflows): 1, since any scale represents zeros and a zero scale
    would divide by zero. Below the smallest normal float32, 2^-126 (amax under 448 * 2^-126 for
    E4M3): the reciprocal of a subnormal scale of 2^-128 or less is inf, and engines that multiply
    by it (vLLM, static FP8 inputs) would turn a 0 into NaN; one floor for every subnormal (whose
    division flushes to zero on some hardware besides), and 2^-126 still fits the amax."""
    return torch.where(scale > 0, scale.clamp(min=torch.finfo(torch.float32).tiny), 1.0)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fmt: NumberFormat,
    saturate: bool = True,
    lowest: float | None = None,
    reciprocal: bool = False,
) -> torch.Tensor:
    """x / scale rounded to fmt's grid, as float32 values (the codes' values); `lowest`: see
    round_to_format. reciprocal=True: x times the float32 reciprocal of the scale instead, as vLLM's
    FP8 kernels scale a static input (ptq.quantization.engines, rule 5); the two differ where x /
    scale is within an ulp of a tie.

    scale broadcasts: a scalar, or shape [out_features, 1] for per-channel weights.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    # 1 / scale as a division of two float32 tensors, not scale.reciprocal(): the same value in
    # eager ops, but Inductor up to torch 2.11 lowers reciprocal to Triton's approximate division
    # even with kernels.EAGER_NUMERICS (pytorch#174751), and a compiled CUDA kernel then rounds one
    # code off next to a tie
    scaled = x.float() * (torch.ones_like(scale) / scale) if reciprocal else x.float() / scale
    return round_to_format(scaled, fmt, saturate, lowest=lowest)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q * scale in float32; q may be grid values or a storage tensor (cast exactly). `dtype`: the
    product then rounded to it (the compute dtype), in the same loop when fused."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * scale).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fmt: NumberFormat,
    saturate: bool = True,
    lowest: float | None = None,
) -> torch.Tensor:
    """Simulated quantization for forward passes: dequantize(quantize(x, scale, fmt), scale)."""
    return dequantize(quantize(x, scale, fmt, saturate, lowest), scale)


def to_storage(q: torch.Tensor, fmt: NumberFormat, lowest: float | None = None) -> torch.Tensor:
    """Grid values (output of quantize / round_to_format) -> a fmt.torch_dtype tensor.

    The cast is exact because the values are already representable; values not on the grid
    are a programming error and are not checked for float formats. For int8, NaN, fractional
    or out-of-range values raise ValueError (torch would cast them silently); `lowest` as quantize's
    (-128: the loaders' full int8 range).
    """
    low = -fmt.max if lowest is None else lowest
    # NaN fails every comparison, so this one check also catches it.
    if fmt.kind == "int" and not bool(((q == torch.round(q)) & (q >= low) & (q <= fmt.max)).all()):
        raise ValueError(f"int8 codes must be integers in [{low:g}, {fmt.max:g}], without NaN")
    return q.to(fmt.torch_dtype)


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in float32: a 0-d tensor, or per row along `dim` with keepdim
    (dim=1 on a Linear weight [out, in] gives [out, 1], the per-output-channel shape).

    NaN propagates. Uses aminmax rather than abs().amax() to avoid a full-size temporary.
    Raises ValueError for an empty tensor (there is no amax to calibrate from).
    """
    if x.numel() == 0:
        raise ValueError("amax of an empty tensor")
    if dim is None:
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
    # max(-lo, hi) is never negative except -0.0 for an all-zero tensor: abs makes it +0.0.
    return torch.maximum(-lo, hi).abs().float()
