"""Datasets of ptq's shipped lm-evaluation-harness tasks (`custom_dataset: !function utils.NAME` in
their YAML): local files, found next to this module, so that the tasks run offline from lm-eval's
own CLI as well (`lm_eval --include_path <this folder> --tasks ptq_arith`)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def local_jsonl(**splits):
    """A DatasetDict of JSONL files, one per split (test=FILE, train=FILE); relative names are in
    this folder. lm-eval passes the task's metadata too (version...): keys whose values are not file
    names are ignored."""
    import datasets

    files = {
        split: str(HERE / name)
        for split, name in splits.items()
        if split in ("test", "train", "validation") and isinstance(name, str)
    }
    return datasets.load_dataset("json", data_files=files)


def default_cloze(max_items: int = 300, **_):
    """ptq's cloze items from its default evaluation text, as ptq compare --tasks cloze builds
    them."""
    import datasets

    from ptq.evaluation.data import load_corpus
    from ptq.evaluation.tasks import build_cloze, cloze_rows, subsample

    task = subsample(build_cloze(load_corpus(None, role="evaluation")), int(max_items))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(cloze_rows(task))})
