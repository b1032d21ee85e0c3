"""Simulated quantization: `quantize_(model, recipe, clips)` swaps every Linear for a QuantLinear
(ptq.calibration.clips.quantize_ takes the clips from a calibration).

A QuantLinear holds its weight already quantized (done once, not per forward), as codes in the
format's storage dtype (float8_e4m3fn, float8_e5m2, int8, bfloat16: one byte per weight for the
8-bit formats) and a scale; it dequantizes them on each forward (one fused cast-and-multiply, under
1% of the matmul on CPU), rounds its input to the recipe's format (static per-tensor scale from
calibration, or one scale per token computed on the fly), and multiplies in float32. A product of
two 8- or 16-bit values is exact in float32, but the simulation multiplies the dequantized operands,
code x scale, and that product is itself rounded to float32 (for most inputs: a scale is rarely a
power of two), where FP8 hardware multiplies the codes and applies the scales after accumulating: so
it simulates fp32-accumulating FP8/int8/bf16 hardware up to summation order and one float32 rounding
of each dequantized operand (relative 3e-7 of the output's max on a 576-wide layer, as
torch._scaled_mm on a CPU). With `attention` (or `kv_cache`) in the recipe, attention's
batched-matmul inputs are rounded too (ptq/quantization/attention.py). SmoothQuant divides each
input channel by s and multiplies the weight's column by s (ModelOpt's per-layer pre-quant scale,
foldable into the preceding norm or layer).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ptq.errors import PtqError
from ptq.models.matmuls import kind, quantizable
from ptq.numerics import granularity as gr
from ptq.numerics.formats import (
    FORMATS,
    NumberFormat,
    amax,
    compute_scale,
    dequantize,
    quantize,
    round_to_format,
    usable_scale,
)
from ptq.numerics.kernels import FALLBACKS, fused  # noqa: F401  (fused is used by the modules that import it from here)
from ptq.quantization import attention, engines, residual
from ptq.quantization.attention import AttentionQuant
from ptq.quantization.plan import Plan, resolve_plan
from ptq.quantization.recipes import Recipe, TensorQuant


def scale_for(clip: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """The scale that maps `clip` (a calibrated or observed amax, per tensor or per group) onto the
    format's max, per the spec's scale mode: amax / max as float32; rounded up to a power of two
    ("pow2": a per-tensor exponent bias, so the clip never overflows); E8M0 (the MX power of two,
    granularity.e8m0_scale); or 1 ("unscaled": a plain cast). 16-bit formats: 1."""
    if spec.scale == "unscaled" or not spec.format.scaled:
        return torch.ones_like(torch.as_tensor(clip, dtype=torch.float32))
    if spec.scale_format == "e8m0":
        return gr.e8m0_scale(torch.as_tensor(clip, dtype=torch.float32), spec.format.max)
    scale = compute_scale(clip, spec.format)
    return pow2_at_least(scale) if spec.scale == "pow2" else scale


def pow2_at_least(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= scale (positive normal float32; inf and NaN stay), from its
    bits: exp2(ceil(log2)) rounds down where log2 of a scale a few ulps above 2^j rounds to j, and
    the clip then overflows."""
    bits = scale.view(torch.int32)
    next_power = (((bits >> 23) + 1) << 23).view(torch.float32)
    return torch.where(((bits & 0x7FFFFF) != 0) & torch.isfinite(scale), next_power, scale)


