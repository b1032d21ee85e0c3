"""Without a connection to the Hub, `hf:` datasets and lm-eval tasks with Hub data use the local datasets cache only:
what is cached loads from there, what is not fails at once, in one line saying why, instead of after huggingface_hub's
five retries. The Hub here is a local port nothing listens on (HF_ENDPOINT), so every connection attempt is real and
is counted: one, the probe, where datasets alone would retry."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from test_tasks import varied_rows, write_jsonl

from ptq.errors import PtqError
from ptq.evaluation import data, harness
from ptq.models import loading

OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROXIES = (
    "HTTPS_PROXY",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
)  # the probe leaves the Hub to a proxy
CACHED = "ptq_offline_rows"  # the name of the dataset put in the local cache (no namespace, like "wikitext")


@pytest.fixture
def closed_hub(monkeypatch, tmp_path):
    """The Hub at a closed local port, offline mode not set, an empty datasets cache, the probe not made yet; returns
    the list of connection attempts to the Hub's port."""
    import datasets.config
    from huggingface_hub import constants

    with socket.socket() as s:  # a free port, closed again: connecting to it is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    # huggingface_hub and datasets read HF_ENDPOINT and their offline settings at import: set where they keep them.
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    for name in OFFLINE_VARIABLES + PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))

    tries = []
    connect = socket.create_connection

    def counted(address, *args, **kwargs):  # the probe and httpx both connect through here
        if address[1] == port:
            tries.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    return tries  # the Hub's answer is asked anew in each test (conftest's hub_not_asked_yet)


def still_online():
    """datasets and huggingface_hub are back out of the offline mode the load ran in."""
    import datasets.config
    from huggingface_hub import constants

    return not (
        datasets.config.HF_HUB_OFFLINE
        or datasets.config.HF_DATASETS_OFFLINE
        or constants.HF_HUB_OFFLINE
    )


@pytest.fixture
def cached_dataset(closed_hub, tmp_path, monkeypatch) -> list[dict]:
    """A dataset named CACHED in the local datasets cache, as a download of it leaves it there: loading a local
    folder of that name writes the same <cache>/<name>/default/0.0.0/<hash>/ entry (no network needed). Its rows
    serve as text ("text") and as multiple-choice items ("context", "choices", "label")."""
    import datasets

    rows = [{"text": f"row {i}: {r['context']}", **r} for i, r in enumerate(varied_rows(6))]
    folder = tmp_path / "source" / CACHED
    folder.mkdir(parents=True)
    write_jsonl(folder / "test.jsonl", rows)
    datasets.load_dataset(str(folder), split="test")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # so that the bare name is no local folder
    assert closed_hub == []
    return rows


# ----------------------------------------------------------------------------------------------
# hf: data specs


def test_an_hf_dataset_not_cached_fails_at_once_in_one_line(closed_hub):
    for _ in range(2):  # the Hub is probed once per process
        with pytest.raises(PtqError) as e:
            data.load_corpus("hf:ptq-test-org/nonexistent", "evaluation")
        message = str(e.value)
        assert message.startswith(
            "cannot load dataset 'ptq-test-org/nonexistent': the Hub cannot be reached (127.0.0.1:"
        )
        assert "not in the local datasets cache" in message and "local file or folder" in message
        assert "\n" not in message
    assert len(closed_hub) == 1 and still_online()


def test_a_cached_hf_dataset_loads_from_the_cache_without_the_hub(cached_dataset, closed_hub):
    corpus = data.load_corpus(f"hf:{CACHED}", "evaluation")
    assert corpus.documents == [r["text"] for r in cached_dataset]
    assert corpus.source == f"hf:{CACHED} (split 'test', field 'text', 6 rows)"
    assert len(closed_hub) == 1 and still_online()  # the probe; datasets did not try the Hub
    with pytest.raises(PtqError, match="from the local datasets cache: ValueError: Unknown split"):
        data.load_corpus(f"hf:{CACHED},split=train", "evaluation")  # cached, but not that split


