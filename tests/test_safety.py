"""Safe loading, resource faults and hostile data (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_faults import calib_args, one_error_line

from ptq import files
from ptq.errors import PtqError, unreadable_weights
from ptq.evaluation.data import Corpus, load_corpus, make_windows
from ptq.files import safe_join
from ptq.models.loading import load_model
from ptq.runtime import resources


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def no_temporaries(directory: Path) -> bool:
    return not any(p.name.endswith(".tmp") for p in directory.rglob("*"))


# 4. Resource faults ------------------------------------------------------------------------------


def test_disk_full_while_writing_calibration(tiny_model, text_file, tmp_path, ptq_cli, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, tmp_path / "c.st"))
    assert code == 2 and one_error_line(err)
    assert "cannot write" in err and "no space left on device" in err
    assert not (tmp_path / "c.st").exists() and no_temporaries(tmp_path)


def test_disk_full_while_writing_report_keeps_the_old_pair(
    tiny_model, tmp_path, ptq_run, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("old results")
    (out / "report.md").write_text("old report")
    real_write = Path.write_text

    def full_on_report(self, text, *args, **kwargs):
        if self.name.startswith(".report.md."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_on_report)
    code, _, err = ptq_run(
        "compare", tiny_model, recipes="fp8-e4m3", seq_len=16, max_windows=2, out=out, force=True
    )
    assert code == 2 and one_error_line(err) and "no space left on device" in err
    # results.json was complete first, but nothing is renamed until both are: the old pair stays.
    assert (out / "results.json").read_text() == "old results" and (
        out / "report.md"
    ).read_text() == "old report"
    assert no_temporaries(tmp_path)


def test_unwritable_output_fails_before_any_work(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr("ptq.commands.common.load_model", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, blocker / "c.st"))
    assert code == 2 and one_error_line(err) and "cannot write in output directory" in err

    def denied(*args, **kwargs):  # what a read-only directory gives a non-root user
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", denied)
    code, _, err = ptq_cli("compare", str(tiny_model), "--out", str(tmp_path / "out"), "-q")
    assert (
        code == 2
        and one_error_line(err)
        and "cannot write in output directory" in err
        and "Permission denied" in err
    )


def test_model_too_big_fails_early_with_estimate_and_flag(
    tiny_model, text_file, tmp_path, ptq_cli, ptq_run, monkeypatch
):
    loaded = load_model(str(tiny_model))
    params = sum(
        p.numel() for p in loaded.model.parameters()
    )  # tied embeddings counted once, as stored
    assert resources.checkpoint_parameters(tiny_model) == params
    monkeypatch.setattr(
        resources, "available_memory", lambda device: params * 4 * 2
    )  # room for 2 copies
    code, _, err = ptq_cli(*calib_args(tiny_model, text_file, tmp_path / "c.st"))
    assert code == 0, err  # calibrate holds one copy
    # compare holds 2.5: the original, and half a copy for bf16 and each variant (without --in-memory, a local
    # checkpoint is compared layer by layer instead: tests/test_streaming.py)
    code, _, err = ptq_cli(
        "compare",
        str(tiny_model),
        "--recipes",
        "fp8-e4m3,int8",
        "--out",
        str(tmp_path / "o"),
        "-q",
        "--in-memory",
    )
    assert code == 2 and one_error_line(err)
    assert (
        f"needs at least {params * 10 / 2**10:.1f} KiB ({params:,} parameters x 4 bytes in float32 x 2.5 copies"
        in err
    )
    assert (
        "--no-memory-check" in err
        and "compare fewer recipes" in err
        and not (tmp_path / "o" / "results.json").exists()
    )
    code, _, err = ptq_run(
        "compare",
        tiny_model,
        recipes="fp8-e4m3,int8",
        seq_len=16,
        max_windows=2,
        out=tmp_path / "o",
        no_memory_check=True,
    )
    assert code == 0, err


def test_output_symlink_is_replaced_not_followed(tiny_model, tmp_path, ptq_run):
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").symlink_to(outside)
    code, _, err = ptq_run(
        "compare", tiny_model, recipes="fp8-e4m3", seq_len=16, max_windows=2, out=out, force=True
    )
    assert code == 0, err
    assert outside.read_text() == "precious" and not (out / "results.json").is_symlink()
    assert json.loads((out / "results.json").read_text())["model"]["name"] == str(tiny_model)


# 5. Safe loading ---------------------------------------------------------------------------------


class Payload:
    """A pickle that creates a file when unpickled (harmless stand-in for os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_checkpoints_refused_unless_allowed_then_weights_only(
    tiny_model, text_file, tmp_path, ptq_cli
):
    state = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    plain = copy_model(tiny_model, tmp_path / "plain", skip=("model.safetensors",))
    torch.save(state, plain / "pytorch_model.bin")
    code, _, err = ptq_cli(*calib_args(plain, text_file, tmp_path / "c.st"))
    assert (
        code == 2
        and one_error_line(err)
        and "only pickle weights" in err
        and "--allow-pickle" in err
    )
    code, _, err = ptq_cli(*calib_args(plain, text_file, tmp_path / "c.st", "--allow-pickle"))
    assert code == 0, err

    marker = tmp_path / "pwned"
    evil = copy_model(tiny_model, tmp_path / "evil", skip=("model.safetensors",))
    torch.save({**state, "extra": Payload(marker)}, evil / "pytorch_model.bin")
    code, _, err = ptq_cli(*calib_args(evil, text_file, tmp_path / "e.st", "--allow-pickle"))
    assert code == 2 and one_error_line(err) and "cannot load model" in err
    assert not marker.exists()  # weights_only=True refused the payload instead of running it
    # what to do, for ptq's user (torch's own advice, re-run torch.load with weights_only=False, is not ptq's)
    assert (
        "its pickle holds more than tensors, which ptq does not load, --allow-pickle or not ("
        in err
    ), err
    assert "weights_only" not in err


def test_remote_code_is_not_run_unless_asked(tiny_model, text_file, tmp_path, ptq_cli):
    marker = tmp_path / "pwned"
    model = copy_model(tiny_model, tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "ptq-test-remote"
    config["auto_map"] = {
        "AutoConfig": "custom.CustomConfig",
        "AutoModelForCausalLM": "custom.CustomModel",
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, _, err = ptq_cli(*calib_args(model, text_file, tmp_path / "c.st"))
    assert code == 2 and one_error_line(err) and "cannot load model" in err
    assert not marker.exists()
    # ptq's flag, not transformers' Python argument and an hf.co address made of a local path
    assert "which ptq runs only with --trust-remote-code" in err and "hf.co" not in err, err
    code, _, err = ptq_cli("inspect", model)
    assert (
        code == 2 and "which ptq runs only with --trust-remote-code" in err and not marker.exists()
    ), err


def test_damaged_model_weights(tiny_model, text_file, tmp_path, ptq_cli):
    data = (tiny_model / "model.safetensors").read_bytes()
    truncated = copy_model(tiny_model, tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    flipped = copy_model(tiny_model, tmp_path / "flipped")
    header = bytearray(data)
    header[8 + 2] ^= 0x40  # inside the JSON header
    (flipped / "model.safetensors").write_bytes(bytes(header))
    for model in (truncated, flipped):
        code, _, err = ptq_cli(*calib_args(model, text_file, tmp_path / "c.st"))
        assert code == 2 and one_error_line(err), err
        assert "damaged or not safetensors" in err or "cannot load model" in err


def test_a_weights_file_that_cannot_be_opened_is_named_with_the_reason(
    tiny_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    """No permission to read a file is no damaged file (tests run as root, where chmod 000 still reads: the operating
    system's error is raised where safetensors would raise it)."""
    import safetensors

    from ptq.execution import streaming
    from ptq.runtime import resources

    opened = safetensors.safe_open
    reasons = {
        PermissionError(
            13, "Permission denied"
        ): "permission denied (check the file's owner and mode)",
        OSError(5, "Input/output error"): "Input/output error",
        safetensors.SafetensorError(
            "Error while deserializing header: header too large"
        ): "damaged or not safetensors",
    }
    weights = tiny_model / "model.safetensors"
    for error, reason in reasons.items():

        def refuse(path, *args, error=error, **kwargs):
            if Path(path) == weights:
                raise error
            return opened(path, *args, **kwargs)

        monkeypatch.setattr(safetensors, "safe_open", refuse)
        expected = f"cannot read the weights file {weights}: {reason}"
        for read in (resources.checkpoint_parameters, streaming.SafetensorsCheckpoint):
            with pytest.raises(PtqError) as caught:
                read(tiny_model)
            assert str(caught.value) == expected
        code, _, err = ptq_cli(*calib_args(tiny_model, text_file, tmp_path / "c.st"))
        assert code == 2 and err.strip() == f"error: {expected}", err


def as_a_user_who_may_not_read(path: Path, read) -> str:
    """The PtqError message of `read()` where `path` is 0600 and owned by someone else: a model another user saved
    (save_pretrained writes 0600). As root, in a forked child that has become `nobody` (root reads any file); else by
    chmod 000. The operating system's own refusal, not a stand-in for it."""
    import multiprocessing
    import os

    def attempt(queue=None):
        try:
            read()
            message = "read"
        except PtqError as e:
            message = str(e)
        except Exception as e:  # noqa: BLE001 (the child's traceback would not reach the test)
            message = repr(e)
        if queue is None:
            return message
        queue.put(message)

    if os.geteuid() != 0:
        path.chmod(0)
        return attempt()
    path.chmod(0o600)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child():
        os.setgid(65534)
        os.setuid(65534)
        attempt(queue)

    process = context.Process(target=child)
    process.start()
    message = queue.get(timeout=60)
    process.join()
    return message


def test_a_file_that_may_not_be_read_is_not_called_missing(tiny_model):
    # safetensors raises FileNotFoundError ("No such file or directory") for a file the user may not read: ptq said
    # "missing", of a file that is there, and of a calibration file "not a readable calibration file: No such file"
    import tempfile

    from ptq.calibration.calibrate import load_calibration
    from ptq.execution import streaming
    from ptq.runtime import resources

    with (
        tempfile.TemporaryDirectory() as shared
    ):  # in /tmp, which every user may enter (pytest's tmp_path is 0700)
        check_unreadable(Path(shared), tiny_model, resources, streaming, load_calibration)


def check_unreadable(
    folder: Path, tiny_model: Path, resources, streaming, load_calibration
) -> None:
    model = copy_model(tiny_model, folder / "model")
    for p in (folder, model, *model.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    weights = model / "model.safetensors"
    for read in (
        lambda: resources.checkpoint_parameters(model),
        lambda: streaming.SafetensorsCheckpoint(model),
    ):
        assert as_a_user_who_may_not_read(weights, read) == (
            f"cannot read the weights file {weights}: permission denied (check the file's owner and mode)"
        )
    calibration = folder / "calibration.safetensors"
    calibration.write_bytes(weights.read_bytes())
    assert as_a_user_who_may_not_read(calibration, lambda: load_calibration(calibration)) == (
        f"cannot read the calibration file {calibration}: permission denied (check the file's owner and mode)"
    )
    weights.unlink()  # and a file that is not there is still missing
    assert str(unreadable_weights(weights, FileNotFoundError(weights))).endswith(": missing")


def test_paths_from_user_files_cannot_escape(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere")
    assert (
        safe_join(out, "model.layers.0/scale.safetensors")
        == out / "model.layers.0" / "scale.safetensors"
    )
    for name in ("../x", "/etc/passwd", "a/../../x", "link/x", "", "a\x00b"):
        with pytest.raises(PtqError, match="refusing output name"):
            safe_join(out, name)


# 6. Hostile data ---------------------------------------------------------------------------------


class SilentTokenizer:
    """A tokenizer that returns no tokens for any text (e.g. everything maps to nothing)."""

    eos_token_id = None
    bos_token_id = None
    all_special_ids: list[int] = []

    def __call__(self, texts, **kwargs):
        return {"input_ids": [[] for _ in (texts if isinstance(texts, list) else [texts])]}


def test_tokenizer_returning_nothing(text_file):
    corpus = load_corpus(str(text_file), role="calibration")
    with pytest.raises(PtqError, match="the tokenizer produced no tokens"):
        make_windows(corpus, SilentTokenizer(), 16, 4)


def test_text_of_only_special_tokens_or_symbols(tiny_model, tmp_path, ptq_cli):
    specials = tmp_path / "eos.txt"
    specials.write_text("<eos>" * 2000)
    code, _, err = ptq_cli(*calib_args(tiny_model, specials, tmp_path / "c.st"))
    assert code == 2 and one_error_line(err) and "only special tokens" in err
    symbols = tmp_path / "symbols.txt"
    symbols.write_text("!?*&^%$#@~\u2603\x00\x7f" * 500)  # odd but real text: calibrates
    code, _, err = ptq_cli(*calib_args(tiny_model, symbols, tmp_path / "c.st"))
    assert code == 0, err


def test_extremely_long_line_is_fine(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    line = (
        "unfold yourself " * 40_000
    ) + "x" * 300_000  # 940 kB on one line, a 300 kB "word" at the end
    corpus = Corpus([line], "one long line", "0")
    windows = make_windows(corpus, tokenizer, 64, 8)
    assert windows.input_ids.shape == (8, 64)


def test_calibration_file_of_another_version_asks_to_calibrate_again(tmp_path):
    from ptq.calibration.calibrate import FILE_KIND, load_calibration

    path = tmp_path / "old.st"
    good = {"data": "t", "data_sha256": "x", "windows": 1, "seq_len": 2, "tokens": 2}
    safetensors.torch.save_file(
        {"input_amax/l": torch.tensor(1.0)},
        str(path),
        metadata={"kind": "ptq-calibration/1", "metadata": json.dumps(good)},
    )
    with pytest.raises(
        PtqError,
        match=r"written by another version of ptq \(kind 'ptq-calibration/1'.*calibrate again",
    ):
        load_calibration(path)
    assert FILE_KIND != "ptq-calibration/1"


def test_calibration_metadata_is_validated(tmp_path):
    from ptq.calibration.calibrate import FILE_KIND, load_calibration

    tensors = {"input_amax/l": torch.tensor(1.0), "weight_amax/l": torch.tensor(2.0)}
    good = {"data": "t", "data_sha256": "x", "windows": 1, "seq_len": 2, "tokens": 2}
    for metadata, message in (
        (["not", "an", "object"], "must be a JSON object"),
        (good | {"tokens": "many"}, "'tokens' must be a non-negative integer"),
        (good | {"unseen_layers": [{"layer": 1}]}, "'unseen_layers' is malformed"),
        ({k: v for k, v in good.items() if k != "data"}, "'data' must be a string"),
    ):
        path = tmp_path / "c.st"
        safetensors.torch.save_file(
            tensors, str(path), metadata={"kind": FILE_KIND, "metadata": json.dumps(metadata)}
        )
        with pytest.raises(PtqError, match=message):
            load_calibration(path)
    for bad in (
        torch.tensor([1.0, 2.0]),
        torch.tensor(float("nan")),
        torch.tensor(-1.0),
        torch.tensor(1.0, dtype=torch.float64),
    ):
        safetensors.torch.save_file(
            {**tensors, "input_amax/l": bad},
            str(path),
            metadata={"kind": FILE_KIND, "metadata": json.dumps(good)},
        )
        with pytest.raises(PtqError, match="invalid entry 'input_amax/l'"):
            load_calibration(path)


@pytest.mark.parametrize("recipe", ["fp8-dynamic+kv-head", "fp8-dynamic+kv"])
def test_a_kv_cache_calibration_of_another_model_is_refused(
    recipe, tiny_model, other_tiny_model, text_file, tmp_path, ptq_cli
):
    # The only static scales are K and V's: the file has no Linear of its own to tell the models apart by, yet it
    # must be refused for another model as any calibration file is (the same layer names, other weights).
    calib = tmp_path / "other.st"
    assert ptq_cli(*calib_args(other_tiny_model, text_file, calib, "--recipe", recipe))[0] == 0
    common = (
        "--eval-data",
        text_file,
        "--seq-len",
        "16",
        "--max-windows",
        "2",
        "--recipes",
        recipe,
        "--no-plots",
        "-q",
    )
    code, _, err = ptq_cli(
        "compare", tiny_model, "--calib", calib, "--out", tmp_path / "wrong", *common
    )
    assert code == 2 and one_error_line(err) and "made for another model" in err, err
    assert not (tmp_path / "wrong").exists()
    # ... and accepted for the model it was made for
    code, _, err = ptq_cli(
        "compare", other_tiny_model, "--calib", calib, "--out", tmp_path / "right", *common
    )
    assert code == 0, err


def test_a_calibration_file_is_taken_for_its_model_computed_in_bfloat16(
    tiny_model, other_tiny_model, text_file, tmp_path, ptq_cli
):
    # ptq calibrate reads the weights in float32; compare --dtype bfloat16 (the default on CUDA) rounds a float32
    # checkpoint's weights to bf16, and the file was refused as "made for another model" on its own model
    calib = tmp_path / "c.st"
    assert ptq_cli(*calib_args(tiny_model, text_file, calib))[0] == 0
    common = (
        "--calib",
        calib,
        "--eval-data",
        text_file,
        "--seq-len",
        "16",
        "--max-windows",
        "2",
        "--dtype",
        "bfloat16",
    )
    common += ("--recipes", "fp8-e4m3", "--no-plots", "-q")
    code, _, err = ptq_cli("compare", tiny_model, *common, "--out", tmp_path / "mine")
    assert code == 0, err
    code, _, err = ptq_cli("compare", other_tiny_model, *common, "--out", tmp_path / "other")
    assert code == 2 and one_error_line(err) and "made for another model" in err, err


def test_a_calibration_file_of_a_model_with_the_same_linear_weights_but_other_norms_is_refused(
    tiny_model, text_file, tmp_path, ptq_cli
):
    """The file was checked against the Linear weights' amax alone: a model whose norms differ (a fine-tune that kept
    the Linear weights) took the other's input scales, clipped 5x, and quantize called it verified. Every other
    parameter's amax is recorded and checked, in memory and layer by layer; the file still fits its own model."""
    calib = tmp_path / "c.st"
    assert ptq_cli(*calib_args(tiny_model, text_file, calib))[0] == 0
    norms = copy_model(tiny_model, tmp_path / "norms")
    state = safetensors.torch.load_file(str(norms / "model.safetensors"))
    for name in state:
        if name.endswith("post_attention_layernorm.weight"):
            state[name] = state[name] * 5
    safetensors.torch.save_file(state, str(norms / "model.safetensors"), metadata={"format": "pt"})
    common = ("--recipe", "fp8-e4m3", "--calib", calib, "--seq-len", "16", "-q")
    for model, memory in (
        (norms, "--in-memory"),
        (norms, "--low-memory"),
        (tiny_model, "--low-memory"),
    ):
        out = tmp_path / f"{model.name}{memory}"
        code, _, err = ptq_cli(
            "quantize", model, *common, memory, "--verify-windows", "1", "-o", out
        )
        if model == norms:
            assert (
                code == 2
                and one_error_line(err)
                and "post_attention_layernorm.weight' differs" in err
            ), err
            assert not out.exists()
        else:
            assert code == 0, err
        evaluated = ptq_cli(
            "eval",
            model,
            *common,
            memory,
            "--eval-data",
            text_file,
            "--out",
            tmp_path / "e",
            "--force",
        )
        assert evaluated[0] == (2 if model == norms else 0), evaluated[2]


def test_a_calibration_file_that_cannot_be_checked_against_the_model_is_refused(tiny_model):
    from transformers import AutoModelForCausalLM

    from ptq.calibration.calibrate import Calibration

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    key = "model.layers.0.self_attn.key"  # K's amax, and no weight amax at all (a file from before they were recorded)
    with pytest.raises(PtqError, match="no weight amax to check it against this model"):
        Calibration({key: torch.tensor(1.0)}, {}).check_model(model, [key])


@pytest.mark.parametrize("size", [100_000, 5 << 20])
def test_gguf_cache_key_follows_content_not_path_or_mtime(tmp_path, size):
    """A reinstalled package (new path, new mtime) reuses the converted model; changed content does not."""
    from ptq.models.loading import gguf_key

    data = bytearray(os.urandom(size))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1, 1))
    assert gguf_key(first) == gguf_key(second)
    data[-1] ^= 1  # the first and the last chunk are always read
    second.write_bytes(data)
    assert gguf_key(first) != gguf_key(second)
    second.write_bytes(data + b"\0")
    assert gguf_key(first) != gguf_key(second)


def test_disk_full_while_writing_a_checkpoint(tiny_model, tmp_path, ptq_run, monkeypatch):
    """A shard that cannot be written (no space left) ends `ptq quantize` in one line, exit 2, with no folder and
    no temporary left behind. safetensors reports it as its own SafetensorError (not an OSError), in these words."""
    import safetensors.torch

    def full(*args, **kwargs):
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "out"
    code, _, err = ptq_run(
        "quantize",
        tiny_model,
        data=None,
        samples=None,
        recipe="fp8-dynamic",
        seq_len=16,
        no_verify=True,
        o=out,
    )
    assert code == 2 and one_error_line(err), err
    assert f"cannot write {out}: no space left on device" in err
    assert not out.exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


def test_a_shard_over_the_file_size_limit_is_one_line_and_leaves_nothing(
    tiny_model, text_file, tmp_path
):
    """The same failure for real, not mocked: `ptq quantize` in a process whose files may not grow past 64 kB
    (RLIMIT_FSIZE, as a quota does), so that safetensors' own write of the shard fails with EFBIG."""
    import subprocess
    import sys

    out = tmp_path / "out"
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # the write fails with EFBIG instead of killing the process
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))\n"
        "from ptq import cli\n"
        "sys.argv = ['ptq', *sys.argv[1:]]\n"
        "cli.main()\n"
    )
    args = [
        tiny_model,
        "--recipe",
        "fp8-dynamic",
        "--seq-len",
        "16",
        "--no-verify",
        "--shard-size",
        "1",
        "-o",
        out,
    ]
    done = subprocess.run(
        [sys.executable, "-c", script, "quantize", *map(str, args), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, one_error_line(done.stderr)) == (2, True), done.stderr
    assert f"cannot write {out}: File too large" in done.stderr, done.stderr
    assert not out.exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


def test_a_checkpoint_the_disk_has_no_room_for_is_refused_before_any_shard(
    tiny_model, tmp_path, ptq_run, monkeypatch
):
    """The shards' size is known before the first is written: a disk without the room for them is one line at once,
    not a failure at the last shard of a 100B-parameter model, with nothing written and nothing left behind."""
    import shutil

    import safetensors.torch

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=50_000))
    written = []
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: written.append(a))
    out = tmp_path / "out"
    code, _, err = ptq_run(
        "quantize",
        tiny_model,
        data=None,
        samples=None,
        recipe="fp8-dynamic",
        seq_len=16,
        no_verify=True,
        o=out,
    )
    assert code == 2 and one_error_line(err), err
    assert (
        "writing the checkpoint's tensors needs at least " in err
        and f"in {tmp_path}, which has 48.8 KiB free" in err
    )
    assert "nothing was written" in err
    assert (
        not written
        and not out.exists()
        and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())
    )


