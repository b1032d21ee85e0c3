"""The results schema (ptq.reporting.results): compare and eval build it in one place, results.json is exactly its
JSON, the one reader gives back what was built, refuses another version or a malformed file in one line, and every
consumer (report, gates, trend, plots, report --json, quantize --compare-results) works from the typed document."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ptq.errors import PtqError
from ptq.reporting.results import (
    SCHEMA_VERSION,
    CompareResults,
    EvalResults,
    from_json,
    load_results,
    to_json,
)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    from conftest import TEXT

    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 3)
    return path


@pytest.fixture(scope="module")
def built(tiny_model, text, tmp_path_factory) -> tuple[CompareResults, Path]:
    """What run_compare built, with every optional part filled (calibration, diagnostics, tasks, gates), and the
    folder it wrote."""
    from ptq import progress
    from ptq.commands.compare import run_compare
    from ptq.commands.options import CalibrationOptions, DataOptions, ModelOptions, OutputOptions
    from ptq.reporting.gates import parse_limits

    out = tmp_path_factory.mktemp("results") / "out"
    progress.QUIET = True
    try:
        results = run_compare(
            ["fp8-e4m3", "int8"],
            model=ModelOptions(model=str(tiny_model)),
            # 4 documents: fewer have no interval (NaN, which equals nothing, not even itself read back)
            data=DataOptions(
                data=str(text), seq_len=32, windows=4, tasks="ptq_shakespeare", limit=4
            ),
            calibration=CalibrationOptions(data=str(text), samples=2, seq_len=32),
            output=OutputOptions(path=out, limits=parse_limits("50%", ["50%"], "0")),
        )
    finally:
        progress.QUIET = False
    return results, out


def test_compare_results_round_trip(built):
    results, out = built
    read = load_results(out / "results.json")
    assert isinstance(read, CompareResults) and read == results
    # Every optional part was built, so the round trip covered it.
    assert read.calibration.layers and read.diagnostics.tensors and read.gates.checks
    assert read.tasks[0].name == "ptq_shakespeare" and read.task_scoring.limit == 4
    assert set(read.variants[0].task_deltas["ptq_shakespeare"]) == {"acc", "acc_norm"}
    assert (
        read.baseline.tasks["ptq_shakespeare"].n == 4 and read.variants[0].snr_db.input_windows > 0
    )


def test_results_json_is_exactly_the_schema(built):
    """The file holds every field of the schema and nothing else: it equals the JSON of what it reads as."""
    _, out = built
    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 1 and data["command"] == "compare"
    assert to_json(load_results(out / "results.json")) == data
    # Today's keys stay where users' scripts find them.
    assert {
        "model",
        "eval",
        "baseline",
        "variants",
        "calibration",
        "gates",
        "tasks",
        "protocol",
    } <= set(data)
    assert data["variants"][0]["tasks"]["ptq_shakespeare"]["acc_ci"] == list(
        load_results(out / "results.json").variants[0].tasks["ptq_shakespeare"].metrics["acc"].ci
    )


def test_eval_results_round_trip(tiny_model, text, tmp_path):
    from ptq import progress
    from ptq.commands.evaluate import run_eval
    from ptq.commands.options import CalibrationOptions, DataOptions, ModelOptions, OutputOptions

    progress.QUIET = True
    try:
        results = run_eval(
            "fp8-e4m3",
            model=ModelOptions(model=str(tiny_model)),
            data=DataOptions(
                data=str(text), seq_len=32, windows=4
            ),  # 4: fewer have no interval (NaN)
            calibration=CalibrationOptions(data=str(text), samples=2, seq_len=32),
            output=OutputOptions(path=tmp_path / "e"),
        )
    finally:
        progress.QUIET = False
    read = load_results(tmp_path / "e" / "results.json")
    assert isinstance(read, EvalResults) and read == results
    assert read.command == "eval" and read.config.name == "fp8-e4m3" and read.calibration.source
    assert to_json(read) == json.loads((tmp_path / "e" / "results.json").read_text())


def test_hand_made_results_round_trip_through_json_text():
    from sample_results import baseline, compare_results, task_scores, variant

    from ptq.reporting.gates import gate_results, parse_limits
    from ptq.reporting.results import dumps

    results = compare_results(
        baseline(tasks=task_scores(piqa=0.6)),
        [variant("a", 1.5, 0.45, 0.02, task_scores(piqa=0.55)), variant("b")],
    )
    results = dataclasses.replace(
        results, gates=gate_results(results, parse_limits("1%", None, "0.01"))
    )
    again = from_json(json.loads(dumps(results)))
    assert again == results and again.variants[0].ppl_delta_pct_ci == (
        1.3,
        1.7,
    )  # intervals read as tuples
    assert [c.passed for c in again.gates.checks] == [False, False, True, True]


# --- the reader refuses, in one line ------------------------------------------------------------


def _variant(data: dict, **changes) -> dict:
    data = json.loads(json.dumps(data))
    data["variants"][0] |= changes
    return data


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d | {"schema_version": 2},
            "has results schema version 2; this ptq reads version 1: upgrade ptq",
        ),
        (
            lambda d: d | {"schema_version": 0},
            "has results schema version 0; this ptq reads version 1",
        ),
        (lambda d: d | {"schema_version": "1"}, 'schema_version must be an integer, not "1"'),
        (lambda d: d | {"command": "quantize"}, "command: expected one of compare, eval"),
        (
            lambda d: _variant(d, kl_div="small"),
            "variants[0].kl_div: expected a number, got a string",
        ),
        (
            lambda d: _variant(d, perplexity_ci=[1.0]),
            "variants[0].perplexity_ci: expected a list of 2 numbers",
        ),
        (lambda d: {k: v for k, v in d.items() if k != "baseline"}, "baseline is missing"),
        (lambda d: [d], "a JSON object expected, not a list"),
        # what the types alone allow and the readers tripped over (a traceback, exit 1: read as a failed gate)
        (
            lambda d: d | {"command": ["compare"]},
            'command: expected one of compare, eval, not ["compare"]',
        ),
        (
            lambda d: _variant(d, tasks=None),
            "variants[0].tasks.ptq_shakespeare: no score for acc, which tasks[0]",
        ),
        (
            lambda d: (
                d | {"tasks": [d["tasks"][0] | {"metrics": [*d["tasks"][0]["metrics"], "f1"]}]}
            ),
            "baseline.tasks.ptq_shakespeare: no score for f1, which tasks[0] lists",
        ),
        (
            lambda d: _variant(d, perplexity=10**400),
            "variants[0].perplexity: an integer of 1329 bits is beyond",
        ),
        (
            lambda d: _variant(d, recipe=d["variants"][0]["recipe"] | {"weights": ""}),
            "variants[0].recipe.weights: empty",
        ),
        (
            lambda d: _variant(d, name="w8|a8"),
            "variants[0].name: 'w8|a8' holds '|': a name is one line without '|'",
        ),
        (lambda d: _variant(d, name="fp8\nrow"), "variants[0].name: 'fp8\\nrow' holds '\\n'"),
        # numbers no run gives, which a report rendered and its gates judged as they stood (exit 0, gates passed)
        (
            lambda d: _variant(d, perplexity=1000.0),
            "variants[0].ppl_delta_pct: +",
        ),  # the delta not its own
        (
            lambda d: _variant(d, accuracy_delta=0.5),
            "variants[0].accuracy_delta: +0.5 is not its accuracy",
        ),
        (
            lambda d: d | {"baseline": d["baseline"] | {"perplexity": 0.0}},
            "baseline.perplexity: 0.0 is not a possible",
        ),
        (lambda d: _variant(d, kl_div=-1.0), "variants[0].kl_div: -1.0 is not a possible value"),
        (
            lambda d: _variant(d, top1_agreement=5.0),
            "variants[0].top1_agreement: 5.0 is not a possible value",
        ),
        (lambda d: _variant(d, window_nll=[]), "variants[0].window_nll: 0 values for the run's"),
        (lambda d: _variant(d, name=d["baseline"]["name"]), "is given to two configurations"),
    ],
)
def test_report_refuses_another_version_or_a_malformed_file_in_one_line(
    built, ptq_cli, tmp_path, change, message
):
    _, out = built
    path = tmp_path / "r.json"
    path.write_text(json.dumps(change(json.loads((out / "results.json").read_text()))))
    code, stdout, stderr = ptq_cli("report", path)
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1
    assert message in stderr and str(path) in stderr and "Traceback" not in stderr


def test_a_file_from_before_schema_versions_is_read_as_version_1(built, ptq_cli, tmp_path):
    """Version 1's layout without schema_version and command (what ptq wrote before them) reads and renders the same;
    with a field of version 1 missing too, it is refused in one line that says why."""
    _, out = built
    data = json.loads((out / "results.json").read_text())
    legacy = {k: v for k, v in data.items() if k not in ("schema_version", "command")}
    (tmp_path / "old.json").write_text(json.dumps(legacy))
    assert load_results(tmp_path / "old.json") == load_results(out / "results.json")
    assert ptq_cli("report", tmp_path / "old.json")[1] == ptq_cli("report", out / "results.json")[1]
    del legacy["target"]
    (tmp_path / "older.json").write_text(json.dumps(legacy))
    code, _, stderr = ptq_cli("report", tmp_path / "older.json")
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert (
        "written before schema versions: rerun the command" in stderr
        and "target is missing" in stderr
    )


def test_report_refuses_eval_results_in_one_line(tiny_model, text, ptq_cli, tmp_path):
    args = ("--eval-data", text, "--seq-len", "32", "--max-windows", "2", "--tasks", "", "--quiet")
    assert ptq_cli("eval", tiny_model, *args, "--out", tmp_path / "e")[0] == 0
    code, _, stderr = ptq_cli("report", tmp_path / "e" / "results.json")
    assert (
        code == 2 and len(stderr.strip().splitlines()) == 1 and "holds `ptq eval` results" in stderr
    )


# --- every consumer reads the typed document ---------------------------------------------------------


def test_report_gates_trend_and_plots_work_from_the_typed_document(built, tmp_path):
    from ptq.files import write_set_atomic
    from ptq.reporting.gates import stored_checks
    from ptq.reporting.plots import available, plot_writers
    from ptq.reporting.report import render_markdown, report_summary
    from ptq.reporting.trend import trend

    results, out = built
    # report.md as compare wrote it, minus its plots section, from the object alone
    written = re.sub(
        r"<details open><summary><b>Plots</b></summary>.*?</details>\n\n",
        "",
        (out / "report.md").read_text(),
        flags=re.S,
    )
    assert render_markdown(results) == written
    # the gates: the stored checks recomputed from the stored limits are the stored ones; KL 0 fails every variant
    assert stored_checks(results) == results.gates.checks
    assert {c.variant for c in results.gates.checks if c.metric == "kl_div" and not c.passed} == {
        "fp8-e4m3",
        "int8",
    }
    # the trend: one variant's perplexity moved beyond its interval
    int8 = results.variants[1]
    moved = dataclasses.replace(
        int8,
        perplexity=2 * int8.perplexity,
        perplexity_ci=(1.9 * int8.perplexity, 2.1 * int8.perplexity),
    )
    later = dataclasses.replace(results, variants=[results.variants[0], moved])
    beyond = [(m.entry, m.metric) for m in trend(later, results)["moves"] if m.beyond_intervals]
    assert beyond == [("int8", "perplexity")]
    summary = report_summary(later, results, None)
    assert summary["passed"] is False and summary["gates"] == to_json(results.gates)
    assert "1 change beyond the intervals" in summary["verdict"]
    # the plots: all three, from the object
    assert available(results) == ["metrics", "layer-amax", "layer-snr"]
    write_set_atomic(plot_writers(results, tmp_path / "r.md"))
    assert {p.name for p in tmp_path.iterdir()} == {
        "r-metrics.png",
        "r-layer-amax.png",
        "r-layer-snr.png",
    }


def test_quantize_reads_compare_results_through_the_reader(built, tmp_path):
    import dataclasses

    from ptq.commands.quantize import load_compare_results
    from ptq.quantization.recipes import load_recipe

    results, out = built
    int8 = load_recipe("int8")
    rows = load_compare_results(out, int8, "vllm")  # the folder or the file
    assert (
        rows["file"] == str(out / "results.json")
        and rows["variant"]["kl_div"] == results.variants[1].kl_div
    )
    assert (
        rows["baseline"]["recipe"]["name"] == "bf16"
        and rows["eval_sha256"] == results.eval.data_sha256
    )
    with pytest.raises(PtqError, match="has no results for recipe 'fp8-e5m2'"):
        load_compare_results(out, load_recipe("fp8-e5m2"), "vllm")
    # a row of the same name is not enough: the same quantization, for the same target (the card quotes it)
    other = dataclasses.replace(load_recipe("fp8-dynamic"), name="int8")
    with pytest.raises(
        PtqError,
        match="'int8' is another recipe of that name \\(weights: int8 per-channel, here: e4m3",
    ):
        load_compare_results(out, other, "vllm")
    with pytest.raises(
        PtqError,
        match="simulated 'int8' as vllm serves it; this checkpoint is for --target transformers",
    ):
        load_compare_results(out, int8, "transformers")
    (tmp_path / "bad.json").write_text(json.dumps({"schema_version": 7}))
    with pytest.raises(PtqError, match="schema version 7"):
        load_compare_results(tmp_path / "bad.json", int8, "vllm")


def test_a_results_folder_is_read_through_its_results_json(tmp_path):
    """`ptq report reports/pr` (the folder compare wrote) reads reports/pr/results.json; a folder without one, or a
    path that does not exist, is named in one line for what it is."""
    from sample_results import baseline, compare_results, variant

    from ptq.reporting.results import dumps

    results = compare_results(baseline(), [variant("a", 1.5, 0.45, 0.02)])
    (tmp_path / "pr").mkdir()
    (tmp_path / "pr" / "results.json").write_text(dumps(results))
    assert load_results(tmp_path / "pr") == results
    (tmp_path / "empty").mkdir()
    with pytest.raises(PtqError, match="empty is a folder without a results.json"):
        load_results(tmp_path / "empty")
    with pytest.raises(PtqError, match="nowhere does not exist"):
        load_results(tmp_path / "nowhere")


def test_a_results_file_nested_too_deeply_is_one_line(tiny_model, ptq_cli, ptq_run, tmp_path):
    """JSON nested deep enough to exhaust Python's stack, given as the results file, as --previous, or as quantize's
    --compare-results, is one line naming the file (exit 2), not a RecursionError traceback (exit 1)."""
    from sample_results import baseline, compare_results, variant

    from ptq.reporting.results import dumps

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    good = tmp_path / "good.json"
    good.write_text(dumps(compare_results(baseline(), [variant("fp8-e4m3", 1.5, 0.45, 0.02)])))
    for run in (
        lambda: ptq_cli("report", deep),
        lambda: ptq_cli("report", good, "--previous", deep, "-o", tmp_path / "r.md"),
        lambda: ptq_run("quantize", tiny_model, compare_results=deep, o=tmp_path / "q"),
    ):
        code, _, stderr = run()
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert f"{deep} is nested too deeply" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "q").exists() and not (tmp_path / "r.md").exists()
