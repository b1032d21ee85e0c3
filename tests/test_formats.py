"""ptq.numerics.formats against independent references: ml_dtypes / numpy casts and hand-computed bits.

Reference semantics: ml_dtypes' float8_e4m3fn / float8_e5m2 / bfloat16 casts and numpy's
float16 cast are round-to-nearest-even and non-saturating (overflow -> NaN for e4m3fn, inf for
the others), so they are the reference for saturate=False directly. For saturate=True the
reference clips finite values to +-max first (max is on the grid and rounding is monotonic, so
clip-then-round equals round-then-saturate), keeps +-inf for formats that have inf, and clips
+-inf to +-max for E4M3.
"""

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from ptq.errors import PtqError
from ptq.numerics import kernels
from ptq.numerics.formats import (
    FORMATS,
    _split_round,
    amax,
    compute_scale,
    dequantize,
    fake_quantize,
    get_format,
    quantize,
    round_to_format,
    to_storage,
)
from ptq.numerics.kernels import fused

E4M3, E5M2, INT8, BF16, FP16 = (FORMATS[n] for n in ("e4m3", "e5m2", "int8", "bf16", "fp16"))

REF_DTYPE = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
}
UINT = {8: np.uint8, 16: np.uint16}
TORCH_UINT = {8: torch.uint8, 16: torch.uint16}
FLOAT_FORMATS = [E4M3, E5M2, BF16, FP16]


def reference_cast(x: np.ndarray, fmt, saturate: bool) -> np.ndarray:
    """x (float32) cast to fmt by ml_dtypes / numpy, as an array of the reference dtype."""
    with np.errstate(all="ignore"):
        if saturate:
            clipped = np.clip(x, -fmt.max, fmt.max)
            x = np.where(np.isinf(x), x, clipped) if fmt.has_inf else clipped
        return x.astype(np.float32).astype(REF_DTYPE[fmt.name])


def assert_same_bits(
    ours: np.ndarray, ref: np.ndarray, uint, x: np.ndarray | None = None, what: str = ""
):
    """Bit-exact equality of two arrays viewed as `uint`, except that NaN only has to match NaN."""
    ours_nan = np.isnan(ours.astype(np.float32))
    ref_nan = np.isnan(ref.astype(np.float32))
    bad = (ours_nan != ref_nan) | (~ref_nan & (ours.view(uint) != ref.view(uint)))
    if bad.any():
        i = np.flatnonzero(bad)[:10]
        inputs = x.ravel()[i] if x is not None else "?"
        raise AssertionError(
            f"{what}: {bad.sum()} mismatches, e.g. inputs {inputs!r}: "
            f"ours {ours.ravel()[i].astype(np.float32)!r} vs ref {ref.ravel()[i].astype(np.float32)!r}"
        )


def check_against_reference(x: np.ndarray, fmt, saturate: bool):
    """round_to_format's float32 values and to_storage's bits both match the reference cast."""
    ref = reference_cast(x, fmt, saturate)
    grid = round_to_format(torch.from_numpy(x), fmt, saturate=saturate)
    assert grid.dtype == torch.float32
    what = f"{fmt.name} saturate={saturate}"
    # The float32 grid values themselves (so a lenient storage cast cannot hide off-grid values) ...
    assert_same_bits(grid.numpy(), ref.astype(np.float32), np.uint32, x, what + " (float32 values)")
    # ... and the storage bits.
    stored = to_storage(grid, fmt)
    assert stored.dtype == fmt.torch_dtype
    ours_bits = stored.view(TORCH_UINT[fmt.bits]).numpy()
    assert_same_bits(ours_bits.view(ref.dtype), ref, UINT[fmt.bits], x, what + " (storage bits)")


def all_values(fmt) -> np.ndarray:
    """Every value of a 8/16-bit float format as float32 (NaN included), via ml_dtypes/numpy."""
    codes = np.arange(2**fmt.bits, dtype=np.uint32).astype(UINT[fmt.bits])
    return codes.view(REF_DTYPE[fmt.name]).astype(np.float32)


