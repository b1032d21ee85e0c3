"""Model specs that are not models: one quick, accurate line each (no download retries, no cut-off reasons)."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from ptq import progress
from ptq.errors import PtqError
from ptq.models import loading

PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("spec", ["a/b/c", "x@y", "org/na me"])
def test_a_name_that_is_no_path_and_no_hub_id_is_refused_at_once(ptq_cli, spec, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the Hub must not be asked")

    monkeypatch.setattr(socket, "create_connection", no_network)
    start = time.monotonic()
    code, out, err = ptq_cli("inspect", spec)
    assert code == 2 and out == "" and time.monotonic() - start < 10
    line = one_line(err)
    assert f"no model folder or file '{spec}'" in line and "org/name" in line and "'smollm2'" in line


def test_a_hub_id_offline_and_not_cached_fails_at_once(ptq_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    code, _, err = ptq_cli("inspect", "ptq-test-org/nosuch")
    assert code == 2 and time.monotonic() - start < 10
    line = one_line(err)
    assert (
        "'ptq-test-org/nosuch'" in line and "not in the local Hugging Face cache" in line and "HF_HUB_OFFLINE" in line
    )


@pytest.mark.parametrize("spec", ["ptq-test-org/nosuch", "smollm"])  # smollm: a typo of the default, or a bare Hub id
def test_a_hub_id_without_a_network_fails_after_one_try(ptq_cli, monkeypatch, spec):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "_hub_offline", lambda: False)
    for name in PROXIES:
        monkeypatch.delenv(name, raising=False)
    tries = []

    def unreachable(address, timeout=None):
        tries.append(address)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    start = time.monotonic()
    code, _, err = ptq_cli("inspect", spec)
    assert code == 2 and time.monotonic() - start < 10 and len(tries) == 1
    line = one_line(err)
    assert f"no model folder or file '{spec}'" in line and "'smollm2'" in line
    assert "cannot be reached" in line and "Name or service not known" in line and "Retry" not in err


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_used(monkeypatch):
    monkeypatch.setattr(loading, "_hub_cached", lambda repo_id: True)
    monkeypatch.setattr(loading, "_hub_offline", lambda: True)
    assert loading.hub_access("org/name") == {"local_files_only": True}
    monkeypatch.setattr(loading, "_hub_offline", lambda: False)
    monkeypatch.setattr(loading, "_hub_unreachable", lambda: "huggingface.co: Name or service not known")
    assert loading.hub_access("org/name") == {"local_files_only": True}
    monkeypatch.setattr(loading, "_hub_unreachable", lambda: None)  # a network: transformers' normal path
    assert loading.hub_access("org/name") == {}
    monkeypatch.setattr(loading, "_hub_cached", lambda repo_id: False)
    assert loading.hub_access("org/name") == {}


def test_an_existing_file_that_is_not_a_model_says_what_it_is(ptq_cli, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello")
    code, _, err = ptq_cli("inspect", text)
    line = one_line(err)
    assert code == 2 and f"{text} is a file, not a model" in line and "does not exist" not in line
    assert "model folder" in line and ".gguf file" in line and "Hub id" in line
    code, _, err = ptq_cli("inspect", tmp_path / "missing")
    assert code == 2 and f"model folder or file {tmp_path / 'missing'} does not exist" in one_line(err)


def test_a_model_folder_without_tokenizer_files_says_so_completely(ptq_cli, tiny_model, tmp_path):
    notok = tmp_path / "notok"
    shutil.copytree(tiny_model, notok)
    for name in loading.TOKENIZER_FILES + ("special_tokens_map.json",):
        (notok / name).unlink(missing_ok=True)
    code, _, err = ptq_cli("inspect", notok)
    line = one_line(err)
    assert code == 2 and "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json" in line
    assert line.rstrip().endswith(f"in {notok}") and "Couldn't instantiate" not in line


def test_a_multi_line_loading_error_is_kept_whole_on_one_line():
    error = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a file\n(2) an instance")
    assert (
        loading._one_line(error) == "Couldn't instantiate the backend tokenizer from one of: (1) a file (2) an instance"
    )
    assert loading._one_line(ValueError("")) == "ValueError"
    assert len(loading._one_line(ValueError("x" * 1000))) == 400


@pytest.mark.parametrize("quiet", [False, True])
def test_a_gguf_conversion_says_so_before_the_long_work(tmp_path, monkeypatch, capsys, quiet):
    gguf = tmp_path / "Some-Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "gguf_caveat", lambda path: "caveat")

    def convert(*args, **kwargs):  # the long work: stop here, after the announcement
        raise PtqError("stopped")

    monkeypatch.setattr(loading, "_from_pretrained", convert)
    monkeypatch.setattr(progress, "QUIET", quiet)
    with pytest.raises(PtqError, match="stopped"):
        loading.converted_gguf_dir(gguf)
    err = capsys.readouterr().err
    if quiet:
        assert err == ""
    else:
        assert "converting Some-Model.Q4_1.gguf into the ptq cache" in err and "once" in err


def error_line(err: str) -> str:
    """The one line of an error, after transformers' progress bar of the weights it read."""
    return one_line("\n".join(line for line in err.splitlines() if "Loading weights" not in line))


def _edit_checkpoint(source, target, edit) -> None:
    """A copy of the model in `source` whose (single-file) safetensors tensors `edit` changes in place."""
    import safetensors.torch

    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    edit(tensors)
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(ptq_cli, tiny_model, tmp_path):
    """transformers fills a tensor missing from the checkpoint with random values, its warning hidden: refused,
    in one line naming it. A tied lm_head and the computed rotary buffers are not missing (tiny_model ties them)."""
    import safetensors

    with safetensors.safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    loading.load_model(str(tiny_model))  # tied, non-persistent buffers: loads
    missing = tmp_path / "missing"
    _edit_checkpoint(tiny_model, missing, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(PtqError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        loading.load_model(str(missing))
    code, _, err = ptq_cli("inspect", missing)
    line = error_line(err)
    assert code == 2 and "model.layers.1.mlp.up_proj.weight" in line and "random values" in line


def test_a_tensor_of_another_shape_is_refused_naming_it(ptq_cli, tiny_model, tmp_path):
    import torch

    wrong = tmp_path / "wrong"
    name = "model.layers.0.input_layernorm.weight"
    _edit_checkpoint(tiny_model, wrong, lambda t: t.__setitem__(name, torch.ones(1)))
    code, _, err = ptq_cli("inspect", wrong)
    line = error_line(err)
    assert code == 2 and f"tensor '{name}' has shape [1] in the checkpoint but [64]" in line
    assert "above report" not in line
