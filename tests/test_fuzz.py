"""Property-based fuzzing of the parsers of user files (recipes, calibration files): whatever the input,
the only exception that may escape is PtqError (one clear line), and nothing hangs."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptq.calibration.calibrate import Calibration, load_calibration, save_calibration
from ptq.errors import PtqError
from ptq.quantization.recipes import load_recipe, parse_recipe

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
yaml_like = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=10) | st.integers(), inner, max_size=5)
    ),
    max_leaves=20,
)
# Near-valid recipes reach deeper into the validation than random values do.
field_values = (
    st.sampled_from(["e4m3", "int8", "bf16", "fp8-e5m2", "nope", "", "tensor", "channel"])
    | yaml_like
)
tensor_quant = st.dictionaries(
    st.sampled_from(["format", "granularity", "saturate", "extra"]), field_values, max_size=4
)
recipes = st.fixed_dictionaries(
    {},
    optional={
        "name": field_values,
        "description": field_values,
        "weights": tensor_quant | yaml_like,
        "inputs": tensor_quant | yaml_like,
        "targets": st.lists(field_values, max_size=3) | yaml_like,
        "ignore": st.lists(field_values, max_size=3) | yaml_like,
        "other": yaml_like,
    },
)


def only_ptq_errors(call):
    try:
        call()
    except PtqError as e:
        assert "\n" not in str(e) or str(e).count("\n") < 3
        assert len(str(e)) < 2000  # a hostile value is never echoed in full


@FUZZ
@given(recipes | yaml_like)
def test_parse_recipe_only_raises_ptq_error(data):
    only_ptq_errors(lambda: parse_recipe(data))


@FUZZ
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_load_recipe_text_only_raises_ptq_error(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    only_ptq_errors(lambda: load_recipe(str(path)))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 50_000,  # nesting deep enough to exhaust PyYAML's recursion
        # "billion laughs": 9^8 references; echoing it in an error message took minutes
        "a: &a [x,x,x,x,x,x,x,x,x]\n"
        + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n"
            for i in range(8)
        )
        + "name: *i\nweights: {format: e4m3}\ninputs: {format: e4m3}\n",
    ],
)
def test_hostile_yaml_is_refused_quickly(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    start = time.monotonic()
    with pytest.raises(PtqError):
        load_recipe(str(path))
    # Minutes without the guards; seconds with them, more on a loaded 2-core machine (7 s seen under 5 jobs)
    assert time.monotonic() - start < 30


def valid_calibration_bytes(tmp_path: Path) -> bytes:
    metadata = {"data": "text", "data_sha256": "0" * 64, "windows": 2, "seq_len": 8, "tokens": 16}
    calibration = Calibration(
        {"a.b": torch.tensor(1.5), "c": torch.tensor(0.0)},
        {"a.b": torch.tensor(0.25), "c": torch.tensor(2.0)},
        metadata,
    )
    path = tmp_path / "valid.st"
    save_calibration(calibration, path, force=True)
    return path.read_bytes()


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_bit_flipped_and_truncated_calibration_files(tmp_path, data):
    original = valid_calibration_bytes(tmp_path)
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(damaged) - 1))
        damaged[i] ^= 1 << data.draw(st.integers(0, 7))
    damaged = bytes(damaged[: data.draw(st.integers(0, len(damaged)))])
    path = tmp_path / "damaged.st"
    path.write_bytes(damaged)
    try:
        calibration = load_calibration(path)
    except PtqError:
        return
    # Whatever got through is well-formed: finite, non-negative scalars for the same layers.
    assert set(calibration.input_amax) == set(calibration.weight_amax)
    for value in [*calibration.input_amax.values(), *calibration.weight_amax.values()]:
        assert (
            value.dtype == torch.float32
            and value.shape == ()
            and torch.isfinite(value)
            and value >= 0
        )


entry_names = st.sampled_from(
    ["input_amax/l", "weight_amax/l", "input_amax/", "other/l", "l"]
) | st.text(max_size=12)
dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.float64])
values = st.floats(allow_nan=True, allow_infinity=True, width=32)
metadata_json = st.one_of(
    st.builds(json.dumps, yaml_like),
    st.builds(
        lambda extra: json.dumps(
            {"data": "t", "data_sha256": "x", "windows": 1, "seq_len": 2, "tokens": 2} | extra
        ),
        st.dictionaries(
            st.sampled_from(
                ["windows", "tokens", "unseen_layers", "warnings", "nonfinite_batches", "data"]
            ),
            yaml_like,
            max_size=3,
        ),
    ),
    st.text(max_size=20),
)


@FUZZ
@given(
    st.dictionaries(entry_names, st.tuples(dtypes, st.lists(values, max_size=3)), max_size=4),
    st.sampled_from(["ptq-calibration/3", "ptq-calibration/2", "other", ""]),
    metadata_json,
)
def test_structured_calibration_files(tmp_path, entries, kind, metadata):
    tensors = {
        k: torch.tensor(v, dtype=torch.float32).to(dtype) for k, (dtype, v) in entries.items()
    }
    path = tmp_path / "fuzz.st"
    safetensors.torch.save_file(tensors, str(path), metadata={"kind": kind, "metadata": metadata})
    only_ptq_errors(lambda: load_calibration(path))


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 2**64 - 1))
def test_random_bytes_as_calibration_file(tmp_path, body, header_len):
    path = tmp_path / "random.st"
    path.write_bytes(struct.pack("<Q", header_len) + body)
    only_ptq_errors(lambda: load_calibration(path))
