"""QuantLinear against an independent reference: ml_dtypes casts (round to nearest even) after
clipping, multiplied in float64 numpy, and the calibration amax against activations captured by hand."""

import copy
import dataclasses
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from ptq.calibration.calibrate import calibrate
from ptq.calibration.clips import quantize_, quantize_variants
from ptq.errors import PtqError
from ptq.quantization.plan import calibrated_layers, resolve_plan
from ptq.quantization.quantize import QuantLinear
from ptq.quantization.recipes import load_recipe


def ref_fake_quant(x: np.ndarray, amax, fmt: str, axis=None) -> np.ndarray:
    """The 30-line reference of REFERENCE.md: scale = amax / max, clip, cast, multiply back."""
    x = x.astype(np.float32)
    if fmt == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    maxval = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}[fmt]
    scale = (np.asarray(amax, np.float32) / np.float32(maxval)).astype(np.float32)
    q = np.clip(x / scale, -maxval, maxval)
    if fmt == "int8":
        q = np.rint(q)
    else:
        q = q.astype({"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]).astype(
            np.float32
        )
    return (q * scale).astype(np.float32)


@pytest.mark.parametrize(
    "recipe_name, wfmt, per_channel",
    [
        ("fp8-e4m3", "e4m3", False),
        ("fp8-e5m2", "e5m2", False),
        ("int8", "int8", True),
        ("bf16", "bf16", False),
    ],
)
def test_quant_linear_matches_reference(recipe_name, wfmt, per_channel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 7, 64) * 5
    x[0, 0, 0] = 40.0  # beyond the calibrated amax: must saturate
    input_amax = torch.tensor(20.0)
    recipe = load_recipe(recipe_name)
    q = QuantLinear(
        linear, recipe.weights, recipe.inputs, input_amax if recipe.needs_calibration else None
    )

    w = linear.weight.detach().numpy()
    w_amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    w_ref = ref_fake_quant(w, w_amax, wfmt)
    x_ref = ref_fake_quant(x.numpy(), 20.0, wfmt)
    y_ref = x_ref.astype(np.float64) @ w_ref.T.astype(np.float64) + linear.bias.detach().numpy()

    assert np.array_equal(q.weight.numpy(), w_ref)  # weights quantized once, bit-exact
    y = q(x).detach().numpy()
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)  # fp32 accumulation vs float64


