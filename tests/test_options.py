"""Every option a command accepts takes effect there (ptq.commands.options): the options `ptq eval` used to accept and
drop (--on-nonfinite, --on-unseen, --allow-pickle, --no-memory-check, --low-memory), for each command that
calibrates or loads a model; a reused --calib file is checked as a calibration made in the run is; options a
command cannot use are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_faults import edited_model, one_error_line
from test_safety import copy_model

from ptq.calibration.calibrate import TensorObserver, load_calibration
from ptq.commands.calibrate import run_calibrate
from ptq.commands.evaluate import run_eval
from ptq.commands.options import (
    CalibrationOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    OutputOptions,
    refuse_unused,
)
from ptq.commands.quantize import run_quantize
from ptq.errors import PtqError
from ptq.runtime import resources

COMMANDS = ("calibrate", "compare", "eval", "quantize")


def command_args(command: str, model: Path, text: Path, out: Path, *extra) -> tuple:
    """The smallest run of `command` on `model` that calibrates fp8-e4m3 on `text` (8 windows of 16 tokens)."""
    calib_data = ("--calib-data", text, "--calib-samples", "8")
    evaluation = ("--eval-data", text, "--max-windows", "2")
    return {
        "calibrate": (
            "calibrate",
            model,
            "--data",
            text,
            "--samples",
            "8",
            "-o",
            out / "c.safetensors",
        ),
        "compare": (
            "compare",
            model,
            "--recipes",
            "fp8-e4m3",
            *calib_data,
            *evaluation,
            "--out",
            out,
            "--no-plots",
        ),
        "eval": (
            "eval",
            model,
            "--recipe",
            "fp8-e4m3",
            *calib_data,
            *evaluation,
            "--tasks",
            "",
            "--out",
            out,
        ),
        "quantize": (
            "quantize",
            model,
            "--recipe",
            "fp8-e4m3",
            "--data",
            text,
            "--samples",
            "8",
            "--no-verify",
            "-o",
            out / "checkpoint",
        ),
    }[command] + ("--seq-len", "16", "-q", *extra)


def calibration_record(command: str, out: Path) -> dict:
    """What the command wrote about its calibration: metadata (calibrate) or its faults."""
    if command == "calibrate":
        return load_calibration(out / "c.safetensors").metadata
    if command == "quantize":
        return json.loads((out / "checkpoint" / "ptq-export.json").read_text())["calibration"][
            "faults"
        ]
    return json.loads((out / "results.json").read_text())["calibration"]["faults"]


@pytest.mark.parametrize("command", COMMANDS)
def test_on_nonfinite_skip_leaves_the_bad_batch_out(
    command, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    observe, seen = TensorObserver.__call__, []

    def nan_in_the_first_batch_of_the_first_layer(self, module, args):
        seen.append(module)
        if module is seen[0] and seen.count(module) == 1:
            args = (args[0] * float("nan"), *args[1:])
        observe(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", nan_in_the_first_batch_of_the_first_layer)
    code, _, err = ptq_cli(*command_args(command, tiny_model, text_file, tmp_path / "fail"))
    assert code == 2 and one_error_line(err) and "--on-nonfinite skip" in err
    seen.clear()
    code, _, err = ptq_cli(
        *command_args(command, tiny_model, text_file, tmp_path / "skip", "--on-nonfinite", "skip")
    )
    assert code == 0, err
    assert "1 batch(es) with NaN/inf inputs left out of its amax" in err
    assert calibration_record(command, tmp_path / "skip")["nonfinite_batches"] == {
        "model.layers.0.self_attn.q_proj": 1
    }


def starve_the_first_layer(monkeypatch) -> list:
    """The first observed layer never gets data (as an expert the router never picks); the list of observed modules
    is returned, to be cleared between runs."""
    observe, seen = TensorObserver.__call__, []

    def never_the_first_layer(self, module, args):
        seen.append(module)
        if module is not seen[0]:
            observe(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", never_the_first_layer)
    return seen


@pytest.mark.parametrize("command", COMMANDS)
def test_on_unseen_fail_stops_on_a_layer_without_data(
    command, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    seen = starve_the_first_layer(monkeypatch)
    code, _, err = ptq_cli(*command_args(command, tiny_model, text_file, tmp_path / "fallback"))
    assert code == 0, err
    assert "warning: layer 'model.layers.0.self_attn.q_proj' received no calibration data" in err
    assert [
        u["layer"] for u in calibration_record(command, tmp_path / "fallback")["unseen_layers"]
    ] == ["model.layers.0.self_attn.q_proj"]
    seen.clear()
    code, _, err = ptq_cli(
        *command_args(command, tiny_model, text_file, tmp_path / "fail", "--on-unseen", "fail")
    )
    assert code == 2 and one_error_line(err)
    assert "received no calibration data, e.g. 'model.layers.0.self_attn.q_proj'" in err


@pytest.mark.parametrize("recipe", ("paper-e4m3", "percentile"))
def test_an_unseen_layer_under_a_histogram_observer_takes_its_siblings_clip(
    recipe, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    # --on-unseen fallback gave the layer its sibling's amax but no histogram: every observer but max then stopped
    # the run with "calibration file has no histogram ... recalibrate", in a run that had calibrated itself.
    from ptq.calibration.clips import input_clip
    from ptq.calibration.diagnostics import sqnr_table
    from ptq.calibration.observers import choose_clip
    from ptq.numerics.formats import get_format
    from ptq.quantization.recipes import load_recipe

    if recipe == "percentile":
        recipe = tmp_path / "percentile.yaml"
        recipe.write_text(
            "name: pct\nweights: {format: e4m3}\ninputs: {format: e4m3, observer: percentile, percentile: 99}\n"
        )
    seen = starve_the_first_layer(monkeypatch)
    calib = tmp_path / "c.safetensors"
    code, _, err = ptq_cli(
        "calibrate",
        tiny_model,
        "--recipe",
        recipe,
        "--data",
        text_file,
        "--samples",
        "8",
        "--seq-len",
        "16",
        "-o",
        calib,
    )
    assert code == 0, err
    unseen, sibling = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"
    calibration = load_calibration(calib)
    assert [u["layer"] for u in calibration.metadata["unseen_layers"]] == [unseen]
    assert torch.equal(calibration.input_amax[unseen], calibration.input_amax[sibling])
    spec = load_recipe(str(recipe)).inputs
    want = choose_clip(
        spec.observer,
        calibration.input_hist[sibling],
        float(calibration.input_amax[sibling]),
        get_format("e4m3"),
        spec.percentile,
    )[1]
    assert float(input_clip(calibration, unseen, spec)) == pytest.approx(want) and want < float(
        calibration.input_amax[sibling]
    )
    assert unseen not in {
        row["tensor"] for row in sqnr_table(calibration)["tensors"]
    }  # no data of its own to diagnose
    seen.clear()
    evaluation = (
        "--eval-data",
        text_file,
        "--max-windows",
        "2",
        "--seq-len",
        "16",
        "--no-plots",
        "-q",
    )
    for extra in (("--calib-data", text_file, "--calib-samples", "8"), ("--calib", calib)):
        code, _, err = ptq_cli(
            "compare",
            tiny_model,
            "--recipes",
            recipe,
            *extra,
            *evaluation,
            "--out",
            tmp_path / extra[0],
        )
        assert code == 0, err
        assert f"warning: layer '{unseen}' received no calibration data" in err


def test_a_layer_whose_every_batch_was_skipped_gets_its_siblings_channel_amax(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    # --on-nonfinite skip on every batch of a layer: its amax fell back to its sibling's, but its per-channel maxima
    # stayed all zeros, and SmoothQuant smoothed it with them (input amax 0) without a word
    observe, seen = TensorObserver.__call__, []

    def nan_in_every_batch_of_the_first_layer(self, module, args):
        seen.append(module)
        if module is seen[0]:
            args = (args[0] * float("nan"), *args[1:])
        observe(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", nan_in_every_batch_of_the_first_layer)
    calib = tmp_path / "c.safetensors"
    args = (
        "--data",
        text_file,
        "--samples",
        "8",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "-q",
        "--on-nonfinite",
        "skip",
    )
    code, _, err = ptq_cli(
        "calibrate", tiny_model, "--recipe", "int8-smoothquant", *args, "-o", calib
    )
    assert code == 0, err
    skipped, sibling = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"
    calibration = load_calibration(calib)
    assert calibration.metadata["nonfinite_batches"] == {skipped: 2}
    assert [u["layer"] for u in calibration.metadata["unseen_layers"]] == [skipped]
    assert torch.equal(
        calibration.input_channel_amax[skipped], calibration.input_channel_amax[sibling]
    )
    assert float(calibration.input_channel_amax[skipped].max()) > 0


@pytest.mark.parametrize("command", COMMANDS)
def test_allow_pickle_loads_a_pickle_checkpoint(command, tiny_model, text_file, tmp_path, ptq_cli):
    pickled = copy_model(tiny_model, tmp_path / "pickled", skip=("model.safetensors",))
    torch.save(
        safetensors.torch.load_file(str(tiny_model / "model.safetensors")),
        pickled / "pytorch_model.bin",
    )
    code, _, err = ptq_cli(*command_args(command, pickled, text_file, tmp_path / "refused"))
    assert code == 2 and one_error_line(err) and "--allow-pickle" in err
    code, _, err = ptq_cli(
        *command_args(command, pickled, text_file, tmp_path / "allowed", "--allow-pickle")
    )
    assert code == 0, err


@pytest.mark.parametrize("command", COMMANDS)
def test_no_memory_check_loads_a_model_that_looks_too_big(
    command, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    monkeypatch.setattr(
        resources, "available_memory", lambda device: 1 << 10
    )  # 1 KiB: nothing fits
    code, _, err = ptq_cli(
        *command_args(command, tiny_model, text_file, tmp_path / "checked", "--in-memory")
    )
    assert code == 2 and one_error_line(err) and "--no-memory-check" in err
    code, _, err = ptq_cli(
        *command_args(command, tiny_model, text_file, tmp_path / "unchecked", "--no-memory-check")
    )
    assert code == 0, err
    assert "block by block" not in err  # loaded whole, as asked, not streamed instead


def streamed_and_whole(command: str, out: Path) -> tuple[object, object]:
    """The numbers a run wrote that must not depend on --low-memory, and whether it ran layer by layer."""
    if command == "calibrate":
        c = load_calibration(out / "c.safetensors")
        return {k: v.tolist() for k, v in sorted(c.input_amax.items())}, None
    if command == "quantize":
        info = json.loads((out / "checkpoint" / "ptq-export.json").read_text())
        weights = safetensors.torch.load_file(str(out / "checkpoint" / "model.safetensors"))
        return {k: v.float().tolist() for k, v in sorted(weights.items())}, info["low_memory"]
    results = json.loads((out / "results.json").read_text())
    entries = (
        [results["config"]] if command == "eval" else [results["baseline"], *results["variants"]]
    )
    return [(e["perplexity"], e["window_nll"]) for e in entries], results["compute"]["low_memory"]


@pytest.mark.parametrize("command", COMMANDS)
def test_low_memory_gives_the_in_memory_numbers(command, tiny_model, text_file, tmp_path, ptq_cli):
    runs = {}
    for mode in ("--in-memory", "--low-memory"):
        code, _, err = ptq_cli(*command_args(command, tiny_model, text_file, tmp_path / mode, mode))
        assert code == 0, err
        runs[mode] = streamed_and_whole(command, tmp_path / mode)
    assert runs["--low-memory"][0] == runs["--in-memory"][0]
    if command != "calibrate":  # the results say how they were computed
        assert runs["--in-memory"][1] is False and runs["--low-memory"][1] is True


def test_eval_low_memory_refuses_what_needs_the_whole_model(
    tiny_model, text_file, tmp_path, ptq_cli
):
    code, _, err = ptq_cli(
        "eval",
        tiny_model,
        "--tasks",
        "cloze",
        "--eval-data",
        text_file,
        "--seq-len",
        "16",
        "--out",
        tmp_path,
        "--low-memory",
        "-q",
    )
    assert code == 2 and one_error_line(err) and "--tasks needs the whole model in memory" in err


@pytest.mark.parametrize("command", ("compare", "eval", "quantize"))
def test_a_reused_calibration_file_gets_the_range_warnings(
    command, tiny_model, text_file, tmp_path, ptq_cli
):
    """A weight amax of 3e-36 has a normal float32 int8 scale (3e-36 / 127) but not an E4M3 one (3e-36 / 448): a
    file calibrated for int8 has no warning, and reusing it for fp8-e4m3 warns as calibrating in the run would."""

    def nearly_zero(t):
        t["model.layers.0.self_attn.o_proj.weight"].zero_()
        t["model.layers.0.self_attn.o_proj.weight"][0, 0] = 3e-36

    model = edited_model(tiny_model, tmp_path / "m", nearly_zero)
    calib = tmp_path / "c.safetensors"
    code, _, err = ptq_cli(
        "calibrate",
        model,
        "--recipe",
        "int8",
        "--data",
        text_file,
        "--samples",
        "8",
        "--seq-len",
        "16",
        "-o",
        calib,
        "-q",
    )
    assert code == 0, err
    assert "warnings" not in load_calibration(calib).metadata and "warning" not in err
    out = tmp_path / "out"
    args = {
        "compare": (
            "compare",
            model,
            "--recipes",
            "fp8-e4m3",
            "--calib",
            calib,
            "--eval-data",
            text_file,
            "--max-windows",
            "2",
            "--out",
            out,
            "--no-plots",
        ),
        "eval": (
            "eval",
            model,
            "--recipe",
            "fp8-e4m3",
            "--calib",
            calib,
            "--eval-data",
            text_file,
            "--max-windows",
            "2",
            "--tasks",
            "",
            "--out",
            out,
        ),
        "quantize": (
            "quantize",
            model,
            "--recipe",
            "fp8-e4m3",
            "--calib",
            calib,
            "--no-verify",
            "-o",
            out / "checkpoint",
        ),
    }[command] + ("--seq-len", "16", "-q")
    code, _, err = ptq_cli(*args)
    assert code == 0, err
    warnings = calibration_record(command, out)["warnings"]
    # compare and eval score the text the file was calibrated on, and say that too (test_data.py)
    assert len(warnings) == (1 if command == "quantize" else 2) and warnings[0].startswith(
        "weight amax 3e-36 of layer 'model.layers.0.self_attn.o_proj' "
        "is below 5.27e-36: its e4m3 scale is not a normal float32"
    )
    assert f"warning: {warnings[0]}" in " ".join(err.split())


def test_eval_results_and_report_carry_the_calibration_faults(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    observe, seen = TensorObserver.__call__, []

    def never_the_first_layer(self, module, args):
        seen.append(module)
        if module is not seen[0]:
            observe(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", never_the_first_layer)
    code, _, err = ptq_cli(*command_args("eval", tiny_model, text_file, tmp_path))
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        results["calibration"]["faults"]["unseen_layers"][0]["layer"]
        == "model.layers.0.self_attn.q_proj"
    )
    assert (
        "Layer `model.layers.0.self_attn.q_proj` received no calibration data"
        in (tmp_path / "report.md").read_text()
    )
    # the protocol is compare's, less what compares against a baseline
    assert not any("KL" in line or "Baseline" in line for line in results["protocol"])
    assert results["protocol"][0].startswith("Perplexity:") and results["protocol"][1].startswith(
        "Quantized Linear:"
    )


def test_options_a_command_does_not_use_are_refused_in_one_line(tiny_model, tmp_path):
    out = OutputOptions(path=tmp_path / "x")
    cases = [
        (
            lambda: run_calibrate(["fp8-e4m3"], model=ModelOptions(dtype="bfloat16"), output=out),
            "--dtype",
        ),
        (
            lambda: run_calibrate(["fp8-e4m3"], compute=ComputeOptions(matmul="fp8"), output=out),
            "--matmul",
        ),
        (
            lambda: run_calibrate(
                ["fp8-e4m3"], calibration=CalibrationOptions(file=tmp_path / "c"), output=out
            ),
            "--calib",
        ),
        (lambda: run_eval(calibration=CalibrationOptions(resume=True), output=out), "--resume"),
        (lambda: run_quantize("fp8-e4m3", data=DataOptions(tasks="cloze"), output=out), "--tasks"),
        (
            lambda: run_quantize("fp8-e4m3", compute=ComputeOptions(matmul="fp8"), output=out),
            "--matmul",
        ),
    ]
    for run, flag in cases:
        with pytest.raises(PtqError, match=f"^{flag} does not apply to ptq "):
            run()
    assert not (tmp_path / "x").exists()
    refuse_unused(
        "eval", ComputeOptions(batch_size="auto"), batch_size="--batch-size"
    )  # "auto" is the default
    with pytest.raises(TypeError):
        DataOptions("text.txt", 16)  # by name only: neighbouring numbers cannot be swapped
    with pytest.raises(PtqError, match="--on-nonfinite must be one of"):
        CalibrationOptions(on_nonfinite="ignore")


def _built(monkeypatch, groups: dict, *commands: str) -> tuple:
    """`commands` built by ptq.cli's helper from `groups`, on an app of their own: (the app, what the
    last call of each command was given)."""
    import typer

    from ptq import cli

    monkeypatch.setattr(cli, "app", typer.Typer(add_completion=False))
    got = {}

    def record(name):
        def command(options):
            """A command built from options groups."""
            got[name] = options

        return command

    for name in commands:
        cli._command(name, **groups)(record(name))
    return cli.app, got


def test_a_field_added_to_a_group_is_a_flag_of_every_command_that_takes_it(monkeypatch):
    """An option is declared once, as a field: the commands that take its group (compare, eval)
    both get its flag, with its help, default, range and panel, and hand its value on."""
    from dataclasses import dataclass

    import typer.main
    from typer.testing import CliRunner

    from ptq import cli
    from ptq.commands.options import DATA, option

    @dataclass(frozen=True, kw_only=True)
    class StridedData(DataOptions):
        stride: int = option(7, "--stride", min=1, help="Tokens between windows.", panel=DATA)

    groups = {**cli.EVALUATION, "data": StridedData}
    app, got = _built(monkeypatch, groups, "compare", "eval")
    runner = CliRunner()
    commands = typer.main.get_command(app).commands
    for name in ("compare", "eval"):
        (stride,) = [p for p in commands[name].params if p.name == "stride"]
        assert (stride.opts, stride.default, stride.help) == (
            ["--stride"],
            7,
            "Tokens between windows.",
        )
        help_text = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"}).output
        assert "--stride" in _panels(help_text)["Data"]
        assert runner.invoke(app, [name, "m", "--stride", "3"]).exit_code == 0
        assert got[name]["data"].stride == 3 and got[name]["model"].model == "m"
        assert runner.invoke(app, [name, "--stride", "0"]).exit_code == 2  # its range
    runner.invoke(app, ["eval"])
    assert got["eval"]["data"].stride == 7 and got["eval"]["data"].tasks == "auto"


def _panels(help_text: str) -> dict[str, str]:
    """--help's panels by title: the text inside each box."""
    import re

    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"╭─ (.+?) ─+╮\n(.*?)╰", help_text, flags=re.DOTALL)
    }


