"""Task accuracy by lm-evaluation-harness (lm-eval 0.4), on the models ptq built, in memory.

Each model (the baseline and every variant) is wrapped as
`lm_eval.models.huggingface.HFLM(pretrained=model)` and scored by
`lm_eval.simple_evaluate(..., log_samples=True)` on the same tasks: the numbers are lm-eval's, the
ones `lm_eval --model hf` prints for the same weights. What lm-eval does not give, ptq adds from its
per-sample results: every variant paired with the baseline on the same documents
(ptq.evaluation.stats).

Task specs (`--tasks`, comma-separated):

    NAME                  an lm-eval task, group or tag by name (hellaswag, mmlu, gsm8k, ...):
                          its dataset from the Hugging Face Hub, so a network or a warm datasets
                          cache
    NAME=FILE.jsonl       an lm-eval task over a local copy of its dataset (rows in the dataset's
                          own fields); or, when the rows are {"context": ..., "choices": [...],
                          "label": i}, a multiple-choice task of that name
                          (lm_eval_tasks/_ptq_choice.yaml)
    FILE.jsonl            the same, named after the file
    FILE.yaml, FOLDER     task YAML files (lm-eval's format): the task(s) they define
    cloze, cloze=TEXT     cloze items ptq builds from the evaluation text (or TEXT), scored by
                          lm-eval (lm_eval_tasks/_ptq_cloze.yaml)

The generated task files (cloze items, local copies) are written to a temporary folder, removed at
exit; what each task was (its source, its documents' sha256) is in results.json's `tasks`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from ptq.errors import PtqError, name_problem
from ptq.evaluation.recovery import accuracy_recovery_pct, higher_is_better, ratio_pct
from ptq.files import parse_json, read_yaml

TASKS_DIR = Path(__file__).resolve().with_name("lm_eval_tasks")  # the task YAMLs ptq ships
# opens a task note naming metrics ptq cannot pair (describe_tasks; the console)
NOT_REPORTED = "not reported:"
CHOICE_TEMPLATE = TASKS_DIR / "_ptq_choice.yaml"
CLOZE_TEMPLATE = TASKS_DIR / "_ptq_cloze.yaml"
CHOICE_FIELDS = ("context", "choices", "label")


@dataclass
class Suite:
    """The tasks of one run, as lm-eval will load them."""

    names: list[str]  # what simple_evaluate is asked for, in the order given
    include_paths: list[Path]
    include_defaults: bool  # whether lm-eval's own tasks are needed (indexing them takes seconds)
    sources: dict[str, str]  # name -> where it comes from, in words
    notes: dict[str, list[str]] = field(default_factory=dict)
    num_fewshot: int | None = None
    limit: float | None = None
    scored: set[str] = field(
        default_factory=set
    )  # the tasks and aggregating groups results will hold (load_check)

    def task_manager(self):
        with quiet_lm_eval():
            return _manager(tuple(str(p) for p in self.include_paths), self.include_defaults)


@functools.lru_cache(maxsize=1)
def _default_index() -> dict:
    """lm-eval's index of its own ~15,000 task configs (about 10 s to build here): built once per
    process."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex().build([Path(lm_eval.tasks.__file__).parent])


def _manager(include_paths: tuple[str, ...], defaults: bool):
    """TaskManager(include_path=..., include_defaults=defaults), with lm-eval's own index reused
    from _default_index: the same entries (include paths override lm-eval's tasks, as TaskManager
    merges them), built once per process."""
    from collections import defaultdict

    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    manager = TaskManager(include_path=list(include_paths) or None, include_defaults=False)
    if defaults:
        manager._index = {**_default_index(), **manager._index}
        kinds = defaultdict(list)
        for name, entry in manager._index.items():
            kinds[entry.kind].append(name)
        manager._all_tasks = sorted(manager._index)
        manager._all_subtasks = sorted(kinds[Kind.TASK] + kinds[Kind.PY_TASK])
        manager._all_groups = sorted(kinds[Kind.GROUP])
        manager._all_tags = sorted(kinds[Kind.TAG])
    return manager


