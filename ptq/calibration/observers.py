"""Activation observers: what calibration records about each quantized activation, and the clipping
value (the amax that the scale maps onto the format's max) that each calibration method derives from
it.

Observers stream: a running max, a running per-channel max (for SmoothQuant) and a histogram of |x|
on fixed bins: 32 per power of two, the float32 values that share an exponent and their top 5
mantissa bits, so that a value's bin is read off its bit pattern (a mask, a shift, a bincount: about
as cheap as the amax itself). Fixed bins make histograms mergeable (add the counts) and let one
calibration pass serve every method and every format: nothing about the activations is kept.

Methods (the recipe's `observer`):
    max         the running max |x|
    percentile  the p-th percentile of |x| (e.g. 99.99)
    mse         the clip that minimises the mean squared quantization error for the target format
    entropy     the clip that minimises KL(P || Q) between the histogram and its quantized version
    best        per tensor, whichever of max / percentile / mse gives the lowest error (the
                paper's choice)

Errors are estimated on the histogram: each bin stands for SUBSAMPLES values spread evenly over it.
"""

from __future__ import annotations

import itertools
import math

import torch

from ptq.numerics.formats import NumberFormat, amax, fake_quantize

MANTISSA_BITS = 5  # a bin is the float32 values with one exponent and the same top 5 mantissa bits
BINS_PER_OCTAVE = 2**MANTISSA_BITS
# |x| below 2^-24 lands in bin 0, at or above 2^32 in the last bin. The top reaches past fp16's
# 65504 because bf16 models' matmul inputs can (a down-projection's outliers); a histogram cannot
# place what its last bin holds, so above 2^32 the methods that read it give way to the max
# (choose_clip).
MIN_EXPONENT, MAX_EXPONENT = -24, 32
NUM_BINS = (MAX_EXPONENT - MIN_EXPONENT) * BINS_PER_OCTAVE
# the bit pattern of 2^-24 (float32 bias 127), shifted
_FIRST_BIN = (MIN_EXPONENT + 127) << MANTISSA_BITS
SUBSAMPLES = 4
MSE_CANDIDATES = 128  # clips tried between amax / 2^8 and amax
METHODS = ("max", "percentile", "mse", "entropy", "best")


def bin_edges() -> torch.Tensor:
    """The NUM_BINS + 1 bin edges on |x| (float64): 2^e * (1 + k/32); bin 0 also takes zeros and
    everything below 2^-24, the last bin everything above."""
    i = torch.arange(NUM_BINS + 1, dtype=torch.float64)
    octave = torch.div(i, BINS_PER_OCTAVE, rounding_mode="floor")
    return torch.exp2(MIN_EXPONENT + octave) * (
        1 + (i - octave * BINS_PER_OCTAVE) / BINS_PER_OCTAVE
    )


def histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of |x| in the fixed bins (int64, length NUM_BINS). For finite x (NaN and inf would
    land in the last bin): calibration leaves batches with NaN/inf out of every statistic."""
    bits = x.detach().float().reshape(-1).view(torch.int32) & 0x7FFFFFFF  # |x|, as its bit pattern
    index = bits.bitwise_right_shift_(23 - MANTISSA_BITS).sub_(_FIRST_BIN).clamp_(0, NUM_BINS - 1)
    return torch.bincount(index, minlength=NUM_BINS)


_CALLS = itertools.count()  # orders observer calls, so a fault is reported where it first appears


class TensorObserver:
    """Streaming statistics of one activation: running max |x|, optionally a histogram of |x| and
    the running max |x| of each channel (the last dimension).

    A batch with NaN or inf is left out of every statistic and counted instead (calibration applies
    the --on-nonfinite policy); `last` keeps its amax so that the fault can be named.

    Nothing here waits for the device: whether a batch is finite is a tensor that selects what the
    running statistics keep (torch.where), the histogram is accumulated where the activations are
    and copied to the CPU only when read (`hist`), and `nonfinite` is a count on the device. A
    forward with observers on its layers runs without a host sync per layer (on CUDA, each sync
    stalls the GPU's queue)."""

    def __init__(self, hist: bool = True, channels: bool = False) -> None:
        self.amax: torch.Tensor | None = None  # max over finite batches; None until the first batch
        self._hist: torch.Tensor | None = torch.zeros(NUM_BINS, dtype=torch.int64) if hist else None
        self.channel_amax: torch.Tensor | None = None
        self.channels = channels
        self.calls = 0  # batches seen
        self.nonfinite: int | torch.Tensor = (
            0  # batches with NaN/inf (a tensor on the device once observed)
        )
        self.last: torch.Tensor | None = (
            None  # the latest batch's amax (NaN or inf names the fault)
        )
        self.step = -1  # when it was last called, in the order of all observers' calls

    # The statistics of the last two tensors observed, the latest used first: q/k/v (and gate/up)
    # see the same input tensor, which is then measured once, and so do all experts' gate/up when
    # every token goes through every expert (gate/up of each, on the layer's input, then its
    # down_proj on its own). Held by reference (their memory cannot be reused meanwhile);
    # calibration clears them.
    shared: tuple = ()

    @property
    def hist(self) -> torch.Tensor | None:
        """The histogram's counts, on the CPU (int64, NUM_BINS)."""
        return None if self._hist is None else self._hist.cpu()

    @hist.setter
    def hist(self, value: torch.Tensor | None) -> None:
        self._hist = value

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        a, hist, channel_amax = self._statistics(x)
        self.last, self.calls, self.step = a, self.calls + 1, next(_CALLS)
        finite = torch.isfinite(a)
        self.nonfinite = (~finite).long() + (
            self.nonfinite.to(a.device) if torch.is_tensor(self.nonfinite) else self.nonfinite
        )
        # A batch with NaN/inf leaves every statistic as it was (amax: 0 until a finite batch;
        # finite_batches() says)
        previous = self.amax if self.amax is not None else torch.zeros_like(a)
        self.amax = torch.where(
            finite, torch.maximum(previous.to(a.device), a), previous.to(a.device)
        )
        if self._hist is not None:
            self._hist = self._hist.to(hist.device) + torch.where(finite, hist, 0)
        if self.channels:
            previous = (
                self.channel_amax
                if self.channel_amax is not None
                else torch.zeros_like(channel_amax)
            )
            previous = previous.to(channel_amax.device)
            self.channel_amax = torch.where(finite, torch.maximum(previous, channel_amax), previous)
        return x.detach()

    def _statistics(self, x: torch.Tensor) -> tuple:
        """(amax, histogram, per-channel amax) of x, measured once for the layers that read the same
        tensor: the tensor itself and its version are the key (a detached view would be a new object
        on every call; a tensor written in place, as layer by layer the hidden states are, has a new
        version). An inference tensor has no version: not cached (calibration runs under
        no_grad)."""
        version = None if x.is_inference() else x._version
        # not `hist`: a copy to the host, a device sync
        wants = (
            self._hist is not None,
            self.channels,
        )
        for i, (seen, seen_version, seen_wants, statistics) in enumerate(TensorObserver.shared):
            if seen is x and seen_version == version and seen_wants == wants:
                # the latest used first: it is kept while each expert's down_proj input comes and
                # goes
                if i:
                    TensorObserver.shared = TensorObserver.shared[::-1]
                return statistics
        data = x.detach()
        a = amax(data)
        hist = histogram(data) if self._hist is not None else None  # kept only if finite (observe)
        channel_amax = (
            data.abs().reshape(-1, data.shape[-1]).amax(0).float() if self.channels else None
        )
        statistics = (a, hist, channel_amax)
        if version is not None:
            TensorObserver.shared = ((x, version, wants, statistics), *TensorObserver.shared[:1])
        return statistics

    def __call__(self, module, args: tuple) -> None:  # a forward pre-hook on a Linear
        self.observe(args[0])

    def finite_batches(self) -> int:
        return self.calls - self.nonfinite

    def cpu(self) -> TensorObserver:
        """A copy whose statistics are on the CPU (to be sent to another process: torchrun's
        shares)."""
        copy = TensorObserver(hist=self._hist is not None, channels=self.channels)
        on_cpu = lambda t: t.cpu() if torch.is_tensor(t) else t  # noqa: E731
        copy.amax, copy._hist, copy.channel_amax = (
            on_cpu(self.amax),
            on_cpu(self._hist),
            on_cpu(self.channel_amax),
        )
        copy.calls, copy.nonfinite, copy.last, copy.step = (
            self.calls,
            on_cpu(self.nonfinite),
            on_cpu(self.last),
            self.step,
        )
        return copy

    def merge(self, other: TensorObserver) -> None:
        """Fold in another observer's statistics of the same activation (e.g. from another process
        or shard): the same as if this one had seen its batches too, on this observer's device.
        Observers that keep different statistics (a histogram or per-channel maxima on one only, or
        channels of another count) are refused: the merged statistics would hold part of the
        batches."""
        if (self._hist is None) != (other._hist is None) or self.channels != other.channels:
            raise ValueError(
                "cannot merge observers that keep different statistics (histogram "
                f"{self._hist is not None} / {other._hist is not None}, per-channel amax "
                f"{self.channels} / {other.channels})"
            )
        if self.channel_amax is not None and other.channel_amax is not None:
            if self.channel_amax.shape != other.channel_amax.shape:
                raise ValueError(
                    f"cannot merge per-channel amax of {list(other.channel_amax.shape)} channels "
                    f"into {list(self.channel_amax.shape)}: not the same activation"
                )
        self.calls += other.calls
        self.nonfinite = _fold(self.nonfinite, other.nonfinite, torch.add)
        if other.step > self.step:  # the latest batch names a fault (its amax is NaN or inf)
            self.last, self.step = other.last, other.step
        self._hist = _fold(self._hist, other._hist, torch.add)
        self.amax = _fold(self.amax, other.amax, torch.maximum)
        self.channel_amax = _fold(self.channel_amax, other.channel_amax, torch.maximum)


def _fold(mine, theirs, op):
    """op(mine, theirs) on mine's device; the other one where either is None. A count (op add) may
    be an int."""
    if theirs is None:
        return mine
    if mine is None:
        return theirs.clone()
    if not torch.is_tensor(mine):
        return theirs + mine
    return op(
        mine,
        theirs.to(mine.device)
        if torch.is_tensor(theirs)
        else torch.tensor(theirs, device=mine.device),
    )


def _bin_values(hist: torch.Tensor, amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, weights): SUBSAMPLES representative magnitudes per non-empty bin (spread evenly over
    the bin, capped at amax) and the count each stands for. float64."""
    hist = hist.double()
    nonzero = torch.nonzero(hist).flatten()
    edges = bin_edges()
    lo, width = edges[nonzero], edges[nonzero + 1] - edges[nonzero]
    offsets = (torch.arange(SUBSAMPLES, dtype=torch.float64) + 0.5) / SUBSAMPLES
    values = (lo[:, None] + offsets[None, :] * width[:, None]).clamp(max=max(amax, 0.0))
    weights = (hist[nonzero] / SUBSAMPLES)[:, None].expand_as(values)
    return values.flatten(), weights.flatten()


def clip_errors(
    hist: torch.Tensor, amax: float, clips: torch.Tensor, fmt: NumberFormat
) -> torch.Tensor:
    """Mean squared error of quantizing the histogram's values with scale clip / fmt.max, per
    clip."""
    values, weights = _bin_values(hist, amax)
    if values.numel() == 0:
        return torch.zeros_like(clips, dtype=torch.float64)
    scales = (clips.double() / fmt.max).clamp(min=1e-30).float()[:, None]
    q = fake_quantize(
        values.float()[None, :].expand(len(clips), -1), scales, fmt, saturate=True
    ).double()
    return ((q - values[None, :]) ** 2 * weights[None, :]).sum(1) / weights.sum()


def snr_db(signal_power: float, noise_power: float) -> float | None:
    """10 log10(signal / noise); None where there is no noise (an infinite ratio, which JSON cannot
    hold) or no signal (an all-zero tensor: no ratio to report)."""
    if noise_power <= 0 or signal_power <= 0:
        return None
    return 10.0 * math.log10(signal_power / noise_power)


def sqnr_db(
    hist: torch.Tensor, amax: float, fmt: NumberFormat, clip: float | None = None
) -> float | None:
    """Signal-to-quantization-noise ratio (dB, see snr_db) of the histogram's values quantized with
    clip / fmt.max (clip defaults to amax: plain max calibration)."""
    values, weights = _bin_values(hist, amax)
    if values.numel() == 0 or amax <= 0:
        return None
    signal = float((values**2 * weights).sum() / weights.sum())
    return snr_db(
        signal,
        float(clip_errors(hist, amax, torch.tensor([clip if clip is not None else amax]), fmt)[0]),
    )


def percentile_clip(hist: torch.Tensor, amax: float, percentile: float) -> float:
    """The `percentile`-th percentile of |x| (0 < percentile <= 100), interpolated linearly inside
    its bin, never above amax."""
    hist = hist.double()
    total = float(hist.sum())
    if total == 0 or percentile >= 100:
        return amax
    cdf = torch.cumsum(hist, 0)
    target = total * percentile / 100
    i = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64)).item())
    i = min(i, NUM_BINS - 1)
    below = float(cdf[i - 1]) if i > 0 else 0.0
    fraction = (target - below) / float(hist[i]) if hist[i] > 0 else 1.0
    edges = bin_edges()
    value = float(edges[i] + fraction * (edges[i + 1] - edges[i]))
    return min(value, amax)


def _candidates(amax: float) -> torch.Tensor:
    return amax * torch.exp2(-torch.linspace(0, 8, MSE_CANDIDATES, dtype=torch.float64))


def mse_clip(hist: torch.Tensor, amax: float, fmt: NumberFormat) -> float:
    """The clip (between amax / 256 and amax) whose scale gives the least mean squared error in
    `fmt`."""
    if amax <= 0:
        return amax
    clips = _candidates(amax)
    return float(clips[int(torch.argmin(clip_errors(hist, amax, clips, fmt)))])


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) in nats of two unnormalised histograms; bins where p is 0 contribute nothing."""
    p, q = p.double() / p.sum(), q.double() / q.sum()
    mask = p > 0
    return float((p[mask] * torch.log(p[mask] / q[mask])).sum())


def quantized_histogram(
    hist: torch.Tensor, clip_bin: int, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT's entropy construction, for any grid: P is hist[:clip_bin + 1] with the mass above
    folded into its last bin; Q spreads the mass of each quantization level (bins that round to the
    same grid value, given by `levels`) evenly over that level's non-empty bins, from the unfolded
    slice."""
    sliced = hist[: clip_bin + 1].double()
    p = sliced.clone()
    p[-1] += hist[clip_bin + 1 :].double().sum()
    levels = levels[: clip_bin + 1]
    _, group = torch.unique(levels, return_inverse=True)
    mass = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, sliced)
    nonempty = torch.zeros_like(mass).index_add_(0, group, (sliced > 0).double())
    q = torch.where(sliced > 0, mass[group] / nonempty[group].clamp(min=1), 0.0)
    return p, q


def entropy_clip(hist: torch.Tensor, amax: float, fmt: NumberFormat) -> float:
    """The clip (a bin's upper edge) minimising KL(P || Q) between the histogram and its quantized
    version."""
    if amax <= 0 or hist.sum() == 0:
        return amax
    edges = bin_edges()
    centers = (edges[:-1] + edges[1:]) / 2
    top = int(torch.nonzero(hist).max())
    best, best_kl = amax, math.inf
    for clip_bin in range(max(0, top - 8 * BINS_PER_OCTAVE), top + 1):
        clip = min(float(edges[clip_bin + 1]), amax)
        levels = fake_quantize(centers.float(), clip / fmt.max, fmt, saturate=True)
        p, q = quantized_histogram(hist, clip_bin, levels)
        if q.sum() == 0:
            continue
        kl = kl_divergence(p, q)
        if kl < best_kl:
            best, best_kl = clip, kl
    return best


def choose_clip(
    method: str,
    hist: torch.Tensor | None,
    amax: float,
    fmt: NumberFormat,
    percentile: float = 99.99,
) -> tuple[str, float]:
    """(method used, clip) for one activation. `best` tries max, percentile and mse and keeps the
    one with the lowest mean squared error on the calibration histogram. An amax at or above the
    histogram's top (2^MAX_EXPONENT, where the last bin gathers values it cannot place): the max."""
    if method == "max" or hist is None or amax >= 2.0**MAX_EXPONENT:
        return "max", amax
    if method == "percentile":
        return method, percentile_clip(hist, amax, percentile)
    if method == "mse":
        return method, mse_clip(hist, amax, fmt)
    if method == "entropy":
        return method, entropy_clip(hist, amax, fmt)
    if method != "best":
        raise ValueError(f"unknown observer '{method}'")
    options = {
        "max": amax,
        "percentile": percentile_clip(hist, amax, percentile),
        "mse": mse_clip(hist, amax, fmt),
    }
    errors = clip_errors(hist, amax, torch.tensor(list(options.values()), dtype=torch.float64), fmt)
    name = list(options)[int(torch.argmin(errors))]
    return name, options[name]
