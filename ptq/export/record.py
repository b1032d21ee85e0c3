"""ptq-export.json, typed: what `ptq quantize` exported and how it was verified. The model card
(ptq.export.card) is rendered from this record alone, and the file is its JSON (to_json): the fields
in their order, nested records as objects, and the optional fields (OPTIONAL) left out when unset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

EXPORT_INFO = "ptq-export.json"  # the record as JSON, next to the checkpoint it describes
KIND = "ptq-export/1"

# a field with this metadata is left out of the JSON while it is None (absent, not null)
OPTIONAL = {"optional": True}


def to_json(value: Any) -> Any:
    """A record (or any part of it) as JSON values: dataclasses as objects keyed by field name, in
    field order, without their unset OPTIONAL fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get("optional") and getattr(value, f.name) is None)
        }
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class NoiseFloor:
    """The simulation with another attention implementation: float-order noise, measured, not a
    limit."""

    what: str
    ppl_delta_pct: float
    kl_div: float
    top1_agreement: float


@dataclass(frozen=True)
class Tolerance:
    max_kl_div: float
    min_top1_agreement: float
    files: str


@dataclass(frozen=True)
class Verification:
    """The reloaded checkpoint scored against ptq's simulation (ptq.export.verify.verify), then what
    the command adds: which loader read it back, and on which text."""

    passed: bool
    problems: list[str]
    criterion: str
    windows: int
    seq_len: int
    tokens: int
    simulated_perplexity: float
    reloaded_perplexity: float
    ptq_perplexity: float
    ppl_delta_pct: float
    kl_div: float
    top1_agreement: float
    # None where no other float order runs the model, and no_noise_floor says why
    noise_floor: NoiseFloor | None
    no_noise_floor: str | None
    ptq_rounding: str | None
    tensors_checked_in_file: int
    tensors_differing: list[str]
    # the scales the loader has no place for, checked in the files: input scales, and the KV
    # cache's k/v scales
    input_scales_checked_in_file: int
    kv_scales_checked_in_file: int
    tolerance: Tolerance
    load: dict  # what the loader made of the checkpoint (ptq.export.reading)
    loader: str | None = None
    # transformers failed in float32: how it does in bfloat16 (ptq.export.reading.bfloat16_check)
    transformers_bfloat16: dict | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # simulated with the loader's token rule (ptq.export.verify.token_rule_layers)
    loader_token_rule_layers: list[str] | None = None
    data: str | None = None
    data_sha256: str | None = None
    description: str | None = None


@dataclass(frozen=True)
class ExportedModel:
    name: str
    source: str
    caveats: list[str]
    architecture: str
    hub_id: str | None  # the model card's base_model: the Hub links the two


@dataclass(frozen=True)
class ExportFormat:
    quant_method: str
    format: str
    compressed_tensors: str
    quantized_layers: int
    ignored_layers: list[str]


@dataclass(frozen=True)
class ExportCalibration:
    source: str
    data: str | None
    data_sha256: str | None
    windows: int | None
    seq_len: int | None
    tokens: int | None
    batch_size: int | None
    faults: dict


@dataclass(frozen=True)
class CheckpointSize:
    """ptq.export.checkpoint.checkpoint_bytes, then what write_weights wrote."""

    bytes: int
    bytes_16bit: int
    bytes_saved: int
    quantized_params: int
    scale_bytes: int
    other_bytes: int
    other_dtypes: list[str]
    shards: int
    tensor_bytes: int


@dataclass(frozen=True)
class ExportRecord:
    """Everything ptq-export.json holds; `recipe`, `coverage` and `compare` are JSON already (the
    recipe's summary, the plan's coverage, the rows of a `ptq compare` results file)."""

    kind: str
    model: ExportedModel
    recipe: dict
    target: str
    target_rules: str | None
    format: ExportFormat
    calibration: ExportCalibration
    size: CheckpointSize
    coverage: dict | None
    verification: Verification | None
    low_memory: bool
    compare: dict | None
    versions: dict[str, str]
    created: str
    # why the checkpoint was written unverified, where the command could not check it
    verification_skipped: str | None = dataclasses.field(default=None, metadata=OPTIONAL)

    def to_json(self) -> dict:
        return to_json(self)
