"""Where ptq computes: PTQ_DEVICE, and the CUDA paths checked against the CPU (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from ptq.errors import PtqError
from ptq.execution.devices import default_device

FAST = ["--seq-len", "32", "--max-windows", "4", "--calib-samples", "4", "--quiet"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares a CUDA run with the CPU's")


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


def test_a_bad_ptq_device_is_one_line_exit_2(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PTQ_DEVICE", "nowhere")
    code, _, stderr = ptq_cli("compare", tiny_model, "--eval-data", text_file, "--out", tmp_path / "x", *FAST)
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
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].device), with_kwargs=True)
    ids = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    scores = evaluate({"a": model, "b": model}, ids, batch_size=2)
    assert scores["a"].perplexity == scores["b"].perplexity and scores["b"].kl_div == 0
    assert seen == [torch.device("cpu")] * 4


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("matmul", ["simulated", "fp8"])
def test_compare_on_cuda_gives_the_cpu_numbers(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch, matmul):
    if matmul == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 matmuls (compute capability 8.9+)")
    runs = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("PTQ_DEVICE", device)
        out = tmp_path / device
        code, _, stderr = ptq_cli(
            "compare",
            tiny_model,
            "--calib-data",
            text_file,
            "--eval-data",
            text_file,
            "--out",
            out,
            "--dtype",
            "float32",
            "--matmul",
            matmul,
            *FAST,
        )
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    assert runs["cuda"]["compute"]["device"] == "cuda"
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]], [runs["cuda"]["baseline"], *runs["cuda"]["variants"]]
    ):
        # float32 on both, up to summation order (and TF32-free cuBLAS); the FP8 matmul's bf16-free float32 output too
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3), (
            cpu["name"] if "name" in cpu else "bf16"
        )


@pytest.mark.cuda
@needs_cuda
def test_calibrate_and_eval_on_cuda_give_the_cpu_numbers(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    from ptq.calibration.calibrate import load_calibration

    amax = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("PTQ_DEVICE", device)
        calib = tmp_path / f"{device}.safetensors"
        code, _, stderr = ptq_cli(
            "calibrate", tiny_model, "--data", text_file, "--samples", "4", "--seq-len", "32", "-o", calib, "--quiet"
        )
        assert code == 0, stderr
        amax[device] = load_calibration(calib).input_amax
        code, _, stderr = ptq_cli(
            "eval",
            tiny_model,
            "--recipe",
            "fp8-e4m3",
            "--calib",
            calib,
            "--eval-data",
            text_file,
            "--tasks",
            "cloze",
            "--max-items",
            "8",
            "--seq-len",
            "32",
            "--max-windows",
            "4",
            "--dtype",
            "float32",
            "--out",
            tmp_path / f"eval-{device}",
            "--quiet",
        )
        assert code == 0, stderr
    for name, value in amax["cpu"].items():
        assert float(amax["cuda"][name]) == pytest.approx(float(value), rel=1e-4), name


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_low_memory_on_cuda_gives_the_cpu_numbers(family, ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    """--low-memory on the GPU: one decoder layer on it at a time, read from disk, the same float32 numbers."""
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
        code, _, stderr = ptq_cli(
            "compare",
            model,
            "--calib-data",
            text_file,
            "--eval-data",
            text_file,
            "--out",
            out,
            "--low-memory",
            "--matmul",
            "simulated",
            "--no-plots",
            *FAST,
        )
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    assert runs["cuda"]["compute"]["low_memory"] and runs["cuda"]["compute"]["device"] == "cuda"
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]], [runs["cuda"]["baseline"], *runs["cuda"]["variants"]]
    ):
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_device_map_on_cuda_gives_the_cpu_numbers(family, ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    """--device-map with a GPU limit smaller than the models: their first modules on the GPU, the others offloaded to
    CPU memory and copied to the GPU for each forward (the experts' grouped matmul too); the CPU's float32 numbers."""
    model = tiny_model
    if family != "llama":
        import families
        from conftest import make_tokenizer

        model = tmp_path / family
        families.build(family).save_pretrained(model)
        make_tokenizer().save_pretrained(model)
    runs = {}
    for device, extra in (("cpu", []), ("cuda", ["--device-map", "auto", "--max-memory", "0=400KB,cpu=1GB"])):
        monkeypatch.setenv("PTQ_DEVICE", device)
        out = tmp_path / device
        code, _, stderr = ptq_cli(
            "compare",
            model,
            "--calib-data",
            text_file,
            "--eval-data",
            text_file,
            "--out",
            out,
            "--dtype",
            "float32",
            "--matmul",
            "simulated",
            "--no-plots",
            *extra,
            *FAST,
        )
        assert code == 0, stderr
        runs[device] = json.loads((out / "results.json").read_text())
    where = runs["cuda"]["compute"]["placement"]
    assert any({"cuda:0", "cpu"} <= set(devices) for devices in where.values()), where  # a model split GPU / CPU memory
    for cpu, cuda in zip(
        [runs["cpu"]["baseline"], *runs["cpu"]["variants"]], [runs["cuda"]["baseline"], *runs["cuda"]["variants"]]
    ):
        assert cuda["perplexity"] == pytest.approx(cpu["perplexity"], rel=1e-3)
