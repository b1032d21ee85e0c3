"""The results schema: what `ptq compare` and `ptq eval` write to results.json, as typed
dataclasses.

results.json is the source of truth: report.md, the gates, the trend, the plots and `ptq report
--json` are drawn from it alone, and they read it through `load_results`, which gives the typed
document or refuses the file in one line naming the problem. The document is built in one place
(ptq.commands.results) and written by `to_json`.

The JSON keys are the dataclasses' field names, nested as the dataclasses are; `X | None` fields are
written as null when there is nothing to record (no tasks, no calibration, no gates) and read as
None when missing. Only TaskScores is written flat (lm-eval's layout: {metric, metric_stderr,
metric_ci, n}). docs/reports.md documents every field and the version policy: SCHEMA_VERSION changes
when a field is renamed, removed or changes meaning; a results file of another version is refused,
one without a version (written before versions, same layout as version 1) is read as version 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptq.errors import PtqError, name_problem
from ptq.files import read_json

SCHEMA_VERSION = 1
COMMANDS = ("compare", "eval")

Interval = tuple[float, float]  # a 95% interval [low, high]


# --- the run: model, computation, evaluation text, statistics ---------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str  # as given (Hub id, folder, .gguf file, or smollm2)
    source: str  # where the weights came from (a folder, a Hub revision, a GGUF conversion)
    # what differs from the model as published (a GGUF conversion's dequantized weights, ...)
    caveats: list[str]


@dataclass(frozen=True, kw_only=True)
class Compute:
    device: str  # cpu, cuda, cuda:0
    dtype: str  # float32 or bfloat16: the compute dtype
    matmul: str  # simulated or fp8 (real FP8 matmuls, torch._scaled_mm)
    low_memory: bool  # layer by layer from disk (--low-memory)
    # matmul fp8: why 128 x 128 weight blocks are simulated (None: real block-wise FP8 matmuls, or
    # matmul simulated)
    blockwise_simulated: str | None = None
    # and why layers with a partial row of blocks (out_features not a multiple of 128) are, where
    # whole blocks are not
    blockwise_partial_simulated: str | None = None
    placement: dict[str, dict[str, int]] | None = (
        None  # --device-map: per model, device-map entries per device
    )
    # on a CPU: the vector instruction set torch's kernels run with (AVX2, AVX512, ...), and the
    # processor's model name. Their float32 results round apart in the last bits per set and per
    # processor, so a perplexity repeats to every digit only on the same kind of CPU.
    cpu_kernels: str | None = None
    cpu: str | None = None


@dataclass(frozen=True, kw_only=True)
class EvalSetup:
    """The evaluation text and its windows."""

    data: str  # the text's source
    data_sha256: str
    seq_len: int  # tokens per window
    # text tokens between the starts of the grid's windows: seq_len, less 1 where a BOS starts each
    stride: int
    windows: int
    tokens: int  # predicted tokens scored, over all windows
    bos: bool  # whether a BOS token starts every window
    description: str  # one line: how the windows were taken from the text


@dataclass(frozen=True, kw_only=True)
class Statistics:
    """How the intervals are made."""

    method: str  # percentile bootstrap
    resamples: int
    seed: int
    confidence: float  # 0.95


# --- what a configuration is, and what it quantizes -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RecipeSummary:
    name: str
    description: str
    weights: str  # the weights' format and granularity, e.g. "e4m3 per-tensor"
    inputs: str  # the Linear inputs' format, granularity and scale, e.g. "e4m3 per-tensor"
    ignore: list[str]  # layers left out (name patterns)
    source: str  # the recipe file's name
    attention: str | None  # attention's batched-matmul inputs, with the tensors quantized
    kv_cache: str | None
    smoothquant_alpha: float | None
    residual: str | None  # residual-add inputs


@dataclass(frozen=True, kw_only=True)
class LeftOut:
    name: str  # a matmul weight that stays in the compute dtype
    params: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class AttentionLeftOut:
    # "<layer>.kv_cache.key", "<layer>.query", ... or an attention layer ptq cannot quantize, whole
    name: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """What share of the model's matmul weights (Linear, Conv1D, experts, lm_head, routers) a recipe
    quantizes."""

    quantized_weight_params: int
    matmul_weight_params: int
    left_out: list[LeftOut]  # largest first
    # the attention inputs and KV-cache tensors the recipe asks for that stay in the compute dtype
    attention_left_out: list[AttentionLeftOut] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class LayerSnr:
    """Quantization SNR in dB per layer (None: exact), in model order."""

    weights: dict[str, float | None]
    # on the variant's own inputs over the first `input_windows` windows
    inputs: dict[str, float | None]
    input_windows: int


# --- tasks (lm-evaluation-harness) ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TaskInfo:
    name: str
    kind: str | None  # lm-eval's output_type (multiple_choice, generate_until, ...) or "group of N"
    n: int  # documents
    metrics: list[str]  # lm-eval's metric keys: acc, acc_norm, exact_match,strict-match, ...
    higher_is_better: dict[str, bool]
    num_fewshot: int | None
    group: str | None  # the group the task is a member of
    source: str
    notes: list[str]
    chance: float | None  # a uniform guess's accuracy (multiple choice)
    documents_sha256: str  # over lm-eval's document hashes


@dataclass(frozen=True, kw_only=True)
class TaskScoring:
    harness: str  # "lm-eval 0.4.13"
    batch_size: int
    limit: float | None  # --limit
    num_fewshot: int | None  # --num-fewshot
    requested: list[str]  # the --tasks entries


@dataclass(frozen=True, kw_only=True)
class TaskMetric:
    value: float  # lm-eval's
    stderr: float | None  # lm-eval's (None where it gives none)
    ci: Interval  # bootstrap over the documents


@dataclass(frozen=True, kw_only=True)
class TaskScores:
    """One task's scores in an entry; written flat, as lm-eval reports them: {metric: value,
    metric_stderr: s, metric_ci: [low, high], ..., n: documents}."""

    n: int
    metrics: dict[str, TaskMetric]

    def _to_json(self) -> dict:
        out: dict[str, Any] = {}
        for name, m in self.metrics.items():
            out |= {name: m.value, f"{name}_stderr": m.stderr, f"{name}_ci": list(m.ci)}
        return out | {"n": self.n}

    @classmethod
    def _from_json(cls, data: Any, where: str) -> TaskScores:
        data = _expect(dict, data, where)
        names = [k for k in data if k != "n" and not k.endswith(("_stderr", "_ci"))]
        metrics = {}
        for name in names:
            for key in (f"{name}_stderr", f"{name}_ci"):
                if key not in data:
                    raise _Invalid(f"{where}: '{key}' is missing")
            metrics[name] = TaskMetric(
                value=_parse(float, data[name], f"{where}.{name}"),
                stderr=_parse(float | None, data[f"{name}_stderr"], f"{where}.{name}_stderr"),
                ci=_parse(Interval, data[f"{name}_ci"], f"{where}.{name}_ci"),
            )
        if "n" not in data:
            raise _Invalid(f"{where}: 'n' is missing")
        return cls(n=_parse(int, data["n"], f"{where}.n"), metrics=metrics)


@dataclass(frozen=True, kw_only=True)
class TaskDelta:
    """A variant's paired delta against the baseline on one task metric, over the same documents."""

    delta: float  # variant - baseline (a fraction)
    stderr: float
    ci: Interval
    significant: bool  # the interval excludes 0
    n: int
    recovery_pct: float  # 100 * variant / baseline