def lm_eval_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lm_eval")


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval logs every step at INFO and warns about passing a built model (which is what ptq
    means to do): keep its errors only, and its progress bars and datasets' off when ptq is
    quiet."""
    import lm_eval.loggers.utils as lm_eval_utils

    from ptq import progress

    # lm-eval records `git describe` of the working directory: outside a git checkout git's "fatal:
    # not a git repository" went to ptq's stderr. The same command, its stderr discarded (its result
    # is unchanged).
    git = lm_eval_utils.subprocess
    lm_eval_utils.subprocess = _QuietSubprocess(git)
    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    bars = []  # lm-eval's modules that draw tqdm bars (requests, tokenizing, building requests)
    if progress.QUIET:
        import datasets
        import lm_eval.api.model
        import lm_eval.api.task
        import lm_eval.models.huggingface

        datasets.disable_progress_bars()
        for module in (lm_eval.api.model, lm_eval.api.task, lm_eval.models.huggingface):
            bars.append((module, module.tqdm))
            module.tqdm = _silenced(module.tqdm)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for module, bar in bars:
            module.tqdm = bar
        lm_eval_utils.subprocess = git


class _QuietSubprocess:
    """The subprocess module, its check_output with stderr discarded unless told otherwise."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def check_output(self, *args, **kwargs):
        return self._module.check_output(*args, **{"stderr": self._module.DEVNULL, **kwargs})


def _silenced(bar):
    return lambda *args, **kwargs: bar(*args, **(kwargs | {"disable": True}))


# ----------------------------------------------------------------------------------------------
# Specs -> lm-eval tasks


def _split_specs(spec: str) -> list[tuple[str, str | None]]:
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, path = (s.strip() for s in part.partition("="))
        if sep and not (name and path):
            raise PtqError(
                f"bad task '{part}': expected NAME, NAME=FILE.jsonl, FILE.jsonl, FILE.yaml or a "
                "folder"
            )
        out.append((name, path) if sep else (part, None))
    if not out:
        raise PtqError(f"--tasks '{spec}' names no task (e.g. --tasks cloze; --tasks '' for none)")
    return out


def task_paths(spec: str | None) -> list[str]:
    """What --tasks `spec` may read from disk (NAME=FILE.jsonl, FILE.jsonl, FILE.yaml, a folder of
    task files, cloze=TEXT's text): the paths as given, whether or not they exist."""
    from ptq.evaluation.data import spec_source

    if not spec:
        return []
    return [
        spec_source(path) if name == "cloze" else path or name
        for name, path in _split_specs(spec)
        if name != "cloze" or path
    ]


def scores_cloze(spec: str | None) -> bool:
    """Whether --tasks `spec` has the cloze task built from text (what --max-items caps)."""
    return bool(spec) and any(name == "cloze" for name, _ in _split_specs(spec))


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise PtqError(f"task file {path} does not exist")
    from ptq.evaluation.data import check_text_size, read_text

    rows = []
    check_text_size([path], f"task file {path}")
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        row = parse_json(line, f"{path}, line {number}")
        if not isinstance(row, dict):
            raise PtqError(f"{path}, line {number}: expected a JSON object")
        rows.append((number, row))
    if not rows:
        raise PtqError(f"task file {path} has no rows")
    return rows


