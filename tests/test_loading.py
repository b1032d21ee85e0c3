"""Model specs that are not models: one quick, accurate line each (no download retries, no cut-off reasons)."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest

from ptq import progress
from ptq.errors import PtqError
from ptq.models import loading

PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("spec", ["a/b/c", "x@y@z", "org/na me", "org/name@"])
def test_a_name_that_is_no_path_and_no_hub_id_is_refused_at_once(ptq_cli, spec, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the Hub must not be asked")

    monkeypatch.setattr(socket, "create_connection", no_network)
    start = time.monotonic()
    code, out, err = ptq_cli("inspect", spec)
    assert code == 2 and out == "" and time.monotonic() - start < 10
    line = one_line(err)
    assert (
        f"no model folder or file '{spec}'" in line and "org/name" in line and "'smollm2'" in line
    )


def test_a_model_spec_is_a_gguf_a_folder_or_a_hub_id_decided_in_one_place(tmp_path, monkeypatch):
    """What the loaders, --low-memory and the model card's base_model each take a spec for: a path that exists is a
    path even when it reads like a Hub id (a folder ./org/name), one written as a path is a path even when missing,
    and only the rest is a Hub id (its repository without the @revision)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    expected = {
        None: ("gguf", None),
        loading.DEFAULT_MODEL: ("gguf", None),
        "m.gguf": ("gguf", None),
        "org/name": ("folder", None),  # the folder here, not the Hub's org/name
        "~/models": ("folder", None),
        "./missing": ("folder", None),
        "/no/such/folder": ("folder", None),
        "org/other": ("hub", "org/other"),
        "org/other@v1.0": ("hub", "org/other"),
        "gpt2": ("hub", "gpt2"),
        "missing.gguf": (
            "gguf",
            None,
        ),  # refused as a missing file (gguf_file), not looked up on the Hub
        "a/b/c": ("hub", None),  # no Hub id's shape: hub_access refuses it
    }
    for spec, (kind, repo) in expected.items():
        assert (loading.model_kind(spec), loading.hub_repo(spec)) == (kind, repo), spec
    assert (
        loading.gguf_file("m.gguf")[0].resolve() == tmp_path / "m.gguf"
        and loading.gguf_file("org/other") is None
    )
    assert loading.local_directory("org/name")[0] == Path("org/name")
    assert loading.local_directory("./missing") is None
    with pytest.raises(PtqError, match="model file missing.gguf does not exist"):
        loading.gguf_file("missing.gguf")


