"""Which files a model may be read from (ptq.model_files): a model folder's metadata cannot make ptq
read a file outside the folder, nor a symlink in it lead out of it (but a Hub snapshot's into its
blobs/), a damaged index or config is one line, and a checkpoint with layers its config does not
have is refused; in memory and layer by layer (--low-memory) alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_faults import one_error_line

BOTH_PATHS = pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory) -> Path:
    """tiny_model saved in several shards, with a model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(path, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def copied(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def last_shard(model: Path) -> str:
    return sorted(p.name for p in model.glob("*.safetensors"))[-1]


def calibrate(ptq_run, model: Path, tmp_path: Path, low_memory: bool):
    return ptq_run(
        "calibrate", model, o=tmp_path / "c.safetensors", low_memory=low_memory, force=True
    )


@BOTH_PATHS
@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_shard_named_outside_the_model_folder_is_refused(
    sharded, tmp_path, ptq_run, low_memory, where
):
    """The index names a shard by '../elsewhere/x.safetensors' or an absolute path: in memory
    transformers refused it, layer by layer it was read into the calibration and the export."""
    model = copied(sharded, tmp_path / "m")
    shard = last_shard(model)
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "x.safetensors"
    (model / shard).rename(outside)
    name = "../elsewhere/x.safetensors" if where == "parent" else str(outside)
    index = model / "model.safetensors.index.json"
    edit_json(
        index,
        lambda d: d["weight_map"].update(
            {k: name for k, v in d["weight_map"].items() if v == shard}
        ),
    )
    code, _, err = calibrate(ptq_run, model, tmp_path, low_memory)
    assert code == 2 and one_error_line(err), err
    assert f"{index} names the file '{name}', outside the model folder" in err, err
    assert not (tmp_path / "c.safetensors").exists()


@BOTH_PATHS
@pytest.mark.parametrize("target", ["shard", "tokenizer.json", "config.json"])
def test_a_symlink_out_of_the_model_folder_is_refused(
    sharded, tmp_path, ptq_run, low_memory, target
):
    """A file of the model folder that is a symlink to a file elsewhere is not read: a model from
    elsewhere could otherwise have ptq read any file of the user's."""
    model = copied(sharded, tmp_path / "m")
    name = last_shard(model) if target == "shard" else target
    outside = tmp_path / "kept-elsewhere"
    (model / name).rename(outside)
    (model / name).symlink_to(outside)
    code, _, err = calibrate(ptq_run, model, tmp_path, low_memory)
    assert code == 2 and one_error_line(err), err
    assert f"{model / name} is a symlink to {outside}, outside the model folder {model}" in err


@BOTH_PATHS
def test_a_hub_snapshot_reads_its_blobs_through_symlinks(tiny_model, tmp_path, ptq_run, low_memory):
    """The Hugging Face cache's layout: snapshots/COMMIT/NAME -> ../../blobs/HASH. Those symlinks
    lead out of the snapshot folder, into its own repository's blobs: they are read. A symlink in
    the folder to itself (inside) is read too."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(tiny_model.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    code, _, err = calibrate(ptq_run, snapshot, tmp_path, low_memory)
    assert code == 0, err
    # the same files, but the folder not in a Hub repository's snapshots/: refused
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in snapshot.iterdir():
        (plain / f.name).symlink_to(f.resolve())
    code, _, err = calibrate(ptq_run, plain, tmp_path, low_memory)
    assert code == 2 and "outside the model folder" in err, err


def test_the_rule_for_names_from_a_model_folder(tmp_path):
    """ptq.model_files.model_file: a relative name inside the folder, nothing else."""
    from ptq.errors import PtqError
    from ptq.model_files import model_file

    model = tmp_path / "m"
    (model / "sub").mkdir(parents=True)
    (model / "sub" / "a.safetensors").write_bytes(b"")
    (model / "in").symlink_to(model / "sub")
    (model / "out").symlink_to(tmp_path)
    assert model_file(model, "sub/a.safetensors", "index") == model / "sub" / "a.safetensors"
    assert model_file(model, "in/a.safetensors", "index") == model / "in" / "a.safetensors"
    for name in ("../x", "/etc/passwd", "sub/../../x", "out/x", "", "a\x00b", 5, ["a"], None):
        with pytest.raises(PtqError, match="^index names "):
            model_file(model, name, "index")


BAD_INDEXES = {
    "a number": lambda d: d["weight_map"].update({next(iter(d["weight_map"])): 5}),
    "a list": lambda d: d["weight_map"].update({next(iter(d["weight_map"])): ["a"]}),
    "weight_map a list": lambda d: d.update(weight_map=[1, 2]),
    "no weight_map": lambda d: d.pop("weight_map"),
}


@BOTH_PATHS
@pytest.mark.parametrize("fault", [*BAD_INDEXES, "deep index", "deep config"])
def test_a_damaged_index_or_config_is_one_line(sharded, tmp_path, ptq_run, low_memory, fault):
    """weight_map values that are numbers or lists (a TypeError traceback in memory), a weight_map
    that is no mapping, and JSON nested deeper than Python's stack (a RecursionError traceback):
    one line, exit 2, naming the file."""
    model = copied(sharded, tmp_path / "m")
    index = model / "model.safetensors.index.json"
    if fault == "deep index":
        index.write_text("[" * 100_000 + "]" * 100_000)
        named = index
    elif fault == "deep config":
        (model / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
        named = model / "config.json"
    else:
        edit_json(index, BAD_INDEXES[fault])
        named = index
    code, _, err = calibrate(ptq_run, model, tmp_path, low_memory)
    assert code == 2 and one_error_line(err) and str(named) in err, err
    if fault.startswith("deep"):
        assert "nested too deeply" in err, err


@BOTH_PATHS
@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_layers_the_config_does_not_have_are_refused(
    tiny_model, sharded, tmp_path, ptq_run, low_memory, layout
):
    """A checkpoint with 2 layers whose config says 1: the second layer was dropped from the
    calibration and the export without a word."""
    model = copied(sharded if layout == "sharded" else tiny_model, tmp_path / "m")
    edit_json(model / "config.json", lambda d: d.update(num_hidden_layers=1))
    code, _, err = ptq_run(
        "quantize", model, o=tmp_path / "out", low_memory=low_memory, recipe="fp8-e4m3"
    )
    assert code == 2 and one_error_line(err), err
    assert "'model.layers.1." in err and "does not have (num_hidden_layers)" in err, err
    assert not (tmp_path / "out").exists()


@BOTH_PATHS
@pytest.mark.parametrize("count", [-1, 0, "2", 1.5, True])
def test_a_layer_count_that_counts_no_layers_is_an_invalid_config(
    tiny_model, tmp_path, ptq_run, low_memory, count
):
    """num_hidden_layers -1 was reported as a recipe that "quantizes no layer"."""
    model = copied(tiny_model, tmp_path / "m")
    edit_json(model / "config.json", lambda d: d.update(num_hidden_layers=count))
    code, _, err = calibrate(ptq_run, model, tmp_path, low_memory)
    assert code == 2 and one_error_line(err), err
    assert f"config {model / 'config.json'} is invalid: num_hidden_layers is {count!r}" in err


@BOTH_PATHS
def test_remote_code_named_in_the_tokenizer_config_is_said_to_be_there(
    tiny_model, tmp_path, ptq_run, low_memory
):
    """auto_map in tokenizer_config.json (not config.json): the refusal names that file; layer by
    layer it was transformers' multi-line message."""
    model = copied(tiny_model, tmp_path / "m")
    marker = tmp_path / "pwned"
    edit_json(
        model / "tokenizer_config.json",
        lambda d: d.update(
            tokenizer_class="CustomTok", auto_map={"AutoTokenizer": ["tok.CustomTok", None]}
        ),
    )
    (model / "tok.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, _, err = calibrate(ptq_run, model, tmp_path, low_memory)
    assert code == 2 and one_error_line(err), err
    assert "(auto_map in its tokenizer_config.json), which ptq runs only with" in err, err
    assert not marker.exists()


def test_an_exports_source_dtypes_are_read_from_the_files_loading_read(sharded, tmp_path):
    """source_dtypes (the dtypes the export writes untouched tensors in) reads the shards the index
    names, as loading does, not a repository's other copy of the weights (Mistral's
    consolidated.safetensors), nor a file the rule refuses."""
    import safetensors.torch
    import torch

    from ptq.errors import PtqError
    from ptq.export.checkpoint import source_dtypes

    model = copied(sharded, tmp_path / "m")
    safetensors.torch.save_file(
        {"model.norm.weight": torch.zeros(64, dtype=torch.float16)},
        str(model / "consolidated.safetensors"),
    )
    assert set(source_dtypes(str(model)).values()) == {torch.float32}
    shard = last_shard(model)
    (model / shard).rename(tmp_path / "elsewhere.safetensors")
    (model / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(PtqError, match="outside the model folder"):
        source_dtypes(str(model))