def check_choice_row(path: Path, number: int, row: dict) -> None:
    context, choices, label = row["context"], row["choices"], row["label"]
    where = f"{path}, line {number}"
    if not isinstance(context, str):
        raise PtqError(f"{where}: 'context' must be text")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise PtqError(f"{where}: 'choices' must be a list of at least two non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise PtqError(f"{where}: 'label' must be an integer index into the {len(choices)} choices")


def _task_yaml(name: str, include: Path, data: dict[str, str], extra: dict | None = None) -> str:
    config = {
        "include": str(include),
        "task": name,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": data},
        **(extra or {}),
    }
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def _check_includes(path: Path, seen: tuple[Path, ...] = ()) -> None:
    """Read a task file and the files it includes, as lm-eval resolves them (`include:` a path
    relative to the including file's folder, or absolute): a file that is not there is named, where
    lm-eval's index would drop the task in silence ("defines no lm-eval task")."""
    config = read_yaml(path, "task file", tags=True)
    includes = config.get("include") if isinstance(config, dict) else None
    for include in (
        includes if isinstance(includes, list) else [includes] if includes is not None else []
    ):
        if not isinstance(include, str):
            raise PtqError(f"task file {path}: include: {include!r} is not a file name")
        found = (
            Path(include).expanduser()
            if Path(include).expanduser().is_absolute()
            else path.parent / include
        )
        if not found.is_file():
            raise PtqError(
                f"task file {path} includes {include}, which is not a file ({found}: an include is "
                "found beside the file that includes it, or by its absolute path)"
            )
        if found.resolve() in seen:
            raise PtqError(f"task file {path} includes {include}, which includes it again")
        _check_includes(found, (*seen, path.resolve()))
        # a text file that YAML reads as a string: lm-eval's index dropped the including task
        if not isinstance(included := read_yaml(found, "task file", tags=True), dict):
            kind = {str: "text", list: "a list", type(None): "nothing"}.get(type(included))
            raise PtqError(
                f"task file {path} includes {include}, which is not a task YAML: {found} reads as "
                f"{kind or 'a value'}, not a mapping of keys (task:, dataset_path:, ...)"
            )


def _yaml_names(target: Path) -> list[str]:
    """The tasks a YAML file or a folder of them defines, as lm-eval indexes them (groups first: a
    folder that defines groups runs its groups, not their members twice)."""
    from lm_eval.tasks._index import Kind, TaskIndex

    # lm-eval's index passes over a file it cannot read in silence: the user's files are read here
    # first, so that a typo is named with its line, not reported as "no task" (or, with a key given
    # twice, run as the other task)
    for path in (
        sorted(p for p in target.rglob("*") if p.suffix in (".yaml", ".yml"))
        if target.is_dir()
        else [target]
    ):
        _check_includes(path)
    folder = target if target.is_dir() else target.parent
    with quiet_lm_eval():
        index = TaskIndex().build([folder])
    entries = [e for e in index.values() if e.kind in (Kind.GROUP, Kind.TASK, Kind.PY_TASK)]
    if target.is_file():
        entries = [
            e
            for e in entries
            if e.yaml_path is not None and Path(e.yaml_path).resolve() == target.resolve()
        ]
    groups = [e.name for e in entries if e.kind == Kind.GROUP]
    return sorted(groups) if groups else sorted(e.name for e in entries)


def prepare(
    spec: str,
    eval_corpus: Callable,
    work: Path,
    *,
    max_items: int | None,
    num_fewshot: int | None = None,
    limit: float | None = None,
) -> Suite:
    """The lm-eval tasks of `spec`, with the files they need generated in `work` (cloze items, local
    copies). Every task is then loaded once by lm-eval, so that a task it cannot find or whose data
    it cannot reach stops here, in one line, before any model is loaded."""
    from ptq.evaluation.data import load_corpus
    from ptq.evaluation.tasks import build_cloze, cloze_rows, scored_chance, subsample

    work.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    include: list[Path] = [TASKS_DIR]
    sources, notes, by_name = {}, {}, []
    for name, path in _split_specs(spec):
        if name == "cloze":
            corpus = load_corpus(path, role="evaluation") if path else eval_corpus()
            task = subsample(build_cloze(corpus), max_items)
            data = work / "cloze.jsonl"
            _write(
                data, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in cloze_rows(task))
            )
            _write(work / "cloze.yaml", _task_yaml("cloze", CLOZE_TEMPLATE, {"test": str(data)}))
            names.append("cloze")
            sources["cloze"] = (
                f"{task.source}; {len(task.items)} of {task.available} items (evenly spaced)"
                if len(task.items) < task.available
                else f"{task.source}; all {len(task.items)} items"
            )
            chance, scored = scored_chance(task, limit)  # of the items --limit leaves, not of all
            notes["cloze"] = list(task.notes) + [
                f"chance {100 * chance:.1f}%: {task.chance_note}"
                + (f" (over the {scored} items --limit scores)" if scored < len(task.items) else "")
            ]
            continue
        target = Path(path or name)
        if (
            path is None
            and target.suffix in (".yaml", ".yml")
            or (path is None and target.is_dir())
        ):
            if not target.exists():
                raise PtqError(f"task file {target} does not exist")
            found = _yaml_names(target)
            if not found:
                raise PtqError(
                    f"{target} defines no lm-eval task (a YAML file with a 'task:' or 'group:' "
                    "name)"
                )
            include.append(target.resolve() if target.is_dir() else target.resolve().parent)
            names += found
            sources |= {n: f"{target}" for n in found}
            continue
        if path is None and target.suffix != ".jsonl":
            names.append(name)  # an lm-eval task by name, checked below
            by_name.append(name)
            continue
        if path is not None and (target.is_dir() or target.suffix in (".yaml", ".yml")):
            raise PtqError(
                f"{name}={path}: NAME=FILE takes a .jsonl file of rows; a task YAML or a folder of "
                f"them is given without NAME= (--tasks {path}: its tasks are named inside it)"
            )
        task_name = name if path is not None else target.stem
        rows = _jsonl_rows(target)
        if all(f in rows[0][1] for f in CHOICE_FIELDS):
            for number, row in rows:
                if not all(f in row for f in CHOICE_FIELDS):
                    raise PtqError(
                        f"{target}, line {number}: expected the fields '{', '.join(CHOICE_FIELDS)}'"
                    )
                check_choice_row(target, number, row)
            _write(
                work / f"{task_name}.yaml",
                _task_yaml(task_name, CHOICE_TEMPLATE, {"test": str(target.resolve())}),
            )
            sources[task_name] = f"{target} ({len(rows)} items; context, choices, label)"
        elif path is not None:
            by_name.append(("local", task_name, target))
            sources[task_name] = (
                f"lm-eval task {task_name} on the local file {target} ({len(rows)} rows)"
            )
        else:
            raise PtqError(
                f"{target}, line {rows[0][0]}: expected the fields '{', '.join(CHOICE_FIELDS)}' "
                f"(or name the lm-eval task these rows are for: TASK={target})"
            )
        names.append(task_name)
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise PtqError(f"task '{twice[0]}' given twice")
    for name in names:
        if problem := name_problem(name):
            raise PtqError(f"task {problem}")
    suite = Suite(
        names, list(dict.fromkeys([work, *include])), False, sources, notes, num_fewshot, limit
    )
    manager = suite.task_manager()
    if any(
        isinstance(n, tuple)
        and n[1] not in manager.all_tasks
        or isinstance(n, str)
        and n not in manager.all_tasks
        for n in by_name
    ):
        suite.include_defaults = (
            True  # lm-eval's own tasks are indexed only when a task needs them (seconds)
        )
        manager = suite.task_manager()
    for item in by_name:
        if isinstance(
            item, tuple
        ):  # an lm-eval task over a local file: its own config, its data from the file
            _, task_name, target = item
            entry = manager.task_index.get(task_name)
            if entry is None or entry.yaml_path is None:
                raise PtqError(
                    f"{target}: these rows are not in the fields {', '.join(CHOICE_FIELDS)}, and "
                    f"'{task_name}' is not an lm-eval task whose data they could be"
                )
            from lm_eval.tasks._yaml_loader import load_yaml

            config = load_yaml(entry.yaml_path, resolve_func=False)
            split = config.get("test_split") or config.get("validation_split") or "test"
            extra = {
                "test_split": split,
                "validation_split": None,
                "training_split": None,
                "fewshot_split": split
                if config.get("fewshot_split") or config.get("training_split")
                else None,
            }
            _write(
                work / f"{task_name}.yaml",
                _task_yaml(task_name, Path(entry.yaml_path), {split: str(target.resolve())}, extra),
            )
        elif item not in manager.all_tasks:
            raise PtqError(
                f"unknown task '{item}': not an lm-eval task, group or tag (list them with "
                "`lm_eval ls tasks`), nor a .jsonl/.yaml file or a folder"
            )
    if any(isinstance(item, tuple) for item in by_name):
        manager = suite.task_manager()  # the generated local copies, indexed
    for (
        name
    ) in names:  # a task ptq wrote must be the one lm-eval finds under its name, not a shipped one
        generated = work / f"{name}.yaml"
        entry = manager.task_index.get(name)
        found = Path(entry.yaml_path).resolve() if entry is not None and entry.yaml_path else None
        if generated.is_file() and found != generated.resolve():
            raise PtqError(
                f"task name '{name}' is taken by "
                f"{'ptq' if found and found.is_relative_to(TASKS_DIR) else 'lm-eval'}'s own task "
                f"of that name, which would run instead of {sources.get(name, 'yours')}: name "
                "yours otherwise (NAME=FILE.jsonl)"
            )
    load_check(suite, manager)
    return suite