def test_an_offline_setting_is_honoured_without_a_probe(closed_hub, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # after datasets read it: ptq reads it again
    with pytest.raises(
        PtqError,
        match="'ptq-test-org/nonexistent': HF_DATASETS_OFFLINE is set and the dataset is not",
    ):
        data.load_corpus("hf:ptq-test-org/nonexistent", "evaluation")
    assert closed_hub == [] and still_online()


def test_compare_with_an_hf_dataset_not_cached_exits_2_with_one_line(
    closed_hub, ptq_cli, tiny_model, tmp_path
):
    out = tmp_path / "out"
    code, _, err = ptq_cli(
        "compare", tiny_model, "--eval-data", "hf:ptq-test-org/nonexistent", "--out", out, "-q"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "'ptq-test-org/nonexistent': the Hub cannot be reached (127.0.0.1:" in lines[0]
    assert len(closed_hub) == 1 and not out.exists()


# ----------------------------------------------------------------------------------------------
# lm-eval tasks


def test_a_hub_task_not_cached_fails_at_once_in_one_line(closed_hub, tmp_path):
    with pytest.raises(PtqError) as e:
        harness.prepare("piqa", None, tmp_path / "work", max_items=None)
    message = str(e.value)
    assert message.startswith("cannot load task 'piqa': the Hub cannot be reached (127.0.0.1:")
    assert (
        "not in the local datasets cache" in message
        and "piqa=FILE.jsonl" in message
        and "\n" not in message
    )
    assert len(closed_hub) == 1 and still_online()


def test_a_task_over_a_cached_hub_dataset_runs_from_the_cache(
    cached_dataset, closed_hub, tmp_path, tiny_model
):
    """A task YAML whose dataset_path is a Hub dataset (the one in the cache): checked and then scored (lm-eval loads
    its data again), the Hub probed once only."""
    from ptq.models.loading import load_model

    task = tmp_path / "cached.yaml"
    task.write_text(
        f"include: {harness.CHOICE_TEMPLATE}\ntask: cached_mc\ndataset_path: {CACHED}\n"
    )
    suite = harness.prepare(str(task), None, tmp_path / "work", max_items=None)
    assert suite.names == ["cached_mc"]
    loaded = load_model(str(tiny_model))
    run = harness.run({"tiny": loaded.model}, loaded.tokenizer, suite, 4)
    assert run.models["tiny"].choices["cached_mc"] == [len(r["choices"]) for r in cached_dataset]
    assert len(closed_hub) == 1 and still_online()


def test_tasks_on_local_files_do_not_probe_the_hub(closed_hub, tmp_path):
    """ptq's own tasks and tasks on local JSON files load without asking whether the Hub is there."""
    items = write_jsonl(tmp_path / "mc.jsonl", varied_rows(6))
    user = tmp_path / "user"
    user.mkdir()
    (user / "mine.yaml").write_text(
        f"include: {harness.CHOICE_TEMPLATE}\ntask: mine\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(items))}\n"
    )
    suite = harness.prepare(
        f"mc={items},ptq_arith,{user / 'mine.yaml'}", None, tmp_path / "work", max_items=None
    )
    assert suite.names == ["mc", "ptq_arith", "mine"]
    assert closed_hub == [] and loading.hub_unreachable.cache_info().misses == 0


@pytest.mark.parametrize(
    "environment, hub, datasets",
    [
        ({}, None, None),
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE", "HF_HUB_OFFLINE"),
        (
            {"HF_HUB_OFFLINE": "yes", "TRANSFORMERS_OFFLINE": "0"},
            "HF_HUB_OFFLINE",
            "HF_HUB_OFFLINE",
        ),
        (
            {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
            None,
            None,
        ),  # the first one set decides
        (
            {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "ON"},
            "TRANSFORMERS_OFFLINE",
            "TRANSFORMERS_OFFLINE",
        ),
        ({"HF_DATASETS_OFFLINE": "1"}, None, "HF_DATASETS_OFFLINE"),
        (
            {"HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "1"},
            "HF_HUB_OFFLINE",
            None,
        ),  # datasets': its own first
    ],
)
def test_the_offline_variables_are_read_as_huggingface_hub_and_datasets_read_them(
    environment, hub, datasets, monkeypatch
):
    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert loading.offline_variable("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") == hub
    assert loading.offline_variable(*OFFLINE_VARIABLES) == datasets
    # as the libraries themselves read them, at import in a new process
    read = "import huggingface_hub.constants as h, datasets.config as d; print(h.HF_HUB_OFFLINE, d.HF_DATASETS_OFFLINE)"
    done = subprocess.run(
        [sys.executable, "-c", read], env=dict(os.environ), capture_output=True, text=True
    )
    assert done.stdout.split() == [str(hub is not None), str(datasets is not None)], done.stderr
