"""Accuracy tasks: what an item is, where items come from, and how an item's scores become a metric.

Every task is a list of items; an item is one or more (context, continuation) pairs and the index of the
right one. Two kinds, both scored as lm-evaluation-harness scores them (lm_eval/api/task.py):

    choice   multiple choice. Each continuation's log-likelihood given its context is summed over its
             tokens. acc: the highest sum is the labelled one. acc_norm: the highest sum divided by the
             choice's length in characters (the harness divides by len() of the choice string, which is
             its length in bytes for ASCII text).
    greedy   one continuation (LAMBADA-style last word). acc: greedy decoding reproduces every token of the
             continuation (the harness's `is_greedy`).

Task specs (`--tasks`, comma-separated):

    cloze                 cloze items built from the evaluation text (see build_cloze)
    cloze=PATH            cloze items built from a .txt/.md/.jsonl file or folder
    NAME=PATH.jsonl       multiple choice from a local JSONL file, one item a line:
                          {"context": "...", "choices": ["...", ...], "label": 0}
                          each choice is scored as the continuation " " + choice (the harness's target
                          delimiter). NAME may also be one of ADAPTERS, whose rows may then carry the
                          dataset's own fields (as exported from the Hugging Face dataset).
    PATH.jsonl            the same, named after the file
    hellaswag, piqa, arc_easy, winogrande, lambada_openai
                          the Hugging Face dataset, split as in the harness (needs a network or a warm cache)

Where ptq differs from the harness (v0.4 task configs): acc_norm divides by len() of the choice string
as the harness code does (characters; the issue's "bytes" is the same for ASCII); the continuation's last
token is fed to the model although nothing reads its logits (the harness drops it; scores are equal);
lambada_openai reports acc only, not its perplexity; winogrande follows the harness's partial evaluation
and reports acc only; a model whose tokenizer adds BOS gets it before every context (the harness does so
only when asked, or for Gemma). Items may be an evenly spaced subset (--max-items): such numbers are
not comparable with full-set published ones.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ptq.errors import PtqError
from ptq.evaluation.data import Corpus, load_corpus

DELIMITER = " "  # the harness's default target_delimiter between context and choice


@dataclass(frozen=True)
class Item:
    contexts: tuple[str, ...]  # one per choice; all equal except for partial evaluation (winogrande)
    continuations: tuple[str, ...]  # the scored text of each choice
    label: int
    norm_lengths: tuple[int, ...] = ()  # acc_norm divisor of each choice (characters); empty: no acc_norm


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "choice" or "greedy"
    items: list[Item]
    source: str  # where the items came from, in words
    available: int  # items before subsampling to --max-items
    chance: float  # accuracy of guessing without the model (see chance_note)
    chance_note: str
    notes: tuple[str, ...] = ()  # how the items were built or preprocessed

    @property
    def metrics(self) -> tuple[str, ...]:
        return ("acc", "acc_norm") if self.kind == "choice" and all(i.norm_lengths for i in self.items) else ("acc",)

    @property
    def sha256(self) -> str:
        blob = json.dumps([[i.contexts, i.continuations, i.label] for i in self.items], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "source": self.source, "n": len(self.items),
                "available": self.available, "metrics": list(self.metrics), "chance": self.chance,
                "chance_note": self.chance_note, "notes": list(self.notes), "sha256": self.sha256}


@dataclass
class ItemScores:
    """What a model produced for each item of one task: per choice, the summed log-likelihood of the
    continuation and whether greedy decoding reproduces it."""

    loglik: list[list[float]] = field(default_factory=list)
    greedy: list[list[bool]] = field(default_factory=list)


def item_correct(task: Task, scores: ItemScores) -> dict[str, np.ndarray]:
    """0/1 per item for each metric of the task (the units the bootstrap resamples)."""
    labels = np.array([i.label for i in task.items])
    if task.kind == "greedy":
        return {"acc": np.array([g[i.label] for g, i in zip(scores.greedy, task.items)], dtype=np.float64)}
    out = {"acc": np.array([np.argmax(ll) for ll in scores.loglik]) == labels}
    if "acc_norm" in task.metrics:
        out["acc_norm"] = np.array([np.argmax(np.array(ll) / np.array(i.norm_lengths, dtype=np.float64))
                                    for ll, i in zip(scores.loglik, task.items)]) == labels
    return {k: v.astype(np.float64) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Specs


def parse_task_specs(spec: str) -> list[tuple[str, str | None]]:
    """`cloze,hellaswag=h.jsonl,my.jsonl` -> [("cloze", None), ("hellaswag", "h.jsonl"), ("my", "my.jsonl")]."""
    out: list[tuple[str, str | None]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, path = (s.strip() for s in part.partition("="))
        if sep and not (name and path):
            raise PtqError(f"bad task '{part}': expected NAME, NAME=PATH or PATH.jsonl")
        if not sep and name.endswith(".jsonl"):
            name, path = Path(name).stem, name
        if not sep and not path and name != "cloze" and name not in ADAPTERS:
            raise PtqError(f"unknown task '{name}' (built in: cloze, {', '.join(ADAPTERS)}; or NAME=PATH.jsonl)")
        if any(name == seen for seen, _ in out):
            raise PtqError(f"task '{name}' given twice")
        out.append((name, path or None))
    if not out:
        raise PtqError("no tasks given (e.g. --tasks cloze)")
    return out


def load_tasks(specs: list[tuple[str, str | None]], eval_corpus: Callable[[], Corpus], max_items: int | None) -> list[Task]:
    """Load each task; `eval_corpus` supplies the evaluation text for a plain `cloze`."""
    tasks = []
    for name, path in specs:
        if name == "cloze":
            corpus = load_corpus(path, role="evaluation") if path else eval_corpus()
            task = build_cloze(corpus, name)
        elif path is not None:
            task = load_jsonl_task(name, Path(path))
        else:
            task = load_hf_task(name)
        tasks.append(subsample(task, max_items))
    return tasks


def subsample(task: Task, max_items: int | None) -> Task:
    """At most `max_items` items, evenly spaced (index round(i * n / max_items)), so a sample covers the
    whole set and is the same on every run."""
    n = len(task.items)
    if max_items is None or n <= max_items:
        return task
    items = [task.items[round(i * n / max_items)] for i in range(max_items)]
    return Task(task.name, task.kind, items, task.source, task.available, _chance(task.kind, items)[0],
                task.chance_note, task.notes)


def _chance(kind: str, items: list[Item]) -> tuple[float, str]:
    if kind == "choice":
        return float(np.mean([1 / len(i.continuations) for i in items])), "uniform guess among the choices"
    counts = Counter(i.continuations[i.label].strip().lower() for i in items)
    word, top = counts.most_common(1)[0]
    return top / len(items), (f"always answering the most frequent target word ('{word}'), the best guess "
                              "that ignores the passage; a uniform guess over the vocabulary is ~0")


def _task(name: str, kind: str, items: list[Item], source: str, notes: tuple[str, ...] = ()) -> Task:
    if not items:
        raise PtqError(f"task '{name}' has no items ({source})")
    chance, note = _chance(kind, items)
    return Task(name, kind, items, source, len(items), chance, note, notes)


# ----------------------------------------------------------------------------------------------
# Cloze: LAMBADA-style items from any text

CLOZE_CONTEXT_CHARS = (200, 600)  # a passage's context: whole lines, at least 200, at most 600 characters
CLOZE_LAST_WORD = re.compile(r"(?<= )([a-z]{3,})[.!?]$")  # a line that ends a sentence with a plain word


def build_cloze(corpus: Corpus, name: str = "cloze") -> Task:
    """Deterministic cloze items (the construction is the same for every model and tokenizer):

    1. A target is the last word of a line that ends a sentence: a space, 3+ lowercase ASCII letters,
       then one of . ! ? and the end of the line (so no speaker names, stage directions or numbers).
    2. The passage is the longest run of whole preceding lines of the same document with 200-600
       characters, then the target's line up to the word; the final punctuation is dropped.
    3. The target must occur earlier in the passage (case-insensitive, whole word): like LAMBADA's
       selection for words that need the broader context, a proxy that keeps items answerable.
    4. Passages do not overlap (a candidate whose passage starts before the previous item's target
       ends is skipped), so items are independent text.
    The model must produce " " + word: every token of it greedily (harness `is_greedy`).
    """
    lo, hi = CLOZE_CONTEXT_CHARS
    items: list[Item] = []
    for doc in corpus.documents:
        lines = doc.split("\n")
        starts = np.cumsum([0] + [len(line) + 1 for line in lines])  # offset of each line in doc
        used_until = 0
        for n, line in enumerate(lines):
            m = CLOZE_LAST_WORD.search(line)
            if not m:
                continue
            word_at = starts[n] + m.start(1)
            first = n  # extend the context back line by line while it stays within `hi` characters
            while first > 0 and word_at - starts[first - 1] - 1 <= hi:
                first -= 1
            context = doc[starts[first]:word_at - 1]
            if len(context) < lo or starts[first] < used_until:
                continue
            word = m.group(1)
            if not re.search(rf"\b{word}\b", context, flags=re.IGNORECASE):
                continue
            items.append(Item((context,), (" " + word,), 0))
            used_until = word_at + len(word)
    notes = (f"passages: whole lines, {lo}-{hi} characters of context; target: a lowercase word of 3+ letters "
             "ending a line and a sentence, also found earlier in the passage; non-overlapping passages; "
             "correct when greedy decoding yields all of the word's tokens",)
    return _task(name, "greedy", items, f"cloze from {corpus.source} (sha256 {corpus.sha256[:16]})", notes)


# ----------------------------------------------------------------------------------------------
# Multiple choice from JSONL, and adapters for the harness's datasets


def _hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")  # WikiHow artifacts, removed as the harness does
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict) -> Item:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    choices = [_hellaswag_preprocess(e) for e in row["endings"]]
    return _choice_item(_hellaswag_preprocess(row["activity_label"] + ": " + ctx), choices, int(row["label"]))


def _piqa(row: dict) -> Item:
    return _choice_item(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def _arc(row: dict) -> Item:
    choices = row["choices"]
    return _choice_item(f"Question: {row['question']}\nAnswer:", list(choices["text"]),
                        list(choices["label"]).index(row["answerKey"]))


def _winogrande(row: dict) -> Item:
    # Partial evaluation: each option fills the blank and the rest of the sentence is scored after it.
    sentence = row["sentence"]
    blank = sentence.index("_")
    target = DELIMITER + sentence[blank + 1:].strip()
    options = [row["option1"], row["option2"]]
    return Item(tuple(sentence[:blank] + o for o in options), (target, target), {"1": 0, "2": 1}[str(row["answer"])])


def _lambada(row: dict) -> Item:
    words = row["text"].split(" ")
    return Item((" ".join(words[:-1]),), (" " + words[-1],), 0)


@dataclass(frozen=True)
class Adapter:
    fields: tuple[str, ...]  # the dataset fields the adapter reads
    to_item: Callable[[dict], Item]
    kind: str
    hub: tuple[str, str | None, str]  # dataset, config, split (as the harness evaluates it)
    note: str


ADAPTERS: dict[str, Adapter] = {
    "hellaswag": Adapter(("activity_label", "ctx_a", "ctx_b", "endings", "label"), _hellaswag, "choice",
                         ("Rowan/hellaswag", None, "validation"),
                         "context = preprocess(activity_label + ': ' + ctx_a + ' ' + ctx_b.capitalize()), "
                         "choices = preprocess(endings), the harness's bracket/[title] clean-up"),
    "piqa": Adapter(("goal", "sol1", "sol2", "label"), _piqa, "choice", ("baber/piqa", None, "validation"),
                    "context = 'Question: {goal}\\nAnswer:', choices = [sol1, sol2]"),
    "arc_easy": Adapter(("question", "choices", "answerKey"), _arc, "choice", ("allenai/ai2_arc", "ARC-Easy", "test"),
                        "context = 'Question: {question}\\nAnswer:', choices = choices.text, "
                        "label = choices.label.index(answerKey)"),
    "winogrande": Adapter(("sentence", "option1", "option2", "answer"), _winogrande, "choice",
                          ("allenai/winogrande", "winogrande_xl", "validation"),
                          "partial evaluation: context = sentence up to '_' + option, continuation = the rest of "
                          "the sentence (scored the same for both options); acc only, as in the harness"),
    "lambada_openai": Adapter(("text",), _lambada, "greedy", ("EleutherAI/lambada_openai", "default", "test"),
                              "context = all words but the last (split on ' '), continuation = ' ' + last word; "
                              "acc = greedy reproduces the word"),
}
GENERIC_FIELDS = ("context", "choices", "label")


def _choice_item(context: str, choices: list[str], label: int) -> Item:
    return Item(tuple(context for _ in choices), tuple(DELIMITER + c for c in choices), label,
                tuple(len(c) for c in choices))


def _generic(row: dict) -> Item:
    context, choices, label = row["context"], row["choices"], row["label"]
    if not isinstance(context, str):
        raise ValueError("'context' must be text")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("'choices' must be a list of at least two non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise ValueError(f"'label' must be an integer index into the {len(choices)} choices")
    return _choice_item(context, choices, label)


def rows_to_task(name: str, rows: list[dict], source: str, where: Callable[[int], str]) -> Task:
    """Items from rows in the generic schema, or in the dataset's own fields when `name` is an adapter."""
    adapter = ADAPTERS.get(name)
    items, kind, note = [], "choice", "generic schema: context, choices, label; continuation = ' ' + choice"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise PtqError(f"{where(i)}: expected a JSON object")
        if all(f in row for f in GENERIC_FIELDS):
            convert = _generic
        elif adapter and all(f in row for f in adapter.fields):
            convert, kind, note = adapter.to_item, adapter.kind, f"{name} adapter: {adapter.note}"
        else:
            wanted = f"'{', '.join(GENERIC_FIELDS)}'" + (f" or the {name} fields '{', '.join(adapter.fields)}'" if adapter else "")
            raise PtqError(f"{where(i)}: expected the fields {wanted}")
        try:
            items.append(convert(row))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise PtqError(f"{where(i)}: {e}") from None
    return _task(name, kind, items, source, (note,))


def load_jsonl_task(name: str, path: Path) -> Task:
    if not path.is_file():
        raise PtqError(f"task file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise PtqError(f"cannot read task file {path}: {e}") from None
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PtqError(f"{path}, line {number}: not valid JSON ({e.msg})") from None
            lines.append(number)
    return rows_to_task(name, rows, f"{path} ({len(rows)} items)", lambda i: f"{path}, line {lines[i]}")


def load_hf_task(name: str) -> Task:
    adapter = ADAPTERS[name]
    dataset_name, config, split = adapter.hub
    try:
        import datasets

        rows = list(datasets.load_dataset(dataset_name, config, split=split))
    except Exception as e:  # no network, no cache, a renamed dataset: one line for the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtqError(f"cannot load task '{name}' from the Hugging Face Hub ({dataset_name}): {reason[:200]} "
                       f"(offline, pass a local copy: {name}=rows.jsonl)") from None
    source = f"hf:{dataset_name}" + (f" ({config})" if config else "") + f", split '{split}'"
    return rows_to_task(name, rows, source, lambda i: f"{dataset_name} row {i}")
