"""Models larger than memory: `ptq calibrate`, `ptq compare` and `ptq quantize` with `--low-memory`
read a local safetensors checkpoint one decoder layer at a time, for every architecture ptq loads
(dense families, GPT-2, mixture-of-experts), as llm-compressor's sequential pipeline, GPTQ and
AutoAWQ do.

The model is built on the meta device (shapes, no data), twice: as transformers builds it (each
decoder layer is copied from it when it is read) and linearized (ptq.models.matmuls: the names that
recipes select, calibration files are keyed by and the export writes). `LayerByLayer` runs it
(ptq.execution.executors):
1. The trunk: everything but the decoder layers (embeddings, rotary embeddings, final norm,
   lm_head), read from disk; in its list of decoder layers, `LayerSlot`s without weights stand in.
2. Capture: the model's own forward runs on each batch, on what the caller's `parts` makes of the
   trunk (below: what runs before the first decoder layer, OPT's project_in, is then quantized and
   observed as in memory); each slot records what it is called with (position embeddings, attention
   masks, cache positions, whatever the family passes to that layer; the first one also the hidden
   states) and the last one stops the forward.
3. Each decoder layer is read (safetensors, memory-mapped, only that layer's tensors, under the
   names `save_pretrained` gives them: ptq.models.names.checkpoint_names; an already quantized
   checkpoint's weights dequantized as they are read, see SafetensorsCheckpoint), in float32 and
   laid out as ptq.models.loading lays it out (a copy of transformers' layer, then linearized), run
   on every batch, its outputs replacing its inputs, and freed before the next one is read.
4. The logits: the model's forward runs on the trunk again, each slot passing its input on and the
   last one returning the last layer's output, so the final norm, the lm_head and whatever the
   family does after it (Gemma's soft-capping) are the model's own code; what ran before the first
   slot runs again without its hooks (observed once). Without logits, the base model's forward runs
   so, when it has Linear layers after the last decoder layer (OPT's project_out).
What is computed on each part (the trunk, then each layer as it is read) is the caller's `parts`:
calibration's observers, compare's quantized variants and their SNR hooks, as on the whole model in
memory. The same float32 ops run on the same batches in the same order as in memory: the amax, the
scores and the checkpoint files are identical (tests/test_streaming.py).

Memory: the trunk, one decoder layer (in float32, and the variants' weight codes in compare), and
every batch's hidden states (windows x seq_len x hidden x 4 bytes, per variant in compare), all on
the compute device: on CUDA one decoder layer is on the GPU at a time. Export has no forward: each
tensor is read when its shard is written (ptq.export.checkpoint.plan_checkpoint with `read`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from torch import nn

from ptq.errors import PtqError, unreadable_weights
from ptq.model_files import read_config, refuse_extra_layers, safetensors_files
from ptq.models.damage import check_parameters
from ptq.models.loading import (
    LoadedModel,
    local_directory,
    model_kind,
    one_line,
    stored_dequantizer,
    to_compute,
    weightless,
)
from ptq.models.matmuls import kind, linearize, quantizable
from ptq.models.names import checkpoint_names, saved_names
from ptq.models.quantized import check_quantized_tensors
from ptq.runtime.devices import LAYER_BY_LAYER_WAYS_OUT, default_device

LOW_MEMORY_FLAG = "--low-memory"
# already quantized checkpoints read dequantized, tensor by tensor
STREAMED_METHODS = (
    "fp8",
    "compressed-tensors",
)


class SafetensorsCheckpoint:
    """The tensors of a local safetensors checkpoint, read one at a time (nothing is kept open or
    cached). Of an already quantized checkpoint (FP8, 8-bit compressed-tensors), each weight is read
    dequantized by `dequantizer` (ptq.models.loading.stored_dequantizer): its codes times its
    scales, in float32, as transformers loads it."""

    def __init__(self, directory: Path, dequantizer=None, quantization_config=None):
        self.directory = Path(directory)
        self.dequantizer = dequantizer
        # weights stored [in, out] (Conv1D's): dequantized as [out, in], per row
        self.transposed: set[str] = set()
        # the files the index names, or every .safetensors file, each inside the folder
        files = safetensors_files(self.directory)
        self.file: dict[str, Path] = {}
        # a name the tensor is read under -> its name in the file, where they differ
        self.stored: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}  # safetensors dtype names: "BF16", "F32", ...
        for path in files:
            name = path.name
            try:
                with safetensors.safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if key in self.file:
                            raise PtqError(
                                f"tensor '{key}' is stored twice, in {self.file[key].name} and "
                                f"{name}"
                            )
                        piece = f.get_slice(key)
                        self.file[key], self.shape[key], self.dtype[key] = (
                            path,
                            tuple(piece.get_shape()),
                            piece.get_dtype(),
                        )
            except PtqError:
                raise
            except Exception as e:
                raise unreadable_weights(path, e) from None
        # a damaged quantized checkpoint (a scale missing, of the wrong shape or sign) is refused
        # before any of its weights is read
        if quantization_config is not None:
            table = {k: (p, self.dtype[k], self.shape[k]) for k, p in self.file.items()}
            check_quantized_tensors(quantization_config, table, str(self.directory))

    def add_prefix(self, prefix: str) -> None:
        """A checkpoint of the base model alone (openai-community/gpt2's `wte.weight`, not
        `transformer.wte.weight`) read under the names the causal LM gives its tensors, as
        transformers loads it: when no tensor's name starts with `prefix.`, each is also found under
        `prefix.<name>`."""
        if not prefix or any(key.startswith(f"{prefix}.") for key in self.file):
            return
        for key in list(self.file):
            alias = f"{prefix}.{key}"
            if alias not in self.file:
                self.file[alias], self.shape[alias], self.dtype[alias] = (
                    self.file[key],
                    self.shape[key],
                    self.dtype[key],
                )
                self.stored[alias] = key

    def digest(self) -> bytes:
        """The checkpoint's contents: the sha256 of every file it reads (its name, size and bytes),
        in name order, read once from start to end with a progress bar. What a resumed ptq search
        knows a streamed model by: its weights are never in memory whole, to take the moments of
        (ptq.calibration.calibrate.model_digest)."""
        import hashlib

        from ptq.progress import progress

        files = sorted(set(self.file.values()), key=lambda path: path.name)
        sizes = [path.stat().st_size for path in files]
        h = hashlib.sha256()
        with progress(
            "fingerprinting the checkpoint (MiB)", -(-sum(sizes) // (1 << 20))
        ) as advance:
            for path, size in zip(files, sizes):
                h.update(f"{path.name} {size}\n".encode())
                with open(path, "rb") as f:
                    while block := f.read(1 << 24):
                        h.update(block)
                        advance(len(block) >> 20)
        return h.digest()

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype; each file is opened once per call and closed
        after."""
        return dict(self.each(names))

    def read_one(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def each(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors one at a time (each file opened once), so that one is in memory at a
        time."""
        missing = [n for n in names if n not in self.file]
        if missing:
            raise PtqError(f"the checkpoint in {self.directory} has no tensor '{missing[0]}'")
        # read first: small (MX: a 32nd of the codes, at most)
        scales = {n: self._scales(n) for n in names}
        read = dict(self._plain(sorted({s for ss in scales.values() for s in ss})))
        for k, tensor in self._plain(names):
            if scales.get(k):
                stored, flip = self.stored.get(k, k), k in self.transposed
                # compressed-tensors' scales are per output row: a Conv1D weight's rows are its
                # columns on disk
                codes = tensor.t() if flip else tensor
                tensor = self.dequantizer.process(
                    {stored: codes} | {s: read[s] for s in scales[k]}
                )[stored]
                tensor = tensor.t() if flip else tensor  # as stored, as every tensor `each` yields
            yield k, tensor

    def _scales(self, name: str) -> list[str]:
        """The tensors (scales) that `name` is dequantized with; none for a tensor stored in 16 or
        32 bits. The converter names a scale for every weight its config targets
        (compressed-tensors' "Linear" matches a norm's weight too): a weight with none of them
        stored is stored as it is; one with some, or 8-bit codes without scales, is a damaged
        checkpoint."""
        if self.dequantizer is None:
            return []
        wanted = sorted(self.dequantizer.get_dependencies(self.stored.get(name, name)))
        present = [s for s in wanted if s in self.file]
        if present and len(present) < len(wanted):
            missing = next(s for s in wanted if s not in self.file)
            raise PtqError(
                f"the checkpoint in {self.directory} has no tensor '{missing}', a scale of '{name}'"
            )
        # other 8-bit tensors: masks, ids
        codes = ("F8_E4M3", "F8_E5M2") + (("I8", "U8") if wanted else ())
        if not present and self.dtype[name] in codes:
            raise PtqError(
                f"tensor '{name}' in {self.directory} holds 8-bit codes ({self.dtype[name]}) but "
                "the checkpoint has no scale for it"
            )
        return present

    def _plain(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors as stored, one at a time, each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file[n], []).append(n)
        for path, keys in by_file.items():
            with safetensors.safe_open(str(path), framework="pt") as f:
                for k in keys:
                    yield k, f.get_tensor(self.stored.get(k, k))


def supports(spec: str | None) -> bool:
    """Whether `spec` is a safetensors checkpoint in a folder (a local one, or a Hub id's in the
    Hugging Face cache, downloaded first: loading would download it anyway), 16/32-bit or quantized
    by a method read dequantized (ptq.models.loading.stored_dequantizer; what it cannot read is
    refused there, in one line)."""
    return _directory(spec) is not None


def _directory(spec: str | None) -> Path | None:
    """The folder `supports` answers for; None for a spec it does not."""
    if model_kind(spec) == "gguf":
        # automatic streaming only for folders: the default model fits anyway, a .gguf converts
        # whole
        return None
    found = local_directory(spec)
    if found is None:
        return None
    directory = found[0]
    config = read_config(directory)  # one line for malformed or too deeply nested JSON
    if not isinstance(config, dict) or not any(directory.glob("*.safetensors")):
        return None
    quantized = config.get("quantization_config")
    if quantized is None or (
        isinstance(quantized, dict) and quantized.get("quant_method") in STREAMED_METHODS
    ):
        return directory
    return None


def too_big(spec: str | None, copies: float = 1) -> bool:
    """The estimate of ptq.runtime.resources (float32 weights times `copies` vs the memory
    available) says the model does not fit; on a GPU, also when its float32 weights do not fit the
    host's memory, where loading reads them first (ptq.models.loading)."""
    from ptq.runtime.resources import shortfall

    directory = _directory(spec)
    if directory is None:
        return False
    device = default_device()
    return shortfall(directory, copies, device) is not None or (
        device.type != "cpu" and shortfall(directory, 1, torch.device("cpu")) is not None
    )


@dataclass
class Streamed:
    """What a streamed model is read from: the model as transformers builds it (on the meta device),
    the checkpoint, the checkpoint's name of each tensor of the linearized model, and where its
    decoder layers are."""

    built: nn.Module
    checkpoint: SafetensorsCheckpoint
    disk: dict[str, str]  # state-dict name in the linearized model -> tensor name in the checkpoint
    layers: str  # the decoder layers' ModuleList, e.g. "model.layers" ("transformer.h" for GPT-2)


def load_streamed(
    spec: str | None, trust_remote_code: bool = False, memory_check: bool = True
) -> LoadedModel:
    """The model on the meta device, linearized (no weights in memory), its tokenizer, and what to
    read it from. No remote code runs: only the architectures transformers itself implements are
    streamed. `memory_check`: a .gguf not yet converted is refused when the host cannot hold it in
    float32 (its conversion loads it whole)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    found = local_directory(spec, memory_check)
    if found is None:
        raise PtqError(
            f"{LOW_MEMORY_FLAG} works on a model folder with safetensors weights or a Hub id; "
            f"'{spec}' is neither"
        )
    directory, caveats, source = found
    if not (directory / "config.json").is_file():
        raise PtqError(f"{spec} is not a Hugging Face model directory (no config.json)")
    if not any(directory.glob("*.safetensors")):
        raise PtqError(
            f"{spec} has no .safetensors weights ({LOW_MEMORY_FLAG} reads safetensors only)"
        )
    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(directory))
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise PtqError(f"cannot load model '{spec}': {one_line(e, directory=directory)}") from None
    quantized = getattr(config, "quantization_config", None)
    # an FP8 or 8-bit compressed-tensors checkpoint: read dequantized, as in memory
    if quantized is not None:
        stored = {
            "quantization_config": quantized if isinstance(quantized, dict) else quantized.to_dict()
        }
        dequantizer, caveat = stored_dequantizer(directory, stored, spec)
        caveats = (*caveats, caveat)
        del config.quantization_config  # the model is built, run and exported as a 16/32-bit one
    else:
        dequantizer = None
    checkpoint = SafetensorsCheckpoint(
        directory, dequantizer, stored["quantization_config"] if dequantizer else None
    )
    built = weightless(config, spec)  # no remote code: streamed architectures are transformers' own
    checkpoint.add_prefix(getattr(built, "base_model_prefix", ""))
    # as in memory (ptq.models.loading.check_loading_info): layers past the config's are refused
    refuse_extra_layers(built, list(checkpoint.file), spec)
    _tie_as_loaded(built, checkpoint)
    model = linearize(copy.deepcopy(built))
    layers = decoder_layers(model)
    try:
        disk = checkpoint_names(model, saved_names(model))
    except PtqError as e:
        raise PtqError(f"{LOW_MEMORY_FLAG} cannot read {spec} layer by layer: {e}") from None
    absent = [name for name in disk.values() if name not in checkpoint.file]
    if absent:
        raise PtqError(
            f"the checkpoint in {directory} has no tensor '{absent[0]}', which "
            f"{type(model).__name__} has: {LOW_MEMORY_FLAG} reads checkpoints written in the "
            "layout of this transformers version"
        )
    _check_shapes(model, disk, checkpoint, directory)
    checkpoint.transposed = {disk[name] for name in conv1d_weights(model) if name in disk}
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.ptq_checkpoint = checkpoint
    model.ptq_streamed = Streamed(built, checkpoint, disk, layers)
    return LoadedModel(
        model, tokenizer, name=spec or "smollm2", source=source, caveats=tuple(caveats)
    )


def _tie_as_loaded(built: nn.Module, checkpoint: SafetensorsCheckpoint) -> None:
    """Tie the weights the config ties, as from_pretrained does (init_empty_weights leaves them
    apart); as transformers does too, not a pair that the checkpoint stores both of with different
    values (a tied config whose checkpoint has its own lm_head.weight): those stay apart, each read
    from its own tensor."""
    tied = getattr(built, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        built.tie_weights()
        return
    for target, source in list(tied.items()):
        if target in checkpoint.file and source in checkpoint.file:
            stored = checkpoint.read([target, source])
            a, b = stored[target], stored[source]
            if a.shape != b.shape or not torch.equal(a.to(torch.float32), b.to(torch.float32)):
                tied.pop(target)
            del stored, a, b
    built.tie_weights(recompute_mapping=False)


def _check_shapes(
    model: nn.Module, disk: dict[str, str], checkpoint: SafetensorsCheckpoint, directory: Path
) -> None:
    """Every tensor's shape in the checkpoint against the model's (config.json), before anything
    runs: copied into a tensor of another shape, it would be broadcast silently. Conv1D's weight is
    [in, out] on disk."""
    tensors = model.state_dict(keep_vars=True)
    conv1d = conv1d_weights(model)
    for name, stored in disk.items():
        want = tuple(tensors[name].shape)
        want = want[::-1] if name in conv1d else want
        got = checkpoint.shape[stored]
        if got != want:
            raise PtqError(
                f"tensor '{stored}' in the checkpoint in {directory} has shape {list(got)}, but "
                f"{type(model).__name__} as its config.json describes it has {list(want)}: the "
                "checkpoint does not match its config"
            )


def conv1d_weights(model: nn.Module) -> set[str]:
    """The state-dict names of the linearized model's Conv1D weights: [in, out] on disk, [out, in]
    in the model."""
    return {
        f"{name}.weight"
        for name, m in model.named_modules()
        if quantizable(m) and kind(m) == "Conv1D"
    }


def whole_reader(
    spec: str | None, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
):
    """ptq's reader for ptq.models.loading.load_model's `reader`: a compressed-tensors checkpoint
    that transformers' loader cannot dequantize (GPT-2's Conv1D layers, an MXFP8 model's merged
    experts), read whole onto a device."""

    def reader(device: torch.device) -> LoadedModel:
        # (remote code: the tokenizer's)
        loaded = load_streamed(spec, trust_remote_code, memory_check=False)
        return read_whole(loaded, device, dtype)

    return reader


def read_whole(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A model loaded by load_streamed, read whole into memory on `device` in `dtype`: how ptq loads
    a checkpoint that transformers' loader cannot dequantize (ptq.models.loading.load_model:
    compressed-tensors Conv1D layers)."""
    streamed = loaded.model.ptq_streamed
    model = _materialise(streamed.built, streamed, device)
    model.generation_config = loaded.model.generation_config
    return dataclasses.replace(loaded, model=to_compute(model, device, dtype))


def is_streamed(model: nn.Module) -> bool:
    return isinstance(getattr(model, "ptq_streamed", None), Streamed)


def decoder_layers(model: nn.Module) -> str:
    """The name of the model's list of decoder layers: the first ModuleList of num_hidden_layers
    modules of one of the classes transformers keeps whole when it splits a model
    (`_no_split_modules`)."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    count = getattr(config, "num_hidden_layers", None)
    whole = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and count
            and len(module) == count
            and all(type(m).__name__ in whole for m in module)
        ):
            return name
    raise PtqError(
        f"cannot find the decoder layers of {type(model).__name__}: {LOW_MEMORY_FLAG} runs a model "
        "one decoder layer at a time; load it whole"
    )


def check_compare_recipes(recipes: list) -> None:
    """Layer by layer, the layers run as transformers' code with ptq's Linear layers: recipes that
    quantize attention's matmul inputs, the KV cache or the residual adds (which switch the whole
    model's attention) need the model whole."""
    for r in recipes:
        if r.beyond_linear:
            words = {
                "attention": "attention's matmul inputs",
                "kv_cache": "the KV cache",
                "residual": "residual adds",
            }
            raise PtqError(
                f"recipe '{r.name}' quantizes {' and '.join(words[k] for k in r.beyond_linear)}: "
                f"{LOW_MEMORY_FLAG} compares Linear-layer recipes only; load the model whole"
            )


class LayerSlot(nn.Module):
    """Stands in for a decoder layer in the trunk: no weights, the layer's plain attributes (a
    family's forward may read `attention_type` or `layer_idx` off its layers); what a call does is
    `action`, set by LayerByLayer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for key, value in vars(layer).items():
            if (
                not key.startswith("_")
                and key != "training"
                and not isinstance(value, (nn.Module, torch.Tensor))
            ):
                self.__dict__[key] = value
        self.action: Callable | None = None

    def forward(self, *args, **kwargs):
        return self.action(*args, **kwargs)


class _Captured(Exception):
    """Raised by the last slot: the forward has given every decoder layer its inputs."""


@contextlib.contextmanager
def _as_is(part: nn.Module) -> Iterator[dict[str, nn.Module]]:
    yield {"model": part}


def _mounted(module: nn.Module, path: str) -> nn.Module:
    """A container holding `module` at `path` (e.g. "model.layers.3"), so that its layers have their
    names in the whole model, which recipes select on and calibration files are keyed by."""
    root = parent = nn.Module()
    *parents, leaf = path.split(".")
    for part in parents:
        setattr(parent, part, nn.Module())
        parent = getattr(parent, part)
    setattr(parent, leaf, module)
    return root


HIDDEN_ON_GPU_FRACTION = (
    0.25  # of the free GPU memory at the capture, the rest for the layers and the activations
)


class LayerByLayer:
    """The executor (ptq.execution.executors) of a streamed model: one decoder layer in memory at a
    time.

    parts(part) -> context manager yielding {name: module}: what runs of each part of the model,
    given the part with its tensors read from disk and its modules under their names in the whole
    model (the trunk is a model whose decoder layers are slots; a layer is mounted at its path).
    Calibration yields the part itself with observers hooked on it; compare yields the part's
    quantized variants. Default: the part itself, as "model".

    starts (ptq search's configurations): model name -> the decoder layer it starts at. Such a model
    takes the first model's (the baseline's) hidden states as its input at that layer, copied as
    the baseline is about to run it; its own trunk does not run before the first decoder layer and
    its earlier layers do not run at all (`parts` need not give them: a layer part gives only the
    models that run it). The caller vouches that they compute what the baseline's do, as the search
    does for the layers before a configuration's first quantized one (16-bit layers both), so the
    numbers are those of the model run whole; the hidden states of such a model are held from that
    layer on only."""

    def __init__(
        self,
        model: nn.Module,
        parts: Callable | None = None,
        names: list[str] | None = None,
        device: torch.device | None = None,
        starts: dict[str, int] | None = None,
    ):
        if not is_streamed(model):
            raise ValueError("LayerByLayer runs a model made by load_streamed")
        self.model = model  # the linearized skeleton: what batch-size estimates read
        self.streamed: Streamed = model.ptq_streamed
        self.parts = parts or _as_is
        self.names = names or ["model"]
        self.device = device or default_device()
        self.dtype = torch.float32  # every tensor is read in float32
        self.layer_count = len(model.get_submodule(self.streamed.layers))
        # the baseline starts at the first layer; a start past the last layer: the baseline's
        # output of the last one
        self.starts = {
            name: min(start, self.layer_count)
            for name, start in (starts or {}).items()
            if start > 0 and name in self.names[1:]
        }
        self.description = f"layer by layer from disk ({self.layer_count} decoder layers)"
        self.ways_out = LAYER_BY_LAYER_WAYS_OUT  # of an out-of-memory: --low-memory is this

    def with_parts(self, parts: Callable, names: list[str]) -> LayerByLayer:
        return LayerByLayer(self.model, parts, names, self.device)

    def steps(self, windows: int, logits: bool = True) -> int:
        layers = sum(self.layer_count - self.starts.get(name, 0) for name in self.names)
        return windows * (layers + (len(self.names) if logits else 0))

    def runs(self, name: str, layer: int) -> bool:
        """Whether the model `name` runs decoder layer `layer` (see `starts`)."""
        return self.starts.get(name, 0) <= layer

    def forward(
        self,
        input_ids: torch.Tensor,
        size: int,
        *,
        logits: bool = True,
        after_batch: Callable[[int], None] | None = None,
        advance: Callable[[int], None] = lambda n: None,
    ) -> Iterator[tuple[torch.Tensor, Iterator]]:
        with _frozen_heap():
            yield from self._forward(input_ids, size, logits, after_batch, advance)

    def _forward(
        self,
        input_ids: torch.Tensor,
        size: int,
        logits: bool,
        after_batch: Callable[[int], None] | None,
        advance: Callable[[int], None],
    ) -> Iterator[tuple[torch.Tensor, Iterator]]:
        batches = [b.to(self.device) for b in input_ids.split(size)]
        trunk = self._trunk(logits)
        # The trunk's Linear layers that the base model runs after its last decoder layer (OPT's
        # project_out): run when the logits are not computed too, as calibration runs the base model
        # in memory (ptq's `_runner`)
        linears = {n for n, m in trunk.named_modules() if quantizable(m) and _in_base(trunk, n)}
        with self.parts(trunk) as trunks:
            del trunk
            # Each model's own inputs of its first decoder layer: what runs before it (OPT's
            # project_in) is part of the trunk, quantized in a variant and observed in calibration
            # as in memory (and checked batch by batch, so that a fault there is named with its own
            # batch)
            captured, store = {name: [] for name in self.names if name not in self.starts}, None
            for name in captured:
                for b, batch in enumerate(batches):
                    h, c, e = self._capture(trunks[name], batch)
                    if store is None:
                        store = self._hidden_store(h, len(batch), len(input_ids))
                    # each model's own hidden states, every batch, in buffers that each layer's
                    # outputs are copied into (new long-lived tensors at every layer would fragment
                    # the host's memory: its peak would grow layer by layer)
                    captured[name].append((h.to(store, copy=True), c, e))
                    del h
                    if after_batch is not None:
                        after_batch(b)
            # per batch, per layer: (positional arguments after the hidden states, keywords), the
            # same for every model
            calls = [c for _, c, _ in captured[self.names[0]]]
            # modules run before the first decoder layer (by the models that start later: the
            # same modules of their own trunks, which run them for the logits)
            early = {name: captured[name][0][2] for name in captured}
            ran = {
                n
                for n, m in trunks[self.names[0]].named_modules()
                if any(m is e for e in early[self.names[0]])
            }
            for name in self.starts:
                early[name] = [m for n, m in trunks[name].named_modules() if n in ran]
            tail = bool(linears - ran)
            hidden = {name: [h for h, _, _ in captured.pop(name)] for name in list(captured)}
            returns_tuple = False
            for i in range(self.layer_count + 1):
                # the models that start at this layer: the baseline's hidden states as it is
                # about to run it (after the last layer: its output)
                for name, start in self.starts.items():
                    if start == i:
                        hidden[name] = [h.clone() for h in hidden[self.names[0]]]
                if i == self.layer_count:
                    break
                path = f"{self.streamed.layers}.{i}"
                with self.parts(self._layer(i)) as layers:
                    for name in self.names:
                        if not self.runs(name, i):
                            continue
                        layer = layers[name].get_submodule(path)
                        for b, batch in enumerate(batches):
                            args, kwargs = calls[b][i]
                            # the same tensor where they wait on the device
                            h = hidden[name][b].to(self.device)
                            out = layer(h, *args, **kwargs)
                            returns_tuple = isinstance(out, tuple)
                            hidden[name][b].copy_(out[0] if returns_tuple else out)
                            del out, h
                            if after_batch is not None:
                                after_batch(b)
                            advance(len(batch))
                    del layer
                del layers
                # this layer's weights are freed before the next one is read (its copies hold
                # cycles)
                gc.collect()
            for b, batch in enumerate(batches):
                finals = [hidden[name][b].to(self.device) for name in self.names]
                # what runs after the last decoder layer (final norm, lm_head, project_out) is
                # checked too
                if logits:
                    yield (
                        batch,
                        _then(
                            self._logits(trunks, finals, batch, returns_tuple, early),
                            after_batch,
                            b,
                        ),
                    )
                    advance(len(batch) * len(self.names))
                else:
                    if tail:
                        for _ in self._logits(
                            trunks, finals, batch, returns_tuple, early, base=True
                        ):
                            pass
                        if after_batch is not None:
                            after_batch(b)
                    yield batch, iter(())
                for name in self.names:
                    hidden[name][b] = None

    def _hidden_store(self, hidden: torch.Tensor, batch_windows: int, windows: int) -> torch.device:
        """Where every window's hidden states wait between decoder layers: on the compute device
        while all of them (every model's) take at most HIDDEN_ON_GPU_FRACTION of its free memory,
        else in host memory, each batch copied over for its layer. They do not shrink with the batch
        size: held on a GPU they could not fit (a 405B model's 512 calibration windows of 2048
        tokens: 64 GiB in float32), every out-of-memory back-off would read the whole checkpoint
        again, to fail at batch size 1."""
        if self.device.type != "cuda":
            return self.device
        need = hidden.numel() * hidden.element_size() * windows * len(self.names) // batch_windows
        free, _ = torch.cuda.mem_get_info(self.device)
        return self.device if need <= HIDDEN_ON_GPU_FRACTION * free else torch.device("cpu")

    def _trunk(self, logits: bool) -> nn.Module:
        """The model with its tensors outside the decoder layers read, and LayerSlots for the
        decoder layers. Without `logits`, the lm_head is not read (unless it is the input
        embeddings, tied)."""
        built = self.streamed.built
        parent_name, _, attr = self.streamed.layers.rpartition(".")
        parent = built.get_submodule(parent_name)
        layers = getattr(parent, attr)
        head = built.get_output_embeddings()
        tied = head is not None and head.weight is getattr(
            built.get_input_embeddings(), "weight", None
        )
        unread = (
            ()
            if logits or head is None or tied
            else tuple(n for n, m in built.named_modules() if m is head)
        )
        setattr(parent, attr, nn.ModuleList([LayerSlot(layer) for layer in layers]))
        try:
            trunk = _materialise(built, self.streamed, self.device, unread=unread)
        finally:
            setattr(parent, attr, layers)
        return trunk

    def _layer(self, i: int) -> nn.Module:
        path = f"{self.streamed.layers}.{i}"
        return _materialise(
            self.streamed.built.get_submodule(path), self.streamed, self.device, path
        )

    def _capture(
        self, trunk: nn.Module, batch: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[tuple, dict]], list[nn.Module]]:
        """The first decoder layer's hidden states and every decoder layer's other arguments on one
        batch, and the trunk's modules that ran before the first decoder layer."""
        slots = trunk.get_submodule(self.streamed.layers)
        calls = []
        early: list[nn.Module] = []

        def record(*args, **kwargs):
            hidden, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
            calls.append((hidden, (args, kwargs)))
            if len(calls) == len(slots):
                raise _Captured
            return hidden  # what the next layer gets is not used: only the first layer's input is

        def called(module, args):
            if not calls and not any(module is m for m in early):
                early.append(module)

        for slot in slots:
            slot.action = record
        inside = {id(m) for slot in slots for m in slot.modules()}
        hooks = [
            m.register_forward_pre_hook(called) for m in trunk.modules() if id(m) not in inside
        ]
        try:
            trunk(input_ids=batch, use_cache=False, **_no_aux_outputs(trunk))
        except _Captured:
            pass
        finally:
            for h in hooks:
                h.remove()
        if len(calls) != len(slots):
            raise PtqError(
                f"the forward of {type(trunk).__name__} called {len(calls)} of its {len(slots)} "
                f"decoder layers: {LOW_MEMORY_FLAG} cannot run it layer by layer; load it whole"
            )
        return calls[0][0], [c for _, c in calls], early

    def _logits(
        self,
        trunks: dict[str, nn.Module],
        finals: list[torch.Tensor],
        batch: torch.Tensor,
        returns_tuple: bool,
        early: dict[str, list[nn.Module]],
        base: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each model's logits on `batch` from its last decoder layer's output `finals[i]`, by the
        model's forward (`base`: the base model's forward, no lm_head: its last hidden states). What
        runs before the first decoder layer ran on this batch at the capture: run again here without
        its hooks (observers, SNR), its output unused."""
        wrap = (lambda x: (x,)) if returns_tuple else (lambda x: x)  # noqa: E731  as the layers return it
        for name, final in zip(self.names, finals):
            trunk = trunks[name]
            slots = trunk.get_submodule(self.streamed.layers)
            for slot in slots:
                slot.action = lambda *args, **kwargs: wrap(
                    args[0] if args else kwargs["hidden_states"]
                )
            slots[len(slots) - 1].action = lambda *args, final=final, **kwargs: wrap(final)
            with _without_hooks(early[name]):
                if base:
                    out = trunk.base_model(
                        input_ids=batch, use_cache=False, **_no_aux_outputs(trunk)
                    ).last_hidden_state
                else:
                    out = trunk(input_ids=batch, use_cache=False, **_no_aux_outputs(trunk)).logits
            yield name, out


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """For the block, the collections that free each decoder layer once it has run (gc.collect)
    look at the objects made since it began only: those made before (the imported modules, the
    skeleton: millions of objects, about 0.3 s a collection even on a tiny model, in which ptq
    search's chunks of layers spent most of their time) are frozen out of them (gc.freeze), and
    given back to the collector after (gc.unfreeze), once what the block made and left (the trunk's
    copies) is collected. Nothing made before the block is garbage that the block must free."""
    if gc.get_freeze_count():  # frozen by a caller: left as it is
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def _no_aux_outputs(trunk: nn.Module) -> dict:
    """A MoE config with `output_router_logits` makes the model's forward gather every layer's
    router logits for its load-balancing loss, which the trunk, its layers run apart, does not have
    (an IndexError): asked off, as the loss is not used (the whole model computes it and drops it).
    Nothing is passed to a model without it."""
    return (
        {"output_router_logits": False}
        if getattr(trunk.config, "output_router_logits", False)
        else {}
    )


def _then(outputs: Iterator, after_batch: Callable[[int], None] | None, b: int) -> Iterator:
    """`outputs`, then after_batch(b) once they are all out (as WholeModels calls it)."""
    yield from outputs
    if after_batch is not None:
        after_batch(b)


def _in_base(model: nn.Module, name: str) -> bool:
    """Whether the module named `name` in `model` is in its base model (not the lm_head)."""
    prefix = getattr(model, "base_model_prefix", "")
    return getattr(model, "base_model", model) is model or name.startswith(f"{prefix}.")


@contextlib.contextmanager
def _without_hooks(modules: list[nn.Module]) -> Iterator[None]:
    """The modules' forward hooks off for the block."""
    from collections import OrderedDict

    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in modules]
    for m in modules:
        m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def _materialise(
    built: nn.Module,
    streamed: Streamed,
    device: torch.device,
    path: str = "",
    unread: tuple[str, ...] = (),
) -> nn.Module:
    """A copy of `built` (a meta-device module as transformers builds it, at `path` in the model)
    with its tensors read from the checkpoint in float32, linearized as ptq.models.loading loads
    every model (the experts' and Conv1D's Linear layers are views into the tensors transformers
    lays out); mounted at `path`. The tensors of the linearized module are written through those
    views, each from its own tensor in the checkpoint. The modules named in `unread` keep their
    tensors on the meta device."""
    module = copy.deepcopy(built)
    made: dict[int, nn.Parameter] = {}
    left = {id(m) for name in unread for m in module.get_submodule(name).modules()}
    for m in module.modules():
        if id(m) in left:
            continue
        for key, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:  # tied parameters stay tied
                    made[id(p)] = nn.Parameter(
                        torch.empty(
                            p.shape,
                            device=device,
                            dtype=torch.float32 if p.is_floating_point() else p.dtype,
                        ),
                        requires_grad=False,
                    )
                m._parameters[key] = made[id(p)]
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = b.to(
                    device=device, dtype=torch.float32 if b.is_floating_point() else b.dtype
                )
    linearize(module)
    root = _mounted(module, path) if path else module
    conv1d = conv1d_weights(root)
    params = {id(p) for p in root.parameters()}
    left_tensors = {
        id(t) for m in module.modules() if id(m) in left for t in (*m.parameters(), *m.buffers())
    }
    done: set[int] = set()
    # checkpoint name -> (model name, the tensor to fill)
    targets: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in root.state_dict(keep_vars=True).items():
        if id(tensor) in done or id(tensor) in left_tensors:
            continue  # tied to a tensor already listed, or left unread
        done.add(id(tensor))
        if name in streamed.disk:
            targets[streamed.disk[name]] = (name, tensor)
        elif id(tensor) in params:
            raise PtqError(
                f"tensor '{name}' of the model is not in the checkpoint: {LOW_MEMORY_FLAG} cannot "
                "read it"
            )
        # else a buffer the checkpoint does not keep: as the model computes it
    with torch.no_grad():
        for stored_name, value in streamed.checkpoint.each(list(targets)):
            name, tensor = targets[stored_name]
            # Conv1D keeps its weight [in, out] on disk
            tensor.copy_(value.t() if name in conv1d else value)
            del value
    # as each part is read from disk, before it runs (a model in memory: once it is loaded)
    check_parameters(root)
    return root
