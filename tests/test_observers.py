"""Observers against independent numpy computations on known distributions."""

import numpy as np
import pytest
import torch

from ptq.calibration.observers import (
    BINS_PER_OCTAVE,
    TensorObserver,
    bin_edges,
    choose_clip,
    entropy_clip,
    histogram,
    kl_divergence,
    mse_clip,
    percentile_clip,
    quantized_histogram,
    sqnr_db,
)
from ptq.numerics.formats import get_format

E4M3, INT8 = get_format("e4m3"), get_format("int8")
BIN = (
    1 + 1 / BINS_PER_OCTAVE
)  # the largest relative width of a bin (at the start of a power of two)


def samples(seed=0, n=200_000):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32)


def observe(x: np.ndarray, chunks=4, **kw) -> TensorObserver:
    obs = TensorObserver(**kw)
    for part in np.array_split(x, chunks):
        obs.observe(torch.from_numpy(part))
    return obs


def np_quant(x, clip, fmt):
    """Independent reference: numpy rounding to the format's grid with scale clip / fmt.max."""
    s = clip / fmt.max
    y = np.abs(x.astype(np.float64)) / s
    if fmt.kind == "int":
        q = np.minimum(np.round(y), fmt.max)
    else:
        e = np.floor(np.log2(np.maximum(y, 2.0**-30)))
        e = np.maximum(e, 1 - fmt.bias)
        quantum = 2.0 ** (e - fmt.mantissa_bits)
        q = np.minimum(np.round(y / quantum) * quantum, fmt.max)
    return np.sign(x) * q * s


def np_mse(x, clip, fmt):
    return float(np.mean((np_quant(x, clip, fmt) - x) ** 2))


def test_running_max_and_mergeable_histograms():
    x = samples()
    obs = observe(x, chunks=7, channels=False)
    assert float(obs.amax) == pytest.approx(np.abs(x).max())
    assert int(obs.hist.sum()) == x.size
    a, b = observe(x[:1000], chunks=1), observe(x[1000:], chunks=3)
    a.merge(b)
    assert torch.equal(a.hist, obs.hist) and float(a.amax) == float(obs.amax)


def test_merge_equals_one_observer_of_every_batch_and_refuses_other_statistics():
    """merge folds shards' observers into the statistics of one that saw every batch (numpy's max, numpy's
    histogram counts), whichever side is empty or saw only non-finite batches; observers keeping other statistics are
    refused (they used to raise AttributeError on a missing histogram, or broadcast 1 channel over 8 silently)."""
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((3, 8)).astype(np.float32) * s for s in (1, 5, 2)]
    bad = np.full((3, 8), np.inf, dtype=np.float32)
    shards = [[batches[0], bad], [], [batches[1], batches[2]], [bad]]
    merged = TensorObserver(channels=True)
    for shard in shards:
        obs = TensorObserver(channels=True)
        for x in shard:
            obs.observe(torch.from_numpy(x))
        merged.merge(obs)
    every = np.abs(np.stack(batches))
    assert merged.calls == 5 and int(merged.nonfinite) == 2 and merged.finite_batches() == 3
    assert float(merged.amax) == every.max()
    np.testing.assert_array_equal(merged.channel_amax.numpy(), every.reshape(-1, 8).max(0))
    edges = bin_edges().numpy()
    want, _ = np.histogram(
        np.clip(every.astype(np.float64), edges[0], np.nextafter(edges[-1], 0)), bins=edges
    )
    assert merged.hist.tolist() == want.tolist()
    assert torch.isinf(merged.last)  # the latest batch, which names a fault

    x = torch.from_numpy(batches[0])
    for mine, theirs in [
        (TensorObserver(), TensorObserver(hist=False)),
        (TensorObserver(hist=False), TensorObserver()),
        (TensorObserver(channels=True), TensorObserver()),
    ]:
        theirs.observe(x)
        with pytest.raises(
            ValueError, match="cannot merge observers that keep different statistics"
        ):
            mine.merge(theirs)
    mine, theirs = TensorObserver(channels=True), TensorObserver(channels=True)
    mine.observe(x)
    theirs.observe(x[:, :1])
    with pytest.raises(
        ValueError, match=r"cannot merge per-channel amax of \[1\] channels into \[8\]"
    ):
        mine.merge(theirs)


