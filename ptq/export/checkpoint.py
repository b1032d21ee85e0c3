"""Export: a quantized model as a Hugging Face checkpoint in the compressed-tensors format, which
transformers and vLLM load (FP8 E4M3 `float-quantized`, int8 `int-quantized`), for every scheme
llm-compressor writes: FP8 (static per-tensor inputs), FP8_DYNAMIC (per-channel weights, per-token
dynamic inputs), FP8_BLOCK (128 x 128 weight blocks, dynamic 1 x 128 input groups), MXFP8 (groups of
32, E8M0 scales), and int8 W8A8. What the files hold: ptq.export.format.

Planning (every tensor to write, in state-dict order, each made when its shard is written) and
writing (the shards, config.json, the model's own code). The codes come from
ptq.quantization.quantize.quantize_weight, the same function the simulation dequantizes, so the file
holds exactly what `ptq compare` simulated. Shards are written one at a time: peak memory stays near
the model plus one shard.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.calibration.calibrate import Calibration
from ptq.calibration.clips import input_clip
from ptq.errors import PtqError
from ptq.export.format import (
    _DTYPE_NAMES,
    check_fused_precision,
    check_kv_cache,
    check_loadable,
    quantization_config,
    weight_scale_shape,
)
from ptq.model_files import safetensors_files
from ptq.models.damage import check_parameter
from ptq.models.matmuls import ROUTER, kind, quantizable
from ptq.models.names import checkpoint_names, saved_names
from ptq.numerics.formats import NumberFormat, amax, compute_scale
from ptq.numerics.granularity import (
    PerBlock,
    PerGroup,
    PerHead,
    e8m0_codes,
)
from ptq.quantization import engines
from ptq.quantization.plan import Plan, calibration_key
from ptq.quantization.plan import resolve_plan as plan_of
from ptq.quantization.quantize import quantize_weight, scale_for
from ptq.quantization.recipes import Recipe, TensorQuant

# what was exported and how it was verified; the model card is rendered from it
EXPORT_INFO = "ptq-export.json"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 1 << 30


@dataclass
class _Entry:
    """One tensor of the checkpoint: its name, shape and dtype, and how to produce it when its shard
    is written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class SourceDtypes(dict):
    """Tensor name -> its dtype in the source checkpoint, and (`elements`) the number of values each
    floating-point dtype holds there."""

    def __init__(self, dtypes: dict[str, torch.dtype], elements: dict[torch.dtype, int]):
        super().__init__(dtypes)
        self.elements = elements


def source_dtypes(location: str) -> SourceDtypes:
    """The dtype of every tensor in the source checkpoint (a local directory's safetensors headers;
    for a checkpoint with pickle weights only, loaded with --allow-pickle, its pytorch_model*.bin
    files, memory-mapped by torch.load(weights_only=True)), so that tensors ptq does not quantize
    are written back as they were, not in the float32 ptq computes in. Tensors of other dtypes
    (an FP8 checkpoint's codes, dequantized on load) are left out."""
    directory = Path(location)
    if not directory.is_dir():  # a Hub id: its files are in the local cache, if anywhere
        try:
            from huggingface_hub import snapshot_download

            directory = Path(
                snapshot_download(
                    location, local_files_only=True, allow_patterns=["*.safetensors", "*.bin"]
                )
            )
        except Exception:
            return SourceDtypes({}, {})
    dtypes: dict[str, torch.dtype] = {}
    elements: collections.Counter = collections.Counter()
    # the files loading read (those the index names), by the rule loading follows (ptq.model_files)
    for path in safetensors_files(directory):
        with safetensors.safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = _DTYPE_NAMES.get(piece.get_dtype())
                if dtype is not None:
                    dtypes[key] = dtype
                    elements[dtype] += math.prod(piece.get_shape())
    if not dtypes:  # pickle weights only (ptq.models.loading refuses them without --allow-pickle)
        for path in sorted(directory.glob("pytorch_model*.bin")):
            try:  # memory-mapped: the dtypes are read, not the tensors
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            # an old (non-zip) pickle cannot be memory-mapped: read as loading read it
            except Exception:
                state = torch.load(str(path), map_location="cpu", weights_only=True)
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dtype in _DTYPE_NAMES.values():
                    dtypes[k] = v.dtype
                    elements[v.dtype] += v.numel()
            del state
    return SourceDtypes(dtypes, dict(elements))


