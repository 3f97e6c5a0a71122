"""The ``data`` config group: which corpus, where it lives, how it is batched (docs/method.md §4).

:class:`DataSpec` (with :class:`SyntheticSpec` for the passage-recall corpus) is the group's
schema and defaults, written here once; :func:`resolve_data` fills its derived defaults and checks
it, refusing keys that the chosen corpus would ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from crtn.errors import ConfigError, check_choice

#: Every value of ``data.name``.
DATASETS = ("wt2", "wt103", "ptb", "enwik8", "text8", "text", "synthetic", "mqar")
#: Corpora that exist at character level only (metric bpc).
CHAR_DATASETS = ("enwik8", "text8")
#: Corpora read from files of words, which ``data.level=char`` reads as characters instead.
LEVEL_DATASETS = ("wt2", "wt103", "ptb", "text")
LEVELS = ("word", "char")

#: Standard corpus folder of each data set (``data.dir`` when it is None).
DEFAULT_DIRS = {
    "wt2": "wikitext-2",
    "wt103": "wikitext-103",
    "ptb": "penn",
    "enwik8": "enwik8",
    "text8": "text8",
}


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
    # copies start at passage boundaries, so copy distances are multiples of passage_len; false:
    # at any token, every distance in [max(min_gap, passage_len), max_gap]
    aligned: bool = True
    train_tokens: int = 2_000_000
    valid_tokens: int = 65_536
    test_tokens: int = 65_536
    seed: int = 1234
    repeat_skip: int = 4  # first tokens of each repeat left out of the repeat metrics


@dataclass(frozen=True)
class MqarSpec:
    """The multi-query associative recall corpus (docs/method.md §4; Arora et al. 2023, "Zoology",
    MQAR), its layout in :mod:`crtn.data.mqar`."""

    n_keys: int = 2048  # key symbols; a document's keys are distinct and unused by the document before
    n_values: int = 512  # value symbols; answers are uniform over them (chance accuracy 1/n_values)
    n_filler: int = 512  # filler symbols, drawn uniformly between the pairs
    n_pairs: int = 64  # key-value pairs per document, each written once and queried once
    slot_len: int = 80  # tokens per slot; a slot holds at most one pair (a write or a query)
    spacing: int = 64  # two pairs of a document lie at least this many tokens apart
    min_gap: int = 1024  # tokens from an answer back to its stored value, at least
    max_gap: int = 8192  # ... and at most
    gap_dist: str = "log_uniform"  # uniform | log_uniform: weight of each query-slot distance d (1 or 1/d)
    doc_len: int = 18432  # tokens per document before its <eos>
    train_tokens: int = 2_000_000
    valid_tokens: int = 262_144
    test_tokens: int = 262_144
    seed: int = 1234
    # all | answers: the training loss is the mean NLL of every token, or of the answers only
    # (Zoology's loss: the filler, keys and values are unpredictable; best.pt then by the answers'
    # validation loss); evaluation scores both
    train_loss: str = "all"


@dataclass(frozen=True)
class DataSpec:
    """Which corpus, where it lives, and how it is batched (docs/method.md §4)."""

    name: str = "synthetic"  # wt2 | wt103 | ptb | enwik8 | text8 | text | synthetic | mqar
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
    mqar: MqarSpec = field(default_factory=MqarSpec)  # name=mqar only

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


def resolve_data(cfg: Any) -> DataSpec:
    """The resolved ``data`` spec of ``cfg`` (an object or dict with :class:`DataSpec`'s fields):
    ``dir`` None becomes the corpus' standard folder, ``level`` None its own level, ``split`` None
    0.9/0.05/0.05 for ``data.name=text``; keys the corpus would ignore are refused.

    Raises:
        ConfigError: unknown ``data.name`` or ``data.level``; ``data.level=word`` for a
            character-level corpus (or ``char`` for the synthetic one); ``data.path`` or
            ``data.split`` with a corpus other than ``text``; ``data.name=text`` without
            ``data.path``; a ``data.split`` that is not three positive fractions summing to 1;
            batch sizes <= 0.
    """
    spec = _as_spec(cfg)
    name = spec.name
    check_choice("data.name", name, DATASETS)
    if spec.level is not None:
        check_choice("data.level", spec.level, LEVELS)
    own = "char" if name in CHAR_DATASETS else "word"
    if name not in LEVEL_DATASETS and spec.level not in (None, own):
        raise ConfigError(f"data.level={spec.level}: data.name={name} exists at {own} level only")
    for key in ("path", "split"):
        if name != "text" and getattr(spec, key) is not None:
            raise ConfigError(f"data.{key}={getattr(spec, key)!r} applies to data.name=text only, not {name}")
    if spec.batch_size <= 0 or spec.eval_batch_size <= 0:
        raise ConfigError("data.batch_size and data.eval_batch_size must be > 0")
    split = spec.split
    if name == "text":
        if not spec.path:
            raise ConfigError("data.name=text needs data.path=<a UTF-8 text file>")
        split = _fractions((0.9, 0.05, 0.05) if split is None else split)
    return replace(spec, dir=spec.dir or DEFAULT_DIRS.get(name), level=spec.level or own, split=split)


def _as_spec(cfg: Any) -> DataSpec:
    if isinstance(cfg, DataSpec):
        return cfg
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    values = {}
    for f in fields(DataSpec):
        value = get(f.name, None)
        if value is None:
            continue
        if f.name in ("synthetic", "mqar"):
            value = _sub_spec(SyntheticSpec if f.name == "synthetic" else MqarSpec, value)
        elif f.name == "split":
            value = list(value)
        values[f.name] = value
    return DataSpec(**values)


def _sub_spec(cls: type, value: Any) -> Any:
    """``cls`` (a generated corpus' spec) with the values of ``value`` (an object or dict)."""
    if isinstance(value, cls):
        return value
    get = value.get if isinstance(value, dict) else lambda k, d=None: getattr(value, k, d)
    given = {g.name: get(g.name, None) for g in fields(cls)}
    return cls(**{k: v for k, v in given.items() if v is not None})


def _fractions(fractions: Any) -> tuple[float, float, float]:
    try:
        fractions = [float(x) for x in fractions]
    except (TypeError, ValueError):
        raise ConfigError(f"data.split={fractions!r} must be 3 positive numbers summing to 1") from None
    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(
            f"data.split={fractions} must be 3 positive numbers (train, valid, test) summing to 1"
        )
    return tuple(fractions)
