"""A Hub id with a network: the Hub here is a local HTTP server that answers the requests huggingface_hub makes
(a revision's commit, its file tree, each file's metadata and bytes) from a folder, so that ptq's download path
(loading.hub_snapshot: huggingface_hub's own snapshot_download into an empty cache) runs as it does for a user, and
what it asks for is counted."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
from conftest import save_tiny_llama

REPO = "ptq-test-org/tiny-llama"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"  # main
REVISIONS = {"main": COMMIT, "v1.0": "1234567890abcdef1234567890abcdef12345678"}  # a tag, at another commit


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's download API for one repository, REPO, held in `folder`, at each commit of REVISIONS (the same files);
    `gated`: its files need a token with access (the metadata does not, as on the Hub); `requests` lists (method,
    path)."""

    def __init__(self, folder: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder, self.gated, self.requests = folder, False, []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def files(self) -> list[dict]:
        entries = []
        for f in sorted(self.folder.iterdir()):
            data = f.read_bytes()
            entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": f.name}
            if f.suffix == ".safetensors":  # weights are LFS files on the Hub: their etag is the content's sha256
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # not on the test's stderr
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        path = urlparse(self.path).path
        self.server.requests.append((self.command, path))
        json_type = {"Content-Type": "application/json"}
        api, resolve = f"/api/models/{REPO}/", f"/{REPO}/resolve/"
        if path.startswith(api + "revision/"):
            commit = REVISIONS.get(unquote(path[len(api + "revision/") :]))
            if commit is None:
                return self._send(b'{"error": "no revision"}', {"X-Error-Code": "RevisionNotFound"}, body, 404)
            info = {"id": REPO, "sha": commit, "siblings": [{"rfilename": e["path"]} for e in self.server.files()]}
            return self._send(json.dumps(info).encode(), json_type, body)
        if path.startswith(api + "tree/"):
            return self._send(json.dumps(self.server.files()).encode(), json_type, body)
        if path.startswith(resolve) and self.server.gated:  # the Hub's answer without a token
            return self._send(b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"} | json_type, body, status=401)
        if path.startswith(resolve):
            commit, name = path[len(resolve) :].split("/", 1)
            entry = next((e for e in self.server.files() if e["path"] == name), None)
            if entry is not None and commit in REVISIONS.values():
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                return self._send((self.server.folder / name).read_bytes(), headers, body)
            return self._send(b'{"error": "no entry"}', {"X-Error-Code": "EntryNotFound"} | json_type, body, 404)
        # another repository: the Hub answers 401 for one that does not exist, as for a private one without a token
        self._send(b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"} | json_type, body, status=401)

    def _send(self, data: bytes, headers: dict, body: bool, status: int = 200):
        self.send_response(status)
        for key, value in (headers | {"Content-Length": str(len(data))}).items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A tiny Llama served as REPO by a FakeHub, as the Hub a user reaches (HF_ENDPOINT), with an empty Hugging Face
    cache; the repository also holds a second copy of its weights under another name, which loading must not fetch
    (as Mistral's repositories hold consolidated.safetensors beside model.safetensors)."""
    import huggingface_hub.constants as constants

    folder = save_tiny_llama(tmp_path / "repo", num_hidden_layers=1)
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")
    server = FakeHub(folder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = server.endpoint
    # huggingface_hub reads HF_ENDPOINT, its offline setting and its cache folder at import: set where it keeps them
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield server
    server.shutdown()
    server.server_close()


def downloaded(server: FakeHub) -> set[str]:
    return {path.rsplit("/", 1)[1] for method, path in server.requests if method == "GET" and "/resolve/" in path}


def test_a_hub_id_is_downloaded_into_the_cache_then_read_as_its_folder(hub, tmp_path, text_file, ptq_cli):
    """`ptq compare org/name` with a network: the config, tokenizer and the weights the model's files name are
    downloaded into the Hugging Face cache (not the repository's other copy of the weights), and the compare is the
    one of the same model read from a folder, its report naming the revision."""
    common = ["--calib-data", text_file, "--calib-samples", "3", "--eval-data", text_file, "--seq-len", "32"]
    common += ["--max-windows", "3", "--recipes", "fp8-e4m3", "-q"]
    code, _, err = ptq_cli("compare", REPO, *common, "--out", tmp_path / "from-hub")
    assert code == 0, err
    files = downloaded(hub)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= files
    assert "consolidated.safetensors" not in files
    snapshot = tmp_path / "hub-cache" / "models--ptq-test-org--tiny-llama" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == (hub.folder / "model.safetensors").read_bytes()

    code, _, err = ptq_cli("compare", hub.folder, *common, "--out", tmp_path / "from-folder")
    assert code == 0, err
    results = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("from-hub", "from-folder")]
    assert [v["perplexity"] for v in results[0]["variants"]] == [v["perplexity"] for v in results[1]["variants"]]
    assert results[0]["model"]["name"] == REPO
    assert f"Hugging Face Hub: {REPO} (revision {COMMIT[:12]})" in json.dumps(results[0]["model"])


def test_a_sharded_hub_model_fetches_the_shards_its_index_names(hub, tmp_path, text_file, ptq_cli):
    """A model in shards: the index first, then every shard it names, and only those."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub.folder, dtype=torch.float32)
    (hub.folder / "model.safetensors").unlink()
    model.save_pretrained(hub.folder, max_shard_size="100KB")
    shards = {f.name for f in hub.folder.glob("model-*.safetensors")}
    assert len(shards) > 1
    code, _, err = ptq_cli("calibrate", REPO, "--data", text_file, "--samples", "2", "--seq-len", "16", "-o",
                           tmp_path / "c.safetensors", "-q")  # fmt: skip
    assert code == 0, err
    files = downloaded(hub)
    assert shards | {"model.safetensors.index.json"} <= files
    assert not {f for f in files if f.endswith(".safetensors")} - shards


def test_a_hub_id_that_does_not_exist_or_is_gated_is_one_line(hub, ptq_cli):
    """The two answers a user meets most: a typo (or a private model without a token), and a gated model (Llama,
    Gemma) whose conditions the account has not accepted. Each says what to do, in one line."""
    code, _, err = ptq_cli("inspect", "ptq-test-org/nosuch")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    line = " ".join(err.split())
    assert "no model 'ptq-test-org/nosuch' on the Hugging Face Hub, or it is private" in line and "HF_TOKEN" in line

    hub.gated = True  # its metadata is read, then the first file refused, under huggingface_hub's progress bar
    code, _, err = ptq_cli("inspect", REPO)
    assert code == 2 and [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]], err
    line = err.splitlines()[-1]
    assert f"model '{REPO}' is gated on the Hugging Face Hub: accept its conditions" in line
    assert f"{hub.endpoint}/{REPO}" in line and "HF_TOKEN" in line


def test_a_checkpoint_of_a_hub_model_names_it_as_its_base_model(hub, tmp_path, ptq_cli):
    """The model card of a checkpoint quantized from a Hub model carries the Hub's metadata for a quantization of it
    (base_model: the repository, whatever revision was read; base_model_relation), read here by huggingface_hub's own
    card parser; one from a folder names none."""
    from huggingface_hub import ModelCard

    code, _, err = ptq_cli("quantize", f"{REPO}@v1.0", "--recipe", "fp8-dynamic", "-o", tmp_path / "from-hub", "-q")
    assert code == 0, err
    card = ModelCard.load(tmp_path / "from-hub" / "README.md").data.to_dict()
    assert card["base_model"] == REPO and card["base_model_relation"] == "quantized"
    assert json.loads((tmp_path / "from-hub" / "ptq-export.json").read_text())["model"]["hub_id"] == REPO

    code, _, err = ptq_cli("quantize", hub.folder, "--recipe", "fp8-dynamic", "-o", tmp_path / "from-folder", "-q")
    assert code == 0, err
    card = ModelCard.load(tmp_path / "from-folder" / "README.md").data.to_dict()
    assert "base_model" not in card and "base_model_relation" not in card and "fp8" in card["tags"]


def test_a_revision_is_read_as_asked_and_named_in_the_reports(hub, tmp_path, text_file, ptq_cli):
    """org/name@revision (a branch, tag or commit, as in huggingface_hub's hf:// paths): the files of that commit,
    which the calibration file names; a revision the Hub does not have is one line."""
    from ptq.calibration.calibrate import load_calibration

    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-q"]
    code, _, err = ptq_cli("calibrate", f"{REPO}@v1.0", *calib, "-o", tmp_path / "c.safetensors")
    assert code == 0, err
    assert (tmp_path / "hub-cache" / "models--ptq-test-org--tiny-llama" / "snapshots" / REVISIONS["v1.0"]).is_dir()
    files = [path for _, path in hub.requests if "/resolve/" in path]
    assert files and all(f"/resolve/{REVISIONS['v1.0']}/" in path for path in files)
    metadata = load_calibration(tmp_path / "c.safetensors").metadata
    assert metadata["model"] == f"{REPO}@v1.0"
    assert metadata["model_source"] == f"Hugging Face Hub: {REPO} (revision {REVISIONS['v1.0'][:12]}, asked as 'v1.0')"

    code, _, err = ptq_cli("inspect", f"{REPO}@v2")
    assert code == 2 and "error" in err.splitlines()[-1], err
    assert f"model '{REPO}' on the Hugging Face Hub has no revision 'v2'" in err.splitlines()[-1]


def test_without_the_hub_a_revision_is_read_from_the_cache_if_it_was_downloaded(
    hub, tmp_path, text_file, ptq_cli, monkeypatch
):
    import huggingface_hub.constants as constants

    from ptq.calibration.calibrate import load_calibration
    from ptq.models import loading

    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-q"]
    code, _, err = ptq_cli("calibrate", f"{REPO}@v1.0", *calib, "-o", tmp_path / "online.safetensors")
    assert code == 0, err
    asked = len(hub.requests)
    loading.hub_snapshot.cache_clear()  # as a new run would
    with monkeypatch.context() as offline:
        offline.setenv("HF_HUB_OFFLINE", "1")
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        code, _, err = ptq_cli("calibrate", f"{REPO}@v1.0", *calib, "-o", tmp_path / "offline.safetensors")
        assert code == 0, err
        code, _, err = ptq_cli("calibrate", f"{REPO}@main", *calib, "-o", tmp_path / "main.safetensors")
    assert len(hub.requests) == asked  # nothing asked of the Hub
    online, offline = (load_calibration(tmp_path / f"{run}.safetensors") for run in ("online", "offline"))
    assert online.metadata["model_source"] == offline.metadata["model_source"]
    assert online.input_amax.keys() == offline.input_amax.keys()
    assert all(torch.equal(online.input_amax[k], offline.input_amax[k]) for k in online.input_amax)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"'{REPO}@main', and as a Hub id it is not in the local Hugging Face cache while HF_HUB_OFFLINE" in err


@pytest.mark.parametrize("layout", ["sharded", "one file"])
def test_weights_larger_than_the_free_disk_are_refused_before_they_are_downloaded(
    hub, tmp_path, text_file, ptq_cli, monkeypatch, layout
):
    """huggingface_hub only warns, file by file, when the disk is short: a 140 GB model would fail once the disk is
    full. The weight files' sizes (the Hub's file tree: the shards the index names, or the one model.safetensors, not
    the repository's other copy) are checked against the cache's free space before the first one is fetched."""
    import shutil
    from collections import namedtuple

    from transformers import AutoModelForCausalLM

    if layout == "sharded":
        model = AutoModelForCausalLM.from_pretrained(hub.folder, dtype=torch.float32)
        (hub.folder / "model.safetensors").unlink()
        model.save_pretrained(hub.folder, max_shard_size="100KB")
    weights = list(hub.folder.glob("model*.safetensors"))
    assert (len(weights) > 1) == (layout == "sharded")
    size = sum(f.stat().st_size for f in weights)  # the files' bytes, headers included
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 * size, size + 1, size - 1))
    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-o", tmp_path / "c.safetensors", "-q"]
    code, _, err = ptq_cli("calibrate", REPO, *calib)
    assert code == 2, err
    line = err.splitlines()[-1]
    assert f"model '{REPO}' (its weights, in the Hugging Face cache) needs at least " in line
    assert f"in {tmp_path / 'hub-cache'}, which has " in line and "HF_HUB_CACHE" in line
    assert not {f for f in downloaded(hub) if f.endswith(".safetensors")}  # not one weight file

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 * size, size, size))  # just enough
    code, _, err = ptq_cli("calibrate", REPO, *calib)
    assert code == 0, err
    assert {f for f in downloaded(hub) if f.endswith(".safetensors")} == {f.name for f in weights}


def test_inspect_of_a_hub_model_reads_its_config_and_no_weights(hub, ptq_cli):
    """What a recipe does to each layer is known from the config: `ptq inspect org/name` downloads no weight file (a
    70B model's 140 GB), and says what inspecting the same model's folder says."""
    recipes = ["--recipe", "fp8-e4m3,fp8-block,int8", "--json"]
    code, out, err = ptq_cli("inspect", REPO, *recipes)
    assert code == 0, err
    assert "config.json" in downloaded(hub) and not {f for f in downloaded(hub) if f.endswith(".safetensors")}
    code, from_folder, err = ptq_cli("inspect", hub.folder, *recipes)
    assert code == 0, err
    from_hub, from_folder = json.loads(out), json.loads(from_folder)
    assert from_hub.pop("model")["source"] == f"Hugging Face Hub: {REPO} (revision {COMMIT[:12]})"
    from_folder.pop("model")
    assert from_hub == from_folder and from_hub["linear_layers"] > 0