def midpoints(fmt) -> np.ndarray:
    """Exact midpoints of all adjacent finite non-negative values, plus the one between max and
    the next value the exponent field could encode (464 for E4M3, 61440 for E5M2), and their
    float32 neighbours just below and above."""
    with np.errstate(invalid="ignore"):  # NaN codes
        v = np.unique(all_values(fmt).astype(np.float64))
    v = v[np.isfinite(v) & (v >= 0)]
    top = v[-1] + (v[-1] - v[-2])  # 480 for E4M3 (its NaN code), 65536 for E5M2 (inf)
    v = np.append(v, top)
    mid = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    assert np.all(mid.astype(np.float64) == (v[1:] + v[:-1]) / 2), (
        "midpoints must be exact in float32"
    )
    near = np.concatenate(
        [mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))]
    )
    return np.concatenate([near, -near])


def specials(fmt) -> np.ndarray:
    tiny_sub = fmt.min_normal * 2.0**-fmt.mantissa_bits
    mx = np.float32(fmt.max)
    vals = [
        0.0,
        tiny_sub,
        tiny_sub / 2,
        tiny_sub * 1.5,
        fmt.min_normal,
        mx,
        np.nextafter(mx, np.float32(np.inf)),
        np.nextafter(mx, np.float32(0)),
        np.inf,
        np.float32(np.finfo(np.float32).max),
        np.float32(2.0**-149),
    ]
    x = np.array(vals, dtype=np.float32)
    return np.concatenate([x, -x, np.array([np.nan, -np.nan], dtype=np.float32)])


# 1. Exhaustive over the 65,536 bf16 bit patterns.


def bf16_patterns() -> np.ndarray:
    # Built from bits independently of any library cast: bf16 is the top half of a float32.
    return (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("saturate", [False, True])
def test_bf16_patterns_round_to_bf16_is_identity(saturate):
    x = bf16_patterns()
    ours = round_to_format(torch.from_numpy(x), BF16, saturate=saturate).numpy()
    assert_same_bits(ours, x, np.uint32, x, "bf16 identity")
    assert np.isnan(ours).sum() == np.isnan(x).sum() == 254  # 2 signs * 127 NaN mantissas
    stored = to_storage(torch.from_numpy(ours), BF16).view(torch.uint16).numpy()
    finite = ~np.isnan(x)
    assert np.array_equal(stored[finite], np.arange(2**16, dtype=np.uint16)[finite])


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_bf16_patterns_to_fp8_match_reference(fmt, saturate):
    check_against_reference(bf16_patterns(), fmt, saturate)


# 2. Millions of random float32 values, ties and special values, for all float formats.


@pytest.fixture(scope="module")
def wide_values() -> np.ndarray:
    rng = np.random.default_rng(1234)
    n = 1_000_000
    # Log-uniform magnitudes from far below E4M3/E5M2/fp16 subnormals to beyond their max.
    logu = (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-30, 20, n)).astype(np.float32)
    # Random finite float32 bit patterns: every exponent, which exercises bf16 end to end.
    bits = rng.integers(0, 2**32, 2 * n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits)]
    # Exact ties and their neighbours for every format, and the special values.
    edge = np.concatenate([np.concatenate([midpoints(f), specials(f)]) for f in FLOAT_FORMATS])
    # bf16 midpoints (and the max/2**128 tie, which must round to inf): all exact in float32.
    with np.errstate(invalid="ignore"):  # NaN patterns
        b = bf16_patterns().astype(np.float64)
    b = np.sort(b[np.isfinite(b) & (b >= 0)])
    b_mid = ((np.append(b, 2.0**128)[1:] + np.append(b, 2.0**128)[:-1]) / 2).astype(np.float32)
    return np.concatenate([logu, bits, edge, b_mid, -b_mid])


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_random_and_edge_values_match_reference(wide_values, fmt, saturate):
    assert wide_values.size > 3_000_000
    check_against_reference(wide_values, fmt, saturate)


