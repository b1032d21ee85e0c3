"""Writing into folders that do not exist yet, as on a first run on a new machine (no ~/.cache, PTQ_CACHE
pointing at a new folder, `-o new/dir/file`), and refusing in one line where a folder cannot be made."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_faults import calib_args, one_error_line

from ptq import files
from ptq.errors import PtqError
from ptq.models.loading import gguf_key, load_model


@pytest.fixture
def fake_gguf(tiny_model, tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A .gguf file whose conversion gives the tiny model, and the list of conversions made. Only the
    GGUF reading is replaced (a real conversion, of the default model, is test_smollm2.py's): the cache,
    its folders and the rename into it are ptq's own."""
    from ptq.models import loading as models

    real = models._from_pretrained
    conversions = []

    def from_pretrained(location, spec, trust_remote_code, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(spec)
            return real(str(tiny_model), spec, trust_remote_code)
        return real(location, spec, trust_remote_code, **kwargs)

    monkeypatch.setattr(models, "_from_pretrained", from_pretrained)
    monkeypatch.setattr(
        models, "gguf_caveat", lambda path: f"Weights were dequantized from a GGUF ({path.name})."
    )
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return gguf, conversions


@pytest.mark.parametrize("setting", ["unset", "new folder", "~/new folder"])
def test_gguf_is_converted_into_a_cache_that_does_not_exist_yet(
    fake_gguf, tmp_path, monkeypatch, ptq_cli, setting
):
    gguf, conversions = fake_gguf
    home = tmp_path / "home"  # a new machine: a home without .cache
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cache = {
        "unset": home / ".cache" / "ptq",
        "new folder": tmp_path / "new" / "cache",
        "~/new folder": home / "cache",
    }[setting]
    if setting == "unset":
        monkeypatch.delenv("PTQ_CACHE", raising=False)
    else:
        monkeypatch.setenv("PTQ_CACHE", "~/cache" if setting.startswith("~") else str(cache))
    for i in range(2):  # commands that load the model (inspect reads the GGUF's config alone)
        code, _, err = ptq_cli(
            "calibrate", gguf, "--samples", "1", "--seq-len", "8", "-o", tmp_path / f"{i}.st", "-q"
        )
        assert code == 0, err
    assert conversions == [str(gguf)]  # converted once, then reused
    converted = cache / "gguf" / f"tiny-{gguf_key(gguf)}"
    assert (converted / "config.json").is_file() and (converted / "ptq-gguf-caveat.txt").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [converted.name]  # no temporaries left
    assert not (tmp_path / "~").exists()


def test_a_cache_that_cannot_be_written_is_one_line_before_the_conversion(
    fake_gguf, tmp_path, monkeypatch, ptq_cli
):
    gguf, conversions = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PTQ_CACHE", str(blocker / "cache"))  # a file in the way: it stops root too
    calibrate = (
        "calibrate",
        gguf,
        "--samples",
        "1",
        "--seq-len",
        "8",
        "-o",
        tmp_path / "c.st",
        "-q",
    )
    code, _, err = ptq_cli(*calibrate)
    assert code == 2 and one_error_line(err), err
    assert (
        f"cannot write in the model cache {blocker / 'cache' / 'gguf'}" in err
        and "PTQ_CACHE" in err
    )
    assert conversions == [] and blocker.read_text() == ""

    def denied(
        *args, **kwargs
    ):  # what a read-only folder gives a non-root user (root writes anyway)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "read-only"))
    monkeypatch.setattr(
        files.tempfile, "mkstemp", denied
    )  # (every command's output check too: the loading alone)
    with pytest.raises(PtqError) as refused:
        load_model(str(gguf))
    assert f"{tmp_path / 'read-only' / 'gguf'}: Permission denied" in str(refused.value)
    assert "PTQ_CACHE" in str(refused.value) and conversions == []


# Every command that writes, into folders that do not exist yet, or under a regular file.

FAST = ("--calib-samples", "2", "--seq-len", "32", "--max-windows", "2", "-q")


@pytest.fixture(scope="module")
def results_file(tiny_model, tmp_path_factory) -> Path:
    from conftest import TEXT

    from ptq import progress
    from ptq.commands.compare import run_compare
    from ptq.commands.options import CalibrationOptions, DataOptions, ModelOptions, OutputOptions

    directory = tmp_path_factory.mktemp("compared")
    (directory / "text.txt").write_text(TEXT * 3)
    progress.QUIET = True
    try:
        text = str(directory / "text.txt")
        run_compare(
            ["fp8-e4m3"],
            model=ModelOptions(model=str(tiny_model)),
            data=DataOptions(data=text, seq_len=32, windows=2),
            calibration=CalibrationOptions(data=text, samples=2, seq_len=32),
            output=OutputOptions(path=directory / "out"),
        )
    finally:
        progress.QUIET = False
    return directory / "out" / "results.json"


def command(
    name: str, tiny_model: Path, text_file: Path, results: Path, out: Path
) -> tuple[tuple, list[Path]]:
    """The arguments of a cheap run of command `name` writing to `out`, and the files it writes there."""
    report = [out / "report.md", out / "report-metrics.png"]
    return {
        "calibrate": (
            calib_args(
                tiny_model, text_file, out / "x.calib.safetensors", "--checkpoint-every", "0"
            ),
            [out / "x.calib.safetensors"],
        ),
        "compare": (
            (
                "compare",
                tiny_model,
                "--recipes",
                "fp8-e4m3",
                "--calib-data",
                text_file,
                "--eval-data",
                text_file,
                *FAST,
                "--out",
                out,
            ),
            [out / "results.json", *report],
        ),
        "eval": (
            (
                "eval",
                tiny_model,
                "--recipe",
                "fp8-e4m3",
                "--tasks",
                "",
                "--calib-data",
                text_file,
                "--eval-data",
                text_file,
                *FAST,
                "--out",
                out,
            ),
            [out / "results.json", out / "report.md"],
        ),
        "quantize": (
            (
                "quantize",
                tiny_model,
                "--data",
                text_file,
                "--samples",
                "2",
                "--seq-len",
                "32",
                "--no-verify",
                "-q",
                "-o",
                out / "ckpt",
            ),
            [out / "ckpt" / "config.json", out / "ckpt" / "ptq-export.json"],
        ),
        "report": (("report", results, "-o", out / "report.md"), report),
    }[name]


COMMANDS = ["calibrate", "compare", "eval", "quantize", "report"]


@pytest.mark.parametrize("name", COMMANDS)
def test_outputs_in_folders_that_do_not_exist_yet_are_created(
    name, tiny_model, text_file, results_file, tmp_path, ptq_cli, monkeypatch
):
    from ptq.calibration import calibrate

    real_save = calibrate.save_checkpoint
    checkpoints = []

    def save_checkpoint(path, *args, **kwargs):  # the first checkpoint is written before the output
        real_save(path, *args, **kwargs)
        checkpoints.append(path.is_file())

    monkeypatch.setattr(calibrate, "save_checkpoint", save_checkpoint)
    out = tmp_path / "new" / "dir"
    args, written = command(name, tiny_model, text_file, results_file, out)
    code, _, err = ptq_cli(*args)
    assert code == 0, err
    assert all(path.is_file() for path in written), sorted(out.rglob("*"))
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.checkpoint"))
    assert checkpoints == (
        [True] * 5 if name == "calibrate" else []
    )  # 24 windows, batches of 4: 5 before the last


@pytest.mark.parametrize("name", COMMANDS)
def test_outputs_under_a_file_are_refused_in_one_line_before_any_work(
    name, tiny_model, text_file, results_file, tmp_path, ptq_cli, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr("ptq.commands.common.load_model", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args, _ = command(name, tiny_model, text_file, results_file, blocker / "dir")
    code, _, err = ptq_cli(*args)
    assert code == 2 and one_error_line(err), err
    assert f"{blocker / 'dir'}: not a directory" in err.lower()
    assert blocker.read_text() == "" and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("name", ["calibrate", "compare", "eval", "report"])
def test_a_file_output_that_is_a_directory_is_refused_before_any_work_even_with_force(
    name, tiny_model, text_file, results_file, tmp_path, ptq_cli, monkeypatch
):
    # calibrate -o DIR --force, or a report.md that is a folder, used to run the whole command and fail on the rename
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr("ptq.commands.common.load_model", never)
    args, written = command(name, tiny_model, text_file, results_file, tmp_path / "out")
    written[0].mkdir(parents=True)
    (written[0] / "keep.txt").write_text("mine")
    code, _, err = ptq_cli(*args, "--force")
    assert code == 2 and one_error_line(err), err
    assert f"{written[0]}: it is a directory" in err
    assert (written[0] / "keep.txt").read_text() == "mine" and not list(tmp_path.rglob("*.tmp"))


def test_a_directory_output_gets_the_usual_mode_not_mkdtemps_0700(tmp_path):
    import os
    import stat

    import safetensors.torch
    import torch

    from ptq.files import atomic_dir

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "new" / "ckpt") as tmp:
            (tmp / "f").write_text("x")
            # safetensors' writer makes its files 0600: another user could not read a shared export or cache
            safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "ckpt").stat().st_mode) == 0o755
    for name in ("f", "model.safetensors"):
        assert stat.S_IMODE((tmp_path / "new" / "ckpt" / name).stat().st_mode) == 0o644, name


