"""Which files a model may be read from: one rule, for every reader (loading in memory, layer by
layer, the memory estimate, an export's source dtypes).

A model is its folder. A name that the folder's own metadata gives (a shard in
model.safetensors.index.json's weight_map) must be a relative path inside the folder: an absolute
path, a '..' and a NUL are refused. Every file ptq or transformers reads from the folder (config,
tokenizer and generation files, remote code, weights: READ_PATTERNS), whether named by metadata or
found in it, must resolve inside the folder: a symlink in it that leads out of it is refused, as a
model downloaded from elsewhere could otherwise make ptq read (and echo in errors, or calibrate and
export) any file of the user's. The one exception is the Hugging Face cache's own layout: a Hub
snapshot (`.../models--ORG--NAME/snapshots/COMMIT`) holds symlinks into its repository's `blobs/`
folder, which it may read. A model someone assembled from files kept elsewhere is refused in one
line naming the symlink: copy the file into the folder (or make it a hard link).

The folder's config.json is read once here too (ptq.files.parse_json: malformed or too deeply
nested JSON is one line), and a layer count that is no count of layers is refused as an invalid
config."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from ptq.errors import PtqError
from ptq.files import parse_json

INDEX_NAME = "model.safetensors.index.json"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
# what loading reads from a model folder (its config, tokenizer, generation config, remote code,
# chat templates, weights)
READ_PATTERNS = (
    "*.json",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.py",
    "*.safetensors",
    "*.bin",
    "*.pt",
)


def _hub_blobs(directory: Path) -> Path | None:
    """The blobs/ folder of the Hugging Face cache repository whose snapshot `directory` is (as
    written, before symlinks are followed), else None."""
    directory = Path(directory).absolute()
    snapshots, repo = directory.parent, directory.parent.parent
    if snapshots.name == "snapshots" and re.fullmatch(r"(models|datasets|spaces)--.+", repo.name):
        return repo / "blobs"
    return None


def _roots(directory: Path) -> list[Path]:
    roots = [Path(directory).resolve()]
    blobs = _hub_blobs(directory)
    if blobs is not None:
        roots.append(blobs.resolve())
    return roots


def check_inside(directory: Path, path: Path, what: str) -> Path:
    """`path` (a file in the model folder `directory`) if it resolves inside the folder (or, for a
    Hub snapshot, inside its repository's blobs/); else a PtqError naming where it leads."""
    resolved = Path(path).resolve()
    if any(resolved.is_relative_to(root) for root in _roots(directory)):
        return Path(path)
    raise PtqError(
        f"{what} {path} is a symlink to {resolved}, outside the model folder {directory}: ptq "
        "reads a model from its own folder only (copy the file into the folder)"
    )


def model_file(directory: Path, name: object, what: str) -> Path:
    """The file that `name`, from the model folder's own metadata (`what`: where it was found),
    names: a relative path inside `directory`, resolving (through symlinks) inside it; anything
    else is refused in one line naming `what`."""
    directory = Path(directory)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise PtqError(f"{what} names a file {name!r}, which is not a file name")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise PtqError(
            f"{what} names the file {name!r}, outside the model folder {directory}: a model's "
            "files are read from its own folder only"
        )
    return check_inside(directory, directory / relative, f"{what} names a file that")


def weight_map(directory: Path, index_name: str = INDEX_NAME) -> dict[str, str] | None:
    """The weight_map of the model folder's index (`index_name`), checked: a mapping of tensor
    names to file names, each file inside the folder (model_file); None without an index."""
    index = Path(directory) / index_name
    if not index.is_file():
        return None
    check_inside(directory, index, "the weights index")
    what = f"the weights index {index}"
    data = read_text_json(index, what)
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict):
        raise PtqError(f"{what} has no weight_map mapping tensor names to files")
    for key, name in mapping.items():
        if not isinstance(name, str):
            raise PtqError(
                f"{what} maps tensor {key!r} to {name!r}, which is not a file name: the index is "
                "damaged"
            )
        model_file(directory, name, what)
    return mapping


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files a model folder's weights are read from: those its index names (not a
    repository's other copies, such as Mistral's consolidated.safetensors), or every .safetensors
    file in it; each inside the folder (model_file, check_inside)."""
    directory = Path(directory)
    mapping = weight_map(directory)
    if mapping is not None:
        return [directory / name for name in sorted(set(mapping.values()))]
    return [
        check_inside(directory, path, "weights file")
        for path in sorted(directory.glob("*.safetensors"))
    ]


def read_text_json(path: Path, what: str) -> object:
    """A JSON file of a model folder (ptq.files.parse_json's one line for malformed or too deeply
    nested JSON), read with a one-line error when it cannot be."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PtqError(f"cannot read {what}: {e}") from None
    return parse_json(text, what)