@pytest.mark.parametrize("saturate", [False, True])
def test_compiled_e4m3_rounding_matches_reference(wide_values, saturate):
    # The fused kernel that every FP8 matmul input goes through (saturating: a clamp and, in a CPU loop, Veltkamp's
    # split; not: the bit operations), compiled by Inductor, against ml_dtypes itself rather than only against the
    # eager ops. A fallback to the eager ops (its warning) fails the test.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        grid = fused(round_to_format, compile=True)(torch.from_numpy(wide_values), E4M3, saturate)
    assert (
        kernels.strict_cpu_arithmetic
    )  # Inductor's defaults: the saturating kernel above is the split
    ref = reference_cast(wide_values, E4M3, saturate).astype(np.float32)
    assert_same_bits(
        grid.numpy(), ref, np.uint32, wide_values, f"compiled e4m3 saturate={saturate}"
    )


def test_compiled_e4m3_rounding_matches_reference_on_every_float32_up_to_480():
    # Exhaustive where the split could err: every float32 of either sign from 0 to 480 (beyond, the clamp gives
    # +-448 whatever the rounding), 2.3 billion values, in 16M chunks (about 30 s).
    kernel = fused(round_to_format, compile=True)
    mismatches = 0
    for chunk in torch.arange(0, 0x43F00001, dtype=torch.int32).split(1 << 24):
        for sign in (1.0, -1.0):
            x = chunk.view(torch.float32) * sign
            ref = torch.from_numpy(reference_cast(x.numpy(), E4M3, True).astype(np.float32))
            mismatches += int(
                (kernel(x, E4M3, True).view(torch.int32) != ref.view(torch.int32)).sum()
            )
    assert kernels.strict_cpu_arithmetic and mismatches == 0


def test_split_rounding_matches_reference(wide_values):
    # The split by itself, in eager ops (what the fused CPU loop computes), on every tie and its neighbours.
    x = np.clip(wide_values, -448, 448)
    ref = reference_cast(x, E4M3, True).astype(np.float32)
    assert_same_bits(
        _split_round(torch.from_numpy(x), E4M3).numpy(), ref, np.uint32, x, "split e4m3"
    )