# --- the baseline, the variants, the configuration of eval ----------------------------------------


@dataclass(frozen=True, kw_only=True)
class Entry:
    """The measurements of one configuration: compare's baseline, eval's configuration, and
    (Variant) each of compare's variants."""

    name: str
    recipe: RecipeSummary
    perplexity: float
    accuracy: float  # next-token accuracy: top-1 prediction equals the next token
    window_nll: list[float]  # mean negative log-likelihood of each window
    coverage: Coverage
    perplexity_stderr: float
    perplexity_ci: Interval
    accuracy_stderr: float
    accuracy_ci: Interval
    tasks: dict[str, TaskScores] | None = None  # per task (--tasks)
    task_samples: dict[str, dict[str, list[float]]] | None = (
        None  # per task and metric: each document's value
    )


@dataclass(frozen=True, kw_only=True)
class Variant(Entry):
    """A quantized variant, measured against the baseline on the same windows."""

    ppl_delta_pct: float  # 100 * (perplexity / baseline perplexity - 1)
    accuracy_delta: float  # accuracy - baseline accuracy (a fraction)
    kl_div: float  # mean KL(p_baseline || p_variant) per predicted token, nats
    top1_agreement: float  # share of positions where the top-1 token equals the baseline's
    snr_db: LayerSnr | None  # None: the variant quantizes no layer to 8 bits
    kl_div_stderr: float
    kl_div_ci: Interval
    top1_agreement_stderr: float
    top1_agreement_ci: Interval
    ppl_delta_pct_stderr: float  # paired over windows
    ppl_delta_pct_ci: Interval
    ppl_delta_significant: bool  # the interval excludes 0
    accuracy_delta_stderr: float
    accuracy_delta_ci: Interval
    accuracy_delta_significant: bool
    task_deltas: dict[str, dict[str, TaskDelta]] | None = None  # per task and metric (--tasks)