def export_layers(
    model: nn.Module, recipe: Recipe, plan: Plan | None = None
) -> tuple[list[str], list[str], list[str]]:
    """The Linear layers the recipe's plan quantizes and those it leaves out, and the state-dict
    names to save; refuses, before any calibration, a model where that is nothing, where a
    quantized weight is tied to another tensor, or whose checkpoint could not hold what the plan
    simulates (check_kv_cache, Conv1D with group scales)."""
    plan = plan or plan_of(model, recipe)
    # and the routers that are Linear layers (ptq.models.matmuls: MoE routers, Qwen2-MoE's
    # shared_expert_gate), which the checkpoint's "Linear" target would otherwise cover: the loaders
    # must keep them as stored
    routers = [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and kind(m) == ROUTER
    ]
    # and the routers that are modules of their own (transformers 5's Qwen3MoeTopKRouter,
    # MixtralTopKRouter...): vLLM builds them as ReplicatedLinear, which the "Linear" target matches
    # (its qwen3_moe.py hands the gate its quant_config), so they are listed too, as
    # compressed-tensors does (quant_config.get_vllm_module_type)
    routers += [
        x.name.rpartition(".")[0] for x in plan.unsupported if x.reason.startswith("router")
    ]
    quantized, ignored = plan.quantized, sorted({*plan.left_out, *routers})
    if not quantized:
        raise PtqError(
            f"recipe '{recipe.name}' quantizes no layer of this {type(model).__name__} "
            f"({plan.left_out_reasons()})"
        )
    check_loadable(model, recipe, quantized, plan)
    conv1d = [
        name
        for name in quantized
        if kind(model.get_submodule(name)) == "Conv1D"
        and isinstance(plan.matmuls[name].weights.granularity, (PerGroup, PerBlock))
    ]
    if conv1d:
        raise PtqError(
            f"recipe '{recipe.name}' has {plan.matmuls[conv1d[0]].weights.granularity.describe()} "
            "weight scales and "
            f"this {type(model).__name__} has Conv1D layers: ptq quantize writes group and block "
            "scales for Linear weights only; `ptq compare` covers this model"
        )
    if plan.target == "vllm":
        check_fused_precision(model, quantized)
    names = saved_names(model)
    check_kv_cache(model, plan, names)
    tied = [name for name in quantized if f"{name}.weight" not in names]
    if tied:
        raise PtqError(
            f"layer '{tied[0]}' shares its weight with another tensor (tied embeddings): leave it "
            f"out of recipe '{recipe.name}' (ignore: [{tied[0]}])"
        )
    return quantized, ignored, names


