"""Atomic output: everything ptq writes goes to a temporary name first, then is renamed into place,
so an interrupted run never leaves a file that looks complete. A failed write (a full disk, no
permission) is one line for the user, and the temporary file is removed.

Folders above an output that do not exist yet are created when it is written (a first run on a new
machine has no ~/.cache; `-o new/dir/file`). `check_outputs` is the one rule for what a command's
outputs may replace (never an input of the run, an existing one only with --force), and claims them
for the run (`writes_outputs`): two runs never both write one output. Also the helpers that keep
outputs safe and reproducible: `check_output_dir` (fail before hours of work, not after),
`make_dir` (a folder created and checked up front, such as the model cache), `safe_join` (a name
taken from a user's file cannot escape the output directory), `save_safetensors` (byte-identical
files for identical content), and `cache_root` (where converted models and offloaded weights are
kept). And the one reader of the YAML files users write (recipes, task files), `read_yaml`, and of
JSON from outside (configs, indexes, results, JSONL rows), `read_json` and `parse_json`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path

import yaml

from ptq.errors import PtqError


def cache_root() -> Path:
    """Where ptq keeps what it makes for later runs (converted models, offloaded weights):
    $PTQ_CACHE (a leading ~ expanded, which a shell does not do in quotes), else ~/.cache/ptq.
    Either may not exist yet on a new machine: it is created on first use."""
    return Path(os.environ.get("PTQ_CACHE") or Path.home() / ".cache" / "ptq").expanduser()


def check_writable(path: Path, force: bool, directory: bool = False) -> None:
    """Refuse to overwrite an existing output unless --force was given. A file output (not
    `directory`) that is an existing directory is refused even with --force, before any work: the
    rename onto it would fail at the end."""
    path = Path(path)
    # a symlink is replaced, not followed
    if not directory and path.is_dir() and not path.is_symlink():
        raise PtqError(
            f"cannot write {path}: it is a directory, and the output is a file (--force does not "
            "replace it)"
        )
    if path.exists() and not force:
        raise PtqError(f"{path} already exists (use --force to overwrite)")


# ---- outputs and inputs: one rule for every command that writes

# The outputs claimed by the run now going (check_outputs), released when it ends (writes_outputs);
# those claimed without --force may not replace what appears under their name meanwhile.
_RUN_CLAIMS: ContextVar[ExitStack | None] = ContextVar("ptq_output_claims", default=None)
_NO_REPLACE: set[Path] = set()


def writes_outputs(run: Callable) -> Callable:
    """Decorates a command's run function: the outputs it claims with check_outputs are held until
    it returns and released then; where it fails or is interrupted, the folders the claim created
    are removed again (where they are still empty)."""

    @functools.wraps(run)
    def holding_claims(*args, **kwargs):
        with ExitStack() as stack:
            token = _RUN_CLAIMS.set(stack)
            try:
                return run(*args, **kwargs)
            finally:
                _RUN_CLAIMS.reset(token)

    return holding_claims


def check_outputs(
    outputs: Sequence[str | Path],
    inputs: Mapping[str, str | Path | None | Sequence[str | Path | None]],
    force: bool,
    *,
    folder: bool = False,
    claim: bool = True,
) -> None:
    """The one rule for what a run may write, checked before any work by every command that writes
    (calibrate, compare, eval, quantize, report):
    - an output is never an input of the run, nor lies within one (a model folder, a folder of task
      files), --force or not: the run would replace what it reads; `inputs`: what each is ("the
      calibration text") -> its local path(s), None where it is not local (a Hub name, a default);
    - a `folder` output (the first, replaced whole: quantize's checkpoint) never holds an input;
    - an output that exists is replaced only with --force (check_writable);
    - the first output is claimed for this run (`claim`; under torchrun only the writing process
      claims): a second run writing it meanwhile is refused in one line, and an output that
      appears under a new output's name while this run works is not replaced at the end. The
      folders created for the claim are removed again if the run fails or is interrupted.
    The caller is a run function decorated with writes_outputs, which holds the claim."""
    paths = [Path(p) for p in outputs]
    given = [
        (what, source)
        for what, sources in inputs.items()
        for source in (sources if isinstance(sources, list | tuple) else [sources])
        if source is not None and str(source) and Path(source).exists()
    ]
    for i, path in enumerate(paths):
        _refuse_inputs(path, given, replaced=folder and i == 0)
    check_output_dir(paths[0].parent)
    if claim:
        _claim(paths, force)
    for i, path in enumerate(paths):
        check_writable(path, force, directory=folder and i == 0)


def _location(path: Path) -> Path:
    """Where `path` is written: its folder resolved, its own name not (a symlink there is replaced,
    not followed)."""
    path = Path(path)
    return path.parent.resolve() / path.name


def _refuse_inputs(path: Path, inputs: list[tuple[str, str | Path]], replaced: bool) -> None:
    out = _location(path)
    for what, source in inputs:
        given = Path(source).resolve()
        if out in (given, _location(Path(source))):
            raise PtqError(f"cannot write {path}: it is {what} {source}, read by this run")
        if given.is_dir() and given in out.parents:
            raise PtqError(f"cannot write {path}: it is within {what} {source}, read by this run")
        if replaced and out in given.parents:
            raise PtqError(
                f"cannot write {path}: it holds {what} {source}, read by this run, and would "
                "replace it"
            )


def _claim(paths: list[Path], force: bool) -> None:
    """Hold paths[0] for this run (a lock file beside it, flock'ed: released by the kernel if the
    process dies), and mark the outputs new to this run as not to be replaced at the end."""
    stack = _RUN_CLAIMS.get()
    if stack is None:
        raise RuntimeError("check_outputs claims outputs for a run decorated with writes_outputs")
    created = _create_folders(paths[0].parent)
    stack.push(lambda kind, *_: _remove_empty(created) if kind is not None else None)
    lock = paths[0].with_name(f".{paths[0].name}.ptq-lock")
    fd = _lock(lock, paths[0])
    if fd is not None:
        stack.callback(_unlock, lock, fd)
    if not force:
        for path in paths:
            _NO_REPLACE.add(_location(path))
            stack.callback(_NO_REPLACE.discard, _location(path))


def _create_folders(directory: Path) -> list[Path]:
    """Create `directory` and its missing parents; the ones created, outermost first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    missing.reverse()
    for folder in missing:
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:
            raise PtqError(f"cannot create output directory {folder}: {_reason(e)}") from None
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:  # not empty (a calibration's checkpoint is kept), or gone
            return


def _lock(lock: Path, path: Path) -> int | None:
    """Open and flock `lock` without waiting; another run holding it: one line. None where the
    filesystem has no locks (the final rename still refuses to replace a new output)."""
    for _ in range(10):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        except OSError as e:
            where = lock.parent
            raise PtqError(f"cannot write in output directory {where}: {_reason(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PtqError(
                f"{path} is being written by another ptq run (it holds {lock}): wait for it to "
                "end, or write elsewhere"
            ) from None
        except OSError:
            os.close(fd)
            return None
        # the run that held it may have removed it as it ended: then lock the new one
        try:
            ours = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            ours = False
        if ours:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)
    raise PtqError(f"cannot claim {path}: {lock} keeps changing (other ptq runs write there)")


def _unlock(lock: Path, fd: int) -> None:
    try:
        if os.stat(lock).st_ino == os.fstat(fd).st_ino:
            lock.unlink()
    except OSError:
        pass
    os.close(fd)


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename `tmp` onto `path`: replacing it, unless `path` is an output claimed new by this run
    (then an output that appeared meanwhile, another run's, is kept, and this fails with EEXIST)."""
    if _location(path) not in _NO_REPLACE:
        os.replace(tmp, path)
        return
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), 1) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(path))
    if os.path.lexists(path):  # no renameat2 here: checked, then renamed
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    os.rename(tmp, path)