# --- calibration, diagnostics, gates
# ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LayerAmax:
    layer: str
    input_amax: float
    weight_amax: float


@dataclass(frozen=True, kw_only=True)
class CalibrationSummary:
    layers: int
    input_amax_min: float
    input_amax_median: float
    input_amax_max: float
    largest: list[LayerAmax]  # the layers with the largest input amax, largest first


@dataclass(frozen=True, kw_only=True)
class UnseenLayer:
    layer: str  # a layer no calibration data reached (an MoE expert)
    input_amax: float  # the amax it was given
    rule: str  # how (--on-unseen fallback: its siblings' largest)


@dataclass(frozen=True, kw_only=True)
class CalibrationFaults:
    """What calibration worked around."""

    on_nonfinite: str  # --on-nonfinite: fail or skip
    unseen_layers: list[UnseenLayer]
    nonfinite_batches: dict[str, int]  # per layer: batches with NaN/inf inputs left out of its amax
    warnings: list[str]  # the range rule's


@dataclass(frozen=True, kw_only=True)
class CalibrationEntry:
    source: str  # a calibration file, or calibrated in this run
    data: str | None
    data_sha256: str | None
    windows: int | None
    seq_len: int | None
    tokens: int | None
    batch_size: int | None
    summary: CalibrationSummary
    faults: CalibrationFaults
    layers: list[LayerAmax]  # every calibrated Linear layer, in model order


@dataclass(frozen=True, kw_only=True)
class TensorSqnr:
    tensor: str
    amax: float
    sqnr_e4m3_db: float | None  # None: exact
    sqnr_int8_db: float | None


@dataclass(frozen=True, kw_only=True)
class Diagnostics:
    """Per-tensor SQNR under a static per-tensor scale, from the calibration histograms."""

    method: str
    tensors: list[TensorSqnr]
    worst_e4m3: list[str]  # tensor names, worst first
    worst_int8: list[str]


@dataclass(frozen=True)
class Limits:
    """The gates' limits (ptq.reporting.gates)."""

    max_ppl_increase_pct: float | None = None
    min_accuracy_recovery_pct: float | None = (
        None  # next-token accuracy and every task without its own limit
    )
    task_accuracy_recovery_pct: dict[str, float] = field(default_factory=dict)
    max_kl: float | None = None

    def any(self) -> bool:
        return (
            self.max_ppl_increase_pct is not None
            or self.min_accuracy_recovery_pct is not None
            or bool(self.task_accuracy_recovery_pct)
            or self.max_kl is not None
        )

    def describe(self) -> list[str]:
        parts = []
        if self.max_ppl_increase_pct is not None:
            parts.append(f"perplexity increase <= {self.max_ppl_increase_pct:g}%")
        if self.min_accuracy_recovery_pct is not None:
            parts.append(f"accuracy recovery >= {self.min_accuracy_recovery_pct:g}%")
        parts += [
            f"{task} accuracy recovery >= {v:g}%"
            for task, v in self.task_accuracy_recovery_pct.items()
        ]
        if self.max_kl is not None:
            parts.append(f"KL <= {self.max_kl:g} nats/token")
        return parts


def fmt_against(value: float, limit: float | None, spec: str, *landmarks: float) -> str:
    """`value` formatted by `spec` ("+.2f", ".2f", ".5f", ".4g"), with as many more digits as it
    takes not to read as `limit` when it is not the limit: a Δ ppl of 2.004% against a 2% limit
    prints +2.004%, not +2.00%, and a KL of 4e-06 against 1e-06 prints 0.000004 under ".5f", not
    0.00000. `landmarks`: other values it must not read as unless it is them (0 for an interval's
    end next to "distinguishable from 0", 100 for a share that is not all). Values well away from
    them print as `spec`."""
    sign, _, rest = spec.rpartition(".")
    digits, kind = int(rest[:-1]), rest[-1]
    apart = [x for x in (limit, *landmarks) if x is not None and math.isfinite(x) and x != value]
    if math.isfinite(value):
        while digits < 17 and any(
            float(f"{value:.{digits}{kind}}") == float(f"{x:.{digits}{kind}}") for x in apart
        ):
            digits += 1
    return f"{value:{sign}.{digits}{kind}}"


