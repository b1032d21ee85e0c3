"""Plots for report.md, drawn from results.json alone (PNG, matplotlib, no pyplot global state).

    <stem>-metrics.png     each metric per recipe, with intervals where the results carry them,
                           and gate limits
    <stem>-layer-amax.png  per-layer input and weight amax (log scale) against each variant
                           format's max
    <stem>-layer-snr.png   per-layer quantization SNR (dB) of weights and inputs, one line per
                           variant

File names are fixed by the report's name, so a rerun replaces its plots; the PNG carries no
version or date, so the same results give the same bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from ptq.numerics.formats import get_format
from ptq.reporting.gates import NEXT_TOKEN
from ptq.reporting.results import CompareResults, Entry, Limits

PLOT_NAMES = ("metrics", "layer-amax", "layer-snr")
TITLES = {
    "metrics": "Metrics per recipe",
    "layer-amax": "Per-layer amax against each format's max",
    "layer-snr": "Per-layer quantization SNR",
}
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def plot_paths(report: Path) -> dict[str, Path]:
    """Where each plot of `report` goes: next to it, named after it."""
    return {name: report.with_name(f"{report.stem}-{name}.png") for name in PLOT_NAMES}


def available(results: CompareResults) -> list[str]:
    """The plots this results file has data for."""
    names = ["metrics"]
    if results.calibration and results.calibration.layers:
        names.append("layer-amax")
    if any(v.snr_db for v in results.variants):
        names.append("layer-snr")
    return names


def plot_writers(results: CompareResults, report: Path) -> dict[Path, Callable[[Path], None]]:
    """Every available plot next to `report`: its path, and the function that draws it into a
    (temporary) file (ptq.files.write_set_atomic writes them with the report, as one set)."""
    paths = plot_paths(Path(report))
    draw = {"metrics": metrics_figure, "layer-amax": amax_figure, "layer-snr": snr_figure}

    def writer(name: str) -> Callable[[Path], None]:
        return lambda tmp: draw[name](results).savefig(
            tmp, format="png", dpi=100, metadata={"Software": None}
        )

    return {paths[name]: writer(name) for name in available(results)}


def _figure(width: float, height: float, rows: int = 1, cols: int = 1):
    from matplotlib.figure import Figure

    # Fixed margins, sized for these figures' labels: a layout engine would cost more than the
    # drawing.
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=0.07,
        right=0.985,
        bottom=0.12 if rows == 1 else 0.06,
        top=0.9,
        hspace=0.35,
        wspace=0.15,
    )
    return fig, fig.subplots(rows, cols, squeeze=False).ravel()


def _block_ticks(ax, layers: list[str]) -> None:
    """Tick each transformer block's first Linear with the block number (names like
    model.layers.7.mlp)."""
    ticks, labels, seen = [], [], set()
    for i, name in enumerate(layers):
        m = re.search(r"\.(\d+)\.", name)
        if m and m.group(1) not in seen:
            seen.add(m.group(1))
            ticks.append(i)
            labels.append(m.group(1))
    step = max(1, len(ticks) // 16)
    ax.set_xticks(ticks[::step], labels[::step])
    ax.set_xlabel(
        "transformer block (Linear layers in model order)"
        if ticks
        else "Linear layer (model order)"
    )


def metrics_figure(results: CompareResults):
    base, variants = results.baseline, results.variants
    entries = [base, *variants]
    names = [e.name for e in entries]
    limits = results.gates.limits if results.gates else Limits()
    panels = [
        ("perplexity", "perplexity (lower is better)", 1.0),
        ("accuracy", "next-token accuracy (%)", 100.0),
        ("kl_div", f"KL vs {base.name} (nats/token)", 1.0),
        ("top1_agreement", f"top-1 agreement with {base.name} (%)", 100.0),
    ]
    # The names under the bars, side by side, must not run together: a character is about 0.6 of the
    # font size wide and each bar has 4.6 inches (a panel) / bars; the font shrinks to fit, down to
    # 6 points, below which the names stand upright in 8 points, the figure taller by their length
    # under each row of panels.
    longest = max(map(len, names))
    fit = 0.85 * 4.6 / len(names) / (0.6 / 72 * longest)
    upright = fit < 6
    tick_size = 8 if upright else min(10.0, fit)
    if upright:
        names_in = 0.6 * 8 / 72 * longest + 0.15  # the upright names' height, inches
        height = 6.5 + 2 * names_in
        fig, axes = _figure(11, height, 2, 2)
        # each row's height, inches
        axes_in = (0.9 * height - (0.4 + names_in) - (0.5 + names_in)) / 2
        fig.subplots_adjust(bottom=(0.4 + names_in) / height, hspace=(0.5 + names_in) / axes_in)
    else:
        fig, axes = _figure(11, 6.5, 2, 2)
    for ax, (key, label, factor) in zip(axes, panels):
        # the baseline has no KL or agreement
        rows = [(i, e) for i, e in enumerate(entries) if hasattr(e, key)]
        xs = [i for i, _ in rows]
        values = [factor * getattr(e, key) for _, e in rows]
        # A bar of inf (a collapsed variant's perplexity) or NaN cannot be drawn: height 0, its
        # value written on it. An interval that is not there (NaN ends: too few windows) or not
        # finite: no error bar.
        ys = [y if math.isfinite(y) else 0.0 for y in values]
        err = [[0.0] * len(rows), [0.0] * len(rows)]
        for j, (_, e) in enumerate(rows):
            value, (low, high) = getattr(e, key), getattr(e, f"{key}_ci")
            if all(map(math.isfinite, (value, low, high))):
                err[0][j], err[1][j] = factor * value - factor * low, factor * high - factor * value
        ax.bar(
            xs,
            ys,
            color=[COLORS[i % len(COLORS)] for i in xs],
            yerr=err if any(map(any, err)) else None,
            capsize=4,
        )
        for x, y, value in zip(xs, ys, values):
            ax.annotate(
                f"{value:.4g}",
                (x, y),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        limit = _limit_line(key, base, limits)
        if limit is not None:
            ax.axhline(factor * limit, color="#c44e52", linestyle="--", linewidth=1, label="gate")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=tick_size, rotation=90 if upright else 0)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.15)
    fig.suptitle(
        f"{results.model.name}: {results.eval.windows} windows x {results.eval.seq_len} tokens; "
        "bars show 95% intervals",
        fontsize=11,
    )
    return fig


def _limit_line(key: str, base: Entry, limits: Limits) -> float | None:
    if key == "perplexity" and limits.max_ppl_increase_pct is not None:
        return base.perplexity * (1 + limits.max_ppl_increase_pct / 100)
    # next-token accuracy is gated by its own limit (`next-token=P%`) where given, as the checks
    # judge it
    recovery = limits.task_accuracy_recovery_pct.get(NEXT_TOKEN, limits.min_accuracy_recovery_pct)
    if key == "accuracy" and recovery is not None:
        return base.accuracy * recovery / 100
    if key == "kl_div" and limits.max_kl is not None:
        return limits.max_kl
    return None


def amax_figure(results: CompareResults):
    layers = results.calibration.layers
    names = [row.layer for row in layers]
    fig, (ax,) = _figure(11, 4.5)
    xs = range(len(layers))
    ax.plot(
        xs,
        [row.input_amax for row in layers],
        "o-",
        markersize=3,
        linewidth=1,
        color=COLORS[0],
        label="input amax",
    )
    ax.plot(
        xs,
        [row.weight_amax for row in layers],
        "s-",
        markersize=3,
        linewidth=1,
        color=COLORS[1],
        label="weight amax",
    )
    formats = []
    for v in results.variants:
        for part in (v.recipe.weights, v.recipe.inputs):
            fmt = part.split()[0]
            if fmt not in formats and get_format(fmt).scaled:
                formats.append(fmt)
    for i, fmt in enumerate(formats):
        ax.axhline(
            get_format(fmt).max,
            color=COLORS[(i + 3) % len(COLORS)],
            linestyle="--",
            linewidth=1,
            label=f"{fmt} max ({get_format(fmt).max:g})",
        )
    ax.set_yscale("log")
    ax.set_ylabel("amax = max |x| (log scale)")
    _block_ticks(ax, names)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(
        "Per-layer amax from calibration; a static per-tensor scale maps each amax onto the "
        "format's max (without a scale, values above the max would saturate)",
        fontsize=9,
    )
    return fig


def snr_figure(results: CompareResults):
    fig, (ax,) = _figure(11, 4.5)
    order: list[str] = []
    for v in results.variants:
        for layers in (v.snr_db.weights, v.snr_db.inputs) if v.snr_db else ():
            order += [n for n in layers if n not in order]
    index = {n: i for i, n in enumerate(order)}
    windows = None
    for i, v in enumerate(results.variants):
        snr = v.snr_db
        if not snr:
            continue
        windows = snr.input_windows
        for part, layers, style in (("weights", snr.weights, "s-"), ("inputs", snr.inputs, "o--")):
            points = [(index[n], db) for n, db in layers.items() if db is not None]
            if points:
                ax.plot(
                    *zip(*points),
                    style,
                    markersize=3,
                    linewidth=1,
                    color=COLORS[(i + 1) % len(COLORS)],
                    label=f"{v.name} {part}",
                )
    ax.set_ylabel("SNR (dB, higher is better)")
    _block_ticks(ax, order)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(
        "Quantization SNR per layer: weights; inputs on each variant's own activations over the "
        f"first {windows} evaluation windows",
        fontsize=9,
    )
    return fig