def test_a_hub_id_offline_and_not_cached_fails_at_once(ptq_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    code, _, err = ptq_cli("inspect", "ptq-test-org/nosuch")
    assert code == 2 and time.monotonic() - start < 10
    line = one_line(err)
    assert (
        "'ptq-test-org/nosuch'" in line
        and "not in the local Hugging Face cache" in line
        and "HF_HUB_OFFLINE" in line
    )


@pytest.mark.parametrize(
    "spec", ["ptq-test-org/nosuch", "smollm"]
)  # smollm: a typo of the default, or a bare Hub id
def test_a_hub_id_without_a_network_fails_after_one_try(ptq_cli, monkeypatch, spec):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_offline", lambda: False)
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
    assert (
        "cannot be reached" in line and "Name or service not known" in line and "Retry" not in err
    )


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_used(monkeypatch):
    monkeypatch.setattr(loading, "_hub_cached", lambda repo_id, revision: True)
    monkeypatch.setattr(loading, "hub_offline", lambda: True)
    assert loading.hub_access("org/name") == {"local_files_only": True}
    monkeypatch.setattr(loading, "hub_offline", lambda: False)
    monkeypatch.setattr(
        loading, "hub_unreachable", lambda: "huggingface.co: Name or service not known"
    )
    assert loading.hub_access("org/name") == {"local_files_only": True}
    monkeypatch.setattr(
        loading, "hub_unreachable", lambda: None
    )  # a network: transformers' normal path
    assert loading.hub_access("org/name") == {}
    monkeypatch.setattr(loading, "_hub_cached", lambda repo_id, revision: False)
    assert loading.hub_access("org/name") == {}


def test_an_existing_file_that_is_not_a_model_says_what_it_is(ptq_cli, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello")
    code, _, err = ptq_cli("inspect", text)
    line = one_line(err)
    assert code == 2 and f"{text} is a file, not a model" in line and "does not exist" not in line
    assert "model folder" in line and ".gguf file" in line and "Hub id" in line
    code, _, err = ptq_cli("inspect", tmp_path / "missing")
    assert code == 2 and f"model folder or file {tmp_path / 'missing'} does not exist" in one_line(
        err
    )


def test_a_model_folder_without_tokenizer_files_says_so_completely(ptq_cli, tiny_model, tmp_path):
    notok = tmp_path / "notok"
    shutil.copytree(tiny_model, notok)
    for name in loading.TOKENIZER_FILES + ("special_tokens_map.json",):
        (notok / name).unlink(missing_ok=True)
    code, _, err = ptq_cli(
        "calibrate", notok, "--samples", "1", "--seq-len", "8", "-o", tmp_path / "c.st"
    )  # loads it
    line = one_line(err)
    assert code == 2 and "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json" in line
    assert line.rstrip().endswith(f"in {notok}") and "Couldn't instantiate" not in line


def test_a_multi_line_loading_error_is_kept_whole_on_one_line():
    error = ValueError(
        "Couldn't instantiate the backend tokenizer from one of: \n(1) a file\n(2) an instance"
    )
    assert (
        loading.one_line(error)
        == "Couldn't instantiate the backend tokenizer from one of: (1) a file (2) an instance"
    )
    assert loading.one_line(ValueError("")) == "ValueError"
    assert len(loading.one_line(ValueError("x" * 1000))) == 400


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
    code, _, err = ptq_cli(
        "calibrate", missing, "--samples", "1", "--seq-len", "8", "-o", tmp_path / "c.st"
    )  # loads it
    line = error_line(err)
    assert code == 2 and "model.layers.1.mlp.up_proj.weight" in line and "random values" in line


def test_a_tensor_of_another_shape_is_refused_naming_it(ptq_cli, tiny_model, tmp_path):
    import torch

    wrong = tmp_path / "wrong"
    name = "model.layers.0.input_layernorm.weight"
    _edit_checkpoint(tiny_model, wrong, lambda t: t.__setitem__(name, torch.ones(1)))
    code, _, err = ptq_cli(
        "calibrate", wrong, "--samples", "1", "--seq-len", "8", "-o", tmp_path / "c.st"
    )  # loads it
    line = error_line(err)
    assert code == 2 and f"tensor '{name}' has shape [1] in the checkpoint but [64]" in line
    assert "above report" not in line


def _cgroup(folder: Path, limit: str, usage: int, inactive: tuple[str, int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    v2 = inactive[0] == "inactive_file"
    (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit + "\n")
    (folder / ("memory.current" if v2 else "memory.usage_in_bytes")).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 1\n{inactive[0]} {inactive[1]}\nactive_file 7\n")


def test_the_host_memory_check_counts_the_memory_cgroup_limit(tmp_path, monkeypatch):
    """A container's, pod's or Slurm job's memory limit is not in /proc/meminfo (the whole machine): the check read
    MemAvailable only, passed a model the limit could not hold, and the OOM killer ended the run where ptq would have
    worked layer by layer. The room is limit - (usage - inactive file cache), the tightest over the cgroup's
    ancestors; cgroup v2, v1 and hybrid (both) files as the kernel writes them."""
    import torch

    from ptq.runtime import resources

    gib = 1 << 30
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    proc = tmp_path / "cgroup"
    # v2: the job's own limit is 'max'; its parent allows 8 GiB, 6 GiB used of which 1 GiB is reclaimable cache
    _cgroup(v2 / "slurm" / "job_1", "max", 3 * gib, ("inactive_file", 0))
    _cgroup(v2 / "slurm", str(8 * gib), 6 * gib, ("inactive_file", gib))
    proc.write_text("0::/slurm/job_1\n")
    assert resources.cgroup_available(proc, v2) == 3 * gib
    _cgroup(
        v2 / "slurm" / "job_1", str(2 * gib), 3 * gib, ("inactive_file", 2 * gib)
    )  # tighter: 2 - (3 - 2)
    assert resources.cgroup_available(proc, v2) == gib
    # v1: the memory controller's line among others; no limit is 2^63 rounded down to a page
    _cgroup(
        v1 / "memory" / "docker" / "abc", str(4 * gib), 5 * gib, ("total_inactive_file", 2 * gib)
    )
    _cgroup(v1 / "memory" / "docker", "9223372036854771712", 9 * gib, ("total_inactive_file", 0))
    proc.write_text("5:cpuacct,cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert resources.cgroup_available(proc, v1) == gib
    # over the limit (the kernel reclaims first): no room, not a negative number
    _cgroup(v1 / "memory" / "docker" / "abc", str(4 * gib), 7 * gib, ("total_inactive_file", gib))
    assert resources.cgroup_available(proc, v1) == 0
    # no limit anywhere, no memory controller, or nothing readable: the kernel's MemAvailable stands
    _cgroup(
        v1 / "memory" / "docker" / "abc",
        "9223372036854771712",
        7 * gib,
        ("total_inactive_file", gib),
    )
    assert resources.cgroup_available(proc, v1) is None
    proc.write_text("3:cpuset:/\n")
    assert resources.cgroup_available(proc, v1) is None
    assert resources.cgroup_available(tmp_path / "absent", v1) is None
    # the host's check takes the smaller of the two
    monkeypatch.setattr(resources, "_mem_available", lambda: 20 * gib)
    monkeypatch.setattr(resources, "cgroup_available", lambda: 3 * gib)
    assert resources.available_memory(torch.device("cpu")) == 3 * gib
    monkeypatch.setattr(resources, "cgroup_available", lambda: None)
    assert resources.available_memory(torch.device("cpu")) == 20 * gib


def test_a_model_whose_float32_load_does_not_fit_the_host_is_refused_before_loading(
    tiny_model, monkeypatch
):
    """On a GPU, the GPU's free memory was the only check, but from_pretrained first reads every weight into host
    memory in float32 (then moved to the GPU): a 32B model on one 141 GB GPU with 128 GB of RAM passed the check
    and was killed by the OOM killer half-way through its load. The host's memory is checked too."""
    import torch

    from ptq.runtime import resources

    params = resources.checkpoint_parameters(tiny_model)
    free = {
        "cuda": params * 4 * 100,
        "cpu": params * 4 - 1,
    }  # the GPU holds it, the host not in float32
    monkeypatch.setattr(resources, "available_memory", lambda device: free[device.type])
    loads = []
    monkeypatch.setattr(
        loading, "_from_pretrained", lambda *a, **k: loads.append(a) or (None, None)
    )
    with pytest.raises(PtqError, match="needs at least .* available on cpu"):
        loading.load_model(str(tiny_model), device=torch.device("cuda"))
    assert not loads
    free["cpu"] = params * 4 * 2  # with room on the host, it loads (to_compute is not reached here)
    monkeypatch.setattr(loading, "to_compute", lambda model, device, dtype: model)
    monkeypatch.setattr(loading, "linearize", lambda model: model)
    loading.load_model(str(tiny_model), device=torch.device("cuda"))
    assert len(loads) == 1
    free["cpu"] = 0
    loading.load_model(
        str(tiny_model), device=torch.device("cuda"), memory_check=False
    )  # --no-memory-check
    assert len(loads) == 2


def test_a_gguf_edited_in_place_is_converted_again(tmp_path):
    """gguf_set_metadata.py (llama.cpp) edits a GGUF's metadata in place, the same size: the fix of Llama 3 GGUFs'
    eos_token_id. The cache key sampled 64 KiB chunks spread over the file, which left most of the metadata (after
    the first 64 KiB: the vocabulary, then the special tokens' ids) out: the edited file got the old conversion."""
    import gguf

    path = _write_gguf(tmp_path / "m.gguf", eos=2)
    before = loading.gguf_key(path)
    reader = gguf.GGUFReader(str(path), "r+")  # as gguf_set_metadata.py does
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = 7
    del reader, field
    assert gguf.GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"].contents() == 7
    assert loading.gguf_key(path) != before


def test_a_compressed_tensors_checkpoint_too_big_for_memory_is_refused_before_loading(
    tiny_model, tmp_path, monkeypatch
):
    """`ptq eval` of a checkpoint `ptq quantize` wrote loads its weights dequantized to float32: its size is checked as
    any model's (it is not streamed automatically: ptq.execution.streaming.supports), not loaded until the OOM killer
    stops it."""
    import json

    from ptq.runtime import resources

    exported = tmp_path / "exported"
    shutil.copytree(tiny_model, exported)
    config = json.loads((exported / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
    }
    (exported / "config.json").write_text(json.dumps(config))
    params = resources.checkpoint_parameters(exported)
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 - 1)
    loads = []
    monkeypatch.setattr(
        loading, "_from_pretrained", lambda *a, **k: loads.append(a) or (None, None)
    )
    with pytest.raises(PtqError, match="needs at least"):
        loading.load_model(str(exported))
    assert not loads


def _write_gguf(path, eos: int = 2, rows: int = 4096):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i:05d}" for i in range(30000)])  # a vocabulary: 480 KB of metadata
    writer.add_eos_token_id(eos)
    writer.add_tensor("w", np.zeros((rows, 1024), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_too_big_for_memory_is_refused_before_its_conversion(tmp_path, monkeypatch):
    """A .gguf is converted by loading it whole in float32 (then written to the cache in float32): the memory check
    ran on the converted folder, after the conversion, which a 4-bit 70B GGUF (280 GB in float32) does not survive."""
    from ptq.runtime import resources

    gguf = _write_gguf(tmp_path / "Big.Q4_1.gguf")
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        resources, "available_memory", lambda device: 4096 * 1024 * 4 - 1
    )  # its float32 size - 1
    converted = []

    def convert(*args, **kwargs):  # the long work: stop here
        converted.append(args)
        raise PtqError("stopped")

    monkeypatch.setattr(loading, "_from_pretrained", convert)
    with pytest.raises(
        PtqError, match=r"needs at least 16\.0 MiB \(4,194,304 parameters .* --no-memory-check"
    ):
        loading.load_model(str(gguf))
    assert not converted
    with pytest.raises(PtqError, match="stopped"):  # --no-memory-check: converted anyway
        loading.load_model(str(gguf), memory_check=False)
    assert len(converted) == 1
    monkeypatch.setattr(resources, "available_memory", lambda device: 4096 * 1024 * 4)  # fits
    with pytest.raises(PtqError, match="stopped"):
        loading.load_model(str(gguf))


def test_a_gguf_larger_than_the_free_disk_is_refused_before_its_conversion(tmp_path, monkeypatch):
    """The conversion writes the float32 weights into the ptq cache: checked against its disk's free space first, not
    found out when the disk is full."""
    import shutil
    from collections import namedtuple

    gguf = _write_gguf(tmp_path / "Big.Q4_1.gguf")
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**39, 4096 * 1024 * 4 - 1))
    converted = []

    def convert(*args, **kwargs):  # the long work: stop here
        converted.append(args)
        raise PtqError("stopped")

    monkeypatch.setattr(loading, "_from_pretrained", convert)
    with pytest.raises(
        PtqError,
        match=r"converting Big\.Q4_1\.gguf \(float32 safetensors\) needs at least 16\.0 MiB in .*PTQ_CACHE",
    ):
        loading.load_model(str(gguf))
    assert not converted
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage(2**40, 2**39, 4096 * 1024 * 4)
    )  # room enough
    with pytest.raises(PtqError, match="stopped"):
        loading.load_model(str(gguf))


def test_runs_started_together_convert_a_gguf_once(tmp_path, monkeypatch):
    """torchrun's processes (or two runs started together) on a .gguf not yet in the cache each converted it: N times
    the float32 model in host memory, and the last to finish replaced the folder the others were loading. One
    converts; the others wait for it and load its folder."""
    import threading

    gguf = tmp_path / "Some-Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "gguf_caveat", lambda path: "caveat")
    monkeypatch.setattr(progress, "QUIET", True)
    conversions = []

    class Saved:
        def save_pretrained(self, folder):
            (Path(folder) / f"{type(self).__name__}.txt").write_text("")

    def convert(*args, **kwargs):  # the long work
        conversions.append(args)
        time.sleep(1)
        model = Saved()
        model.config = type("Config", (), {})()
        return model, Saved()

    monkeypatch.setattr(loading, "_from_pretrained", convert)
    found, errors = [], []

    def run():
        try:
            found.append(loading.converted_gguf_dir(gguf, memory_check=False))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(found) == 3 and len({str(d) for d, _ in found}) == 1
    assert len(conversions) == 1


def test_a_gguf_path_with_a_leading_tilde_is_found(tmp_path, monkeypatch):
    """A quoted path keeps its `~` ("~/My Models/m.gguf": the shell expands none in quotes); a model folder's is
    expanded, a .gguf file's was not: "model file ~/My Models/m.gguf does not exist"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "My Models").mkdir()
    (tmp_path / "My Models" / "m.gguf").write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "gguf_caveat", lambda path: "caveat")
    monkeypatch.setattr(progress, "QUIET", True)

    def convert(
        location, spec, *args, **kwargs
    ):  # the long work: stop here, with what it was given
        raise PtqError(f"converting {spec} from {location}")

    monkeypatch.setattr(loading, "_from_pretrained", convert)
    with pytest.raises(
        PtqError, match=f"converting {tmp_path}/My Models/m.gguf from {tmp_path}/My Models$"
    ):
        loading.load_model("~/My Models/m.gguf")


def save_fp8_checkpoint(source: Path, target: Path, block: int = 32, shards: int = 1) -> Path:
    """`source` as an official FP8 checkpoint is laid out (DeepSeek-V3, Qwen3 FP8: quant_method fp8): every matmul
    weight (experts' included, under the checkpoint's per-expert names) as float8_e4m3fn codes with a float32
    `weight_scale_inv` per block x block tile (amax / 448), everything else in bf16, in `shards` files."""
    import json

    import safetensors.torch
    import torch

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors |= safetensors.torch.load_file(str(f))
    for key, w in list(tensors.items()):
        rows, cols = w.shape if w.ndim == 2 else (0, 0)
        if (
            any(s in key for s in ("embed", "lm_head", "norm"))
            or not rows
            or rows % block
            or cols % block
        ):
            tensors[key] = w.to(
                torch.bfloat16
            )  # and a router of a few experts, as DeepSeek-V3 keeps its gate
            continue
        tiles = w.float().reshape(rows // block, block, cols // block, block)
        scale = tiles.abs().amax(dim=(1, 3)) / 448
        tensors[key] = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[key.removesuffix("weight") + "weight_scale_inv"] = scale
    names = sorted(tensors)
    files = {
        f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards] for i in range(shards)
    }
    if shards == 1:
        files = {"model.safetensors": names}
    for file, keys in files.items():
        safetensors.torch.save_file(
            {k: tensors[k] for k in keys}, str(target / file), metadata={"format": "pt"}
        )
    if shards > 1:
        weight_map = {k: file for file, keys in files.items() for k in keys}
        (target / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    config = json.loads((target / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_an_fp8_checkpoint_is_dequantized_where_transformers_would_keep_its_codes(
    tiny_model, tmp_path, monkeypatch
):
    """On a GPU of compute capability 8.9+ (an H100 here: torch.cuda made to say so), transformers loads an FP8
    checkpoint as FP8Linear layers holding the float8 codes and their weight_scale_inv; cast to float32 as ptq
    computes, the codes would become the weights, their scales dropped. ptq dequantizes: each weight is its codes
    times its block's scale (the reference below, by hand), no scale is left as a parameter, and reports say so."""
    import safetensors.torch
    import torch

    fp8 = save_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    loaded = loading.load_model(str(fp8), device=torch.device("cpu"))
    stored = safetensors.torch.load_file(fp8 / "model.safetensors")
    params = dict(loaded.model.named_parameters())
    assert not [name for name in params if "scale" in name]
    projections = [key for key in stored if key.endswith("_proj.weight")]
    assert len(projections) == 14
    for key in projections:
        scale = stored[key.replace(".weight", ".weight_scale_inv")]
        expected = stored[key].float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        assert params[key].dtype == torch.float32 and torch.equal(params[key], expected), key
    assert "fp8 checkpoint: its weights were dequantized" in loaded.caveats[0]


def test_a_checkpoint_quantized_by_a_method_ptq_cannot_dequantize_is_refused(
    ptq_cli, tiny_model, tmp_path
):
    import json

    gptq = tmp_path / "gptq"
    shutil.copytree(tiny_model, gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(config))
    code, _, err = ptq_cli("inspect", gptq)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"model '{gptq}' is already quantized (quant_method gptq), which ptq cannot dequantize"
        in err
    )


def test_the_memory_estimate_counts_two_values_per_byte_of_mxfp4_blocks(tmp_path):
    """gpt-oss stores its experts as MXFP4: uint8 *_blocks of two 4-bit values per byte, and uint8 *_scales (one E8M0
    per 32 values). Dequantized on load, a *_blocks tensor of N bytes is 2N values; other uint8 tensors count as they
    are."""
    import safetensors.torch
    import torch

    from ptq.runtime import resources

    safetensors.torch.save_file(
        {
            "mlp.experts.gate_up_proj_blocks": torch.zeros(
                2, 64, 4, 16, dtype=torch.uint8
            ),  # 8192 bytes
            "mlp.experts.gate_up_proj_scales": torch.zeros(2, 64, 4, dtype=torch.uint8),  # 512
            "mlp.experts.gate_up_proj_bias": torch.zeros(2, 64, dtype=torch.bfloat16),  # 128
        },
        str(tmp_path / "model.safetensors"),
    )
    assert resources.checkpoint_parameters(tmp_path) == 2 * 8192 + 512 + 128


def test_the_memory_estimate_counts_the_values_of_packed_compressed_tensors_weights(tmp_path):
    """compressed-tensors pack-quantized (W4A16) stores eight 4-bit values per int32 of a weight_packed tensor, with
    the unpacked shape in weight_shape (which may lie in another shard); NVFP4 two per uint8. They load dequantized,
    one float32 per value: counted per stored element, a 70B W4A16 model read as about 9 billion parameters and
    passed the memory check it could not hold."""
    import json

    import safetensors.torch
    import torch

    from ptq.runtime import resources

    layer = "model.layers.0.mlp"
    first = {
        f"{layer}.up_proj.weight_packed": torch.zeros(
            512, 32, dtype=torch.int32
        ),  # 512 x 256 int4 values
        f"{layer}.up_proj.weight_scale": torch.zeros(512, 8),  # 4096
        f"{layer}.gate_proj.weight_packed": torch.zeros(
            64, 16, dtype=torch.uint8
        ),  # NVFP4: 64 x 32, no shape
        "model.norm.weight": torch.zeros(256),
    }
    second = {
        f"{layer}.up_proj.weight_shape": torch.tensor([512, 256])
    }  # the shape in the other shard
    safetensors.torch.save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in first}}
    index["weight_map"] |= {k: "model-00002-of-00002.safetensors" for k in second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert resources.checkpoint_parameters(tmp_path) == 512 * 256 + 4096 + 64 * 32 + 256


def test_the_caveat_of_a_compressed_tensors_checkpoint_names_its_weights_bits():
    """A W4A16 checkpoint (pack-quantized) was described as "its 8-bit weights dequantized"."""
    from ptq.models.loading import dequantized_loading

    def caveat(groups):
        qc = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": groups,
        }
        return dequantized_loading({"quantization_config": qc}, "model 'm'", "m")[1]

    assert "evaluated as its 4-bit weights dequantized" in caveat(
        {"group_0": {"weights": {"num_bits": 4}}}
    )
    assert "The 4-bit weights' rounding" in caveat({"group_0": {"weights": {"num_bits": 4}}})
    mixed = {"group_0": {"weights": {"num_bits": 4}}, "group_1": {"weights": {"num_bits": 8}}}
    assert "evaluated as its quantized weights dequantized" in caveat(mixed)
    assert "its quantized weights" in caveat({"group_0": {"weights": None}})


@pytest.mark.parametrize("kept", [1 << 20, 50_000_000])
def test_a_truncated_gguf_is_called_damaged_or_truncated(tmp_path, kept):
    # gguf's reader failed on a cut file with numpy's words only ("cannot reshape array of size 399424 into shape")
    source = loading.gguf_file(loading.DEFAULT_MODEL)[0]
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(kept))
    with pytest.raises(
        PtqError, match=rf"^cannot read GGUF file {cut}: damaged or truncated \(.+\)$"
    ):
        loading.gguf_caveat(cut)