def _renameat2():
    """libc's renameat2 (Linux: RENAME_NOREPLACE, an atomic rename that never replaces), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    path, fd = ctypes.c_char_p, ctypes.c_int
    function.argtypes = [fd, path, fd, path, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_AT_FDCWD = -100
_RENAMEAT2 = _renameat2()


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it onto `path`, else delete it."""
    path = Path(path)
    _create_parent(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise PtqError(f"cannot write in {path.parent}: {e.strerror}") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        # mkstemp makes 0600 files; outputs get the usual mode
        os.chmod(tmp_path, 0o666 & ~_umask())
        yield tmp_path
        _move_into_place(tmp_path, path)
    except OSError as e:
        tmp_path.unlink(missing_ok=True)
        raise PtqError(f"cannot write {path}: {_reason(e)} (nothing was written)") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _create_parent(path: Path) -> None:
    """Create the folders above `path` that do not exist yet."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PtqError(f"cannot create output directory {path.parent}: {_reason(e)}") from None


def _reason(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
        return "it appeared while this run worked (another run or program wrote it): not replaced"
    return e.strerror or str(e) or type(e).__name__


def check_output_dir(directory: Path) -> None:
    """Make sure files can be created in `directory`, before any long work, without leaving
    anything: the probe file goes into the directory, or into its nearest existing ancestor when the
    directory does not exist yet (it is created only when the outputs are written)."""
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        _probe(existing)
    except OSError as e:
        raise PtqError(f"cannot write in output directory {directory}: {_reason(e)}") from None


def make_dir(directory: Path, what: str = "output directory", hint: str = "") -> Path:
    """Create `directory` and its missing parents now and make sure files can be created in it: for
    a folder that is written long after the command starts (the model cache, filled after a
    conversion). A folder that cannot be created or written is one line naming it, followed by
    `hint`."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _probe(directory)
    except OSError as e:
        raise PtqError(f"cannot write in {what} {directory}: {_reason(e)}{hint}") from None
    return directory


def _probe(directory: Path) -> None:
    """Create and remove a file in `directory`: this works where permission bits say nothing (root,
    a read-only mount), and raises OSError where a file could not be created."""
    if not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory")
    fd, probe = tempfile.mkstemp(prefix=".ptq-probe.", dir=directory)
    os.close(fd)
    os.unlink(probe)


def safe_join(directory: Path, name: str) -> Path:
    """directory / name for a `name` that comes from a user's file (a tensor or layer name, a
    recipe): refused if it is absolute, climbs with '..', or resolves (through symlinks) outside
    `directory`."""
    directory = Path(directory)
    relative = Path(name)
    if not name or "\x00" in name or relative.is_absolute() or ".." in relative.parts:
        raise PtqError(f"refusing output name {name!r}: it must stay inside {directory}")
    path = directory / relative
    if not path.resolve().is_relative_to(directory.resolve()):
        raise PtqError(f"refusing output name {name!r}: it resolves outside {directory}")
    return path


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """safetensors.torch.save_file, atomically and deterministically: the safetensors library writes
    the header's metadata in a random order (a Rust HashMap), so the header is rewritten with sorted
    keys; the tensor data are untouched (their offsets are relative to the end of the header)."""
    import safetensors.torch

    data = safetensors.torch.save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    canonical = {"__metadata__": dict(sorted(header.pop("__metadata__", {}).items()))} | dict(
        sorted(header.items())
    )
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.write(data[8 + n :])
            f.flush()
            os.fsync(f.fileno())


def write_set_atomic(writers: dict[Path, Callable[[Path], None]]) -> None:
    """Files that belong together (results.json, report.md and its plots): each written by its
    function into a temporary file, all renamed only once every one is complete, so a failure (a
    full disk) leaves the old set or none."""
    with ExitStack() as stack:
        tmps = {path: stack.enter_context(atomic_path(path)) for path in writers}
        for path, tmp in tmps.items():
            writers[path](tmp)


def text_writer(text: str) -> Callable[[Path], None]:
    """A write_set_atomic writer of `text` (UTF-8)."""
    return lambda tmp: tmp.write_text(text, encoding="utf-8")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Like atomic_path, for a directory: built under a temporary name, renamed when complete."""
    path = Path(path)
    check_output_dir(path.parent)
    _create_parent(path)
    try:
        tmp_path = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise PtqError(f"cannot write in {path.parent}: {_reason(e)}") from None
    try:
        # mkdtemp makes 0700 folders; a checkpoint or cache gets the usual mode
        os.chmod(tmp_path, 0o777 & ~_umask())
        yield tmp_path
        for f in tmp_path.rglob("*"):  # and its files too: safetensors' save_file makes them 0600
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~_umask())
        # An existing folder (--force) is moved aside, not deleted, until the new one is in place:
        # an interruption in between leaves one of the two under `path` (the other under a hidden
        # temporary name), never neither.
        old = None
        if path.exists() and _location(path) not in _NO_REPLACE:
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
        try:
            _move_into_place(tmp_path, path)
        except BaseException:
            if old is not None:
                os.replace(old / path.name, path)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    # a full disk, a quota, a read-only mount while the folder was written: one line
    except OSError as e:
        shutil.rmtree(tmp_path, ignore_errors=True)
        where = f" ({e.filename})" if e.filename else ""
        raise PtqError(f"cannot write {path}: {_reason(e)}{where} (nothing was written)") from None
    except BaseException:
        shutil.rmtree(tmp_path, ignore_errors=True)
        raise


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error: PyYAML
    keeps the last one silently, so `weights:` written twice would quantize by whichever came
    second."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            # `<<: *base`: merged keys may be overridden, as YAML says
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                # a list or mapping as a key ([1, 2]: 3): PyYAML's own error, with its line, not a
                # TypeError here
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found unhashable key",
                    key_node.start_mark,
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"'{key}' given twice (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep)


class _TaggedLoader(_StrictLoader):
    """lm-eval's task files tag values (`!function utils.process_docs`): read as None, for checking
    only."""


_TaggedLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def read_yaml(path: Path, what: str, tags: bool = False) -> object:
    """A user's YAML file, safe-loaded (no Python objects), a key given twice refused; a problem is
    one line with its line and column. tags: custom tags (lm-eval's !function) allowed, as None."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        return yaml.load(text, Loader=_TaggedLoader if tags else _StrictLoader)  # noqa: S506 (SafeLoader subclasses)
    except (OSError, UnicodeDecodeError) as e:
        raise PtqError(f"cannot read {what} {path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PtqError(f"{what} {path}{at}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise PtqError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise PtqError(f"{what} {path} is nested too deeply") from None


def parse_json(text: str | bytes, what: str) -> object:
    """JSON from outside ptq (a config, a checkpoint index, a results file, a JSONL row): a problem
    is one line naming `what` ("config.json of MODEL", "line 3 of rows.jsonl"), never a traceback;
    nesting deep enough to exhaust Python's stack is refused like any other malformed input."""
    try:
        return json.loads(text)
    except RecursionError:  # the decoder recurses once per level of nesting
        raise PtqError(f"{what} is nested too deeply to be read as JSON") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise PtqError(f"{what} is not valid JSON: {e}") from None


def read_json(path: Path, what: str | None = None) -> object:
    """A JSON file from outside ptq, read as parse_json reads text; `what` defaults to the path."""
    what = what or str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PtqError(f"cannot read {what}: {e}") from None
    return parse_json(text, what)
