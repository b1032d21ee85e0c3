"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""

import os


class PtqError(Exception):
    """A problem with the user's input (path, data, recipe, calibration file, output), not a bug."""


def unreadable_weights(path, error: Exception) -> PtqError:
    """A weights file safetensors could not open, said as the operating system says it where it did
    (a missing file, no permission to read it), else as what it most likely is."""
    return PtqError(
        f"cannot read the weights file {path}: "
        f"{os_reason(path, error) or 'damaged or not safetensors'}"
    )


def os_reason(path, error: Exception) -> str | None:
    """Why the operating system would not let `path` be read, where `error` (a reader's) was that,
    else None. safetensors raises FileNotFoundError for a file it may not read (a model another user
    saved: save_pretrained writes 0600): the file is opened here once more to say which."""
    if isinstance(error, FileNotFoundError) and os.path.lexists(path):
        try:
            open(path, "rb").close()
        except OSError as e:
            error = e
        else:
            return None
    if isinstance(error, FileNotFoundError):
        return "missing"
    if isinstance(error, PermissionError):
        return "permission denied (check the file's owner and mode)"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return None


def name_problem(name: str) -> str | None:
    """What keeps `name` (a recipe's, a task's) from naming a row of the report's tables, or None: a
    name is one line without '|' (a markdown table would split the row there)."""
    import unicodedata

    bad = next((c for c in name if c == "|" or unicodedata.category(c) == "Cc"), None)
    return (
        None
        if bad is None
        else f"{name!r} holds {bad!r}: a name is one line without '|' (it names a table row)"
    )