def load_check(suite: Suite, manager) -> None:
    """Load every task once (its dataset included), turning lm-eval's and datasets' errors into one
    line. A task that may use the Hub is loaded from the local datasets cache only when the Hub
    cannot be used (data.hub_or_cache)."""
    from ptq.evaluation.data import cache_failure, hub_or_cache

    for name in suite.names:
        with hub_or_cache() if _uses_hub(name, manager) else contextlib.nullcontext() as offline:
            try:
                with quiet_lm_eval():
                    loaded = manager.load([name])
            except Exception as e:  # noqa: BLE001  (a missing dataset, no network, a bad YAML: one line for the user)
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                why = cache_failure(offline, e) if offline else f"{type(e).__name__}: {reason}"
                raise PtqError(
                    f"cannot load task '{name}': {why}. Offline, point it at local files: "
                    f"{name}=FILE.jsonl (rows in its dataset's own fields), or a task YAML with "
                    "dataset_path: json and dataset_kwargs: {data_files: ...}"
                ) from None
        for task_name, task in (
            (loaded.get("tasks") or {}).items() if isinstance(loaded, dict) else ()
        ):
            check_fewshot(task_name, task, suite.num_fewshot)
            suite.scored.add(task_name)
        groups = (loaded.get("groups") or {}) if isinstance(loaded, dict) else {}
        # a group has a row of its own only when it aggregates its members (describe_tasks)
        suite.scored |= {
            g for g, group in groups.items() if getattr(group, "aggregate_metric_list", None)
        }


