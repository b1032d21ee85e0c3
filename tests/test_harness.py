"""--tasks by lm-evaluation-harness: ptq's baseline gives exactly what lm-eval's own CLI gives for the same weights;
every variant is paired with it on the same documents; generated tasks (cloze, JSONL) and shipped ones run offline;
what cannot run stops in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tasks import LINES, varied_rows, write_jsonl

from ptq.evaluation import harness, stats

SHIPPED = harness.TASKS_DIR
LIMIT = "6"


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    """The tiny Llama with bfloat16 weights on disk: what `lm_eval --model hf --model_args dtype=bfloat16` and
    `ptq compare --dtype bfloat16` both compute with."""
    from conftest import save_tiny_llama
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-bf16"))
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mc_folder(tmp_path_factory) -> Path:
    """A folder with one task YAML of the user's own over ptq's multiple-choice JSONL format."""
    folder = tmp_path_factory.mktemp("tasks")
    data = write_jsonl(folder / "rows.jsonl", varied_rows(12))
    (folder / "mc.yaml").write_text(
        f"include: {SHIPPED / '_ptq_choice.yaml'}\ntask: mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
    )
    return folder


def lm_eval_cli(
    model: Path, tasks: str, include: Path, out: Path
) -> tuple[dict, dict[str, list[dict]]]:
    """lm-evaluation-harness's own CLI on the model directory: its results and its per-sample files."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model},dtype=bfloat16",
            "--tasks",
            tasks,
            "--include_path",
            str(include),
            "--limit",
            LIMIT,
            "--batch_size",
            "4",
            "--device",
            "cpu",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return results, samples


