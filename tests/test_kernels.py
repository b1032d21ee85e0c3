"""The fused kernels (ptq/numerics/kernels.py): each compiles on the device it runs on, with the format's constants as
literals of the generated code, and a kernel that cannot compile warns once and runs its eager ops."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import ptq.evaluation.evaluate
import ptq.evaluation.layerstats
import ptq.numerics.kernels
from ptq.numerics.formats import FORMATS, dequantize, fake_quantize, quantize, to_storage
from ptq.numerics.granularity import PerGroup, PerTensor, PerToken
from ptq.numerics.kernels import fused
from ptq.quantization.quantize import _round_activation, _round_dynamic, _rounded_codes
from ptq.quantization.recipes import TensorQuant

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs CUDA: compiles the Triton kernels"
            ),
        ],
    ),
]


def every_kernel(device: str):
    """(name, function, arguments, exact) for each function ptq fuses, on `device`: the rounding is bit-exact,
    the metrics' reductions agree up to summation order."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 64, generator=g) * 30).to(device)
    w = (torch.randn(48, 64, generator=g) * torch.logspace(-6, 2, 64)).to(device)
    logits = torch.randn(20, 300, generator=g).to(device)
    targets = torch.randint(0, 300, (20,), generator=g).to(device)
    parts = ptq.evaluation.evaluate._scores(logits, targets)[
        2:
    ]  # max logit, log sum exp: what _probs, _cross take
    scale = torch.tensor(0.05, device=device)
    per_channel = (w.abs().amax(1, keepdim=True) / 448).to(device)
    codes = to_storage(quantize(w, per_channel, FORMATS["e4m3"]), FORMATS["e4m3"])
    group_scale = x.reshape(3, 40, 2, 32).abs().amax(-1, keepdim=True) / 448
    return [
        (
            "input rounding e4m3",
            _round_activation,
            (x, scale, FORMATS["e4m3"], True, None, PerTensor(), False),
            True,
        ),
        (
            "input rounding int8",
            _round_activation,
            (x, scale, FORMATS["int8"], True, None, PerTensor(), False),
            True,
        ),
        (
            "input rounding int8 [-128, 127]",
            _round_activation,
            (x, scale, FORMATS["int8"], True, -128.0, PerTensor(), False),
            True,
        ),
        (
            "input rounding per group",
            _round_activation,
            (x, group_scale, FORMATS["e4m3"], True, None, PerGroup(32), False),
            True,
        ),
        (
            "input codes e4m3",
            _round_activation,
            (x.bfloat16(), scale, FORMATS["e4m3"], True, None, PerTensor(), True),
            True,
        ),
        (
            "dynamic rounding per token",
            _round_dynamic,
            (x, TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True), False),
            True,
        ),
        (
            "dynamic codes per group",
            _round_dynamic,
            (x.bfloat16(), TensorQuant(FORMATS["e4m3"], PerGroup(32), dynamic=True), True),
            True,
        ),
        (
            "dynamic rounding, vLLM's floor",
            _round_dynamic,
            (
                x * 1e-5,
                TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True, min_scale=1 / (448 * 512)),
                False,
            ),
            True,
        ),
        (  # the power-of-two scales are made from the float32 bits: int32 ops in Triton too
            "dynamic rounding, power-of-two scales",
            _round_dynamic,
            (x, TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True, scale="pow2"), False),
            True,
        ),
        (  # MX: E8M0 scales per group of 32, 2^k built from bits; the last group's 2^-127 is a float32 subnormal
            "dynamic rounding, MX groups",
            _round_dynamic,
            (
                torch.cat([x, torch.full((3, 40, 32), 1e-40, device=device)], -1),
                TensorQuant(FORMATS["e4m3"], PerGroup(32), dynamic=True, scale_format="e8m0"),
                False,
            ),
            True,
        ),
        ("weight codes e5m2", _rounded_codes, (w, per_channel, FORMATS["e5m2"], True), True),
        (
            "weight codes bf16",
            _rounded_codes,
            (w, torch.tensor(1.0, device=device), FORMATS["bf16"], False),
            True,
        ),
        ("weight dequantize", dequantize, (codes, per_channel), True),
        (
            "weight dequantize to bf16",
            dequantize,
            (codes, per_channel, torch.bfloat16),
            True,
        ),  # the bf16 forward's
        ("scores", ptq.evaluation.evaluate._scores, (logits, targets), False),
        ("probabilities", ptq.evaluation.evaluate._probs, (logits, *parts), False),
        (
            "cross entropy",
            ptq.evaluation.evaluate._cross,
            (torch.softmax(logits, -1), logits, *parts),
            False,
        ),
        ("powers", ptq.evaluation.layerstats._powers, (w, w.round()), False),
    ]


def same(got, want, exact: bool = True) -> bool:
    if isinstance(got, tuple):
        return all(same(g, w, exact) for g, w in zip(got, want, strict=True))
    if not exact and got.is_floating_point():
        return got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return got.dtype == want.dtype and torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        )
    if got.is_floating_point():
        return (
            got.dtype == want.dtype
            and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(), want.nan_to_num())
        )
    return torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_every_fused_kernel_compiles_and_matches_its_eager_ops(device):
    # Fails when fused() falls back to the eager ops: the fallback's warning is an error here (only it: Inductor's
    # own notes on CUDA, such as "Online softmax is disabled", are no failure), and FALLBACKS must stay empty. On
    # CUDA this compiles the Triton kernels that failed with "Cannot bitcast data-type of size 64 to data-type of
    # size 32" when the format's ints were symbolic.
    ptq.numerics.kernels.FALLBACKS.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message="torch.compile failed for kernel", category=UserWarning
        )
        for what, fn, args, exact in every_kernel(device):
            got = fused(fn, compile=True)(*args)
            assert same(got, fn(*args), exact), what
    assert ptq.numerics.kernels.FALLBACKS == {}


