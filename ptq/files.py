"""Atomic output: everything ptq writes goes to a temporary name first, then is renamed into place,
so an interrupted run never leaves a file that looks complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ptq.errors import PtqError


def check_writable(path: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless --force was given."""
    if path.exists() and not force:
        raise PtqError(f"{path} already exists (use --force to overwrite)")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it onto `path`, on failure delete it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PtqError(f"cannot create output directory {path.parent}: {e.strerror}") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Like atomic_path, for a directory: built under a temporary name, renamed when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp_path
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp_path, path)
    except BaseException:
        shutil.rmtree(tmp_path, ignore_errors=True)
        raise
