"""Models larger than memory: `ptq calibrate --low-memory`, `ptq quantize --low-memory` and `ptq compare
--low-memory` work on a safetensors checkpoint block by block from disk, so that a model whose weights do not
fit in memory can still be calibrated, quantized and compared (compare_blocks: each variant keeps its own
hidden states, each block is quantized per recipe when it is read).

The model itself is built on the meta device (shapes, no data). Calibration is one pass over the checkpoint:
the embedding table is read, the calibration windows are embedded batch by batch and the hidden states kept;
then, for each decoder block, only that block's tensors are read (safetensors `safe_open`, one tensor at a
time), given to transformers' own decoder layer (`load_state_dict(assign=True)`), every cached batch runs
through it with ptq's TensorObservers hooked on its Linear layers (its outputs replace the cached inputs),
and the block is freed. Position ids, rotary embeddings and the causal mask are made as LlamaModel.forward
makes them. Same batches, same float32 ops in the same order as the in-memory calibration: the amax are
bit-identical (tests/test_streaming.py).

Export is a second pass, with no forward: ptq.export.checkpoint's checkpoint plan and shard writer, each tensor read
from disk when its output shard is written, quantized by ptq.quantization.quantize.quantize_weight (the one code path) or
copied in its own dtype. The files are byte-identical to those of the in-memory `ptq quantize`.

Memory: calibration holds one block in float32 plus the cached hidden states (windows x seq_len x hidden
x 4 bytes); export holds one output shard (--shard-size) plus one tensor being quantized (about five
float32 copies of the largest Linear weight while it is rounded). Only the Llama architecture (SmolLM2,
Llama 2/3) is supported: other architectures build their masks and position embeddings differently.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import safetensors
import torch
from torch import nn

from ptq.calibration.calibrate import Calibration, TensorObserver, _fail_on_nonfinite, check_weight, finish
from ptq.errors import PtqError
from ptq.models.loading import LoadedModel
from ptq.numerics.formats import amax
from ptq.progress import progress

SUPPORTED_MODEL_TYPES = ("llama",)
LOW_MEMORY_FLAG = "--low-memory"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class SafetensorsCheckpoint:
    """The tensors of a local safetensors checkpoint, read one at a time (nothing is kept open or cached)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise PtqError(f"{index} is not a readable safetensors index") from None
        else:
            files = [p.name for p in sorted(self.directory.glob("*.safetensors"))]
        self.file: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}  # safetensors dtype names: "BF16", "F32", ...
        for name in files:
            path = self.directory / name
            try:
                with safetensors.safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if key in self.file:
                            raise PtqError(f"tensor '{key}' is stored twice, in {self.file[key].name} and {name}")
                        piece = f.get_slice(key)
                        self.file[key], self.shape[key], self.dtype[key] = path, tuple(piece.get_shape()), piece.get_dtype()
            except PtqError:
                raise
            except Exception:
                raise PtqError(f"cannot read the weights file {path}: missing, damaged or not safetensors") from None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype; each file is opened once per call and closed after."""
        missing = [n for n in names if n not in self.file]
        if missing:
            raise PtqError(f"the checkpoint in {self.directory} has no tensor '{missing[0]}'")
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file[n], []).append(n)
        tensors = {}
        for path, keys in by_file.items():
            with safetensors.safe_open(str(path), framework="pt") as f:
                for k in keys:
                    tensors[k] = f.get_tensor(k)
        return tensors

    def read_one(self, name: str) -> torch.Tensor:
        return self.read([name])[name]


def directory_of(spec: str | None) -> tuple[Path, tuple[str, ...], str] | None:
    """The local safetensors directory behind a model spec (the offline default and .gguf files are converted
    once, as ptq.models.loading does), its caveats and source text; None for a Hub id."""
    from ptq.models import loading as models

    if spec is None or spec == models.DEFAULT_MODEL:
        import importlib.metadata

        directory, caveats = models.converted_gguf_dir(models.default_gguf_path())
        return directory, caveats, (f"SmolLM2-135M-Instruct from the PyPI package {models.DEFAULT_DISTRIBUTION} "
                                    f"{importlib.metadata.version(models.DEFAULT_DISTRIBUTION)}")
    if spec.endswith(".gguf") and Path(spec).is_file():
        directory, caveats = models.converted_gguf_dir(Path(spec))
        return directory, caveats, f"{Path(spec).resolve()} (GGUF)"
    directory = Path(spec).expanduser()
    if directory.is_dir():
        return directory, (), str(directory.resolve())
    return None


def supports(spec: str | None) -> bool:
    """Whether `spec` is a local safetensors checkpoint of an architecture ptq can stream (no load needed)."""
    if spec is None or not Path(spec).expanduser().is_dir():
        return False  # automatic streaming only for local directories: the default model fits anyway
    directory = Path(spec).expanduser()
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("model_type") in SUPPORTED_MODEL_TYPES
            and "quantization_config" not in config and any(directory.glob("*.safetensors")))


def too_big(spec: str | None, copies: float = 1) -> bool:
    """The estimate of ptq.execution.resources (float32 weights times `copies` vs the memory available) says the model
    does not fit."""
    from ptq.execution.devices import default_device
    from ptq.execution.resources import shortfall

    return supports(spec) and shortfall(Path(spec).expanduser(), copies, default_device()) is not None


def load_streamed(spec: str | None, trust_remote_code: bool = False) -> LoadedModel:
    """The model on the meta device (no weights in memory), its tokenizer, and its checkpoint to stream from.
    No remote code runs: only the architectures transformers itself implements are streamed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    found = directory_of(spec)
    if found is None:
        raise PtqError(f"{LOW_MEMORY_FLAG} works on a local model directory with safetensors weights; '{spec}' is not one "
                       "(download it first, e.g. with `hf download`)")
    directory, caveats, source = found
    if not (directory / "config.json").is_file():
        raise PtqError(f"{spec} is not a Hugging Face model directory (no config.json)")
    if not any(directory.glob("*.safetensors")):
        raise PtqError(f"{spec} has no .safetensors weights ({LOW_MEMORY_FLAG} reads safetensors only)")
    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(directory))
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtqError(f"cannot load model '{spec}': {reason}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise PtqError(f"{LOW_MEMORY_FLAG} supports the {', '.join(SUPPORTED_MODEL_TYPES)} architecture, not "
                       f"'{config.model_type}' ({spec}): load it whole, without {LOW_MEMORY_FLAG}")
    if getattr(config, "quantization_config", None) is not None:
        raise PtqError(f"{spec} is already a quantized checkpoint: {LOW_MEMORY_FLAG} reads 16/32-bit checkpoints only")
    checkpoint = SafetensorsCheckpoint(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.ptq_checkpoint = checkpoint
    return LoadedModel(model, tokenizer, name=spec or "smollm2", source=source, caveats=tuple(caveats))


def is_streamed(model: nn.Module) -> bool:
    return isinstance(getattr(model, "ptq_checkpoint", None), SafetensorsCheckpoint)


def _materialise(skeleton: nn.Module, prefix: str, checkpoint: SafetensorsCheckpoint, device: torch.device) -> nn.Module:
    """A copy of a meta-device module with its tensors from disk, in float32 (as ptq.models.loading loads every model).
    The skeleton itself stays on the meta device (its tied weights stay tied)."""
    module = copy.deepcopy(skeleton)
    names = list(module.state_dict())
    tensors = checkpoint.read([f"{prefix}.{n}" for n in names])
    state = {n: _float32(tensors[f"{prefix}.{n}"]).to(device) for n in names}
    module.load_state_dict(state, strict=True, assign=True)
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise PtqError(f"module '{prefix}' keeps tensors that are not in the checkpoint: {LOW_MEMORY_FLAG} cannot build it")
    return module


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _embedded(model: nn.Module, batches: tuple[torch.Tensor, ...], device: torch.device) -> tuple[list, list]:
    """Each batch embedded, and what LlamaModel.forward computes once per batch before its decoder layers
    (position ids, rotary embeddings, the causal mask) as keyword arguments for a decoder block."""
    from transformers.masking_utils import create_causal_mask

    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    embed = _materialise(base.embed_tokens, f"{prefix}.embed_tokens", model.ptq_checkpoint, device)
    hidden = [embed(b.to(device)) for b in batches]
    del embed
    rotary = type(base.rotary_emb)(config=model.config).to(device)
    extras = []
    for h in hidden:
        position_ids = torch.arange(h.shape[1], device=device).unsqueeze(0)
        mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        extras.append({"attention_mask": mask, "position_embeddings": rotary(h, position_ids=position_ids),
                       "position_ids": position_ids})
    return hidden, extras


def calibrate_blocks(model: nn.Module, input_ids: torch.Tensor, layers: list[str], batch_size: int = 4,
                     on_nonfinite: str = "fail", on_unseen: str = "fallback", device: torch.device | None = None,
                     channels: list[str] = ()) -> Calibration:
    """ptq.calibration.calibrate.calibrate for a streamed model: the same amax, one decoder block in memory at a time."""
    from ptq.execution.devices import default_device

    device = device or default_device()
    checkpoint: SafetensorsCheckpoint = model.ptq_checkpoint
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    blocks = base.layers
    block_layers: list[list[str]] = [[] for _ in blocks]
    head = []
    modules = dict(model.named_modules())
    for name in layers:
        if not isinstance(modules.get(name), nn.Linear):
            raise PtqError(f"{LOW_MEMORY_FLAG} calibrates Linear inputs only; '{name}' (attention or residual coverage) "
                           "needs the in-memory path")
        parts = name.split(".")
        if name.startswith(f"{prefix}.layers.") and parts[2].isdigit() and int(parts[2]) < len(blocks):
            block_layers[int(parts[2])].append(name)
        elif name == "lm_head":
            head.append(name)
        else:
            raise PtqError(f"layer '{name}' is neither in a decoder block nor the lm_head: {LOW_MEMORY_FLAG} cannot calibrate it")
    observers = {name: TensorObserver(channels=name in set(channels)) for name in layers}
    weight_amax: dict[str, torch.Tensor] = {}
    batches = input_ids.split(batch_size)

    with torch.inference_mode(), progress("calibrating block by block", len(blocks) + 2) as advance:
        hidden, extras = _embedded(model, batches, device)  # the cached activations: the next block's inputs
        advance(1)
        for i, skeleton in enumerate(blocks):
            block = _materialise(skeleton, f"{prefix}.layers.{i}", checkpoint, device)
            hooks = []
            for name in block_layers[i]:
                module = block.get_submodule(name.removeprefix(f"{prefix}.layers.{i}."))
                weight_amax[name] = check_weight(name, module.weight)
                hooks.append(module.register_forward_pre_hook(observers[name]))
            try:
                for b, h in enumerate(hidden):
                    hidden[b] = block(h, cache=None, use_cache=False, **extras[b])
                    if on_nonfinite == "fail":
                        _fail_on_nonfinite({n: observers[n] for n in block_layers[i]}, b, batch_size)
            finally:
                for hook in hooks:
                    hook.remove()
                del block  # its weights' memory is freed before the next block is read
            advance(1)
        if head:  # the lm_head's input is the final norm's output; its logits are not needed
            norm = _materialise(base.norm, f"{prefix}.norm", checkpoint, device)
            name = "lm_head"
            stored = name + ".weight" if name + ".weight" in checkpoint.file else f"{prefix}.embed_tokens.weight"  # tied
            weight_amax[name] = check_weight(name, _float32(checkpoint.read_one(stored)))
            for b, h in enumerate(hidden):
                observers[name](None, (norm(h),))
                if on_nonfinite == "fail":
                    _fail_on_nonfinite({name: observers[name]}, b, batch_size)
            del norm
        advance(1)
    del hidden
    TensorObserver.shared = None  # release the last activation it holds
    calibration = finish(observers, layers, {name: weight_amax[name] for name in layers}, on_nonfinite, on_unseen)
    calibration.metadata["low_memory"] = f"calibrated block by block from disk ({len(blocks)} decoder blocks)"
    return calibration


def _mounted(module: nn.Module, path: str) -> nn.Module:
    """A container holding `module` at `path` (e.g. "model.layers.3"), so that its layers have their names in the
    whole model, which recipes select on and calibration files are keyed by."""
    root = parent = nn.Module()
    *parents, leaf = path.split(".")
    for part in parents:
        setattr(parent, part, nn.Module())
        parent = getattr(parent, part)
    setattr(parent, leaf, module)
    return root


def check_compare_recipes(recipes: list) -> None:
    """Block-by-block compare runs transformers' decoder layers as they are: recipes that quantize attention's
    matmul inputs or the residual adds (which patch the whole model) need the model whole."""
    for r in recipes:
        if r.beyond_linear:
            raise PtqError(f"recipe '{r.name}' quantizes attention or residual inputs: {LOW_MEMORY_FLAG} compares "
                           "Linear-layer recipes only; load the model whole")


def compare_blocks(model: nn.Module, recipes: list, calibration: Calibration | None, input_ids: torch.Tensor,
                   batch_size: int = 4, matmul: str = "simulated", device: torch.device | None = None,
                   target: str = "transformers") -> tuple:
    """ptq.evaluation.evaluate.evaluate of each recipe's variant of a streamed model (the first recipe is the baseline),
    one decoder block in memory at a time: every variant's hidden states are kept for all windows, each block
    is read from disk, quantized per recipe (ptq.quantization.quantize.quantize_variants: weight codes, shared where the
    recipes agree), run on each variant's own hidden states, and freed; the final norm and lm_head then give
    each batch's logits, scored as evaluate scores them. The same float32 ops on the same batches in the same
    order as the in-memory evaluation. Returns (scores, weight SNR, input SNR) as ptq.evaluation.layerstats computes
    them in memory."""
    from ptq.evaluation.evaluate import Scores, score_logits
    from ptq.evaluation.layerstats import input_snr_db, weight_snr_db
    from ptq.execution.devices import default_device
    from ptq.quantization.quantize import quantize_variants

    device = device or default_device()
    check_compare_recipes(recipes)
    checkpoint: SafetensorsCheckpoint = model.ptq_checkpoint
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    names = [r.name for r in recipes]
    weight_snr = {name: {} for name in names[1:]}
    input_snr = {name: {} for name in names[1:]}
    batches = input_ids.split(batch_size)
    with torch.inference_mode(), progress("comparing block by block", len(base.layers) + 2) as advance:
        first, extras = _embedded(model, batches, device)
        hidden = {name: list(first) for name in names}  # each variant's own activations, all windows
        del first
        advance(1)
        for i, skeleton in enumerate(base.layers):
            path = f"{prefix}.layers.{i}"
            original = _mounted(_materialise(skeleton, path, checkpoint, device), path)
            variants = quantize_variants(original, recipes, calibration, matmul, target)  # codes; no float32 copies
            for name, variant in variants.items():
                block = variant.get_submodule(path)
                if name in weight_snr:
                    weight_snr[name] |= weight_snr_db(original, variant)
                with input_snr_db({name: variant}) as measured:
                    hidden[name] = [block(h, cache=None, use_cache=False, **extras[b]) for b, h in enumerate(hidden[name])]
                if name in input_snr:
                    input_snr[name] |= measured.get(name, {})
            del original, variants, variant, block  # freed before the next block is read
            advance(1)
        norm = _materialise(base.norm, f"{prefix}.norm", checkpoint, device)
        stored = "lm_head.weight" if "lm_head.weight" in checkpoint.file else f"{prefix}.embed_tokens.weight"  # tied
        linear = model.lm_head
        head = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        head.weight = nn.Parameter(_float32(checkpoint.read_one(stored)).to(device), requires_grad=False)
        head = _mounted(head, "lm_head")
        heads = quantize_variants(head, recipes, calibration, matmul, target)  # one copy of codes the recipes share
        for name in weight_snr:
            weight_snr[name] |= weight_snr_db(head, heads[name])
        del head
        scores = {name: Scores() for name in names}
        with input_snr_db({name: heads[name] for name in input_snr}) as measured:
            for b, batch in enumerate(batches):
                targets, baseline = batch[:, 1:].to(device), None
                for name in names:
                    baseline = score_logits(scores[name], heads[name].lm_head(norm(hidden[name][b])), targets, baseline)
        for name in input_snr:
            input_snr[name] |= measured.get(name, {})
        advance(1)
    return scores, weight_snr, input_snr


def plan_checkpoint(model: nn.Module, recipe, calibration: Calibration, target: str = "transformers") -> tuple[list, list[str], list[str]]:
    """ptq.export.checkpoint.plan_checkpoint for a streamed model: the same tensors in the same order, each read from disk
    when its shard is written. The calibration is checked against the weights as they are read; the engine's shared
    scales (ptq.quantization.engines) come from its weight amaxes."""
    from ptq.export import checkpoint as export
    from ptq.quantization import engines

    checkpoint: SafetensorsCheckpoint = model.ptq_checkpoint
    quantized, ignored, names = export.export_layers(model, recipe)
    if calibration is None:
        raise PtqError(f"recipe '{recipe.name}' needs calibration (static input scales)")
    for layer in quantized:
        if layer not in calibration.input_amax or layer not in calibration.weight_amax:
            raise PtqError(f"calibration file has no amax for layer '{layer}' (made for model "
                           f"'{calibration.metadata.get('model', '?')}'; recalibrate for this model and recipe)")
    absent = [n for n in names if n not in checkpoint.file]
    if absent:
        raise PtqError(f"the checkpoint in {checkpoint.directory} has no tensor '{absent[0]}' that {type(model).__name__} saves")
    # Refuse a calibration of another model before writing anything (each weight is checked again when read).
    _checked_weight(quantized[0], checkpoint.read_one(f"{quantized[0]}.weight"), calibration)
    by_weight = {f"{layer}.weight": layer for layer in quantized}
    engine = engines.engine_scales(model, recipe, target, lambda n: calibration.weight_amax[n],
                                   {n: calibration.input_amax[n] for n in quantized if recipe.inputs.static}, set(quantized))
    entries = []
    for name in names:
        shape = checkpoint.shape[name]
        layer = by_weight.get(name)
        if layer is None:
            dtype = SAFETENSORS_DTYPES.get(checkpoint.dtype[name])
            if dtype is None:
                raise PtqError(f"tensor '{name}' has dtype {checkpoint.dtype[name]}, which ptq does not know how to copy")
            # Unchanged, in its stored dtype: what the in-memory export writes after its float32 round trip.
            entries.append(export._Entry(name, shape, dtype, lambda n=name: checkpoint.read_one(n).contiguous()))
            continue
        entries += export.quantized_entries(
            layer, shape, lambda n=name, layer=layer: _checked_weight(layer, checkpoint.read_one(n), calibration),
            recipe, engine.input_amax.get(layer, calibration.input_amax[layer]), weight_amax=engine.weight_amax.get(layer))
    return entries, quantized, ignored


def _checked_weight(layer: str, weight: torch.Tensor, calibration: Calibration) -> torch.Tensor:
    w = weight.float()
    if not torch.equal(amax(w), calibration.weight_amax[layer]):
        raise PtqError(f"calibration file was made for another model ('{calibration.metadata.get('model', '?')}'): "
                       f"the weights of layer '{layer}' differ")
    return w
