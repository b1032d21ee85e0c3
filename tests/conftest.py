"""Shared fixtures: a tiny randomly initialised Llama with a byte-level BPE tokenizer, saved as a local
Hugging Face directory, so that the whole pipeline runs offline in seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from families import TEXT, make_tokenizer  # noqa: F401 (the tests import both from here)

# Tests run the eager quantization kernel (bit-identical to the compiled one, which
# test_quantize.py checks once) so that each test process does not pay for compilation.
os.environ.setdefault("PTQ_COMPILE", "0")
# ptq computes on the GPU by default; the tests build their references on the CPU, so ptq runs there too (on a GPU
# machine as well). Tests of the CUDA paths ask for cuda themselves and are skipped where there is none.
os.environ.setdefault("PTQ_DEVICE", "cpu")


def save_tiny_llama(path: Path, seed: int = 0, **config) -> Path:
    """A tiny random Llama and its tokenizer saved in `path`; `config` overrides LlamaConfig's sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **(sizes | config),
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory) -> Path:
    """Same architecture, different weights: a calibration file from one must be refused by the other."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)


@pytest.fixture(autouse=True)
def hub_not_asked_yet():
    """ptq asks about the Hub once per process (whether it can be reached, where a Hub id's files are): each test asks
    anew, as a new run would, and no test sees another's answer."""
    from ptq.models import loading

    answers = (loading.hub_unreachable, loading.hub_snapshot)
    for cached in answers:
        cached.cache_clear()
    yield
    for cached in answers:
        cached.cache_clear()


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT * 3)
    return path


@pytest.fixture
def ptq_cli(monkeypatch, capsys):
    """Run `ptq ARGS...` in-process; return (exit code, stdout, stderr)."""
    from ptq import cli, progress

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # what the test printed before (a checkpoint's save bar) is not this run's output
        monkeypatch.setattr(sys, "argv", ["ptq", *map(str, args)])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            progress.QUIET = False
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


# What `ptq_run` adds to a command's argv unless the test says otherwise: a small run on the tiny text.
# TEXT_FILE stands for the `text_file` fixture's file (made only when a run uses it).
TEXT_FILE = object()
SMALL_RUN = {
    "calibrate": {"data": TEXT_FILE, "samples": 4, "seq_len": 32, "quiet": True},
    "quantize": {"data": TEXT_FILE, "samples": 4, "seq_len": 32, "quiet": True},
    "compare": {
        "calib_data": TEXT_FILE,
        "eval_data": TEXT_FILE,
        "calib_samples": 4,
        "seq_len": 32,
        "max_windows": 4,
        "quiet": True,
    },
    "eval": {"eval_data": TEXT_FILE, "seq_len": 32, "max_windows": 4, "quiet": True},
}
SHORT_FLAGS = {"-o": "--output", "-q": "--quiet"}


def flag(name: str) -> str:
    """A keyword's flag: `max_windows` -> `--max-windows`; a one-letter name is a short flag, `o` -> `-o`."""
    return f"-{name}" if len(name) == 1 else "--" + name.replace("_", "-")


@pytest.fixture
def ptq_run(ptq_cli, request):
    """Run `ptq COMMAND ARGS... FLAGS...` in-process, as a small run on the tiny text; return (exit code, stdout,
    stderr), as `ptq_cli` does.

    The argv is the command, then `args` as given (the model, and any raw words such as `*extra`), then this
    command's small-run defaults with `flags` laid over them. The defaults (SMALL_RUN; TEXT = the `text_file`
    fixture's file):
        calibrate, quantize: --data TEXT --samples 4 --seq-len 32 --quiet
        compare:             --calib-data TEXT --eval-data TEXT --calib-samples 4 --seq-len 32 --max-windows 4 --quiet
        eval:                --eval-data TEXT --seq-len 32 --max-windows 4 --quiet
        any other command:   none
    A keyword is a flag: `max_windows=4` -> `--max-windows 4`, a one-letter name a short flag (`o=path` -> `-o path`);
    `True` -> the bare flag (`no_verify=True` -> `--no-verify`); `None` or `False` -> no such flag, which drops a
    default (`data=None`: no `--data`). A raw word in `args` that repeats a default or a keyword's flag is an error,
    so no flag is given twice. `ptq_run.argv(...)` returns the argv (after `ptq`) without running it."""

    def argv(command: str, *args, **flags) -> list[str]:
        given = SMALL_RUN.get(command, {}) | flags
        words = [str(a) for a in args]
        flagged = [
            flag(name) for name, value in given.items() if value is not None and value is not False
        ]
        clash = {SHORT_FLAGS.get(w, w) for w in words} & {SHORT_FLAGS.get(f, f) for f in flagged}
        if clash:
            raise ValueError(
                f"ptq_run: {sorted(clash)} given both as a word and as a keyword or default"
            )
        for name, value in given.items():
            if value is None or value is False:
                continue
            words.append(flag(name))
            if value is not True:
                words.append(
                    str(request.getfixturevalue("text_file") if value is TEXT_FILE else value)
                )
        return [command, *words]

    def run(command: str, *args, **flags) -> tuple[int, str, str]:
        return ptq_cli(*argv(command, *args, **flags))

    run.argv = argv
    return run
