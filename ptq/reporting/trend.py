"""Trend: what moved between a previous results file and this one.

Entries are matched by name (the baseline, each variant, each task). A change is flagged as beyond
its intervals when the two runs' 95% intervals for the metric (its `<metric>_ci` field, [low, high])
do not overlap, a conservative test. Whether a change is better or worse follows the metric's
direction: for a task metric, the one results.json records for the task (lm-eval's
higher_is_better). Where the two runs were measured in a different setup (model, text, windows, task
documents, dtype, matmul path, target, calibration, a recipe's formats under the same name, ...),
`setup_changes` names it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ptq.reporting.gates import task_higher_is_better, task_metric_is_share, task_scores
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


def _sha(value: str | None) -> str | None:
    return value[:16] if value else value


def _calibration(r: CompareResults, what: str):
    cal = r.calibration
    if cal is None:
        return None
    return {"text": _sha(cal.data_sha256), "windows": cal.windows, "seq_len": cal.seq_len}[what]


SETUP = (
    ("model", lambda r: r.model.name),
    ("evaluation text", lambda r: r.eval.data_sha256),
    ("seq_len", lambda r: r.eval.seq_len),
    ("windows", lambda r: r.eval.windows),
    ("bos", lambda r: r.eval.bos),
    ("compute dtype", lambda r: r.compute.dtype),
    ("matmul", lambda r: r.compute.matmul),  # real FP8 matmuls round otherwise than the simulation
    ("target", lambda r: r.target),
    ("calibration text (sha256)", lambda r: _calibration(r, "text")),
    ("calibration windows", lambda r: _calibration(r, "windows")),
    ("calibration seq_len", lambda r: _calibration(r, "seq_len")),
    ("task --limit", lambda r: r.task_scoring.limit if r.task_scoring else None),
    ("task --num-fewshot", lambda r: r.task_scoring.num_fewshot if r.task_scoring else None),
)


# what a recipe quantizes and how (its name, description and file may change without changing that)
RECIPE_SETUP = (
    "weights",
    "inputs",
    "ignore",
    "attention",
    "kv_cache",
    "smoothquant_alpha",
    "residual",
)


def setup_changes(results: CompareResults, previous: CompareResults) -> list[str]:
    """What differs in how the two runs measured: "what: previous -> now", one entry each. Tasks are
    compared where both runs scored them: their documents (how many, and the sha256 over lm-eval's
    document hashes) and shots."""
    changes = [
        f"{what}: {get(previous)} -> {get(results)}"
        for what, get in SETUP
        if get(previous) != get(results)
    ]
    # entries are matched by name: one whose recipe quantizes otherwise under the same name is a
    # different measurement
    old_entries = {e.name: e for e in [previous.baseline, *previous.variants]}
    for new in [results.baseline, *results.variants]:
        old = old_entries.get(new.name)
        if old is None:
            continue
        for what in RECIPE_SETUP:
            before, now = getattr(old.recipe, what), getattr(new.recipe, what)
            if before != now:
                changes.append(f"{new.name} {what}: {before} -> {now}")
    old_tasks = {t.name: t for t in previous.tasks or []}
    for new in results.tasks or []:
        old = old_tasks.get(new.name)
        if old is None:
            continue
        if (old.n, old.documents_sha256) != (new.n, new.documents_sha256):
            changes.append(
                f"{new.name} documents: {old.n} (sha256 {_sha(old.documents_sha256)}) -> "
                f"{new.n} (sha256 {_sha(new.documents_sha256)})"
            )
        if old.num_fewshot != new.num_fewshot:
            changes.append(f"{new.name} shots: {old.num_fewshot} -> {new.num_fewshot}")
    return changes


@dataclass(frozen=True)
class Move:
    entry: str  # baseline or variant name
    metric: str  # a key of METRICS
    task: str | None
    previous: float
    current: float
    previous_ci: tuple[float, float]
    current_ci: tuple[float, float]
    better: str | None = None  # "higher" or "lower"; None: the metric's in METRICS
    # a task metric: whether it is a share in [0, 1] (printed as a percentage) or in its own units;
    # None: not a task's
    share: bool | None = None

    @property
    def change(self) -> float:
        return self.current - self.previous

    @property
    def beyond_intervals(self) -> bool:
        """Whether the two intervals do not overlap."""
        return self.current_ci[0] > self.previous_ci[1] or self.current_ci[1] < self.previous_ci[0]

    @property
    def worse(self) -> bool:
        better = self.better or BETTER.get(self.metric, "higher")
        return self.change > 0 if better == "lower" else self.change < 0

    def to_json(self) -> dict:
        return asdict(self) | {
            "better": self.better or BETTER.get(self.metric, "higher"),
            "change": self.change,
            "beyond_intervals": self.beyond_intervals,
            "worse": self.worse,
        }


def _moves(
    name: str,
    previous: Entry,
    current: Entry,
    results: CompareResults,
    previous_results: CompareResults,
) -> list[Move]:
    moves = [
        Move(
            name,
            key,
            None,
            getattr(previous, key),
            getattr(current, key),
            _ci(previous, key),
            _ci(current, key),
        )
        for key, _, _ in METRICS
        if hasattr(previous, key)
        and hasattr(current, key)  # a variant's delta metrics, not the baseline's
    ]
    old_tasks, new_tasks = task_scores(previous), task_scores(current)
    for task, metrics in new_tasks.items():
        for metric, new in metrics.items():
            old = old_tasks.get(task, {}).get(metric)
            if old:
                label = task if metric == "acc" else f"{task} {metric}"
                higher = task_higher_is_better(results, task, metric)
                share = task_metric_is_share(results, task, metric) and task_metric_is_share(
                    previous_results, task, metric
                )
                # an accuracy, or a task's other metric
                kind = "accuracy" if higher and share else "task_metric"
                better = "higher" if higher else "lower"
                moves.append(
                    Move(name, kind, label, old.value, new.value, old.ci, new.ci, better, share)
                )
    return moves


def _ci(entry: Entry, key: str) -> tuple[float, float]:
    return getattr(entry, f"{key}_ci")


def trend(results: CompareResults, previous: CompareResults) -> dict:
    """{"setup_changes": [...], "moves": [Move], "only_now": [...], "only_before": [...]}."""
    moves = []
    if previous.baseline.name == results.baseline.name:
        moves += _moves(
            results.baseline.name, previous.baseline, results.baseline, results, previous
        )
    old_variants = {v.name: v for v in previous.variants}
    for v in results.variants:
        if v.name in old_variants:
            moves += _moves(v.name, old_variants[v.name], v, results, previous)
    now_names = {results.baseline.name, *(v.name for v in results.variants)}
    old_names = {previous.baseline.name, *old_variants}
    return {
        "setup_changes": setup_changes(results, previous),
        "moves": moves,
        "only_now": sorted(now_names - old_names),
        "only_before": sorted(old_names - now_names),
    }