def plan_checkpoint(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration | None,
    dtypes: dict[str, torch.dtype],
    target: str = "transformers",
    read: Callable[[str], torch.Tensor] | None = None,
    plan: Plan | None = None,
) -> tuple[list[_Entry], list[str], list[str]]:
    """Every tensor to write, in state-dict order; and the quantized and the left-out Linear layers.
    `target`: whose scales to write (ptq.quantization.engines: vllm, the shared scales vLLM serves).
    read: the tensor of that name in the source checkpoint, for a model whose weights are not in
    memory (on the meta device: ptq.execution.streaming); each tensor is then read when its shard is
    written, and each quantized weight checked against the calibration as it is read (the first one
    before anything is written). `plan`: the recipe's plan for `model` and `target`, when the
    command has resolved it."""
    plan = plan or plan_of(model, recipe, target)
    quantized, ignored, names = export_layers(model, recipe, plan)
    if recipe.needs_calibration:
        if calibration is None:
            raise PtqError(f"recipe '{recipe.name}' needs calibration (static scales)")
        calibrated = plan.calibrated
        if read is None:
            calibration.check_model(model, calibrated)
        else:  # the weights are checked as they are read
            missing = [name for name in calibrated if name not in calibration.input_amax]
            if missing:
                raise PtqError(
                    f"calibration file has no amax for layer '{missing[0]}' (made for model "
                    f"'{calibration.metadata.get('model', '?')}'; recalibrate for this model and "
                    "recipe)"
                )
    params = dict(model.state_dict())
    by_weight = {f"{name}.weight": name for name in quantized}
    fallback = _dominant_dtype(dtypes)
    modules = dict(model.named_modules())
    disk = checkpoint_names(model, names)
    conv1d = {
        f"{name}.weight" for name, m in modules.items() if quantizable(m) and kind(m) == "Conv1D"
    }

    # in memory; else the calibration's, or read (no calibration is needed)
    def weight_amax(
        n: str,
    ) -> torch.Tensor:
        if read is None:
            return amax(modules[n].weight)
        if calibration is not None and n in calibration.weight_amax:
            return calibration.weight_amax[n]
        return amax(read(disk[f"{n}.weight"]).float())

    # the scales the target engine serves, for the groups the plan says share one
    # (ptq.quantization.engines)
    shared_weight_amax = engines.shared_amax(
        {n: plan.matmuls[n].weight_group for n in quantized if plan.matmuls[n].weight_group},
        weight_amax,
    )
    # each static input's clip under the recipe's observer (max: the amax), as the simulation takes
    # it
    clip = lambda n: input_clip(calibration, n, plan.matmuls[n].inputs)  # noqa: E731
    shared_input_amax = engines.shared_amax(
        {n: plan.matmuls[n].input_group for n in quantized if plan.matmuls[n].input_group}, clip
    )
    entries: list[_Entry] = []
    for name in names:
        tensor = params[name]
        layer = by_weight.get(name)
        if layer is None:
            if name in conv1d:  # Conv1D keeps its weight [in, out] on disk
                tensor = tensor.t()
            dtype = dtypes.get(disk[name], fallback) if tensor.is_floating_point() else tensor.dtype
            make = (
                (
                    lambda n=disk[name], d=dtype, m=name: (
                        _checked_tensor(m, read(n), calibration).to(d).contiguous()
                    )
                )
                if read is not None
                else (lambda t=tensor, d=dtype: t.detach().cpu().to(d).contiguous())
            )
            entries.append(_Entry(disk[name], tuple(tensor.shape), dtype, make))
            continue
        if read is None:
            weight = lambda m=modules[layer]: m.weight  # noqa: E731
        else:
            weight = lambda n=disk[name], layer=layer, t=name in conv1d: _checked_weight(  # noqa: E731
                layer, read(n).t() if t else read(n), calibration
            )
        entries += quantized_entries(
            disk[name].removesuffix(".weight"),
            tuple(tensor.shape),
            weight,
            recipe.schemes[plan.matmuls[layer].scheme],
            shared_input_amax.get(layer, clip(layer))
            if plan.matmuls[layer].inputs.static
            else None,
            transposed=name in conv1d,
            weight_amax=shared_weight_amax.get(layer),
        )
    entries += kv_cache_entries(model, plan, calibration, disk)
    if read is not None:  # a calibration of another model is refused before anything is written
        _checked_weight(quantized[0], read(disk[f"{quantized[0]}.weight"]), calibration)
        # and the vectors it recorded (norms, biases: small), each checked again as written
        for name in names:
            if (
                calibration is not None
                and name in calibration.tensor_amax
                and params[name].dim() == 1
            ):
                _checked_tensor(name, read(disk[name]), calibration)
    # each left-out layer under its name in the files, which vLLM matches, and under its module's
    # name where transformers names it otherwise (GPT-NeoX's lm_head is embed_out on disk, PhiMoE's
    # mlp.router is block_sparse_moe.gate): compressed-tensors matches the ignore list against
    # transformers' module names
    ignored = sorted(
        {
            n
            for name in ignored
            for n in (name, disk.get(f"{name}.weight", name).removesuffix(".weight"))
        }
    )
    return entries, quantized, ignored


