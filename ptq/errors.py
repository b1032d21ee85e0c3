"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class PtqError(Exception):
    """A problem with the user's input (path, data, recipe, calibration file, output), not a bug."""


def unreadable_weights(path, error: Exception) -> PtqError:
    """A weights file safetensors could not open, said as the operating system says it where it did (a missing file,
    no permission to read it), else as what it most likely is."""
    if isinstance(error, FileNotFoundError):
        why = "missing"
    elif isinstance(error, PermissionError):
        why = "permission denied (check the file's owner and mode)"
    elif isinstance(error, OSError):
        why = error.strerror or str(error)
    else:
        why = "damaged or not safetensors"
    return PtqError(f"cannot read the weights file {path}: {why}")


def name_problem(name: str) -> str | None:
    """What keeps `name` (a recipe's, a task's) from naming a row of the report's tables, or None: a name is one
    line without '|' (a markdown table would split the row there)."""
    import unicodedata

    bad = next((c for c in name if c == "|" or unicodedata.category(c) == "Cc"), None)
    return None if bad is None else f"{name!r} holds {bad!r}: a name is one line without '|' (it names a table row)"
