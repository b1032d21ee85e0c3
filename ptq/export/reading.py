"""Reading a written checkpoint back for its verification: as a user would, with transformers
(reload), or, where transformers cannot run it as quantized, with ptq's own dequantizing reader,
which reads the files and config.json alone.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.errors import PtqError
from ptq.export.checkpoint import remote_code_files
from ptq.files import read_json
from ptq.models.quantized import check_quantized_files


def reload(
    directory: Path, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict]:
    """Load the checkpoint as a user would (AutoModelForCausalLM.from_pretrained, float32, default
    options; the model's own code, copied with it, runs only with `trust_remote_code`, as the user
    asked for the source), and describe what transformers made of it. `dtype`: bfloat16 for
    bfloat16_check only."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:  # compressed-tensors draws its own tqdm bars on stderr; ptq shows its own progress
        with contextlib.redirect_stderr(io.StringIO()):
            model, info = AutoModelForCausalLM.from_pretrained(
                str(directory),
                dtype=dtype,
                output_loading_info=True,
                trust_remote_code=trust_remote_code,
            )
            # compressed-tensors decompresses the weights on the first forward
            with torch.inference_mode():
                model(input_ids=torch.zeros((1, 1), dtype=torch.long))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtqError(f"transformers cannot load the exported checkpoint: {reason}") from None
    # asked for float32, some transformers versions still hold weights in 16 bits (5.17 dequantizes
    # fused experts into bfloat16): the loader then computes another model than the checkpoint's,
    # and the check would measure that
    state = model.state_dict()
    narrowed = [n for n, t in state.items() if t.dtype in (torch.bfloat16, torch.float16)]
    if narrowed and dtype == torch.float32:
        raise PtqError(
            f"transformers cannot load the exported checkpoint: it holds {len(narrowed)} tensor(s) "
            f"in 16 bits though float32 was asked for ('{narrowed[0]}', {state[narrowed[0]].dtype})"
        )
    model.eval()
    model.requires_grad_(False)
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    return model, {
        # some versions (5.17) quantize the KV cache themselves, by compressed-tensors' attention
        # hook, from the checkpoint's k_scale / v_scale; others leave them unused (unexpected keys)
        "kv_cache_quantized": any(n.endswith((".k_scale", ".v_scale")) for n in state),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": sorted(str(k) for k in info.get("mismatched_keys", [])),
        "quantized_layers": len(quantized),
        "input_quantized_layers": sum(
            1
            for m in quantized
            if m.quantization_scheme.input_activations is not None
            and (m.quantization_scheme.input_activations.dynamic or hasattr(m, "input_scale"))
        ),
    }


def reload_or_read(
    directory: Path, conv1d: bool, trust_remote_code: bool = False
) -> tuple[nn.Module, dict]:
    """The checkpoint reloaded by transformers; where transformers cannot run it (Conv1D layers, or
    its error on load: block or MX scales on some shapes), by ptq's own reader, with
    transformers' reason recorded. `trust_remote_code`: as the user gave it for the source (the
    checkpoint carries the source's own code)."""
    if conv1d:
        return reload_dequantized(directory, trust_remote_code=trust_remote_code)
    try:
        return reload(directory, trust_remote_code)
    except PtqError as e:
        model, info = reload_dequantized(
            directory,
            "transformers cannot run this checkpoint: "
            f"{str(e).removeprefix('transformers cannot load the exported checkpoint: ')}",
            trust_remote_code,
        )
    info["bfloat16"] = bfloat16_check(directory, model, trust_remote_code)
    return model, info


def bfloat16_check(directory: Path, read: nn.Module, trust_remote_code: bool = False) -> dict:
    """Where transformers cannot run the checkpoint in float32, does it in bfloat16, the dtype users
    load 16-bit models in? (compressed-tensors' MX decompression returns bfloat16 scales: "expected
    m1 and m2 to have the same dtype" in float32.) And are the weights it decompresses the files'
    codes x scales, those of ptq's reader (`read`, float32) in bfloat16? An E4M3 code times a power
    of two is exact in bfloat16, so MX weights must be equal bit for bit. {"runs", "error" where it
    does not, "layers": quantized layers compared, "equal": how many were}. The bfloat16 model (half
    the float32 reload's memory) is freed before the check scores anything."""
    try:
        model, _ = reload(directory, trust_remote_code, dtype=torch.bfloat16)
    except PtqError as e:
        return {
            "runs": False,
            "error": str(e).removeprefix("transformers cannot load the exported checkpoint: "),
        }
    modules = dict(read.named_modules())
    compared = [
        (m.weight, modules[name].weight)
        for name, m in model.named_modules()
        if getattr(m, "quantization_scheme", None) is not None
        and name in modules
        and hasattr(m, "weight")
    ]
    equal = sum(torch.equal(w, r.to(torch.bfloat16)) for w, r in compared if w.shape == r.shape)
    del model
    return {"runs": True, "layers": len(compared), "equal": int(equal)}