def near_ties(fmt_name: str, scale: np.float32) -> np.ndarray:
    """Inputs x whose x / scale lies within 3 float32 ulps of a tie between two neighbouring codes of the format
    (the midpoints, from ml_dtypes' table of every E4M3 code, or the integers'), of either sign: where an approximate
    division (Triton's default, PTX div.full.f32) and the correctly rounded one (the eager op's) can round apart."""
    if fmt_name == "int8":
        grid = np.arange(0, 128, dtype=np.float64)
    else:
        codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        grid = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    x = ((grid[1:] + grid[:-1]) / 2 * np.float64(scale)).astype(np.float32)
    x = (x.view(np.int32)[:, None] + np.arange(-3, 4, dtype=np.int32)).view(np.float32).ravel()
    return np.concatenate([x, -x])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.1, 1 / 3, 0.0123, 7.77])
def test_fused_rounding_next_to_ties_matches_the_eager_division(device, scale):
    # Fails on CUDA without kernels.EAGER_NUMERICS' correctly rounded division: there x / scale next to a tie can
    # land on the other side of it, one code apart from the eager op, the CPU and the engine.
    s = np.float32(scale)
    for fmt, reciprocal in (("e4m3", False), ("e4m3", True), ("int8", False)):
        x = torch.from_numpy(near_ties(fmt, s)).reshape(2, -1).to(device)
        args = (
            x,
            torch.tensor(s, device=device),
            FORMATS[fmt],
            True,
            None,
            PerTensor(),
            False,
            reciprocal,
        )
        assert same(fused(_round_activation, compile=True)(*args), _round_activation(*args)), (
            fmt,
            reciprocal,
        )
    # Dynamic per token: each row's scale is its amax / 448, in float32; a row of inputs next to that scale's ties,
    # with that amax as its largest element.
    row_amax = np.float32(448 * s)
    row = np.append(near_ties("e4m3", row_amax / np.float32(448)), row_amax)
    assert np.abs(row).max() == row_amax
    x = torch.from_numpy(np.stack([row, -row])).to(device)
    spec = TensorQuant(FORMATS["e4m3"], PerToken(), dynamic=True)
    assert same(fused(_round_dynamic, compile=True)(x, spec, False), _round_dynamic(x, spec, False))


def test_the_formats_constants_are_literals_of_the_generated_code():
    # With the format's ints as symbolic sizes, Inductor wrote the exponent clamp as `1 + ((-1)*ks0)` (a 64-bit
    # kernel argument in Triton); compiled per format, 1 - bias is the int32 literal -6 (E4M3) / -14 (E5M2).
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    # Not saturating: the arithmetic rounding (saturating E4M3 is a clamp and a cast, with no exponent clamp).
    x, scale = (
        torch.randn(5, 64) * 100,
        torch.tensor(2.0),
    )  # within both formats' range: no NaN from an overflow
    with config.patch(fx_graph_cache=False):
        for fmt, literal in (("e4m3", "-6"), ("e5m2", "-14")):
            kernel = fused(fake_quantize, compile=True)
            got, code = run_and_get_code(kernel, x, scale, FORMATS[fmt], False)
            assert torch.equal(got, fake_quantize(x, scale, FORMATS[fmt], False))
            code = "\n".join(code)
            assert literal in code and "(-1)*ks" not in code, fmt


def test_a_kernel_that_cannot_compile_warns_once_naming_itself_then_runs_eager(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError(
                "Cannot bitcast data-type of size 64 to data-type of size 32\nsecond line"
            )

        return run

    monkeypatch.setattr(ptq.numerics.kernels.torch, "compile", broken_compile)
    monkeypatch.setattr(ptq.numerics.kernels, "FALLBACKS", {})
    x, scale = torch.randn(4, 16) * 10, torch.tensor(0.1)
    kernel = fused(fake_quantize, compile=True)
    with pytest.warns(UserWarning) as caught:
        for _ in range(3):
            assert torch.equal(
                kernel(x, scale, FORMATS["e4m3"], True),
                fake_quantize(x, scale, FORMATS["e4m3"], True),
            )
        other = fused(
            fake_quantize, compile=True
        )  # another instance of the same kernel: no second warning
        other(x, scale, FORMATS["e4m3"], True)
    messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(messages) == 1
    assert (
        "fake_quantize_e4m3_True" in messages[0]
        and "size 64" in messages[0]
        and "second line" not in messages[0]
    )
    assert list(ptq.numerics.kernels.FALLBACKS) == ["fake_quantize_e4m3_True"]


def test_out_of_memory_in_a_kernel_is_raised_not_hidden_by_the_fallback(monkeypatch):
    def oom_compile(fn, **kwargs):
        def run(*args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return run

    monkeypatch.setattr(ptq.numerics.kernels.torch, "compile", oom_compile)
    monkeypatch.setattr(ptq.numerics.kernels, "FALLBACKS", {})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fused(fake_quantize, compile=True)(
            torch.randn(4, 16), torch.tensor(0.1), FORMATS["e4m3"], True
        )
    assert ptq.numerics.kernels.FALLBACKS == {}


def test_an_error_of_the_ops_themselves_is_raised_as_without_compilation():
    def checked(x):
        if x.dim() != 2:
            raise ValueError("two dimensions expected")
        return x * 2

    with pytest.raises(ValueError, match="two dimensions"):
        fused(checked, compile=True)(torch.ones(3))
