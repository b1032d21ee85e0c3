"""--device-map: models placed by accelerate, offloaded where the devices cannot hold them (ptq/execution/placement.py).

Without a GPU, a --max-memory cpu limit smaller than the models sends their modules to disk: accelerate's offloading
hooks then load each module's tensors (weights, and the quantized layers' codes and scales) for its forward, the
same hooks that load CPU-offloaded modules onto a GPU. The numbers must be exactly those of the models in memory.
"""

from __future__ import annotations

import json

import families
import pytest
import torch

from ptq.calibration.calibrate import load_calibration

COMMON = ["--seq-len", "16", "--max-windows", "2", "--calib-samples", "2", "--no-plots"]
OFFLOADED = [
    "--device-map",
    "auto",
    "--max-memory",
    "cpu=450KB",
]  # less than the tiny models: some of each on disk


def _model_dir(family: str, tmp_path, tiny_model):
    if family == "llama":
        return tiny_model  # tied embeddings
    from conftest import make_tokenizer

    path = tmp_path / family
    families.build(family).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2"])
def test_compare_with_offloaded_models_equals_the_models_in_memory(
    family, tmp_path, ptq_cli, text_file, tiny_model, monkeypatch
):
    model = _model_dir(family, tmp_path, tiny_model)
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))  # the offload folders go under it
    data = [
        "--calib-data",
        text_file,
        "--eval-data",
        text_file,
        "--recipes",
        "fp8-e4m3,int8",
        *COMMON,
    ]
    code, _, err = ptq_cli("compare", model, *data, "--out", tmp_path / "memory")
    assert code == 0, err
    code, _, err = ptq_cli("compare", model, *data, *OFFLOADED, "--out", tmp_path / "placed")
    assert code == 0, err
    memory = json.loads((tmp_path / "memory" / "results.json").read_text())
    placed = json.loads((tmp_path / "placed" / "results.json").read_text())
    where = placed["compute"]["placement"]
    assert set(where) == {"bf16", "fp8-e4m3", "int8"}
    assert all("disk" in devices for devices in where.values()), where
    assert any("cpu" in devices for devices in where.values()), (
        where
    )  # a model split between memory and disk
    assert "on disk by accelerate (--device-map)" in placed["device"]
    assert memory["compute"]["placement"] is None  # in memory: nothing placed
    assert placed["baseline"]["perplexity"] == memory["baseline"]["perplexity"]
    assert (
        placed["calibration"]["layers"] == memory["calibration"]["layers"]
    )  # calibrated on the placed original
    for a, b in zip(memory["variants"], placed["variants"], strict=True):
        assert (a["name"], a["perplexity"], a["kl_div"], a["top1_agreement"]) == (
            b["name"],
            b["perplexity"],
            b["kl_div"],
            b["top1_agreement"],
        )
        assert a["snr_db"] == b["snr_db"]  # input SNR measured on the offloaded layers too
    assert "on disk by accelerate" in (tmp_path / "placed" / "report.md").read_text()
    offload = tmp_path / "cache" / "offload"
    assert offload.is_dir() and not any(
        offload.iterdir()
    )  # used for the disk, and emptied after the run


def test_offloading_to_a_disk_without_room_is_refused_before_writing(
    tmp_path, ptq_cli, text_file, tiny_model, monkeypatch
):
    """accelerate writes offloaded tensors through memory maps: a disk that filled under one ended the process with
    SIGBUS (exit 135, no message) and left the partly written folder, disk still full. The free space is checked
    first, and --max-memory's disk limit, which accelerate accepts and does not apply, is applied."""
    import shutil
    from collections import namedtuple

    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    args = [
        "eval",
        tiny_model,
        "--recipe",
        "fp8-e4m3",
        "--calib-data",
        text_file,
        "--eval-data",
        text_file,
        *COMMON[:-1],
        "-q",
    ]
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 4096)
    )  # 4 KiB free
    code, _, err = ptq_cli(
        *args, "--device-map", "auto", "--max-memory", "cpu=150KB", "--out", tmp_path / "full"
    )
    last = err.strip().splitlines()[-1]  # after eval's note that the text has no cloze items
    assert (
        code == 2 and "offloading part of the model to disk (--device-map) needs at least" in last
    ), err
    assert (
        "4.0 KiB free" in last and sum(line.startswith("error") for line in err.splitlines()) == 1
    )
    offload = tmp_path / "cache" / "offload"
    assert not offload.exists() or not any(offload.rglob("*.dat"))
    monkeypatch.setattr(shutil, "disk_usage", real)
    code, _, err = ptq_cli(
        *args, "--device-map", "auto", "--max-memory", "cpu=150KB,disk=1KB", "--out", tmp_path / "d"
    )
    assert code == 2 and "--max-memory's disk limit leaves it 1000 B" in err, err
    code, _, err = ptq_cli(
        *args, "--device-map", "auto", "--max-memory", "cpu=150KB,disk=1GB", "--out", tmp_path / "e"
    )
    assert code == 0, err


