"""The calibrate and compare commands end to end on the tiny model, and every bad input the issue
names: one line on stderr, exit code 2, nothing left behind."""

import json
import shutil

import pytest
import torch

from ptq.calibration.calibrate import load_calibration
from ptq.execution.devices import cpu_model

FAST = ["--seq-len", "32", "--max-windows", "4", "--calib-samples", "4", "--quiet"]


def test_compare_writes_report_and_results(ptq_cli, tiny_model, text_file, tmp_path):
    out = tmp_path / "rep"
    code, stdout, stderr = ptq_cli(
        "compare", tiny_model, "--calib-data", text_file, "--eval-data", text_file, "--out", out, *FAST
    )
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    assert results["model"]["name"] == str(tiny_model)
    assert results["eval"]["seq_len"] == 32 and results["eval"]["windows"] == 4 and results["eval"]["tokens"] == 4 * 31
    assert results["baseline"]["name"] == "bf16"
    assert [v["name"] for v in results["variants"]] == ["fp8-e4m3", "int8"]
    for v in results["variants"]:
        assert v["perplexity"] > 1 and 0 <= v["accuracy"] <= 1 and v["kl_div"] >= 0 and 0 <= v["top1_agreement"] <= 1
        assert v["ppl_delta_pct"] == pytest.approx(100 * (v["perplexity"] / results["baseline"]["perplexity"] - 1))
    report = (out / "report.md").read_text()
    assert "| fp8-e4m3 | e4m3 per-tensor | e4m3 per-tensor |" in report and "int8 per-channel" in report
    assert "stride 32" in report and "no BOS" in report and "amax / 127" in report
    assert "fp8-e4m3" in stdout and "wrote" in stdout


def test_compare_with_real_fp8_matmuls_and_bf16_compute(ptq_cli, tiny_model, text_file, tmp_path):
    """--matmul fp8 (torch._scaled_mm, which CPUs run too) gives the simulation's numbers up to summation order;
    --dtype bfloat16 (the CUDA default) runs the whole model in bf16 and says so in the report."""
    runs = {}
    tasks = ["--tasks", "ptq_shakespeare", "--limit", "3"]  # lm-eval runs the real FP8 matmuls too
    for name, extra in (("sim", tasks), ("fp8", ["--matmul", "fp8", *tasks]), ("bf16", ["--dtype", "bfloat16"])):
        out = tmp_path / name
        code, _, stderr = ptq_cli(
            "compare", tiny_model, "--calib-data", text_file, "--eval-data", text_file, "--out", out, *FAST, *extra
        )
        assert code == 0, stderr
        runs[name] = json.loads((out / "results.json").read_text())
    assert runs["sim"]["compute"] == {
        "device": "cpu",
        "dtype": "float32",
        "matmul": "simulated",
        "low_memory": False,
        "blockwise_simulated": None,
        "placement": None,
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),  # AVX2, AVX512, ...: what the numbers were made with
        "cpu": cpu_model(),
    }
    assert (
        f"cpu ({cpu_model()}, {runs['sim']['compute']['cpu_kernels']} kernels), float32 compute"
        in (tmp_path / "sim" / "report.md").read_text()
    )
    assert runs["fp8"]["compute"]["matmul"] == "fp8" and runs["bf16"]["compute"]["dtype"] == "bfloat16"
    sim, fp8, bf16 = (runs[k]["variants"][0] for k in ("sim", "fp8", "bf16"))
    assert fp8["perplexity"] == pytest.approx(sim["perplexity"], rel=1e-5)
    assert fp8["task_samples"] == sim["task_samples"] and len(sim["task_samples"]["ptq_shakespeare"]["acc"]) == 3
    assert bf16["perplexity"] == pytest.approx(sim["perplexity"], rel=0.05) and bf16["perplexity"] != sim["perplexity"]
    assert "torch._scaled_mm" in (tmp_path / "fp8" / "report.md").read_text()
    assert "run in bfloat16 in every variant" in (tmp_path / "bf16" / "report.md").read_text()


