"""Text from outside ptq (a model folder's name, a data path) in markdown (report.md, a model card),
rendered so it cannot break the document: a folder may be named with a newline (which would end a
heading or a table row), a '|' (which splits a table row), backticks or '#'."""

from __future__ import annotations

import re
import unicodedata

_SPECIALS = re.compile(r"([\\`*_{}\[\]<>()#+!|~])")  # what CommonMark lets a backslash escape


def visible(text: str) -> str:
    """`text` with its control characters and line separators shown as escapes (a newline as \\n),
    so it stays on its line; everything else as it is."""
    return "".join(
        c.encode("unicode_escape").decode("ascii")
        if unicodedata.category(c) in ("Cc", "Zl", "Zp")
        else c
        for c in str(text)
    )


def inline(text: str) -> str:
    """`text` as literal text of a heading, a line or a table cell: visible, its markdown
    specials backslash-escaped."""
    return _SPECIALS.sub(r"\\\1", visible(text))


def cell(text: str) -> str:
    """`text` in a table cell, otherwise as written: visible, its '|' escaped."""
    return visible(text).replace("|", "\\|")


def code(text: str) -> str:
    """`text` as a code span: visible, fenced by more backticks than it holds in a row."""
    text = visible(text)
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