LOCAL_BUILDERS = (
    "json",
    "csv",
    "text",
    "parquet",
    "arrow",
)  # datasets' packaged builders, which read data_files


def _uses_hub(name: str, manager) -> bool:
    """Whether loading task `name` may download from the Hub. Not for a task ptq ships (their data
    are files next to them), nor for one task whose data are local files read by one of datasets'
    packaged builders (ptq's generated tasks; a user's YAML with dataset_path: json); a group, a
    tag, a Python task or any other task may (so the Hub is probed for it: one quick connect per
    process)."""
    # lm-eval's own index and YAML reader (private modules: where they moved, the Hub is probed)
    try:
        from lm_eval.tasks._index import Kind
        from lm_eval.tasks._yaml_loader import load_yaml

        entry = manager.task_index.get(name)
    except (ImportError, AttributeError):
        return True
    if entry is None or entry.kind != Kind.TASK or entry.yaml_path is None:
        return True
    if Path(entry.yaml_path).resolve().parent == TASKS_DIR:
        return False
    try:
        modified = Path(entry.yaml_path).stat().st_mtime_ns
    except OSError:  # lm-eval's load says why
        return True
    return _reads_remote_data(str(entry.yaml_path), modified, load_yaml)


@functools.lru_cache(maxsize=256)
def _reads_remote_data(yaml_path: str, modified: int, load_yaml) -> bool:
    """Whether the task YAML at `yaml_path` (as of its modification time `modified`) may read its
    data from the Hub (see _uses_hub): read once for the check before the run and the run."""
    try:
        config = load_yaml(yaml_path, resolve_func=False)
    except Exception:  # noqa: BLE001  (a YAML lm-eval will refuse: its load says why)
        return True
    paths = _strings((config.get("dataset_kwargs") or {}).get("data_files"))
    return (
        config.get("dataset_path") not in LOCAL_BUILDERS
        or "custom_dataset" in config
        or not paths
        or any("://" in p for p in paths)
    )


def _strings(value) -> list[str]:
    """The file names in data_files: a name, a list of them, or a dict of split -> either."""
    if isinstance(value, str):
        return [value]
    values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [s for v in values for s in _strings(v)]


def check_fewshot(name: str, task, num_fewshot: int | None) -> None:
    """Refuse more few-shot examples (--num-fewshot, else the task's own num_fewshot) than the
    task's few-shot pool holds (lm-eval would stop with "Sample larger than population"); drawn from
    the test split itself (fewshot_split naming it: ptq's _ptq_choice.yaml and _ptq_cloze.yaml),
    lm-eval leaves the document being scored out, so one fewer."""
    config = getattr(task, "config", None)
    n = num_fewshot if num_fewshot is not None else getattr(config, "num_fewshot", None)
    if not n or config is None:
        return
    try:
        pool = len(list(task.fewshot_docs()))
    except Exception:  # noqa: BLE001  (a task whose pool lm-eval builds otherwise: left to lm-eval)
        return
    fewshot_split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    available = (
        pool - 1
        if fewshot_split is not None and fewshot_split == getattr(config, "test_split", None)
        else pool
    )
    if n > available:
        flag = f"--num-fewshot {n}" if num_fewshot is not None else f"its num_fewshot: {n}"
        raise PtqError(f"{name} has only {max(available, 0)} few-shot examples ({flag})")