def read_config(directory: Path) -> dict | None:
    """The model folder's config.json as a dict (None without one, or when it is no JSON object:
    transformers then says what is wrong with it); malformed or too deeply nested JSON and a layer
    count that counts no layers are refused in one line."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    check_inside(directory, path, "config")
    config = read_text_json(path, f"config {path}")
    if not isinstance(config, dict):
        return None
    for where in (config, config.get("text_config")):
        count = where.get("num_hidden_layers") if isinstance(where, dict) else None
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 1
        ):
            raise PtqError(
                f"config {path} is invalid: num_hidden_layers is {count!r}, where a model has a "
                "whole number of decoder layers, at least one"
            )
    return config


def check_folder(directory: Path) -> None:
    """Before anything reads the model folder `directory`: every file loading reads from it
    (READ_PATTERNS) resolves inside it, the weight indexes name files inside it, and its
    config.json is readable and valid (read_config)."""
    directory = Path(directory)
    for path in sorted(directory.iterdir()):
        if any(fnmatch.fnmatch(path.name, p) for p in READ_PATTERNS):
            check_inside(directory, path, "model file")
    for index_name in (INDEX_NAME, PICKLE_INDEX_NAME):
        weight_map(directory, index_name)
    read_config(directory)


def remote_code_files(directory: Path) -> list[str]:
    """The JSON files of a model folder that name code of its own (auto_map): config.json,
    tokenizer_config.json, ..."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = parse_json(path.read_text(encoding="utf-8"), str(path))
        except (PtqError, OSError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(path.name)
    return found


def extra_layers(model, names) -> list[str]:
    """Of the checkpoint tensor `names`, those of a layer that the model does not have: under one of
    its ModuleLists (the decoder layers; `model` as transformers builds it), at an index past its
    end (an index that has more layers than config.json's num_hidden_layers). Tensors the model's
    class drops on purpose (`_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token
    prediction layer) are not counted."""
    from torch import nn

    ignored = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ]
    prefix = getattr(model, "base_model_prefix", "") or ""
    lists = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name:
            lists[name] = len(module)
            if prefix and name.startswith(f"{prefix}."):
                lists.setdefault(name.removeprefix(f"{prefix}."), len(module))
    extra = []
    for key in names:
        if any(p.search(key) for p in ignored):
            continue
        for name, length in lists.items():
            found = re.match(rf"{re.escape(name)}\.(\d+)\.", key)
            if found and int(found.group(1)) >= length:
                extra.append(key)
                break
    return sorted(extra)


def refuse_extra_layers(model, names, spec: str) -> None:
    """Refuse a checkpoint that holds layers the model (its config.json) does not have: they would
    be dropped from the calibration and the export without a word."""
    extra = extra_layers(model, names)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise PtqError(
            f"cannot load model '{spec}': the checkpoint has tensor '{extra[0]}'{more} of a "
            f"layer that {type(model).__name__} as its config.json describes it does not have "
            "(num_hidden_layers): the checkpoint does not match its config"
        )
