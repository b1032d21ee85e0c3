"""The calibrate and compare commands end to end on the tiny model, and every bad input the issue
names: one line on stderr, exit code 2, nothing left behind."""

import json
import shutil

import pytest
import torch

from ptq.calibration.calibrate import load_calibration
from ptq.runtime.devices import cpu_model

FAST = ["--seq-len", "32", "--max-windows", "4", "--calib-samples", "4", "--quiet"]


def test_compare_writes_report_and_results(ptq_run, tiny_model, tmp_path):
    out = tmp_path / "rep"
    code, stdout, stderr = ptq_run("compare", tiny_model, out=out)
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    assert results["model"]["name"] == str(tiny_model)
    assert (
        results["eval"]["seq_len"] == 32
        and results["eval"]["windows"] == 4
        and results["eval"]["tokens"] == 4 * 31
    )
    assert results["baseline"]["name"] == "bf16"
    assert [v["name"] for v in results["variants"]] == ["fp8-e4m3", "int8"]
    for v in results["variants"]:
        assert (
            v["perplexity"] > 1
            and 0 <= v["accuracy"] <= 1
            and v["kl_div"] >= 0
            and 0 <= v["top1_agreement"] <= 1
        )
        assert v["ppl_delta_pct"] == pytest.approx(
            100 * (v["perplexity"] / results["baseline"]["perplexity"] - 1)
        )
    report = (out / "report.md").read_text()
    assert (
        "| fp8-e4m3 | e4m3 per-tensor | e4m3 per-tensor |" in report
        and "int8 per-channel" in report
    )
    assert "stride 32" in report and "no BOS" in report and "amax / 127" in report
    assert "fp8-e4m3" in stdout and "wrote" in stdout


def test_compare_with_real_fp8_matmuls_and_bf16_compute(ptq_run, tiny_model, tmp_path):
    """--matmul fp8 (torch._scaled_mm, which CPUs run too) gives the simulation's numbers up to summation order;
    --dtype bfloat16 (the CUDA default) runs the whole model in bf16 and says so in the report."""
    runs = {}
    tasks = ["--tasks", "ptq_shakespeare", "--limit", "3"]  # lm-eval runs the real FP8 matmuls too
    for name, extra in (
        ("sim", tasks),
        ("fp8", ["--matmul", "fp8", *tasks]),
        ("bf16", ["--dtype", "bfloat16"]),
    ):
        out = tmp_path / name
        code, _, stderr = ptq_run("compare", tiny_model, *extra, out=out)
        assert code == 0, stderr
        runs[name] = json.loads((out / "results.json").read_text())
    assert (
        runs["sim"]["compute"]
        == {
            "device": "cpu",
            "dtype": "float32",
            "matmul": "simulated",
            "low_memory": False,
            "blockwise_simulated": None,
            "blockwise_partial_simulated": None,
            "placement": None,
            "cpu_kernels": torch.backends.cpu.get_cpu_capability(),  # AVX2, AVX512, ...: what the numbers were made with
            "cpu": cpu_model(),
        }
    )
    assert (
        f"cpu ({cpu_model()}, {runs['sim']['compute']['cpu_kernels']} kernels), float32 compute"
        in (tmp_path / "sim" / "report.md").read_text()
    )
    assert (
        runs["fp8"]["compute"]["matmul"] == "fp8" and runs["bf16"]["compute"]["dtype"] == "bfloat16"
    )
    sim, fp8, bf16 = (runs[k]["variants"][0] for k in ("sim", "fp8", "bf16"))
    assert fp8["perplexity"] == pytest.approx(sim["perplexity"], rel=1e-5)
    assert (
        fp8["task_samples"] == sim["task_samples"]
        and len(sim["task_samples"]["ptq_shakespeare"]["acc"]) == 3
    )
    assert (
        bf16["perplexity"] == pytest.approx(sim["perplexity"], rel=0.05)
        and bf16["perplexity"] != sim["perplexity"]
    )
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
    assert cpu_model(str(cpuinfo)) == (
        expected if expected not in ("", "x86_64", "aarch64", "arm64", "i386") else None
    )
    assert cpu_model(str(tmp_path / "missing")) == cpu_model(str(cpuinfo))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "float64"], "unknown compute dtype 'float64'"),
        (["--matmul", "int4"], "unknown matmul 'int4'"),
    ],
)
def test_bad_compute_options_exit_2_with_one_line(
    ptq_cli, tiny_model, text_file, tmp_path, args, message
):
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--eval-data", text_file, "--out", tmp_path / "x", *FAST, *args
    )
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_an_error_message_keeps_its_square_brackets(ptq_cli, tiny_model, text_file, tmp_path):
    # Printed through rich: without escaping, "[lm_head]" in a message was read as markup and vanished.
    missing = tmp_path / "ignore[lm_head].yaml"
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--eval-data", text_file, "--recipes", missing, *FAST
    )
    assert code == 2 and "ignore[lm_head].yaml" in stderr and len(stderr.strip().splitlines()) == 1


