"""Trend: what moved between a previous results file and this one.

Entries are matched by name (the baseline, each variant, each task). A change is flagged as beyond its
intervals when the two runs' 95% intervals for the metric (its `<metric>_ci` field, [low, high]) do not
overlap, a conservative test.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ptq.reporting.gates import task_scores
from ptq.reporting.results import CompareResults, Entry

# (field of an entry, label, which direction is better); the baseline has the first and third only
METRICS = (
    ("perplexity", "perplexity", "lower"),
    ("ppl_delta_pct", "Δ ppl vs baseline (%)", "lower"),
    ("accuracy", "next-token accuracy", "higher"),
    ("kl_div", "KL vs baseline", "lower"),
    ("top1_agreement", "top-1 agreement", "higher"),
)
LABELS = {key: label for key, label, _ in METRICS}
BETTER = {key: better for key, _, better in METRICS}
SETUP = (
    ("model", lambda r: r.model.name),
    ("evaluation text", lambda r: r.eval.data_sha256),
    ("seq_len", lambda r: r.eval.seq_len),
    ("windows", lambda r: r.eval.windows),
)


@dataclass(frozen=True)
class Move:
    entry: str  # baseline or variant name
    metric: str  # a key of METRICS
    task: str | None
    previous: float
    current: float
    previous_ci: tuple[float, float]
    current_ci: tuple[float, float]

    @property
    def change(self) -> float:
        return self.current - self.previous

    @property
    def beyond_intervals(self) -> bool:
        """Whether the two intervals do not overlap."""
        return self.current_ci[0] > self.previous_ci[1] or self.current_ci[1] < self.previous_ci[0]

    @property
    def worse(self) -> bool:
        better = BETTER.get(self.metric, "higher")
        return self.change > 0 if better == "lower" else self.change < 0

    def to_json(self) -> dict:
        return asdict(self) | {"change": self.change, "beyond_intervals": self.beyond_intervals, "worse": self.worse}


def _moves(name: str, previous: Entry, current: Entry) -> list[Move]:
    moves = [
        Move(name, key, None, getattr(previous, key), getattr(current, key), _ci(previous, key), _ci(current, key))
        for key, _, _ in METRICS
        if hasattr(previous, key) and hasattr(current, key)  # a variant's delta metrics, not the baseline's
    ]
    old_tasks, new_tasks = task_scores(previous), task_scores(current)
    for task, metrics in new_tasks.items():
        for metric, new in metrics.items():
            old = old_tasks.get(task, {}).get(metric)
            if old:
                label = task if metric == "acc" else f"{task} {metric}"
                moves.append(Move(name, "accuracy", label, old.value, new.value, old.ci, new.ci))
    return moves


def _ci(entry: Entry, key: str) -> tuple[float, float]:
    return getattr(entry, f"{key}_ci")


def trend(results: CompareResults, previous: CompareResults) -> dict:
    """{"setup_changes": [...], "moves": [Move], "only_now": [...], "only_before": [...]}."""
    moves = []
    if previous.baseline.name == results.baseline.name:
        moves += _moves(results.baseline.name, previous.baseline, results.baseline)
    old_variants = {v.name: v for v in previous.variants}
    for v in results.variants:
        if v.name in old_variants:
            moves += _moves(v.name, old_variants[v.name], v)
    now_names = {results.baseline.name, *(v.name for v in results.variants)}
    old_names = {previous.baseline.name, *old_variants}
    setup = [f"{what}: {get(previous)} -> {get(results)}" for what, get in SETUP if get(previous) != get(results)]
    return {
        "setup_changes": setup,
        "moves": moves,
        "only_now": sorted(now_names - old_names),
        "only_before": sorted(old_names - now_names),
    }