def reload_dequantized(
    directory: Path,
    why: str = "transformers does not load compressed-tensors Conv1D layers",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, dict]:
    """ptq's own reader, for checkpoints transformers cannot run as quantized (Conv1D layers; block
    and MX scales where transformers' compressed-tensors integration fails): every quantized
    weight dequantized from the files (codes x weight_scale, each scale repeated over its group
    or tile as config.json's weights say: block_structure rows x columns, or group_size columns,
    cropped at the edges; E8M0 bytes read as 2^(u - 127); in the file's orientation: [in, out]
    for Conv1D), every other tensor as stored, written as a plain float32 checkpoint that
    transformers then loads with its own weight conversions (experts merged as usual); dynamic
    inputs (per tensor, token or group, as config.json's input_activations say) of the plain
    layers quantized on the fly with torch's own float8 cast. Static input scales and experts'
    inputs are not applied (verify checks static scales in the files). Deliberately simple
    arithmetic, read from the files and config.json alone, so that it checks the files rather
    than ptq's simulation. A model with its own code (auto_map) runs it with `trust_remote_code`
    only."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_json(Path(directory) / "config.json", f"config.json of {directory}")
    # the same check of codes against their scales as every other reader's, before any is used
    files = sorted(Path(directory).glob("*.safetensors"))
    check_quantized_files(config.get("quantization_config"), files, str(directory))
    groups = config.pop("quantization_config")["config_groups"]
    if len(groups) > 1:
        raise PtqError(
            f"ptq's reader reads checkpoints of one config group; {directory} has {len(groups)} "
            "(a recipe with overrides): export it with --no-verify, or without overrides"
        )
    scheme = next(iter(groups.values()))
    weight_args = scheme.get("weights") or {}
    tile = (
        tuple(weight_args["block_structure"])
        if weight_args.get("strategy") == "block"
        else (1, weight_args["group_size"])
        if weight_args.get("strategy") == "group"
        else None
    )
    with tempfile.TemporaryDirectory(prefix="ptq-reader-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        # the model's own code, copied with the checkpoint, goes along
        if remote_code_files(config.get("auto_map")):
            for f in Path(directory).glob("*.py"):
                shutil.copyfile(f, Path(tmp) / f.name)
        try:
            with torch.device("meta"):  # which layers are Conv1D ([in, out] on disk)
                skeleton = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code),
                    trust_remote_code=trust_remote_code,
                )
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PtqError(
                f"ptq's reader cannot build the exported checkpoint's model: {reason}"
            ) from None
        model, info, stored, dynamic_layers = _read_dequantized(
            directory, tmp, scheme, tile, skeleton, trust_remote_code
        )
    input_args = scheme.get("input_activations")
    modules = dict(model.named_modules())
    # experts are merged on load: weights only
    hooked = [name for name in dynamic_layers if name in modules]
    for name in hooked:
        modules[name].register_forward_pre_hook(
            lambda m, args, a=input_args: (_dynamic_fp8(args[0], a),)
        )
    model.eval().requires_grad_(False)
    return model, {
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [],
        "quantized_layers": sum(1 for k in stored if k.endswith(".weight_scale")),
        "input_quantized_layers": len(hooked),
        "loader": f"ptq's dequantizing reader ({why})",
    }


def _read_dequantized(
    directory: Path,
    tmp: str,
    scheme: dict,
    tile: tuple[int, int] | None,
    skeleton: nn.Module,
    trust_remote_code: bool,
) -> tuple[nn.Module, dict, dict, list[str]]:
    """reload_dequantized's reading: the files' weights dequantized into `tmp` (holding the plain
    config.json), loaded by transformers; (the model, its loading info, the stored tensors, the
    layers with dynamic inputs)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    conv1d = {name for name, m in skeleton.named_modules() if isinstance(m, Conv1D)}
    input_args = scheme.get("input_activations")
    stored = _read_tensors(directory, None)
    dense, dynamic_layers = {}, []
    for key, t in stored.items():
        if key.endswith((".weight_scale", ".input_scale", ".k_scale", ".v_scale")):
            continue
        scale = stored.get(f"{key}_scale")
        if scale is not None:
            if scale.dtype == torch.uint8:  # E8M0
                scale = torch.exp2(scale.float() - 127)
            rows, cols = t.shape
            # tiles, or groups along the input: each scale over its tile, the last ones partial
            if tile is not None:
                scale = scale.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[
                    :, :cols
                ]
            elif scale.numel() > 1 and key.removesuffix(".weight") in conv1d:  # [in, out] on disk
                scale = scale.reshape(1, -1)
            t = t.float() * scale
            if input_args is not None and input_args.get("dynamic"):
                dynamic_layers.append(key.removesuffix(".weight"))
        dense[key] = t.float() if t.is_floating_point() else t
    try:
        safetensors.torch.save_file(dense, str(Path(tmp) / "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # a tensor of the wrong shape (e.g. a Conv1D weight not in [in, out])
        raise PtqError(
            "the exported checkpoint does not fit its architecture: "
            f"{str(e).strip().splitlines()[-1]}"
        ) from None
    return model, info, stored, dynamic_layers


def _dynamic_fp8(x: torch.Tensor, args: dict) -> torch.Tensor:
    """Dynamic E4M3 input quantization as config.json describes it (per tensor, token or group; fp32
    or E8M0 scales: the smallest power of two >= amax / 448), by torch's float8 cast: the
    reader's own arithmetic."""
    shape, size = x.shape, (args.get("group_size") if args.get("strategy") == "group" else None)
    v = x.float()
    if size:
        v = torch.nn.functional.pad(v, (0, -v.shape[-1] % size))
        v = v.reshape(*v.shape[:-1], -1, size)
    amax_ = v.abs().amax() if args.get("strategy") == "tensor" else v.abs().amax(-1, keepdim=True)
    scale = amax_ / 448.0
    if args.get("scale_dtype") is not None:  # E8M0: round the scale up to a power of two
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(scale > 0, scale, 1.0)
    q = (v / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    if size:
        q = q.reshape(*q.shape[:-2], -1)[..., : shape[-1]]
    return q.to(x.dtype)


def _read_tensors(directory: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint directory's safetensors files (all of them for None)."""
    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as f:
            found |= {k: f.get_tensor(k) for k in f.keys() if names is None or k in names}
    return found