def test_midpoints_are_ties():
    # Guard the test data: the tie set really hits values between representable numbers.
    m = midpoints(E4M3)
    assert 464.0 in m and np.float32(2.0**-10) in m and np.float32(-3 * 2.0**-10) in m
    assert 61440.0 in midpoints(E5M2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", FLOAT_FORMATS + [INT8], ids=lambda f: f.name)
def test_cuda_matches_cpu(wide_values, fmt):
    x = torch.from_numpy(wide_values)
    for saturate in (False, True):
        cpu = round_to_format(x, fmt, saturate).numpy()
        gpu = round_to_format(x.cuda(), fmt, saturate).cpu().numpy()
        assert_same_bits(gpu, cpu, np.uint32, wide_values, f"cuda {fmt.name}")


def float64_values() -> np.ndarray:
    """float64 inputs that float32 cannot hold: each format's ties nudged by 2^-30 of themselves either way (float32
    rounds them onto the tie), random 53-bit values from far below the formats' subnormals to past float32's
    max, what float32 flushes to zero or overflows to inf, and the special values."""
    rng = np.random.default_rng(5)
    ties = np.concatenate([midpoints(f).astype(np.float64) for f in FLOAT_FORMATS])
    with np.errstate(invalid="ignore"):
        b = bf16_patterns().astype(np.float64)
    b = np.sort(b[np.isfinite(b) & (b >= 0)])
    ties = np.concatenate(
        [ties, (b[1:] + b[:-1]) / 2, np.arange(-128, 128) + 0.5]
    )  # bf16's and int8's ties too
    nudged = np.concatenate([ties * (1 + 2.0**-30), ties * (1 - 2.0**-30)])
    logu = rng.choice([-1.0, 1.0], 200_000) * 2.0 ** rng.uniform(-160, 130, 200_000)
    edge = [1e-50, 2.0**-150, 3.0e38, 3.4028235677973366e38, 1e39, 1e300, 0.0, np.inf, np.nan]
    edge = np.array(
        edge + [(2 - 2.0**-8) * 2.0**127 * (1 - 2.0**-40)]
    )  # just below bf16's overflow tie
    return np.concatenate([nudged, logu, edge, -edge])


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", FLOAT_FORMATS + [INT8], ids=lambda f: f.name)
def test_float64_inputs_are_rounded_once(fmt, saturate):
    # ml_dtypes and numpy round a float64 to the format directly; casting it to float32 first rounded twice
    # (1.0625 + 2^-40 became the E4M3 tie 1.0625, then the even 1.0 instead of 1.125; 464 + 2^-30 became 448
    # instead of NaN when not saturating).
    # the reference itself: ml_dtypes before 0.7 rounds a float64 through float32, twice (1.0625 + 2^-40 to 1.0)
    assert np.array([1.0625 + 2.0**-40]).astype(ml_dtypes.float8_e4m3fn)[0] == 1.125, (
        "ml_dtypes < 0.7: see pyproject"
    )
    x = float64_values()
    with np.errstate(all="ignore"):
        if fmt is INT8:
            ref = np.clip(np.rint(x), -127, 127).astype(np.float32)
        else:
            if saturate:
                clipped = np.clip(x, -fmt.max, fmt.max)
                x_ref = np.where(np.isinf(x), x, clipped) if fmt.has_inf else clipped
            else:
                x_ref = x
            ref = x_ref.astype(REF_DTYPE[fmt.name]).astype(np.float32)
        assert (x.astype(np.float32) != x)[
            np.isfinite(x)
        ].sum() > 400_000  # float32 cannot hold most of them
    ours = round_to_format(torch.from_numpy(x), fmt, saturate=saturate).numpy()
    assert_same_bits(ours, ref, np.uint32, x, f"float64 -> {fmt.name} saturate={saturate}")


def test_other_input_dtypes_and_strides():
    x64 = torch.tensor(
        [1.0 + 2.0**-40, 464.0, -3.0 * 2**-10, 1.0625 + 2.0**-40], dtype=torch.float64
    )
    assert round_to_format(x64, E4M3).tolist() == [1.0, 448.0, -(2.0**-8), 1.125]
    xb = torch.tensor([3.0, 448.0, 500.0], dtype=torch.bfloat16)
    assert round_to_format(xb, E4M3).tolist() == [3.0, 448.0, 448.0]
    w = torch.randn(64, 32)
    assert torch.equal(round_to_format(w.t(), E5M2), round_to_format(w.t().contiguous(), E5M2))


# 3. bf16 with subnormals flushed (TPU behaviour), hand-computed.


def test_bf16_flush_subnormals():
    x = torch.tensor(
        [
            2.0**-127,
            -(2.0**-127),
            2.0**-133,
            3 * 2.0**-130,
            2.0**-126 - 2.0**-134,
            2.0**-126,
            -(2.0**-126),
            1.0,
            2.0**-149,
        ],
        dtype=torch.float32,
    )
    flushed = round_to_format(x, BF16, saturate=False, flush_subnormals=True)
    assert flushed.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 2.0**-126, -(2.0**-126), 1.0, 0.0]
    assert torch.signbit(flushed).tolist() == [
        False,
        True,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    # Without flushing the subnormals survive; 127.5 quanta of 2**-133 rounds (half-even) up to 2**-126.
    kept = round_to_format(x, BF16, saturate=False)
    assert kept.tolist() == [
        2.0**-127,
        -(2.0**-127),
        2.0**-133,
        3 * 2.0**-130,
        2.0**-126,
        2.0**-126,
        -(2.0**-126),
        1.0,
        0.0,
    ]
    # Normals are unchanged by flushing.
    normals = torch.randn(10_000) * 1e3
    assert torch.equal(
        round_to_format(normals, BF16, False, True), round_to_format(normals, BF16, False)
    )
    # Same rule for another format: E4M3 values below 2**-6 become zero.
    assert round_to_format(
        torch.tensor([2.0**-7, 2.0**-6]), E4M3, flush_subnormals=True
    ).tolist() == [0.0, 2.0**-6]


# 4. Hand-computed bit patterns, independent of ml_dtypes.


def bits_of(values, fmt, saturate):
    q = round_to_format(torch.tensor(values, dtype=torch.float32), fmt, saturate=saturate)
    return to_storage(q, fmt).view(TORCH_UINT[fmt.bits]).tolist()


INF, NAN = float("inf"), float("nan")


def test_e4m3_hand_computed_bits():
    assert bits_of([448.0, -448.0, 2.0**-9, 2.0**-6, 1.0, -0.0, 0.0], E4M3, True) == [
        0x7E,
        0xFE,
        0x01,
        0x08,
        0x38,
        0x80,
        0x00,
    ]
    # Ties: 2**-10 is halfway 0..2**-9 -> 0 (even); 3*2**-10 -> 2**-8; 464 between 448 and 480 -> 448 (even).
    assert bits_of([2.0**-10, 3 * 2.0**-10, 464.0, 1.0625, 1.1875], E4M3, True) == [
        0x00,
        0x02,
        0x7E,
        0x38,
        0x3A,
    ]
    assert bits_of([464.0, 465.0, 1e6, INF, -INF], E4M3, True) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert bits_of([464.0, 465.0, INF, NAN], E4M3, False) == [0x7E, 0x7F, 0x7F, 0x7F]
    assert bits_of([-465.0, -INF], E4M3, False) == [0xFF, 0xFF]


def test_e5m2_hand_computed_bits():
    assert bits_of([57344.0, -57344.0, 1.0, 2.0**-16, 2.0**-14], E5M2, True) == [
        0x7B,
        0xFB,
        0x3C,
        0x01,
        0x04,
    ]
    assert bits_of([INF, -INF, 61440.0, 61439.0], E5M2, True) == [0x7C, 0xFC, 0x7B, 0x7B]
    assert bits_of([INF, 61440.0, 61439.0, -61440.0], E5M2, False) == [0x7C, 0x7C, 0x7B, 0xFC]
    # 2**-17 is halfway 0..2**-16 -> 0; 3*2**-17 -> 2*2**-16.
    assert bits_of([2.0**-17, 3 * 2.0**-17], E5M2, True) == [0x00, 0x02]


def test_16_bit_overflow_is_ieee_when_not_saturating():
    tie = (
        2 - 2.0**-8
    ) * 2.0**127  # halfway between bf16 max (odd mantissa) and 2**128: rounds up to inf
    below = float(np.nextafter(np.float32(tie), np.float32(0)))
    big = [
        3.3895313892515355e38,
        below,
        tie,
        float(np.finfo(np.float32).max),
        65504.0,
        65519.0,
        65520.0,
    ]
    assert bits_of(big[:4], BF16, False) == [0x7F7F, 0x7F7F, 0x7F80, 0x7F80]
    assert bits_of(big[:4], BF16, True) == [0x7F7F, 0x7F7F, 0x7F7F, 0x7F7F]
    assert bits_of(big[4:], FP16, False) == [0x7BFF, 0x7BFF, 0x7C00]
    assert bits_of(big[4:], FP16, True) == [0x7BFF, 0x7BFF, 0x7BFF]


# 5. int8: scale = amax / 127, codes in [-127, 127], round half to even.


def test_int8_rounding_and_saturation():
    x = torch.tensor(
        [2.5, 3.5, -2.5, 0.5, 1.5, -0.5, 126.5, 127.4, 300.0, -128.0, -300.0, INF, -INF]
    )
    assert quantize(x, 1.0, INT8).tolist() == [
        2,
        4,
        -2,
        0,
        2,
        0,
        126,
        127,
        127,
        -127,
        -127,
        127,
        -127,
    ]
    assert torch.isnan(round_to_format(torch.tensor([NAN]), INT8)).all()


def test_int8_scale_and_codes_match_numpy():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(200_000) * 10).astype(np.float32)
    x[:1000] = rng.integers(-300, 300, 1000) + 0.5  # exact ties
    a = amax(torch.from_numpy(x))
    scale = compute_scale(a, INT8)
    assert scale.item() == np.float32(np.abs(x).max()) / np.float32(127)
    q = quantize(torch.from_numpy(x), scale, INT8)
    ref = np.clip(np.rint(x / scale.numpy()), -127, 127)
    assert np.array_equal(q.numpy(), ref)
    assert q.abs().max().item() == 127
    stored = to_storage(q, INT8)
    assert stored.dtype == torch.int8 and stored.min().item() >= -127
    assert np.array_equal(stored.numpy(), ref.astype(np.int8))
    # Raw ties with scale 1.
    t = x[:1000]
    assert np.array_equal(
        round_to_format(torch.from_numpy(t), INT8).numpy(), np.clip(np.rint(t), -127, 127)
    )