def test_replacing_a_directory_keeps_the_old_one_until_the_new_one_is_in_place(
    tmp_path, monkeypatch
):
    # --force onto an existing export: the old folder used to be deleted before the rename, so an interruption in
    # between left neither. Now a failing rename puts the old one back, and a successful one leaves no trace of it.
    import os

    from ptq import files

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real_replace = os.replace

    def interrupted(src, dst):
        if Path(dst) == target and Path(src).name.endswith(
            ".tmp"
        ):  # the new folder, not the old one moved back
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_dir(target) as tmp:
            (tmp / "new.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["old.txt"] and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["ckpt"]
    monkeypatch.setattr(files.os, "replace", real_replace)
    with files.atomic_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new.txt"] and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["ckpt"]


# Outputs and inputs: one rule for every command that writes (ptq.files.check_outputs) --------------


def never_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the outputs were checked")


def measure_args(name: str, model: Path, out: Path, **given) -> tuple:
    """compare or eval of `model` into `out` with --force; `given`: flag -> value, laid over the
    defaults (None drops one)."""
    flags = {"--calib-data": None, "--eval-data": None, "--tasks": ""} | given
    recipe = "--recipes" if name == "compare" else "--recipe"
    words = [w for f, v in flags.items() if v is not None for w in (f, v)]
    return (name, model, recipe, "fp8-e4m3", *words, *FAST, "--out", out, "--force")


@pytest.mark.parametrize("name", ["compare", "eval"])
def test_compare_and_eval_never_write_over_what_they_read(
    name, tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """`compare --eval-data out/report.md --out out --force` replaced the text it read with its
    report (and a calibration file, a task's rows or task folder alike); `--out MODEL` wrote
    report.md and results.json into the model's folder, --force or not."""
    from test_safety import copy_model

    monkeypatch.setattr("ptq.commands.common.load_model", never_load)
    model = copy_model(tiny_model, tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    for f in ("report.md", "results.json", "report-metrics.png"):
        (out / f).write_bytes(text_file.read_bytes())
    text = str(text_file)
    cases = [
        (
            {"--eval-data": out / "report.md", "--calib-data": text},
            "report.md",
            "the evaluation text",
        ),
        (
            {"--eval-data": text, "--calib-data": f"{out / 'results.json'},field=text"},
            "results.json",
            "the calibration text",
        ),
        (
            {"--eval-data": text, "--calib": out / "report-metrics.png"},
            "report-metrics.png",
            "the calibration file",
        ),
        (
            {"--eval-data": text, "--calib-data": text, "--tasks": f"rows={out / 'results.json'}"},
            "results.json",
            "the task file",
        ),
    ]
    for given, clash, what in cases:
        before = {p: p.read_bytes() for p in out.iterdir()}
        code, _, err = ptq_cli(*measure_args(name, model, out, **given))
        source = out / clash
        message = f"cannot write {out / clash}: it is {what} {source}, read by this run"
        assert code == 2 and one_error_line(err) and message in err, (given, err)
        assert {p: p.read_bytes() for p in out.iterdir()} == before
    # a folder of task files, and the model's folder: nothing is written within them
    for given, where, what, force in (
        ({"--tasks": out}, out, f"the task file {out}", True),
        ({}, model, f"the model {model}", True),
        ({}, model / "reports", f"the model {model}", False),
    ):
        before = {p: p.read_bytes() for p in (*out.iterdir(), *model.iterdir())}
        args = measure_args(
            name, model, where, **{"--eval-data": text, "--calib-data": text}, **given
        )
        code, _, err = ptq_cli(*(args if force else args[:-1]))
        message = f"cannot write {where / 'report.md'}: it is within {what}, read by this run"
        assert code == 2 and one_error_line(err) and message in err, (given, err)
        assert {p: p.read_bytes() for p in (*out.iterdir(), *model.iterdir())} == before
        assert not (model / "reports").exists()


@pytest.mark.parametrize("name", ["calibrate", "compare"])
def test_a_second_run_into_an_output_being_written_is_refused_before_any_work(
    name, tiny_model, text_file, results_file, tmp_path, ptq_cli, monkeypatch
):
    """Two runs into one new output both ran to the end: calibrate and compare refused the second
    only then, after all its work. The output is claimed at the start: the second is one line."""
    args, written = command(name, tiny_model, text_file, results_file, tmp_path / "out")
    monkeypatch.setattr("ptq.commands.common.load_model", never_load)

    @files.writes_outputs
    def another_run_writing():  # holds the output as a run of its own would, meanwhile
        files.check_outputs(
            [tmp_path / "out" / "report.md" if name == "compare" else written[0]], {}, False
        )
        return ptq_cli(*args)

    code, _, err = another_run_writing()
    assert code == 2 and one_error_line(err), err
    assert "is being written by another ptq run" in err
    assert list((tmp_path / "out").iterdir()) == []  # nothing of the refused run


def test_two_quantize_runs_into_one_new_folder_one_is_refused(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """Two `ptq quantize -o same` at once both said they succeeded, the later checkpoint silently
    replacing the earlier one. Here the second starts while the first writes its checkpoint."""
    from ptq.commands import quantize

    args, written = command("quantize", tiny_model, text_file, None, tmp_path / "out")
    real_write, second = quantize._write, []

    def write(*a, **k):
        if not second:
            second.append(ptq_cli(*args))
        return real_write(*a, **k)

    monkeypatch.setattr(quantize, "_write", write)
    code, _, err = ptq_cli(*args)
    assert code == 0, err
    code, _, err = second[0]
    assert code == 2 and one_error_line(err) and "is being written by another ptq run" in err, err
    assert all(p.is_file() for p in written)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["ckpt"]  # no lock, no temporary


def test_an_output_that_appears_while_a_run_works_is_not_replaced(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """Another writer (not a ptq run) creates the new output between the start's check and the
    final rename: the run fails in one line and leaves it as it is."""
    from ptq.commands import quantize

    args, _ = command("quantize", tiny_model, text_file, None, tmp_path / "out")
    target = tmp_path / "out" / "ckpt"
    real_write = quantize._write

    def write(*a, **k):
        target.mkdir()
        (target / "theirs.txt").write_text("theirs")
        return real_write(*a, **k)

    monkeypatch.setattr(quantize, "_write", write)
    code, _, err = ptq_cli(*args)
    assert code == 2 and one_error_line(err), err
    assert f"cannot write {target}: it appeared while this run worked" in err
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["ckpt"]


@pytest.mark.parametrize("when", ["loading the model", "drawing the plots"])
def test_an_interrupted_compare_leaves_nothing_it_created(
    when, tiny_model, text_file, results_file, tmp_path, ptq_cli, monkeypatch
):
    """Ctrl-C (or SIGTERM, which unwinds alike) while compare drew its plots left an empty output
    folder behind (and the new folders above it)."""
    from ptq.reporting import plots

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    real_writers = plots.plot_writers
    if when == "loading the model":
        monkeypatch.setattr("ptq.commands.common.load_model", interrupted)
    else:
        monkeypatch.setattr(
            plots,
            "plot_writers",
            lambda *a: {path: interrupted for path in real_writers(*a)},
        )
    args, _ = command("compare", tiny_model, text_file, results_file, tmp_path / "new" / "out")
    code, _, err = ptq_cli(*args)
    assert code == 130 and "interrupted" in err, err
    assert not (tmp_path / "new").exists()