# ----------------------------------------------------------------------------------------------
# Running


@dataclass
class ModelTasks:
    """What lm-eval returned for one model: its aggregate results and, per task, per metric, the
    per-document values (ordered by doc_id) that the pairing resamples."""

    results: dict  # lm-eval's results[task] (metric keys "acc,none", "acc_stderr,none", ...)
    samples: dict[str, dict[str, np.ndarray]]  # task -> "metric,filter" -> values per document
    doc_hashes: dict[
        str, list[str]
    ]  # task -> per document (to check that every model saw the same documents)
    choices: dict[str, list[int]]  # task -> number of choices per document (multiple choice)
    responses: dict[str, dict[str, list]]  # task -> filter -> lm-eval's filtered_resps per document


@dataclass
class HarnessRun:
    models: dict[str, ModelTasks]
    configs: dict  # task -> lm-eval's config of it
    n_shot: dict
    higher_is_better: dict
    group_subtasks: dict
    batch_size: int


def _per_document(
    samples: list[dict],
) -> tuple[dict[str, np.ndarray], list[str], list[int], dict[str, list]]:
    docs: dict[int, str] = {}
    responses: dict[str, dict[int, object]] = {}
    values: dict[str, dict[int, float]] = {}
    choices: dict[int, int] = {}
    for s in samples:
        doc = int(s["doc_id"])
        docs[doc] = s.get("doc_hash", "")
        choices[doc] = len(s.get("arguments") or ())
        responses.setdefault(s.get("filter", "none"), {})[doc] = s.get("filtered_resps")
        for metric in s.get("metrics", ()):
            value = s.get(metric)
            if isinstance(value, (bool, int, float, np.floating, np.integer)):
                values.setdefault(f"{metric},{s.get('filter', 'none')}", {})[doc] = float(value)
    order = sorted(docs)
    return (
        {k: np.array([v[d] for d in order]) for k, v in values.items() if len(v) == len(order)},
        [docs[d] for d in order],
        [choices[d] for d in order],
        {f: [r.get(d) for d in order] for f, r in responses.items()},
    )


def run(models: dict, tokenizer, suite: Suite, batch_size: int) -> HarnessRun:
    """lm-eval on each model in turn, the same tasks, documents and settings."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from ptq.evaluation.data import hub_or_cache
    from ptq.runtime import devices

    out: dict[str, ModelTasks] = {}
    manager = suite.task_manager()
    # simple_evaluate loads every task's data again: from the cache only, as load_check did, when
    # the Hub cannot be used
    uses_hub = any(_uses_hub(name, manager) for name in suite.names)
    last = None
    for name, model in models.items():
        what = f"running lm-evaluation-harness on {name} with batches of {batch_size} document(s)"
        offline = hub_or_cache() if uses_hub else contextlib.nullcontext()
        with offline, quiet_lm_eval(), _untied(model), devices.gpu_memory(what):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            result = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(suite.names),
                num_fewshot=suite.num_fewshot,
                limit=suite.limit,
                task_manager=manager,
                log_samples=True,
            )
        samples, hashes, choices, responses = {}, {}, {}, {}
        for task, rows in result["samples"].items():
            samples[task], hashes[task], choices[task], responses[task] = _per_document(rows)
        for group in result.get(
            "group_subtasks", {}
        ):  # a group: its members' documents, one after the other
            leaves = _leaves(group, result["group_subtasks"], samples)
            keys = set.intersection(*(set(samples[t]) for t in leaves)) if leaves else set()
            if keys:
                samples[group] = {
                    k: np.concatenate([samples[t][k] for t in leaves]) for k in sorted(keys)
                }
                hashes[group] = [h for t in leaves for h in hashes[t]]
                choices[group] = [c for t in leaves for c in choices[t]]
        out[name] = ModelTasks(result["results"], samples, hashes, choices, responses)
        last = result
    first = next(iter(out.values()))
    for name, m in out.items():
        if m.doc_hashes != first.doc_hashes:
            raise PtqError(
                f"lm-eval scored different documents for {name} than for {next(iter(out))}: cannot "
                "pair them"
            )
    return HarnessRun(
        out,
        last["configs"],
        last.get("n-shot", {}),
        last.get("higher_is_better", {}),
        last.get("group_subtasks", {}),
        batch_size,
    )


def _leaves(group: str, members: dict, scored: dict) -> list[str]:
    """The scored tasks under a group, in lm-eval's order (groups may nest)."""
    out = []
    for name in members.get(group, []):
        out += (
            _leaves(name, members, scored)
            if name in members
            else ([name] if name in scored else [])
        )
    return out