def test_int8_per_channel_and_zero_rows():
    w = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-127.0, 50.0, 25.4, 0.2]])
    a = amax(w, dim=1)
    assert a.shape == (3, 1) and a.flatten().tolist() == [4.0, 0.0, 127.0]
    scale = compute_scale(a, INT8)
    assert scale.shape == (3, 1)
    assert scale.flatten().tolist() == [
        np.float32(4.0) / np.float32(127),
        1.0,
        1.0,
    ]  # amax 0 -> scale 1
    q = quantize(w, scale, INT8)
    ref = np.clip(np.rint(w.numpy() / scale.numpy()), -127, 127)
    assert np.array_equal(q.numpy(), ref)
    assert q[0].abs().max() == 127 and q[2].tolist() == [-127, 50, 25, 0]
    assert torch.equal(fake_quantize(w, scale, INT8)[1], torch.zeros(4))
    # Values beyond a row's amax (static scale too small) saturate.
    assert quantize(torch.tensor([[10.0], [1.0], [500.0]]), scale, INT8).flatten().tolist() == [
        127,
        1,
        127,
    ]


def test_to_storage_int8_rejects_bad_codes():
    with pytest.raises(ValueError):
        to_storage(torch.tensor([1.0, NAN]), INT8)
    with pytest.raises(ValueError):
        to_storage(torch.tensor([1.5]), INT8)
    with pytest.raises(ValueError):
        to_storage(torch.tensor([128.0]), INT8)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        to_storage(torch.tensor([-128.0]), INT8)  # ptq's own convention: symmetric
    # the loaders' full range (--target vllm's static int8 inputs): quantize gives -128, and it is stored as such
    q = quantize(torch.tensor([-200.0, -1.0, 64.0]), torch.tensor(1.0), INT8, lowest=-128.0)
    assert to_storage(q, INT8, lowest=-128.0).tolist() == [-128, -1, 64]
    with pytest.raises(ValueError, match=r"\[-128, 127\]"):
        to_storage(torch.tensor([-129.0]), INT8, lowest=-128.0)


