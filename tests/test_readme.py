"""The README runs as shown: every `ptq ...` command in its code blocks parses with ptq's CLI (without running),
every `make TARGET` it shows is a Makefile target, and every docs/ link points to a file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

import ptq.cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Where a shell command line ends for our purpose: redirections, pipes, separators.
_SHELL_STOPS = {">", ">>", "<", "|", "||", ";", "&", "2>", "2>&1", "&>"}


def _code_blocks(text: str) -> list[str]:
    """The bodies of the fenced code blocks (```...```), and of indented ones (4 spaces after a blank line)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    blocks += re.findall(r"(?:^|\n\n)((?:    [^\n]*\n?)+)", outside)
    return blocks


def _logical_lines(block: str) -> list[str]:
    """Shell lines of a block: comments dropped, backslash continuations joined."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    if current:
        lines.append(current)
    return lines


def _commands(line: str, program: str) -> list[list[str]]:
    """The argument lists of each `program ...` command of a shell line (split on &&, ||, ;), a trailing comment and
    anything after a redirection or pipe left out."""
    out = []
    for part in re.split(r"&&|\|\||;", line):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word in _SHELL_STOPS or word.startswith((">", "2>")):
                words = words[:i]
                break
        if words[:1] == [program] or (program == "ptq" and words[:1] == [".venv/bin/ptq"]):
            out.append(words[1:])
        elif program == "ptq" and words[:3] == ["python", "-m", "ptq"]:
            out.append(words[3:])
    return out


def readme_commands(text: str, program: str) -> list[list[str]]:
    return [
        cmd
        for block in _code_blocks(text)
        for line in _logical_lines(block)
        for cmd in _commands(line, program)
    ]


def parse_error(args: list[str]) -> str | None:
    """None when ptq's CLI parses `ptq ARGS` (a known subcommand, known flags, values of the right type, required
    arguments given), else click's message. Nothing is run."""
    group = typer.main.get_command(ptq.cli.app)
    if not args:
        return "no subcommand"
    name, rest = args[0], args[1:]
    sub = group.commands.get(name)
    if sub is None:
        return f"no such command: {name}"
    # click's UsageError family (NoSuchOption, BadParameter, MissingParameter, ...): typer vendors click, so the
    # classes are not imported by name.
    try:
        ctx = sub.make_context(name, list(rest))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    ctx.close()
    return None


README_TEXT = README.read_text()
PTQ_COMMANDS = readme_commands(README_TEXT, "ptq")


def test_the_readme_shows_every_command():
    shown = {cmd[0] for cmd in PTQ_COMMANDS if cmd}
    assert shown >= {"calibrate", "compare", "report", "inspect", "quantize", "eval"}


@pytest.mark.parametrize("args", PTQ_COMMANDS, ids=[" ".join(c)[:80] for c in PTQ_COMMANDS])
def test_each_readme_command_parses(args):
    assert parse_error(args) is None, f"ptq {' '.join(args)}: {parse_error(args)}"


@pytest.mark.parametrize(
    "args",
    [
        ["compare", "smollm2", "--max-windows", "8", "--no-such-flag"],  # a made-up flag
        ["compare", "--max-windows", "eight"],  # a bad value for a typed option
        ["report"],  # a missing required argument
        ["compres", "smollm2"],  # a made-up command
    ],
)
def test_the_check_fails_on_a_wrong_command(args):
    assert parse_error(args) is not None


def test_the_extraction_handles_continuations_and_chains():
    text = (
        "```sh\n# a comment\nptq compare smollm2 \\\n    --max-windows 8 --out r && ptq report r/results.json"
        ' >> "$GITHUB_STEP_SUMMARY"\nmake demo   # builds .venv\necho ptq not this\n```\n'
    )
    assert readme_commands(text, "ptq") == [
        ["compare", "smollm2", "--max-windows", "8", "--out", "r"],
        ["report", "r/results.json"],
    ]
    assert readme_commands(text, "make") == [["demo"]]


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {
        m
        for line in re.findall(r"^([A-Za-z0-9_.-][^:=\n]*):(?!=)", makefile, flags=re.M)
        for m in line.split()
    }


def test_every_make_target_shown_exists():
    targets = _make_targets()
    shown = {cmd[0] for cmd in readme_commands(README_TEXT, "make") if cmd}
    shown |= set(re.findall(r"`make ([A-Za-z0-9_-]+)", README_TEXT))
    assert {"demo", "test"} <= shown
    assert shown <= targets, f"not in the Makefile: {sorted(shown - targets)}"


def test_every_docs_link_points_to_a_file():
    links = re.findall(r"\]\(((?:\./)?docs/[^)#\s]+)(?:#[^)]*)?\)", README_TEXT)
    assert links
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, f"README links to missing files: {missing}"


def test_the_readme_is_short():
    assert len(README_TEXT.splitlines()) <= 250
