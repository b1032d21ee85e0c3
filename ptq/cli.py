"""The `ptq` command line. Thin on purpose: parse, call one function from ptq.commands,
print.

The options of calibrate, compare, eval and quantize are declared once, as the fields of the options
groups (ptq.commands.options); `_command` turns the groups a command takes into its parameters and
hands the command function the groups built."""

from __future__ import annotations

import inspect as pyinspect
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ptq import progress
from ptq.commands import options as opts
from ptq.commands.options import (
    CalibrationOptions,
    CheckpointOptions,
    ComputeOptions,
    DataOptions,
    Flag,
    ModelOptions,
    OutputOptions,
)
from ptq.errors import PtqError
from ptq.reporting.results import to_json

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

app = typer.Typer(
    help="Post-training quantization of Hugging Face causal LMs to FP8 E4M3, compared with int8 "
    "and bf16.\n\n"
    "Exit codes: 0 success (all gates pass), 1 a gate failed (quantize: the checkpoint failed its "
    "verification), 2 a usage or input error, 130 interrupted, 143 terminated.\n\n"
    "Example: ptq compare smollm2 --max-ppl-increase 2% --out reports/pr && ptq report "
    "reports/pr/results.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _parser(parse: Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    """A Flag's parser as click's: its ValueError becomes click's one-line "Invalid value"."""
    if parse is None:
        return None

    def parser(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None

    return parser


def _annotated(flag: Flag, kind: Any) -> Any:
    """The annotation of a command function's parameter for `flag`: its type and typer's Option (its
    Argument where it has no flags)."""
    info = dict(
        help=flag.help,
        rich_help_panel=flag.panel,
        show_default=flag.show_default,
        metavar=flag.metavar,
        min=flag.min,
        max=flag.max,
        parser=_parser(flag.parser),
    )
    return Annotated[
        kind, typer.Option(*flag.decls, **info) if flag.decls else typer.Argument(**info)
    ]


def _command(name: str, **groups: type) -> Callable[[Callable], Callable]:
    """Register the command `name`: its parameters are its function's own and one per flag of the
    fields of `groups` that it takes (ptq.commands.options), shown panel by panel in --help. The
    function is called with its own and, where it takes `options`, the groups built by keyword (as
    the run_* functions take them)."""

    def register(fn: Callable) -> Callable:
        signature = pyinspect.signature(fn, eval_str=True).parameters
        own = [p.replace(kind=_KEYWORD) for p in signature.values() if p.name != "options"]
        from_groups = [
            pyinspect.Parameter(param, _KEYWORD, default=default, annotation=_annotated(flag, kind))
            for param, (flag, kind, default) in opts.parameters(name, groups).items()
        ]
        # the command's own main options first, its own output options after the groups' outputs
        params = [p for p in own if _panel(p) is None] + from_groups
        params += [p for p in own if _panel(p) is not None]

        def command(**values: Any) -> Any:
            mine = {p.name: values.pop(p.name) for p in own}
            if "options" in signature:
                mine["options"] = opts.from_flags(name, groups, values)
            return fn(**mine)

        command.__name__, command.__doc__ = fn.__name__, _unwrapped(fn.__doc__)
        command.__signature__ = pyinspect.Signature(
            sorted(params, key=lambda p: opts.PANELS.index(_panel(p)))
        )
        return app.command(name)(command)

    return register


_KEYWORD = pyinspect.Parameter.KEYWORD_ONLY


def _panel(param: pyinspect.Parameter) -> str | None:
    """The help panel of a command function's parameter."""
    return next(
        (m.rich_help_panel for m in getattr(param.annotation, "__metadata__", ())),
        None,
    )


def _unwrapped(doc: str | None) -> str | None:
    """A docstring as one line a paragraph: typer keeps a docstring's line breaks in the help."""
    if doc is None:
        return None
    return "\n\n".join(" ".join(p.split()) for p in pyinspect.cleandoc(doc).split("\n\n"))


def _field(cls: type, name: str) -> Any:
    """The annotation of a field's own flag, for a command that takes it without its group."""
    return _annotated(*opts.field_flag(cls, name))


ModelArg = _field(ModelOptions, "model")
RemoteCode = _field(ModelOptions, "trust_remote_code")
Target = _field(ComputeOptions, "target")
Force = _annotated(opts.FORCE, bool)
NoPlots = _annotated(opts.NO_PLOTS, bool)
MaxPplIncrease, MinAccuracyRecovery, MaxKl = (_annotated(f, f.type) for f in opts.GATE_FLAGS)
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bars.", rich_help_panel=opts.OUTPUT)
]
Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print machine-readable JSON on stdout instead of tables.",
        rich_help_panel=opts.OUTPUT,
    ),
]
EVALUATION = dict(
    model=ModelOptions,
    data=DataOptions,
    calibration=CalibrationOptions,
    compute=ComputeOptions,
    output=OutputOptions,
)