@pytest.mark.parametrize("all_experts", [True, False])
def test_layers_reading_one_tensor_measure_it_once(all_experts, monkeypatch):
    """q/k/v read one tensor, and so do an expert's gate/up (with all_experts, every expert's): its histogram is
    computed once. The cache was keyed on a detached view, a new object at every call, so it never hit: each layer
    measured its input again. Per decoder layer of 4 experts: attention 2 (q/k/v, o), then with all_experts 1 (every
    gate/up) + 4 (each down_proj), routed 2 per expert (gate/up on its tokens, down_proj). The statistics are those
    of each layer calibrated alone (no tensor shared with another observer)."""
    import families

    from ptq.calibration import observers
    from ptq.calibration.calibrate import calibrate
    from ptq.models.matmuls import linearize
    from ptq.quantization.plan import calibration_targets, resolve_plans
    from ptq.quantization.recipes import load_recipe

    model = linearize(families.build("qwen3_moe", seed=3))
    assert model.config.num_experts == 4 and model.config.num_hidden_layers == 2
    layers, _ = calibration_targets(resolve_plans(model, [load_recipe("fp8-e4m3")]).values())
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    made = []
    real = observers.histogram
    monkeypatch.setattr(observers, "histogram", lambda x: made.append(x.shape) or real(x))
    together = calibrate(model, ids, layers, batch_size=2, all_experts=all_experts)
    assert len(made) == 2 * 2 * (
        (2 + 1 + 4) if all_experts else (2 + 2 * 4)
    )  # 2 batches, 2 decoder layers
    for name in layers:
        alone = calibrate(model, ids, [name], batch_size=2, all_experts=all_experts)
        assert torch.equal(together.input_amax[name], alone.input_amax[name]), name
        assert torch.equal(together.input_hist[name], alone.input_hist[name]), name


def test_a_tensor_written_in_place_is_measured_again():
    """The statistics shared by layers reading one tensor are keyed by its version: values written in place are
    measured again; an inference tensor (no version) is never shared."""
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            x = torch.ones(4, 8)
            a, b = TensorObserver(), TensorObserver()
            a.observe(x)
            x.mul_(3)
            b.observe(x)
        assert float(a.amax) == 1 and float(b.amax) == 3, mode


def test_observing_copies_nothing_to_the_host(monkeypatch):
    # The histogram stays where the activations are until it is read: `observe` used to read the `hist` property
    # (a copy to the CPU) on every call, a device sync per layer and batch on CUDA that its docstring rules out.
    copies = []
    real_cpu = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    x = samples(n=1000)
    obs = observe(x, chunks=3, channels=False)
    TensorObserver(hist=False).observe(torch.from_numpy(x))
    assert copies == []
    assert int(obs.hist.sum()) == x.size and copies  # reading it copies, once asked


def test_histogram_matches_numpy_on_the_bin_edges():
    # Values on, just below and just above every 7th bin edge, zeros, tiny and huge values, both signs:
    # the bit-pattern binning must agree with numpy's histogram over bin_edges() (bin 0 and the last bin
    # open-ended).
    edges = bin_edges().numpy()
    on = edges[::7].astype(np.float32)
    x = np.concatenate(
        [
            on,
            np.nextafter(on, np.float32(0)),
            np.nextafter(on, np.float32(np.inf)),
            [0.0, 1e-30, 2.0**-25, 2.0**16, 2.0**32, 3e38],
            samples(6, 10_000) * 50,
        ]
    ).astype(np.float32)
    x = np.concatenate([x, -x])
    a = np.abs(x.astype(np.float64))
    want, _ = np.histogram(np.clip(a, edges[0], np.nextafter(edges[-1], 0)), bins=edges)
    assert histogram(torch.from_numpy(x)).tolist() == want.tolist()
    assert histogram(torch.from_numpy(x).to(torch.bfloat16)).sum() == x.size


def test_channel_amax_is_per_last_dimension():
    x = torch.randn(3, 5, 8)
    obs = TensorObserver(hist=False, channels=True)
    obs.observe(x[:2])
    obs.observe(x[2:])
    np.testing.assert_allclose(obs.channel_amax.numpy(), np.abs(x.numpy()).reshape(-1, 8).max(0))


@pytest.mark.parametrize("p", [50.0, 99.0, 99.99])
def test_percentile_matches_numpy_within_a_bin(p):
    x = samples(1)
    obs = observe(x)
    got = percentile_clip(obs.hist, float(obs.amax), p)
    want = np.percentile(np.abs(x), p)
    assert want / BIN <= got <= want * BIN