def test_compare_and_eval_take_the_same_options_but_their_own(monkeypatch):
    """The flags of compare and eval come from the same groups: they differ only where one command
    has a use for an option the other has not (compare's recipes, gates, plots and JSON)."""
    import typer.main

    from ptq import cli

    commands = typer.main.get_command(cli.app).commands
    compare, eval_ = ({p.name for p in commands[c].params} for c in ("compare", "eval"))
    assert compare - eval_ == {
        "recipes",
        "as_json",
        "no_plots",
        "max_ppl_increase",
        "min_accuracy_recovery",
        "max_kl",
    }
    assert eval_ - compare == {"recipe"}


def test_a_field_that_is_read_from_other_flags_is_converted_and_named_in_each_commands_spelling():
    """--no-memory-check, --no-plots, --device-map with --max-memory and the gates become their
    fields; --calib with the calibration text is refused under each command's own flag."""
    from ptq.commands.options import from_flags, parameters

    groups = {"model": ModelOptions, "calibration": CalibrationOptions, "output": OutputOptions}
    values = {name: default for name, (_, _, default) in parameters("compare", groups).items()}
    built = from_flags(
        "compare", groups, values | {"no_memory_check": True, "no_plots": True, "max_kl": "0.01"}
    )
    assert built["model"].memory_check is False and built["model"].placement is None
    assert built["output"].plots is False and built["output"].limits.max_kl == 0.01
    assert built["output"].path == Path("reports/compare")
    both = {"calib": Path("c.safetensors"), "calib_data": "t.txt"}
    with pytest.raises(PtqError, match="^give either --calib .* or --calib-data .*, not both$"):
        from_flags("compare", groups, values | both)
    values = {name: default for name, (_, _, default) in parameters("quantize", groups).items()}
    with pytest.raises(PtqError, match="^give either --calib .* or --data .*, not both$"):
        from_flags(
            "quantize", groups, values | {"calib": Path("c"), "data": "t.txt", "output": "q"}
        )


def test_an_option_declaration_naming_no_command_or_two_flags_alike_is_refused():
    from dataclasses import dataclass

    from ptq.commands.options import option, parameters

    with pytest.raises(ValueError, match="no such command: evaluate"):
        option(1, "--n", help="n", commands=("evaluate",))

    @dataclass(frozen=True, kw_only=True)
    class Twice:
        a: int = option(1, "--seq-len", help="one")
        b: int = option(1, "--seq-len", help="another")

    with pytest.raises(TypeError, match="two different flags named seq_len"):
        parameters("eval", {"twice": Twice})