def test_plan_keeps_lm_head_in_bf16_and_quantizes_the_rest(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = resolve_plan(model, load_recipe("fp8-e4m3")).matmuls
    assert (
        layers["lm_head"].weights.format.name == "bf16"
        and "ignore: lm_head" in layers["lm_head"].reason
    )
    body = [name for name in layers if name != "lm_head"]
    assert len(body) == 14 and all(
        layers[n].weights.format.name == "e4m3" and layers[n].quantized for n in body
    )
    assert calibrated_layers(model, load_recipe("fp8-e4m3")) == body
    assert calibrated_layers(model, load_recipe("bf16")) == []


def test_calibration_amax_is_the_max_of_the_inputs_seen(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(0)
    )
    seen = {}
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out, n=n: seen.setdefault(n, []).append(args[0].clone())
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    layers = calibrated_layers(model, load_recipe("fp8-e4m3"))
    cal = calibrate(
        model, ids, layers, batch_size=2
    )  # batches of 2, 2, 1: the running max must merge them
    for name in layers:
        expected = max(float(t.abs().max()) for t in seen[name])
        assert float(cal.input_amax[name]) == pytest.approx(expected, rel=1e-6)
        assert float(cal.weight_amax[name]) == float(
            model.get_submodule(name).weight.detach().abs().max()
        )


def test_quantize_swaps_every_linear_and_bf16_baseline_is_close_to_fp32(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    cal = calibrate(model, ids, calibrated_layers(model, load_recipe("fp8-e4m3")))
    bf16 = quantize_(copy.deepcopy(model), load_recipe("bf16"), None)
    e4m3 = quantize_(copy.deepcopy(model), load_recipe("fp8-e4m3"), cal)
    assert not any(type(m) is torch.nn.Linear for m in e4m3.modules())
    with torch.no_grad():
        ref, y16, y8 = (m(input_ids=ids).logits for m in (model, bf16, e4m3))
    err16, err8 = (ref - y16).abs().max(), (ref - y8).abs().max()
    assert 0 < err16 < err8  # bf16 rounds (not a no-op) and loses less than E4M3


def test_compiled_input_kernel_is_bit_identical_to_the_eager_ops():
    """The one activation quantizer, compiled, against the eager ops of formats.py: every format, saturation,
    int8 range, granularity (static per tensor, dynamic per token and per group) and output (values, codes)."""
    import dataclasses

    from ptq.numerics.formats import FORMATS, fake_quantize, quantize
    from ptq.numerics.granularity import PerGroup, PerTensor, PerToken
    from ptq.quantization.quantize import ActivationQuantizer, dynamic_scale
    from ptq.quantization.recipes import TensorQuant

    torch.manual_seed(0)
    x = torch.randn(3, 50, 96) * 30
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -1e9, 0.0])
    scale = torch.tensor(0.05)
    compiled = ActivationQuantizer(compile=True)

    def same(y, ref):
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(), ref.nan_to_num())
        assert torch.equal(
            y.view(torch.int32)[~y.isnan()], ref.view(torch.int32)[~ref.isnan()]
        )  # signed zeros too

    for fmt in ("e4m3", "int8"):
        for saturate in (True, False):
            spec = TensorQuant(FORMATS[fmt], PerTensor(), saturate)
            same(
                compiled(x.clone(), spec, scale)[0], fake_quantize(x, scale, FORMATS[fmt], saturate)
            )
    full = TensorQuant(FORMATS["int8"], int_range="full")
    same(
        compiled(x.clone(), full, scale)[0],
        fake_quantize(x, scale, FORMATS["int8"], True, lowest=-128.0),
    )
    finite = x.nan_to_num(posinf=1e9)
    for g in (PerToken(), PerGroup(32)):
        spec = TensorQuant(FORMATS["e4m3"], g, dynamic=True)
        y, s = compiled(finite.clone(), spec)
        grouped = finite.reshape(3, 50, 3, 32) if isinstance(g, PerGroup) else finite
        assert torch.equal(s, dynamic_scale(finite, spec))
        same(y, fake_quantize(grouped, s, FORMATS["e4m3"]).reshape(x.shape))
    codes, _ = compiled(
        finite.clone(),
        dataclasses.replace(spec, granularity=PerTensor(), dynamic=False),
        scale,
        True,
    )
    want = quantize(finite, scale, FORMATS["e4m3"]).to(torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(
        codes.view(torch.uint8), want.view(torch.uint8)
    )


def test_compiled_weight_rounding_is_bit_identical_to_the_eager_ops():
    from ptq.numerics.formats import FORMATS, quantize, to_storage
    from ptq.quantization.quantize import _rounded_codes, fused

    torch.manual_seed(1)
    w = torch.randn(64, 96) * torch.logspace(
        -6, 2, 96
    )  # columns from tiny (subnormal after scaling) to large
    compiled = fused(_rounded_codes, compile=True)
    for fmt in ("e4m3", "e5m2", "int8", "bf16"):
        for scale in (
            w.abs().amax(1, keepdim=True) / FORMATS[fmt].max,
            w.abs().amax() / FORMATS[fmt].max,
            torch.tensor(1.0),
        ):
            for saturate in (True, False):
                got = compiled(w, scale, FORMATS[fmt], saturate)
                want = to_storage(quantize(w, scale, FORMATS[fmt], saturate), FORMATS[fmt])
                assert got.dtype == want.dtype == FORMATS[fmt].torch_dtype
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), fmt


def test_compiled_weight_dequantize_decodes_every_code_as_ml_dtypes_does():
    # QuantLinear keeps its weight as storage codes and dequantizes them on each forward with this kernel
    import ml_dtypes
    import numpy as np

    from ptq.numerics.formats import FORMATS, dequantize
    from ptq.quantization.quantize import fused

    compiled = fused(dequantize, compile=True)
    every_byte = np.arange(256, dtype=np.uint8)
    cases = {
        "e4m3": (every_byte.view(ml_dtypes.float8_e4m3fn), torch.float8_e4m3fn),
        "e5m2": (every_byte.view(ml_dtypes.float8_e5m2), torch.float8_e5m2),
        "int8": (every_byte.view(np.int8), torch.int8),
    }
    per_channel = torch.tensor([[0.01], [3.0], [2.0**-20], [1.0]])
    for fmt, (codes_np, dtype) in cases.items():
        codes = torch.from_numpy(every_byte.copy()).view(dtype).reshape(4, 64)
        assert codes.dtype == FORMATS[fmt].torch_dtype
        for scale in (torch.tensor(1.0), torch.tensor(0.0371), per_channel):
            got = compiled(codes, scale).numpy()
            want = codes_np.astype(np.float32).reshape(4, 64) * scale.numpy()
            assert np.array_equal(np.isnan(got), np.isnan(want)), fmt
            assert np.array_equal(
                got[~np.isnan(got)].view(np.int32), want[~np.isnan(want)].view(np.int32)
            ), fmt


