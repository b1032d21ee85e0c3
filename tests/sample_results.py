"""Typed results documents made by hand (ptq.reporting.results), for tests of the gates, the trend and the report
that need particular numbers rather than a real compare: every field filled, the ones a test names set."""

from __future__ import annotations

from ptq.reporting.results import (
    CompareResults,
    Compute,
    Coverage,
    Entry,
    EvalSetup,
    ModelInfo,
    RecipeSummary,
    Statistics,
    TaskMetric,
    TaskScores,
    Variant,
)


def recipe(name: str) -> RecipeSummary:
    return RecipeSummary(
        name=name,
        description=f"{name} by hand",
        weights="e4m3 per-tensor",
        inputs="e4m3 per-tensor",
        ignore=[],
        source=f"{name}.yaml",
        attention=None,
        kv_cache=None,
        smoothquant_alpha=None,
        residual=None,
    )


def task_scores(**values: float) -> dict[str, TaskScores]:
    """{task: TaskScores} with one metric, acc, per task: task_scores(piqa=0.6)."""
    return {
        name: TaskScores(
            n=100, metrics={"acc": TaskMetric(value=v, stderr=0.01, ci=(v - 0.05, v + 0.05))}
        )
        for name, v in values.items()
    }


def _common(name: str, perplexity: float, accuracy: float, tasks) -> dict:
    return dict(
        name=name,
        recipe=recipe(name),
        perplexity=perplexity,
        accuracy=accuracy,
        window_nll=[1.0, 1.1],
        coverage=Coverage(quantized_weight_params=10, matmul_weight_params=10, left_out=[]),
        perplexity_stderr=0.1,
        perplexity_ci=(perplexity - 0.2, perplexity + 0.2),
        accuracy_stderr=0.01,
        accuracy_ci=(accuracy - 0.02, accuracy + 0.02),
        tasks=tasks,
    )


def baseline(
    name: str = "bf16", perplexity: float = 10.0, accuracy: float = 0.5, tasks=None
) -> Entry:
    return Entry(**_common(name, perplexity, accuracy, tasks))


def variant(
    name: str = "v",
    ppl_delta_pct: float = 0.0,
    accuracy: float = 0.5,
    kl_div: float = 0.0,
    tasks=None,
    base_perplexity: float = 10.0,
) -> Variant:
    return Variant(
        **_common(name, base_perplexity * (1 + ppl_delta_pct / 100), accuracy, tasks),
        ppl_delta_pct=ppl_delta_pct,
        accuracy_delta=accuracy - 0.5,
        kl_div=kl_div,
        top1_agreement=0.99,
        snr_db=None,
        kl_div_stderr=0.0,
        kl_div_ci=(kl_div, kl_div),
        top1_agreement_stderr=0.0,
        top1_agreement_ci=(0.98, 1.0),
        ppl_delta_pct_stderr=0.1,
        ppl_delta_pct_ci=(ppl_delta_pct - 0.2, ppl_delta_pct + 0.2),
        ppl_delta_significant=False,
        accuracy_delta_stderr=0.01,
        accuracy_delta_ci=(-0.01, 0.01),
        accuracy_delta_significant=False,
    )


def compare_results(
    base: Entry | None = None, variants: list[Variant] | None = None
) -> CompareResults:
    base = base or baseline()
    variants = [variant()] if variants is None else variants
    return CompareResults(
        model=ModelInfo(name="tiny", source="by hand", caveats=[]),
        device="cpu, float32 compute",
        compute=Compute(device="cpu", dtype="float32", matmul="simulated", low_memory=False),
        eval=EvalSetup(
            data="text.txt",
            data_sha256="0" * 64,
            seq_len=64,
            stride=64,
            windows=2,
            tokens=126,
            bos=False,
            description="2 windows x 64 tokens",
        ),
        protocol=["By hand."],
        target="vllm",
        statistics=Statistics(
            method="percentile bootstrap", resamples=2000, seed=0, confidence=0.95
        ),
        calibration=None,
        versions={"ptq": "0"},
        created="2026-01-01T00:00:00+00:00",
        baseline=base,
        variants=variants,
    )
