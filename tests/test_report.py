"""Reports for CI and people: gates and their exit codes, `ptq report`, trends, plots, per-layer SNR,
`ptq inspect`, --json and --help. One tiny-model compare is shared by most tests."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from ptq.evaluation.recovery import accuracy_recovery_pct
from ptq.reporting.gates import Limits, check, parse_limits
from ptq.reporting.report import render_markdown


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    from conftest import TEXT

    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 3)
    return path


@pytest.fixture(scope="module")
def compared(tiny_model, small_text, tmp_path_factory) -> Path:
    """One compare of the tiny model with a KL gate that must fail (any quantization moves KL above 0)
    and a perplexity gate that must pass."""
    from ptq import progress
    from ptq.commands.compare import run_compare
    from ptq.commands.options import CalibrationOptions, DataOptions, ModelOptions, OutputOptions

    out = tmp_path_factory.mktemp("compare") / "out"
    progress.QUIET = True
    try:
        run_compare(
            ["fp8-e4m3", "int8"],
            model=ModelOptions(model=str(tiny_model)),
            data=DataOptions(data=str(small_text), seq_len=64, windows=8),
            calibration=CalibrationOptions(data=str(small_text), samples=4, seq_len=64),
            output=OutputOptions(path=out, limits=parse_limits("50%", None, "0")),
        )
    finally:
        progress.QUIET = False
    return out


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def table_row(markdown: str, name: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {name}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


# --- gates: pure semantics on hand-made results ---------------------------------------------------


def results_with(ppl_delta: float, acc: float, kl: float, tasks=None, base_tasks=None):
    """Typed results of one variant `v` against a baseline of accuracy 0.5 (tests/sample_results.py)."""
    from sample_results import baseline, compare_results, variant

    return compare_results(
        baseline(accuracy=0.5, tasks=base_tasks), [variant("v", ppl_delta, acc, kl, tasks)]
    )


def test_gate_limits_are_inclusive_and_recovery_is_a_ratio():
    limits = parse_limits("2%", ["99%"], "0.01")
    assert limits == Limits(2.0, 99.0, {}, 0.01)
    at_limit = check(results_with(2.0, 0.495, 0.01), limits)  # 0.495 / 0.5 = 99% recovery
    assert [(c.metric, c.passed) for c in at_limit] == [
        ("ppl_delta_pct", True),
        ("accuracy_recovery_pct", True),
        ("kl_div", True),
    ]
    assert at_limit[1].value == pytest.approx(99.0)
    # a share that is no count's (4e-08 read as the fraction 0 divided by 0): the floats' own ratio
    assert (
        accuracy_recovery_pct(2e-08, 4e-08) == 50.0
        and accuracy_recovery_pct(99 / 104, 100 / 104) == 99.0
    )
    beyond = check(results_with(2.01, 0.494, 0.0101), limits)
    assert [c.passed for c in beyond] == [False, False, False]
    assert "perplexity +2.01% > +2%" in beyond[0].describe()


def test_per_task_gates_default_override_and_missing_task_fails():
    from sample_results import task_scores

    tasks, base_tasks = task_scores(piqa=0.6, arc_easy=0.45), task_scores(piqa=0.62, arc_easy=0.5)
    limits = parse_limits(None, ["95%", "arc_easy=90%", "hellaswag=99%"], None)
    checks = {c.task: c for c in check(results_with(0, 0.5, 0, tasks, base_tasks), limits)}
    assert checks["next-token"].passed and checks["next-token"].limit == 95
    assert checks["piqa"].value == pytest.approx(100 * 0.6 / 0.62) and checks["piqa"].passed
    assert (
        checks["arc_easy"].limit == 90 and checks["arc_easy"].passed
    )  # 90% recovery: passes its own limit only
    assert checks["hellaswag"].value is None and not checks["hellaswag"].passed


@pytest.mark.parametrize(
    "args, message",
    [
        (("--max-ppl-increase", "0.02"), "takes a percentage such as 2%"),
        (("--min-accuracy-recovery", "ninety%"), "is not a percentage"),
        (("--max-kl", "-1"), "non-negative"),
        (("--min-accuracy-recovery", "99%", "--min-accuracy-recovery", "98%"), "give one limit"),
        (
            (
                "--min-accuracy-recovery",
                "next-token=99%",
                "--min-accuracy-recovery",
                "next-token=0%",
            ),
            "--min-accuracy-recovery sets next-token twice (99%, 0%): give one",
        ),
    ],
)
def test_bad_gate_values_exit_2_with_one_line(ptq_cli, compared, args, message):
    code, out, err = ptq_cli("report", compared / "results.json", *args)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_report_refuses_a_gate_on_a_task_the_results_do_not_hold(ptq_cli, compared):
    code, out, err = ptq_cli(
        "report", compared / "results.json", "--min-accuracy-recovery", "hellaswag=99%"
    )
    assert code == 2 and out == ""
    assert (
        "names task 'hellaswag', which" in err
        and "(it has next-token)" in err
        and len(err.splitlines()) == 1
    )
    code, out, _ = ptq_cli(
        "report", compared / "results.json", "--min-accuracy-recovery", "next-token=0%"
    )
    assert code == 0 and "gate checks pass" in out


def task_info(
    name: str, higher_is_better: dict[str, bool], n: int = 100, sha: str = "a" * 64, shots: int = 0
):
    from ptq.reporting.results import TaskInfo

    return TaskInfo(
        name=name,
        kind="multiple_choice",
        n=n,
        metrics=list(higher_is_better),
        higher_is_better=higher_is_better,
        num_fewshot=shots,
        group=None,
        source="by hand",
        notes=[],
        chance=None,
        documents_sha256=sha,
    )


def scores(n: int = 100, half_width: float = 0.02, **values: float):
    from ptq.reporting.results import TaskMetric, TaskScores

    return TaskScores(
        n=n,
        metrics={
            k: TaskMetric(value=v, stderr=0.01, ci=(v - half_width, v + half_width))
            for k, v in values.items()
        },
    )


def test_lower_is_better_task_metrics_follow_the_recorded_direction():
    """lm-eval records higher_is_better per task (crows_pairs_english: likelihood_diff and pct_stereotype, both
    False); the gates, the trend and the report follow it rather than guessing from the metric's name."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.evaluation.recovery import higher_is_better
    from ptq.reporting.report import tasks_section, trend_section
    from ptq.reporting.trend import trend

    crows = task_info("crows_pairs_english", {"likelihood_diff": False, "pct_stereotype": False})
    mixed = task_info("mytask", {"acc": True, "error_rate": False})

    def run(crows_values: dict, mytask_values: dict):
        return compare_results(
            baseline(
                tasks={
                    "crows_pairs_english": scores(likelihood_diff=3.55, pct_stereotype=0.60),
                    "mytask": scores(acc=0.8, error_rate=0.2),
                }
            ),
            [
                variant(
                    "fp8",
                    tasks={
                        "crows_pairs_english": scores(**crows_values),
                        "mytask": scores(**mytask_values),
                    },
                )
            ],
        )

    more_biased = dataclasses.replace(
        run({"likelihood_diff": 4.10, "pct_stereotype": 0.66}, {"acc": 0.8, "error_rate": 0.3}),
        tasks=[crows, mixed],
    )
    checks = check(more_biased, Limits(min_accuracy_recovery_pct=99.0))
    # only next-token accuracy and mytask's acc are accuracies; a higher error rate or bias is never "115% recovery"
    assert [(c.task, c.task_metric) for c in checks] == [("next-token", None), ("mytask", "acc")]
    assert all(c.passed for c in checks)
    # a limit on a task none of whose metrics is an accuracy cannot pass silently
    (crows_check,) = [
        c for c in check(more_biased, parse_limits(None, ["crows_pairs_english=99%"], None))
    ]
    assert crows_check.value is None and not crows_check.passed
    # where the results record no direction, lm-eval's lower-is-better names still decide
    assert higher_is_better("acc") and not higher_is_better("word_perplexity")
    assert not higher_is_better("exact_match,strict-match", {"exact_match": False})

    # the trend: lower values are better, and a metric in nats is not a percentage
    less_biased = dataclasses.replace(
        run({"likelihood_diff": 3.20, "pct_stereotype": 0.54}, {"acc": 0.8, "error_rate": 0.1}),
        tasks=[crows, mixed],
    )
    t = trend(more_biased, less_biased)
    moves = {(m.entry, m.task): m for m in t["moves"] if m.task}
    for task in (
        "crows_pairs_english likelihood_diff",
        "crows_pairs_english pct_stereotype",
        "mytask error_rate",
    ):
        assert (
            moves[("fp8", task)].beyond_intervals and moves[("fp8", task)].worse
        )  # it rose: worse
        assert moves[("fp8", task)].to_json()["better"] == "lower"
    assert moves[("fp8", "crows_pairs_english likelihood_diff")].share is False
    lines = trend_section(t, less_biased)
    row = next(
        line for line in lines if line.startswith("| fp8 | crows_pairs_english likelihood_diff")
    )
    assert row == (
        "| fp8 | crows_pairs_english likelihood_diff (lower is better) | 3.2000 [3.1800, 3.2200] "
        "| 4.1000 [4.0800, 4.1200] | +0.9000 | ⚠️ worse |"
    )
    row = next(line for line in lines if line.startswith("| fp8 | mytask error_rate"))
    assert "| 10.00% [8.00%, 12.00%] | 30.00% [28.00%, 32.00%] | +20.00 points | ⚠️ worse |" in row
    assert (
        trend(less_biased, more_biased)["moves"][-1].worse is False
    )  # fp8's error_rate fell: better

    # the report: nats as they are, shares as percentages, the direction named
    lines = tasks_section(more_biased)
    row = next(
        line
        for line in lines
        if line.startswith("| crows_pairs_english | likelihood_diff") and "fp8" in line
    )
    assert "| likelihood_diff (lower is better) |" in row and "| 4.1000 | [4.0800, 4.1200] |" in row
    assert "%" not in row.replace(
        "| recovery |", ""
    )  # no percentage but the (absent) recovery column
    row = next(
        line
        for line in lines
        if line.startswith("| crows_pairs_english | pct_stereotype") and "fp8" in line
    )
    assert "| 66.00% | [64.00, 68.00] |" in row
    assert (
        "In their own units, not percentages (values, intervals and deltas): crows_pairs_english likelihood_diff."
        in lines
    )