def test_compute_scale():
    assert compute_scale(torch.tensor(0.0), E4M3).item() == 1.0
    assert compute_scale(0.0, INT8).item() == 1.0
    assert compute_scale(torch.tensor(896.0), E4M3).item() == 2.0
    assert compute_scale(torch.tensor(57344.0), E5M2).item() == 1.0
    s = compute_scale(torch.tensor([[3.0], [0.0]]), E4M3)
    assert s.dtype == torch.float32 and s.shape == (2, 1) and s[1].item() == 1.0
    assert (
        compute_scale(torch.tensor(1e-45), E4M3).item() == 1.0
    )  # underflowing scale -> 1, never 0
    assert compute_scale(torch.tensor([5.0, 0.0]), BF16).tolist() == [1.0, 1.0]
    for bad in (-1.0, NAN, INF):
        with pytest.raises(ValueError):
            compute_scale(torch.tensor([1.0, bad]), E4M3)


def test_a_tiny_amax_gets_a_normal_scale_so_that_multiplying_by_its_reciprocal_works():
    # amax / 448 below 2^-126 is a float32 subnormal, whose reciprocal overflows to inf: vLLM scales static FP8
    # inputs by x * (1 / scale), where a 0 became NaN. The scale is raised to 2^-126 (the amax still fits).
    tiny = 2.0**-126
    for a in (1e-36, 5e-37, 1e-38):
        scale = compute_scale(torch.tensor(a), E4M3)
        assert scale.item() == tiny and torch.isfinite(scale.reciprocal())
        x = torch.tensor([0.0, a, -a / 3], dtype=torch.float32)
        for reciprocal in (False, True):
            got = quantize(x, scale, E4M3, reciprocal=reciprocal).numpy()
            # reference: ml_dtypes' E4M3 of x * 2^126 (exact in float32: a power of two)
            want = (
                (x.numpy() * np.float32(2.0**126))
                .astype(ml_dtypes.float8_e4m3fn)
                .astype(np.float32)
            )
            np.testing.assert_array_equal(got, want)
    assert (
        compute_scale(torch.tensor(448 * tiny), E4M3).item() == tiny
    )  # the smallest normal scale, unchanged
    assert compute_scale(torch.tensor(448 * tiny * 2), E4M3).item() == 2 * tiny