@dataclass(frozen=True)
class Check:
    """One gate against one variant."""

    variant: str
    # "ppl_delta_pct", "accuracy_recovery_pct", "kl_div" or "finite_outputs" (fails: perplexity not
    # finite)
    metric: str
    task: str | None  # for accuracy recovery: NEXT_TOKEN or a task name
    value: float | None  # None: the task is not in the results, which fails its gate
    limit: float
    passed: bool
    task_metric: str | None = (
        None  # the task's metric (acc, acc_norm, exact_match,strict-match); None: accuracy
    )

    def describe(self) -> str:
        if self.value is None:
            return f"{self.variant}: {self.task} accuracy was not measured (its gate needs it)"
        if self.metric == "ppl_delta_pct":
            value = fmt_against(self.value, self.limit, "+.2f")
            return f"{self.variant}: perplexity {value}% {self._op('<=', '>')} +{self.limit:g}%"
        if self.metric == "finite_outputs":
            return (
                f"{self.variant}: perplexity {self.value} (NaN or inf logits): a model whose "
                "outputs are not numbers fails every gate"
            )
        if self.metric == "kl_div":
            value = fmt_against(self.value, self.limit, ".4g")
            return f"{self.variant}: KL {value} {self._op('<=', '>')} {self.limit:g}"
        what = f"{self.task} {self.task_metric}" if self.task_metric else f"{self.task} accuracy"
        value = fmt_against(self.value, self.limit, ".2f")
        return f"{self.variant}: {what} recovery {value}% {self._op('>=', '<')} {self.limit:g}%"

    def _op(self, meets: str, beyond: str) -> str:
        """How the value compares with the limit: a NaN is neither within nor beyond it, and
        fails."""
        if self.passed:
            return meets
        return f"is not {meets}" if self.value is not None and math.isnan(self.value) else beyond


@dataclass(frozen=True, kw_only=True)
class Gates:
    limits: Limits
    passed: bool  # every check passed
    checks: list[Check]


# --- the documents
# -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Run:
    """What both documents hold: how the numbers were measured."""

    schema_version: int = SCHEMA_VERSION
    command: str  # "compare" or "eval"
    model: ModelInfo
    device: str  # one line: where and how the models ran
    compute: Compute
    eval: EvalSetup
    protocol: list[str]  # how the numbers were measured, one sentence each
    target: str  # --target: the engine whose load-time rules the simulation applies
    statistics: Statistics
    calibration: CalibrationEntry | None  # None: no recipe needed one
    tasks: list[TaskInfo] | None = None  # --tasks, in lm-eval's order
    task_scoring: TaskScoring | None = None
    # package -> version (ptq, torch, transformers, python; lm_eval with --tasks)
    versions: dict[str, str]
    created: str  # ISO 8601, UTC (SOURCE_DATE_EPOCH pins it)


@dataclass(frozen=True, kw_only=True)
class CompareResults(Run):
    """`ptq compare`: the bf16 baseline and each variant on the same windows."""

    command: str = "compare"
    baseline: Entry
    variants: list[Variant]
    diagnostics: Diagnostics | None = None  # when calibrated with histograms
    gates: Gates | None = None  # None: no gate was given


@dataclass(frozen=True, kw_only=True)
class EvalResults(Run):
    """`ptq eval`: one configuration, no baseline."""

    command: str = "eval"
    config: Entry


Results = CompareResults | EvalResults