_PATH = _parser(opts.path_value)


def _split(values: str) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()]


@_command(
    "calibrate",
    model=ModelOptions,
    calibration=CalibrationOptions,
    compute=ComputeOptions,
    output=OutputOptions,
)
def calibrate(
    options: dict[str, Any],
    recipe: Annotated[
        str, typer.Option("--recipe", help="Recipe(s) whose tensors to calibrate, comma-separated.")
    ] = "fp8-e4m3",
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Record the amax of every tensor a recipe quantizes (weights and Linear inputs).

    Example: ptq calibrate smollm2 --samples 32 -o smollm2.calib.safetensors
    """
    progress.QUIET = quiet or as_json
    from ptq.calibration.calibrate import checkpoint_path, summary_rows
    from ptq.commands.calibrate import run_calibrate

    output = options["output"].path
    try:
        calibration = run_calibrate(_split(recipe), **options)
    except KeyboardInterrupt:
        if checkpoint_path(output).is_file():
            progress.stderr.print(
                f"the last checkpoint is {checkpoint_path(output)}: rerun with --resume to "
                f"continue",
                highlight=False,
                soft_wrap=True,
            )
        raise
    _print_faults(calibration.metadata)
    summary = summary_rows(calibration)
    if as_json:
        _print_json({"output": str(output), "metadata": calibration.metadata, "summary": summary})
    else:
        _print_calibration(summary, calibration.metadata, output)


@_command("compare", **EVALUATION)
def compare(
    options: dict[str, Any],
    recipes: Annotated[
        str,
        typer.Option(
            "--recipes",
            help="Recipes to compare with the bf16 baseline, comma-separated (names in recipes/ or "
            ".yaml paths).",
        ),
    ] = "fp8-e4m3,int8",
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Evaluate the bf16 baseline and each recipe on the same held-out windows; write a report.

    Exits 1 when a gate (--max-ppl-increase, --min-accuracy-recovery, --max-kl) fails; the report is
    written either way.

    Example: ptq compare smollm2 --recipes fp8-e4m3,int8 --max-ppl-increase 2% --max-kl 0.01 --out
    reports/smollm2
    """
    progress.QUIET = quiet or as_json
    from ptq.commands.compare import run_compare

    results = run_compare(_split(recipes), **options)
    if results.calibration:
        _print_faults(to_json(results.calibration.faults))
    if as_json:
        _print_json(to_json(results))
    else:
        _print_compare(results, options["output"].path)
    _exit_for_gates(results)


@_command("search", **EVALUATION)
def search(
    options: dict[str, Any],
    recipes: Annotated[
        str,
        typer.Option(
            "--recipes",
            help="The recipes a unit may take, cheapest first, comma-separated (names in recipes/ "
            "or .yaml paths); 16-bit is the last resort.",
        ),
    ] = "fp8-e4m3",
    max_kl: Annotated[
        str | None,
        typer.Option(
            "--max-kl",
            metavar="NATS",
            help="Budget: the held-out mean KL from the bf16 baseline, nats per token (e.g. 0.01).",
        ),
    ] = None,
    max_ppl_increase: Annotated[
        str | None,
        typer.Option(
            "--max-ppl-increase",
            metavar="PCT",
            help="Budget: the held-out perplexity increase over the bf16 baseline (e.g. 1%).",
        ),
    ] = None,
    min_accuracy_recovery: Annotated[
        str | None,
        typer.Option(
            "--min-accuracy-recovery",
            metavar="PCT",
            help="Budget: the held-out next-token accuracy, as a share of the bf16 baseline's "
            "(e.g. 99% or next-token=99%).",
        ),
    ] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Find the fewest units (what vLLM serves as one layer) to keep in 16-bit, or at a finer
    recipe, so that the model meets a budget, verified on held-out windows; write
    DIR/searched.yaml, a recipe for compare, quantize, inspect and eval, with search.json,
    search.md and the curve.

    Exits 1 when the held-out interval's upper bound misses the budget; the files are written
    either way.

    Example: ptq search smollm2 --recipes fp8-e4m3,fp8-dynamic --max-kl 0.01 --out reports/search
    """
    progress.QUIET = quiet or as_json
    from ptq.commands.search import parse_budget, run_search, state_path
    from ptq.reporting.search import closest_line, finer_words, verdict_word

    budget = parse_budget(max_kl, max_ppl_increase, min_accuracy_recovery)
    try:
        record = run_search(_split(recipes), budget, **options)
    except KeyboardInterrupt:
        if (state := state_path(Path(options["output"].path))).is_file():
            progress.stderr.print(
                escape(f"the configurations scored so far are in {state}: rerun with --resume "
                       "to continue"),
                highlight=False,
                soft_wrap=True,
            )  # fmt: skip
        raise
    if as_json:
        _print_json(to_json(record))
    else:
        v = record["verdict"]
        verdict = verdict_word(v)
        progress.stderr.print(
            escape(
                f"{record['model']}: {len(record['chosen'])} of {len(record['units'])} unit(s) "
                f"kept in 16-bit{finer_words(record)}, "
                f"{100 * record['fraction_quantized']:.1f}% of matmul weights quantized; "
                f"held-out {record['budget']['measure']} {v['value']:.4g} "
                f"[{v['ci'][0]:.4g}, {v['ci'][1]:.4g}]: {verdict} the budget "
                f"{record['budget']['given']}"
            ),
            highlight=False,
            soft_wrap=True,
        )
        if line := closest_line(record):
            progress.stderr.print(escape(line.replace("**", "")), highlight=False, soft_wrap=True)
        print(f"wrote {options['output'].path}/searched.yaml, search.json, search.md, search.png")
    if not record["verdict"]["meets"]:
        raise typer.Exit(1)


@_command("report")
def report(
    results: Annotated[
        Path,
        typer.Argument(
            metavar="RESULTS.json", parser=_PATH, help="results.json written by `ptq compare`."
        ),
    ],
    previous: Annotated[
        Path | None,
        typer.Option(
            "--previous", parser=_PATH, help="An earlier results.json: show what moved since."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            parser=_PATH,
            help="Write the markdown (and its plots) here instead of printing it.",
        ),
    ] = None,
    max_ppl_increase: MaxPplIncrease = None,
    min_accuracy_recovery: MinAccuracyRecovery = None,
    max_kl: MaxKl = None,
    no_plots: NoPlots = False,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Render a results file as markdown for a pull request or a CI step summary: verdict, table,
    trend, details.

    Gates given here replace those stored by compare; exits 1 when one fails. Plots are drawn only
    with --output.

    Example: ptq report reports/pr/results.json --previous reports/main/results.json
    --max-ppl-increase 2% >> "$GITHUB_STEP_SUMMARY"
    """
    from ptq.commands.report import run_report
    from ptq.reporting.gates import parse_limits
    from ptq.reporting.report import report_summary

    limits = parse_limits(max_ppl_increase, min_accuracy_recovery, max_kl)
    judged, old, markdown = run_report(results, previous, output, limits, not no_plots, force)
    if as_json:
        _print_json(report_summary(judged, old, output))
    elif output is None:
        print(markdown, end="")
    else:
        progress.stderr.print(f"wrote {output}", highlight=False, markup=False, soft_wrap=True)
    _exit_for_gates(judged)


@_command("inspect")
def inspect(
    model: ModelArg = None,
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe",
            help="Recipe(s) to show, comma-separated (names in recipes/ or .yaml paths).",
        ),
    ] = "fp8-e4m3,int8",
    trust_remote_code: RemoteCode = False,
    as_json: Json = False,
    target: Target = "vllm",
) -> None:
    """List the model's Linear layers with their shapes and what each recipe does to them.

    Example: ptq inspect smollm2 --recipe fp8-e4m3
    """
    from ptq.commands.inspect import run_inspect

    info = run_inspect(model, _split(recipe), trust_remote_code, target)
    if as_json:
        _print_json(info)
    else:
        _print_inspect(info)


