"""The paper's knobs against independent references: dynamic per-token and power-of-two / unscaled
scales (ml_dtypes casts), SmoothQuant's algebra, attention coverage through quantize_, observers via
calibration, layer selection and the plan rows."""

import copy

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from ptq.calibration.calibrate import calibrate, load_calibration, save_calibration
from ptq.calibration.clips import input_clip, quantize_
from ptq.calibration.observers import percentile_clip
from ptq.quantization.attention import attention_modules
from ptq.quantization.plan import calibrated_layers, resolve_plan
from ptq.quantization.quantize import QuantLinear, smoothing_factors
from ptq.quantization.recipes import parse_recipe

E4M3 = ml_dtypes.float8_e4m3fn


def recipe(**fields):
    base = {"name": "r", "weights": {"format": "e4m3"}, "inputs": {"format": "e4m3"}}
    return parse_recipe(base | fields)


def ref_e4m3(x: np.ndarray, scale) -> np.ndarray:
    """Independent reference: clip to +-448, cast with ml_dtypes (round to nearest even), multiply back."""
    scale = np.asarray(scale, np.float32)
    return (np.clip(x / scale, -448, 448).astype(E4M3).astype(np.float32) * scale).astype(
        np.float32
    )


def linear_and_input(seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(2, 5, 16) * torch.logspace(-2, 1, 16)  # channels of very different ranges
    return linear, x


def test_dynamic_per_token_scales_match_reference():
    linear, x = linear_and_input()
    r = recipe(
        weights={"format": "e4m3", "granularity": "channel"},
        inputs={"format": "e4m3", "dynamic": True},
    )
    q = QuantLinear(linear, r.weights, r.inputs, None)
    xn = x.numpy()
    token_scale = np.abs(xn).max(-1, keepdims=True) / np.float32(448)
    w = linear.weight.detach().numpy()
    x_q, w_q = (
        ref_e4m3(xn, token_scale),
        ref_e4m3(w, np.abs(w).max(1, keepdims=True) / np.float32(448)),
    )
    # the operands bit for bit (a scale one ulp off hides within the product's tolerance), then the product
    assert np.array_equal(q.quantize_input(x)[1].numpy(), x_q) and np.array_equal(
        q.weight.detach().numpy(), w_q
    )
    np.testing.assert_allclose(q(x).detach().numpy(), x_q @ w_q.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["pow2", "unscaled"])
def test_pow2_and_unscaled_scales_match_reference(mode):
    linear, x = linear_and_input(1)
    r = recipe(weights={"format": "e4m3", "scale": mode}, inputs={"format": "e4m3", "scale": mode})
    q = QuantLinear(linear, r.weights, r.inputs, torch.tensor(7.0) if mode == "pow2" else None)
    w = linear.weight.detach().numpy()
    if mode == "pow2":  # rounded up to a power of two: amax never overflows
        x_scale, w_scale = (
            2.0 ** np.ceil(np.log2(7.0 / 448)),
            2.0 ** np.ceil(np.log2(np.abs(w).max() / 448)),
        )
        assert float(q.input_scale) == x_scale == 2.0**-6
    else:
        x_scale = w_scale = 1.0
        assert float(q.input_scale) == 1.0 and float(q.weight_scale) == 1.0
    x_q, w_q = ref_e4m3(x.numpy(), x_scale), ref_e4m3(w, w_scale)
    assert np.array_equal(q.quantize_input(x)[1].numpy(), x_q) and np.array_equal(
        q.weight.detach().numpy(), w_q
    )
    np.testing.assert_allclose(q(x).detach().numpy(), x_q @ w_q.T, rtol=1e-5, atol=1e-6)


def test_smoothquant_preserves_the_product_and_evens_out_channels():
    linear, x = linear_and_input(2)
    channel_amax = x.abs().reshape(-1, 16).amax(0)
    s = smoothing_factors(channel_amax, linear.weight, 0.5)
    w_amax = linear.weight.detach().abs().amax(0)
    torch.testing.assert_close(s, (channel_amax.sqrt() / w_amax.sqrt()))
    bf16 = recipe(
        weights={"format": "bf16"}, inputs={"format": "bf16"}
    )  # near-lossless: the algebra only
    q = QuantLinear(linear, bf16.weights, bf16.inputs, None, smooth=s)
    torch.testing.assert_close(q(x), linear(x), rtol=2e-2, atol=2e-2)
    smoothed = channel_amax / s
    assert smoothed.max() / smoothed.min() < channel_amax.max() / channel_amax.min()


def test_smoothquant_int8_beats_naive_int8_on_outlier_channels():
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(4, 16, 64)
    x[..., :2] *= 60  # two outlier channels, as in LLM activations
    channel_amax = x.abs().reshape(-1, 64).amax(0)
    naive_r = recipe(
        weights={"format": "int8", "granularity": "channel"}, inputs={"format": "int8"}
    )
    naive = QuantLinear(linear, naive_r.weights, naive_r.inputs, channel_amax.max())
    s = smoothing_factors(channel_amax, linear.weight, 0.5)
    smooth = QuantLinear(
        linear, naive_r.weights, naive_r.inputs, (channel_amax / s).max(), smooth=s
    )
    exact = linear(x)
    assert (smooth(x) - exact).pow(2).mean() < 0.5 * (naive(x) - exact).pow(2).mean()


ATTENTION = {"attention": {"format": "e4m3", "observer": "percentile", "percentile": 99.9}}


def test_calibration_covers_attention_and_quantize_uses_the_observer(tiny_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    r = recipe(**ATTENTION, inputs={"format": "e4m3", "observer": "mse"})
    layers = calibrated_layers(model, r)
    attn = list(attention_modules(model))
    assert [f"{a}.{t}" for a in attn for t in ("key", "probs", "query", "value")] == [
        n
        for n in layers
        if "self_attn." in n and n.split(".")[-1] in ("key", "probs", "query", "value")
    ]
    ids = torch.randint(0, 200, (3, 16), generator=torch.Generator().manual_seed(0))
    captured = {}
    q_proj = model.model.layers[1].self_attn.q_proj
    hook = q_proj.register_forward_hook(
        lambda m, a, out: captured.setdefault("q", []).append(out.detach())
    )
    calibration = calibrate(model, ids, layers, batch_size=2)
    hook.remove()
    assert model.config._attn_implementation != "ptq"  # calibration leaves the model as it was
    # The probabilities are softmax outputs: amax <= 1, histogram counts every probability entry.
    probs = "model.layers.1.self_attn.probs"
    assert 0 < float(calibration.input_amax[probs]) <= 1
    heads = model.config.num_attention_heads
    assert int(calibration.input_hist[probs].sum()) == 3 * heads * 16 * 16
    # Query amax: q_proj's output after RoPE, never larger than sqrt(2) x the pre-RoPE amax per pair.
    pre = torch.cat(captured["q"]).abs().max()
    assert (
        0 < float(calibration.input_amax["model.layers.1.self_attn.query"]) <= float(pre) * 2**0.5
    )
    path = tmp_path / "c.safetensors"
    calibration.metadata |= {
        "data": "test",
        "data_sha256": "0" * 64,
        "windows": 3,
        "seq_len": 16,
        "tokens": 48,
    }
    save_calibration(calibration, path)
    loaded = load_calibration(path)
    assert torch.equal(loaded.input_hist[probs], calibration.input_hist[probs])
    clip = input_clip(loaded, probs, r.attention)
    assert float(clip) == pytest.approx(
        percentile_clip(loaded.input_hist[probs], float(loaded.input_amax[probs]), 99.9)
    )
    quantized = quantize_(copy.deepcopy(model), r, loaded)
    aq = quantized.model.layers[1].self_attn.ptq_attention
    assert set(aq.quantizers) == {"query", "key", "value", "probs"}
    assert float(aq.quantizers["probs"].scale) == pytest.approx(float(clip) / 448)
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.5)


def test_linear_amax_does_not_depend_on_attention_being_calibrated_too(tiny_model):
    """Observing attention leaves the forward as the baseline runs it: a Linear input's statistics are
    the same to the bit whether or not the calibrated recipes also cover attention."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 200, (3, 16), generator=torch.Generator().manual_seed(0))
    linears = calibrated_layers(model, recipe())
    with_attention = calibrated_layers(model, recipe(**ATTENTION))
    assert set(linears) < set(with_attention)
    alone, together = (
        calibrate(model, ids, linears, batch_size=2),
        calibrate(model, ids, with_attention, batch_size=2),
    )
    for name in linears:
        assert torch.equal(alone.input_amax[name], together.input_amax[name]), name
        assert torch.equal(alone.input_hist[name], together.input_hist[name]), name


def test_smoothquant_through_calibration_and_selection(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    r = recipe(
        weights={"format": "int8", "granularity": "channel"},
        inputs={"format": "int8"},
        smoothquant={"alpha": 0.5},
        ignore=["lm_head", "model.layers.0.*"],
    )
    smoothed = resolve_plan(model, r).smoothed
    assert smoothed and not any(n.startswith("model.layers.0.") for n in smoothed)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    calibration = calibrate(model, ids, calibrated_layers(model, r), channels=smoothed)
    quantized = quantize_(copy.deepcopy(model), r, calibration)
    layer = quantized.model.layers[1].self_attn.q_proj
    amax_c = calibration.input_channel_amax["model.layers.1.self_attn.q_proj"]
    assert layer.smooth is not None and float(layer.input_scale) == pytest.approx(
        float((amax_c / layer.smooth).max()) / 127
    )
    assert (
        quantized.model.layers[0].self_attn.q_proj.weights.format.name == "bf16"
    )  # ignored: baseline


def test_smoothquant_under_vllm_shares_the_smoothed_weights_scale_and_rounds_int8_inputs_as_vllm(
    tiny_model,
):
    # vLLM serves a smoothed checkpoint as plain W8A8: q/k/v (and gate/up) share the largest of their per-tensor
    # weight scales, taken from the weights as stored (W * s), and int8 inputs round over [-128, 127]. The shared
    # scale came from the unsmoothed weights, so W * s saturated; smoothed inputs kept [-127, 127].
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    fp8 = recipe(smoothquant={"alpha": 0.5})
    int8 = recipe(weights={"format": "int8"}, inputs={"format": "int8"}, smoothquant={"alpha": 0.5})
    smoothed = resolve_plan(model, fp8).smoothed
    calibration = calibrate(model, ids, calibrated_layers(model, fp8), channels=smoothed)
    quantized = quantize_(copy.deepcopy(model), fp8, calibration, target="vllm")
    attn = "model.layers.1.self_attn"
    stored = []
    for p in ("q_proj", "k_proj", "v_proj"):
        w = model.get_submodule(f"{attn}.{p}").weight.detach().double().numpy()
        s = smoothing_factors(
            calibration.input_channel_amax[f"{attn}.{p}"],
            model.get_submodule(f"{attn}.{p}").weight,
            0.5,
        )
        stored.append(w * s.double().numpy())
    want = np.float32(max(np.abs(w).max() for w in stored).astype(np.float32) / np.float32(448))
    for p in ("q_proj", "k_proj", "v_proj"):
        assert float(quantized.get_submodule(f"{attn}.{p}").weight_scale) == want, p
    quantized = quantize_(copy.deepcopy(model), int8, calibration, target="vllm")
    assert quantized.get_submodule(f"{attn}.q_proj").inputs.lowest == -128.0
    assert (
        quantize_(copy.deepcopy(model), int8, calibration)
        .get_submodule(f"{attn}.q_proj")
        .inputs.lowest
        is None
    )


def test_describe_plan_lists_linear_and_attention_tensors(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    r = recipe(
        attention={"format": "e4m3", "tensors": ["probs"]},
        kv_cache={"format": "e4m3"},
        ignore=["lm_head", "model.layers.1.*"],
    )
    rows = {row["name"]: row for row in resolve_plan(model, r).rows()}
    assert (
        rows["model.layers.0.self_attn.probs"]["inputs"] == "e4m3 per-tensor"
        and rows["model.layers.0.self_attn.probs"]["quantized"]
    )
    assert (
        rows["model.layers.0.self_attn.kv_cache.key"]["quantized"]
        and not rows["model.layers.0.self_attn.query"]["quantized"]
    )
    assert (
        not rows["model.layers.1.self_attn.probs"]["quantized"]
        and not rows["model.layers.1.mlp.up_proj"]["quantized"]
    )
    assert (
        rows["model.layers.0.mlp.up_proj"]["weights"] == "e4m3 per-tensor"
        and rows["lm_head"]["weights"] == "bf16"
    )


def test_compare_sweep_with_paper_recipes_reports_sqnr(ptq_run, tiny_model, tmp_path):
    import json

    out = tmp_path / "out"
    code, stdout, stderr = ptq_run(
        "compare",
        tiny_model,
        recipes="paper-e4m3,paper-int8-smoothquant,fp8-e4m3-dynamic",
        calib_samples=2,
        max_windows=2,
        out=out,
    )
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == [
        "paper-e4m3",
        "paper-int8-smoothquant",
        "fp8-e4m3-dynamic",
    ]
    assert results["variants"][0]["recipe"]["attention"].startswith("e4m3 per-tensor best")
    assert results["variants"][1]["recipe"]["smoothquant_alpha"] == 0.85
    tensors = {row["tensor"]: row for row in results["diagnostics"]["tensors"]}
    assert "model.layers.0.self_attn.probs" in tensors and "model.layers.1.mlp.down_proj" in tensors
    assert all(row["sqnr_e4m3_db"] > 20 for row in tensors.values())
    assert results["diagnostics"]["worst_int8"][0] in tensors
    assert (
        "<summary><b>Per-tensor diagnostics (calibration data)</b></summary>"
        in (out / "report.md").read_text()
    )


def test_summary_lists_linear_layers_and_check_model_needs_their_weights(tiny_model):
    from ptq.calibration.calibrate import Calibration, summary_rows
    from ptq.errors import PtqError

    calibration = Calibration(
        {"a.self_attn.query": torch.tensor(99.0), "a.q_proj": torch.tensor(1.0)},
        {"a.q_proj": torch.tensor(2.0)},
    )
    assert [row["layer"] for row in summary_rows(calibration)["largest"]] == ["a.q_proj"]
    # the median of an even count is the mean of the middle two, as numpy's (torch's median takes the lower one)
    amaxes = [3.0, 1.0, 4.0, 1.5]
    names = [f"l{i}" for i in range(len(amaxes))]
    even = Calibration(
        {n: torch.tensor(a) for n, a in zip(names, amaxes)}, {n: torch.tensor(1.0) for n in names}
    )
    assert summary_rows(even)["input_amax_median"] == float(np.median(amaxes)) == 2.25
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    name = "model.layers.0.mlp.up_proj"  # an input amax without the weight amax that identifies the model
    with pytest.raises(PtqError, match="made for another model"):
        Calibration({name: torch.tensor(1.0)}, {}).check_model(model, [name])


def test_residual_recipe_calibrates_and_quantizes(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    r = recipe(residual={"format": "e4m3"}, ignore=["lm_head", "*.residual.input"])
    names = [n for n in calibrated_layers(model, r) if ".residual." in n]
    assert names == [
        f"model.layers.{i}.residual.{t}" for i in (0, 1) for t in ("attn_out", "mid", "mlp_out")
    ]
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    calibration = calibrate(model, ids, calibrated_layers(model, r))
    assert float(calibration.input_amax["model.layers.1.residual.mid"]) > 0
    quantized = quantize_(copy.deepcopy(model), r, calibration)
    made = quantized.model.layers[1].ptq_residual
    assert set(made) == {"attn_out", "mid", "mlp_out"}
    assert float(made["mid"].scale) == pytest.approx(
        float(calibration.input_amax["model.layers.1.residual.mid"]) / 448
    )
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.5)
    rows = {row["name"]: row for row in resolve_plan(model, r).rows()}
    assert (
        rows["model.layers.0.residual.mid"]["quantized"]
        and not rows["model.layers.0.residual.input"]["quantized"]
    )


def test_rounding_noise_example_reproduces_compare_and_nudges_only_calibrated_scales(
    ptq_run, tiny_model, text_file, tmp_path
):
    """examples/rounding_noise.py (docs/paper.md): its as-calibrated row is what `ptq compare` reports, and a
    nudge of the calibrated amax leaves a recipe without calibrated scales exactly where it was."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "rounding_noise", Path(__file__).parent.parent / "examples" / "rounding_noise.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = dict(
        windows=3, calib_samples=2, seq_len=32, calib_data=str(text_file), eval_data=str(text_file)
    )
    rows = example.measure(str(tiny_model), ["fp8-e4m3", "fp8-e4m3-dynamic"], repeats=2, **common)
    assert [len(runs) for runs in rows.values()] == [3, 3]
    dynamic = rows["fp8-e4m3-dynamic"]
    assert all(
        run == dynamic[0] for run in dynamic
    )  # per-token scales: nothing calibrated to nudge
    from ptq.calibration.calibrate import Calibration

    calibration = Calibration(
        {"a": torch.tensor(3.0)}, {}, input_channel_amax={"a": torch.tensor([1.0, 2.0])}
    )
    moved = example.nudged(calibration, seed=1)
    for before, after in (
        (calibration.input_amax["a"], moved.input_amax["a"]),
        (calibration.input_channel_amax["a"], moved.input_channel_amax["a"]),
    ):
        assert not torch.equal(before, after) and torch.allclose(before, after, rtol=1e-5, atol=0)

    out = tmp_path / "out"
    code, _, stderr = ptq_run(
        "compare",
        tiny_model,
        recipes="fp8-e4m3,fp8-e4m3-dynamic",
        calib_samples=2,
        max_windows=3,
        out=out,
        no_plots=True,
    )
    assert code == 0, stderr
    for v in json.loads((out / "results.json").read_text())["variants"]:
        assert rows[v["name"]][0]["ppl_delta_pct"] == pytest.approx(v["ppl_delta_pct"], abs=1e-9)
        assert rows[v["name"]][0]["kl_div"] == pytest.approx(v["kl_div"], rel=1e-9)