def test_console_task_table_prints_a_metric_in_its_own_units():
    import dataclasses
    import io

    from rich.console import Console
    from sample_results import baseline, compare_results, variant

    from ptq.cli import _print_tasks

    crows = task_info("crows_pairs_english", {"likelihood_diff": False, "pct_stereotype": False})
    r = dataclasses.replace(
        compare_results(
            baseline(
                tasks={"crows_pairs_english": scores(likelihood_diff=3.55, pct_stereotype=0.6)}
            ),
            [
                variant(
                    "fp8",
                    tasks={"crows_pairs_english": scores(likelihood_diff=4.1, pct_stereotype=0.66)},
                )
            ],
        ),
        tasks=[crows],
    )
    out = io.StringIO()
    _print_tasks(Console(file=out, width=400), r, [r.baseline, *r.variants])
    text = out.getvalue()
    assert (
        "3.550 [3.530, 3.570]" in text and "4.100 [4.080, 4.120]" in text and "355.0%" not in text
    )
    assert "60.0% [58.0, 62.0]" in text and "likelihood_diff (lower is better)" in text


def test_a_variant_exactly_at_the_accuracy_recovery_limit_passes():
    """Limits are inclusive (docs/reports.md): 99 right of 104 tokens against the baseline's 100 is a recovery of
    exactly 99%, and passes --min-accuracy-recovery 99%, where the float quotient of the two accuracies reads
    98.99999999999999%. Every ratio of counts that is a whole percentage comes out as exactly that number."""
    from fractions import Fraction

    from sample_results import baseline, compare_results, variant

    from ptq.evaluation.recovery import accuracy_recovery_pct

    assert 100 * ((99 / 104) / (100 / 104)) < 99  # what the plain quotient says
    assert accuracy_recovery_pct(99 / 104, 100 / 104) == 99.0
    results = compare_results(baseline(accuracy=100 / 104), [variant("fp8", accuracy=99 / 104)])
    (c,) = check(results, parse_limits(min_accuracy_recovery=["99%"]))
    assert c.passed and c.value == 99.0 and "recovery 99.00% >= 99%" in c.describe()
    assert not check(results, parse_limits(min_accuracy_recovery=["99.01%"]))[0].passed
    for n in range(1, 400):
        for correct in range(1, n + 1):
            for pct in (90, 95, 98, 99):
                if (
                    correct * pct % 100 == 0
                ):  # the variant has exactly pct% of the baseline's right answers
                    assert accuracy_recovery_pct(correct * pct // 100 / n, correct / n) == pct
    assert accuracy_recovery_pct(0.7231, 0.7519) == float(100 * Fraction(7231, 7519))


def test_a_nan_never_passes_a_gate():
    from ptq.evaluation.recovery import accuracy_recovery_pct

    assert math.isnan(accuracy_recovery_pct(0.3, float("nan"))) and math.isnan(
        accuracy_recovery_pct(float("nan"), 0.5)
    )
    assert (
        accuracy_recovery_pct(0.3, 0.0) == 100.0
    )  # a zero baseline cannot be fallen short of, as documented
    from sample_results import baseline, compare_results, variant

    nan = float("nan")
    limits = parse_limits("2%", ["99%"], "0.01")
    for r in (
        compare_results(baseline(accuracy=nan), [variant(accuracy=0.01)]),
        compare_results(baseline(), [variant(ppl_delta_pct=nan, accuracy=nan, kl_div=nan)]),
    ):
        checks = {c.metric: c for c in check(r, limits)}
        assert not checks["accuracy_recovery_pct"].passed
        assert "recovery nan% is not >= 99%" in checks["accuracy_recovery_pct"].describe()
    assert not checks["ppl_delta_pct"].passed and not checks["kl_div"].passed
    assert checks["kl_div"].describe() == "v: KL nan is not <= 0.01"
    # a variant whose perplexity is not a number, under an accuracy gate only that its accuracy meets: it fails, and
    # the report says why and marks its perplexity
    import dataclasses

    from ptq.reporting.gates import gate_results
    from ptq.reporting.report import render_markdown

    for broken in (nan, math.inf):
        v = dataclasses.replace(
            variant(accuracy=0.5), perplexity=broken, ppl_delta_pct=broken, kl_div=broken
        )
        r = compare_results(baseline(), [v, variant("ok")])
        r = dataclasses.replace(r, gates=gate_results(r, parse_limits(None, ["99%"], None)))
        assert not r.gates.passed
        assert [(c.variant, c.metric) for c in r.gates.checks if not c.passed] == [
            ("v", "finite_outputs")
        ]
        md = render_markdown(r)
        assert (
            f"- ❌ v: perplexity {broken} (NaN or inf logits): a model whose outputs are not numbers"
            in md
        )
        assert table_row(md, "v ❌")[3] == f"**{broken:.4f}** ❌" and "ok ✅ |" in md


def test_a_value_beyond_its_limit_never_prints_as_the_limit():
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.gates import gate_results
    from ptq.reporting.report import render_markdown

    r = compare_results(
        baseline(), [variant("v", ppl_delta_pct=2.004, accuracy=0.49498, kl_div=4e-6)]
    )
    r = dataclasses.replace(r, gates=gate_results(r, parse_limits("2%", ["99%"], "1e-6")))
    md = render_markdown(r)
    # 100 * 0.49498 / 0.5 = 98.996% recovery: .2f would print 99.00% against the 99% limit
    assert "- ❌ v: perplexity +2.004% > +2%" in md
    assert "- ❌ v: next-token accuracy recovery 98.996% < 99%" in md
    assert "- ❌ v: KL 4e-06 > 1e-06" in md
    row = table_row(md, "v ❌")
    assert (row[4], row[6], row[7]) == ("**+2.004%** ❌", "**98.996%** ❌", "**0.0000040** ❌")
    # ordinary values, away from their limits (or with no limit), print as before
    r2 = compare_results(
        baseline(), [variant("v", ppl_delta_pct=3.0, accuracy=0.45, kl_div=0.0123)]
    )
    r2 = dataclasses.replace(r2, gates=gate_results(r2, parse_limits("2%", ["99%"], "0.01")))
    assert table_row(render_markdown(r2), "v ❌")[4:8] == [
        "**+3.00%** ❌",
        "45.00%",
        "**90.00%** ❌",
        "**0.01230** ❌",
    ]
    from ptq.reporting.results import fmt_against

    assert fmt_against(2.004, None, "+.2f") == "+2.00" and fmt_against(2.0, 2.0, "+.2f") == "+2.00"
    assert fmt_against(1.00001e-6, 1e-6, ".4g") == "1.00001e-06"
    assert fmt_against(1.996, 2.0, "+.2f") == "+1.996"  # passing, still not printed as the limit


# --- compare with gates, through the CLI --------------------------------------------------------


def test_compare_failing_gate_exits_1_marks_cells_and_still_writes(
    ptq_run, tiny_model, small_text, tmp_path
):
    out = tmp_path / "out"
    code, stdout, _ = ptq_run(
        "compare",
        tiny_model,
        seq_len=64,
        max_windows=8,
        batch_size=4,
        out=out,
        eval_data=small_text,
        calib_data=small_text,
        max_kl=0,
        max_ppl_increase="50%",
        no_plots=True,
        json=True,
    )
    assert code == 1
    results = json.loads(stdout)  # --json: the results file's content on stdout
    assert results == load(out / "results.json")
    assert results["gates"]["passed"] is False
    kl_checks = [c for c in results["gates"]["checks"] if c["metric"] == "kl_div"]
    assert {c["variant"] for c in kl_checks} == {"fp8-e4m3", "int8"} and not any(
        c["passed"] for c in kl_checks
    )
    report = (out / "report.md").read_text()
    assert report.splitlines()[2].startswith(
        "❌ **2 of 4 gate checks fail** (fp8-e4m3, int8)"
    )  # KL fails, ppl passes
    for name in ("fp8-e4m3", "int8"):
        row = table_row(report, name)
        assert row[0] == f"{name} ❌"
        assert row[7].startswith("**") and row[7].endswith("❌")  # the KL cell
        assert "❌" not in row[4]  # the Δ ppl cell passed
    assert not list(out.glob("*.png"))  # --no-plots


def test_compare_passing_gates_exit_0(compared, ptq_cli, tmp_path):
    # Same numbers re-judged by `ptq report` with limits they meet: exit 0 and every row marked as passing.
    code, out, _ = ptq_cli(
        "report",
        compared / "results.json",
        "--max-kl",
        "1",
        "--max-ppl-increase",
        "50%",
        "--min-accuracy-recovery",
        "50%",
    )
    assert code == 0
    assert out.splitlines()[2].startswith("✅ **All 6 gate checks pass**")
    assert table_row(out, "int8")[0] == "int8 ✅"


def test_stored_gates_are_rerendered_and_exit_1(compared, ptq_cli):
    code, out, _ = ptq_cli("report", compared / "results.json")
    assert code == 1  # the KL gate stored by compare still fails
    assert "❌ fp8-e4m3: KL" in out and "❌ int8: KL" in out
    # Without plots, `ptq report` prints the same markdown as compare wrote, minus the plot section.
    without_plots = re.sub(
        r"<details open><summary><b>Plots</b></summary>.*?</details>\n\n",
        "",
        (compared / "report.md").read_text(),
        flags=re.S,
    )
    assert out == without_plots


# --- the results file carries what the plots need -----------------------------------------------


def test_results_carry_per_layer_amax_in_model_order(compared, tiny_model):
    from transformers import AutoModelForCausalLM

    results = load(compared / "results.json")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    linear = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    layers = results["calibration"]["layers"]
    assert [row["layer"] for row in layers] == linear
    modules = dict(model.named_modules())
    for row in layers:
        assert row["weight_amax"] == pytest.approx(
            modules[row["layer"]].weight.abs().max().item(), rel=1e-6
        )
        assert row["input_amax"] > 0
    top = results["calibration"]["summary"]["largest"][0]
    assert top["input_amax"] == max(row["input_amax"] for row in layers)


def reference_snr(x: np.ndarray, x_q: np.ndarray) -> float:
    x, x_q = x.astype(np.float64), x_q.astype(np.float64)
    return 10 * math.log10((x**2).sum() / ((x - x_q) ** 2).sum())


def test_compiled_signal_and_noise_powers_match_numpy():
    from ptq.evaluation.layerstats import _powers
    from ptq.quantization.quantize import fused

    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 700, 96)).astype(np.float32) * 5
    x_q = x + rng.normal(size=x.shape).astype(np.float32) * 0.01
    signal, noise = fused(_powers, compile=True)(
        torch.from_numpy(x), torch.from_numpy(x_q)
    ).tolist()
    assert signal == pytest.approx((x.astype(np.float64) ** 2).sum(), rel=1e-12)
    assert noise == pytest.approx(((x.astype(np.float64) - x_q) ** 2).sum(), rel=1e-12)


