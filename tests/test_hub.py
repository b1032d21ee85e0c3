"""A Hub id with a network: the Hub here is a local HTTP server that answers the requests huggingface_hub makes
(a revision's commit, its file tree, each file's metadata and bytes) from a folder, so that ptq's download path
(loading.hub_snapshot: huggingface_hub's own snapshot_download into an empty cache) runs as it does for a user, and
what it asks for is counted."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
import yaml
from conftest import save_tiny_llama

from ptq import __version__

REPO = "ptq-test-org/tiny-llama"
TOKEN = "hf_ptq_test_token"  # the one token FakeHub knows
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"  # main
REVISIONS = {
    "main": COMMIT,
    "v1.0": "1234567890abcdef1234567890abcdef12345678",
}  # a tag, at another commit


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's API for downloads, from REPO held in `folder` at each commit of REVISIONS (the same files), and for
    uploads: a token's account (whoami), creating a repository, and commits of files (sent inline: every file's
    upload mode is "regular") or deletions, kept in folders under `folder`'s parent. `gated`: REPO's files need a token
    with access (the metadata does not, as on the Hub); `token_role`: what the token set may do; `requests` lists
    (method, path); `commits` each commit's (repository, message); `private` the repositories created private; `cards` the model
    cards' metadata validated before a commit."""

    def __init__(self, folder: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder, self.gated, self.requests = folder, False, []
        self.repos = {REPO: folder}  # repository -> its files
        self.token_role, self.commits, self.private, self.cards = "write", [], set(), []
        self.token_scoped: list[
            dict
        ] = []  # a fine-grained token's permissions (token_role "fineGrained")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def files(self, repo: str = REPO) -> list[dict]:
        entries = []
        for f in sorted(self.repos[repo].iterdir()):
            data = f.read_bytes()
            entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": f.name}
            if (
                f.suffix == ".safetensors"
            ):  # weights are LFS files on the Hub: their etag is the content's sha256
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            entries.append(entry)
        return entries

    def commit(self, repo: str, lines: list[dict]) -> str:
        """Apply a commit's operations (huggingface_hub's ndjson lines) to `repo`'s folder; its new commit id."""
        folder = self.repos[repo]
        for line in lines:
            value = line["value"]
            if line["key"] == "header":
                self.commits.append((repo, value["summary"]))
            elif line["key"] == "file":
                (folder / value["path"]).write_bytes(base64.b64decode(value["content"]))
            elif line["key"] == "deletedFile":
                (folder / value["path"]).unlink()
            else:
                raise AssertionError(f"FakeHub: unexpected commit operation {line['key']}")
        return hashlib.sha1(f"{repo} {len(self.commits)}".encode()).hexdigest()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


API = re.compile(r"/api/models/([^/]+/[^/]+)/(revision|tree|preupload|commit)/(.*)")
RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # not on the test's stderr
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def do_POST(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        path = urlparse(self.path).path
        self.server.requests.append((self.command, path))
        json_type = {"Content-Type": "application/json"}
        data = (
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.command == "POST"
            else b""
        )
        if path == "/api/whoami-v2":
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(
                    b'{"error": "Invalid credentials in Authorization header"}',
                    json_type,
                    body,
                    401,
                )
            token = {"role": self.server.token_role}
            if (
                token["role"] == "fineGrained"
            ):  # as the Hub describes one: per entity, what the token may do to it
                token["fineGrained"] = {
                    "canReadGatedRepos": False,
                    "global": [],
                    "scoped": self.server.token_scoped,
                }
            who = {"name": "ptq-tester", "auth": {"type": "access_token", "accessToken": token}}
            return self._send(json.dumps(who).encode(), json_type, body)
        if (
            path == "/api/validate-yaml"
        ):  # a README.md's metadata, before it is committed: YAML that holds a mapping
            front = json.loads(data)["content"].split("---\n")
            metadata = yaml.safe_load(front[1]) if len(front) > 2 and front[0] == "" else None
            if not isinstance(metadata, dict):
                return self._send(b'{"errors": [{"message": "no metadata"}]}', json_type, body, 400)
            self.server.cards.append(metadata)
            return self._send(b'{"errors": [], "warnings": []}', json_type, body)
        if path == "/api/repos/create" and self.command == "POST":
            ask = json.loads(data)
            repo = f"{ask['organization']}/{ask['name']}"
            url = json.dumps({"url": f"{self.server.endpoint}/{repo}"}).encode()
            if repo in self.server.repos:  # as the Hub: 409, with the repository's address
                return self._send(
                    url[:-1] + b', "error": "You already created this model repo"}',
                    json_type,
                    body,
                    409,
                )
            self.server.repos[repo] = self.server.folder.parent / repo.replace("/", "--")
            self.server.repos[repo].mkdir()
            if (
                ask.get("visibility", "private" if ask.get("private") else None) == "private"
            ):  # huggingface_hub 1+, 0.x
                self.server.private.add(repo)
            return self._send(url, json_type, body)
        api, resolve = API.fullmatch(path), RESOLVE.fullmatch(path)
        repo = unquote((api or resolve)[1]) if api or resolve else None
        if repo not in self.server.repos:
            # the Hub answers 401 for a repository that does not exist, as for a private one without a token
            return self._send(
                b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"} | json_type, body, 401
            )
        if api and api[2] == "revision":
            commit = REVISIONS.get(unquote(api[3])) if repo == REPO else COMMIT
            if commit is None:
                return self._send(
                    b'{"error": "no revision"}', {"X-Error-Code": "RevisionNotFound"}, body, 404
                )
            info = {
                "id": repo,
                "sha": commit,
                "siblings": [{"rfilename": e["path"]} for e in self.server.files(repo)],
            }
            return self._send(json.dumps(info).encode(), json_type, body)
        if api and api[2] == "tree":
            return self._send(json.dumps(self.server.files(repo)).encode(), json_type, body)
        if api and api[2] == "preupload":
            modes = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                for f in json.loads(data)["files"]
            ]
            return self._send(json.dumps({"files": modes}).encode(), json_type, body)
        if api and api[2] == "commit":
            oid = self.server.commit(
                repo, [json.loads(line) for line in data.decode().splitlines() if line]
            )
            answer = {"commitUrl": f"{self.server.endpoint}/{repo}/commit/{oid}", "commitOid": oid}
            return self._send(json.dumps(answer).encode(), json_type, body)
        if resolve and self.server.gated:  # the Hub's answer without a token
            return self._send(
                b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"} | json_type, body, status=401
            )
        if resolve:
            commit, name = resolve[2], resolve[3]
            entry = next((e for e in self.server.files(repo) if e["path"] == name), None)
            if entry is not None and (commit in REVISIONS.values() or repo != REPO):
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                return self._send((self.server.repos[repo] / name).read_bytes(), headers, body)
            return self._send(
                b'{"error": "no entry"}', {"X-Error-Code": "EntryNotFound"} | json_type, body, 404
            )
        self._send(b'{"error": "not found"}', json_type, body, status=404)

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
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    for name in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield server
    server.shutdown()
    server.server_close()


def downloaded(server: FakeHub) -> set[str]:
    return {
        path.rsplit("/", 1)[1]
        for method, path in server.requests
        if method == "GET" and "/resolve/" in path
    }


def test_a_hub_id_is_downloaded_into_the_cache_then_read_as_its_folder(
    hub, tmp_path, text_file, ptq_cli
):
    """`ptq compare org/name` with a network: the config, tokenizer and the weights the model's files name are
    downloaded into the Hugging Face cache (not the repository's other copy of the weights), and the compare is the
    one of the same model read from a folder, its report naming the revision."""
    common = [
        "--calib-data",
        text_file,
        "--calib-samples",
        "3",
        "--eval-data",
        text_file,
        "--seq-len",
        "32",
    ]
    common += ["--max-windows", "3", "--recipes", "fp8-e4m3", "-q"]
    code, _, err = ptq_cli("compare", REPO, *common, "--out", tmp_path / "from-hub")
    assert code == 0, err
    files = downloaded(hub)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= files
    assert "consolidated.safetensors" not in files
    snapshot = tmp_path / "hub-cache" / "models--ptq-test-org--tiny-llama" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == (
        hub.folder / "model.safetensors"
    ).read_bytes()

    code, _, err = ptq_cli("compare", hub.folder, *common, "--out", tmp_path / "from-folder")
    assert code == 0, err
    results = [
        json.loads((tmp_path / d / "results.json").read_text()) for d in ("from-hub", "from-folder")
    ]
    assert [v["perplexity"] for v in results[0]["variants"]] == [
        v["perplexity"] for v in results[1]["variants"]
    ]
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
    assert (
        "no model 'ptq-test-org/nosuch' on the Hugging Face Hub, or it is private" in line
        and "HF_TOKEN" in line
    )

    hub.gated = True  # its metadata is read, then the first file refused, under huggingface_hub's progress bar
    code, _, err = ptq_cli("inspect", REPO)
    assert code == 2 and [line for line in err.splitlines() if "error" in line] == [
        err.splitlines()[-1]
    ], err
    line = err.splitlines()[-1]
    assert f"model '{REPO}' is gated on the Hugging Face Hub: accept its conditions" in line
    assert f"{hub.endpoint}/{REPO}" in line and "HF_TOKEN" in line


def test_a_checkpoint_of_a_hub_model_names_it_as_its_base_model(hub, tmp_path, ptq_cli):
    """The model card of a checkpoint quantized from a Hub model carries the Hub's metadata for a quantization of it
    (base_model: the repository, whatever revision was read; base_model_relation), read here by huggingface_hub's own
    card parser; one from a folder names none."""
    from huggingface_hub import ModelCard

    code, _, err = ptq_cli(
        "quantize", f"{REPO}@v1.0", "--recipe", "fp8-dynamic", "-o", tmp_path / "from-hub", "-q"
    )
    assert code == 0, err
    card = ModelCard.load(tmp_path / "from-hub" / "README.md").data.to_dict()
    assert card["base_model"] == REPO and card["base_model_relation"] == "quantized"
    assert (
        json.loads((tmp_path / "from-hub" / "ptq-export.json").read_text())["model"]["hub_id"]
        == REPO
    )

    code, _, err = ptq_cli(
        "quantize", hub.folder, "--recipe", "fp8-dynamic", "-o", tmp_path / "from-folder", "-q"
    )
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
    assert (
        tmp_path
        / "hub-cache"
        / "models--ptq-test-org--tiny-llama"
        / "snapshots"
        / REVISIONS["v1.0"]
    ).is_dir()
    files = [path for _, path in hub.requests if "/resolve/" in path]
    assert files and all(f"/resolve/{REVISIONS['v1.0']}/" in path for path in files)
    metadata = load_calibration(tmp_path / "c.safetensors").metadata
    assert metadata["model"] == f"{REPO}@v1.0"
    assert (
        metadata["model_source"]
        == f"Hugging Face Hub: {REPO} (revision {REVISIONS['v1.0'][:12]}, asked as 'v1.0')"
    )

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
    code, _, err = ptq_cli(
        "calibrate", f"{REPO}@v1.0", *calib, "-o", tmp_path / "online.safetensors"
    )
    assert code == 0, err
    asked = len(hub.requests)
    loading.hub_snapshot.cache_clear()  # as a new run would
    with monkeypatch.context() as offline:
        offline.setenv("HF_HUB_OFFLINE", "1")
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        code, _, err = ptq_cli(
            "calibrate", f"{REPO}@v1.0", *calib, "-o", tmp_path / "offline.safetensors"
        )
        assert code == 0, err
        code, _, err = ptq_cli(
            "calibrate", f"{REPO}@main", *calib, "-o", tmp_path / "main.safetensors"
        )
    assert len(hub.requests) == asked  # nothing asked of the Hub
    online, offline = (
        load_calibration(tmp_path / f"{run}.safetensors") for run in ("online", "offline")
    )
    assert online.metadata["model_source"] == offline.metadata["model_source"]
    assert online.input_amax.keys() == offline.input_amax.keys()
    assert all(torch.equal(online.input_amax[k], offline.input_amax[k]) for k in online.input_amax)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert (
        f"'{REPO}@main', and as a Hub id it is not in the local Hugging Face cache while HF_HUB_OFFLINE"
        in err
    )


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
    calib = [
        "--data",
        text_file,
        "--samples",
        "2",
        "--seq-len",
        "16",
        "-o",
        tmp_path / "c.safetensors",
        "-q",
    ]
    code, _, err = ptq_cli("calibrate", REPO, *calib)
    assert code == 2, err
    line = err.splitlines()[-1]
    assert f"model '{REPO}' (its weights, in the Hugging Face cache) needs at least " in line
    assert f"in {tmp_path / 'hub-cache'}, which has " in line and "HF_HUB_CACHE" in line
    assert not {f for f in downloaded(hub) if f.endswith(".safetensors")}  # not one weight file

    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage(2 * size, size, size)
    )  # just enough
    code, _, err = ptq_cli("calibrate", REPO, *calib)
    assert code == 0, err
    assert {f for f in downloaded(hub) if f.endswith(".safetensors")} == {f.name for f in weights}


