"""Cloze items built from any text: what lm-evaluation-harness lacks, ptq builds, and lm-eval scores
(ptq/evaluation/harness.py, lm_eval_tasks/_ptq_cloze.yaml: loglikelihood of " " + word, acc = greedy
decoding yields every token of it, lm-eval's is_greedy). Every other task is lm-eval's own.

Items may be an evenly spaced subset (--max-items): such numbers are not comparable with full-set
ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ptq.errors import PtqError
from ptq.evaluation.data import Corpus

DELIMITER = " "  # lm-eval's default target_delimiter between context and continuation


@dataclass(frozen=True)
class Item:
    # one per choice; all equal except for partial evaluation (winogrande)
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]  # the scored text of each choice
    label: int
    # acc_norm divisor of each choice (characters); empty: no acc_norm
    norm_lengths: tuple[int, ...] = ()


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
        return (
            ("acc", "acc_norm")
            if self.kind == "choice" and all(i.norm_lengths for i in self.items)
            else ("acc",)
        )

    @property
    def sha256(self) -> str:
        blob = json.dumps(
            [[i.contexts, i.continuations, i.label] for i in self.items], ensure_ascii=False
        )
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "n": len(self.items),
            "available": self.available,
            "metrics": list(self.metrics),
            "chance": self.chance,
            "chance_note": self.chance_note,
            "notes": list(self.notes),
            "sha256": self.sha256,
        }


def subsample(task: Task, max_items: int | None) -> Task:
    """At most `max_items` items, evenly spaced (index round(i * n / max_items)), so a sample covers
    the whole set and is the same on every run."""
    n = len(task.items)
    if max_items is None or n <= max_items:
        return task
    items = [task.items[round(i * n / max_items)] for i in range(max_items)]
    return Task(
        task.name,
        task.kind,
        items,
        task.source,
        task.available,
        _chance(task.kind, items)[0],
        task.chance_note,
        task.notes,
    )


def scored_chance(task: Task, limit: float | None) -> tuple[float, int]:
    """The chance of the items lm-eval scores under --limit (the first ceil(n * limit) of them for a
    fraction, else the first `limit`: lm_eval.evaluator_utils.get_sample_size), and how many those
    are."""
    n = (
        len(task.items)
        if limit is None
        else math.ceil(len(task.items) * limit)
        if limit < 1
        else int(limit)
    )
    scored = task.items[:n]
    return _chance(task.kind, scored)[0], len(scored)


def _chance(kind: str, items: list[Item]) -> tuple[float, str]:
    if kind == "choice":
        return float(
            np.mean([1 / len(i.continuations) for i in items])
        ), "uniform guess among the choices"
    counts = Counter(i.continuations[i.label].strip().lower() for i in items)
    word, top = counts.most_common(1)[0]
    return top / len(items), (
        f"always answering the most frequent target word ('{word}'), the best guess "
        "that ignores the passage; a uniform guess over the vocabulary is ~0"
    )


def _task(
    name: str, kind: str, items: list[Item], source: str, notes: tuple[str, ...] = ()
) -> Task:
    if not items:
        raise PtqError(f"task '{name}' has no items ({source})")
    chance, note = _chance(kind, items)
    return Task(name, kind, items, source, len(items), chance, note, notes)


# ----------------------------------------------------------------------------------------------
# Cloze: LAMBADA-style items from any text

# a passage's context: whole lines, at least 200, at most 600 characters
CLOZE_CONTEXT_CHARS = (
    200,
    600,
)
# a line that ends a sentence with a plain word
CLOZE_LAST_WORD = re.compile(r"(?<= )([a-z]{3,})[.!?]$")


def build_cloze(corpus: Corpus, name: str = "cloze") -> Task:
    """Deterministic cloze items (the construction is the same for every model and tokenizer):

    1. A target is the last word of a line that ends a sentence: a space, 3+ lowercase ASCII
       letters, then one of . ! ? and the end of the line (so no speaker names, stage directions or
       numbers).
    2. The passage is the longest run of whole preceding lines of the same document with 200-600
       characters, then the target's line up to the word; the final punctuation is dropped.
    3. The target must occur earlier in the passage (case-insensitive, whole word): like LAMBADA's
       selection for words that need the broader context, a proxy that keeps items answerable.
    4. Passages do not overlap (a candidate whose passage starts before the previous item's target
       ends is skipped), so items are independent text.
    The model must produce " " + word: every token of it greedily (harness `is_greedy`).
    """
    lo, hi = CLOZE_CONTEXT_CHARS
    notes = (
        f"passages: whole lines, {lo}-{hi} characters of context; target: a lowercase word of 3+ "
        "letters ending a line and a sentence, also found earlier in the passage; non-overlapping "
        "passages; correct when greedy decoding yields all of the word's tokens",
    )
    items = cloze_items(corpus)
    if not items:
        raise PtqError(f"task '{name}' has no items: {no_cloze_items(corpus)}")
    return _task(
        name, "greedy", items, f"cloze from {corpus.source} (sha256 {corpus.sha256[:16]})", notes
    )


def no_cloze_items(corpus: Corpus) -> str:
    return (
        f"no line of {corpus.source} ends a sentence with a lowercase word that occurs earlier in "
        f"its {CLOZE_CONTEXT_CHARS[0]}-{CLOZE_CONTEXT_CHARS[1]} character passage"
    )


def cloze_items(corpus: Corpus) -> list[Item]:
    """The items of build_cloze (none where no line of the text qualifies: a text without line
    breaks, say)."""
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
            context = doc[starts[first] : word_at - 1]
            if len(context) < lo or starts[first] < used_until:
                continue
            word = m.group(1)
            if not re.search(rf"\b{word}\b", context, flags=re.IGNORECASE):
                continue
            items.append(Item((context,), (" " + word,), 0))
            used_until = word_at + len(word)
    return items


def cloze_rows(task: Task) -> list[dict]:
    """The rows lm-eval scores a cloze task on (lm_eval_tasks/_ptq_cloze.yaml): context and target
    word."""
    return [
        {"context": i.contexts[0], "target": i.continuations[0].removeprefix(DELIMITER)}
        for i in task.items
    ]
