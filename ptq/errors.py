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