def test_calibrate_and_eval_with_offloaded_moe(tmp_path, ptq_cli, ptq_run, text_file, tiny_model):
    model = _model_dir("qwen3_moe", tmp_path, tiny_model)
    args = ["--data", text_file, "--seq-len", "16", "--samples", "2"]
    assert ptq_cli("calibrate", model, *args, "-o", tmp_path / "memory.safetensors")[0] == 0
    code, _, err = ptq_cli(
        "calibrate", model, *args, *OFFLOADED, "-o", tmp_path / "placed.safetensors"
    )
    assert code == 0, err
    memory, placed = (
        load_calibration(tmp_path / "memory.safetensors"),
        load_calibration(tmp_path / "placed.safetensors"),
    )
    assert memory.input_amax.keys() == placed.input_amax.keys()
    assert any(
        ".experts.3.down_proj" in name for name in placed.input_amax
    )  # every expert, through the preloaded module
    for name in memory.input_amax:
        assert torch.equal(memory.input_amax[name], placed.input_amax[name]), name
        assert torch.equal(memory.weight_amax[name], placed.weight_amax[name]), name
        assert torch.equal(memory.input_hist[name], placed.input_hist[name]), name
    evaluated = {}
    for name, extra in (("memory", []), ("placed", OFFLOADED)):
        code, _, err = ptq_run(
            "eval",
            model,
            *(extra[:-1] + ["cpu=150KB"] if extra else []),  # one model: a smaller limit
            quiet=None,
            recipe="fp8-e4m3",
            calib=tmp_path / "memory.safetensors",
            tasks="ptq_shakespeare",
            limit=3,
            seq_len=16,
            max_windows=2,
            out=tmp_path / f"eval-{name}",
        )
        assert code == 0, err
        evaluated[name] = json.loads((tmp_path / f"eval-{name}" / "results.json").read_text())
    assert "disk" in evaluated["placed"]["compute"]["placement"]["fp8-e4m3"]
    assert (
        evaluated["placed"]["config"]["perplexity"] == evaluated["memory"]["config"]["perplexity"]
    )
    # lm-eval runs the placed model as it is (accelerate's hooks move each block's weights in): the same task numbers
    assert (
        evaluated["placed"]["config"]["task_samples"]
        == evaluated["memory"]["config"]["task_samples"]
    )
    assert evaluated["placed"]["config"]["tasks"]["ptq_shakespeare"]["n"] == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-memory", "cpu=1GB"], "--max-memory limits what --device-map places"),
        (["--device-map", "everywhere"], "unknown --device-map 'everywhere'"),
        (
            ["--device-map", "auto", "--max-memory", "cpu=lots"],
            "--max-memory size 'lots' is not a size",
        ),
        (
            ["--device-map", "auto", "--max-memory", "cpu=1e400GiB"],
            "--max-memory size '1e400GiB' is not a size",
        ),
        (
            ["--device-map", "auto", "--max-memory", "cpu=1e-30GiB"],
            "--max-memory size '1e-30GiB' is less than a byte",
        ),
        (["--device-map", "auto", "--max-memory", "cpu"], "--max-memory 'cpu' is not DEVICE=SIZE"),
        (["--device-map", "auto", "--max-memory", f"{torch.cuda.device_count()}=1GB"], "GPU(s)"),
        (["--device-map", "auto", "--max-memory", "tpu=1GB"], "device 'tpu' is not a GPU index"),
        (
            ["--device-map", "auto", "--max-memory", "cpu=1GiB,cpu=2GiB"],
            "--max-memory names device cpu twice",
        ),
        (["--device-map", "auto", "--low-memory"], "--low-memory and --device-map"),
    ],
)
def test_bad_placement_options_are_one_line(
    args, message, tmp_path, ptq_cli, text_file, tiny_model
):
    code, out, err = ptq_cli(
        "compare", tiny_model, "--eval-data", text_file, *COMMON, *args, "--out", tmp_path / "r"
    )
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r" / "results.json").exists()


