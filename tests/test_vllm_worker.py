"""The vLLM check's CPU stand-in for torch._scaled_mm (benchmarks/vllm_worker.py, stand-in 5): the same arithmetic as
torch's own kernel, fast. vLLM is not needed: the worker imports only torch at module level."""

import pytest
import torch

from benchmarks.vllm_worker import fast_scaled_mm


def operands(m=24, k=80, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 40).to(torch.float8_e4m3fn)
    b = (
        (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn).t()
    )  # [K, N] column-major, as vLLM passes it
    return a, b, g


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fast_scaled_mm_computes_the_scaled_product(row_wise, out_dtype, with_bias):
    # The reference: the product in float64, rounded once to the output dtype (torch._scaled_mm is no reference
    # everywhere: torch 2.11's CPU kernel asserts "only supports per-tensor scaling" for row-wise scales; 2.13's runs)
    a, b, g = operands()
    m, n = a.shape[0], b.shape[1]
    if row_wise:
        scale_a, scale_b = (
            torch.rand(m, 1, generator=g) * 0.02,
            torch.rand(1, n, generator=g) * 0.003,
        )
    else:
        scale_a, scale_b = torch.tensor([0.013]), torch.tensor([0.0021])
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    exact = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    ref = (exact + (bias.double() if with_bias else 0.0)).to(out_dtype)
    got = fast_scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    assert got.dtype == ref.dtype == out_dtype and got.shape == ref.shape == (m, n)
    # float32: only the accumulation order differs; bf16: at most one rounding step of the output
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= tol


def test_fast_scaled_mm_leaves_other_cases_to_torch():
    a, b, _ = operands()
    one = torch.tensor([1.0])
    assert fast_scaled_mm(a.float(), b.float(), one, one) is None  # not FP8 operands
    assert fast_scaled_mm(a, b, one, one, out_dtype=torch.float8_e4m3fn) is None  # FP8 output
    assert fast_scaled_mm(a, b, one, one, scale_result=one) is None
    assert fast_scaled_mm(a, b, torch.ones(a.shape[0], 2), one) is None  # block-wise scales
