"""The multi-query associative recall corpus (MQAR; docs/method.md §4), generated from a seed.

Multi-query associative recall (Arora et al. 2023, "Zoology: Measuring and Improving Recall in
Efficient Language Models", §3; their generator ``zoology/data/multiquery_ar.py``) stretched
over long gaps: each answer's key-value pair lies ``min_gap`` to ``max_gap`` tokens back, and
two queries never need the same past segment.

Vocabulary (ids): 0 ``<eos>``; keys ``1..K`` (``K = n_keys``, symbols ``k0, k1, ...``);
values ``K+1..K+V`` (``V = n_values``, ``v0, ...``); filler ``K+V+1..K+V+F``
(``F = n_filler``, ``f0, ...``). Keys and values are disjoint, as in zoology; the filler is a
third disjoint set.

Document: ``doc_len`` tokens, then ``<eos>``. Its first ``n_slots = doc_len // S`` runs of
``S = slot_len`` tokens are *slots*. A slot holds at most one *pair* ``k v`` (two tokens) at
an offset drawn uniformly from ``[0, J]``, ``J = S - spacing``; every other token (the tail
after the last slot included) is filler, drawn uniformly from the F filler ids. A pair is
either the *write* of pair i (``k_i v_i``, the first time ``k_i`` occurs in the document) or
its *query* (the same two tokens again, later; that ``v_i`` is the *answer*, the target that
the query's key predicts).

Schedule: the slots are visited in order. A slot reserved by an earlier write holds that
write's query. Any other slot, while fewer than ``n_pairs`` pairs are written, holds the next
write and reserves its query slot among the free (unreserved) slots ``d`` slots ahead,
``d_lo <= d <= d_hi``, drawn with weight 1 (``gap_dist=uniform``) or 1/d (``log_uniform``:
each doubling of the gap about equally likely), where ``d_lo = ceil((min_gap + J) / S)`` and
``d_hi = floor((max_gap - J) / S)``. At most ``d_hi - d_lo`` earlier writes can hold a slot
of that window, so one is free while the window lies inside the document, and every slot
before ``n_slots - d_hi`` is a write or a query; at most half of them are queries, so
``n_slots >= d_hi + 2 n_pairs - 1`` (checked) gives every document its ``n_pairs`` pairs. The
remaining slots hold filler only. Earlier reservations fill the near end of a window more often
than its far end, so the realised gaps lean a little longer than the weights say (defaults: 28%,
32% and 39% of the answers at 1,024-2,047, 2,048-4,095 and 4,096-8,192 tokens; each split's
counts are in ``info``).

Keys: ``n_pairs`` distinct keys per document, in random order, none of them a key of the
previous document (a cache reaching back across the document boundary holds no pair with a
query's key unless it reaches two documents back). Values: independent and uniform over the V
values (repeats allowed), so without its stored pair an answer is unpredictable: chance
accuracy 1/V, loss ln V.

Guarantees (tests/test_mqar.py): the gap from an answer back to its stored value (equal to the
gap from the query's key back to the write's key) lies in ``[min_gap, max_gap]``; two pairs of
a document lie at least ``spacing`` tokens apart, so with ``tgt_len <= spacing`` no two pairs
share a segment, whatever the alignment of the segments (streams start anywhere in a
document), and in particular consecutive queries need different cached segments.

Labels: ``labels[split]`` (``int32``) holds the gap at each answer token and 0 elsewhere, so
``label > 0`` marks the answers; ``repeat_gap[split]`` is the same tensor (an answer copies the
value ``gap`` tokens back). :class:`crtn.mqar_metrics.AnswerSums` reports loss and accuracy on
the answers by gap bucket (:func:`gap_buckets`). Training scores every token by default;
``train_loss="answers"`` sets :attr:`crtn.data.Corpus.train_on_labels`, so that the training loss
is the mean NLL of the answers only, as Zoology trains MQAR (the other tokens are unpredictable
by construction).

Determinism: :class:`numpy.random.SeedSequence` (``seed``) spawns one stream per split. Each
split has ``*_tokens`` tokens: whole documents, the last one truncated.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from crtn.data.base import SPLITS, Corpus
from crtn.data.spec import MqarSpec, metric_name
from crtn.data.vocab import EOS, Vocab
from crtn.errors import ConfigError

EOS_IDX = 0
#: Values of ``data.mqar.gap_dist``: the weight of a query-slot distance d is 1 or 1/d.
GAP_DISTS = ("uniform", "log_uniform")
#: Values of ``data.mqar.train_loss``: the training loss over every token or over the answers only.
TRAIN_LOSSES = ("all", "answers")


def mqar_settings(cfg: Any) -> dict[str, Any]:
    """The fields of :class:`crtn.data.spec.MqarSpec` read from ``cfg`` (an object, a dict, or
    None; missing or None fields: the defaults)."""
    defaults = MqarSpec()
    out = {}
    for f in fields(MqarSpec):
        default = getattr(defaults, f.name)
        value = cfg.get(f.name, default) if isinstance(cfg, dict) else getattr(cfg, f.name, default)
        out[f.name] = default if value is None else value
    return out


def slot_distances(c: dict[str, Any]) -> tuple[int, int]:
    """``(d_lo, d_hi)``: the slot distances from a write to its query that keep every gap inside
    ``[min_gap, max_gap]`` whatever the pairs' offsets (module docstring); slots."""
    S, J = c["slot_len"], c["slot_len"] - c["spacing"]
    return -(-(c["min_gap"] + J) // S), (c["max_gap"] - J) // S


def gap_buckets(min_gap: int, max_gap: int) -> list[tuple[int, int]]:
    """Gap buckets for the answer metrics, inclusive ``(lo, hi)`` in tokens: doublings of
    ``min_gap``, the last one closed at ``max_gap``; e.g. 1024, 8192 -> (1024, 2047),
    (2048, 4095), (4096, 8192)."""
    edges = [min_gap]
    while edges[-1] * 2 < max_gap:
        edges.append(edges[-1] * 2)
    return [(lo, hi - 1) for lo, hi in zip(edges, edges[1:])] + [(edges[-1], max_gap)]


def _validate(c: dict[str, Any]) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"data.mqar.{key}={c[key]} {why}")

    for key in ("n_keys", "n_values", "n_filler", "n_pairs", "train_tokens", "valid_tokens", "test_tokens"):
        if c[key] <= 0:
            raise bad(key, "must be > 0")
    if c["n_keys"] < 2 * c["n_pairs"]:
        raise bad(
            "n_keys",
            f"must be >= 2 * n_pairs = {2 * c['n_pairs']}: a document's keys are distinct and "
            "unused by the document before",
        )
    if c["spacing"] < 2:
        raise bad("spacing", "must be >= 2 (a pair is two tokens)")
    if c["slot_len"] < c["spacing"]:
        raise bad("slot_len", f"must be >= spacing={c['spacing']}")
    if c["gap_dist"] not in GAP_DISTS:
        raise ConfigError(f"data.mqar.gap_dist={c['gap_dist']!r} is not one of: {', '.join(GAP_DISTS)}")
    if c["train_loss"] not in TRAIN_LOSSES:
        raise ConfigError(
            f"data.mqar.train_loss={c['train_loss']!r} is not one of: {', '.join(TRAIN_LOSSES)}"
        )
    if c["min_gap"] < 1 or c["max_gap"] < c["min_gap"]:
        raise ConfigError(
            f"data.mqar.min_gap={c['min_gap']} and max_gap={c['max_gap']}: need 1 <= min_gap <= max_gap"
        )
    d_lo, d_hi = slot_distances(c)
    S, J = c["slot_len"], c["slot_len"] - c["spacing"]
    if d_lo > d_hi:
        raise ConfigError(
            f"data.mqar.min_gap={c['min_gap']} and max_gap={c['max_gap']}: no slot distance d keeps "
            f"every gap d*slot_len +- {J} (slot_len={S}, spacing={c['spacing']}) inside "
            "[min_gap, max_gap]; widen the range or shorten slot_len"
        )
    need = d_hi + 2 * c["n_pairs"] - 1
    if c["doc_len"] < need * S:
        raise ConfigError(
            f"data.mqar.doc_len={c['doc_len']} is too short for n_pairs={c['n_pairs']} pairs queried up to "
            f"max_gap={c['max_gap']} tokens later: needs at least {need * S} tokens ({need} slots of "
            f"slot_len={S})"
        )