def kv_cache_entries(
    model: nn.Module, plan, calibration: Calibration | None, disk: dict[str, str]
) -> list[_Entry]:
    """`<attention>.k_scale` and `.v_scale` of every attention layer whose KV cache the plan
    quantizes: float32, [1] per tensor or [kv heads, 1, 1] per head (compressed-tensors'
    attn_head layout), the simulation's scales."""
    entries = []
    for layer, tensors in plan.attention.items():  # each with a k_proj (check_kv_cache)
        prefix = disk[f"{layer}.k_proj.weight"].removesuffix(".k_proj.weight")
        for tensor, short in (("kv_cache.key", "k"), ("kv_cache.value", "v")):
            spec = tensors.get(tensor)
            if spec is None:
                continue
            scale = (
                scale_for(input_clip(calibration, calibration_key(layer, tensor), spec), spec)
                .float()
                .cpu()
            )
            shape = (scale.numel(), 1, 1) if isinstance(spec.granularity, PerHead) else (1,)
            entries.append(
                _Entry(
                    f"{prefix}.{short}_scale",
                    shape,
                    torch.float32,
                    lambda s=scale, shape=shape: s.reshape(shape).contiguous(),
                )
            )
    return entries


def quantized_entries(
    layer: str,
    shape: tuple[int, ...],
    weight: Callable[[], torch.Tensor],
    recipe: Recipe,
    input_amax: torch.Tensor | None,
    transposed: bool = False,
    weight_amax: torch.Tensor | None = None,
) -> list[_Entry]:
    """The tensors of a quantized Linear: its codes, weight scale and (static inputs) input scale.
    `weight()` gives the weight [out, in] when its shard is written (from the model in memory, or
    from disk: ptq.execution.streaming); `transposed`: the codes are written [in, out], as Conv1D
    stores its weight. `weight_amax`: a fused group's shared amax for the weight scale
    (ptq.quantization.engines), instead of the weight's own."""
    weights, inputs = recipe.weights, recipe.inputs
    scale_shape = weight_scale_shape(shape, weights)
    mx = weights.scale_format == "e8m0"
    scales: dict[str, torch.Tensor] = {}  # the weight's scale, from the call that made its codes
    codes = lambda w=weight, f=weights, s=scales: _weight_codes(w(), f, s, layer, weight_amax)  # noqa: E731
    stored_scale = lambda s=scales, shape=scale_shape: s.pop("scale").reshape(shape)  # noqa: E731
    entries = [
        _Entry(
            f"{layer}.weight",
            shape[::-1] if transposed else shape,
            weights.format.torch_dtype,
            (lambda: codes().t().contiguous()) if transposed else codes,
        ),
        _Entry(
            f"{layer}.weight_scale",
            scale_shape,
            torch.uint8 if mx else torch.float32,
            (lambda: e8m0_codes(stored_scale())) if mx else stored_scale,
        ),
    ]
    if inputs.static:
        entries.append(
            _Entry(
                f"{layer}.input_scale",
                (1,),
                torch.float32,
                lambda a=input_amax, f=inputs.format: _input_scale(a, f),
            )
        )
    return entries


def _checked_weight(
    layer: str, weight: torch.Tensor, calibration: Calibration | None
) -> torch.Tensor:
    """A weight read from disk, in float32, refused when its amax is not the calibration's (another
    model)."""
    w = weight.float()
    if calibration is not None:
        calibration.check_weight(layer, w)
    return w


