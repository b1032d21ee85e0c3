"""torch.compile for ptq's fused kernels (the rounding, the weight codes, the evaluation's metrics):
`fused(fn)`.

Kept apart from ptq/quantization/quantize.py so that the kernels' compilation (per device, per
format) is one small module.
"""

from __future__ import annotations

import os
import warnings

import torch

# Kernels that fell back to their eager ops in this process: kernel name -> the first line of the
# error.
FALLBACKS: dict[str, str] = {}

# Whether Inductor compiles CPU loops in strict IEEE binary32 arithmetic, no fused multiply-adds and
# no unsafe math (its defaults; environment variables change them), which formats.round_to_format's
# fused E4M3 rounding needs. Read when the first kernel is made: a traced function cannot read
# Inductor's config.
strict_cpu_arithmetic = False


def fused(fn, compile: bool | None = None):
    """`fn` (a chain of exact elementwise ops or reductions) fused by torch.compile into a few
    loops, made on the first call, unless PTQ_COMPILE=0 (read then); tests check each against the
    eager ops.

    One kernel per value of the non-tensor arguments (a NumberFormat, `saturate`), compiled with
    those values as constants of the graph: the format's ints (bias, mantissa bits, clamps) become
    int32 literals of the generated code, and every integer the bit tricks of
    formats.round_to_format / exact_exp2 make is an int32 tensor op on int32 operands, so what is
    bitcast to float32 is 32-bit by construction. Compiled with dynamic=True instead, those ints
    arrived as 64-bit symbolic sizes (ks0, ks1), the int arithmetic promoted to int64 in Triton and
    `.view(torch.float32)` could not compile ("Cannot bitcast data-type of size 64 to data-type of
    size 32"); an explicit `.to(torch.int32)` would not help, Inductor drops a cast to the dtype the
    graph says the value already has. Only the tensors' sizes are symbolic (maybe_mark_dynamic, so
    one kernel serves every shape). Each kernel is a function of its own (its own code object), so
    that Dynamo's cache of recompilations is not shared between formats.

    If compilation fails (no C++ compiler, unsupported device, ...): the eager ops, after one
    warning per kernel and process naming the kernel and the error, recorded in FALLBACKS.
    Out-of-memory errors are raised."""
    kernels: dict[tuple, object] = {}
    enabled = None

    def run(*args):
        nonlocal enabled
        if enabled is None:
            enabled = os.environ.get("PTQ_COMPILE", "1") != "0" if compile is None else compile
        if not enabled:
            return fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        constants = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
        kernel = kernels.get(constants)
        if kernel is None:
            kernel = kernels[constants] = _specialised(fn, constants, len(args))
        if kernel is fn:
            return fn(*args)
        for t in tensors:
            for dim in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        try:
            return kernel(*tensors)
        except (torch.cuda.OutOfMemoryError, MemoryError):
            raise
        except Exception as e:
            # an error of the ops themselves is raised here, as it would be without compilation
            result = fn(*args)
            kernels[constants] = fn
            name = _kernel_name(fn, constants)
            first = (str(e).strip().splitlines() or [""])[0]
            if name not in FALLBACKS:
                FALLBACKS[name] = f"{type(e).__name__}: {first}"
                warnings.warn(
                    f"torch.compile failed for kernel {name} ({type(e).__name__}: {first}); "
                    "running its eager ops, slower",
                    stacklevel=2,
                )
            return result

    return run


def _kernel_name(fn, constants: tuple) -> str:
    parts = [getattr(a, "name", None) or str(a) for _, a in constants]
    return "_".join([fn.__name__, *parts]) if parts else fn.__name__


def _specialised(fn, constants: tuple, n: int):
    """torch.compile of `fn` with the non-tensor arguments (position, value) fixed: a function of
    the tensors."""
    fixed = dict(constants)
    slots = tuple(fixed.get(i, _TENSOR) for i in range(n))

    def kernel(*tensors):
        it = iter(tensors)
        return fn(*[next(it) if s is _TENSOR else s for s in slots])

    global strict_cpu_arithmetic
    from torch._inductor import config

    strict_cpu_arithmetic = (
        config.cpp.enable_floating_point_contract_flag == "off"
        and not config.cpp.enable_unsafe_math_opt_flag
    )
    name = _kernel_name(fn, constants)
    kernel.__code__ = kernel.__code__.replace(
        co_name="".join(c if c.isalnum() else "_" for c in name)
    )
    kernel.__name__ = kernel.__qualname__ = kernel.__code__.co_name
    return torch.compile(kernel, dynamic=False, options=EAGER_NUMERICS)


# Inductor's options that make a generated kernel compute what the eager ops compute, which ptq's
# rounding needs bit for bit (they matter in Triton, on GPUs; the CPU loops are already strict, see
# strict_cpu_arithmetic):
# - division correctly rounded: Triton lowers x / y to an approximate division (PTX div.full.f32, up
#   to 2 ulps off), so x / scale next to a tie between two codes could round to the other code than
#   the eager op, than the CPU, and than the engine's own kernel;
# - no fused multiply-adds and every cast kept (emulate_precision_casts): a bf16 value rounded, then
#   widened, stays rounded, and a * b + c is two roundings, as in the eager ops;
# - subnormals kept (disable_ftz): a float32 subnormal is not flushed to zero, as eager CUDA kernels
#   keep them (an E8M0 scale 2^-127, or a tiny scaled input, would otherwise read as 0).
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}


_TENSOR = object()  # a tensor argument's slot