def schedule(n_docs: int, c: dict[str, Any], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The slots of every document's writes and queries (module docstring, "Schedule").

    Returns:
        ``(write, query)``: ``int64 [n_docs, n_pairs]``, the slot of pair i's write and of its
        query; ``d_lo <= query - write <= d_hi``, and no slot holds two pairs.

    Visits the slots in order, vectorised over documents; the query slot is drawn among the free
    ones of the window by the Gumbel-max trick with log-weights 0 or -log d.
    """
    n_pairs, n_slots = c["n_pairs"], c["doc_len"] // c["slot_len"]
    d_lo, d_hi = slot_distances(c)
    d = np.arange(d_lo, d_hi + 1)
    log_w = -np.log(d) if c["gap_dist"] == "log_uniform" else np.zeros(len(d))
    taken = np.zeros((n_docs, n_slots + d_hi + 1), dtype=bool)
    taken[:, n_slots:] = True  # past the document's last slot: never free
    write = np.full((n_docs, n_pairs), -1, dtype=np.int64)
    query = np.full((n_docs, n_pairs), -1, dtype=np.int64)
    n_written = np.zeros(n_docs, dtype=np.int64)
    for j in range(n_slots):
        if (n_written == n_pairs).all():
            break
        free = ~taken[:, j + d_lo : j + d_hi + 1]  # [n_docs, window]
        score = np.where(free, log_w + rng.gumbel(size=free.shape), -np.inf)
        new = ~taken[:, j] & free.any(1) & (n_written < n_pairs)
        rows, i = np.nonzero(new)[0], n_written[new]
        q = j + d_lo + score[rows].argmax(1)
        write[rows, i], query[rows, i] = j, q
        taken[rows, q] = True
        n_written[rows] += 1
    # the schedule's guarantee under _validate's bound on doc_len
    assert (n_written == n_pairs).all(), "MQAR schedule: a document got fewer pairs than n_pairs"
    return write, query


def draw_keys(n_docs: int, n_pairs: int, n_keys: int, rng: np.random.Generator) -> np.ndarray:
    """``int64 [n_docs, n_pairs]`` key indices in ``[0, n_keys)``: distinct within a document, in
    random order, none of them among the previous document's (needs ``n_keys >= 2 n_pairs``)."""
    keys = np.empty((n_docs, n_pairs), dtype=np.int64)
    prev = np.zeros(0, dtype=np.int64)
    for doc in range(n_docs):
        score = rng.random(n_keys)
        score[prev] = 2.0  # above every draw: never among the n_pairs smallest
        keys[doc] = np.argsort(score, kind="stable")[:n_pairs]
        prev = keys[doc]
    return keys


def generate_split(c: dict[str, Any], n_tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One split: ``{"tokens": int64 [n_tokens], "gaps": int32 [n_tokens]}``.

    ``gaps`` is, at each answer token, the distance in tokens back to its stored value (the
    write's ``v``), and 0 elsewhere (module docstring).
    """
    K, V, F = c["n_keys"], c["n_values"], c["n_filler"]
    P, S, T = c["n_pairs"], c["slot_len"], c["doc_len"]
    n_docs = -(-n_tokens // (T + 1))
    write, query = schedule(n_docs, c, rng)
    jitter = S - c["spacing"]
    w_pos = write * S + rng.integers(0, jitter + 1, size=write.shape)  # key of the write
    q_pos = query * S + rng.integers(0, jitter + 1, size=query.shape)  # key of the query
    key = 1 + draw_keys(n_docs, P, K, rng)
    value = 1 + K + rng.integers(0, V, size=(n_docs, P))
    toks = np.empty((n_docs, T + 1), dtype=np.int64)
    toks[:, :T] = 1 + K + V + rng.integers(0, F, size=(n_docs, T))
    toks[:, T] = EOS_IDX
    rows = np.arange(n_docs)[:, None]
    for pos in (w_pos, q_pos):
        toks[rows, pos] = key
        toks[rows, pos + 1] = value
    gaps = np.zeros((n_docs, T + 1), dtype=np.int32)
    gaps[rows, q_pos + 1] = q_pos - w_pos
    return {"tokens": toks.reshape(-1)[:n_tokens], "gaps": gaps.reshape(-1)[:n_tokens]}


def _split_stats(g: dict[str, np.ndarray], buckets: list[tuple[int, int]]) -> dict[str, Any]:
    gaps = g["gaps"][g["gaps"] > 0]
    return {
        "tokens": len(g["tokens"]),
        "docs": int(np.count_nonzero(g["tokens"] == EOS_IDX)) + int(g["tokens"][-1] != EOS_IDX),
        "answers": len(gaps),
        "mean_gap": float(gaps.mean()) if len(gaps) else None,
        "answers_by_gap": {f"{lo}-{hi}": int(((gaps >= lo) & (gaps <= hi)).sum()) for lo, hi in buckets},
    }


def make_mqar(cfg: Any = None) -> Corpus:
    """Generate the multi-query associative recall corpus (module docstring; docs/method.md §4).

    Args:
        cfg: an object with the fields of :class:`crtn.data.spec.MqarSpec` (None: the defaults).

    Returns:
        A :class:`Corpus` named ``"mqar"`` (word level, metric ppl) with ``labels`` and
        ``repeat_gap`` (the same ``int32`` tensor per split: the gap at each answer token, 0
        elsewhere) and ``info``: ``vocab`` (id ranges of keys, values and filler, inclusive),
        ``chance_acc`` (1 / n_values) and ``chance_loss`` (ln n_values, nats), ``n_values``,
        ``gap_buckets`` (:func:`gap_buckets`), ``slot_distances``, ``doc_len`` (with its
        ``<eos>``), and per split (``info["splits"][name]``) token, document and answer counts,
        the mean gap and the answers per gap bucket; ``train_on_labels`` when ``train_loss`` is
        ``"answers"``.

    Raises:
        ConfigError: an invalid ``data.mqar.*`` value (named), or a ``doc_len`` too short for
            ``n_pairs`` pairs at gaps up to ``max_gap``.
    """
    c = mqar_settings(cfg)
    _validate(c)
    seeds = np.random.SeedSequence(int(c["seed"])).spawn(len(SPLITS))
    gen = {
        s: generate_split(c, int(c[f"{s}_tokens"]), np.random.default_rng(seeds[j]))
        for j, s in enumerate(SPLITS)
    }
    K, V, F = c["n_keys"], c["n_values"], c["n_filler"]
    symbols = [EOS] + [f"k{i}" for i in range(K)] + [f"v{i}" for i in range(V)] + [f"f{i}" for i in range(F)]
    splits = {s: torch.from_numpy(gen[s]["tokens"]) for s in SPLITS}
    gaps = {s: torch.from_numpy(gen[s]["gaps"]) for s in SPLITS}
    buckets = gap_buckets(c["min_gap"], c["max_gap"])
    info = {
        "vocab": {"keys": [1, K], "values": [K + 1, K + V], "filler": [K + V + 1, K + V + F]},
        "n_values": V,
        "chance_acc": 1.0 / V,
        "chance_loss": math.log(V),
        "gap_buckets": [list(b) for b in buckets],
        "slot_distances": list(slot_distances(c)),
        "doc_len": c["doc_len"] + 1,
        "tokens": {s: len(splits[s]) for s in SPLITS},
        "splits": {s: _split_stats(gen[s], buckets) for s in SPLITS},
        "config": dict(c),
    }
    return Corpus(
        name="mqar",
        vocab=Vocab(symbols, eos=EOS),
        level="word",
        metric=metric_name("word"),
        splits=splits,
        train_counts=torch.bincount(splits["train"], minlength=len(symbols)),
        labels=gaps,
        repeat_gap=gaps,
        info=info,
        train_on_labels=c["train_loss"] == "answers",
    )
