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
