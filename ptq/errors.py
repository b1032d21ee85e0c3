"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class PtqError(Exception):
    """A problem with the user's input (path, data, recipe, calibration file, output), not a bug."""