@contextlib.contextmanager
def _untied(model):
    """HFLM calls model.tie_weights(): on a variant whose lm_head ptq replaced (a quantized one, or
    the baseline's bf16 one) that would put the embedding back in its place. The variants are built
    as they are meant to run: no tying."""
    tie = getattr(model, "tie_weights", None)
    if tie is None:
        yield
        return
    model.tie_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.tie_weights


# ----------------------------------------------------------------------------------------------
# Per task and variant: lm-eval's numbers, and the pairing it does not give


def metric_key(key: str) -> str:
    """lm-eval's "acc,none" -> "acc"; "exact_match,strict-match" stays as it is (the filter is part
    of the name)."""
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else key


def _is_mean(values: np.ndarray, reported) -> bool:
    """Whether lm-eval's number is the mean of the per-document values (acc, exact_match: yes;
    perplexity, bleu, corpus-level f1: no), the condition for bootstrapping documents."""
    return (
        isinstance(reported, (int, float, np.floating))
        and len(values) > 0
        and abs(float(np.mean(values)) - float(reported)) <= 1e-9
    )


def describe_tasks(run: HarnessRun, suite: Suite) -> list[dict]:
    """results.json's "tasks": one entry per task lm-eval scored (a group's members each), in
    lm-eval's order."""
    first = next(iter(run.models.values()))
    out = []
    order: list[str] = []
    grouped = {t for g in run.group_subtasks for t in _leaves(g, run.group_subtasks, first.samples)}
    for name in first.results:  # lm-eval's order, each group just before its members
        if name in grouped:
            continue
        for t in (
            [name, *_leaves(name, run.group_subtasks, first.samples)]
            if name in run.group_subtasks
            else [name]
        ):
            if t in first.samples and t not in order:
                order.append(t)
    for task in order:
        samples, reported = first.samples[task], first.results[task]
        metrics = [metric_key(k) for k, v in samples.items() if _is_mean(v, reported.get(k))]
        if task in run.group_subtasks and not metrics:
            # a group whose number is not its documents' mean (not weighted by size): its members
            # only
            continue
        # lm-eval's numbers that are no mean over documents (a perplexity, bleu): ptq pairs
        # documents, so it cannot give them an interval or a paired delta; named, never silently
        # left out
        unpaired = sorted(
            {metric_key(k) for k in reported if "," in k and "_stderr," not in k} - set(metrics),
        )
        config = run.configs.get(task, {})
        choices = first.choices.get(task) or []
        mc = (
            config.get("output_type") == "multiple_choice"
            or task in run.group_subtasks
            and all(
                run.configs.get(t, {}).get("output_type") == "multiple_choice"
                for t in _leaves(task, run.group_subtasks, first.samples)
            )
        )
        group = next((g for g, members in run.group_subtasks.items() if task in members), None)
        hib = run.higher_is_better.get(task, {})
        kind = (
            f"group of {len(run.group_subtasks[task])}"
            if task in run.group_subtasks
            else config.get("output_type")
        )
        entry = {
            "name": task,
            "kind": kind,
            "n": len(first.doc_hashes[task]),
            "metrics": metrics,
            "higher_is_better": {metric_key(k + ",none"): bool(v) for k, v in hib.items()},
            "num_fewshot": run.n_shot.get(task),
            "group": group,
            "source": suite.sources.get(task)
            or (suite.sources.get(group) if group else None)
            or f"lm-eval task {task}",
            "notes": suite.notes.get(task, [])
            + (
                [
                    f"{NOT_REPORTED} {', '.join(unpaired)} (lm-eval's "
                    f"{'value is' if len(unpaired) == 1 else 'values are'} not a mean over the "
                    "documents, such as a perplexity or a corpus-level score, and ptq reports "
                    "per-document means, paired between models; lm-eval's own output has "
                    f"{'it' if len(unpaired) == 1 else 'them'})"
                ]
                if unpaired
                else []
            ),
            "chance": float(np.mean([1 / c for c in choices]))
            if mc and choices and min(choices) > 0
            else None,
            "documents_sha256": _sha256(first.doc_hashes[task]),
        }
        out.append(entry)
    return out