def _checked_tensor(
    name: str, tensor: torch.Tensor, calibration: Calibration | None
) -> torch.Tensor:
    """A tensor read from disk that is not quantized (a norm, an embedding), refused when the
    calibration recorded another amax for it (Calibration.tensor_amax: another model whose Linear
    weights are this one's)."""
    check_parameter(name, tensor)  # never a damaged tensor copied into the checkpoint
    if calibration is not None:
        calibration.check_tensor(name, tensor.float() if tensor.is_floating_point() else tensor)
    return tensor


def _weight_codes(
    weight: torch.Tensor,
    weights: TensorQuant,
    scales: dict,
    layer: str,
    weight_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    codes, scales["scale"] = quantize_weight(weight, weights, layer, weight_amax)
    scales["scale"] = scales["scale"].cpu()
    return codes.cpu()


def _input_scale(input_amax: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    return compute_scale(input_amax, fmt).reshape(1).cpu()  # exactly QuantLinear's input_scale


def _dominant_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The source checkpoint's own dtype: the floating-point dtype that holds most of its values
    (SourceDtypes), not most of its tensors (an FP8 checkpoint has a float32 weight_scale_inv next
    to each weight, its values in bf16)."""
    elements = getattr(dtypes, "elements", None)
    if elements is None:
        elements = collections.Counter(d for d in dtypes.values() if d.is_floating_point)
    return max(elements, key=elements.get) if elements else torch.float32


def shard(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Consecutive groups of at most max_bytes (a tensor larger than that gets a shard of its
    own)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_weights(
    entries: list[_Entry],
    directory: Path,
    max_shard_bytes: int,
    advance: Callable[[int], None] = lambda n: None,
) -> dict:
    """Write the safetensors shards (and the index when there is more than one), one shard in memory
    at a time; refused at once when the disk has not the room for them (a streamed model's
    weights are read and quantized as its shards are written: a full disk is found out before
    that work, not at the last shard)."""
    from ptq.runtime.resources import check_disk

    total = sum(e.nbytes for e in entries)
    way_out = "free some space or write it elsewhere (-o); nothing was written"
    check_disk(directory.parent, total, "writing the checkpoint's tensors", way_out)
    groups = shard(entries, max_shard_bytes)
    n = len(groups)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        filename = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for e in group:
            t = e.make()
            assert t.dtype == e.dtype and tuple(t.shape) == e.shape, (e.name, t.dtype, t.shape)
            tensors[e.name] = t
            weight_map[e.name] = filename
        _save_shard(tensors, directory / filename)
        del tensors
        advance(len(group))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"shards": n, "tensor_bytes": total}


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors.torch.save_file, whose I/O errors (a full disk, a quota) come as SafetensorError
    ("... (os error 28)"), not OSError: raised as the OSError they are, which ptq.files.atomic_dir
    turns into one line."""
    try:
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    except safetensors.SafetensorError as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def scheme_layers(model: nn.Module, plan: Plan) -> dict[int, list[str]]:
    """The quantized layers of each of the plan's schemes (Recipe.schemes index -> names), each
    under its module's name and its name in the files where they differ (as the ignore list)."""
    quantized = plan.quantized
    disk = checkpoint_names(model, [f"{n}.weight" for n in quantized])
    out: dict[int, list[str]] = {}
    for n in quantized:
        names = {n, disk.get(f"{n}.weight", n).removesuffix(".weight")}
        out.setdefault(plan.matmuls[n].scheme, []).extend(sorted(names))
    return out


def write_config(
    model: nn.Module,
    recipe: Recipe,
    ignored: list[str],
    dtypes: dict[str, torch.dtype],
    directory: Path,
    plan: Plan | None = None,
) -> dict:
    """config.json with the compressed-tensors quantization_config (written by compressed-tensors
    itself), and generation_config.json; returns the quantization_config as written. `plan`: for
    a recipe with overrides, which layers get each scheme (a config group each)."""
    from compressed_tensors.compressors import ModelCompressor

    config = copy.deepcopy(model.config)
    # the checkpoint's own dtype, not the float32 ptq computed in
    config.dtype = _dominant_dtype(dtypes)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    copy_remote_code(
        getattr(model.config, "_name_or_path", ""),
        getattr(model.config, "auto_map", None),
        directory,
    )
    layers = scheme_layers(model, plan) if plan is not None and recipe.overrides else None
    ModelCompressor(quantization_config=quantization_config(recipe, ignored, layers)).update_config(
        str(directory)
    )
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())["quantization_config"]


def remote_code_files(auto_map: dict | None) -> list[str]:
    """The Python files of the model's own directory that config.json's auto_map names
    ("modeling_x.XForCausalLM" -> modeling_x.py; a reference into another repository,
    "owner/repo--modeling_x.X", is fetched from there)."""
    names = []
    for value in (auto_map or {}).values():
        for reference in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(reference, str) and "--" not in reference and "." in reference:
                names.append(reference.split(".")[0] + ".py")
    return sorted(set(names))


def copy_remote_code(source: str, auto_map: dict | None, directory: Path) -> list[str]:
    """Copy into `directory` the source checkpoint's Python files that auto_map names, with the
    files they import relatively (transformers' get_relative_import_files, as its save_pretrained
    does): the exported config.json keeps the source's auto_map, so its code must travel with it
    (loading it needs trust_remote_code, as the source did). `source`: the source's local
    directory, or a Hub id whose files are in the local cache. Returns the names copied."""
    import shutil

    from transformers.dynamic_module_utils import get_relative_import_files

    wanted = remote_code_files(auto_map)
    if not wanted or not source:
        return []
    root = Path(source)
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(source, local_files_only=True, allow_patterns=["*.py"]))
        except Exception:
            return []
    files = {root / name for name in wanted if (root / name).is_file()}
    for f in list(files):
        files |= {Path(p) for p in get_relative_import_files(str(f)) if Path(p).is_file()}
    for f in sorted(files):
        # config.save_pretrained already copies the configuration's own file
        if not (directory / f.name).exists():
            shutil.copyfile(f, directory / f.name)
    return sorted(f.name for f in files)