def test_calibration_file_is_reused_and_gives_the_same_results(
    ptq_cli, ptq_run, tiny_model, text_file, tmp_path
):
    calib = tmp_path / "c.safetensors"
    code, stdout, stderr = ptq_run("calibrate", tiny_model, o=calib)
    assert code == 0, stderr
    assert "largest input amax" in stdout
    cal = load_calibration(calib)
    assert (
        len(cal.input_amax) == 14
        and cal.metadata["tokens"] == 4 * 32
        and cal.metadata["model"] == str(tiny_model)
    )
    assert cal.metadata["data_sha256"] and cal.metadata["versions"]["torch"]
    assert (
        cal.metadata["versions"]["tokenizers"] and cal.metadata["versions"]["numpy"]
    )  # windows, intervals

    a, b = tmp_path / "a", tmp_path / "b"
    assert (
        ptq_cli(
            "compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", a, *FAST
        )[0]
        == 0
    )
    assert ptq_run("compare", tiny_model, out=b)[0] == 0
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (a, b))
    assert [v["perplexity"] for v in ra["variants"]] == [v["perplexity"] for v in rb["variants"]]


def test_e5m2_and_a_custom_recipe_file(ptq_run, tiny_model, tmp_path):
    recipe = tmp_path / "no-mlp.yaml"
    recipe.write_text(
        "name: no-mlp\nignore: [lm_head, '*.mlp.*']\nweights: {format: e4m3}\ninputs: {format: e4m3}\n"
    )
    code, _, stderr = ptq_run(
        "compare", tiny_model, recipes=f"fp8-e5m2,{recipe}", out=tmp_path / "r"
    )
    assert code == 0, stderr
    names = [
        v["name"] for v in json.loads((tmp_path / "r" / "results.json").read_text())["variants"]
    ]
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
        "calibration folder",
        "broken tokenizer",
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    case, ptq_cli, ptq_run, tiny_model, other_tiny_model, text_file, tmp_path
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
        (tmp_path / "r.yaml").write_text(
            "name: r\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamik: true}\n"
        )
        extra, expected = ["--recipes", str(tmp_path / "r.yaml")], "unknown key 'dynamik'"
    elif case == "other model's calibration":
        calib = tmp_path / "other.safetensors"
        assert ptq_run("calibrate", other_tiny_model, samples=2, o=calib)[0] == 0
        extra, expected = ["--calib", str(calib)], "made for another model"
    elif case == "broken tokenizer":  # the JSON error alone did not say which file
        broken = tmp_path / "broken-tokenizer"
        shutil.copytree(tiny_model, broken)
        (broken / "tokenizer.json").write_text("{garbage")
        model, expected = (
            str(broken),
            f"{broken / 'tokenizer.json'} is not valid JSON (Expecting property name",
        )
    elif case == "calibration folder":
        # a folder beside the output (one that held the output would be refused first: an output
        # is never written into an input of the run)
        (tmp_path / "calibrations").mkdir()
        extra, expected = (
            ["--calib", str(tmp_path / "calibrations")],
            f"calibration file {tmp_path / 'calibrations'} is a folder: give the .safetensors",
        )
    else:
        (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
        extra, expected = (
            ["--calib", str(tmp_path / "junk.safetensors")],
            "not a readable calibration file",
        )
    calib_source = [] if "--calib" in extra else ["--calib-data", data]
    code, stdout, stderr = ptq_cli(
        "compare", model, *calib_source, "--eval-data", data, "--out", out, *extra, *FAST
    )
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "recipes, expected", [("fp8-dynamic,mxfp8", "need no calibration"), (",", "no recipe given")]
)
def test_calibrate_with_nothing_to_calibrate_stops_before_loading_the_model(
    recipes, expected, ptq_cli, tiny_model, text_file, tmp_path, monkeypatch
):
    # It used to load the model (minutes for a large one) before saying "nothing to calibrate"
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("ptq.commands.common.load_model", never)
    out = tmp_path / "c.safetensors"
    code, _, err = ptq_cli(
        "calibrate", tiny_model, "--recipe", recipes, "--data", text_file, "-o", out, "-q"
    )
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and not out.exists()


@pytest.mark.parametrize("command", ["compare", "inspect", "eval", "quantize"])
def test_an_empty_recipe_list_is_refused_not_a_baseline_alone(
    command, ptq_cli, tiny_model, text_file, tmp_path
):
    # `ptq compare --recipes "$RECIPES"` with an empty variable compared nothing and passed every gate (exit 0)
    out = tmp_path / "out"
    args = {
        "compare": (
            "--recipes",
            "",
            "--eval-data",
            text_file,
            "--out",
            out,
            "--max-ppl-increase",
            "1%",
            *FAST,
        ),
        "inspect": ("--recipe", " , "),
        "eval": ("--recipe", "", "--eval-data", text_file, "--out", out, "--tasks", "", *FAST),
        "quantize": ("--recipe", "", "-o", out, "--no-verify", "-q"),
    }[command]
    code, _, err = ptq_cli(command, tiny_model, *args)
    assert code == 2 and "no recipe given" in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and not out.exists()