def _sha256(hashes: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def add_task_metrics(
    entry: dict, run: HarnessRun, tasks: list[dict], baseline: str | None = None
) -> None:
    """entry["tasks"] = {task: {metric: lm-eval's value, metric_stderr: lm-eval's, metric_ci:
    bootstrap 95%, n}}; with a baseline also entry["task_deltas"] = {task: {metric: {delta, stderr,
    ci, significant, n, recovery_pct}}}, paired on the same documents, and entry["task_samples"]
    (the per-document values the intervals resample). recovery_pct is 100 * variant / baseline
    either way; only a higher-is-better metric (as lm-eval records it for the task) takes an
    accuracy's rule that a zero baseline counts as 100%."""
    from ptq.evaluation import stats

    mine = run.models[entry["name"]]
    entry["tasks"], entry["task_samples"], deltas = {}, {}, {}
    for task in tasks:
        name = task["name"]
        reported = mine.results.get(name, {})
        row, samples = {}, {}
        for key, values in mine.samples[name].items():
            metric = metric_key(key)
            if metric not in task["metrics"]:
                continue
            metric_name, _, filt = key.partition(",")
            e = stats.estimate_share(values)  # 0/1 per document: Wilson's interval
            row.update(
                {
                    metric: float(reported[key]),
                    f"{metric}_stderr": _number(reported.get(f"{metric_name}_stderr,{filt}")),
                    f"{metric}_ci": e["ci"],
                }
            )
            samples[metric] = values.tolist()
            if baseline is not None:
                base = run.models[baseline]
                d = stats.paired_delta(base.samples[name][key], values, stats.difference)
                # an accuracy's recovery (a zero baseline counts as 100%), or a lower-is-better
                # metric's plain ratio
                recover = (
                    accuracy_recovery_pct
                    if higher_is_better(metric, task.get("higher_is_better"))
                    else ratio_pct
                )
                d["recovery_pct"] = recover(float(reported[key]), float(base.results[name][key]))
                deltas.setdefault(name, {})[metric] = d
        entry["tasks"][name] = {**row, "n": task["n"]}
        entry["task_samples"][name] = samples
    if baseline is not None:
        entry["task_deltas"] = deltas


def _number(value):
    return (
        float(value)
        if isinstance(value, (int, float, np.floating)) and np.isfinite(value)
        else None
    )


def scoring(run: HarnessRun, suite: Suite) -> dict:
    """results.json's "task_scoring": how lm-eval ran."""
    return {
        "harness": f"lm-eval {lm_eval_version()}",
        "batch_size": run.batch_size,
        "limit": suite.limit,
        "num_fewshot": suite.num_fewshot,
        "requested": list(suite.names),
    }


def protocol(tasks: list[dict]) -> list[str]:
    if not tasks:
        return []
    from ptq.evaluation import stats

    s = stats.describe()
    return [
        f"Tasks: scored by lm-evaluation-harness ({lm_eval_version()}) on each model in memory "
        "(lm_eval.models.huggingface.HFLM around the model ptq built; simple_evaluate with "
        "log_samples): the values and their stderr are lm-eval's, as `lm_eval --model hf` reports "
        "them for the same weights.",
        f"Task intervals: {s['method']} ({s['resamples']} resamples, seed {s['seed']}) over the "
        "documents of lm-eval's per-sample results, except a metric that is 0 or 1 per document "
        "(acc, exact_match): Wilson's score interval for a proportion; deltas vs the baseline are "
        "paired (the same resampled documents for both) and marked distinguishable from 0 when "
        "their 95% interval excludes 0. Recovery = variant / baseline, as model cards report it.",
    ]