def test_percentile_and_mse_above_fp16s_range_match_numpy():
    # A bf16 model's down-projection can see inputs beyond 2^16 (fp16's range), where the histogram used to end:
    # every such value fell into its last bin and the 99.5th percentile read 65019 instead of numpy's 1.8e5.
    x = samples(5) * 1e5
    obs = observe(x)
    want = np.percentile(np.abs(x), 99.5)
    got = percentile_clip(obs.hist, float(obs.amax), 99.5)
    assert want > 2**16 and want / BIN <= got <= want * BIN
    got = mse_clip(obs.hist, float(obs.amax), INT8)
    grid = np.abs(x).max() * 2.0 ** -np.linspace(0, 8, 400)
    assert np_mse(x, got, INT8) <= 1.05 * min(np_mse(x, c, INT8) for c in grid)


def test_an_amax_beyond_the_histogram_falls_back_to_the_max():
    x = np.array([1.0, 2.0, 3.0 * 2.0**32], dtype=np.float32)
    obs = observe(x, chunks=1)
    for method in ("percentile", "mse", "entropy", "best"):
        assert choose_clip(method, obs.hist, float(obs.amax), E4M3, 50.0) == (
            "max",
            float(obs.amax),
        )


@pytest.mark.parametrize("fmt", [E4M3, INT8])
def test_mse_clip_is_near_the_brute_force_optimum(fmt):
    # Gaussian bulk plus a few large outliers.
    x = np.concatenate([samples(2), np.array([40.0, -35.0, 30.0], dtype=np.float32)])
    obs = observe(x)
    got = mse_clip(obs.hist, float(obs.amax), fmt)
    grid = np.abs(x).max() * 2.0 ** -np.linspace(0, 8, 400)
    best = min(np_mse(x, c, fmt) for c in grid)
    assert np_mse(x, got, fmt) <= 1.05 * best


def test_clip_error_and_sqnr_estimate_match_the_samples():
    x = samples(3)
    obs = observe(x)
    amax = float(obs.amax)
    for fmt in (E4M3, INT8):
        want = 10 * np.log10(np.mean(x.astype(np.float64) ** 2) / np_mse(x, amax, fmt))
        assert sqnr_db(obs.hist, amax, fmt) == pytest.approx(want, abs=0.5)


def test_kl_divergence_matches_numpy():
    p, q = torch.tensor([1.0, 2.0, 0.0, 5.0]), torch.tensor([2.0, 2.0, 1.0, 3.0])
    pn, qn = p.numpy() / p.sum().item(), q.numpy() / q.sum().item()
    want = sum(a * np.log(a / b) for a, b in zip(pn, qn) if a > 0)
    assert kl_divergence(p, q) == pytest.approx(want)


def test_quantized_histogram_on_a_known_histogram():
    hist = torch.tensor([4, 0, 2, 2, 6, 3, 1], dtype=torch.int64)
    levels = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    p, q = quantized_histogram(hist, 4, levels)  # clip at bin 4: bins 5, 6 fold into it
    assert p.tolist() == [4, 0, 2, 2, 10]
    assert q.tolist() == [
        4,
        0,
        2,
        2,
        6,
    ]  # level 1 holds 4 counts over 2 non-empty bins; level 2 holds 6 in 1
    levels = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    p, q = quantized_histogram(hist, 6, levels)
    assert p.tolist() == [4, 0, 2, 2, 6, 3, 1] and q.tolist() == [3, 0, 3, 3, 3, 3, 3]


def test_entropy_clips_outliers_for_int8_but_keeps_the_bulk():
    x = np.concatenate([samples(4), np.full(5, 60.0, dtype=np.float32)])
    obs = observe(x)
    clip = entropy_clip(obs.hist, float(obs.amax), INT8)
    assert 2.5 < clip < 30


def test_best_picks_the_lowest_error_method():
    x = np.concatenate([samples(5), np.array([50.0], dtype=np.float32)])
    obs = observe(x)
    amax = float(obs.amax)
    method, clip = choose_clip("best", obs.hist, amax, INT8, percentile=99.99)
    errors = {
        m: np_mse(x, choose_clip(m, obs.hist, amax, INT8)[1], INT8)
        for m in ("max", "percentile", "mse")
    }
    assert method == min(errors, key=errors.get) and method != "max"
    assert choose_clip("max", obs.hist, amax, INT8) == ("max", amax)
