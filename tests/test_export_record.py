"""The typed export record: ptq-export.json is its JSON (optional fields left out while unset, not
null), and the model card renders from the record alone."""

import dataclasses

from ptq.export.card import render_model_card
from ptq.export.record import (
    KIND,
    CheckpointSize,
    ExportCalibration,
    ExportedModel,
    ExportFormat,
    ExportRecord,
)


def record(**changes) -> ExportRecord:
    r = ExportRecord(
        kind=KIND,
        model=ExportedModel("tiny", "/models/tiny", [], "LlamaForCausalLM", None),
        recipe={
            "name": "fp8-e4m3",
            "description": "FP8",
            "weights": "e4m3 per-tensor",
            "inputs": "e4m3 per-tensor",
        },
        target="vllm",
        target_rules=None,
        format=ExportFormat("compressed-tensors", "float-quantized", "0.20", 14, ["lm_head"]),
        calibration=ExportCalibration(
            "calibrated in this run", "t.txt", "ab" * 32, 2, 32, 64, 2, {}
        ),
        size=CheckpointSize(1000, 1800, 800, 700, 60, 240, ["float32"], 1, 1000),
        coverage=None,
        verification=None,
        low_memory=False,
        compare=None,
        versions={"ptq": "0.1.0"},
        created="2025-01-01T00:00:00+00:00",
    )
    return dataclasses.replace(r, **changes)


def test_the_record_serializes_in_field_order_without_unset_optional_fields():
    info = record().to_json()
    assert list(info)[:3] == ["kind", "model", "recipe"] and list(info)[-1] == "created"
    assert "verification_skipped" not in info and info["verification"] is None
    assert info["size"]["shards"] == 1 and info["model"]["hub_id"] is None
    skipped = record(verification_skipped="too big").to_json()
    assert list(skipped)[-1] == "verification_skipped"


def test_the_card_renders_from_the_record():
    card = render_model_card(record())
    assert "Not verified (exported with `--no-verify`)." in card
    assert "| layers | 14 Linear layers quantized; left as in the source: `lm_head` |" in card
    assert "base_model" not in card  # no Hub id
    card = render_model_card(
        record(
            verification_skipped="too big",
            model=dataclasses.replace(record().model, hub_id="org/tiny"),
        )
    )
    assert "Not verified (too big)." in card and "base_model: org/tiny" in card


def test_names_from_outside_cannot_break_the_card():
    """A model folder named with a newline, '|' or backticks ended the card's heading and split its table rows: such
    names are rendered visibly (\\n) and escaped, so every row still has its two cells."""
    evil = "/models/a\nb|c`d#"
    card = render_model_card(
        record(
            model=dataclasses.replace(record().model, name=evil, source=evil),
            calibration=dataclasses.replace(record().calibration, data="x|\r\ny.txt"),
        )
    )
    lines = card.splitlines()
    heading = next(line for line in lines if line.startswith("# "))
    assert heading.startswith("# /models/a\\\\nb\\|c\\`d\\# — fp8-e4m3"), heading
    rows = [line for line in lines if line.startswith("| ")]
    assert all(line.replace("\\|", "").count("|") == 3 for line in rows[:12]), rows
    assert "| source model | /models/a\\nb\\|c`d# (LlamaForCausalLM) |" in card
    assert "| calibration | x\\|\\r\\ny.txt (sha256" in card
