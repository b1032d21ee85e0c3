"""Writing into folders that do not exist yet, as on a first run on a new machine (no ~/.cache, PTQ_CACHE
pointing at a new folder, `-o new/dir/file`), and refusing in one line where a folder cannot be made."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ptq import files
from ptq.models import gguf_key

from test_faults import one_error_line


@pytest.fixture
def fake_gguf(tiny_model, tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A .gguf file whose conversion gives the tiny model, and the list of conversions made. Only the
    GGUF reading is replaced (a real conversion, of the default model, is test_smollm2.py's): the cache,
    its folders and the rename into it are ptq's own."""
    from ptq import models

    real = models._from_pretrained
    conversions = []

    def from_pretrained(location, spec, trust_remote_code, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(spec)
            return real(str(tiny_model), spec, trust_remote_code)
        return real(location, spec, trust_remote_code, **kwargs)

    monkeypatch.setattr(models, "_from_pretrained", from_pretrained)
    monkeypatch.setattr(models, "gguf_caveat", lambda path: f"Weights were dequantized from a GGUF ({path.name}).")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return gguf, conversions


@pytest.mark.parametrize("setting", ["unset", "new folder", "~/new folder"])
def test_gguf_is_converted_into_a_cache_that_does_not_exist_yet(fake_gguf, tmp_path, monkeypatch, ptq_cli, setting):
    gguf, conversions = fake_gguf
    home = tmp_path / "home"  # a new machine: a home without .cache
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cache = {"unset": home / ".cache" / "ptq", "new folder": tmp_path / "new" / "cache", "~/new folder": home / "cache"}[setting]
    if setting == "unset":
        monkeypatch.delenv("PTQ_CACHE", raising=False)
    else:
        monkeypatch.setenv("PTQ_CACHE", "~/cache" if setting.startswith("~") else str(cache))
    for _ in range(2):
        code, _, err = ptq_cli("inspect", gguf, "--json")
        assert code == 0, err
    assert conversions == [str(gguf)]  # converted once, then reused
    converted = cache / "gguf" / f"tiny-{gguf_key(gguf)}"
    assert (converted / "config.json").is_file() and (converted / "ptq-gguf-caveat.txt").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [converted.name]  # no temporaries left
    assert not (tmp_path / "~").exists()


def test_a_cache_that_cannot_be_written_is_one_line_before_the_conversion(fake_gguf, tmp_path, monkeypatch, ptq_cli):
    gguf, conversions = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PTQ_CACHE", str(blocker / "cache"))  # a file in the way: it stops root too
    code, _, err = ptq_cli("inspect", gguf)
    assert code == 2 and one_error_line(err), err
    assert f"cannot write in the model cache {blocker / 'cache' / 'gguf'}" in err and "PTQ_CACHE" in err
    assert conversions == [] and blocker.read_text() == ""

    def denied(*args, **kwargs):  # what a read-only folder gives a non-root user (root writes anyway)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "read-only"))
    monkeypatch.setattr(files.tempfile, "mkstemp", denied)
    code, _, err = ptq_cli("inspect", gguf)
    assert code == 2 and one_error_line(err), err
    assert f"{tmp_path / 'read-only' / 'gguf'}: Permission denied" in err and "PTQ_CACHE" in err
    assert conversions == []