# --- writing
# ---------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """A results document (or any part of it) as JSON values: dataclasses as objects keyed by field
    name, tuples as lists."""
    if hasattr(value, "_to_json"):
        return value._to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def dumps(results: Results) -> str:
    """The text of results.json."""
    return json.dumps(to_json(results), indent=2) + "\n"


# --- reading
# ---------------------------------------------------------------------------------------


class _Invalid(Exception):
    """A field that does not match the schema: the message names it, e.g. variants[0].kl_div."""


def load_results(path: Path, what: str = "results file") -> Results:
    """The typed document of a results.json, or a PtqError in one line naming what is wrong with the
    file."""
    path = Path(path)
    # the folder compare wrote (--out): its results.json
    if path.is_dir() and (path / "results.json").is_file():
        path = path / "results.json"
    if path.is_dir():
        raise PtqError(f"{what} {path} is a folder without a results.json")
    if not path.is_file():
        raise PtqError(f"{what} {path} does not exist")
    # the one reader of JSON from outside: malformed or nested too deeply is one line naming it
    data = read_json(path, f"{what} {path}")
    return from_json(data, str(path))


def load_compare(path: Path, what: str = "results file") -> CompareResults:
    """load_results, for a reader of `ptq compare` results (they have a baseline and variants)."""
    results = load_results(path, what)
    if not isinstance(results, CompareResults):
        raise PtqError(
            f"{path} holds `ptq {results.command}` results, not `ptq compare` results (no baseline)"
        )
    return results


def from_json(data: Any, name: str = "results") -> Results:
    """The typed document of parsed results.json content; `name` (the file) starts every error
    message."""
    if not isinstance(data, dict):
        raise PtqError(
            f"{name} is not a ptq results file: a JSON object expected, not {_kind(data)}"
        )
    version = data.get("schema_version")
    legacy = "schema_version" not in data
    if not legacy and (not isinstance(version, int) or isinstance(version, bool)):
        raise PtqError(f"{name}: schema_version must be an integer, not {json.dumps(version)}")
    if not legacy and version != SCHEMA_VERSION:
        advice = (
            "upgrade ptq to read it"
            if version > SCHEMA_VERSION
            else "rerun the command to write it anew"
        )
        raise PtqError(
            f"{name} has results schema version {version}; this ptq reads version "
            f"{SCHEMA_VERSION}: {advice}"
        )
    # files from before the version: compare's had no `command`
    command = data.get("command", "compare")
    cls = (
        {"compare": CompareResults, "eval": EvalResults}.get(command)
        if isinstance(command, str)
        else None
    )
    try:
        if cls is None:
            raise _Invalid(
                f"command: expected one of {', '.join(COMMANDS)}, not {json.dumps(command)}"
            )
        results = _parse(cls, {**data, "schema_version": SCHEMA_VERSION, "command": command}, "")
        _check_references(results)
        return results
    except _Invalid as e:
        written = " (written before schema versions: rerun the command)" if legacy else ""
        raise PtqError(
            f"{name} is not a valid ptq results file of schema version {SCHEMA_VERSION}{written}: "
            f"{e}"
        ) from None


def _check_references(results: Results) -> None:
    """What the schema's types alone do not say and the readers rely on: every entry has a score for
    each task and metric the document lists, names fit in a table row, a recipe names its
    formats."""
    entries = (
        [
            ("baseline", results.baseline),
            *((f"variants[{i}]", v) for i, v in enumerate(results.variants)),
        ]
        if isinstance(results, CompareResults)
        else [("config", results.config)]
    )
    for i, task in enumerate(results.tasks or []):
        if problem := name_problem(task.name):
            raise _Invalid(f"tasks[{i}].name: {problem}")
        for where, e in entries:
            scores = (e.tasks or {}).get(task.name)
            missing = [m for m in task.metrics if scores is None or m not in scores.metrics]
            if missing:
                raise _Invalid(
                    f"{where}.tasks.{task.name}: no score for {missing[0]}, which tasks[{i}] lists"
                )
    for where, e in entries:
        if problem := name_problem(e.name):
            raise _Invalid(f"{where}.name: {problem}")
        for part in ("weights", "inputs"):
            if not getattr(e.recipe, part).split():
                raise _Invalid(
                    f"{where}.recipe.{part}: empty (a format, such as 'e4m3 per-tensor')"
                )
    _check_measurements(results, entries)


def _check_measurements(results: Results, entries: list[tuple[str, Entry]]) -> None:
    """The numbers a report shows side by side, and the gates judge, must be one run's: a value no
    measurement gives (a perplexity under 1, an agreement over 100%), a delta that is not its
    variant's against the baseline, or windows other than the run's, is a file edited or damaged,
    which would be rendered and judged as it stands."""
    names = [e.name for _, e in entries]
    if len(set(names)) < len(names):
        raise _Invalid(
            f"the name '{next(n for n in names if names.count(n) > 1)}' is given to two "
            "configurations"
        )

    # NaN: a measurement that failed, reported as such
    def within(value: float, low: float, high: float) -> bool:
        return math.isnan(value) or low <= value <= high

    def agrees(stored: float, computed: float) -> bool:
        return (math.isnan(stored) and math.isnan(computed)) or math.isclose(
            stored, computed, rel_tol=1e-6, abs_tol=1e-9
        )

    for where, e in entries:
        if len(e.window_nll) != results.eval.windows:
            raise _Invalid(
                f"{where}.window_nll: {len(e.window_nll)} values for the run's "
                f"{results.eval.windows} windows"
            )
        # a perplexity is exp(mean NLL) >= 1, less a rounding where every token was all but certain
        for field_name, low, high in (("perplexity", 1 - 1e-6, math.inf), ("accuracy", 0, 1)):
            if not within(getattr(e, field_name), low, high):
                raise _Invalid(
                    f"{where}.{field_name}: {getattr(e, field_name)} is not a possible value"
                )
    if not isinstance(results, CompareResults):
        return
    base = results.baseline
    for i, v in enumerate(results.variants):
        where = f"variants[{i}]"
        for field_name, low, high in (("kl_div", 0, math.inf), ("top1_agreement", 0, 1)):
            if not within(getattr(v, field_name), low, high):
                raise _Invalid(
                    f"{where}.{field_name}: {getattr(v, field_name)} is not a possible value"
                )
        ppl_delta = 100 * (v.perplexity / base.perplexity - 1) if base.perplexity else math.nan
        if not agrees(v.ppl_delta_pct, ppl_delta):
            raise _Invalid(
                f"{where}.ppl_delta_pct: {v.ppl_delta_pct:+.4g}% is not its perplexity "
                f"{v.perplexity:.6g} against the baseline's {base.perplexity:.6g} "
                f"({ppl_delta:+.4g}%)"
            )
        if not agrees(v.accuracy_delta, v.accuracy - base.accuracy):
            raise _Invalid(
                f"{where}.accuracy_delta: {v.accuracy_delta:+.6g} is not its accuracy "
                f"{v.accuracy:.6g} less the baseline's {base.accuracy:.6g}"
            )


def parse(kind: Any, value: Any) -> Any:
    """`value` (JSON values, as other modules give them) as `kind`, a type of this schema, checked
    all the way down: how the builder (ptq.commands.results) takes in what calibration, evaluation
    and lm-eval report."""
    try:
        return _parse(kind, value, "")
    except _Invalid as e:
        raise ValueError(f"not a valid {getattr(kind, '__name__', kind)}: {e}") from None


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), "a number")


def _expect(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, kind):
        raise _Invalid(f"{where or 'the document'}: expected {_kind(kind())}, got {_kind(value)}")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(kind: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as `kind` (a type of this schema), checked all the way down."""
    if hasattr(kind, "_from_json"):
        return kind._from_json(value, where)
    if dataclasses.is_dataclass(kind):
        value = _expect(dict, value, where)
        hints, args = _hints(kind), {}
        for f in dataclasses.fields(kind):
            here = f"{where}.{f.name}" if where else f.name
            if f.name in value:
                args[f.name] = _parse(hints[f.name], value[f.name], here)
            elif (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            ):
                continue  # its default
            elif _optional(hints[f.name]):
                args[f.name] = None
            else:
                raise _Invalid(f"{here} is missing")
        return kind(**args)
    origin, params = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in params:
            return None
        (inner,) = [p for p in params if p is not type(None)]
        return _parse(inner, value, where)
    if origin is list:
        return [
            _parse(params[0], v, f"{where}[{i}]") for i, v in enumerate(_expect(list, value, where))
        ]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(params):
            raise _Invalid(f"{where}: expected a list of {len(params)} numbers, got {_kind(value)}")
        return tuple(_parse(p, v, f"{where}[{i}]") for i, (p, v) in enumerate(zip(params, value)))
    if origin is dict:
        value = _expect(dict, value, where)
        return {k: _parse(params[1], v, f"{where}.{k}") for k, v in value.items()}
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid(f"{where}: expected a number, got {_kind(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise _Invalid(
                f"{where}: an integer of {value.bit_length()} bits is beyond a float's range"
            ) from None
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(
                f"{where}: expected an integer, got "
                f"{_kind(value) if not isinstance(value, float) else value}"
            )
        return value
    if kind in (str, bool):
        if not isinstance(value, kind):
            raise _Invalid(f"{where}: expected {_kind(kind())}, got {_kind(value)}")
        return value
    # a type added to the schema without one
    raise TypeError(f"results schema: no reader for {kind!r}")


def _optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (types.UnionType, typing.Union) and type(
        None
    ) in typing.get_args(kind)