def test_a_16_bit_layer_computed_in_its_own_dtype_is_used_as_it_is(tiny_model):
    # bf16 compute (a GPU's default): the baseline's weights and inputs are bf16 already, so neither is rounded nor
    # copied per forward; the result is the product of the rounding it skips, by the kernels themselves
    from ptq.numerics.formats import FORMATS
    from ptq.numerics.granularity import PerTensor
    from ptq.quantization.quantize import _round_activation, _weight_dequantize, dequantize_weight

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    layer = quantize_(copy.deepcopy(model), load_recipe("bf16"), None).model.layers[0].mlp.down_proj
    codes, scale = layer.weight_codes, layer.weight_scale
    assert dequantize_weight(codes, scale, layer.weights, torch.bfloat16) is codes
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert layer.quantize_input(x)[1] is x
    rounded = _round_activation(
        x, layer.input_scale, FORMATS["bf16"], True, None, PerTensor(), False
    ).bfloat16()
    want = torch.nn.functional.linear(rounded, _weight_dequantize(codes, scale, torch.bfloat16))
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got.nan_to_num(), want.nan_to_num()
    )
    # in float32 compute the same layer still rounds its input to bf16 and widens its codes
    wide = x[1:].float() + 2.0**-12  # finite values off the bf16 grid
    assert not torch.equal(layer.quantize_input(wide)[1], wide)
    assert dequantize_weight(codes, scale, layer.weights).dtype == torch.float32


@pytest.mark.parametrize(
    "recipe_name", ["bf16", "fp8-e4m3", "int8", "fp8-dynamic", "fp8-block", "mxfp8"]
)
@pytest.mark.parametrize("bias", [False, True])
def test_a_large_weight_is_multiplied_a_block_of_rows_at_a_time_with_the_same_product(
    monkeypatch, recipe_name, bias
):
    # A weight whose float32 copy would pass WEIGHT_BLOCK_BYTES (here 40 rows' worth) is made a block of rows at a
    # time: no copy made per forward is larger than a block (128 rows, or 256 for 256-row weight tiles), and the
    # output is the product of the whole dequantized weight. 300 rows: two whole blocks and a partial one, whose
    # last 128 x 128 tile is partial too.
    import ptq.quantization.quantize as quantize
    from ptq.numerics.granularity import PerBlock

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 300, bias=bias)
    recipe = load_recipe(recipe_name)
    weights = recipe.weights
    x = torch.randn(2, 5, 96) * 3
    q = QuantLinear(
        linear, weights, recipe.inputs, torch.tensor(9.0) if recipe.needs_calibration else None
    )
    want = torch.nn.functional.linear(q.quantize_input(x)[1], q.weight, linear.bias)
    made = []
    dequantize_weight = quantize.dequantize_weight
    monkeypatch.setattr(
        quantize,
        "dequantize_weight",
        lambda codes, *a: made.append(len(codes)) or dequantize_weight(codes, *a),
    )
    monkeypatch.setattr(quantize, "WEIGHT_BLOCK_BYTES", 40 * 96 * 4)
    with torch.no_grad():
        got = q(x)
    assert made == [128, 128, 44]
    assert torch.equal(got, want)
    if (
        recipe_name == "fp8-block"
    ):  # 256-row tiles: blocks of 256 rows, the scale's rows sliced with them
        tiled = dataclasses.replace(weights, granularity=PerBlock(256, 64))
        q = QuantLinear(linear, tiled, recipe.inputs, None)
        want = torch.nn.functional.linear(q.quantize_input(x)[1], q.weight, linear.bias)
        made.clear()
        with torch.no_grad():
            assert torch.equal(q(x), want) and made == [256, 44]
    with (
        torch.enable_grad()
    ):  # autograd: the whole weight, as F.linear (blocks written into the output would not do)
        made.clear()
        q(x)
        assert made == [300]


