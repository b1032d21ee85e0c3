"""Where ptq computes: PTQ_DEVICE, and the CUDA paths checked against the CPU (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from ptq.errors import PtqError
from ptq.runtime.devices import default_device

FAST = ["--seq-len", "32", "--max-windows", "4", "--calib-samples", "4", "--quiet"]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: compares a CUDA run with the CPU's"
)


def test_ptq_device_chooses_where_ptq_computes(monkeypatch):
    monkeypatch.setenv("PTQ_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")
    monkeypatch.setenv("PTQ_DEVICE", "tpu:banana")
    with pytest.raises(PtqError, match="PTQ_DEVICE='tpu:banana' is not a device"):
        default_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("PTQ_DEVICE", "cuda")
        with pytest.raises(PtqError, match="no CUDA device"):
            default_device()
    else:
        monkeypatch.setenv("PTQ_DEVICE", f"cuda:{torch.cuda.device_count()}")
        with pytest.raises(PtqError, match=f"torch sees {torch.cuda.device_count()} CUDA device"):
            default_device()
    # devices torch names but ptq does not compute on: one line (a Mac's mps was a RuntimeError deep in loading)
    for other in ("mps", "xpu", "meta"):
        monkeypatch.setenv("PTQ_DEVICE", other)
        with pytest.raises(
            PtqError, match=f"^PTQ_DEVICE='{other}': ptq computes on cpu or cuda .*, not {other}$"
        ):
            default_device()


def test_a_bad_ptq_device_is_one_line_exit_2(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PTQ_DEVICE", "nowhere")
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--eval-data", text_file, "--out", tmp_path / "x", *FAST
    )
    assert code == 2 and "PTQ_DEVICE='nowhere'" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_evaluate_feeds_each_model_on_its_own_device_and_scores_on_the_first(tiny_model):
    # A model whose parameters live elsewhere than the windows (export's reloaded model, accelerate's device_map)
    # gets its batch on its own device; its logits come back to the baseline's. On the CPU both are the CPU: the
    # batch each model sees is checked.
    from transformers import AutoModelForCausalLM

    from ptq.evaluation.evaluate import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["input_ids"].device), with_kwargs=True
    )
    ids = torch.randint(
        0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0)
    )
    scores = evaluate({"a": model, "b": model}, ids, batch_size=2)
    assert scores["a"].perplexity == scores["b"].perplexity and scores["b"].kl_div == 0
    assert seen == [torch.device("cpu")] * 4


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("matmul", ["simulated", "fp8"])
def test_compare_on_cuda_gives_the_cpu_numbers(ptq_run, tiny_model, tmp_path, monkeypatch, matmul):
    if matmul == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 matmuls (compute capability 8.9+)")
    runs = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("PTQ_DEVICE", device)
        out = tmp_path / device
        code, _, stderr = ptq_run("compare", tiny_model, out=out, dtype="float32", matmul=matmul)
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    assert runs["cuda"]["compute"]["device"] == "cuda"
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]],
        [runs["cuda"]["baseline"], *runs["cuda"]["variants"]],
    ):
        # float32 on both, up to summation order (and TF32-free cuBLAS); the FP8 matmul's bf16-free float32 output too
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3), (
            cpu["name"] if "name" in cpu else "bf16"
        )


@pytest.mark.cuda
@needs_cuda
def test_calibrate_and_eval_on_cuda_give_the_cpu_numbers(
    ptq_run, tiny_model, tmp_path, monkeypatch
):
    import re

    from families import TEXT

    from ptq.calibration.calibrate import load_calibration

    # the cloze task's items are lines that end a sentence with a plain word: one sentence a line (text_file has none)
    lines = tmp_path / "lines.txt"
    lines.write_text(re.sub(r"([.!?]) ", r"\1\n", TEXT * 3))
    amax = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("PTQ_DEVICE", device)
        calib = tmp_path / f"{device}.safetensors"
        code, _, stderr = ptq_run("calibrate", tiny_model, o=calib)
        assert code == 0, stderr
        amax[device] = load_calibration(calib).input_amax
        code, _, stderr = ptq_run(
            "eval",
            tiny_model,
            recipe="fp8-e4m3",
            calib=calib,
            eval_data=lines,
            tasks="cloze",
            max_items=8,
            dtype="float32",
            out=tmp_path / f"eval-{device}",
        )
        assert code == 0, stderr
    for name, value in amax["cpu"].items():
        assert float(amax["cuda"][name]) == pytest.approx(float(value), rel=1e-4), name


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "family, hidden_on_host", [("llama", False), ("mixtral", False), ("llama", True)]
)
def test_low_memory_on_cuda_gives_the_cpu_numbers(
    family, hidden_on_host, ptq_run, tiny_model, tmp_path, monkeypatch
):
    """--low-memory on the GPU: one decoder layer on it at a time, read from disk, the same float32 numbers; also
    with the hidden states waiting in host memory between layers (where the GPU could not hold them)."""
    from ptq.execution import streaming

    if hidden_on_host:
        monkeypatch.setattr(streaming, "HIDDEN_ON_GPU_FRACTION", 0)
    model = tiny_model
    if family != "llama":
        import families
        from conftest import make_tokenizer

        model = tmp_path / family
        families.build(family).save_pretrained(model)
        make_tokenizer().save_pretrained(model)
    runs = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("PTQ_DEVICE", device)
        out = tmp_path / device
        code, _, stderr = ptq_run(
            "compare", model, out=out, low_memory=True, matmul="simulated", no_plots=True
        )
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    assert runs["cuda"]["compute"]["low_memory"] and runs["cuda"]["compute"]["device"] == "cuda"
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]],
        [runs["cuda"]["baseline"], *runs["cuda"]["variants"]],
    ):
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_device_map_on_cuda_gives_the_cpu_numbers(
    family, ptq_run, tiny_model, tmp_path, monkeypatch
):
    """--device-map with a GPU limit smaller than the models: their first modules on the GPU, the others offloaded to
    CPU memory and copied to the GPU for each forward (the experts' grouped matmul too); the CPU's float32 numbers."""
    model = tiny_model
    if family != "llama":
        import families
        from conftest import make_tokenizer

        model = tmp_path / family
        families.build(family).save_pretrained(model)
        make_tokenizer().save_pretrained(model)
    # Each of the compare's 3 models (baseline, fp8-e4m3, int8) gets a third of the GPU limit, and accelerate keeps
    # room for the largest decoder layer on it. ptq's models of both families take (float32, as accelerate counts
    # them) about 265 KB for the baseline and 190-198 KB for a variant: 500KB (a third, 167 KB) splits every one
    # between GPU and CPU memory, by accelerate's device map; 400KB leaves the baseline all on the CPU, and from 600KB
    # the variants fit on the GPU (at 800KB, the H200 run of 2026-12-04 placed mixtral's three whole on the GPU).
    gpu_limit = "500KB"
    runs = {}
    for device, extra in (
        ("cpu", []),
        ("cuda", ["--device-map", "auto", "--max-memory", f"0={gpu_limit},cpu=1GB"]),
    ):
        monkeypatch.setenv("PTQ_DEVICE", device)
        out = tmp_path / device
        code, _, stderr = ptq_run(
            "compare", model, *extra, out=out, dtype="float32", matmul="simulated", no_plots=True
        )
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    where = runs["cuda"]["compute"]["placement"]
    assert all({"cuda:0", "cpu"} <= set(devices) for devices in where.values()), (
        where
    )  # each model split GPU / CPU
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]],
        [runs["cuda"]["baseline"], *runs["cuda"]["variants"]],
    ):
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3)


@pytest.mark.parametrize(
    "recipe_text",
    [
        "weights: {format: e4m3}\ninputs: {format: e4m3}\n",  # per-tensor
        "weights: {format: e4m3, granularity: channel}\ninputs: {format: e4m3, granularity: token, dynamic: true}\n",
    ],
)
def test_fp8_matmuls_where_the_cpu_scaled_mm_takes_per_tensor_scales_only(
    tiny_model, tmp_path, monkeypatch, request, recipe_text
):
    """torch 2.11's CPU torch._scaled_mm refuses any scale but a per-tensor one (an INTERNAL ASSERT; later versions
    take row-wise scales): the probe reads that refusal, and --matmul fp8 there multiplies with per-tensor or unit
    scales and applies the row-wise ones after, in float32: the simulation's logits, one torch._scaled_mm per layer."""
    import copy

    from transformers import AutoModelForCausalLM

    import ptq.quantization.quantize as quantize_module
    from ptq.calibration.calibrate import calibrate
    from ptq.calibration.clips import quantize_
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.recipes import load_recipe

    refusal = "Now _scaled_mm only supports per-tensor scaling for CPU backend."
    original, ops_original, calls = torch._scaled_mm, torch.ops.aten._scaled_mm, []

    def per_tensor_only(scaled_mm):
        def call(a, b, scale_a, scale_b, *args, **kwargs):
            if scale_a.numel() != 1 or scale_b.numel() != 1:
                raise RuntimeError(
                    f"(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED. {refusal}"
                )
            calls.append(1)
            return scaled_mm(a, b, scale_a, scale_b, *args, **kwargs)

        return call

    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:  # this torch's own CPU kernel (row-wise scales in versions after 2.11), asked through the public name
        original(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32
        )
        rowwise = True
    except RuntimeError:
        rowwise = False
    probe = quantize_module.cpu_scaled_mm_tensorwise_only
    request.addfinalizer(probe.cache_clear)  # the next test tries this torch's own kernel again
    probe.cache_clear()
    assert probe() is not rowwise
    probe.cache_clear()
    monkeypatch.setattr(torch.ops.aten, "_scaled_mm", per_tensor_only(ops_original))
    assert probe() is True

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
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
    monkeypatch.setattr(
        torch,
        "_scaled_mm",
        lambda a, b, scale_a, scale_b, **kwargs: per_tensor_only(original)(
            a, b, scale_a, scale_b, **kwargs
        ),
    )
    calls.clear()
    with torch.no_grad():
        want, got = simulated(input_ids=ids).logits, real(input_ids=ids).logits
    assert (
        len(calls) == 7 * model.config.num_hidden_layers
    )  # q k v o gate up down, each one real FP8 matmul
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