def test_compare_baseline_is_lm_eval_cli_exactly_and_variants_are_paired(
    ptq_run, bf16_model, mc_folder, tmp_path, monkeypatch
):
    """A generation task (ptq_arith, shipped), a multiple-choice one (the user's YAML) and a loglikelihood one
    (ptq_cloze, shipped) in one compare, offline."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    out = tmp_path / "out"
    tasks = f"{SHIPPED / 'ptq_arith.yaml'},{mc_folder},{SHIPPED / 'ptq_cloze.yaml'}"
    code, stdout, err = ptq_run(
        "compare",
        bf16_model,
        recipes="fp8-e4m3",
        calib_data=text,
        calib_samples=2,
        eval_data=text,
        max_windows=2,
        dtype="bfloat16",
        batch_size=4,
        tasks=tasks,
        limit=LIMIT,
        no_plots=True,
        out=out,
    )
    assert code == 0, err
    r = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in r["tasks"]] == ["ptq_arith", "mc", "ptq_cloze"]
    assert {t["name"]: t["kind"] for t in r["tasks"]} == {
        "ptq_arith": "generate_until",
        "mc": "multiple_choice",
        "ptq_cloze": "loglikelihood",
    }

    # lm-eval's CLI gets the same tasks: the shipped folder (ptq_arith, ptq_cloze) and the user's folder (mc)
    include = tmp_path / "include"
    include.mkdir()
    for source in (SHIPPED, mc_folder):
        for f in source.iterdir():
            if f.is_file():
                (include / f.name).write_bytes(f.read_bytes())
    cli, cli_samples = lm_eval_cli(bf16_model, "ptq_arith,mc,ptq_cloze", include, tmp_path / "cli")
    base = r["baseline"]
    for task in r["tasks"]:
        name = task["name"]
        assert task["n"] == int(LIMIT)
        for key, value in cli[name].items():
            metric, _, filt = key.partition(",")
            if metric in ("alias", "name", "sample_len") or metric.endswith("_stderr"):
                continue
            shown = harness.metric_key(key)
            assert base["tasks"][name][shown] == value, (name, key)  # exactly lm-eval's number
            assert base["tasks"][name][f"{shown}_stderr"] == cli[name][f"{metric}_stderr,{filt}"]
            per_doc = {
                int(s["doc_id"]): float(s[metric]) for s in cli_samples[name] if s["filter"] == filt
            }
            assert base["task_samples"][name][shown] == [per_doc[i] for i in sorted(per_doc)]
    assert base["tasks"]["mc"]["acc"] not in (0.0, 1.0) or base["tasks"]["mc"]["acc_norm"] not in (
        0.0,
        1.0,
    )

    # every variant: a paired delta with its interval, recovery, on the same documents
    for v in r["variants"]:
        for task in r["tasks"]:
            name = task["name"]
            assert set(v["task_deltas"][name]) == set(task["metrics"])
            for metric, d in v["task_deltas"][name].items():
                mine, theirs = (
                    np.array(v["task_samples"][name][metric]),
                    np.array(base["task_samples"][name][metric]),
                )
                expected = stats.paired_delta(theirs, mine, stats.difference)
                assert (
                    d["delta"] == pytest.approx(mine.mean() - theirs.mean())
                    and d["ci"] == expected["ci"]
                )
                assert d["significant"] == (d["ci"][0] > 0 or d["ci"][1] < 0)
                b, q = base["tasks"][name][metric], v["tasks"][name][metric]
                assert d["recovery_pct"] == pytest.approx(100 * q / b if b > 0 else 100.0)
    report = (out / "report.md").read_text()
    assert (
        "## Task accuracy (lm-evaluation-harness)" in report
        and "| ptq_arith | exact_match,strict-match | 6 | 4 |" in report
    )
    assert "recovery" in stdout


def test_cloze_and_jsonl_against_itself_give_zero_deltas_and_gates_per_metric(
    ptq_run, tiny_model, tmp_path
):
    recipe = tmp_path / "bf16-again.yaml"
    recipe.write_text(
        "name: bf16-again\ndescription: the baseline again\ntargets: [Linear]\nignore: []\n"
        "weights: {format: bf16}\ninputs: {format: bf16}\n"
    )
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    mc = write_jsonl(tmp_path / "mc.jsonl", varied_rows(12))
    code, out, err = ptq_run(
        "compare",
        tiny_model,
        calib_data=None,
        calib_samples=None,
        recipes=recipe,
        eval_data=text,
        max_windows=2,
        tasks=f"cloze,mine={mc}",
        max_items=8,
        no_plots=True,
        min_accuracy_recovery="100%",
        out=tmp_path / "out",
    )
    assert code == 0, out + err
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {t["name"]: t["n"] for t in r["tasks"]} == {"cloze": 8, "mine": 12}
    v = r["variants"][0]
    for metrics in v["task_deltas"].values():
        for d in metrics.values():
            assert (
                d["delta"] == 0
                and d["ci"] == [0, 0]
                and d["significant"] is False
                and d["recovery_pct"] == 100
            )
    assert set(v["tasks"]["mine"]) == {
        "acc",
        "acc_stderr",
        "acc_ci",
        "acc_norm",
        "acc_norm_stderr",
        "acc_norm_ci",
        "n",
    }
    checks = {
        (c["task"], c["task_metric"])
        for c in r["gates"]["checks"]
        if c["metric"] == "accuracy_recovery_pct"
    }
    assert checks == {("next-token", None), ("cloze", "acc"), ("mine", "acc"), ("mine", "acc_norm")}
    assert "chance" in (tmp_path / "out" / "report.md").read_text()


def test_eval_one_configuration_with_tasks(ptq_run, tiny_model, tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    small, large = (write_jsonl(tmp_path / f"mc{n}.jsonl", varied_rows(n)) for n in (8, 40))
    code, out, err = ptq_run(
        "eval",
        tiny_model,
        recipe="fp8-e4m3",
        calib_data=text,
        calib_samples=2,
        eval_data=text,
        max_windows=2,
        batch_size=16,
        tasks=f"small={small},large={large}",
        out=tmp_path / "out",
    )
    assert code == 0, err
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    c = r["config"]
    assert r["command"] == "eval" and c["name"] == "fp8-e4m3" and "task_deltas" not in c
    width = {
        name: c["tasks"][name]["acc_ci"][1] - c["tasks"][name]["acc_ci"][0]
        for name in ("small", "large")
    }
    assert width["large"] < width["small"]  # intervals narrow as documents grow
    assert (
        r["task_scoring"]["batch_size"] == 16
        and r["versions"]["lm_eval"] == harness.lm_eval_version()
    )
    report = (tmp_path / "out" / "report.md").read_text()
    assert "# ptq eval" in report and "| large | acc_norm | 40 |" in report


def test_a_group_is_paired_on_its_members_documents(tiny_model, tmp_path):
    """A folder defining a group (size-weighted, as mmlu): the group's row is lm-eval's number, paired over the
    documents of all its members."""
    from ptq.models.loading import load_model

    folder = tmp_path / "group"
    folder.mkdir()
    for name, n in (("mc_a", 5), ("mc_b", 9)):
        data = write_jsonl(folder / f"{name}.jsonl", varied_rows(n))
        (folder / f"{name}.yaml").write_text(
            f"include: {SHIPPED / '_ptq_choice.yaml'}\ntask: {name}\n"
            f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        )
    (folder / "_mcs.yaml").write_text(
        "group: mcs\ntask: [mc_a, mc_b]\naggregate_metric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    weight_by_size: true\nmetadata:\n  version: 1.0\n"
    )
    (folder / "_plain.yaml").write_text("group: plain\ntask: [mc_a]\nmetadata:\n  version: 1.0\n")
    suite = harness.prepare(str(folder), None, tmp_path / "work", max_items=None)
    assert suite.names == ["mcs", "plain"]
    # what results will hold, known before any model: a group that aggregates nothing has no row (describe_tasks)
    assert suite.scored == {"mcs", "mc_a", "mc_b"}
    suite = harness.prepare(str(folder / "_mcs.yaml"), None, tmp_path / "work", max_items=None)
    loaded = load_model(str(tiny_model))
    model = loaded.model
    run = harness.run({"a": model, "b": model}, loaded.tokenizer, suite, 4)
    tasks = harness.describe_tasks(run, suite)
    assert [(t["name"], t["n"], t["metrics"]) for t in tasks] == [
        ("mcs", 14, ["acc"]),
        ("mc_a", 5, ["acc", "acc_norm"]),
        ("mc_b", 9, ["acc", "acc_norm"]),
    ]
    entry = {"name": "b"}
    harness.add_task_metrics(entry, run, tasks, baseline="a")
    a = run.models["a"]
    assert entry["tasks"]["mcs"]["acc"] == a.results["mcs"]["acc,none"]
    assert entry["task_samples"]["mcs"]["acc"] == [
        *a.samples["mc_a"]["acc,none"],
        *a.samples["mc_b"]["acc,none"],
    ]
    assert entry["task_deltas"]["mcs"]["acc"]["n"] == 14


def test_a_gate_on_a_task_the_run_does_not_score_stops_before_the_model(ptq_cli, tmp_path):
    """It could only fail, and only after the whole run (exit 1, read as a regression): a typo is one line, exit 2."""
    mc = write_jsonl(tmp_path / "mc.jsonl", varied_rows(6))
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    for tasks, gate, scored in (
        (None, "mc=99%", "next-token"),
        (f"mine={mc}", "mc=99%", "next-token, mine"),
    ):
        code, out, err = ptq_cli(
            "compare",
            tmp_path / "no-model-here",  # never reached: the gates are checked first
            *(("--tasks", tasks) if tasks else ()),
            "--eval-data",
            text,
            "--min-accuracy-recovery",
            "mine=99%",
            "--min-accuracy-recovery",
            gate,
            "--out",
            tmp_path / "out",
        )
        assert code == 2 and out == "", err
        assert err.strip().splitlines()[
            -1
        ] == (  # after datasets' own "Generating test split" lines
            f"error: --min-accuracy-recovery names task '{'mine' if tasks is None else 'mc'}', which this run has no "
            f"accuracy for (it has {scored}): correct the name, or add the task to compare's --tasks"
        )
    assert not (tmp_path / "out").exists()


def test_recovery_of_a_lower_is_better_metric_is_its_plain_ratio():
    """lm-eval records the direction per task (crows_pairs_english's likelihood_diff: higher_is_better false). Only an
    accuracy takes the rule that a zero baseline counts as 100% recovery; an error rate that rises from 0 is no
    100% recovery, and one that rises from 0.25 to 0.5 is 200% of the baseline (variant / baseline, as documented)."""
    values = {
        "a": {
            "acc,none": [0.0, 0.0, 0.0, 0.0],
            "err,none": [0.0, 0.0, 0.0, 0.0],
            "miss,none": [0, 1, 0, 0],
        },
        "b": {
            "acc,none": [1.0, 0.0, 0.0, 0.0],
            "err,none": [1.0, 0.0, 0.0, 0.0],
            "miss,none": [1, 1, 0, 0],
        },
    }
    models = {
        name: harness.ModelTasks(
            results={"t": {k: float(np.mean(v)) for k, v in metrics.items()}},
            samples={"t": {k: np.array(v, dtype=float) for k, v in metrics.items()}},
            doc_hashes={"t": ["h0", "h1", "h2", "h3"]},
            choices={"t": [2, 2, 2, 2]},
            responses={},
        )
        for name, metrics in values.items()
    }
    run = harness.HarnessRun(
        models, {}, {}, {"t": {"acc": True, "err": False, "miss": False}}, {}, 4
    )
    tasks = [
        {
            "name": "t",
            "n": 4,
            "metrics": ["acc", "err", "miss"],
            "higher_is_better": {"acc": True, "err": False, "miss": False},
        }
    ]
    entry = {"name": "b"}
    harness.add_task_metrics(entry, run, tasks, baseline="a")
    deltas = entry["task_deltas"]["t"]
    assert (
        deltas["acc"]["recovery_pct"] == 100.0
    )  # an accuracy's zero baseline cannot be fallen short of
    assert np.isnan(deltas["err"]["recovery_pct"])  # errors from none: no ratio, and never "100%"
    assert deltas["miss"]["recovery_pct"] == pytest.approx(100 * 0.5 / 0.25)
    assert deltas["err"]["delta"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "task, message",
    [
        ("{bad}", "line 2 is not valid JSON"),
        ("{wrong}", "line 1: expected the fields 'context, choices, label'"),
        ("mc={label}", "line 1: 'label' must be an integer index"),
        ("mc=missing.jsonl", "does not exist"),
        ("{empty_folder}", "defines no lm-eval task"),
        (" , ", "--tasks ' , ' names no task (e.g. --tasks cloze; --tasks '' for none)"),
        (
            "{broken_yaml}",
            "broken.yaml, line 3, column 6: not valid YAML: mapping values are not allowed here",
        ),
        (
            "{yaml_folder}",
            "broken.yaml, line 3, column 6: not valid YAML",
        ),  # lm-eval's index skipped it silently
        (
            "{twice_yaml}",
            "twice.yaml, line 2, column 1: not valid YAML: 'task' given twice (first on line 1)",
        ),
        (
            "a|b={good}",
            "task 'a|b' holds '|': a name is one line without '|' (it names a table row)",
        ),
        # ptq's shipped ptq_arith ran instead, and the report credited the user's file
        (
            "ptq_arith={good}",
            "task name 'ptq_arith' is taken by ptq's own task of that name, which would run instead",
        ),
        (
            "mine={empty_folder}",
            "NAME=FILE takes a .jsonl file of rows; a task YAML or a folder of them is given",
        ),
        (
            "mine={twice_yaml}",
            "NAME=FILE takes a .jsonl file of rows; a task YAML or a folder of them is given",
        ),
        # lm-eval's index dropped the task in silence: "defines no lm-eval task"
        ("{typo_include}", "includes _tmpl.yaml, which is not a file ("),
        ("{loop_include}", "includes loop.yaml, which includes it again"),
    ],
)
def test_bad_task_input_is_one_line(ptq_cli, tiny_model, tmp_path, task, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n{oops\n')
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "a"}])
    label = write_jsonl(
        tmp_path / "label.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 2}]
    )
    (tmp_path / "empty").mkdir()
    good = write_jsonl(tmp_path / "good.jsonl", varied_rows(4))
    (tmp_path / "yaml").mkdir()
    broken = tmp_path / "yaml" / "broken.yaml"
    broken.write_text("task: mine\ndataset_path: json\n  bad: [\n")
    twice = tmp_path / "twice.yaml"
    twice.write_text(f"task: mine\ntask: other\ninclude: {SHIPPED / '_ptq_choice.yaml'}\n")
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "_template.yaml").write_text(f"include: {SHIPPED / '_ptq_choice.yaml'}\n")
    typo = tmp_path / "inc" / "typo.yaml"
    typo.write_text(
        f"include: _tmpl.yaml\ntask: mine\ndataset_path: json\ndataset_kwargs: {{data_files: {good}}}\n"
    )
    (tmp_path / "loop").mkdir()
    loop = tmp_path / "loop" / "loop.yaml"
    loop.write_text("include: [loop.yaml]\ntask: mine\n")
    out_dir = tmp_path / "out"
    code, _, err = ptq_cli(
        "eval",
        tiny_model,
        "--tasks",
        task.format(
            typo_include=typo,
            loop_include=loop,
            bad=bad,
            wrong=wrong,
            label=label,
            empty_folder=tmp_path / "empty",
            broken_yaml=broken,
            yaml_folder=tmp_path / "yaml",
            twice_yaml=twice,
            good=good,
        ),
        "--out",
        out_dir,
        "-q",
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out_dir.exists()


@pytest.mark.parametrize(
    "name, content, message",
    [
        # a RecursionError traceback, exit 1
        (
            "deep.jsonl",
            b'{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}\n",
            "deep.jsonl, line 2 is nested too deeply to be read as JSON",
        ),
        # UTF-16 with its byte-order mark: "cannot read task file" (a codec's error message)
        (
            "wide.jsonl",
            '{"context": "a", "choices": ["b", "c"], "label": 7}\n'.encode("utf-16"),
            "wide.jsonl, line 1: 'label' must be an integer index",
        ),
        ("narrow.jsonl", b"{}\n".decode().encode("utf-16-le"), "narrow.jsonl is not UTF-8 text"),
    ],
)
def test_task_rows_are_read_as_data_rows_are(tmp_path, name, content, message):
    """Task rows (--tasks NAME=FILE.jsonl) are read by the text reader and the one JSON reader: too deep a row is
    one line naming the file and the line; UTF-16 is decoded by its byte-order mark, refused without one."""
    from ptq.errors import PtqError

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PtqError) as e:
        harness.prepare(f"mc={path}", None, tmp_path / "work", max_items=None)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_hub_task_offline_and_unknown_task_are_one_line(tmp_path, monkeypatch):
    """With no network (HF_DATASETS_OFFLINE set), a Hub task stops in one line naming it and the way to local files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(Exception) as e:
        harness.prepare("piqa,nosuchtask", None, tmp_path, max_items=None)
    assert "unknown task 'nosuchtask'" in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(Exception) as e:
        harness.prepare("piqa", None, tmp_path, max_items=None)
    message = str(e.value)
    assert (
        "cannot load task 'piqa': HF_DATASETS_OFFLINE is set" in message
        and "piqa=FILE.jsonl" in message
    )
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--limit", "6"], "--num-fewshot and --limit apply to --tasks"),
        (["--tasks", "cloze", "--limit", "1.5"], "--limit takes a number of documents"),
    ],
)
def test_task_options_without_tasks_are_one_line(ptq_cli, tiny_model, tmp_path, args, message):
    code, _, err = ptq_cli("compare", tiny_model, *args, "--out", tmp_path / "out", "-q")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_tasks_under_torchrun_are_refused_in_one_line(ptq_cli, tiny_model, tmp_path, monkeypatch):
    """lm-eval runs the models ptq built in one process: under torchrun, --tasks stops before any work."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for command in ("compare", "eval"):
        code, _, err = ptq_cli(
            command, tiny_model, "--tasks", "cloze", "--out", tmp_path / command, "-q"
        )
        assert (
            code == 2 and "--tasks runs lm-evaluation-harness on each model in one process" in err
        )
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / command).exists()


def test_shipped_tasks_are_indexed_by_lm_eval():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(SHIPPED), include_defaults=False)
    assert {"ptq_arith", "ptq_cloze", "ptq_shakespeare"} <= set(manager.all_tasks)
    loaded = manager.load(["ptq_shakespeare", "ptq_arith"])["tasks"]
    docs = {name.split(":")[-1]: list(task.test_docs()) for name, task in loaded.items()}
    assert len(docs["ptq_shakespeare"]) == 6 and len(docs["ptq_arith"]) == 24
    for doc in docs["ptq_arith"]:  # every answer's arithmetic is right
        work, answer = doc["answer"].split(" #### ")
        assert eval(work.split(". ")[-1].split(" = ")[0]) == int(answer)  # noqa: S307  (our own data file)


def test_lm_eval_git_describe_outside_a_checkout_prints_nothing(tmp_path, monkeypatch, capfd):
    """lm-eval records `git describe` of the working directory; outside a git checkout git's "fatal: not a git
    repository" went straight to the terminal. Inside ptq's lm-eval context its stderr is discarded."""
    from lm_eval.loggers import utils as lm_eval_utils

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    lm_eval_utils.get_git_commit_hash()
    assert "fatal" in capfd.readouterr().err  # lm-eval as it is
    with harness.quiet_lm_eval():
        assert lm_eval_utils.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err
    assert lm_eval_utils.subprocess is subprocess  # put back