def test_amax():
    x = torch.tensor([[1.0, -7.0], [3.0, 2.0]])
    assert amax(x).item() == 7.0 and amax(x).shape == ()
    assert amax(x, dim=1).tolist() == [[7.0], [3.0]]
    assert amax(x.to(torch.bfloat16)).dtype == torch.float32
    assert not torch.signbit(amax(torch.zeros(3)))
    assert torch.isnan(amax(torch.tensor([1.0, NAN, -5.0])))
    assert torch.isnan(amax(torch.tensor([[1.0, NAN], [2.0, 3.0]]), dim=1)[0]).all()
    with pytest.raises(ValueError):
        amax(torch.empty(0))


# 6. fake_quantize equals the 30-line reference used by llm-compressor / ModelOpt / Quark.


def reference_fp8_fake_quant(x: np.ndarray, amax_value: np.ndarray) -> np.ndarray:
    scale = (amax_value / np.float32(448.0)).astype(np.float32)
    q = np.clip(x / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q * scale


def test_fake_quantize_matches_reference():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((256, 512)) * 0.05).astype(np.float32)
    x[rng.integers(0, 256, 20), rng.integers(0, 512, 20)] *= 200  # outliers
    xt = torch.from_numpy(x)
    cases = [
        ("per-tensor", amax(xt)),
        ("per-channel", amax(xt, dim=1)),
        ("static scale too small (saturates)", amax(xt) * 0.25),
    ]
    for name, a in cases:
        ours = fake_quantize(xt, compute_scale(a, E4M3), E4M3)
        ref = reference_fp8_fake_quant(x, a.numpy())
        assert ours.dtype == torch.float32
        assert_same_bits(ours.numpy(), ref, np.uint32, x, name)
    # quantize -> to_storage -> dequantize is the same as fake_quantize.
    scale = compute_scale(amax(xt, dim=1), E4M3)
    stored = to_storage(quantize(xt, scale, E4M3), E4M3)
    assert torch.equal(dequantize(stored, scale), fake_quantize(xt, scale, E4M3))


# 7. Format table and names.


def test_get_format_aliases():
    for name, key in [
        ("e4m3", "e4m3"),
        ("fp8-e4m3", "e4m3"),
        ("float8_e4m3fn", "e4m3"),
        ("E4M3", "e4m3"),
        ("e5m2", "e5m2"),
        ("int8", "int8"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("fp16", "fp16"),
        ("float16", "fp16"),
    ]:
        assert get_format(name) is FORMATS[key]
    with pytest.raises(
        PtqError, match=r"unknown number format 'e3m4' \(known: e4m3, e5m2, int8, bf16, fp16"
    ):
        get_format("e3m4")


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_table_matches_torch_finfo(fmt):
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.max == fi.max and fmt.min_normal == fi.smallest_normal
    assert fmt.bits == fi.bits and fmt.mantissa_bits == round(-np.log2(fi.eps))
    assert fmt.exponent_bits == fmt.bits - 1 - fmt.mantissa_bits
    assert fmt.min_normal == 2.0 ** (1 - fmt.bias)
    assert not fmt.scaled if fmt.bits == 16 else fmt.scaled