@_command(
    "quantize",
    model=ModelOptions,
    checkpoint=CheckpointOptions,  # first: --verify heads its panel, --verify-windows after it
    data=DataOptions,
    calibration=CalibrationOptions,
    compute=ComputeOptions,
    output=OutputOptions,
)
def quantize(
    options: dict[str, Any],
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe",
            help="Recipe to export: fp8-e4m3, fp8-dynamic, fp8-block, mxfp8 or int8; NAME+kv or "
            "NAME+kv-head adds an FP8 KV cache (e.g. fp8-e4m3+kv); or a .yaml path with E4M3 or "
            "int8 "
            "weights and inputs.",
        ),
    ] = "fp8-e4m3",
    quiet: Quiet = False,
) -> None:
    """Write a quantized checkpoint (compressed-tensors format) that transformers and vLLM load, and
    verify it.

    Example: ptq quantize smollm2 --recipe fp8-e4m3 -o smollm2-fp8
    """
    progress.QUIET = quiet
    from ptq.commands.quantize import run_quantize
    from ptq.export.verify import VerificationFailed

    # an option takes effect or is refused, never dropped
    if not options["checkpoint"].verify and options["data"].windows != opts.VERIFY_WINDOWS:
        raise PtqError("--verify-windows does not apply with --no-verify (no verification runs)")
    output = options["output"].path
    try:
        info = run_quantize(recipe, **options)
    except VerificationFailed as e:
        _print_quantize(e.info, output, written=False)
        progress.stderr.print(
            f"[bold red]verification failed:[/] {e}; nothing was written to {output} "
            "(--no-verify writes it unverified)",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(1) from None
    _print_faults(info["calibration"]["faults"])
    _print_quantize(info, output, written=True)


@_command("eval", **EVALUATION)
def eval_(
    options: dict[str, Any],
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe", help="The configuration to evaluate (a recipe name or .yaml path)."
        ),
    ] = "bf16",
    quiet: Quiet = False,
) -> None:
    """Evaluate one configuration: perplexity and task accuracy, each with a 95% interval.

    Example: ptq eval smollm2 --recipe fp8-e4m3 --calib smollm2.calib.safetensors --tasks cloze
    """
    progress.QUIET = quiet
    from ptq.commands.evaluate import run_eval

    results = run_eval(recipe, **options)
    if results.calibration:
        _print_faults(to_json(results.calibration.faults))
    _print_eval(results, options["output"].path)