def test_an_input_shared_by_q_k_v_and_gate_up_is_quantized_once(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)
    )
    cal = calibrate(model, ids, calibrated_layers(model, load_recipe("fp8-e4m3")))
    q = quantize_(copy.deepcopy(model), load_recipe("fp8-e4m3"), cal)
    quantizer = q.model.layers[0].self_attn.q_proj.input_quantizer
    calls = []
    static, dynamic = (
        quantizer._kernels
    )  # fp8-e4m3's inputs have static scales (the lm_head's bf16: none)
    quantizer._kernels = (lambda *a: calls.append(1) or static(*a), dynamic)
    with torch.no_grad():
        cached = q(input_ids=ids).logits
    # per block: q/k/v input, o_proj input, gate/up input, down_proj input; lm_head (bf16) once
    assert len(calls) == 2 * 4 + 1
    for m in q.modules():  # one quantizer per layer (no sharing) must give the same logits
        if isinstance(m, QuantLinear):
            m.input_quantizer = type(quantizer)(compile=False)
    with torch.no_grad():
        assert torch.equal(q(input_ids=ids).logits, cached)


def test_variants_share_what_they_do_not_quantize_and_match_separate_copies(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=False)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3)
    )
    recipes = [load_recipe(r) for r in ("bf16", "fp8-e4m3", "int8")]
    cal = calibrate(model, ids, calibrated_layers(model, recipes[1]))
    variants = quantize_variants(model, recipes, cal)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    embeds = {storage(v.model.embed_tokens.weight) for v in variants.values()}
    assert len(embeds) == 1  # one copy for all variants...
    original = {storage(t) for t in (*model.parameters(), *model.buffers())}
    for v in (
        variants.values()
    ):  # ...and none of the original's memory (a memory-mapped checkpoint) kept
        assert not original & {storage(t) for t in (*v.parameters(), *v.buffers())}
    heads = {
        storage(v.lm_head.weight_codes) for v in variants.values()
    }  # left in bf16 by every recipe
    assert len(heads) == 1
    assert variants["bf16"].model.layers[0].mlp.down_proj.weight_codes.dtype == torch.bfloat16
    assert (
        variants["fp8-e4m3"].model.layers[0].mlp.down_proj.weight_codes.dtype == torch.float8_e4m3fn
    )  # one byte
    assert variants["int8"].model.layers[0].mlp.down_proj.weight_codes.dtype == torch.int8
    assert (
        model.model.layers[0].mlp.down_proj.__class__ is torch.nn.Linear
    )  # the original is left as it was
    with torch.no_grad():
        for r in recipes:
            alone = quantize_(copy.deepcopy(model), r, cal)
            assert torch.equal(variants[r.name](input_ids=ids).logits, alone(input_ids=ids).logits)