def dynamic_scale(x: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """Dynamic scales from the activation itself, shaped to broadcast over its grouped view
    (granularity.grouped): one per tensor ([]), per token (row of the last dimension: [..., 1]) or
    per group of that row."""
    x_amax = gr.amax_of(gr.grouped(x, spec.granularity), spec.granularity)
    if spec.scale_format == "e8m0":
        return gr.e8m0_scale(x_amax, spec.format.max)
    scale = x_amax / spec.format.max
    if (
        spec.min_scale
    ):  # the engine's floor (ptq.quantization.engines, rule 4); an all-zero token gets it too
        scale = scale.clamp(min=spec.min_scale)
    else:
        scale = usable_scale(scale)  # an all-zero token: 1, any scale represents it
    return pow2_at_least(scale) if spec.scale == "pow2" else scale


def _round_activation(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: NumberFormat,
    saturate: bool,
    lowest: float | None,
    g: gr.Granularity,
    codes: bool,
    reciprocal: bool = False,
) -> torch.Tensor:
    """x / scale rounded to the format (scale broadcasts over x's grouped view), as float32 values
    on the grid times the scale (the simulation), or as storage codes (what a real FP8 matmul takes;
    the storage cast keeps grid values exactly: tests check it against formats.to_storage).
    reciprocal: x * (1 / scale), formats.quantize."""
    q = quantize(gr.grouped(x, g), scale, fmt, saturate, lowest, reciprocal)
    return gr.ungrouped(q.to(fmt.torch_dtype) if codes else dequantize(q, scale), g, x.shape)


def _round_dynamic(
    x: torch.Tensor, spec: TensorQuant, codes: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded with dynamic scales taken from x itself (dynamic_scale), and the scales: one
    function, so that its fused kernel reads each row (token or group) once for its maximum and its
    rounding, without a temporary |x|."""
    if spec.reciprocal and spec.format.kind == "int":
        # vLLM's dynamic int8 kernel multiplies by max / amax, which is not always the float32
        # reciprocal of the scale amax / max: next to a tie the two round to neighbouring codes
        # (ptq.quantization.engines, rule 3). Its scale is amax / max unfloored; below amax 127 /
        # FLT_MAX the multiplier is inf, every nonzero element saturates, and a zero (0 * inf: NaN)
        # converts to code 0, as every zero does.
        g = spec.granularity
        view = gr.grouped(x, g)
        x_amax = gr.amax_of(view, g).float()
        scale = torch.where(x_amax > 0, x_amax / spec.format.max, 1.0)
        # max / amax in one rounding, as the kernel's 127.0f / amax: Python's `127.0 / tensor` is
        # tensor.reciprocal() * 127, two roundings, a different multiplier for a quarter of the
        # amaxes
        multiplier = torch.full_like(x_amax, spec.format.max) / x_amax
        scaled = view.float() * torch.where(x_amax > 0, multiplier, 0.0)
        q = round_to_format(torch.where(view == 0, 0.0, scaled), spec.format)
        return gr.ungrouped(
            q.to(spec.format.torch_dtype) if codes else dequantize(q, scale), g, x.shape
        ), scale
    scale = dynamic_scale(x, spec)
    q = _round_activation(
        x, scale, spec.format, spec.saturate, spec.lowest, spec.granularity, codes, spec.reciprocal
    )
    return q, scale


# one kernel per (format, saturate, range, granularity, codes); the dynamic one per (spec, codes)
_activation_rounding = fused(_round_activation)
_dynamic_rounding = fused(_round_dynamic)


def quantize_activation(
    x: torch.Tensor, spec: TensorQuant, scale: torch.Tensor | None = None, codes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one activation rounding, for every granularity: (x rounded as `spec` says, the scale it
    took). `scale`: a static scale (per tensor, per head, or one per row: an expert's); None:
    dynamic, from x itself."""
    return ActivationQuantizer.round(
        (_activation_rounding, _dynamic_rounding), x, spec, scale, codes
    )


class ActivationQuantizer:
    """quantize_activation for every QuantLinear of one model, with one addition: an input shared by
    several Linears (q/k/v, gate/up) and quantized alike is rounded once. The last input is held (so
    its memory cannot be reused) and matched by identity and version."""

    def __init__(self, compile: bool | None = None):
        # compile=None: the process's shared kernels (PTQ_COMPILE decides); False / True: kernels of
        # its own
        self._kernels = (
            (_activation_rounding, _dynamic_rounding)
            if compile is None
            else (fused(_round_activation, compile), fused(_round_dynamic, compile))
        )
        self._last: tuple | None = None

    @staticmethod
    def round(
        kernels, x, spec: TensorQuant, scale, codes: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not spec.format.scaled and x.dtype == spec.format.torch_dtype and not codes:
            # a 16-bit input already in its format (bf16 compute: the baseline, the layers a recipe
            # leaves out) rounds to itself, inf and NaN included (tests/test_formats.py, every bf16
            # bit pattern): no pass over it
            return x, scale
        static, dynamic = kernels
        if scale is None:
            return dynamic(x, spec, codes)
        return static(
            x,
            scale,
            spec.format,
            spec.saturate,
            spec.lowest,
            spec.granularity,
            codes,
            spec.reciprocal,
        ), scale

    def __call__(
        self,
        x: torch.Tensor,
        spec: TensorQuant,
        scale: torch.Tensor | None = None,
        codes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Inference tensors keep no version counter; between the Linears that share an input no
        # module writes to it in place (they would corrupt the unquantized model's math too).
        version = None if x.is_inference() else x._version
        last = self._last
        if (
            last is not None
            and last[0] is x
            and last[1] == version
            and last[2] is scale
            and last[3] == (spec, codes)
        ):
            return last[4]
        out = self.round(self._kernels, x, spec, scale, codes)
        self._last = (x, version, scale, (spec, codes), out)
        return out


class ActQuant(nn.Module):
    """Fake-quantizes an activation other than a matmul input (attention's, the KV cache's, a
    residual's): with a static scale from calibration (per tensor or per head), or dynamic
    scales."""

    def __init__(self, spec: TensorQuant, clip: torch.Tensor | None):
        super().__init__()
        self.spec = spec
        if spec.static and clip is None:
            raise ValueError("a static activation scale needs a calibrated clip")
        scale = scale_for(clip, spec) if spec.static else scale_for(torch.ones(()), spec)
        if isinstance(spec.granularity, gr.PerHead):  # one per head of [batch, heads, tokens, dim]
            scale = scale.reshape(1, -1, 1, 1)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_activation(x, self.spec, None if self.spec.dynamic else self.scale)[0].to(
            x.dtype
        )

    def extra_repr(self) -> str:
        return self.spec.describe()


class QuantLinear(nn.Module):
    # False: weights only (what transformers computes for fused experts; ptq.export.checkpoint)
    round_inputs = True
    quantized_matmul = True  # ptq.models.matmuls.QUANTIZED: a matmul already quantized

    @staticmethod
    def grouped_experts(experts, layers: dict[str, list]):
        """ptq.models.matmuls.GROUPING: how a LinearExperts whose layers are QuantLinears runs
        grouped."""
        return grouped_experts(experts, layers)

    def __init__(
        self,
        linear: nn.Linear,
        weights: TensorQuant,
        inputs: TensorQuant,
        input_amax: torch.Tensor | None,
        input_quantizer: ActivationQuantizer | None = None,
        smooth: torch.Tensor | None = None,
        weight_cache: dict | None = None,
        fp8: bool = False,
        name: str = "?",
        weight_amax: torch.Tensor | None = None,
    ):
        super().__init__()
        self.input_quantizer = input_quantizer or ActivationQuantizer(compile=False)
        # True: this layer multiplies real FP8 codes with torch._scaled_mm (asked for, and see
        # fp8_matmul_applies)
        self.fp8_matmul = fp8 and fp8_matmul_applies(linear, weights, inputs, smooth)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weights, self.inputs = weights, inputs
        w = linear.weight.detach()
        if smooth is not None:  # SmoothQuant: x / s times W * s is the same product, with easier x
            smooth = smooth.to(w.device)
        self.register_buffer("smooth", smooth)
        # Variants of one model quantize many weights the same way (layers a recipe leaves out run
        # as the baseline): one copy of the codes serves them all. weight_amax: the amax its scale
        # comes from when not its own (a fused group's: ptq.quantization.engines)
        key = (
            (id(linear.weight), weights, None if weight_amax is None else float(weight_amax))
            if smooth is None
            else None
        )
        if weight_cache is not None and key in weight_cache:
            codes, weight_scale = weight_cache[key][1:]
        else:
            codes, weight_scale = quantize_weight(
                w.float() * smooth if smooth is not None else w, weights, name, weight_amax
            )
            if weight_cache is not None and key is not None:
                weight_cache[key] = (
                    linear.weight,
                    codes,
                    weight_scale,
                )  # the weight is held so its id stays unique
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = linear.bias
        if inputs.static and input_amax is None:
            raise ValueError("a scaled input format needs a calibrated input amax")
        scale = scale_for(
            input_amax.to(w.device) if inputs.static else torch.ones((), device=w.device), inputs
        )
        self.register_buffer("input_scale", scale)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input the rounding sees, after SmoothQuant's division; its rounded values in
        float32)."""
        if self.smooth is not None:
            x = x / self.smooth
        if not self.round_inputs:
            return x, x
        return x, self.input_quantizer(
            x, self.inputs, None if self.inputs.dynamic else self.input_scale
        )[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_matmul:
            return self.fp8_forward(x)
        dtype = x.dtype  # the compute dtype: SmoothQuant's x / s (a float32 s) is float32
        x_q = self.quantize_input(x)[1]
        return simulated_linear(
            x_q.to(dtype), self.weight_codes, self.weight_scale, self.weights, self.bias
        )

    def fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same product as the simulation, by a real FP8 matmul: torch._scaled_mm multiplies the
        input's and the weight's float8 codes, accumulates in float32 and applies both scales (per
        tensor, or per row: per token and per output channel; or 1 x 128 input groups and 128 x 128
        weight blocks), with the output in the compute dtype."""
        codes, scale_x = self.input_quantizer(
            x, self.inputs, None if self.inputs.dynamic else self.input_scale, True
        )
        codes = codes.reshape(-1, self.in_features)
        rows, scale_w = len(codes), self.weight_scale
        blockwise = isinstance(self.weights.granularity, gr.PerBlock)
        tensorwise_only = not codes.is_cuda and cpu_scaled_mm_tensorwise_only()
        if blockwise:
            scale_x = scale_x.reshape(rows, -1)  # [rows, in / 128]
        elif scale_x.dim() or scale_w.dim() or not (codes.is_cuda or tensorwise_only):
            # row-wise scaling needs both scales row-wise; on CPUs torch's tensor-wise path is a
            # slow reference loop (70x the row-wise one here), so per-tensor scales go row-wise
            # there too: the same product
            scale_x = scale_x.reshape(-1, 1).expand(rows, 1).contiguous()
            scale_w = scale_w.reshape(1, -1).expand(1, self.out_features).contiguous()
        pad = -rows % 16 if codes.is_cuda else 0  # cuBLAS wants each dimension a multiple of 16
        if pad:
            codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad)).view(codes.dtype)
            scale_x = F.pad(scale_x, (0, 0, 0, pad), value=1.0) if scale_x.dim() else scale_x
        if blockwise:
            y = _blockwise_mm(codes, self.weight_codes, scale_x, scale_w, x.dtype)
            y = y if self.bias is None else y + self.bias
        elif scale_x.dim() and (
            tensorwise_only
            or (x.dtype == torch.float32 and rowwise_float32_unavailable(codes.device))
        ):
            # the product with unit scales, then both scales (and the bias) in float32, as the
            # row-wise kernel's epilogue applies them, rounded once to the compute dtype
            one = torch.ones((), device=codes.device)
            y = torch._scaled_mm(
                codes, self.weight_codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            )
            y = y * scale_w * scale_x
            y = (y if self.bias is None else y + self.bias).to(x.dtype)
        else:
            # cuBLAS takes no bias with a float32 output ("Bias is not supported when out_dtype is
            # set to Float32")
            fused_bias = self.bias if x.dtype != torch.float32 else None
            y = torch._scaled_mm(
                codes,
                self.weight_codes.t(),
                scale_a=scale_x,
                scale_b=scale_w,
                bias=fused_bias,
                out_dtype=x.dtype,
            )
            if fused_bias is None and self.bias is not None:
                y = y + self.bias
        return y[:rows].reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32), made from the codes on each call by one fused loop
        (formats.dequantize: codes * scale, in float32). The forward makes it in the compute dtype
        directly: on a GPU in bf16, one loop writing 2 bytes a weight rather than 4 and another
        cast."""
        return dequantize_weight(self.weight_codes, self.weight_scale, self.weights)

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, weights={self.weights.describe()}, "
            f"inputs={self.inputs.describe()}"
        )


def quantize_weight(
    w: torch.Tensor, weights: TensorQuant, layer: str = "?", shared_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight's codes in the format's storage dtype (formats.FORMATS: float8_e4m3fn, int8,
    ...) and its scale as checkpoints store it ([], [out, 1], [out, in/G] or [ceil(out/R),
    ceil(in/C)]; granularity.stored), rounded and stored by one fused loop. The one code path for
    weights: the simulation dequantizes these codes, `ptq quantize` writes them."""
    w = w.detach().float()
    g = weights.granularity
    if isinstance(
        g, (gr.PerTensor, gr.PerChannel)
    ):  # aminmax: no full-size temporary of a large weight
        weight_amax = amax(w, dim=1) if isinstance(g, gr.PerChannel) else amax(w)
    else:
        weight_amax = gr.amax_of(gr.grouped(w, g), g)
    if shared_amax is not None:  # per tensor only (ptq.quantization.engines)
        weight_amax = torch.as_tensor(shared_amax, dtype=torch.float32, device=w.device).reshape(
            weight_amax.shape
        )
    if not bool(torch.isfinite(weight_amax).all()):  # a cast to int8 would turn NaN into a number
        raise PtqError(
            f"the weight of layer '{layer}' contains NaN or inf: the checkpoint is damaged"
        )
    scale = scale_for(weight_amax, weights)
    if isinstance(g, (gr.PerTensor, gr.PerChannel)):
        return _weight_rounding(w, scale, weights.format, weights.saturate), scale
    codes = _grouped_codes(w, scale, weights.format, weights.saturate, g)
    return codes, gr.stored(scale, g)