def test_existing_outputs_need_force(ptq_cli, tiny_model, text_file, tmp_path):
    calib = tmp_path / "c.safetensors"
    args = (
        "calibrate",
        tiny_model,
        "--data",
        text_file,
        "--samples",
        "2",
        "--seq-len",
        "32",
        "-o",
        calib,
        "--quiet",
    )
    assert ptq_cli(*args)[0] == 0
    before = calib.read_bytes()
    code, _, stderr = ptq_cli(*args)
    assert code == 2 and "already exists (use --force" in stderr and calib.read_bytes() == before
    assert ptq_cli(*args, "--force")[0] == 0

    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("keep me")
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--calib", calib, "--eval-data", text_file, "--out", out, *FAST
    )
    assert code == 2 and "report.md already exists" in stderr
    assert (out / "report.md").read_text() == "keep me" and not (out / "results.json").exists()
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )  # no temp files left


def test_python_dash_m_entry_point(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ptq", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "calibrate" in result.stdout and "compare" in result.stdout


def one_line(stderr: str) -> bool:
    return len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: ")


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny GPT-2 (learned position table of 256 rows, transformer.wpe) with the tests' tokenizer."""
    from conftest import make_tokenizer
    from families import build

    path = tmp_path_factory.mktemp("gpt2")
    build("gpt2").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("task, shots, pool", [("ptq_arith", 8, 4), ("ptq_shakespeare", 50, 5)])
def test_num_fewshot_beyond_a_tasks_pool_is_one_line(
    ptq_cli, tiny_model, text_file, tmp_path, task, shots, pool
):
    code, _, stderr = ptq_cli(
        "eval", tiny_model, "--eval-data", text_file, *FAST[:4], "--tasks", task, "--limit", "2",
        "--num-fewshot", str(shots), "--out", tmp_path / "o", "--quiet",
    )  # fmt: skip
    assert code == 2 and one_line(stderr), stderr
    assert f"{task} has only {pool} few-shot examples (--num-fewshot {shots})" in stderr
    assert not (tmp_path / "o").exists()


def test_seq_len_beyond_learned_positions_is_refused_and_beyond_rotary_warned(
    ptq_cli, tiny_model, gpt2_model, text_file, tmp_path
):
    for args in (
        (
            "calibrate",
            gpt2_model,
            "--data",
            text_file,
            "--samples",
            "2",
            "-o",
            tmp_path / "c.safetensors",
        ),
        (
            "compare",
            gpt2_model,
            "--calib-data",
            text_file,
            "--eval-data",
            text_file,
            "--out",
            tmp_path / "r",
        ),
        ("eval", gpt2_model, "--eval-data", text_file, "--tasks", "", "--out", tmp_path / "e"),
    ):
        code, _, stderr = ptq_cli(*args, "--seq-len", "257", "--quiet")
        assert code == 2 and one_line(stderr), stderr
        assert "--seq-len 257" in stderr and "'transformer.wpe') has 256 positions" in stderr
    assert not any((tmp_path / name).exists() for name in ("c.safetensors", "r", "e"))
    long_text = tmp_path / "long.txt"
    long_text.write_text(text_file.read_text() * 10)
    code, _, stderr = ptq_cli(
        "eval", tiny_model, "--eval-data", long_text, "--seq-len", "300", "--max-windows", "1", "--tasks", "",
        "--out", tmp_path / "rope", "--quiet",
    )  # fmt: skip
    assert code == 0, stderr
    assert (
        stderr.count("warning: --seq-len 300 is beyond the context") == 1
        and "(256 positions)" in stderr
    )


def test_huge_numbers_are_capped_or_refused_in_one_line(ptq_cli, tiny_model, text_file, tmp_path):
    calib = tmp_path / "c.safetensors"
    code, _, stderr = ptq_cli(
        "calibrate", tiny_model, "--data", text_file, "--samples", "2", "--seq-len", "32", "-o", calib,
        "--batch-size", "99999999999999999999", "--quiet",
    )  # fmt: skip
    assert code == 0 and calib.is_file(), (
        stderr
    )  # larger than the windows: all of them in one batch
    code, _, stderr = ptq_cli(
        "eval", tiny_model, "--eval-data", text_file, *FAST[:4], "--tasks", "ptq_arith", "--limit", "1e20",
        "--out", tmp_path / "e", "--quiet",
    )  # fmt: skip
    assert code == 2 and one_line(stderr) and "--limit 1e+20 is too large" in stderr
    for size in ("inf", "1e300"):
        code, _, stderr = ptq_cli(
            "quantize", tiny_model, "--data", text_file, "--samples", "2", "--seq-len", "32", "--shard-size", size,
            "--no-verify", "-o", tmp_path / "q", "--quiet",
        )  # fmt: skip
        assert code == 2 and one_line(stderr) and "--shard-size must be a number of MB" in stderr, (
            stderr
        )
    assert not (tmp_path / "q").exists() and not (tmp_path / "e").exists()


def test_quantize_refuses_compare_results_of_another_model(
    ptq_cli, tiny_model, other_tiny_model, text_file, tmp_path
):
    other = tmp_path / "other"
    code, _, stderr = ptq_cli(
        "compare", other_tiny_model, "--recipes", "fp8-e4m3", "--calib-data", text_file, "--eval-data", text_file,
        "--out", other, "--no-plots", *FAST,
    )  # fmt: skip
    assert code == 0, stderr
    args = (
        "quantize",
        tiny_model,
        "--data",
        text_file,
        "--samples",
        "4",
        "--seq-len",
        "32",
        "--no-verify",
        "-q",
    )
    code, _, stderr = ptq_cli(*args, "--compare-results", other, "-o", tmp_path / "q")
    assert code == 2 and one_line(stderr), stderr
    assert (
        f"compares another model ('{other_tiny_model}'" in stderr and not (tmp_path / "q").exists()
    )
    mine = tmp_path / "mine"
    assert ptq_cli(
        "compare", tiny_model, "--recipes", "fp8-e4m3", "--calib-data", text_file, "--eval-data", text_file,
        "--out", mine, "--no-plots", *FAST,
    )[0] == 0  # fmt: skip
    code, _, stderr = ptq_cli(*args, "--compare-results", mine, "-o", tmp_path / "q2")
    assert code == 0, stderr
    info = json.loads((tmp_path / "q2" / "ptq-export.json").read_text())
    assert info["compare"]["model"] == str(tiny_model)
    assert info["compare"]["calibration"] == {"data": str(text_file), "windows": 4, "seq_len": 32}
    # the same model and recipe, calibrated on fewer windows (as this test did, unnoticed, before the check): the card
    # would quote numbers of other scales
    code, _, stderr = ptq_cli(
        *args[:5], "2", *args[6:], "--compare-results", mine, "-o", tmp_path / "q3"
    )
    assert code == 2 and one_line(stderr), stderr
    assert (
        f"{mine / 'results.json'} was calibrated otherwise ({text_file}, 4 x 32 tokens) than this checkpoint"
        in stderr
    )
    assert "quantize with the compare's calibration (--calib), or compare again" in stderr
    assert not (tmp_path / "q3").exists()


def test_verify_windows_with_no_verify_is_refused_not_dropped(ptq_cli, tiny_model, tmp_path):
    out = tmp_path / "q"
    code, _, err = ptq_cli(
        "quantize",
        tiny_model,
        "--recipe",
        "fp8-dynamic",
        "--no-verify",
        "--verify-windows",
        "20",
        "-o",
        out,
        "-q",
    )
    assert (
        code == 2
        and "--verify-windows does not apply with --no-verify" in err
        and "Traceback" not in err
    ), err
    assert not out.exists()


def test_fewer_calibration_windows_than_asked_for_are_said(ptq_run, tiny_model, tmp_path):
    from ptq.calibration.calibrate import load_calibration

    out = tmp_path / "c.safetensors"
    code, _, err = ptq_run("calibrate", tiny_model, samples=100000, o=out)
    assert code == 0, err
    windows = load_calibration(out).metadata["windows"]
    assert 0 < windows < 100000
    assert f"calibrating on {windows}, not the 100000 asked for" in " ".join(err.split())
    code, _, err = ptq_run("calibrate", tiny_model, samples=8, o=out, force=True)
    assert code == 0 and "asked for" not in err, err


def test_calibration_options_where_nothing_is_calibrated_are_named_in_a_note(
    ptq_cli, ptq_run, tiny_model, text_file, tmp_path
):
    """With --calib (a file reused) or recipes that need no calibration, --calib-samples, --on-unseen and the others
    of a calibration run here do nothing: said in a note, not dropped in silence; used, they bring no note."""
    calib = tmp_path / "c.safetensors"
    assert ptq_run("calibrate", tiny_model, samples=2, o=calib)[0] == 0
    common = (
        "--eval-data",
        text_file,
        *FAST[:4],
        "--no-plots",
        "-q",
        "--calib-samples",
        "3",
        "--on-unseen",
        "fail",
    )
    code, _, err = ptq_cli(
        "compare", tiny_model, "--calib", calib, "--out", tmp_path / "a", *common
    )
    assert code == 0, err
    assert (
        f"note: --calib-samples, --on-unseen not used: the calibration is read from {calib}"
        in " ".join(err.split())
    )
    code, _, err = ptq_cli(
        "compare", tiny_model, "--recipes", "fp8-dynamic", "--out", tmp_path / "b", *common
    )
    assert code == 0, err
    assert (
        "note: --calib-samples, --on-unseen not used: recipe(s) fp8-dynamic need no calibration"
        in " ".join(err.split())
    )
    code, _, err = ptq_cli(
        "quantize", tiny_model, "--recipe", "fp8-e4m3", "--calib", calib, "--samples", "3", *FAST[:2], "--no-verify",
        "-o", tmp_path / "q", "-q",
    )  # fmt: skip
    assert code == 0 and "note: --samples not used: the calibration is read from" in " ".join(
        err.split()
    ), err
    code, _, err = ptq_cli(
        "compare", tiny_model, "--out", tmp_path / "c", *common
    )  # calibrated here: used
    assert code == 0 and "not used" not in err, err


def test_calibration_options_a_run_does_not_use_are_refused(
    ptq_cli, ptq_run, tiny_model, text_file, tmp_path
):
    """bf16 needs no calibration: --calib-data (even a file that does not exist) and --calib are refused, not
    dropped; so is --calib for a quantize recipe that computes its scales on the fly."""
    calib = tmp_path / "c.safetensors"
    assert ptq_run("calibrate", tiny_model, samples=2, o=calib)[0] == 0
    base = (
        "eval",
        tiny_model,
        "--eval-data",
        text_file,
        *FAST[:4],
        "--tasks",
        "",
        "--out",
        tmp_path / "e",
        "-q",
    )
    for extra, flag in (
        (("--calib-data", tmp_path / "nosuch.txt"), "--calib-data"),
        (("--calib", calib), "--calib"),
        (("--calib", tmp_path / "nosuch.safetensors"), "--calib"),
    ):
        code, _, stderr = ptq_cli(*base, *extra)
        assert code == 2 and one_line(stderr), stderr
        assert f"{flag} is not used: recipe bf16 needs no calibration" in stderr
        code, _, stderr = ptq_cli(
            "compare", tiny_model, "--recipes", "fp8-dynamic", "--eval-data", text_file, *FAST[:4],
            "--out", tmp_path / "c", "-q", *extra,
        )  # fmt: skip
        assert code == 2 and one_line(stderr) and f"{flag} is not used" in stderr, stderr
    code, _, stderr = ptq_cli(
        "quantize", tiny_model, "--recipe", "fp8-dynamic", "--calib", calib, "--seq-len", "32", "--no-verify",
        "-o", tmp_path / "q", "-q",
    )  # fmt: skip
    assert code == 2 and one_line(stderr) and "--calib is not used: recipe fp8-dynamic" in stderr, (
        stderr
    )
    assert not any(p.exists() for p in (tmp_path / "e", tmp_path / "c", tmp_path / "q"))


@pytest.mark.parametrize(
    "args, flag",
    [
        (["eval", "m", "--max-windows", "0"], "--max-windows"),
        (["compare", "m", "--seq-len", "1"], "--seq-len"),
        (["quantize", "m", "-o", "x", "--shard-size", "nan"], "--shard-size"),
        (["eval", "m", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_option_parser_errors_are_one_line(ptq_cli, args, flag):
    code, stdout, stderr = ptq_cli(*args)
    assert code == 2 and one_line(stderr) and flag in stderr and not stdout, stderr
    code, stdout, _ = ptq_cli(args[0], "--help")
    assert code == 0 and "Usage" in stdout  # --help as typer prints it
    assert (flag in stdout) != flag.startswith("--no-such")


def test_eval_by_default_scores_the_cloze_task_where_lm_eval_can_run(
    tiny_model, text_file, ptq_cli, tmp_path
):
    """eval's --tasks default ('auto') is the cloze task with the model whole in memory, and none layer by layer
    (--low-memory: lm-eval needs the whole model), with a note, where it used to refuse its own default. An
    explicit task layer by layer is still refused in one line."""
    base = (
        "eval",
        tiny_model,
        *FAST[:4],
        "--force",
    )  # the default evaluation text: long enough for cloze items
    code, _, err = ptq_cli(*base, "--out", tmp_path / "whole", "--limit", "2")
    assert code == 0, err
    assert [
        t["name"] for t in json.loads((tmp_path / "whole" / "results.json").read_text())["tasks"]
    ] == ["cloze"]
    code, _, err = ptq_cli(*base, "--out", tmp_path / "layered", "--low-memory")
    assert code == 0, err
    assert "note: no task accuracy layer by layer (--low-memory)" in err
    results = json.loads((tmp_path / "layered" / "results.json").read_text())
    assert not results["tasks"] and results["compute"]["low_memory"]
    code, _, err = ptq_cli(*base, "--out", tmp_path / "asked", "--low-memory", "--tasks", "cloze")
    assert code == 2 and one_line(err) and "--tasks needs the whole model in memory" in err


def test_max_items_without_a_cloze_task_is_refused_and_caps_the_default_one(
    tiny_model, text_file, ptq_cli, tmp_path
):
    """--max-items caps only the cloze items: given where no cloze task runs, it was dropped silently."""
    from ptq.commands.options import DEFAULT_MAX_ITEMS

    refusal = (
        "error: --max-items caps the cloze task's items, and this run scores no cloze task: add cloze to --tasks, "
        "or drop --max-items (--limit caps every task)"
    )
    for args in (("compare", tiny_model), ("eval", tiny_model, "--tasks", "ptq_arith")):
        code, out, err = ptq_cli(*args, "--max-items", "5", "--out", tmp_path / "refused")
        assert code == 2 and out == "" and err.strip() == refusal
    assert not (tmp_path / "refused").exists()
    code, out, err = ptq_cli(
        "eval", tiny_model, *FAST[:4], "--max-items", "3", "--out", tmp_path / "three", "-q"
    )
    assert code == 0, err
    assert [
        (t["name"], t["n"])
        for t in json.loads((tmp_path / "three" / "results.json").read_text())["tasks"]
    ] == [("cloze", 3)]
    _, help_text, _ = ptq_cli("eval", "--help")
    assert f"[default: ({DEFAULT_MAX_ITEMS})]" in " ".join(help_text.split())


def test_eval_prints_a_missing_interval_and_a_bracketed_path_as_they_are(
    tiny_model, text_file, ptq_cli, tmp_path
):
    """rich read "[nan, nan]" (fewer windows than an interval needs) and "[abc]" in a path as markup and dropped them."""
    out_dir = tmp_path / "run[abc]"
    args = (
        "eval",
        tiny_model,
        "--eval-data",
        text_file,
        "--seq-len",
        "32",
        "--max-windows",
        "2",
        "--tasks",
        "",
    )
    code, out, err = ptq_cli(*args, "--out", out_dir, "-q")
    assert code == 0, err
    first, last = out.strip().splitlines()
    assert first.startswith(f"{tiny_model} with bf16: perplexity ") and first.endswith(
        " (no interval: fewer than 4 windows) on 2 windows x 32 tokens"
    ), first
    assert last == f"wrote {out_dir / 'report.md'} and {out_dir / 'results.json'}"


def test_eval_by_default_on_a_text_without_cloze_items_gives_perplexity_with_a_note(
    tiny_model, ptq_cli, tmp_path
):
    """The default task is not the user's request: a text with no cloze item (one line) is evaluated, with a note
    saying why there is no accuracy. Asked for by name, the cloze task on that text is refused in one line."""
    text = tmp_path / "one-line.txt"
    text.write_text("the cat sat on the mat and then the cat sat on the mat again. " * 20)
    base = ("eval", tiny_model, "--eval-data", text, "--seq-len", "16", "--max-windows", "2", "-q")
    code, out, err = ptq_cli(*base, "--out", tmp_path / "auto")
    assert code == 0, err
    assert err.strip() == (
        f"note: no cloze accuracy (no line of {text} ends a sentence with a lowercase word that occurs earlier in "
        "its 200-600 character passage): perplexity only; --tasks names other tasks"
    )
    assert (
        not json.loads((tmp_path / "auto" / "results.json").read_text())["tasks"]
        and "perplexity" in out
    )
    code, out, err = ptq_cli(*base, "--out", tmp_path / "asked", "--tasks", "cloze")
    assert (
        code == 2
        and one_line(err)
        and f"error: task 'cloze' has no items: no line of {text} ends" in err
    )
    for option in (
        ("--limit", "5"),
        ("--num-fewshot", "1"),
        ("--max-items", "3"),
    ):  # task options, none to apply to
        code, out, err = ptq_cli(*base, "--out", tmp_path / "options", *option)
        assert (
            code == 2
            and one_line(err)
            and "apply to task accuracy, and this run scores none" in err
        ), err


def test_the_console_table_never_prints_a_small_kl_as_zero(tmp_path, capsys, monkeypatch):
    """A KL of 3.4e-06 (int8 on a tiny MoE) printed as 0.00000 reads as a variant identical to the baseline: the
    console table writes it as the report does (report.kl_text)."""
    import sample_results

    from ptq import cli

    monkeypatch.setenv("COLUMNS", "200")
    results = sample_results.compare_results(
        variants=[sample_results.variant("int8", 1.0, kl_div=3.4e-06)]
    )
    cli._print_compare(results, tmp_path)
    out = capsys.readouterr().out
    assert "0.0000034" in out and "0.00000 " not in out


@pytest.mark.parametrize(
    "args, name",
    [
        (("inspect", ""), "'model'"),
        (("compare", "TINY", "--out", ""), "'--out'"),
        (("eval", "TINY", "--out", " "), "'--out'"),
        (("calibrate", "TINY", "-o", ""), "'--output' / '-o'"),
        (("quantize", "TINY", "-o", ""), "'--output' / '-o'"),
        (("compare", "TINY", "--calib", ""), "'--calib'"),
        (("report", ""), "'RESULTS.json'"),
    ],
)
def test_an_empty_model_or_path_is_refused_not_read_as_a_default_or_the_current_folder(
    ptq_cli, tiny_model, tmp_path, monkeypatch, args, name
):
    """`ptq inspect ""` showed the offline default model; `--out ""` wrote the report into the current folder."""
    monkeypatch.chdir(tmp_path)
    code, out, err = ptq_cli(*(str(tiny_model) if a == "TINY" else a for a in args))
    assert code == 2 and out == "" and one_line(err), err
    assert err.startswith(f"error: Invalid value for {name}: is empty: give a")
    assert list(tmp_path.iterdir()) == []


def test_report_never_writes_over_the_results_it_reads(ptq_cli, tmp_path):
    from sample_results import compare_results

    from ptq.reporting.results import to_json

    results = tmp_path / "results.json"
    results.write_text(json.dumps(to_json(compare_results())))
    code, out, err = ptq_cli("report", results)
    assert code == 0 and out.startswith("# ptq compare"), err  # a results file report reads
    before = results.read_bytes()
    previous = tmp_path / "previous.json"
    previous.write_bytes(before)
    for target, what in (
        (results, f"the results file {results}"),
        (tmp_path / "." / "results.json", f"the results file {results}"),
        (previous, f"the previous results file {previous}"),
    ):
        code, out, err = ptq_cli(
            "report", results, "--previous", previous, "-o", target, "--force", "--no-plots"
        )
        assert code == 2 and one_line(err) and f"it is {what}, read by this run" in err, err
    assert results.read_bytes() == before and previous.read_bytes() == before
    for flag in (
        "--no-plots",
        "--force",
    ):  # options for written files, where none is written: said, not ignored
        code, out, err = ptq_cli("report", results, flag)
        assert code == 2 and one_line(err) and f"{flag} applies with --output" in err and not out, (
            err
        )


def test_a_tokenizer_with_ids_beyond_the_models_embedding_is_refused_before_a_forward(
    ptq_cli, text_file, tmp_path
):
    """Another model's tokenizer (ids up to its own vocabulary): an IndexError from the embedding, exit 1, before."""
    from conftest import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    model = tmp_path / "small-vocab"
    LlamaForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    window = ("--seq-len", "32", "-q")
    for args in (
        (
            "eval",
            model,
            "--eval-data",
            text_file,
            "--tasks",
            "",
            "--out",
            tmp_path / "e",
            "--max-windows",
            "2",
        ),
        (
            "calibrate",
            model,
            "--data",
            text_file,
            "--samples",
            "2",
            "-o",
            tmp_path / "c.safetensors",
        ),
    ):
        code, out, err = ptq_cli(*args, *window)
        assert code == 2 and out == "" and one_line(err), err
        assert (
            f"the tokenizer of model '{model}' gives token id" in err
            and "its embedding has 50 rows" in err
        )


@pytest.mark.parametrize(
    "recipe, why",
    [
        (
            "name: typo\ninclude: ['model.layer.*']\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamic: true}\n",
            "layers left out by the recipe (not matched by its include patterns)",
        ),
        (
            "name: typo\nweights: {format: e4m3, granularity: group, group_size: 7}\n"
            "inputs: {format: e4m3, dynamic: true}\n",
            "is not a multiple of the weight group of 7",
        ),
    ],
)
def test_a_recipe_that_quantizes_nothing_is_refused_not_reported_as_a_variant(
    ptq_cli, tiny_model, text_file, tmp_path, recipe, why
):
    """A typo in `include` (or a group no layer's width takes) left every layer in 16 bits: compare reported the
    16-bit model under the recipe's name, +0.00%, and passed its gates; quantize already refused it. The baseline
    recipe, evaluated on its own, and inspect, which shows the plan, still run."""
    from test_faults import one_error_line

    path = tmp_path / "typo.yaml"
    path.write_text(recipe)
    static = tmp_path / "static.yaml"  # with inputs to calibrate
    static.write_text(recipe.replace(", dynamic: true", ""))
    evaluation = ("--eval-data", text_file, "--seq-len", "16", "--max-windows", "2", "-q")
    runs = {
        "compare": (
            "compare",
            tiny_model,
            "--recipes",
            f"fp8-e4m3,{path}",
            *evaluation,
            "--max-ppl-increase",
            "50%",
        ),
        "eval": ("eval", tiny_model, "--recipe", path, *evaluation),
        "calibrate": (
            "calibrate",
            tiny_model,
            "--recipe",
            static,
            "--data",
            text_file,
            "--seq-len",
            "16",
        ),
    }
    for command, args in runs.items():
        out = tmp_path / command
        code, _, err = ptq_cli(*args, "--out" if command != "calibrate" else "-o", out)
        assert code == 2 and one_error_line(err), (command, err)
        assert "error: recipe 'typo' quantizes no layer of this model (" in err and why in err, (
            command,
            err,
        )
        assert not out.exists()
    code, _, err = ptq_cli(
        "eval", tiny_model, "--recipe", "bf16", *evaluation, "--out", tmp_path / "bf16"
    )
    assert code == 0, err
    code, out, err = ptq_cli("inspect", tiny_model, "--recipe", path)
    assert code == 0 and "typo: typo; quantizes 0 of" in out, err


def test_a_recipe_name_given_twice_or_the_baselines_is_named(ptq_cli, tiny_model, tmp_path):
    # "each recipe may appear once, and not as the baseline 'bf16'" named neither the recipe nor the files
    from ptq.quantization.recipes import recipes_dir

    same = tmp_path / "mine.yaml"
    same.write_text(
        "name: fp8-e4m3\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamic: true}\n"
    )
    baseline = tmp_path / "base.yaml"
    baseline.write_text("name: bf16\nweights: {format: e4m3}\ninputs: {format: e4m3}\n")
    builtin = recipes_dir() / "fp8-e4m3.yaml"
    twice = "each recipe may appear once (a report row and a gate are named by it)"
    for recipes, message in (
        (
            "fp8-e4m3,int8,fp8-e4m3",
            f"recipe name 'fp8-e4m3' is given twice ({builtin}, {builtin}): {twice}",
        ),
        (f"fp8-e4m3,{same}", f"recipe name 'fp8-e4m3' is given twice ({builtin}, {same}): {twice}"),
        (
            str(baseline),
            f"recipe name 'bf16' is the baseline's ({baseline}): every compare has the baseline; a variant",
        ),
    ):
        code, _, err = ptq_cli(
            "compare", tiny_model, "--recipes", recipes, "--out", tmp_path / "out", "-q"
        )
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"error: {message}" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command, panels",
    [
        (
            "compare",
            {
                "Options": ["--recipes", "--target"],
                "Output": ["--out", "--force", "--no-plots", "--quiet", "--json"],
                "Data": ["--eval-data", "--seq-len", "--max-windows"],
                "Calibration": ["--calib", "--calib-data", "--calib-samples", "--on-unseen"],
                "Tasks": ["--tasks", "--max-items", "--num-fewshot", "--limit"],
                "Gates": ["--max-ppl-increase", "--min-accuracy-recovery", "--max-kl"],
                "Hardware and placement": ["--batch-size", "--dtype", "--device-map", "--matmul"],
                "Loading and safety": [
                    "--trust-remote-code",
                    "--allow-pickle",
                    "--strict-coverage",
                ],
            },
        ),
        (
            "quantize",
            {
                "Output": ["--output", "--force"],
                "Data": ["--data", "--seq-len"],
                "Calibration": ["--calib", "--samples", "--calibrate-all-experts"],
                "Checkpoint": ["--verify", "--verify-windows", "--shard-size", "--push-to-hub"],
                "Hardware and placement": ["--low-memory", "--max-memory"],
                "Loading and safety": ["--no-memory-check"],
            },
        ),
    ],
)
def test_help_groups_the_options_in_panels(ptq_cli, monkeypatch, command, panels):
    """`ptq compare --help` is not one panel of 35 options: each option is shown in its group's
    panel, the panels in a fixed order."""
    import re

    monkeypatch.setenv("COLUMNS", "200")
    code, stdout, _ = ptq_cli(command, "--help")
    assert code == 0
    shown = {
        m.group(1): re.findall(r"^│ [ *]*(--[\w-]+)", m.group(2), flags=re.MULTILINE)
        for m in re.finditer(r"╭─ (.+?) ─+╮\n(.*?)╰", stdout, flags=re.DOTALL)
    }
    assert [p for p in shown if p in panels] == list(panels)  # in this order
    for panel, flags in panels.items():
        assert set(flags) <= set(shown[panel]), (panel, shown[panel])
    every = [flag for flags in shown.values() for flag in flags]
    assert len(every) == len(set(every))  # each option in one panel


def test_ptq_run_is_the_small_run_with_the_tests_flags_laid_over(ptq_run, tiny_model, text_file):
    """The helper the tests invoke the CLI with: its defaults, keyword -> flag, None drops, no flag twice."""
    assert ptq_run.argv("compare", tiny_model, out="r") == [
        "compare",
        str(tiny_model),
        *("--calib-data", str(text_file), "--eval-data", str(text_file), "--calib-samples", "4"),
        *("--seq-len", "32", "--max-windows", "4", "--quiet", "--out", "r"),
    ]
    assert ptq_run.argv("calibrate", "m", "--resume", seq_len=16, quiet=None, o="c.st") == [
        *("calibrate", "m", "--resume", "--data", str(text_file), "--samples", "4"),
        *("--seq-len", "16", "-o", "c.st"),
    ]
    assert ptq_run.argv(
        "quantize", "m", data=None, samples=None, no_verify=True, shard_size=0.5
    ) == [
        *("quantize", "m", "--seq-len", "32", "--quiet", "--no-verify", "--shard-size", "0.5"),
    ]
    assert ptq_run.argv("eval", "m", max_windows=None, tasks="") == [
        *("eval", "m", "--eval-data", str(text_file), "--seq-len", "32", "--quiet", "--tasks", ""),
    ]
    assert ptq_run.argv("report", "results.json", no_plots=True) == [
        *("report", "results.json", "--no-plots"),
    ]
    with pytest.raises(ValueError, match="--quiet"):
        ptq_run.argv("eval", "m", "-q")
    with pytest.raises(ValueError, match="--seq-len"):
        ptq_run.argv("eval", "m", "--seq-len", "8")


@pytest.mark.parametrize("command", ["compare", "eval"])
def test_tasks_help_says_task_files_run_their_python(ptq_cli, monkeypatch, command):
    """A task YAML's `!function` imports and runs Python beside it, as lm-eval does: --help says so where --tasks is
    described (and docs/tasks.md), so a folder from elsewhere is not taken for data."""
    monkeypatch.setenv("COLUMNS", "300")
    code, stdout, _ = ptq_cli(command, "--help")
    text = " ".join(stdout.replace("│", " ").split())
    assert code == 0 and "(their !function Python runs, as in lm-eval: trusted files only)" in text
    from pathlib import Path

    docs = (Path(__file__).parent.parent / "docs" / "tasks.md").read_text()
    assert "its `!function` entries import and run Python" in " ".join(docs.split())