@pytest.mark.parametrize(
    "recipe_text",
    [
        "name: t\ntargets: [Linear]\nignore: [lm_head]\nweights: {format: e4m3}\ninputs: {format: e4m3}\n",  # static per-tensor: tensor-wise scaling
        "name: t\ntargets: [Linear]\nignore: [lm_head]\nweights: {format: e4m3, granularity: channel}\ninputs: {format: e4m3, dynamic: true}\n",  # row-wise
        "name: t\ntargets: [Linear]\nignore: [lm_head]\nweights: {format: e5m2}\ninputs: {format: e4m3, scale: pow2}\n",
    ],
)
def test_real_fp8_matmul_matches_the_simulation(tiny_model, tmp_path, recipe_text):
    """torch._scaled_mm on the float8 codes (CPU here; the same call and rules as on Hopper) gives the
    simulation's product up to float32 summation order, in every layer the recipe puts in FP8."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    (tmp_path / "r.yaml").write_text(recipe_text)
    recipe = load_recipe(str(tmp_path / "r.yaml"))
    ids = torch.randint(
        0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(4)
    )  # 63 rows
    cal = (
        calibrate(model, ids, calibrated_layers(model, recipe))
        if recipe.needs_calibration
        else None
    )
    simulated = quantize_(copy.deepcopy(model), recipe, cal)
    real = quantize_(copy.deepcopy(model), recipe, cal, matmul="fp8")
    fp8_layers = [n for n, m in real.named_modules() if isinstance(m, QuantLinear) and m.fp8_matmul]
    assert (
        len(fp8_layers) == 7 * model.config.num_hidden_layers
    )  # q k v o gate up down; the lm_head is left in bf16
    calls = []
    original = torch._scaled_mm
    with (
        torch.no_grad(),
        mock.patch.object(
            torch, "_scaled_mm", lambda *a, **k: calls.append(1) or original(*a, **k)
        ),
    ):
        want, got = simulated(input_ids=ids).logits, real(input_ids=ids).logits
    assert len(calls) == len(fp8_layers)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(
        got, quantize_(copy.deepcopy(model), load_recipe("bf16"), None)(input_ids=ids).logits
    )


def _cublas_scaled_mm(original, calls, cutlass_rowwise=False):
    """torch._scaled_mm with the checks its CUDA kernel makes and its CPU kernel does not (torch 2.11's
    aten/src/ATen/native/cuda/ScaledBlas.cpp): no E5M2 x E5M2 product, no bias with a float32 output, the inner
    and output dimensions multiples of 16; with `cutlass_rowwise` (Ada, Blackwell: row-wise scales go to CUTLASS's
    kernel) no float32 output with row-wise scales."""

    def scaled_mm(a, b, *args, bias=None, out_dtype=None, **kwargs):
        if a.dtype == b.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        if bias is not None and out_dtype == torch.float32:
            raise ValueError("Bias is not supported when out_dtype is set to Float32")
        if (
            cutlass_rowwise
            and kwargs["scale_a"].dim()
            and out_dtype not in (torch.bfloat16, torch.float16)
        ):
            raise ValueError(
                "Only bf16 and fp16 high precision output types are supported for row-wise scaling."
            )
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise ValueError(f"dimensions not multiples of 16: {tuple(a.shape)} x {tuple(b.shape)}")
        calls.append(1)
        return original(a, b, *args, bias=bias, out_dtype=out_dtype, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("cutlass_rowwise", [False, True], ids=["hopper", "ada-blackwell"])
@pytest.mark.parametrize(
    "recipe_text, fp8_layers",
    [
        ("weights: {format: e4m3}\ninputs: {format: e4m3}\n", 7),
        ("weights: {format: e5m2}\ninputs: {format: e4m3, scale: pow2}\n", 7),
        (
            "weights: {format: e5m2}\ninputs: {format: e5m2}\n",
            0,
        ),  # cuBLAS has no E5M2 x E5M2 product
        (
            "weights: {format: e4m3, granularity: channel}\ninputs: {format: e4m3, granularity: token, dynamic: true}\n",
            7,
        ),
    ],
)
def test_real_fp8_matmuls_keep_to_the_rules_of_cublas(
    tmp_path, monkeypatch, recipe_text, fp8_layers, cutlass_rowwise
):
    """A float32 model with biases (Qwen2's q/k/v, --low-memory's compute dtype) under --matmul fp8, with
    torch._scaled_mm held to the rules of its CUDA kernel: the bias is added after a float32 product, an
    E5M2 x E5M2 layer stays simulated, row-wise scales with a float32 output are applied after a unit-scale product
    where torch runs CUTLASS's row-wise kernel (bf16 or fp16 only), and the logits are the simulation's."""
    import ptq.quantization.quantize as quantize_module

    monkeypatch.setattr(
        quantize_module, "rowwise_float32_unavailable", lambda device: cutlass_rowwise
    )
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(
        tmp_path / "m",
        attention_bias=True,
        mlp_bias=True,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    (tmp_path / "r.yaml").write_text(
        "name: t\ntargets: [Linear]\nignore: [lm_head]\n" + recipe_text
    )
    recipe = load_recipe(str(tmp_path / "r.yaml"))
    ids = torch.randint(
        0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(4)
    )
    cal = (
        calibrate(model, ids, calibrated_layers(model, recipe))
        if recipe.needs_calibration
        else None
    )
    simulated = quantize_(copy.deepcopy(model), recipe, cal)
    real = quantize_(copy.deepcopy(model), recipe, cal, matmul="fp8")
    layers = [m for m in real.modules() if isinstance(m, QuantLinear) and m.fp8_matmul]
    assert len(layers) == fp8_layers * model.config.num_hidden_layers
    assert all(m.bias is not None for m in layers)
    calls = []
    cublas = _cublas_scaled_mm(torch._scaled_mm, calls, cutlass_rowwise)
    with torch.no_grad(), mock.patch.object(torch, "_scaled_mm", cublas):
        want, got = simulated(input_ids=ids).logits, real(input_ids=ids).logits
    assert len(calls) == len(layers)
    # torch's CPU kernel dequantizes, then multiplies: the simulation's arithmetic. The unit-scale product sums the
    # codes' products first, as a GPU does; a static input near a rounding boundary may then take the next code
    tolerance = 1e-4 if cutlass_rowwise else 1e-5
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "capability, cuda, unavailable",
    [
        ((9, 0), "13.0", False),
        ((9, 0), "12.9", False),
        ((9, 0), "12.6", True),
        ((8, 9), "13.0", True),
        ((10, 0), "13.0", True),
        ((12, 0), "12.9", True),
    ],
)
def test_rowwise_float32_output_is_cublas_on_hopper_only(
    monkeypatch, capability, cuda, unavailable
):
    """torch 2.11 sends row-wise scales to cuBLAS (float32 output allowed) on compute capability 9.x with CUDA
    12.9+, and to CUTLASS (bf16 / fp16 only) on Ada, Blackwell or an older CUDA; on a CPU the question does not arise."""
    from ptq.quantization.quantize import rowwise_float32_unavailable

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert rowwise_float32_unavailable(torch.device("cuda", 0)) is unavailable
    assert rowwise_float32_unavailable(torch.device("cpu")) is False


@pytest.mark.parametrize("in_features", [128, 256, 384, 512, 640, 11008])
def test_block_fp8_matmul_passes_torchs_scale_layout_checks(in_features):
    """The block-wise product's arguments, on meta tensors, against torch's own shape and stride checks for 1 x 128
    input groups times 128 x 128 weight blocks (the meta function mirrors the CUDA kernel's): the weight's scales
    padded to round_up(K / 128, 4) rows, whatever K / 128 is (Llama-2's down_proj: 86)."""
    from ptq.quantization.quantize import _blockwise_mm

    rows, out_features, k_blocks = 48, 256, in_features // 128
    codes = torch.empty(rows, in_features, dtype=torch.float8_e4m3fn, device="meta")
    weight_codes = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device="meta")
    scale_x = torch.empty(rows, k_blocks, device="meta")
    scale_w = torch.empty(out_features // 128, k_blocks, device="meta")
    y = _blockwise_mm(codes, weight_codes, scale_x, scale_w, torch.bfloat16)
    assert y.shape == (rows, out_features) and y.dtype == torch.bfloat16


def test_matmul_choice_is_checked_and_auto_is_simulated_on_cpu(tiny_model):
    from ptq.quantization.quantize import resolve_matmul

    assert resolve_matmul("auto", torch.device("cpu")) == "simulated"
    assert resolve_matmul("fp8", torch.device("cpu")) == "fp8"
    with pytest.raises(PtqError, match="unknown matmul 'int4'"):
        resolve_matmul("int4", torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="no CUDA device with FP8 (compute capability 8.9+)",
)
@pytest.mark.parametrize("recipe_name", ["fp8-e4m3", "fp8-e4m3-dynamic"])
def test_cuda_fp8_matmul_in_bf16_matches_the_simulation(tiny_model, recipe_name):
    """On an FP8 GPU, in its default bf16 compute: `auto` picks real FP8 matmuls (cuBLAS through
    torch._scaled_mm), whose logits match the simulation's to bf16 precision."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).to("cuda", torch.bfloat16)
    recipe = load_recipe(recipe_name)
    ids = torch.randint(
        0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(4)
    ).cuda()
    cal = (
        calibrate(model, ids, calibrated_layers(model, recipe))
        if recipe.needs_calibration
        else None
    )
    simulated = quantize_(copy.deepcopy(model), recipe, cal)
    real = quantize_(copy.deepcopy(model), recipe, cal, matmul="auto")
    assert any(isinstance(m, QuantLinear) and m.fp8_matmul for m in real.modules())
    with torch.no_grad():
        want, got = simulated(input_ids=ids).logits.float(), real(input_ids=ids).logits.float()
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2  # a few bf16 roundings apart


def _tiny(family: str) -> torch.nn.Module:
    """A tiny model of a tested family, or of a sandwich-norm one the families file does not list."""
    import families
    import transformers

    extra = {"olmo2": "Olmo2Config", "glm4": "Glm4Config"}
    if family not in extra:
        return families.build(family)
    torch.manual_seed(0)
    config = getattr(transformers, extra[family])(**families.COMMON, head_dim=16, pad_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gemma3", "olmo2", "glm4"])
def test_residual_quantizers_see_the_operands_of_the_blocks_two_adds(family):
    """Each residual quantizer is given what the block adds: x + attn_out is the mid-block sum and mid + mlp_out the
    block's output, bit for bit. Sandwich-norm blocks (Gemma 2/3, OLMo 2, GLM-4) add their post-norms' outputs, and
    their post_attention_layernorm (Gemma, OLMo) reads the attention output, not the sum."""
    from ptq.quantization import residual

    model = _tiny(family)
    name, block = next(iter(residual.residual_blocks(model).items()))
    seen = {}

    def recorder(tensor):
        def q(x):
            seen.setdefault(tensor, x.detach().clone())
            return x

        return q

    handles = residual.install(model, {name: {t: recorder(t) for t in residual.TENSORS}})
    handles.append(
        block.register_forward_hook(
            lambda m, a, out: seen.setdefault("output", out[0] if isinstance(out, tuple) else out)
        )
    )
    with torch.no_grad():
        model(torch.arange(12)[None])
    for h in handles:
        h.remove()
    assert torch.equal(seen["input"] + seen["attn_out"], seen["mid"])
    assert torch.equal(seen["mid"] + seen["mlp_out"], seen["output"])


def test_pow2_scales_are_the_smallest_power_of_two_that_does_not_clip():
    """scale: pow2 rounds amax / max up to a power of two, so that amax / scale <= max. Against numpy's frexp of the
    float32 amax / 448, for amaxes 0-3 ulps around 448 * 2^j, static and dynamic, eager and compiled: a scale one ulp
    above 2^j has a float32 log2 of exactly j, and exp2(ceil(log2)) gave 2^j (the amax then clipped)."""
    from ptq.numerics.formats import FORMATS
    from ptq.numerics.granularity import PerTensor, PerToken
    from ptq.numerics.kernels import fused
    from ptq.quantization.quantize import dynamic_scale, scale_for
    from ptq.quantization.recipes import TensorQuant

    base = (448 * 2.0 ** np.arange(-100, 100)).astype(np.float32)
    amax = np.concatenate(
        [(base.view(np.int32) + ulps).view(np.float32) for ulps in (-1, 0, 1, 2, 3)]
    )
    s = amax / np.float32(448)
    mantissa, exponent = np.frexp(s.astype(np.float64))
    want = np.where(mantissa == 0.5, s, np.exp2(exponent)).astype(np.float32)
    assert (amax.astype(np.float64) / want <= 448).all()

    static = TensorQuant(FORMATS["e4m3"], PerTensor(), scale="pow2")
    assert np.array_equal(
        np.array([scale_for(torch.tensor(a), static).item() for a in amax], np.float32), want
    )
    dynamic = TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True, scale="pow2")
    rows = torch.from_numpy(amax).reshape(-1, 1).repeat(1, 8)
    for fn in (dynamic_scale, fused(dynamic_scale, compile=True)):
        assert np.array_equal(fn(rows, dynamic).flatten().numpy(), want)


def test_smoothquant_in_a_bf16_model_computes_in_bf16_as_the_reference():
    """SmoothQuant's s is float32, so x / s is float32: a bf16 layer with a bias raised ("self and mat2 must have the
    same dtype"), one without returned float32 to the rest of the bf16 model. Against numpy: x / s and W * s in
    float32, int8 rounded (np.rint), the dequantized operands rounded to bf16 once, multiplied in float64."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = (torch.randn(3, 5, 64) * 4).to(torch.bfloat16)
    s = torch.rand(64) * 3 + 0.25
    input_amax = (x.float().abs().amax((0, 1)) / s).max()
    recipe = load_recipe("int8-smoothquant")
    q = QuantLinear(linear, recipe.weights, recipe.inputs, input_amax, smooth=s)
    y = q(x)
    assert y.dtype == torch.bfloat16

    def bf16(v):
        return v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    sn = s.numpy()
    w = linear.weight.detach().float().numpy() * sn
    w_scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    w_ref = bf16(np.clip(np.rint(w / w_scale), -127, 127) * w_scale)
    x_s = x.float().numpy() / sn
    x_scale = np.float32(input_amax.item()) / np.float32(127)
    x_ref = bf16(np.clip(np.rint(x_s / x_scale), -127, 127) * x_scale)
    y_ref = x_ref @ w_ref.T + linear.bias.detach().double().numpy()
    np.testing.assert_allclose(y.double().detach().numpy(), y_ref, rtol=2e-2, atol=2e-2)
