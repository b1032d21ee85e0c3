"""What a command is told, in five groups, built once by the CLI (ptq.cli) and passed whole to the command's function
(ptq.commands.workflows): the model, the evaluation data, the calibration, the computation, the outputs; and, for
`quantize`, the checkpoint. A field is a command-line option under its own name (the flag is in its comment).

Every option a command is given takes effect there or is refused in one line (`refuse_unused`): a command that
does not use an option never drops it silently. The fields are given by name only (kw_only): two neighbouring numbers
cannot be swapped unnoticed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ptq.calibration.calibrate import NONFINITE_POLICIES, UNSEEN_POLICIES
from ptq.errors import PtqError
from ptq.execution.batching import parse_batch_size
from ptq.execution.placement import Placement
from ptq.reporting.gates import Limits

DEFAULT_MAX_ITEMS = (
    300  # cloze items built from the text; an evenly spaced subset keeps a CPU run to minutes
)


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Which model, how it is loaded, and what it is refused for."""

    model: str | None = (
        None  # Hub id, local folder, .gguf file; None: the offline default (smollm2)
    )
    trust_remote_code: bool = False  # --trust-remote-code
    allow_pickle: bool = False  # --allow-pickle: pickle (.bin) checkpoints, loaded with torch.load(weights_only=True)
    memory_check: bool = True  # False: --no-memory-check
    dtype: str | None = (
        None  # --dtype: float32 or bfloat16; None: bfloat16 on CUDA, float32 on the CPU
    )
    placement: Placement | None = (
        None  # --device-map and --max-memory (ptq.execution.placement.parse)
    )
    strict_coverage: bool = (
        False  # --strict-coverage: refuse a model with matmul weights ptq cannot quantize
    )


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """The evaluation: text, windows and tasks (quantize: the text and windows that verify the checkpoint)."""

    data: str | None = (
        None  # --eval-data (quantize: the evaluation split of --data); None: the offline default text
    )
    seq_len: int = 512  # --seq-len
    windows: int | None = (
        40  # --max-windows (quantize: --verify-windows); None: every window of the text
    )
    tasks: str | None = None  # --tasks: lm-evaluation-harness tasks (ptq.evaluation.harness)
    max_items: int | None = (
        None  # --max-items: cloze items built from the text; None: DEFAULT_MAX_ITEMS
    )
    num_fewshot: int | None = None  # --num-fewshot (lm-eval's); None: each task's own
    limit: float | None = (
        None  # --limit (lm-eval's): the first N documents of each task, or a fraction below 1
    )


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    """A calibration file to reuse, or the text and policies to calibrate with."""

    file: Path | None = None  # --calib: a file from `ptq calibrate`
    data: str | None = (
        None  # --calib-data (calibrate, quantize: --data); None: the offline default text
    )
    samples: int = 32  # --calib-samples (calibrate, quantize: --samples): calibration windows
    seq_len: int = 512  # --seq-len
    on_nonfinite: str = "fail"  # --on-nonfinite
    on_unseen: str = "fallback"  # --on-unseen
    all_experts: bool = True  # --calibrate-all-experts / --routed-experts-only
    resume: bool = False  # --resume (calibrate)
    checkpoint_every: float = 60.0  # --checkpoint-every, seconds (calibrate)

    def __post_init__(self):
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise PtqError(
                f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, not '{self.on_nonfinite}'"
            )
        if self.on_unseen not in UNSEEN_POLICIES:
            raise PtqError(
                f"--on-unseen must be one of {', '.join(UNSEEN_POLICIES)}, not '{self.on_unseen}'"
            )


@dataclass(frozen=True, kw_only=True)
class ComputeOptions:
    """How the models run."""

    batch_size: int | str | None = (
        None  # --batch-size: windows per forward pass; None or "auto": automatic
    )
    matmul: str = "auto"  # --matmul: simulated, fp8 or auto
    low_memory: bool | None = (
        None  # --low-memory / --in-memory; None: layer by layer when the model does not fit
    )
    target: str = "vllm"  # --target: the engine whose load-time rules the simulation applies (ptq.quantization.engines)

    def __post_init__(self):
        object.__setattr__(
            self, "batch_size", parse_batch_size(self.batch_size)
        )  # an int, or None for automatic


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """Where the results go."""

    path: Path  # compare, eval: the report folder (--out); calibrate: the calibration file, quantize: the checkpoint (-o)
    force: bool = False  # --force: replace existing outputs
    plots: bool = True  # False: --no-plots (compare)
    limits: Limits | None = (
        None  # the gates (compare): --max-ppl-increase, --min-accuracy-recovery, --max-kl
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What quantize writes besides the weights."""

    verify: bool = True  # --verify / --no-verify: reload the checkpoint and check its logits against ptq's simulation
    shard_size_mb: float = 1000.0  # --shard-size
    compare_results: Path | None = (
        None  # --compare-results: a compare results.json for the model card
    )
    push_to_hub: str | None = (
        None  # --push-to-hub org/name: uploaded once written and verified (ptq.export.hub)
    )
    private: bool = False  # --private: a repository --push-to-hub creates is private


def refuse_unused(command: str, options: object, **flags: str) -> None:
    """One line for an option that `command` does not use but was given (its field differs from the default):
    flags maps the field to the flag named in the message."""
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(options)
        if f.default is not dataclasses.MISSING
    }
    for name, flag in flags.items():
        if getattr(options, name) != defaults[name]:
            raise PtqError(f"{flag} does not apply to ptq {command}")