def test_inspect_of_a_hub_model_reads_its_config_and_no_weights(hub, ptq_cli):
    """What a recipe does to each layer is known from the config: `ptq inspect org/name` downloads no weight file (a
    70B model's 140 GB), and says what inspecting the same model's folder says."""
    recipes = ["--recipe", "fp8-e4m3,fp8-block,int8", "--json"]
    code, out, err = ptq_cli("inspect", REPO, *recipes)
    assert code == 0, err
    assert "config.json" in downloaded(hub) and not {
        f for f in downloaded(hub) if f.endswith(".safetensors")
    }
    code, from_folder, err = ptq_cli("inspect", hub.folder, *recipes)
    assert code == 0, err
    from_hub, from_folder = json.loads(out), json.loads(from_folder)
    assert from_hub.pop("model")["source"] == f"Hugging Face Hub: {REPO} (revision {COMMIT[:12]})"
    from_folder.pop("model")
    assert from_hub == from_folder and from_hub["linear_layers"] > 0


PUSHED = "ptq-test-org/tiny-llama-FP8-dynamic"


@pytest.fixture
def token(monkeypatch, tmp_path):
    """A token huggingface_hub sends (HF_TOKEN), and no token file of the machine's."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


def test_a_checkpoint_is_pushed_to_the_hub_once_written_and_verified(hub, token, tmp_path, ptq_cli):
    """`ptq quantize org/name -o DIR --push-to-hub org/name-FP8`: the verified checkpoint is written to DIR, then the
    repository is created (private when asked) and holds exactly DIR's files, byte for byte, in one commit naming the
    recipe and model; the repository then loads through ptq as any Hub model."""
    out = tmp_path / "fp8"
    code, stdout, err = ptq_cli(
        "quantize", REPO, "--recipe", "fp8-dynamic", "-o", out, "--push-to-hub", PUSHED, "--private"
    )
    assert code == 0, err
    assert (
        "verification passed" in stdout
        and f"uploaded to {hub.endpoint}/{PUSHED} (commit " in stdout
    )
    pushed = hub.repos[PUSHED]
    assert sorted(f.name for f in pushed.iterdir()) == sorted(f.name for f in out.iterdir())
    assert all((pushed / f.name).read_bytes() == f.read_bytes() for f in out.iterdir())
    assert hub.commits == [(PUSHED, f"ptq {__version__}: fp8-dynamic of {REPO}")]
    assert hub.private == {PUSHED}
    assert [card["base_model"] for card in hub.cards] == [
        REPO
    ]  # the card's metadata, as the Hub validates it
    code, stdout, err = ptq_cli("inspect", PUSHED, "--recipe", "fp8-e4m3", "--json")
    assert code == 0, err
    assert json.loads(stdout)["model"]["source"].startswith(
        f"Hugging Face Hub: {PUSHED} (revision "
    )


def test_a_push_that_would_fail_or_overwrite_is_refused_before_the_work(
    hub, token, tmp_path, ptq_cli, monkeypatch
):
    """Each in one line, before the model is read and with nothing written or committed: an id that is not org/name,
    no token, a read-only one, a fine-grained one that may not write to the repository, no Hub, a repository that
    holds files (without --force), --private alone. With --force the repository's files are those of the new
    checkpoint: an earlier upload's other files are deleted in the same commit (no stale shard beside the new ones),
    the Hub's .gitattributes kept."""
    import huggingface_hub.constants as constants

    def refused(*flags: str) -> str:
        requests = len(hub.requests)
        code, _, err = ptq_cli(
            "quantize", REPO, "--recipe", "fp8-dynamic", "-o", tmp_path / "out", *flags
        )
        assert code == 2 and not (tmp_path / "out").exists() and not hub.commits, err
        assert not [
            path for _, path in hub.requests[requests:] if "/resolve/" in path
        ]  # the model was not read
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        return lines[0]

    assert "--push-to-hub takes a Hub repository id org/name" in refused(
        "--push-to-hub", "tiny-llama-fp8"
    )
    assert "--push-to-hub takes a Hub repository id org/name" in refused(
        "--push-to-hub", f"{PUSHED}@v1"
    )
    assert "--private applies with --push-to-hub" in refused("--private")
    assert f"Hub repository {REPO} already holds files (config.json, " in refused(
        "--push-to-hub", REPO
    )
    hub.token_role = "read"
    assert "the one set is read-only" in refused("--push-to-hub", PUSHED)
    # a fine-grained token: refused unless it may write to the repository's owner, or to the repository itself
    hub.token_role = "fineGrained"

    def scoped(kind: str, name: str, *permissions: str) -> dict:
        return {
            "entity": {"_id": "0" * 24, "type": kind, "name": name},
            "permissions": list(permissions),
        }

    for refusing in (
        [
            scoped("user", "ptq-tester", "repo.content.read", "repo.write")
        ],  # the account's own repositories only
        [
            scoped("org", "ptq-test-org", "repo.content.read", "inference.endpoints.write")
        ],  # may read, not write
        [scoped("model", REPO, "repo.write")],  # another repository of the organization
    ):
        hub.token_scoped = refusing
        line = refused("--push-to-hub", PUSHED)
        assert f"--push-to-hub {PUSHED}: the fine-grained token set may not write there" in line
        assert "write access to the repositories of ptq-test-org" in line
    for writing in (
        [
            scoped("user", "ptq-tester", "repo.write"),
            scoped("org", "PTQ-Test-Org", "repo.content.read", "repo.write"),
        ],
        [scoped("model", REPO, "repo.content.read", "repo.write")],
        [
            {"entity": {"type": "org"}, "permissions": []}
        ],  # no name: ptq cannot tell, the upload decides
    ):
        hub.token_scoped = writing  # past the token: the next check (REPO holds files) refuses
        assert f"Hub repository {REPO} already holds files" in refused("--push-to-hub", REPO)
    hub.token_role = "write"
    monkeypatch.delenv("HF_TOKEN")
    assert "needs a Hugging Face token that may write: `hf auth login`, or set HF_TOKEN" in refused(
        "--push-to-hub", PUSHED
    )
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        f"--push-to-hub {PUSHED}: the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE is set)"
        in refused("--push-to-hub", PUSHED)
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert not hub.repos.keys() - {REPO}  # nothing created

    # --force: the earlier upload's files go, in the same commit as the new ones
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (existing / "model-00001-of-00009.safetensors").write_bytes(b"an earlier upload's shard")
    hub.repos[PUSHED] = existing
    assert "already holds files (model-00001-of-00009.safetensors)" in refused(
        "--push-to-hub", PUSHED
    )
    code, _, err = ptq_cli(
        "quantize",
        REPO,
        "--recipe",
        "fp8-dynamic",
        "-o",
        tmp_path / "out",
        "--push-to-hub",
        PUSHED,
        "--force",
        "-q",
    )
    assert code == 0, err
    assert sorted(f.name for f in existing.iterdir()) == sorted(
        [".gitattributes", *(f.name for f in (tmp_path / "out").iterdir())]
    )
    assert len(hub.commits) == 1 and not hub.private