def checkpoint_bytes(entries: list[_Entry], quantized_layers: list[str]) -> dict:
    """Bytes of the tensors written, and of the same model as a 16-bit checkpoint: every parameter
    of a floating-point or quantized tensor at 2 bytes (the scales are not part of a 16-bit
    checkpoint)."""
    codes = {f"{layer}.weight" for layer in quantized_layers}
    scales = {
        f"{layer}.{kind}" for layer in quantized_layers for kind in ("weight_scale", "input_scale")
    }
    # the FP8 KV cache's: new too
    scales |= {e.name for e in entries if e.name.endswith((".k_scale", ".v_scale"))}
    model = [e for e in entries if e.name not in scales]
    bytes_16bit = sum(
        e.nbytes
        // e.dtype.itemsize
        * (2 if e.dtype.is_floating_point or e.name in codes else e.dtype.itemsize)
        for e in model
    )
    written = sum(e.nbytes for e in entries)
    return {
        "bytes": written,
        "bytes_16bit": bytes_16bit,
        "bytes_saved": bytes_16bit - written,
        "quantized_params": sum(e.nbytes for e in entries if e.name in codes),  # 1 byte each
        "scale_bytes": sum(e.nbytes for e in entries if e.name in scales),
        "other_bytes": sum(e.nbytes for e in model if e.name not in codes),
        "other_dtypes": sorted(
            {str(e.dtype).removeprefix("torch.") for e in model if e.name not in codes}
        ),
    }


def is_exported(directory: Path) -> dict | None:
    """The compressed-tensors quantization_config of a checkpoint directory, or None."""
    config = Path(directory) / "config.json"
    try:
        qc = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors" else None
