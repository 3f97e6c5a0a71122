"""The ``data`` config group: which corpus, where it lives, how it is batched (docs/method.md §4).

:class:`DataSpec` (with :class:`SyntheticSpec` for the passage-recall corpus) is the group's
schema and defaults, written here once; :func:`crtn.data.corpus.resolve_data` fills its derived
defaults and checks it, refusing keys that the chosen corpus would ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Every value of ``data.name``.
DATASETS = ("wt2", "wt103", "ptb", "enwik8", "text8", "text", "synthetic")
#: Corpora that exist at character level only (metric bpc).
CHAR_DATASETS = ("enwik8", "text8")
#: Corpora read from files of words, which ``data.level=char`` reads as characters instead.
LEVEL_DATASETS = ("wt2", "wt103", "ptb", "text")
LEVELS = ("word", "char")


@dataclass(frozen=True)
class SyntheticSpec:
    """The passage-recall corpus (docs/method.md §4)."""

    vocab_size: int = 512
    branching: int = 16  # successors per symbol in the sparse Markov source
    concentration: float = 1.0  # Dirichlet concentration of the successor probabilities
    passage_len: int = 16  # P
    doc_passages: int = 64  # passages per document
    p_repeat: float = 0.5  # probability that a passage copies an earlier one
    min_gap: int = 160  # tokens between the copied passage and its copy, at least
    max_gap: int = 256  # ... and at most
    train_tokens: int = 2_000_000
    valid_tokens: int = 65_536
    test_tokens: int = 65_536
    seed: int = 1234
    repeat_skip: int = 4  # first tokens of each repeat left out of the repeat metrics


@dataclass(frozen=True)
class DataSpec:
    """Which corpus, where it lives, and how it is batched (docs/method.md §4)."""

    name: str = "synthetic"  # wt2 | wt103 | ptb | enwik8 | text8 | text | synthetic
    root: str = "data"  # folder holding the corpus folders (see conf/data/*.yaml)
    dir: str | None = None  # corpus folder under root; None: the corpus' standard folder (wikitext-2...)
    path: str | None = None  # name=text only: the UTF-8 file
    # word | char; None: the corpus' own (char for enwik8/text8, word otherwise); char reads the
    # word corpora (wt2, wt103, ptb) and text files as characters, newlines included
    level: str | None = None
    split: list[float] | None = None  # name=text only: train/valid/test fractions; None: 0.9/0.05/0.05
    cache_dir: str | None = None  # vocabulary/encoding cache; None: beside the data (crtn/data/corpus.py)
    batch_size: int = 16
    eval_batch_size: int = 16  # conf/data options of real corpora: 10
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)  # name=synthetic only

    def __post_init__(self) -> None:
        if isinstance(self.split, list):
            object.__setattr__(self, "split", tuple(self.split))


def data_level(data: Any) -> str:
    """``word`` or ``char``: the level of the corpus a ``data`` node (or plain dict) describes,
    without reading it (a resolved spec says it in ``level``; older configs by name)."""
    get = data.get if isinstance(data, dict) else lambda k, d=None: getattr(data, k, d)
    name = get("name")
    if name in CHAR_DATASETS:
        return "char"
    return get("level") or "word"


def metric_name(level: str) -> str:
    """``ppl`` for word-level corpora (and the synthetic one), ``bpc`` for character-level ones
    (docs/method.md §5)."""
    return "bpc" if level == "char" else "ppl"