def test_weight_and_input_snr_match_an_independent_reference(tiny_model):
    """E4M3 per-tensor through ml_dtypes' cast, int8 per-channel through numpy (plain, and SmoothQuant's W * s
    against W * s), against ptq.evaluation.layerstats."""
    from ptq.calibration.calibrate import calibrate
    from ptq.calibration.clips import quantize_variants
    from ptq.evaluation.evaluate import evaluate
    from ptq.evaluation.layerstats import input_snr_db, layer_snr, weight_snr_db
    from ptq.models.loading import load_model
    from ptq.quantization.plan import calibrated_layers, resolve_plan
    from ptq.quantization.recipes import load_recipe

    loaded = load_model(str(tiny_model), device=torch.device("cpu"))
    model = loaded.model
    ids = torch.randint(0, 300, (6, 32), generator=torch.Generator().manual_seed(0))
    recipes = [load_recipe("fp8-e4m3"), load_recipe("int8"), load_recipe("int8-smoothquant")]
    cal = calibrate(
        model,
        ids,
        sorted(calibrated_layers(model, recipes[0])),
        channels=resolve_plan(model, recipes[2]).smoothed,
    )
    models = quantize_variants(model, [load_recipe("bf16"), *recipes], cal)
    quantized = {r.name: models[r.name] for r in recipes}
    name = "model.layers.1.mlp.down_proj"
    captured = []  # the E4M3 variant's own input to that layer, over the first 4 windows
    hook = (
        quantized["fp8-e4m3"]
        .get_submodule(name)
        .register_forward_pre_hook(lambda m, a: captured.append(a[0].detach().numpy().copy()))
    )
    with input_snr_db(quantized, ids.shape[1]) as inputs:
        evaluate(
            models, ids, batch_size=3
        )  # windows 0-2, then 3-5: the second batch counts for one window
    hook.remove()
    snr = layer_snr({v: weight_snr_db(model, m) for v, m in quantized.items()}, inputs)

    w = model.get_submodule(name).weight.detach().numpy()
    scale = np.float32(np.abs(w).max() / np.float32(448))
    w_e4m3 = (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    assert snr["fp8-e4m3"]["weights"][name] == pytest.approx(reference_snr(w, w_e4m3), abs=1e-6)
    ch_scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    w_int8 = np.clip(np.round(w / ch_scale), -127, 127) * ch_scale
    assert snr["int8"]["weights"][name] == pytest.approx(reference_snr(w, w_int8), abs=1e-4)
    s = (
        cal.input_channel_amax[name].numpy().astype(np.float64) ** 0.85
        / np.abs(w).max(axis=0).astype(np.float64) ** 0.15
    )
    ws = (w * s.astype(np.float32)).astype(np.float32)
    ch_scale = np.abs(ws).max(axis=1, keepdims=True) / np.float32(127)
    ws_int8 = np.clip(np.round(ws / ch_scale), -127, 127) * ch_scale
    assert snr["int8-smoothquant"]["weights"][name] == pytest.approx(
        reference_snr(ws, ws_int8), abs=1e-3
    )

    x = np.concatenate([captured[0].reshape(-1), captured[1][:1].reshape(-1)])
    x_scale = np.float32(cal.input_amax[name].item() / np.float32(448))
    x_e4m3 = (
        np.clip(x / x_scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * x_scale
    )
    assert snr["fp8-e4m3"]["inputs"][name] == pytest.approx(reference_snr(x, x_e4m3), abs=1e-5)
    assert snr["fp8-e4m3"]["input_windows"] == 4 and set(snr) == {
        "fp8-e4m3",
        "int8",
        "int8-smoothquant",
    }
    assert (
        25 < snr["fp8-e4m3"]["weights"][name] < 35
    )  # 3 mantissa bits: about 31 dB on Gaussian-like weights


def test_every_experts_input_snr_is_measured_grouped_as_one_by_one_against_an_independent_reference():
    """A mixture-of-experts layer's experts run grouped (one matmul for all of them), not through their QuantLinears'
    forward: each expert's input SNR is still measured, on the rows routed to it, as when the experts run one by one
    (the SNR of the same rows, whatever their order), and expert 0's gate_proj input against ml_dtypes on the rows the
    router sent it. Past its share of tokens, a layer's hook removes itself."""
    import families

    from ptq.calibration.calibrate import calibrate
    from ptq.calibration.clips import quantize_variants
    from ptq.evaluation.evaluate import evaluate
    from ptq.evaluation.layerstats import input_snr_db, quantized_layers
    from ptq.models.matmuls import LinearExperts, linearize
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.recipes import load_recipe

    model = linearize(families.build("mixtral"))
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    recipes = [load_recipe("fp8-e4m3"), load_recipe("fp8-dynamic")]
    cal = calibrate(model, ids, sorted(calibrated_layers(model, recipes[0])))
    models = quantize_variants(model, [load_recipe("bf16"), *recipes], cal)
    quantized = {r.name: models[r.name] for r in recipes}
    block = quantized["fp8-e4m3"].model.layers[0].mlp.experts
    routed = []  # the E4M3 variant's input to its first experts layer, and where each token goes
    hook = block.register_forward_pre_hook(lambda m, a: routed.append((a[0].clone(), a[1].clone())))

    def measured() -> dict:
        with input_snr_db(
            quantized, window_tokens=16, windows=4
        ) as inputs:  # every token: one batch of 4 windows
            evaluate(models, ids, batch_size=4)
            # a layer that has seen its 64 tokens removed its hook; an expert, given fewer, keeps it
            hooked = {
                n
                for v in quantized.values()
                for n, q in quantized_layers(v).items()
                if q._forward_pre_hooks
            }
            assert hooked and all(".experts." in n for n in hooked)
        return inputs

    grouped = measured()
    hook.remove()
    experts = [m for v in quantized.values() for m in v.modules() if isinstance(m, LinearExperts)]
    assert all(m._grouped[1] is not None for m in experts)  # the grouped forward ran
    for m in experts:
        m._grouped_weights = lambda: None  # the loop over experts, module by module
    looped = measured()

    for variant in quantized:
        names = [n for n in grouped[variant] if ".experts." in n]
        assert len(names) == 2 * 4 * 3  # 2 layers, 4 experts, gate/up/down
        assert all(grouped[variant][n] is not None for n in names), (
            variant
        )  # Mixtral routes to every expert here
        assert grouped[variant] == pytest.approx(looped[variant], abs=1e-4), variant

    hidden, top_k = routed[0]
    x = hidden[(top_k == 0).any(-1)].numpy()  # the rows routed to expert 0
    name = "model.layers.0.mlp.experts.0.gate_proj"
    scale = np.float32(cal.input_amax[name].item() / np.float32(448))
    x_e4m3 = (
        np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    )
    assert grouped["fp8-e4m3"][name] == pytest.approx(reference_snr(x, x_e4m3), abs=1e-5)
    assert grouped["fp8-e4m3"][name] == grouped["fp8-e4m3"]["model.layers.0.mlp.experts.0.up_proj"]


# --- plots ---------------------------------------------------------------------------------------


def test_plots_are_linked_relative_deterministic_and_skippable(compared, ptq_cli, tmp_path):
    report = (compared / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert links == ["report-metrics.png", "report-layer-amax.png", "report-layer-snr.png"]
    for link in links:
        assert (compared / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Re-rendered elsewhere from results.json alone: same names (after the report's), same bytes.
    code, _, err = ptq_cli("report", compared / "results.json", "-o", tmp_path / "pr.md")
    assert code == 1 and "wrote" in err
    for name in ("metrics", "layer-amax", "layer-snr"):
        assert (tmp_path / f"pr-{name}.png").read_bytes() == (
            compared / f"report-{name}.png"
        ).read_bytes()
    assert "](pr-metrics.png)" in (tmp_path / "pr.md").read_text()
    # Nothing is overwritten without --force, and nothing half-written.
    before = (tmp_path / "pr.md").read_text()
    code, _, err = ptq_cli(
        "report", compared / "results.json", "-o", tmp_path / "pr.md", "--max-kl", "1"
    )
    assert code == 2 and "already exists" in err and (tmp_path / "pr.md").read_text() == before
    code, _, _ = ptq_cli(
        "report", compared / "results.json", "-o", tmp_path / "bare.md", "--no-plots"
    )
    assert (
        code == 1
        and not list(tmp_path.glob("bare-*.png"))
        and "![" not in (tmp_path / "bare.md").read_text()
    )


def test_metrics_plot_draws_an_inf_perplexity_and_a_missing_interval_without_warnings():
    import dataclasses
    import warnings

    import sample_results

    from ptq.reporting.plots import metrics_figure

    nan = math.nan
    collapsed = dataclasses.replace(
        sample_results.variant("collapsed", ppl_delta_pct=math.inf),
        perplexity_ci=(math.inf, math.inf),
    )
    unknown = dataclasses.replace(
        sample_results.variant("few", ppl_delta_pct=3.0), perplexity_ci=(nan, nan)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value encountered" from a NaN or inf bar
        fig = metrics_figure(sample_results.compare_results(variants=[collapsed, unknown]))
        fig.canvas.draw()
    ax = fig.axes[0]  # perplexity
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == [
        10.0,
        0.0,
        pytest.approx(10.3),
    ]  # the inf bar has no height; its label says inf
    assert [t.get_text() for t in ax.texts] == ["10", "inf", "10.3"]
    (segments,) = [
        c.get_segments() for c in ax.collections
    ]  # the error bars: the baseline's interval only
    assert [tuple(float(y) for _, y in seg) for seg in segments] == [
        (9.8, 10.2),
        (0.0, 0.0),
        (10.3, 10.3),
    ]


# --- trend ---------------------------------------------------------------------------------------


def test_trend_flags_changes_beyond_intervals(compared, ptq_cli, tmp_path):
    current = load(compared / "results.json")
    previous = copy.deepcopy(current)
    fp8 = next(v for v in previous["variants"] if v["name"] == "fp8-e4m3")
    fp8["perplexity"] = current["variants"][0]["perplexity"] * 0.9
    fp8["ppl_delta_pct"] = 100 * (
        fp8["perplexity"] / previous["baseline"]["perplexity"] - 1
    )  # one run's numbers
    # Intervals of 1% around each perplexity: the moved one (10%) is beyond them, the others are not.
    for results in (current, previous):
        for entry in [results["baseline"], *results["variants"]]:
            entry["perplexity_ci"] = [entry["perplexity"] * 0.99, entry["perplexity"] * 1.01]
    (tmp_path / "old.json").write_text(json.dumps(previous))
    (tmp_path / "new.json").write_text(json.dumps(current))
    code, out, _ = ptq_cli(
        "report", tmp_path / "new.json", "--previous", tmp_path / "old.json", "--max-kl", "1"
    )
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("| fp8-e4m3 | perplexity |"))
    assert "(+11.11%)" in row and row.endswith("| ⚠️ worse |")
    row = next(line for line in out.splitlines() if line.startswith("| int8 | perplexity |"))
    assert row.endswith("| no |")
    # The same through --json.
    code, out, _ = ptq_cli(
        "report",
        tmp_path / "new.json",
        "--previous",
        tmp_path / "old.json",
        "--max-kl",
        "1",
        "--json",
    )
    data = json.loads(out)
    flagged = [(m["entry"], m["metric"]) for m in data["trend"]["moves"] if m["beyond_intervals"]]
    assert flagged == [("fp8-e4m3", "perplexity")]
    assert "1 change beyond the intervals" in data["verdict"]
    moved = next(m for m in data["trend"]["moves"] if m["beyond_intervals"])
    assert moved["worse"] is True


def test_trend_names_every_difference_in_setup():
    """Two runs that measured differently (task documents, --limit, shots, dtype, target, BOS, calibration) are not
    a code change alone: the trend says what differs."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.report import trend_section
    from ptq.reporting.results import TaskScoring
    from ptq.reporting.trend import trend

    def run(n: int, sha: str, limit: float | None, shots: int, acc: float):
        r = compare_results(
            baseline(tasks={"piqa": scores(n, acc=acc)}),
            [variant(tasks={"piqa": scores(n, acc=acc)})],
        )
        scoring = TaskScoring(
            harness="lm-eval 0.4.13",
            batch_size=4,
            limit=limit,
            num_fewshot=None,
            requested=["piqa"],
        )
        return dataclasses.replace(
            r, tasks=[task_info("piqa", {"acc": True}, n, sha, shots)], task_scoring=scoring
        )

    old, new = run(20, "b" * 64, 20.0, 0, 0.8), run(500, "c" * 64, None, 5, 0.7)
    same = trend(new, run(500, "c" * 64, None, 5, 0.7))
    assert same["setup_changes"] == []
    assert trend(new, old)["setup_changes"] == [
        "task --limit: 20.0 -> None",
        f"piqa documents: 20 (sha256 {'b' * 16}) -> 500 (sha256 {'c' * 16})",
        "piqa shots: 0 -> 5",
    ]
    # compute dtype, --target, BOS and the calibration text's identity and amount
    calibrated = dataclasses.replace(new, calibration=_calibration("d" * 64, windows=32))
    other = dataclasses.replace(
        new,
        compute=dataclasses.replace(new.compute, dtype="bfloat16"),
        target="transformers",
        eval=dataclasses.replace(new.eval, bos=True),
        calibration=_calibration("e" * 64, windows=8),
    )
    t = trend(other, calibrated)
    assert t["setup_changes"] == [
        "bos: False -> True",
        "compute dtype: float32 -> bfloat16",
        "target: vllm -> transformers",
        f"calibration text (sha256): {'d' * 16} -> {'e' * 16}",
        "calibration windows: 32 -> 8",
    ]
    assert f"calibration text (sha256): {'d' * 16} -> {'e' * 16}" in trend_section(t, calibrated)[3]
    assert trend(new, calibrated)["setup_changes"] == [
        f"calibration text (sha256): {'d' * 16} -> None"
    ] + [
        "calibration windows: 32 -> None",
        "calibration seq_len: 64 -> None",
    ]


def _calibration(sha: str, windows: int):
    from ptq.reporting.results import CalibrationEntry, CalibrationFaults, CalibrationSummary

    return CalibrationEntry(
        source="calibrated in this run",
        data="calib.txt",
        data_sha256=sha,
        windows=windows,
        seq_len=64,
        tokens=windows * 63,
        batch_size=4,
        summary=CalibrationSummary(
            layers=0, input_amax_min=1.0, input_amax_median=1.0, input_amax_max=1.0, largest=[]
        ),
        faults=CalibrationFaults(
            on_nonfinite="fail", unseen_layers=[], nonfinite_batches={}, warnings=[]
        ),
        layers=[],
    )


def test_report_exit_code_and_json_come_from_the_checks_it_shows(ptq_cli, tmp_path):
    """A results file whose stored gates.passed disagrees with its numbers (an older ptq's, or edited): `ptq report`
    judges the stored limits anew, and its markdown, --json and exit code all say the same."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.results import Gates, dumps

    r = compare_results(baseline(), [variant(ppl_delta_pct=3.0)])
    stale_pass = dataclasses.replace(
        r, gates=Gates(limits=Limits(max_ppl_increase_pct=2.0), passed=True, checks=[])
    )
    (tmp_path / "stale.json").write_text(dumps(stale_pass))
    code, out, err = ptq_cli("report", tmp_path / "stale.json")
    assert code == 1 and "- ❌ v: perplexity +3.00% > +2%" in out
    assert (
        "stores gates.passed true, but its numbers fail its limits" in err
        and len(err.strip().splitlines()) == 1
    )
    code, out, _ = ptq_cli("report", tmp_path / "stale.json", "--json")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False and data["gates"]["passed"] is False
    assert [(c["metric"], c["value"], c["passed"]) for c in data["gates"]["checks"]] == [
        ("ppl_delta_pct", 3.0, False)
    ]
    # and the other way round: a stored failure the numbers do not bear out
    stale_fail = dataclasses.replace(
        r, gates=Gates(limits=Limits(max_ppl_increase_pct=5.0), passed=False, checks=[])
    )
    (tmp_path / "stale_fail.json").write_text(dumps(stale_fail))
    code, out, _ = ptq_cli("report", tmp_path / "stale_fail.json")
    assert code == 0 and "✅ **All 1 gate checks pass**" in out
    code, out, _ = ptq_cli("report", tmp_path / "stale_fail.json", "--json")
    assert (
        code == 0
        and json.loads(out)["passed"] is True
        and json.loads(out)["gates"]["passed"] is True
    )


def test_report_refuses_a_file_that_is_not_results(ptq_cli, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    for path in (tmp_path / "x.json", tmp_path / "missing.json"):
        code, out, err = ptq_cli("report", path)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


# --- inspect and help ---------------------------------------------------------------------------


def test_inspect_lists_every_linear_with_its_shape_and_treatment(ptq_cli, tiny_model):
    from transformers import AutoModelForCausalLM

    code, out, _ = ptq_cli("inspect", tiny_model, "--recipe", "fp8-e4m3,int8", "--json")
    assert code == 0
    info = json.loads(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert [row["layer"] for row in info["layers"]] == list(linear)
    for row in info["layers"]:
        assert row["shape"] == list(linear[row["layer"]].weight.shape)
        fp8, int8 = row["recipes"]["fp8-e4m3"], row["recipes"]["int8"]
        assert fp8["quantized"] == int8["quantized"] == (row["layer"] != "lm_head")
        if fp8["quantized"]:
            assert (
                (fp8["weights"], int8["weights"], int8["inputs"])
                == (
                    "e4m3 per-tensor",
                    "int8 per-channel",
                    "int8 per-tensor [-128, 127]",  # as vLLM serves them (the default target, as compare's)
                )
            )
        else:
            assert fp8["weights"] == "bf16"
    assert info["target"] == "vllm" and info["recipes"]["int8"]["layers"] == len(linear) - 1
    q, k, v = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    by_layer = {row["layer"]: row["recipes"] for row in info["layers"]}
    assert by_layer[q]["fp8-e4m3"]["shares_scale_with"] == [
        k,
        v,
    ]  # vLLM's fused qkv_proj: one weight scale
    code, out, _ = ptq_cli(
        "inspect", tiny_model, "--recipe", "fp8-e4m3,int8", "--json", "--target", "transformers"
    )
    info = json.loads(out)
    by_layer = {row["layer"]: row["recipes"] for row in info["layers"]}
    assert (
        by_layer[q]["int8"]["inputs"] == "int8 per-tensor"
        and by_layer[q]["fp8-e4m3"]["shares_scale_with"] is None
    )
    code, out, _ = ptq_cli("inspect", tiny_model, "--recipe", "int8")
    assert code == 0 and "lm_head" in out and "- (bf16)" in out and "int8 ch / int8" in out
    # printed to a pipe (a CI log): every row whole, as wide as it needs (at rich's 80 columns, four recipes
    # squeezed the kind and shape columns away and cut the layer names)
    code, out, _ = ptq_cli("inspect", tiny_model, "--recipe", "fp8-e4m3,int8,fp8-dynamic,mxfp8")
    row = next(line for line in out.splitlines() if "model.layers.1.mlp.down_proj" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert (
        cells[:3] == ["model.layers.1.mlp.down_proj", "Linear", "64 x 128"] and len(cells) == 7
    ), row
    assert cells[6] == "e4m3 per-group-32 e8m0 scales / e4m3 per-group-32 dynamic e8m0 scales", row


@pytest.mark.parametrize("command", ["calibrate", "compare", "report", "inspect"])
def test_every_command_has_help_with_an_example(ptq_cli, command):
    code, out, _ = ptq_cli(command, "--help")
    assert code == 0 and "Example: ptq " + command in " ".join(out.split())


def test_report_into_a_directory_is_refused_before_anything_is_written(compared, ptq_cli, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    for force in ([], ["--force"]):
        code, _, err = ptq_cli("report", compared / "results.json", "-o", target, *force)
        assert (
            code == 2
            and "is a directory" in err
            and "--force" not in err
            and len(err.strip().splitlines()) == 1
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list(target.iterdir())


def test_report_plots_and_markdown_are_written_as_one_set(compared, ptq_cli, tmp_path, monkeypatch):
    from ptq.reporting import plots

    def broken(results):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(
        plots, "snr_figure", broken
    )  # the last plot fails, after the others are drawn
    code, _, err = ptq_cli("report", compared / "results.json", "-o", tmp_path / "pr.md")
    assert code != 0
    assert not list(
        tmp_path.iterdir()
    )  # neither the markdown nor the plots drawn before the failure
    monkeypatch.undo()
    code, _, err = ptq_cli("report", compared / "results.json", "-o", tmp_path / "pr.md")
    assert code == 1 and sorted(p.name for p in tmp_path.iterdir()) == [
        "pr-layer-amax.png",
        "pr-layer-snr.png",
        "pr-metrics.png",
        "pr.md",
    ]


def test_metrics_plot_draws_the_accuracy_gate_that_next_token_accuracy_is_judged_by():
    """`--min-accuracy-recovery next-token=98%` is the limit next-token accuracy is gated by (it overrides a default
    99%, and is one on its own): the accuracy panel's dashed line is base accuracy x 98%, as the checks say."""
    import dataclasses

    import sample_results

    from ptq.reporting.gates import gate_results
    from ptq.reporting.plots import metrics_figure

    base = sample_results.baseline(accuracy=0.5)
    r = sample_results.compare_results(base, [sample_results.variant("v", accuracy=0.495)])
    for given, expected in (
        (["99%", "next-token=98%"], 98.0),
        (["next-token=98%"], 98.0),
        (["99%"], 99.0),
    ):
        gated = dataclasses.replace(r, gates=gate_results(r, parse_limits(None, given, None)))
        (judged,) = [c for c in gated.gates.checks if c.task == "next-token"]
        assert judged.limit == expected
        ax = metrics_figure(gated).axes[1]  # next-token accuracy, in percent
        (line,) = [ln for ln in ax.lines if ln.get_label() == "gate"]
        assert line.get_ydata()[0] == pytest.approx(100 * 0.5 * expected / 100)


def test_trend_names_a_change_of_matmul_path_or_of_a_recipe_under_the_same_name():
    """Real FP8 matmuls (--matmul fp8) against a simulated previous run, or a recipe whose formats changed while its
    name did not: the numbers move for that reason, not the code's, and the trend must say so."""
    import dataclasses

    from sample_results import compare_results, variant

    from ptq.reporting.trend import trend

    old = compare_results()
    assert trend(old, compare_results())["setup_changes"] == []
    fp8 = dataclasses.replace(old, compute=dataclasses.replace(old.compute, matmul="fp8"))
    assert trend(fp8, old)["setup_changes"] == ["matmul: simulated -> fp8"]
    v = variant()
    channel = dataclasses.replace(
        v, recipe=dataclasses.replace(v.recipe, weights="e4m3 per-channel", ignore=["lm_head"])
    )
    assert trend(compare_results(variants=[channel]), old)["setup_changes"] == [
        "v weights: e4m3 per-tensor -> e4m3 per-channel",
        "v ignore: [] -> ['lm_head']",
    ]


def test_the_verdict_and_intervals_never_print_a_failing_ppl_delta_as_its_limit():
    """+2.004% against a 2% limit fails: the verdict line (the first a pull request shows) and the intervals table
    print it as +2.004%, as the results table and the failed checks do, not as a failing +2.00%."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.gates import gate_results
    from ptq.reporting.report import render_markdown

    r = compare_results(baseline(), [variant("v", ppl_delta_pct=2.004)])
    r = dataclasses.replace(r, gates=gate_results(r, parse_limits("2%", None, None)))
    md = render_markdown(r)
    verdict = md.splitlines()[2]
    assert verdict.startswith("❌ **1 of 1 gate checks fail** (v)") and verdict.endswith(
        "v +2.004%."
    )
    assert "| v | 10.2004 | [10.0004, 10.4004] | +2.004% |" in md
    # without a limit, or away from it, the usual two decimals
    plain = render_markdown(compare_results(baseline(), [variant("v", ppl_delta_pct=2.004)]))
    assert plain.splitlines()[2].endswith("v +2.00%.") and "| +2.00% |" in plain


def test_the_intervals_give_the_kl_and_agreement_with_their_intervals():
    """The intervals section asks to compare close recipes by their KL: it prints each variant's KL and top-1
    agreement with the intervals results.json holds for them (kl_div_ci, top1_agreement_ci)."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.report import intervals_section

    close = [
        dataclasses.replace(variant("a", kl_div=0.03935), kl_div_ci=(0.03389, 0.04505)),
        dataclasses.replace(variant("b", kl_div=0.03684), kl_div_ci=(0.02942, 0.04306)),
    ]
    lines = intervals_section(compare_results(baseline(), close))
    at = lines.index("| variant | KL vs bf16 (nats/token) | 95% CI | top-1 agreement | 95% CI |")
    table = "\n".join(lines[at:])
    assert table_row(table, "a |") == [
        "a",
        "0.03935",
        "[0.03389, 0.04505]",
        "99.00%",
        "[98.00, 100.00]",
    ]
    assert table_row(table, "b |") == [
        "b",
        "0.03684",
        "[0.02942, 0.04306]",
        "99.00%",
        "[98.00, 100.00]",
    ]


def test_the_16_bit_baseline_is_not_reported_as_quantized():
    """The bf16 baseline rounds its matmul weights to bf16: its coverage line says so, not "100% ... quantized"."""
    from sample_results import baseline, compare_results, variant

    from ptq.reporting.report import coverage_lines

    r = compare_results(baseline(), [variant("v")])
    base = dataclasses_replace_recipe(r.baseline, weights="bf16", inputs="bf16")
    base_line, variant_line = coverage_lines([base, r.variants[0]])[2:4]
    assert base_line == "- bf16: 100.00% of matmul weight parameters rounded to bf16 (10 of 10)."
    assert variant_line == "- v: 100.00% of matmul weight parameters quantized (10 of 10)."


def dataclasses_replace_recipe(entry, **recipe):
    import dataclasses

    return dataclasses.replace(entry, recipe=dataclasses.replace(entry.recipe, **recipe))


def test_a_variant_that_quantizes_fewer_weights_says_so_in_the_verdict_and_table():
    """fp8-block on a model whose in_features are not multiples of 128 leaves most layers in 16 bits: its small
    perplexity delta is not an answer about 8 bits, so the verdict and the table give its share next to it."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.report import render_markdown
    from ptq.reporting.results import Coverage, LeftOut

    full = Coverage(quantized_weight_params=7895, matmul_weight_params=10000, left_out=[])
    part = Coverage(
        quantized_weight_params=1974,
        matmul_weight_params=10000,
        left_out=[LeftOut(name="model.layers.0.mlp.up_proj", params=8026, reason="shape")],
    )
    r = compare_results(
        baseline(),
        [
            dataclasses.replace(variant("fp8", ppl_delta_pct=1.82), coverage=full),
            dataclasses.replace(variant("block", ppl_delta_pct=0.6), coverage=part),
        ],
    )
    md = render_markdown(r)
    assert md.splitlines()[2] == (
        "**Perplexity vs bf16:** fp8 +1.82%, block +0.60% (only 19.74% of matmul weights quantized)."
    )
    assert table_row(md, "fp8 |")[-1] == "78.95%"
    assert table_row(md, "block |")[-1] == "**19.74%**"
    assert table_row(md, "**bf16**")[-1] == ""
    assert md.splitlines()[4].endswith("| top-1 agreement | matmul weights quantized |")


def test_a_small_kl_is_never_printed_as_zero():
    """KL 3.437e-06 (an int8 MoE above) is not 0.00000: the results table, the intervals and the trend give it two
    significant digits, and a change from it to 1.03e-05 (three times as far from the baseline) is not +0.00000.
    KLs of 1e-4 and above print as before (5 decimals)."""
    import dataclasses

    from sample_results import baseline, compare_results, variant

    from ptq.reporting.report import render_markdown

    def with_kl(kl: float, ci: tuple[float, float]):
        return compare_results(
            baseline(), [dataclasses.replace(variant("v", kl_div=kl), kl_div_ci=ci)]
        )

    before, now = with_kl(3.437e-6, (2.9e-6, 4.1e-6)), with_kl(1.03e-5, (8.7e-6, 1.21e-5))
    md = render_markdown(now, before)
    assert table_row(md, "v |")[7] == "0.000010"  # the results table
    at = md.splitlines().index(
        "| variant | KL vs bf16 (nats/token) | 95% CI | top-1 agreement | 95% CI |"
    )
    assert table_row("\n".join(md.splitlines()[at:]), "v |")[1:3] == [
        "0.000010",
        "[0.0000087, 0.000012]",
    ]
    trend_row = next(line for line in md.splitlines() if line.startswith("| v | KL vs baseline |"))
    assert trend_row == (
        "| v | KL vs baseline | 0.0000034 [0.0000029, 0.0000041] | 0.000010 [0.0000087, 0.000012] | +0.0000069 | ⚠️ worse |"
    )
    assert table_row(render_markdown(with_kl(0.03935, (0.03389, 0.04505))), "v |")[7] == "0.03935"
    assert table_row(render_markdown(with_kl(0.00012, (0.0001, 0.00014))), "v |")[7] == "0.00012"


def test_the_gates_note_defines_the_percentages_it_judges():
    """The table prints Δ ppl and accuracy recovery in percent (+2.00%, 99.60%) and the gates' limits are percents:
    the note's definitions carry the factor 100 that makes them so, as docs/reports.md's do."""
    import dataclasses

    from sample_results import compare_results, variant

    from ptq.reporting.gates import gate_results
    from ptq.reporting.report import gates_note

    r = compare_results(variants=[variant("v", ppl_delta_pct=1.0)])
    note = gates_note(
        dataclasses.replace(r, gates=gate_results(r, parse_limits("2%", ["99%"], "0.01")))
    )
    assert "Δ ppl = 100 * (ppl_variant / ppl_baseline - 1) %" in note
    assert "accuracy recovery = 100 * accuracy_variant / accuracy_baseline %" in note


@pytest.mark.parametrize(
    "names",
    [
        ["fp8-e4m3", "fp8-dynamic", "fp8-block", "mxfp8", "int8"],
        [f"fp8-e4m3-smoothquant-{i}" for i in range(8)],
    ],
)
def test_the_metrics_plot_labels_of_many_recipes_do_not_overlap(names):
    """The bars of `ptq compare --recipes fp8-e4m3,fp8-dynamic,fp8-block,mxfp8,int8` (and of eight long names): each
    panel's recipe names, as drawn, lie apart (fp8-e4m3, fp8-dynamic and fp8-block used to run into one another),
    clear of the other panels' titles, and inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from sample_results import compare_results, variant

    from ptq.reporting.plots import metrics_figure

    fig = metrics_figure(compare_results(variants=[variant(n) for n in names]))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    figure_box = fig.bbox
    for ax in fig.axes:
        boxes = [
            label.get_window_extent(renderer) for label in ax.get_xticklabels() if label.get_text()
        ]
        assert len(boxes) == len(names) + 1
        for left, right in zip(boxes, boxes[1:]):
            assert not left.overlaps(right), ax.get_title()
        assert all(b.y0 >= figure_box.y0 and b.x0 >= figure_box.x0 for b in boxes)
        title = ax.title.get_window_extent(renderer)
        # no panel's labels run into the title of the panel below
        for other in fig.axes:
            if other is not ax:
                assert not any(b.overlaps(other.title.get_window_extent(renderer)) for b in boxes)
        assert title.height > 0


def test_per_layer_snr_median_and_the_diagnostics_name_what_they_measure():
    """The SNR summary's median of an even number of layers is the mean of the middle two (statistics.median), not
    the upper one; the per-tensor diagnostics are of each layer's input (calibration histograms of activations), and
    their table says so rather than naming a layer as if it were its weight."""
    import dataclasses
    import statistics

    from sample_results import compare_results, variant

    from ptq.reporting.report import details_sections, render_diagnostics
    from ptq.reporting.results import Diagnostics, LayerSnr, TensorSqnr

    weights = {"a": 30.0, "b": 31.0, "c": 33.0, "d": 40.0}
    snr = LayerSnr(weights=weights, inputs={"a": 20.0, "b": None}, input_windows=1)
    r = compare_results(variants=[dataclasses.replace(variant("v"), snr_db=snr)])
    row = table_row("\n".join(details_sections(r)), "v |")
    assert row == [
        "v",
        f"{statistics.median(weights.values()):.1f}",
        "30.0 (`a`)",
        "20.0",
        "20.0 (`a`)",
    ]
    assert row[1] == "32.0"
    d = Diagnostics(
        method="static per-tensor max scale",
        tensors=[
            TensorSqnr(
                tensor="model.layers.0.mlp.down_proj",
                amax=106.2,
                sqnr_e4m3_db=31.9,
                sqnr_int8_db=4.6,
            )
        ],
        worst_e4m3=["model.layers.0.mlp.down_proj"],
        worst_int8=["model.layers.0.mlp.down_proj"],
    )
    lines = render_diagnostics(dataclasses.replace(r, diagnostics=d))
    assert "| layer (its input) | input amax | SQNR E4M3 (dB) | SQNR int8 (dB) |" in lines


def near_limits_with_a_task(names=("fp8[static]", "fp8[/]")):
    """Two variants beside their gates' limits (Δ ppl 2.004% at 2%, KL 0.0100004 at 0.01, piqa recovery 98.98% at
    99%) and a partial one (20 of 1,000,000 matmul weights left out), gates judged."""
    import dataclasses

    from sample_results import baseline, compare_results, task_scores, variant

    from ptq.reporting.gates import gate_results
    from ptq.reporting.results import Coverage, TaskDelta

    base = baseline(tasks=task_scores(piqa=0.6))
    near = variant(names[0], 2.004, 0.5, 0.0100004, tasks=task_scores(piqa=0.5939))
    delta = TaskDelta(
        delta=-0.0061,
        stderr=0.003,
        ci=(-0.012, -0.00004),
        significant=True,
        n=100,
        recovery_pct=98.98,
    )
    near = dataclasses.replace(near, task_deltas={"piqa": {"acc": delta}})
    partial = variant(names[1], 0.0034, 0.5, 0.001, tasks=task_scores(piqa=0.6))
    partial = dataclasses.replace(
        partial,
        coverage=Coverage(
            quantized_weight_params=999_980, matmul_weight_params=1_000_000, left_out=[]
        ),
        ppl_delta_pct_ci=(0.002, 0.9),
        ppl_delta_significant=True,
        task_deltas={
            "piqa": {
                "acc": dataclasses.replace(delta, delta=0.0, ci=(0.0, 0.0), recovery_pct=100.0)
            }
        },
    )
    results = dataclasses.replace(
        compare_results(base, [near, partial]), tasks=[task_info("piqa", {"acc": True})]
    )
    return dataclasses.replace(
        results, gates=gate_results(results, parse_limits("2%", ["99%"], "0.01"))
    )


def test_console_prints_names_as_written_and_values_with_the_digits_of_the_report(
    tmp_path, capsys, monkeypatch
):
    """rich read "[static]" in a recipe name as a style tag (dropped) and "[/]" as a closing tag (a traceback after the
    report was written); the console rounded 2.004% to +2.00% beside FAIL, where the report prints +2.004%."""
    from ptq import cli

    monkeypatch.setenv("COLUMNS", "250")
    cli._print_compare(near_limits_with_a_task(), tmp_path)
    out = capsys.readouterr().out
    assert "fp8[static] FAIL" in out and "│ fp8[/] " in out
    assert "+2.004%" in out and "0.0100004" in out and "+2.00%" not in out
    assert "98.98% FAIL)" in out  # the piqa recovery against its 99% limit, not 99.0%
    assert "+0.003%" in out  # not +0.00%: beside it the interval excludes 0


def test_markdown_keeps_nonzero_ends_partial_shares_and_failing_task_cells_apart():
    md = render_markdown(near_limits_with_a_task())
    assert (
        "[+0.002, +0.90]%" in md and "| +0.003% |" in md
    )  # an end or a delta that is not 0 does not read +0.00
    assert "(only 99.998% of matmul weights quantized)" in md and "**99.998%**" in md
    piqa_rows = [
        line
        for line in md.splitlines()
        if line.startswith("| piqa | acc |") and "fp8[static]" in line
    ]
    assert piqa_rows and piqa_rows[0].endswith("| **98.98%** ❌ |")
    assert "[-1.20, -0.004]" in piqa_rows[0]


def test_trend_from_or_to_an_infinite_perplexity_prints_no_nan():
    from sample_results import baseline, compare_results, variant

    from ptq.reporting.trend import trend

    collapsed = compare_results(baseline(), [variant("fp8", base_perplexity=float("inf"))])
    recovered = compare_results(baseline(), [variant("fp8", 1.0)])
    for old, new in ((collapsed, recovered), (collapsed, collapsed)):
        md = render_markdown(new, old)
        rows = [line for line in md.splitlines() if line.startswith("| fp8 | perplexity |")]
        assert rows and "nan" not in rows[0], rows
    assert trend(recovered, collapsed)["moves"]


def test_a_report_written_again_takes_the_plots_it_no_longer_draws_away(
    compared, ptq_cli, tmp_path
):
    """With --no-plots --force (or a run with less to plot), the earlier run's PNGs stayed beside the new report,
    showing another run's numbers; without --force they are refused like any output."""
    out = tmp_path / "again"
    code, _, err = ptq_cli("report", compared / "results.json", "-o", out / "report.md")
    assert code == 1, err  # compared's KL gate fails
    plots = sorted(p.name for p in out.glob("*.png"))
    assert plots == ["report-layer-amax.png", "report-layer-snr.png", "report-metrics.png"]
    code, _, err = ptq_cli(
        "report", compared / "results.json", "-o", out / "report.md", "--no-plots"
    )
    assert code == 2 and "exists" in err and len(list(out.glob("*.png"))) == 3
    code, _, err = ptq_cli(
        "report", compared / "results.json", "-o", out / "report.md", "--no-plots", "--force"
    )
    assert code == 1 and not list(out.glob("*.png")) and (out / "report.md").is_file()


def test_the_diagnostics_list_every_tensor_in_block_order():
    """The per-tensor SQNR table of a 12-block model lists block 2 before block 10 (names sorted as text put
    model.layers.10 right after model.layers.1), whatever order the calibration file holds its histograms in."""
    import torch

    from ptq.calibration.calibrate import Calibration
    from ptq.calibration.diagnostics import sqnr_table
    from ptq.calibration.observers import NUM_BINS

    names = [
        f"model.layers.{i}.{part}"
        for i in (10, 2, 0, 1, 11)
        for part in ("self_attn.q_proj", "mlp.down_proj")
    ]
    hist = torch.zeros(NUM_BINS, dtype=torch.int64)
    hist[1000:1010] = 5
    calibration = Calibration(
        input_amax={n: torch.tensor(1.0) for n in names},
        weight_amax={n: torch.tensor(1.0) for n in names},
        input_hist={n: hist.clone() for n in names},
    )
    listed = [row["tensor"] for row in sqnr_table(calibration)["tensors"]]
    assert listed == [
        f"model.layers.{i}.{part}"
        for i in (0, 1, 2, 10, 11)
        for part in ("mlp.down_proj", "self_attn.q_proj")
    ]


def test_the_report_names_every_layer_a_variant_left_unquantized():
    """The coverage line names the first three layers of a reason ("and 177 more"); the report then lists every one
    of them, collapsed, so that what stayed in 16 bits is in the report and not only in results.json."""
    import dataclasses

    from sample_results import compare_results, variant

    from ptq.reporting.report import render_markdown
    from ptq.reporting.results import AttentionLeftOut, Coverage, LeftOut

    shape = "shape: in_features 576 is not a multiple of the weight block's 128 columns"
    names = [f"model.layers.{i}.mlp.up_proj" for i in range(12)]
    coverage = Coverage(
        quantized_weight_params=100,
        matmul_weight_params=1400,
        left_out=[
            LeftOut(name="lm_head", params=100, reason="left out by the recipe (ignore: lm_head)")
        ]
        + [LeftOut(name=n, params=100, reason=shape) for n in names],
        attention_left_out=[
            AttentionLeftOut(name="model.layers.0.self_attn", reason="its own attention code")
        ],
    )
    r = compare_results(
        variants=[dataclasses.replace(variant("blocks"), coverage=coverage), variant("all")]
    )
    md = render_markdown(r)
    assert (
        "`model.layers.0.mlp.up_proj`, `model.layers.1.mlp.up_proj`, `model.layers.2.mlp.up_proj` and 9 more"
        in md
    )
    every = md.split("<details><summary>Every layer left unquantized</summary>")[1].split(
        "</details>"
    )[0]
    assert every.strip().splitlines() == [
        f"- blocks, 12 matmul weights: {shape}: " + ", ".join(f"`{n}`" for n in names)
    ]  # reasons whose names all fit in the line (lm_head, the attention layer) are not repeated
    assert "Every layer left unquantized" not in render_markdown(
        compare_results(variants=[variant("all")])
    )


def test_names_from_outside_cannot_break_the_report():
    """A model folder named with a newline, '|' or backticks ended report.md's heading (the rest of the name a
    paragraph) and broke its code span: names are rendered visibly (\\n) and escaped."""
    import dataclasses

    from sample_results import compare_results

    from ptq.reporting.report import render_markdown
    from ptq.reporting.results import ModelInfo

    evil = "/m/a\nb|c``d"
    r = compare_results()
    r = dataclasses.replace(
        r,
        model=ModelInfo(name=evil, source=f"the folder {evil}", caveats=[]),
        eval=dataclasses.replace(r.eval, data="t\u2028x.txt"),
    )
    md = render_markdown(r)
    assert md.splitlines()[0] == "# ptq compare: /m/a\\\\nb\\|c\\`\\`d"
    assert "- Model: ```/m/a\\nb|c``d```, the folder /m/a\\nb|c``d." in md
    assert "- Evaluation text: t\\u2028x.txt (sha256" in md
    assert "\n" + "b|c" not in md and "\u2028" not in md
