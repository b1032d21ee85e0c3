"""How far does a variant's measured perplexity move when its calibrated scales move in their sixth digit?

Calibrates once, then evaluates each recipe with the calibration as it is and, `--repeats` times, with
every calibrated amax multiplied by (1 + 1e-6 * N(0, 1)): a change far below anything calibration can
resolve, which only moves which values round up and which round down. The spread it causes is the part
of a perplexity delta that no choice of windows explains (the report's bootstrap interval is over
windows); see docs/paper.md, "Noise beyond the intervals".

    .venv/bin/python examples/rounding_noise.py smollm2 fp8-e4m3,int8-smoothquant,paper-e4m3 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from ptq.calibration.calibrate import Calibration, calibrate
from ptq.calibration.clips import quantize_variants
from ptq.evaluation.data import load_corpus, make_windows
from ptq.evaluation.evaluate import evaluate
from ptq.models.loading import load_model
from ptq.quantization.engines import DEFAULT_TARGET
from ptq.quantization.plan import calibration_targets, resolve_plans
from ptq.quantization.recipes import load_recipe


def nudged(calibration: Calibration, seed: int, relative: float = 1e-6) -> Calibration:
    """A copy with every calibrated amax (per tensor and per channel) moved by `relative` x N(0, 1)."""
    moved = copy.deepcopy(calibration)
    generator = torch.Generator().manual_seed(seed)
    for stats in (moved.input_amax, moved.input_channel_amax):
        for name, amax in stats.items():
            stats[name] = amax * (1 + relative * torch.randn(amax.shape, generator=generator))
    return moved


def measure(
    model: str,
    recipes: list[str],
    repeats: int,
    windows: int,
    calib_samples: int,
    seq_len: int,
    calib_data: str | None = None,
    eval_data: str | None = None,
) -> dict[str, list[dict]]:
    """{recipe: [{"ppl_delta_pct", "kl_div"} as calibrated, then one per nudged calibration]}."""
    loaded = load_model(model)
    variants = [load_recipe(r) for r in recipes]
    layers, channels = calibration_targets(resolve_plans(loaded.model, variants).values())
    calib_ids = make_windows(
        load_corpus(calib_data, "calibration"), loaded.tokenizer, seq_len, calib_samples
    ).input_ids
    calibration = calibrate(loaded.model, calib_ids, layers, channels=channels)
    eval_ids = make_windows(
        load_corpus(eval_data, "evaluation"), loaded.tokenizer, seq_len, windows
    ).input_ids
    rows: dict[str, list[dict]] = {r.name: [] for r in variants}
    for repeat in range(repeats + 1):
        used = calibration if repeat == 0 else nudged(calibration, repeat)
        scores = evaluate(
            quantize_variants(
                loaded.model, [load_recipe("bf16"), *variants], used, target=DEFAULT_TARGET
            ),
            eval_ids,
        )  # as `ptq compare` quantizes by default
        base = scores["bf16"].perplexity
        for r in variants:
            rows[r.name].append(
                {
                    "ppl_delta_pct": 100 * (scores[r.name].perplexity / base - 1),
                    "kl_div": scores[r.name].kl_div,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("recipes", help="comma-separated recipe names or .yaml paths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-data")
    parser.add_argument("--eval-data")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args()
    rows = measure(
        args.model,
        args.recipes.split(","),
        args.repeats,
        args.windows,
        args.calib_samples,
        args.seq_len,
        args.calib_data,
        args.eval_data,
    )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        "| recipe | Δ ppl as calibrated | Δ ppl, nudged (min..max) | KL as calibrated | KL, nudged (min..max) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, runs in rows.items():
        d, kl = [r["ppl_delta_pct"] for r in runs], [r["kl_div"] for r in runs]
        print(
            f"| {name} | {d[0]:+.2f}% | {min(d[1:], default=d[0]):+.2f}% .. {max(d[1:], default=d[0]):+.2f}% "
            f"| {kl[0]:.4f} | {min(kl[1:], default=kl[0]):.4f} .. {max(kl[1:], default=kl[0]):.4f} |"
        )


if __name__ == "__main__":
    main()