def test_few_shot_examples_of_ptqs_own_formats_never_include_the_document_scored(tmp_path):
    """ptq's multiple-choice rows and cloze items draw their shots from the task's own rows. Without fewshot_split
    naming that split, lm-eval did not leave the scored document out: with 4 shots from 5 rows every document saw
    its own answer among its examples. It is left out now, and shots beyond the other rows are refused."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    rows = [
        {"context": f"Question {i}: which letter?", "choices": ["A", "B", "C", "D"], "label": i % 4}
        for i in range(5)
    ]
    words = [
        "river",
        "stone",
        "candle",
        "harbor",
        "meadow",
        "lantern",
        "orchard",
        "falcon",
        "willow",
        "anvil",
    ] * 3
    text = (
        tmp_path / "lines.txt"
    )  # no two cloze items alike (lm-eval leaves out every copy of the scored one)
    text.write_text(
        "\n".join(
            f"In year {i} the {w} stood near gate {7 * i}, and all spoke of the {w}."
            for i, w in enumerate(words)
        )
    )
    specs = {"mine": f"mine={write_jsonl(tmp_path / 'rows.jsonl', rows)}", "cloze": f"cloze={text}"}
    for name, spec in specs.items():
        suite = harness.prepare(spec, None, tmp_path / name, max_items=None)
        task = suite.task_manager().load([name])["tasks"][name]
        docs = list(task.test_docs())
        shots = len(docs) - 1  # every other document
        for doc in docs:
            context = task.fewshot_context(doc, num_fewshot=shots)
            scored = doc["context"]
            assert context.count(scored) == 1, (name, scored)  # as the question only, at the end
            assert context.endswith(scored), name
        with pytest.raises(harness.PtqError, match=f"{name} has only {shots} few-shot examples"):
            harness.check_fewshot(name, task, shots + 1)


def test_a_metric_that_is_not_a_mean_over_documents_is_named_not_silently_dropped(
    ptq_cli, tiny_model, tmp_path
):
    """lm-eval's perplexities (loglikelihood_rolling: wikitext's word_perplexity, bits_per_byte) and corpus-level
    scores are no means over documents, which ptq pairs: such a task ran for minutes and showed an empty table, exit
    0, nothing said. They are named as not reported, in results.json, the report and the console."""
    docs = write_jsonl(
        tmp_path / "docs.jsonl",
        [{"text": " ".join(LINES.split()[i : i + 40])} for i in range(0, 400, 50)],
    )
    task = tmp_path / "rolling.yaml"
    task.write_text(
        "task: rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {docs}\noutput_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
        "metadata:\n  version: 1.0\n"
    )
    mc = write_jsonl(tmp_path / "mc.jsonl", varied_rows(6))
    text = tmp_path / "lines.txt"
    text.write_text(LINES)
    code, out, err = ptq_cli(
        "eval", tiny_model, "--eval-data", text, "--seq-len", "32", "--max-windows", "2",
        "--tasks", f"{task},mine={mc}", "--out", tmp_path / "out", "-q",
    )  # fmt: skip
    assert code == 0, err
    tasks = {
        t["name"]: t for t in json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]
    }
    note = "not reported: bits_per_byte, word_perplexity (lm-eval's values are not a mean over the documents"
    assert tasks["rolling"]["metrics"] == [] and any(
        n.startswith(note) for n in tasks["rolling"]["notes"]
    )
    assert tasks["mine"]["metrics"] == ["acc", "acc_norm"] and not any(
        "not reported" in n for n in tasks["mine"]["notes"]
    )
    assert note in (tmp_path / "out" / "report.md").read_text()
    assert f"rolling: {note}" in " ".join(out.split())


@pytest.mark.parametrize(
    "content, reads_as",
    [("just some words\n", "text"), ("- a\n- b\n", "a list"), ("", "nothing"), ("7\n", "a value")],
)
def test_an_include_that_is_not_a_task_yaml_is_named(tmp_path, content, reads_as):
    """`include: notes.txt` (a file YAML reads as text, a list, or nothing) was reported as "defines no lm-eval task":
    lm-eval's index dropped the task in silence. It is named, with what it reads as."""
    from ptq.errors import PtqError

    (tmp_path / "notes.txt").write_text(content)
    task = tmp_path / "t.yaml"
    task.write_text("include: notes.txt\ntask: mine\ndataset_path: json\n")
    with pytest.raises(PtqError) as e:
        harness.prepare(str(task), None, tmp_path / "work", max_items=None)
    assert str(e.value) == (
        f"task file {task} includes notes.txt, which is not a task YAML: {tmp_path / 'notes.txt'} reads as "
        f"{reads_as}, not a mapping of keys (task:, dataset_path:, ...)"
    )