@pytest.mark.parametrize(
    "n, binary, decimal",
    [
        (0, "0 B", "0 B"),
        (999, "999 B", "999 B"),
        (1000, "1000 B", "1.0 kB"),
        (1024, "1.0 KiB", "1.0 kB"),
        (50_000, "48.8 KiB", "50.0 kB"),
        (16 * 2**20, "16.0 MiB", "16.8 MB"),
        (2**30 // 2, "512.0 MiB", "536.9 MB"),
        (140 * 10**9, "130.4 GiB", "140.0 GB"),
        (3 * 2**40, "3.0 TiB", "3.3 TB"),
        (5000 * 2**40, "5,000.0 TiB", "5,497.6 TB"),
    ],
)
def test_one_byte_formatter_binary_for_memory_and_disk_decimal_for_files(n, binary, decimal):
    from ptq.runtime.resources import size_text

    assert (size_text(n), size_text(n, si=True)) == (binary, decimal)


def test_calibrate_never_writes_over_what_it_reads(tiny_model, text_file, tmp_path, ptq_cli):
    # `--data copy.txt -o copy.txt --force` replaced the text with a calibration file; an output in the model's
    # folder would be read with its weights the next time (every *.safetensors there)
    model = copy_model(tiny_model, tmp_path / "model")
    text = tmp_path / "copy.txt"
    text.write_bytes(text_file.read_bytes())
    for data, out, message in (
        (text, text, f"cannot write {text}: it is the calibration text {text}, read by this run"),
        (
            f"{text},field=text",
            text,
            f"cannot write {text}: it is the calibration text {text}, read by this run",
        ),
        (text, model / "model.safetensors", f"it is within the model {model}, read by this run"),
        (text, model / "calib.safetensors", f"it is within the model {model}, read by this run"),
    ):
        before = {p.name: p.read_bytes() for p in (text, *model.iterdir())}
        code, _, err = ptq_cli(
            "calibrate", model, "--data", data, "--seq-len", "16", "-o", out, "--force", "-q"
        )
        assert code == 2 and one_error_line(err) and message in err, err
        assert {p.name: p.read_bytes() for p in (text, *model.iterdir())} == before


def test_quantize_never_replaces_or_writes_into_what_it_reads(
    tiny_model, text_file, tmp_path, ptq_cli
):
    """`quantize out/export -o out/export --force` replaced the ptq export it was reading (a ptq export may be
    replaced with --force); an output in the model's folder, or one replaced whole that holds an input, is refused."""
    common = (
        "--recipe",
        "fp8-dynamic",
        "--data",
        text_file,
        "--seq-len",
        "16",
        "--verify-windows",
        "1",
        "-q",
    )
    export = tmp_path / "out" / "export"
    assert ptq_cli("quantize", tiny_model, *common, "-o", export)[0] == 0
    text = (
        export / "text.txt"
    )  # a file the user keeps in an export, which --force would replace with it
    text.write_bytes(text_file.read_bytes())
    for model, data, out, message in (
        (
            export,
            text_file,
            export,
            f"cannot write {export}: it is the model {export}, read by this run",
        ),
        (export, text_file, export / "sub", f"it is within the model {export}, read by this run"),
        (
            tiny_model,
            text,
            export,
            f"it holds the calibration text {text}, read by this run, and would replace it",
        ),
    ):
        before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
        code, _, err = ptq_cli(
            "quantize", model, *common[:2], "--data", data, *common[4:], "-o", out, "--force"
        )
        assert code == 2 and one_error_line(err) and message in err, err
        assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before


def test_json_from_outside_is_one_line_for_every_fault(tmp_path):
    """parse_json / read_json: nesting that exhausts the stack, malformed text, bytes that are not
    UTF-8 and a missing file are each a PtqError naming what was read, never a traceback."""
    from ptq.files import parse_json, read_json

    assert parse_json('{"a": [1, 2]}', "x") == {"a": [1, 2]}
    with pytest.raises(PtqError, match=r"^config.json of m is nested too deeply"):
        parse_json("[" * 100_000 + "]" * 100_000, "config.json of m")
    with pytest.raises(PtqError, match=r"^line 3 of rows.jsonl is not valid JSON: Expecting"):
        parse_json('{"context": ', "line 3 of rows.jsonl")
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(PtqError, match=r"^cannot read .*bad.json"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(PtqError, match=r"^cannot read index of m"):
        read_json(tmp_path / "missing.json", "index of m")