def test_cpu_model_is_the_processors_model_name(tmp_path):
    """From /proc/cpuinfo's first "model name" line (x86 Linux); a cpuinfo without one (ARM's) falls back to the
    platform's processor name, and a bare architecture name is no model."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor @ 2.60GHz\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor @ 2.60GHz\n"
    )
    assert cpu_model(str(cpuinfo)) == "Intel(R) Xeon(R) Processor @ 2.60GHz"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")
    import platform

    expected = platform.processor().strip()
    assert cpu_model(str(cpuinfo)) == (expected if expected not in ("", "x86_64", "aarch64", "arm64", "i386") else None)
    assert cpu_model(str(tmp_path / "missing")) == cpu_model(str(cpuinfo))


@pytest.mark.parametrize(
    "args, message",
    [(["--dtype", "float64"], "unknown compute dtype 'float64'"), (["--matmul", "int4"], "unknown matmul 'int4'")],
)
def test_bad_compute_options_exit_2_with_one_line(ptq_cli, tiny_model, text_file, tmp_path, args, message):
    code, _, stderr = ptq_cli("compare", tiny_model, "--eval-data", text_file, "--out", tmp_path / "x", *FAST, *args)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_an_error_message_keeps_its_square_brackets(ptq_cli, tiny_model, text_file, tmp_path):
    # Printed through rich: without escaping, "[lm_head]" in a message was read as markup and vanished.
    missing = tmp_path / "ignore[lm_head].yaml"
    code, _, stderr = ptq_cli("compare", tiny_model, "--eval-data", text_file, "--recipes", missing, *FAST)
    assert code == 2 and "ignore[lm_head].yaml" in stderr and len(stderr.strip().splitlines()) == 1


def test_calibration_file_is_reused_and_gives_the_same_results(ptq_cli, tiny_model, text_file, tmp_path):
    calib = tmp_path / "c.safetensors"
    code, stdout, stderr = ptq_cli(
        "calibrate", tiny_model, "--data", text_file, "--samples", "4", "--seq-len", "32", "-o", calib, "--quiet"
    )
    assert code == 0, stderr
    assert "largest input amax" in stdout
    cal = load_calibration(calib)
    assert len(cal.input_amax) == 14 and cal.metadata["tokens"] == 4 * 32 and cal.metadata["model"] == str(tiny_model)
    assert cal.metadata["data_sha256"] and cal.metadata["versions"]["torch"]

    a, b = tmp_path / "a", tmp_path / "b"
    assert ptq_cli("compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", a, *FAST)[0] == 0
    assert (
        ptq_cli("compare", tiny_model, "--calib-data", text_file, "--eval-data", text_file, "--out", b, *FAST)[0] == 0
    )
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (a, b))
    assert [v["perplexity"] for v in ra["variants"]] == [v["perplexity"] for v in rb["variants"]]


def test_e5m2_and_a_custom_recipe_file(ptq_cli, tiny_model, text_file, tmp_path):
    recipe = tmp_path / "no-mlp.yaml"
    recipe.write_text("name: no-mlp\nignore: [lm_head, '*.mlp.*']\nweights: {format: e4m3}\ninputs: {format: e4m3}\n")
    code, _, stderr = ptq_cli(
        "compare",
        tiny_model,
        "--recipes",
        f"fp8-e5m2,{recipe}",
        "--calib-data",
        text_file,
        "--eval-data",
        text_file,
        "--out",
        tmp_path / "r",
        *FAST,
    )
    assert code == 0, stderr
    names = [v["name"] for v in json.loads((tmp_path / "r" / "results.json").read_text())["variants"]]
    assert names == ["fp8-e5m2", "no-mlp"]


def corrupted_model(src, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(src, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    return bad


@pytest.mark.parametrize(
    "case",
    [
        "missing model",
        "corrupted model",
        "missing data",
        "empty data",
        "too little data",
        "unknown recipe",
        "invalid recipe",
        "other model's calibration",
        "unreadable calibration",
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    case, ptq_cli, tiny_model, other_tiny_model, text_file, tmp_path
):
    out = tmp_path / "out"
    model, data, extra = str(tiny_model), str(text_file), []
    if case == "missing model":
        model, expected = str(tmp_path / "no-such-model"), "does not exist"
    elif case == "corrupted model":
        model, expected = str(corrupted_model(tiny_model, tmp_path)), "damaged or not safetensors"
    elif case == "missing data":
        data, expected = str(tmp_path / "nothing.txt"), "data path not found"
    elif case == "empty data":
        (tmp_path / "empty.txt").write_text("  \n")
        data, expected = str(tmp_path / "empty.txt"), "no text"
    elif case == "too little data":
        (tmp_path / "short.txt").write_text("Who's there?")
        data, expected = str(tmp_path / "short.txt"), "not enough text for one window"
    elif case == "unknown recipe":
        extra, expected = ["--recipes", "fp9"], "unknown recipe 'fp9'"
    elif case == "invalid recipe":
        (tmp_path / "r.yaml").write_text("name: r\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamik: true}\n")
        extra, expected = ["--recipes", str(tmp_path / "r.yaml")], "unknown key 'dynamik'"
    elif case == "other model's calibration":
        calib = tmp_path / "other.safetensors"
        assert (
            ptq_cli(
                "calibrate",
                other_tiny_model,
                "--data",
                text_file,
                "--samples",
                "2",
                "--seq-len",
                "32",
                "-o",
                calib,
                "--quiet",
            )[0]
            == 0
        )
        extra, expected = ["--calib", str(calib)], "made for another model"
    else:
        (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
        extra, expected = ["--calib", str(tmp_path / "junk.safetensors")], "not a readable calibration file"
    calib_source = [] if "--calib" in extra else ["--calib-data", data]
    code, stdout, stderr = ptq_cli("compare", model, *calib_source, "--eval-data", data, "--out", out, *extra, *FAST)
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in stderr
    assert not out.exists()


def test_existing_outputs_need_force(ptq_cli, tiny_model, text_file, tmp_path):
    calib = tmp_path / "c.safetensors"
    args = ("calibrate", tiny_model, "--data", text_file, "--samples", "2", "--seq-len", "32", "-o", calib, "--quiet")
    assert ptq_cli(*args)[0] == 0
    before = calib.read_bytes()
    code, _, stderr = ptq_cli(*args)
    assert code == 2 and "already exists (use --force" in stderr and calib.read_bytes() == before
    assert ptq_cli(*args, "--force")[0] == 0

    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("keep me")
    code, _, stderr = ptq_cli("compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", out, *FAST)
    assert code == 2 and "report.md already exists" in stderr
    assert (out / "report.md").read_text() == "keep me" and not (out / "results.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_python_dash_m_entry_point(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ptq", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "calibrate" in result.stdout and "compare" in result.stdout