def test_quantize_with_offloaded_calibration_writes_the_same_files(
    tmp_path, ptq_cli, text_file, tiny_model
):
    args = ["--data", text_file, "--seq-len", "16", "--samples", "2", "--verify-windows", "2"]
    assert ptq_cli("quantize", tiny_model, *args, "-o", tmp_path / "memory")[0] == 0
    code, out, err = ptq_cli(
        "quantize",
        tiny_model,
        *args,
        "--device-map",
        "auto",
        "--max-memory",
        "cpu=150KB",  # one model
        "-o",
        tmp_path / "placed",
    )
    assert code == 0, err
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "placed" / name).read_bytes() == (
            tmp_path / "memory" / name
        ).read_bytes(), name
    info = json.loads((tmp_path / "placed" / "ptq-export.json").read_text())
    assert info["verification"] is None and "--device-map" in info["verification_skipped"]
    assert "not verified" in out


def test_limits_are_shared_between_the_models_held_at_once_and_the_report_says_where_they_went():
    from ptq.execution.placement import Placement, budgets, describe, parse

    placement = parse("sequential", "cpu=1.5GB, disk=10GB")
    assert placement == Placement("sequential", {"cpu": 1_500_000_000, "disk": 10_000_000_000})
    assert budgets(placement, 3) == {"cpu": 500_000_000, "disk": 3_333_333_333}
    assert budgets(placement, 3, held=10**9) == {
        "cpu": 500_000_000,
        "disk": 3_333_333_333,
    }  # the user's limits
    assert (
        describe({"bf16": {"cuda:0": 3, "cuda:1": 2, "cpu": 1}, "fp8-e4m3": {"cuda:0": 5}})
        == "placed over cuda:0, cuda:1 by accelerate (--device-map), offloaded to CPU memory"
    )
    assert (
        describe({"bf16": {"cpu": 2, "disk": 4}})
        == "placed in CPU memory and on disk by accelerate (--device-map)"
    )


def test_the_default_host_budget_counts_the_memory_the_models_already_hold(monkeypatch):
    """The models are loaded and quantized on the CPU before they are placed, and a module placed on the CPU stays
    where it is: the default budget is 90% of what is available plus what they hold (each storage once: variants
    share the tensors they do not quantize), not of what is left beside them."""
    from torch import nn

    from ptq.execution import placement as placing
    from ptq.runtime import resources

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(resources, "available_memory", lambda device: 1000)
    shared = nn.Linear(16, 16, bias=False)  # 1 KiB of float32
    a, b = nn.Sequential(shared, nn.Linear(16, 8)), nn.Sequential(shared)  # 544 bytes more in a
    assert placing.host_bytes([a, b]) == 1024 + 512 + 32
    assert placing.host_bytes([nn.Linear(4, 4, device="meta")]) == 0
    assert placing.budgets(placing.Placement(), 2) == {"cpu": 450}
    assert placing.budgets(placing.Placement(), 2, held=1568) == {"cpu": int(2568 * 0.9) // 2}


def test_a_placed_model_holds_no_buffer_in_two_modules(tmp_path):
    """ptq gives one input scale tensor to the layers whose inputs round alike, and accelerate moves a tensor that
    several submodules of one hooked block hold only once (named_buffers drops duplicates): on an H200 a CPU-offloaded
    mixture-of-experts layer, loaded whole by one hook, found its experts' scales on two devices. Shown here with the
    meta device standing in for the GPU; place() gives each module its own buffers before accelerate's hooks."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from ptq.calibration.clips import quantize_
    from ptq.execution.placement import Placement, own_buffers, place
    from ptq.models.matmuls import LinearExperts, linearize
    from ptq.quantization.quantize import QuantLinear
    from ptq.quantization.recipes import load_recipe

    def quantized():
        return quantize_(linearize(families.build("mixtral")), load_recipe("fp8-dynamic"), None)

    def scales(model):
        experts = next(m for m in model.modules() if isinstance(m, LinearExperts))
        return experts, [m.input_scale for m in experts.modules() if isinstance(m, QuantLinear)]

    experts, shared = scales(quantized())
    assert (
        len(shared) > 2 and len({id(s) for s in shared}) == 1
    )  # one tensor, as quantize_ leaves it
    model = quantized()
    own_buffers(model)
    experts, own = scales(model)
    assert len({id(s) for s in own}) == len(own) and all(torch.equal(s, shared[0]) for s in own)
    add_hook_to_module(experts, AlignDevicesHook(execution_device="meta", place_submodules=True))
    assert {s.device.type for s in scales(model)[1]} == {"meta"}  # every expert's scale moved
    placed = place(
        quantized(), Placement("auto", {"cpu": 10**9}), {"cpu": 10**9}, tmp_path / "offload"
    )
    buffers = [b for m in placed.modules() for b in m._buffers.values() if b is not None]
    assert len({id(b) for b in buffers}) == len(buffers)
