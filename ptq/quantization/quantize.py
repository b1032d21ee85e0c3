"""Simulated quantization: `quantize_(model, recipe, calibration)` swaps every Linear for a QuantLinear.

A QuantLinear holds its weight already quantized (done once, not per forward), as codes in the format's
storage dtype (float8_e4m3fn, float8_e5m2, int8, bfloat16: one byte per weight for the 8-bit formats) and a
scale; it dequantizes them on each forward (one fused cast-and-multiply, under 1% of the matmul on CPU), rounds its input
to the recipe's format (static per-tensor scale from calibration, or one scale per token computed on the
fly), and multiplies in float32. A product of two 8- or 16-bit values
is exact in float32, so this simulates fp32-accumulating FP8/int8/bf16 hardware faithfully up to
summation order. With `attention` (or `kv_cache`) in the recipe, attention's batched-matmul inputs are
rounded too (ptq/quantization/attention.py). SmoothQuant divides each input channel by s and multiplies the weight's
column by s (ModelOpt's per-layer pre-quant scale, foldable into the preceding norm or layer).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ptq.calibration.calibrate import Calibration
from ptq.calibration.observers import choose_clip
from ptq.errors import PtqError
from ptq.models.matmuls import kind, quantizable
from ptq.numerics import granularity as gr
from ptq.numerics.formats import NumberFormat, amax, compute_scale, dequantize, fake_quantize, quantize
from ptq.numerics.kernels import FALLBACKS, fused  # noqa: F401  (fused is used by the modules that import it from here)
from ptq.quantization import attention, engines, residual
from ptq.quantization.attention import AttentionQuant
from ptq.quantization.plan import calibration_key, resolve_plan
from ptq.quantization.recipes import Recipe, TensorQuant


class InputQuantizer:
    """Quantizes Linear inputs for every QuantLinear of one model, with the fused rounding.

    An input shared by several Linears (q/k/v, gate/up) with the same scale is quantized once:
    the last input is held (so its memory cannot be reused) and matched by identity and version.
    """

    def __init__(self, compile: bool | None = None, codes: bool = False):
        # codes: the storage codes (float8) a real FP8 matmul takes, instead of their float32 values
        self._kernel = fused(_rounded_codes if codes else fake_quantize, compile)
        self._last: tuple | None = None

    def __call__(self, x: torch.Tensor, scale: torch.Tensor, fmt: NumberFormat, saturate: bool) -> torch.Tensor:
        # Inference tensors keep no version counter; between the Linears that share an input no
        # module writes to it in place (they would corrupt the unquantized model's math too).
        version = None if x.is_inference() else x._version
        last = self._last
        if last is not None and last[0] is x and last[1] == version and last[2] is scale and last[3] == (fmt, saturate):
            return last[4]
        x_q = self._kernel(x, scale, fmt, saturate)
        self._last = (x, version, scale, (fmt, saturate), x_q)
        return x_q


def scale_for(clip: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """The scale that maps `clip` (a calibrated or observed amax, per tensor or per group) onto the format's max,
    per the spec's scale mode: amax / max as float32; rounded up to a power of two ("pow2": a per-tensor exponent
    bias, so the clip never overflows); E8M0 (the MX power of two, granularity.e8m0_scale); or 1 ("unscaled": a
    plain cast). 16-bit formats: 1."""
    if spec.scale == "unscaled" or not spec.format.scaled:
        return torch.ones_like(torch.as_tensor(clip, dtype=torch.float32))
    if spec.scale_format == "e8m0":
        return gr.e8m0_scale(torch.as_tensor(clip, dtype=torch.float32), spec.format.max)
    scale = compute_scale(clip, spec.format)
    return torch.exp2(torch.ceil(torch.log2(scale))) if spec.scale == "pow2" else scale


def dynamic_scale(x: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """Dynamic scales from the activation itself, shaped to broadcast over its grouped view (granularity.grouped):
    one per tensor, per token (row of the last dimension) or per group of that row."""
    x_amax = gr.amax_of(gr.grouped(x, spec.granularity), spec.granularity)
    if spec.scale_format == "e8m0":
        return gr.e8m0_scale(x_amax, spec.format.max)
    scale = x_amax / spec.format.max
    scale = torch.where(scale > 0, scale, 1.0)  # an all-zero token: any scale represents it
    return torch.exp2(torch.ceil(torch.log2(scale))) if spec.scale == "pow2" else scale


def token_scale(x: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """Dynamic per-token (or per-tensor) scales of x: [..., 1] (or []), for kernels that take one per row."""
    return dynamic_scale(x, spec)


def _grouped_fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, fmt: NumberFormat, saturate: bool, g: gr.Granularity
) -> torch.Tensor:
    """fake_quantize with a scale per group or block (scale broadcasts over x's grouped view)."""
    return gr.ungrouped(fake_quantize(gr.grouped(x, g), scale, fmt, saturate), g, x.shape)


_grouped_rounding = fused(_grouped_fake_quantize)


def fake_quantize_dynamic(x: torch.Tensor, spec: TensorQuant) -> torch.Tensor:
    """x rounded with dynamic scales of its own (per tensor, token or group), as float32 values."""
    scale = dynamic_scale(x, spec)
    if isinstance(spec.granularity, gr.PerGroup):
        return _grouped_rounding(x, scale, spec.format, spec.saturate, spec.granularity)
    return fake_quantize(x, scale, spec.format, spec.saturate)


class ActQuant(nn.Module):
    """Fake-quantizes an activation: with a static scale from calibration, or per token (dynamic)."""

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
        if self.spec.dynamic:
            return fake_quantize_dynamic(x, self.spec).to(x.dtype)
        return fake_quantize(x, self.scale, self.spec.format, self.spec.saturate).to(x.dtype)

    def extra_repr(self) -> str:
        return self.spec.describe()


class QuantLinear(nn.Module):
    round_inputs = True  # False: weights only (what transformers computes for fused experts; ptq.export.checkpoint)
    quantized_matmul = True  # ptq.models.matmuls.QUANTIZED: a matmul already quantized

    @staticmethod
    def grouped_experts(experts, layers: dict[str, list]):
        """ptq.models.matmuls.GROUPING: how a LinearExperts whose layers are QuantLinears runs grouped."""
        return grouped_experts(experts, layers)

    def __init__(
        self,
        linear: nn.Linear,
        weights: TensorQuant,
        inputs: TensorQuant,
        input_amax: torch.Tensor | None,
        input_quantizer: InputQuantizer | None = None,
        smooth: torch.Tensor | None = None,
        weight_cache: dict | None = None,
        fp8_codes_quantizer: InputQuantizer | None = None,
        name: str = "?",
        weight_amax: torch.Tensor | None = None,
    ):
        super().__init__()
        self.input_quantizer = input_quantizer or InputQuantizer(compile=False)
        # Set: this layer multiplies real FP8 codes with torch._scaled_mm (see fp8_matmul_applies)
        self.fp8_codes_quantizer = fp8_codes_quantizer if fp8_matmul_applies(linear, weights, inputs, smooth) else None
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weights, self.inputs = weights, inputs
        w = linear.weight.detach()
        if smooth is not None:  # SmoothQuant: x / s times W * s is the same product, with easier x
            smooth = smooth.to(w.device)
        self.register_buffer("smooth", smooth)
        # Variants of one model quantize many weights the same way (layers a recipe leaves out run as the
        # baseline): one copy of the codes serves them all.
        # weight_amax: the amax its scale comes from when not its own (a fused group's: ptq.quantization.engines)
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
                weight_cache[key] = (linear.weight, codes, weight_scale)  # the weight is held so its id stays unique
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = linear.bias
        if inputs.static and input_amax is None:
            raise ValueError("a scaled input format needs a calibrated input amax")
        scale = scale_for(input_amax.to(w.device) if inputs.static else torch.ones((), device=w.device), inputs)
        self.register_buffer("input_scale", scale)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input the rounding sees, after SmoothQuant's division; its rounded values in float32)."""
        if self.smooth is not None:
            x = x / self.smooth
        if not self.round_inputs:
            return x, x
        if self.inputs.dynamic:
            return x, fake_quantize_dynamic(x, self.inputs)
        return x, self.input_quantizer(x, self.input_scale, self.inputs.format, self.inputs.saturate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_codes_quantizer is not None:
            return self.fp8_forward(x)
        x, x_q = self.quantize_input(x)
        return F.linear(
            x_q.to(x.dtype), dequantize_weight(self.weight_codes, self.weight_scale, self.weights, x.dtype), self.bias
        )

    def fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same product as the simulation, by a real FP8 matmul: torch._scaled_mm multiplies the input's
        and the weight's float8 codes, accumulates in float32 and applies both scales (per tensor, or per
        row: per token and per output channel), with the output in the compute dtype."""
        rows = x.reshape(-1, self.in_features)
        scale_x = token_scale(rows, self.inputs) if self.inputs.dynamic else self.input_scale
        codes = self.fp8_codes_quantizer(rows, scale_x, self.inputs.format, self.inputs.saturate)
        scale_w = self.weight_scale
        if scale_x.dim() or scale_w.dim():  # row-wise scaling needs both scales row-wise
            scale_x = scale_x.reshape(-1, 1).expand(len(rows), 1).contiguous()
            scale_w = scale_w.reshape(1, -1).expand(1, self.out_features).contiguous()
        pad = -len(rows) % 16 if rows.is_cuda else 0  # cuBLAS wants each dimension a multiple of 16
        if pad:
            codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad)).view(codes.dtype)
            scale_x = F.pad(scale_x, (0, 0, 0, pad), value=1.0) if scale_x.dim() else scale_x
        y = torch._scaled_mm(
            codes, self.weight_codes.t(), scale_a=scale_x, scale_b=scale_w, bias=self.bias, out_dtype=x.dtype
        )
        return y[: len(rows)].reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32), made from the codes on each call by one fused loop
        (formats.dequantize: codes * scale, in float32). The forward makes it in the compute dtype directly: on a
        GPU in bf16, one loop writing 2 bytes a weight rather than 4 and another cast."""
        return dequantize_weight(self.weight_codes, self.weight_scale, self.weights)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, weights={self.weights.describe()}, inputs={self.inputs.describe()}"


def quantize_weight(
    w: torch.Tensor, weights: TensorQuant, layer: str = "?", shared_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight's codes in the format's storage dtype (formats.FORMATS: float8_e4m3fn, int8, ...)
    and its scale as checkpoints store it ([], [out, 1], [out, in/G] or [ceil(out/R), ceil(in/C)];
    granularity.stored), rounded and stored by one fused loop.
    The one code path for weights: the simulation dequantizes these codes, `ptq quantize` writes them."""
    w = w.detach().float()
    g = weights.granularity
    if isinstance(g, (gr.PerTensor, gr.PerChannel)):  # aminmax: no full-size temporary of a large weight
        weight_amax = amax(w, dim=1) if isinstance(g, gr.PerChannel) else amax(w)
    else:
        weight_amax = gr.amax_of(gr.grouped(w, g), g)
    if shared_amax is not None:  # per tensor only (ptq.quantization.engines)
        weight_amax = torch.as_tensor(shared_amax, dtype=torch.float32, device=w.device).reshape(weight_amax.shape)
    if not bool(torch.isfinite(weight_amax).all()):  # a cast to int8 would turn NaN into a number
        raise PtqError(f"the weight of layer '{layer}' contains NaN or inf: the checkpoint is damaged")
    scale = scale_for(weight_amax, weights)
    if isinstance(g, (gr.PerTensor, gr.PerChannel)):
        return _weight_rounding(w, scale, weights.format, weights.saturate), scale
    codes = _grouped_codes(w, scale, weights.format, weights.saturate, g)
    return codes, gr.stored(scale, g)


def dequantize_weight(
    codes: torch.Tensor, scale: torch.Tensor, weights: TensorQuant, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes * scale (the stored scale of quantize_weight), in `dtype`, by one fused loop."""
    g = weights.granularity
    if isinstance(g, (gr.PerTensor, gr.PerChannel)):
        return _weight_dequantize(codes, scale, dtype)
    return _grouped_dequantize(codes, gr.broadcastable(scale, g), g, dtype)


def _rounded_codes(w: torch.Tensor, scale: torch.Tensor, fmt: NumberFormat, saturate: bool) -> torch.Tensor:
    # quantize gives values on the format's grid, which the storage cast keeps exactly (tests check it
    # against formats.to_storage)
    return quantize(w, scale, fmt, saturate).to(fmt.torch_dtype)


def _grouped_rounded_codes(w, scale, fmt: NumberFormat, saturate: bool, g: gr.Granularity) -> torch.Tensor:
    return gr.ungrouped(_rounded_codes(gr.grouped(w, g), scale, fmt, saturate), g, w.shape)


def _grouped_dequantized(codes, scale, g: gr.Granularity, dtype: torch.dtype) -> torch.Tensor:
    return gr.ungrouped(dequantize(gr.grouped(codes.float(), g), scale, dtype), g, codes.shape)


_weight_rounding = fused(_rounded_codes)
_weight_dequantize = fused(dequantize)
_grouped_codes = fused(_grouped_rounded_codes)
_grouped_dequantize = fused(_grouped_dequantized)
_rows_rounding = fused(fake_quantize)  # experts' inputs: one scale per row, their expert's


MATMULS = ("simulated", "fp8", "auto")


def fp8_matmul_available(device: torch.device) -> bool:
    """Whether `device` multiplies float8 natively: CUDA compute capability 8.9 or higher (Ada, Hopper,
    Blackwell). torch._scaled_mm also runs on CPU, slower than the simulation, so "auto" leaves CPUs simulated."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_matmul(matmul: str, device: torch.device) -> str:
    """ "simulated" or "fp8" for `matmul` ("simulated", "fp8", or "auto": fp8 where the device has it)."""
    if matmul not in MATMULS:
        raise PtqError(f"unknown matmul '{matmul}' (known: {', '.join(MATMULS)})")
    if matmul == "auto":
        return "fp8" if fp8_matmul_available(device) else "simulated"
    return matmul


def fp8_matmul_applies(linear: nn.Linear, weights: TensorQuant, inputs: TensorQuant, smooth) -> bool:
    """A layer can run as a real FP8 matmul when its weight and its input are both in a scaled 8-bit float
    format (E4M3 or E5M2) with per-tensor or per-row scales (torch._scaled_mm's tensor-wise and row-wise
    scaling; group and block scales stay simulated), without SmoothQuant, and its dimensions are multiples of 16
    (cuBLAS's rule)."""
    return (
        weights.format.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and inputs.format.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and isinstance(weights.granularity, (gr.PerTensor, gr.PerChannel))  # _scaled_mm: tensor or row scales
        and isinstance(inputs.granularity, (gr.PerTensor, gr.PerToken))
        and inputs.scale_format == "fp32"
        and smooth is None
        and linear.in_features % 16 == 0
        and linear.out_features % 16 == 0
    )


def input_clip(calibration: Calibration, name: str, spec: TensorQuant) -> torch.Tensor:
    """The calibrated clip of one activation under the spec's observer (per head: each head's amax)."""
    if isinstance(spec.granularity, gr.PerHead):
        if name not in calibration.input_channel_amax:
            raise PtqError(
                f"calibration file has no per-head amax for '{name}' (per-head KV-cache scales need one: "
                "recalibrate with this recipe)"
            )
        return calibration.input_channel_amax[name]
    amax_ = calibration.input_amax[name]
    if spec.observer == "max":
        return amax_
    hist = calibration.input_hist.get(name)
    if hist is None:
        raise PtqError(
            f"calibration file has no histogram for '{name}' (observer '{spec.observer}' needs one; recalibrate)"
        )
    _, clip = choose_clip(spec.observer, hist, float(amax_), spec.format, spec.percentile)
    return torch.tensor(clip, dtype=torch.float32)


def smoothing_factors(channel_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j (Xiao et al. 2022)."""
    w_amax = weight.detach().float().abs().amax(0).clamp(min=1e-5)
    return (channel_amax.float().clamp(min=1e-5).pow(alpha) / w_amax.pow(1 - alpha)).clamp(min=1e-5)


class EngineInt8Inputs(QuantLinear):
    """A QuantLinear whose int8 inputs round as vLLM and transformers (compressed-tensors) round them: clamp
    x / scale to [-128, 127], then round (ptq.quantization.engines, rule 3). ptq's convention rounds, then clamps to
    [-127, 127]; the two differ only where x / scale < -127.5, i.e. beyond the calibrated amax on the negative side."""

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.round_inputs:
            return x, x
        return x, torch.round((x.float() / self.input_scale).clamp(-128, 127)) * self.input_scale


def quantize_(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration | None,
    weight_cache: dict | None = None,
    matmul: str = "simulated",
    target: str = "transformers",
) -> nn.Module:
    """Replace, in place, each Linear of `model` by the QuantLinear the recipe asks for, and quantize
    attention's matmul inputs where the recipe covers them. `weight_cache` (see quantize_variants) lets
    several variants of one model share the weight codes they have in common. matmul="fp8" runs the layers
    whose weights and inputs are both FP8 as real FP8 matmuls (torch._scaled_mm); "auto" where the device
    has them (resolve_matmul). `target` (ptq.quantization.engines): "vllm" applies the scales and int8 rounding vLLM
    serves; "transformers" each layer's own scales and ptq's int8 convention."""
    matmul = resolve_matmul(matmul, next(model.parameters()).device)
    plan = resolve_plan(model, recipe)
    needed = plan.calibrated
    smoothed = set(plan.smoothed)
    if needed or smoothed:
        if calibration is None:
            raise PtqError(f"recipe '{recipe.name}' needs calibration (static input scales)")
        calibration.check_model(model, needed)
        missing = sorted(smoothed - set(calibration.input_channel_amax))
        if missing:
            raise PtqError(
                f"calibration file has no per-channel input amax for '{missing[0]}' "
                f"(SmoothQuant needs one: calibrate with --recipe {recipe.name})"
            )
    input_quantizer = InputQuantizer()
    fp8_codes_quantizer = InputQuantizer(codes=True) if matmul == "fp8" else None
    scales: dict[tuple, torch.Tensor] = {}  # Linears that share an input (same amax) share one scale tensor
    # --- engine hook (ptq.quantization.engines): the scales the target engine serves; for the plan to take over ---
    clips = {
        name: input_clip(calibration, name, e.inputs)
        for name, e in plan.matmuls.items()
        if e.inputs.static and name not in smoothed
    }
    engine = engines.engine_scales(
        model,
        recipe,
        target,
        lambda n: amax(model.get_submodule(n).weight),
        clips,
        {name for name, e in plan.matmuls.items() if e.reason is None},
    )
    int8_as_engine = engines.int8_inputs_as_engine(target)
    # --- end of the engine hook ---
    for name, entry in plan.matmuls.items():
        weights, inputs = entry.weights, entry.inputs
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        smooth = input_amax = None
        if name in smoothed:
            channel_amax = calibration.input_channel_amax[name]
            smooth = smoothing_factors(channel_amax, linear.weight, recipe.smoothquant)
            input_amax = (channel_amax / smooth).max()  # the smoothed input's amax, exactly
        elif inputs.static:
            input_amax = engine.input_amax.get(name, clips[name])
        q = QuantLinear(
            linear,
            weights,
            inputs,
            input_amax,
            input_quantizer,
            smooth,
            weight_cache,
            fp8_codes_quantizer,
            name,
            engine.weight_amax.get(name),
        )
        if (
            int8_as_engine
            and inputs.format.kind == "int"
            and inputs.static
            and smooth is None
            and q.fp8_codes_quantizer is None
        ):
            q.__class__ = EngineInt8Inputs
        q.ptq_kind = kind(linear)  # Linear, Conv1D or Experts, as the layer it replaces (ptq.models.matmuls)
        if smooth is None:
            key = (inputs, float(q.input_scale), q.input_scale.device)
            q.input_scale = scales.setdefault(key, q.input_scale)
        setattr(parent, child, q)
    quantizers = {}
    for layer, tensors in plan.attention.items():
        made = {
            t: ActQuant(spec, input_clip(calibration, calibration_key(layer, t), spec) if spec.static else None)
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
                t: ActQuant(spec, input_clip(calibration, f"{block}.residual.{t}", spec) if spec.static else None)
                for t, spec in tensors.items()
            }
        )
        model.get_submodule(block).ptq_residual = made  # registered, so it moves with the model
        residual.install(model, {block: dict(made.items())})
    return model


def quantize_variants(
    model: nn.Module,
    recipes: list[Recipe],
    calibration: Calibration | None,
    matmul: str = "simulated",
    target: str = "transformers",
) -> dict[str, nn.Module]:
    """One quantized variant of `model` per recipe, built to share memory: the variants share one copy of
    the tensors no recipe replaces (embeddings, norms, biases), and weights quantized the same way (the
    layers left in 16-bit) are stored once. `model` itself is left as it was, and no variant refers to
    its tensors: once the caller drops it, it is freed whole."""
    # Linear weights are replaced in every variant: referenced until then. Everything else is copied, so
    # that nothing of `model` stays referenced (its weights may be a memory map of the checkpoint, which
    # one remaining tensor would keep whole).
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
        r.name: quantize_(copy.deepcopy(model, memo=dict(tensors)), r, calibration, weight_cache, matmul, target)
        for r in recipes
    }


class GroupedExperts:
    """One projection of a LinearExperts (gate and up together, as the fused module computes them; or down) for
    all experts at once: their QuantLinears' weight codes stacked [E, rows, in] (the QuantLinears keep views into
    them, so nothing is stored twice), weight scales [E, rows, 1], input scales [E] and biases [E, rows]."""

    def __init__(self, layers: list[list[QuantLinear]], concatenated: bool):
        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:  # gate and up rows as the fused module lays them out
            if len(tensors) == 1:
                return tensors[0]
            return torch.cat(tensors, dim=0) if concatenated else torch.stack(tensors, dim=1).flatten(0, 1)

        first_group = layers[0]
        first = first_group[0]
        self.inputs, self.round_inputs = first.inputs, first.round_inputs
        self.codes = torch.stack([stack([group[e].weight_codes for group in layers]) for e in range(len(first_group))])
        self.weight_scale = torch.stack(
            [
                stack([group[e].weight_scale.reshape(-1, 1).expand(group[e].out_features, 1) for group in layers])
                for e in range(len(first_group))
            ]
        )
        self.input_scale = torch.stack([m.input_scale for m in first_group]).reshape(-1, 1)
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

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from ptq.models.matmuls import grouped_linear

        if not self.round_inputs:
            x_q = x
        else:
            scale = token_scale(x, self.inputs) if self.inputs.dynamic else self.input_scale[expert_ids]
            x_q = _rows_rounding(x, scale, self.inputs.format, self.inputs.saturate)
        weight = _weight_dequantize(self.codes, self.weight_scale, x.dtype)  # written once, in the compute dtype
        bias = self.bias[expert_ids] if self.bias is not None else None
        return grouped_linear(x_q.to(x.dtype), weight, offsets, bias)


def grouped_experts(experts, layers: dict[str, list]) -> dict[str, GroupedExperts] | None:
    """The grouped form of a LinearExperts' quantized layers ({"gate_up": ..., "down": ...}), or None when they
    are not all QuantLinears quantized alike per projection (then the experts run one by one)."""
    groups = {"gate_up": [layers[p] for p in ("gate_proj", "up_proj") if p in layers], "down": [layers["down_proj"]]}
    for group in groups.values():
        ms = [m for g in group for m in g]
        if not all(isinstance(m, QuantLinear) and m.smooth is None for m in ms):
            return None
        if len({(m.weights, m.inputs, m.round_inputs, m.weight_codes.dtype, m.weight_codes.device) for m in ms}) != 1:
            return None
        if not isinstance(ms[0].weights.granularity, (gr.PerTensor, gr.PerChannel)) or isinstance(
            ms[0].inputs.granularity, gr.PerGroup
        ):
            return None  # group and block scales: the experts run one by one
        if not all(torch.equal(g[e].input_scale, group[0][e].input_scale) for g in group for e in range(len(g))):
            return None  # gate and up read the same input: one scale (they always agree when calibrated together)
    return {name: GroupedExperts(group, experts.concatenated) for name, group in groups.items()}