def is_its_own_weight(codes: torch.Tensor, weights: TensorQuant, dtype: torch.dtype) -> bool:
    """A 16-bit weight whose codes are already in the compute dtype: dequantize_weight returns the
    codes themselves."""
    return codes.dtype == dtype and not weights.format.scaled


def dequantize_weight(
    codes: torch.Tensor,
    scale: torch.Tensor,
    weights: TensorQuant,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """codes * scale (the stored scale of quantize_weight), in `dtype`, by one fused loop. A 16-bit
    weight whose codes are already in `dtype` (bf16 compute: the baseline, the layers a recipe
    leaves out) is its codes: its scale is 1, and no copy of it is made per forward."""
    if is_its_own_weight(codes, weights, dtype):
        return codes
    g = weights.granularity
    if isinstance(g, (gr.PerTensor, gr.PerChannel)):
        return _weight_dequantize(codes, scale, dtype)
    return _grouped_dequantize(codes, gr.broadcastable(scale, g), g, dtype)


# The simulation makes a weight from its codes in the compute dtype on each forward. One whose copy
# would be larger than this (a vocabulary-sized lm_head in float32 on a CPU, a large model's MLP) is
# made and multiplied a block of output rows at a time, each block's product written into the
# output, so that the forward's transient is one block rather than a second copy of the largest
# layer.
WEIGHT_BLOCK_BYTES = 64 * 2**20


def simulated_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    weights: TensorQuant,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """F.linear(x, dequantize_weight(codes, scale, weights, x.dtype), bias), in blocks of output
    rows where the dequantized weight would exceed WEIGHT_BLOCK_BYTES (without autograd: the blocks
    write into the output)."""
    out_features, in_features = codes.shape
    g = weights.granularity
    align = (
        math.lcm(128, g.rows) if isinstance(g, gr.PerBlock) else 128
    )  # blocks of rows start on a weight block
    rows = max(align, WEIGHT_BLOCK_BYTES // (in_features * x.element_size()) // align * align)
    if (
        is_its_own_weight(codes, weights, x.dtype)  # no copy made
        or out_features <= rows
        or torch.is_grad_enabled()
        or not isinstance(g, (gr.PerTensor, gr.PerChannel, gr.PerGroup, gr.PerBlock))
    ):
        return F.linear(x, dequantize_weight(codes, scale, weights, x.dtype), bias)
    flat = x.reshape(-1, in_features)
    y = torch.empty(len(flat), out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        w = dequantize_weight(
            codes[start:stop], _scale_rows(scale, g, start, stop), weights, x.dtype
        )
        if bias is None:
            torch.mm(flat, w.t(), out=y[:, start:stop])
        else:
            torch.addmm(bias[start:stop], flat, w.t(), out=y[:, start:stop])
    return y.reshape(*x.shape[:-1], out_features)


def _scale_rows(scale: torch.Tensor, g: gr.Granularity, start: int, stop: int) -> torch.Tensor:
    """The stored scale (granularity.stored) of a weight's rows start:stop (start on a block's first
    row)."""
    if isinstance(g, gr.PerTensor):
        return scale
    if isinstance(g, gr.PerBlock):
        return scale[start // g.rows : -(-stop // g.rows)]
    return scale[start:stop]  # per channel [out, 1], per group [out, in / G]


def _rounded_codes(
    w: torch.Tensor, scale: torch.Tensor, fmt: NumberFormat, saturate: bool
) -> torch.Tensor:
    # quantize gives values on the format's grid, which the storage cast keeps exactly (tests check
    # it against formats.to_storage)
    return quantize(w, scale, fmt, saturate).to(fmt.torch_dtype)


def _grouped_rounded_codes(
    w, scale, fmt: NumberFormat, saturate: bool, g: gr.Granularity
) -> torch.Tensor:
    return gr.ungrouped(_rounded_codes(gr.grouped(w, g), scale, fmt, saturate), g, w.shape)


def _grouped_dequantized(codes, scale, g: gr.Granularity, dtype: torch.dtype) -> torch.Tensor:
    return gr.ungrouped(dequantize(gr.grouped(codes.float(), g), scale, dtype), g, codes.shape)


_weight_rounding = fused(_rounded_codes)
_weight_dequantize = fused(dequantize)
_grouped_codes = fused(_grouped_rounded_codes)
_grouped_dequantize = fused(_grouped_dequantized)


MATMULS = ("simulated", "fp8", "auto")


def fp8_matmul_available(device: torch.device) -> bool:
    """Whether `device` multiplies float8 natively: CUDA compute capability 8.9 or higher (Ada,
    Hopper, Blackwell). torch._scaled_mm also runs on CPU, slower than the simulation, so "auto"
    leaves CPUs simulated."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def rowwise_float32_unavailable(device: torch.device) -> bool:
    """Whether torch._scaled_mm refuses a float32 output with row-wise scales on `device`: only
    cuBLAS's row-wise kernel writes float32, and torch calls it on Hopper (compute capability 9.x)
    with CUDA 12.9+; elsewhere (Ada, Blackwell, older CUDA) it runs CUTLASS's, which writes bf16 or
    fp16 ("Only bf16 and fp16 high precision output types are supported for row-wise scaling", torch
    2.11's ScaledBlas.cpp)."""
    if device.type != "cuda":
        return False
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] != 9 or cuda < (12, 9)


@functools.cache
def cpu_scaled_mm_tensorwise_only() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes per-tensor scales only (torch 2.11: "Now
    _scaled_mm only supports per-tensor scaling for CPU backend"; later ones take row-wise scales
    too). Tried once per process on a 16 x 16 product, through torch.ops so that a wrapper of
    torch._scaled_mm does not see the trial."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch.ops.aten._scaled_mm(
            a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32
        )
    except RuntimeError:  # torch's INTERNAL ASSERT is a RuntimeError
        return True
    return False


def resolve_matmul(matmul: str, device: torch.device) -> str:
    """ "simulated" or "fp8" for `matmul` ("simulated", "fp8", or "auto": fp8 where the device has
    it)."""
    if matmul not in MATMULS:
        raise PtqError(f"unknown matmul '{matmul}' (known: {', '.join(MATMULS)})")
    if matmul == "auto":
        return "fp8" if fp8_matmul_available(device) else "simulated"
    return matmul


def fp8_matmul_applies(
    linear: nn.Linear, weights: TensorQuant, inputs: TensorQuant, smooth
) -> bool:
    """A layer can run as a real FP8 matmul when its weight and its input are both in a scaled 8-bit
    float format (E4M3 or E5M2) with per-tensor or per-row scales (torch._scaled_mm's tensor-wise
    and row-wise scaling), or with 128 x 128 weight blocks and dynamic 1 x 128 input groups where
    torch multiplies those on the layer's device (blockwise_unavailable, tried apart for layers with
    partial blocks); MX groups (E8M0 scales) stay simulated, and so does an E5M2 input times E5M2
    weight (cuBLAS has no such product). Without SmoothQuant, and its dimensions multiples of 16
    (cuBLAS's rule)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if (
        weights.format.torch_dtype not in fp8
        or inputs.format.torch_dtype not in fp8
        or smooth is not None
    ):
        return False
    if weights.format.torch_dtype == inputs.format.torch_dtype == torch.float8_e5m2:
        return False  # cuBLAS: "Multiplication of two Float8_e5m2 matrices is not supported"
    if inputs.scale_format != "fp32" or weights.scale_format != "fp32":
        return False
    if linear.in_features % 16 or linear.out_features % 16:
        return False
    if isinstance(weights.granularity, gr.PerBlock):
        whole = linear.out_features % 128 == 0  # the plan takes whole blocks along the input only
        return (
            weights.granularity == gr.PerBlock(128, 128)
            and inputs.granularity == gr.PerGroup(128)
            and inputs.dynamic
            and blockwise_unavailable(linear.weight.device, linear.weight.dtype, whole) is None
        )
    return isinstance(weights.granularity, (gr.PerTensor, gr.PerChannel)) and isinstance(
        inputs.granularity, (gr.PerTensor, gr.PerToken)
    )


def _blockwise_mm(
    codes: torch.Tensor,
    weight_codes: torch.Tensor,
    scale_x: torch.Tensor,
    scale_w: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """FP8 codes [rows, in] with 1 x 128 group scales [rows, in / 128] times weight codes [out, in]
    with 128 x 128 block scales [out / 128, in / 128] (DeepSeek-V3's layout), by
    torch.nn.functional.scaled_mm. The scales' memory layouts are the ones torch checks for
    (aten/src/ATen/native/cuda/ScaledBlas.cpp, is_blockwise_1x128_scaling: the input's column-major;
    is_blockwise_128x128_scaling of the transposed second operand: the weight's row-major), with the
    weight's K blocks padded to a multiple of 4 (_scaled_block1x128_block128x128:
    [round_up(K / 128, 4), N / 128], strides (1, that); the padding is never read)."""
    return F.scaled_mm(
        codes,
        weight_codes.t(),
        scale_x.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        F.pad(scale_w, (0, -scale_w.shape[1] % 4), value=1.0).t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=dtype,
    )


_BLOCKWISE: dict[tuple[str, torch.dtype, bool], str | None] = {}


def blockwise_unavailable(
    device: torch.device, dtype: torch.dtype, whole_blocks: bool = True
) -> str | None:
    """None when torch multiplies 1 x 128-group inputs by 128 x 128-block weights on `device` with
    output in `dtype` (cuBLAS on Hopper with CUDA 12.9 or later); else why not, in one line. Tried
    once per device and dtype on a small product and compared with the simulation's, so that a
    kernel which accepts the scales but reads them otherwise is not used either;
    `whole_blocks=False` tries a weight whose last row of blocks is partial (192 outputs: the layers
    whose out_features is not a multiple of 128), which the kernel may read otherwise than the
    simulation."""
    key = (str(device), dtype, whole_blocks)
    if key not in _BLOCKWISE:
        g = torch.Generator().manual_seed(0)
        k, n = (256, 256) if whole_blocks else (256, 192)
        x, w = torch.randn(32, k, generator=g).to(device), torch.randn(n, k, generator=g).to(device)
        inputs = TensorQuant(FORMATS["e4m3"], gr.PerGroup(128), dynamic=True)
        weights = TensorQuant(FORMATS["e4m3"], gr.PerBlock(128, 128))
        codes, scale_x = quantize_activation(x, inputs, codes=True)
        weight_codes, scale_w = quantize_weight(w, weights)
        want = (
            quantize_activation(x, inputs)[0]
            @ dequantize_weight(weight_codes, scale_w, weights).t()
        )
        try:
            got = _blockwise_mm(
                codes, weight_codes, scale_x.reshape(32, -1), scale_w, dtype
            ).float()
            error = float((got - want).abs().max() / want.abs().max())
            _BLOCKWISE[key] = (
                None
                if error < 2e-2
                else f"torch's block-wise scaled_mm differs from the simulation by {error:.1e}"
            )
        except (
            Exception
        ) as e:  # the op's own refusal is the reason (no kernel for this device, version or dtype)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _BLOCKWISE[key] = (
                f"torch.nn.functional.scaled_mm on {device}: {type(e).__name__}: {first}"
            )
        if (
            not whole_blocks
            and _BLOCKWISE[key] is not None
            and blockwise_unavailable(device, dtype) is None
        ):
            _BLOCKWISE[key] = f"partial blocks: {_BLOCKWISE[key]}"
    return _BLOCKWISE[key]


@dataclasses.dataclass
class Clips:
    """What quantize_ takes from a calibration (ptq.calibration.clips.static_clips), as tensors,
    keyed as the plan keys what they clip: the clip of each static input, of a Linear (`matmuls`),
    of an attention layer's tensor (`attention`: layer -> {tensor: clip}; attention's key and the KV
    cache's share statistics, not always a clip) and of a decoder block's residual tensor
    (`residual`: block -> {tensor: clip}); and each SmoothQuant layer's per-channel input amax
    (`channel_amax`)."""

    matmuls: dict[str, torch.Tensor]
    attention: dict[str, dict[str, torch.Tensor]]
    residual: dict[str, dict[str, torch.Tensor]]
    channel_amax: dict[str, torch.Tensor]


def smoothing_factors(
    channel_amax: torch.Tensor, weight: torch.Tensor, alpha: float
) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j (Xiao et al.
    2022)."""
    w_amax = weight.detach().float().abs().amax(0).clamp(min=1e-5)
    return (channel_amax.float().clamp(min=1e-5).pow(alpha) / w_amax.pow(1 - alpha)).clamp(min=1e-5)


def quantize_(
    model: nn.Module,
    recipe: Recipe,
    clips: Clips | None,
    weight_cache: dict | None = None,
    matmul: str = "simulated",
    target: str = "transformers",
    plan: Plan | None = None,
) -> nn.Module:
    """Replace, in place, each Linear of `model` by the QuantLinear the plan of `recipe` asks for,
    and quantize attention's matmul inputs where the recipe covers them. `clips`: the static inputs'
    clips (None for a recipe without static inputs or SmoothQuant). `weight_cache` (see
    quantize_variants) lets several variants of one model share the weight codes they have in
    common. matmul="fp8" runs the layers whose weights and inputs are both FP8 as real FP8 matmuls
    (torch._scaled_mm); "auto" where the device has them (resolve_matmul). `target`
    (ptq.quantization.engines): "vllm" applies the scales and int8 rounding vLLM serves;
    "transformers" each layer's own scales and ptq's int8 convention. `plan`: the plan already
    resolved for this model, recipe and target (resolve_plan), so that it is resolved once per
    command."""
    matmul = resolve_matmul(matmul, next(model.parameters()).device)
    plan = plan or resolve_plan(model, recipe, target)
    if plan.target != target or plan.recipe.name != recipe.name:
        raise ValueError(
            f"a plan of '{plan.recipe.name}' for {plan.target} given to quantize '{recipe.name}' "
            f"for {target}"
        )
    smoothed = set(plan.smoothed)
    if (plan.calibrated or smoothed) and clips is None:
        raise PtqError(f"recipe '{recipe.name}' needs calibration (static input scales)")
    input_quantizer = ActivationQuantizer()
    scales: dict[
        tuple, torch.Tensor
    ] = {}  # Linears that share an input (same amax) share one scale tensor
    matmul_clips = clips.matmuls if clips is not None else {}
    smooths = {  # SmoothQuant's factors: the weights stored (and their amax) are W * s
        name: smoothing_factors(
            clips.channel_amax[name],
            model.get_submodule(name).weight,
            recipe.smoothquant,
        )
        for name in smoothed
    }

    def weight_amax(name: str) -> torch.Tensor:
        w = model.get_submodule(name).weight
        return amax(w.float() * smooths[name].to(w.device)) if name in smooths else amax(w)

    # the scales the target engine serves, for the groups the plan says share one
    # (ptq.quantization.engines)
    shared_weight_amax = engines.shared_amax(
        {n: e.weight_group for n, e in plan.matmuls.items() if e.weight_group}, weight_amax
    )
    shared_input_amax = engines.shared_amax(
        {n: e.input_group for n, e in plan.matmuls.items() if e.input_group},
        matmul_clips.__getitem__,
    )
    for name, entry in plan.matmuls.items():
        weights, inputs = entry.weights, entry.inputs
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        smooth = input_amax = None
        if name in smoothed:
            smooth = smooths[name]
            input_amax = (
                clips.channel_amax[name] / smooth
            ).max()  # the smoothed input's amax, exactly
        elif inputs.static:
            input_amax = shared_input_amax.get(name, matmul_clips.get(name))
        q = QuantLinear(
            linear,
            weights,
            inputs,
            input_amax,
            input_quantizer,
            smooth,
            weight_cache,
            matmul == "fp8",
            name,
            shared_weight_amax.get(name),
        )
        q.ptq_kind = kind(
            linear
        )  # Linear, Conv1D or Experts, as the layer it replaces (ptq.models.matmuls)
        if smooth is None:
            key = (inputs, float(q.input_scale), q.input_scale.device)
            q.input_scale = scales.setdefault(key, q.input_scale)
        setattr(parent, child, q)
    quantizers = {}
    for layer, tensors in plan.attention.items():
        made = {
            t: ActQuant(
                spec,
                clips.attention[layer][t] if spec.static else None,
            )
            for t, spec in tensors.items()
        }
        quantizers[layer] = AttentionQuant(
            {t: q for t, q in made.items() if not t.startswith("kv_cache.")},
            {t.removeprefix("kv_cache."): q for t, q in made.items() if t.startswith("kv_cache.")},
        )
    attention.install(model, quantizers)
    for block, tensors in plan.residual.items():
        made = nn.ModuleDict(
            {
                t: ActQuant(
                    spec,
                    clips.residual[block][t] if spec.static else None,
                )
                for t, spec in tensors.items()
            }
        )
        model.get_submodule(block).ptq_residual = made  # registered, so it moves with the model
        residual.install(model, {block: dict(made.items())})
    return model


def quantize_variants(
    model: nn.Module,
    recipes: list[Recipe],
    clips: dict[str, Clips | None] | None,
    matmul: str = "simulated",
    target: str = "transformers",
    plans: dict[str, Plan] | None = None,
) -> dict[str, nn.Module]:
    """One quantized variant of `model` per recipe, built to share memory: the variants share one
    copy of the tensors no recipe replaces (embeddings, norms, biases), and weights quantized the
    same way (the layers left in 16-bit) are stored once. `model` itself is left as it was, and no
    variant refers to its tensors: once the caller drops it, it is freed whole. `clips`: each
    recipe's clips (quantize_), by recipe name. `plans`: the recipes' plans for `model` and
    `target`, by recipe name (plan.resolve_plans), when the caller has resolved them already."""
    # Linear weights are replaced in every variant: referenced until then. Everything else is
    # copied, so that nothing of `model` stays referenced (its weights may be a memory map of the
    # checkpoint, which one remaining tensor would keep whole).
    kept = {
        id(t)
        for m in model.modules()
        if not quantizable(m)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }  # a tied lm_head's embedding too
    kept |= {id(m.bias) for m in model.modules() if quantizable(m) and m.bias is not None}

    def copy_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in kept:
            return t
        if isinstance(t, nn.Parameter):
            return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
        return t.clone()

    tensors = {id(t): copy_of(t) for t in (*model.parameters(), *model.buffers())}
    weight_cache: dict = {}
    return {
        r.name: quantize_(
            copy.deepcopy(model, memo=dict(tensors)),
            r,
            (clips or {}).get(r.name),
            weight_cache,
            matmul,
            target,
            (plans or {}).get(r.name),
        )
        for r in recipes
    }


class GroupedExperts:
    """One projection of a LinearExperts (gate and up together, as the fused module computes them;
    or down) for all experts at once: their QuantLinears' weight codes stacked [E, rows, in] (the
    QuantLinears keep views into them, so nothing is stored twice), weight scales [E, rows, 1] (per
    tensor or channel) or [E, rows, in / G] (per group: a row's scales travel with it; 128 x 128
    blocks: each row takes its block row's scales, so that gate and up rows, interleaved or not,
    stack as for groups of 128 along the input), input scales [E] and biases [E, rows]."""

    def __init__(self, layers: list[list[QuantLinear]], concatenated: bool):
        def stack(
            tensors: list[torch.Tensor],
        ) -> torch.Tensor:  # gate and up rows as the fused module lays them out
            if len(tensors) == 1:
                return tensors[0]
            return (
                torch.cat(tensors, dim=0)
                if concatenated
                else torch.stack(tensors, dim=1).flatten(0, 1)
            )

        first_group = layers[0]
        first = first_group[0]
        g = first.weights.granularity
        # the stack's weights: a block's scales repeated over its rows are groups of its columns
        # along the input (the plan takes only inputs of whole blocks); the same products, scale by
        # scale
        self.weights = (
            dataclasses.replace(first.weights, granularity=gr.PerGroup(g.cols))
            if isinstance(g, gr.PerBlock)
            else first.weights
        )
        self.inputs, self.round_inputs = first.inputs, first.round_inputs
        self.codes = torch.stack(
            [stack([group[e].weight_codes for group in layers]) for e in range(len(first_group))]
        )

        def row_scales(m: QuantLinear) -> torch.Tensor:  # [out, 1] or [out, in / G]
            if isinstance(g, gr.PerBlock):  # [ceil(out / R), in / C] -> [out, in / C]
                return m.weight_scale.repeat_interleave(g.rows, dim=0)[: m.out_features]
            if isinstance(g, gr.PerGroup):
                return m.weight_scale
            return m.weight_scale.reshape(-1, 1).expand(m.out_features, 1)

        self.weight_scale = torch.stack(
            [stack([row_scales(group[e]) for group in layers]) for e in range(len(first_group))]
        )
        self.input_scale = torch.stack([m.input_scale for m in first_group]).reshape(-1, 1)
        self.experts = list(
            zip(*layers)
        )  # per expert, its QuantLinears of this projection (gate and up, or down)
        biases = [[group[e].bias for group in layers] for e in range(len(first_group))]
        self.bias = None if first.bias is None else torch.stack([stack(b) for b in biases])
        rows = sum(group[0].out_features for group in layers)
        for e in range(len(first_group)):  # the QuantLinears now read their codes from the stack
            for i, group in enumerate(layers):
                part = (
                    slice(i * group[e].out_features, (i + 1) * group[e].out_features)
                    if concatenated
                    else slice(i, rows, len(layers))
                )
                group[e].weight_codes = self.codes[e, part]

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        from ptq.models.matmuls import grouped_linear

        if any(m._forward_pre_hooks for layers in self.experts for m in layers):
            self._expert_hooks(x, offsets)
        if not self.round_inputs:
            x_q = x
        else:
            x_q = quantize_activation(
                x, self.inputs, None if self.inputs.dynamic else self.input_scale[expert_ids]
            )[0]
        x_q = x_q.to(x.dtype)
        bias = self.bias[expert_ids] if self.bias is not None else None
        experts = max(1, WEIGHT_BLOCK_BYTES // (self.codes[0].numel() * x.element_size()))
        if (
            experts >= len(self.codes)
            or torch.is_grad_enabled()
            or is_its_own_weight(self.codes, self.weights, x.dtype)
        ):
            weight = dequantize_weight(
                self.codes, self.weight_scale, self.weights, x.dtype
            )  # in the compute dtype
            return grouped_linear(x_q, weight, offsets, bias)
        # All experts' weights dequantized at once would pass WEIGHT_BLOCK_BYTES (a large MoE layer:
        # as large as the 16-bit layer): a few experts at a time, each group's rows into the output;
        # experts no row is routed to are not dequantized at all
        ends = [0, *offsets.tolist()]  # expert e's rows are ends[e]:ends[e + 1]
        y = torch.empty(len(x), self.codes.shape[1], dtype=x.dtype, device=x.device)
        for first in range(0, len(self.codes), experts):
            last = min(first + experts, len(self.codes))
            start, stop = ends[first], ends[last]
            if start == stop:
                continue
            weight = dequantize_weight(
                self.codes[first:last], self.weight_scale[first:last], self.weights, x.dtype
            )
            rows = None if bias is None else bias[start:stop]
            y[start:stop] = grouped_linear(
                x_q[start:stop], weight, offsets[first:last] - start, rows
            )
        return y

    def _expert_hooks(self, x: torch.Tensor, offsets: torch.Tensor) -> None:
        """Forward pre-hooks on an expert's own QuantLinears (ptq.evaluation.layerstats' input SNR)
        called with the rows routed to that expert, as when the experts run one by one; an input a
        hook returns is not used here."""
        ends = [0, *offsets.tolist()]  # expert e's rows are ends[e]:ends[e + 1]
        for e, layers in enumerate(self.experts):
            if ends[e] == ends[e + 1] or not any(m._forward_pre_hooks for m in layers):
                continue
            rows = x[ends[e] : ends[e + 1]]
            for m in layers:
                for key, hook in list(m._forward_pre_hooks.items()):
                    hook(m, (rows,), {}) if key in m._forward_pre_hooks_with_kwargs else hook(
                        m, (rows,)
                    )


def grouped_experts(experts, layers: dict[str, list]) -> dict[str, GroupedExperts] | None:
    """The grouped form of a LinearExperts' quantized layers ({"gate_up": ..., "down": ...}), or
    None when they are not all QuantLinears quantized alike per projection (then the experts run one
    by one)."""
    groups = {
        "gate_up": [layers[p] for p in ("gate_proj", "up_proj") if p in layers],
        "down": [layers["down_proj"]],
    }
    for group in groups.values():
        ms = [m for g in group for m in g]
        if not all(isinstance(m, QuantLinear) and m.smooth is None for m in ms):
            return None
        if (
            len(
                {
                    (
                        m.weights,
                        m.inputs,
                        m.round_inputs,
                        m.weight_codes.dtype,
                        m.weight_codes.device,
                    )
                    for m in ms
                }
            )
            != 1
        ):
            return None
        if not all(
            torch.equal(g[e].input_scale, group[0][e].input_scale)
            for g in group
            for e in range(len(g))
        ):
            # gate and up read the same input: one scale (they always agree when calibrated
            # together)
            return None
    return {name: GroupedExperts(group, experts.concatenated) for name, group in groups.items()}