def _print_faults(metadata: dict) -> None:
    """Warnings on stderr for what calibration worked around (also in the calibration file and
    report)."""
    for u in metadata.get("unseen_layers", []):
        progress.stderr.print(
            f"warning: layer '{u['layer']}' received no calibration data; input amax "
            f"{u['input_amax']:.4g} ({u['rule']})",
            highlight=False,
            soft_wrap=True,
        )
    for layer, n in metadata.get("nonfinite_batches", {}).items():
        progress.stderr.print(
            f"warning: layer '{layer}': {n} batch(es) with NaN/inf inputs left out of its amax",
            highlight=False,
            soft_wrap=True,
        )
    for w in metadata.get("warnings", []):
        progress.stderr.print(f"warning: {w}", highlight=False, soft_wrap=True)


def _exit_for_gates(results) -> None:
    """Exit 1 when a gate fails: `results` as judged (compare's fresh gates, or report's judged
    anew), so the exit code and the report's verdict come from the same checks."""
    if results.gates and not results.gates.passed:
        raise typer.Exit(1)


PIPED_WIDTH = 400  # columns of a table printed to a file or a CI log: its rows whole, not cut to 80


def stdout_console():
    """stdout as rich writes it: a terminal's own width; piped (a CI log, a file) wide enough that a
    table's columns are not squeezed away (rich takes 80 columns where it finds no terminal:
    inspect's layer names were cut to 11 characters and its kind and shape columns to none)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPED_WIDTH)


def _print_json(data: dict) -> None:
    import json

    print(json.dumps(data, indent=2))


def _print_inspect(info: dict) -> None:
    from rich.table import Table

    names = list(info["recipes"])
    table = Table(
        title=f"{info['model']['name']}: {info['linear_layers']} quantizable layers "
        f"(Linear, Conv1D, experts), {info['linear_parameters']:,} parameters, as "
        f"{info['target']} serves them"
    )
    table.add_column("layer", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("out x in", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, no_wrap=True)
    short = lambda d: d.replace(" per-tensor", "").replace(" per-channel", " ch")  # noqa: E731
    for row in info["layers"]:
        cells = []
        for name in names:
            r = row["recipes"][name]
            cells.append(
                (f"{short(r['weights'])} / {short(r['inputs'])}" if r["quantized"] else "- (bf16)")
                # a recipe with overrides: the scheme each layer gets
                + (f" ({r['scheme']})" if r.get("scheme") not in (None, name, "bf16") else "")
            )
        table.add_row(row["layer"], row["kind"], f"{row['shape'][0]} x {row['shape'][1]}", *cells)
    console = stdout_console()
    console.print(table)
    console.print(
        "cells: weights / inputs; 'ch' = one scale per output channel, otherwise one "
        "per-tensor scale; '- (bf16)' = left out, runs as the bf16 baseline",
        highlight=False,
    )
    for name, s in info["recipes"].items():
        console.print(
            f"{name}: {s['description']}; quantizes {s['layers']} of "
            f"{info['linear_layers']} layers; {s['coverage_line']}",
            highlight=False,
            soft_wrap=True,
        )


def _print_quantize(info: dict, output: Path, written: bool) -> None:

    from ptq.runtime.resources import size_text

    console = stdout_console()
    size, ver = info["size"], info["verification"]
    if ver is not None:
        tol = ver["tolerance"]
        # ptq's own reader stands in where transformers cannot run the checkpoint as quantized
        # (Conv1D layers)
        reloaded = (
            "ptq reader reload"
            if str(ver.get("loader") or "").startswith("ptq's")
            else "transformers reload"
        )
        console.print(
            f"verification {'[green]passed[/]' if ver['passed'] else '[bold red]FAILED[/]'} "
            f"({reloaded} vs ptq simulation, "
            f"{ver['windows']} windows x {ver['seq_len']} tokens): perplexity "
            f"{ver['reloaded_perplexity']:.4f} vs "
            f"{ver['simulated_perplexity']:.4f} simulated"
            + (
                f", {ver['ptq_perplexity']:.4f} with {ver['ptq_rounding']}"
                if ver["ptq_rounding"]
                else ""
            )
            + f" ({ver['ppl_delta_pct']:+.4f}%; "
            + (
                f"float-order noise floor {ver['noise_floor']['ppl_delta_pct']:+.4f}%, KL "
                f"{ver['noise_floor']['kl_div']:.3g}"
                if ver["noise_floor"]
                else f"no float-order noise floor: {ver['no_noise_floor']}"
            )
            + f"), files {len(ver['tensors_differing']) or 'bit-identical'}"
            + (" differing" if ver["tensors_differing"] else "")
            + f" ({ver['tensors_checked_in_file']} tensors), "
            f"KL {ver['kl_div']:.3g} nats/token (limit {tol['max_kl_div']:g}), same top-1 "
            f"{100 * ver['top1_agreement']:.2f}% "
            f"(limit {100 * tol['min_top1_agreement']:g}%), input quantization in "
            f"{ver['load']['input_quantized_layers']}/"
            f"{info['format']['quantized_layers']} layers",
            highlight=False,
        )
        for p in ver["problems"]:
            console.print(f"  problem: {p}", highlight=False, markup=False)
    else:
        console.print(
            f"not verified ({info.get('verification_skipped', '--no-verify')})",
            highlight=False,
            markup=False,
        )
    if written:
        pct = 100 * size["bytes_saved"] / size["bytes_16bit"]
        console.print(
            f"wrote {output}: {size_text(size['bytes'], si=True)} of tensors in "
            f"{size['shards']} shard(s), {info['format']['quantized_layers']} Linear layers as "
            f"{info['recipe']['weights']} at 1 byte/parameter; "
            f"16-bit checkpoint {size_text(size['bytes_16bit'], si=True)}, saved "
            f"{size_text(size['bytes_saved'], si=True)} ({pct:.1f}%)"
            # a float32 source's other tensors stay float32: the saving against 16 bits is then
            # smaller, even negative
            + f"; the other tensors as in the source ({', '.join(size['other_dtypes']) or 'none'}, "
            f"{size_text(size['other_bytes'], si=True)})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    if written and info.get("hub"):
        console.print(
            f"uploaded to {info['hub']['url']} (commit {info['hub']['commit'][:12]})",
            highlight=False,
        )


def _print_calibration(summary: dict, metadata: dict, output: Path) -> None:
    from rich.table import Table

    table = Table(
        title=f"largest input amax of {summary['layers']} layers "
        f"(min {summary['input_amax_min']:.4g}, median {summary['input_amax_median']:.4g}, max "
        f"{summary['input_amax_max']:.4g})"
    )
    for col in ("layer", "input amax", "weight amax"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for row in summary["largest"]:
        table.add_row(row["layer"], f"{row['input_amax']:.4g}", f"{row['weight_amax']:.4g}")
    console = stdout_console()
    console.print(table)
    console.print(
        f"calibrated on {metadata['tokens']:,} tokens of {metadata['data']}; wrote {output}",
        markup=False,
        soft_wrap=True,
    )


def _print_compare(results, out: Path) -> None:
    from rich.table import Table

    from ptq.reporting.coverage import describe_coverage
    from ptq.reporting.gates import stored_checks
    from ptq.reporting.report import kl_div_text, ppl_delta_text

    base = results.baseline
    checks = stored_checks(results)
    # names (a recipe's, the model's, a task's) are text, not rich markup: escaped, so "[...]" is
    # printed as written
    table = Table(
        title=escape(
            f"{results.model.name}: {results.eval.windows} windows x {results.eval.seq_len} tokens"
        )
    )
    for col in (
        "variant",
        "perplexity",
        "Δ ppl",
        "next-token acc",
        f"KL vs {base.name}",
        "top-1 agreement",
    ):
        table.add_column(escape(col), justify="left" if col == "variant" else "right")
    table.add_row(
        escape(base.name), f"{base.perplexity:.4f}", "", f"{100 * base.accuracy:.2f}%", "", ""
    )
    failed = {c.variant for c in checks if not c.passed}
    for v in results.variants:
        table.add_row(
            escape(v.name) + (" FAIL" if v.name in failed else ""),
            f"{v.perplexity:.4f}",
            ppl_delta_text(
                v, checks
            ),  # with the digits that tell it from its gate's limit, as in the report
            f"{100 * v.accuracy:.2f}%",
            kl_div_text(v, checks),
            f"{100 * v.top1_agreement:.2f}%",
        )
    console = stdout_console()
    console.print(table)
    for v in results.variants:
        console.print(
            f"{v.name}: {describe_coverage(to_json(v.coverage))}",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    _print_tasks(console, results, [base, *results.variants])
    if results.gates:
        from ptq.reporting.report import verdict

        console.print(verdict(results).replace("**", ""), highlight=False, markup=False)
    console.print(
        f"wrote {out / 'report.md'} and {out / 'results.json'}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _print_tasks(console, results, entries: list) -> None:
    from rich.table import Table

    from ptq.evaluation import harness
    from ptq.reporting.gates import stored_checks, task_higher_is_better, task_metric_is_share
    from ptq.reporting.report import interval_text, task_checks, task_delta
    from ptq.reporting.results import CompareResults, fmt_against

    if not results.tasks:
        return
    checks = stored_checks(results) if isinstance(results, CompareResults) else []
    table = Table(
        title="task accuracy, lm-evaluation-harness (95% CI; Δ vs baseline in points, "
        "* = distinguishable from 0; recovery = variant / baseline)"
    )
    for col in ("task", "metric", "n", *(e.name for e in entries)):
        table.add_column(escape(col), justify="left" if col in ("task", "metric") else "right")
    for task in results.tasks:
        for metric in task.metrics:
            # a share in [0, 1] as a percentage; a metric in its own units (likelihood_diff, nats)
            # as it is
            scale, unit, places = (
                (100, "%", 1) if task_metric_is_share(results, task.name, metric) else (1, "", 3)
            )
            cells = []
            for e in entries:
                m = e.tasks[task.name].metrics[metric]
                ci = interval_text(m.ci, scale, f".{places}f")
                cell = f"{scale * m.value:.{places}f}{unit} {ci}"
                d = task_delta(e, task.name, metric)
                if d:
                    gated = task_checks(checks, e.name, task.name, metric)
                    limit = gated[0].limit if gated else None
                    cell += (
                        f" ({fmt_against(scale * d.delta, None, f'+.{places}f', 0)}"
                        f"{'*' if d.significant else ''}; "
                        f"{fmt_against(d.recovery_pct, limit, '.1f')}%"
                        f"{' FAIL' if any(not c.passed for c in gated) else ''})"
                    )
                cells.append(escape(cell))
            lower = (
                "" if task_higher_is_better(results, task.name, metric) else " (lower is better)"
            )
            table.add_row(escape(task.name), escape(metric + lower), str(task.n), *cells)
    console.print(table)
    for task in (
        results.tasks
    ):  # lm-eval's numbers ptq cannot pair (harness.describe_tasks), named here too
        for note in task.notes:
            if note.startswith(harness.NOT_REPORTED):
                console.print(escape(f"{task.name}: {note}"), highlight=False, soft_wrap=True)


def _print_eval(results, out: Path) -> None:

    from ptq.evaluation.stats import MIN_UNITS
    from ptq.reporting.report import interval_text

    c = results.config
    interval = interval_text(c.perplexity_ci, fmt=".4f")
    if interval == "n/a":
        interval = f"(no interval: fewer than {MIN_UNITS} windows)"
    console = stdout_console()
    console.print(
        f"{results.model.name} with {c.name}: perplexity {c.perplexity:.4f} {interval} on "
        f"{results.eval.windows} windows x {results.eval.seq_len} tokens",
        markup=False,  # an interval is no rich markup tag ("[nan, nan]" vanished as one)
        soft_wrap=True,
    )
    _print_tasks(console, results, [c])
    console.print(
        f"wrote {out / 'report.md'} and {out / 'results.json'}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


_TERMINATED: list[int] = []  # set by the SIGTERM handler (click re-raises interrupts as its own)


def _terminate(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so that every temporary file is removed on the way out."""
    _TERMINATED.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    """Entry point: user mistakes (PtqError) become one line on stderr and exit code 2. Ctrl-C (130)
    and SIGTERM (143) unwind normally: half-written outputs are deleted, finished ones and
    checkpoints stay."""
    from ptq.runtime.allocator import keep_freed_host_memory

    keep_freed_host_memory()  # fewer page faults per forward (docs/performance.md)
    _TERMINATED.clear()
    progress.NOTES.clear()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        code = app(
            standalone_mode=False
        )  # click's own usage errors are printed below, in ptq's one line
        progress.print_notes()
        raise SystemExit(
            code if isinstance(code, int) else 0
        )  # as typer's standalone mode: typer.Exit(n), 130, 0
    except click_exceptions.ClickException as e:
        if (
            type(e).__name__ != "NoArgsIsHelpError"
        ):  # bare `ptq`: typer has printed the help already
            progress.stderr.print(
                f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True
            )
        raise SystemExit(e.exit_code) from None
    except typer.Abort:  # end of input at a prompt (ptq asks for none)
        progress.stderr.print("Aborted!", highlight=False)
        raise SystemExit(1) from None
    except PtqError as e:
        progress.stderr.print(
            f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True
        )
        raise SystemExit(2) from None
    except Exception as e:
        if (
            type(e).__name__ != "OutOfMemoryError"
        ):  # torch.cuda.OutOfMemoryError where no step named what did not fit
            raise
        from ptq.runtime.devices import out_of_memory

        progress.stderr.print(
            f"[bold red]error:[/] {escape(str(out_of_memory('', str(e))))}",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(2) from None
    except (KeyboardInterrupt, SystemExit) as e:  # typer turns KeyboardInterrupt into exit code 130
        if not (_TERMINATED or isinstance(e, KeyboardInterrupt) or e.code == 130):
            raise
        progress.stderr.print("terminated" if _TERMINATED else "interrupted", highlight=False)
        raise SystemExit(143 if _TERMINATED else 130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
