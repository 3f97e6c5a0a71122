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
value ``gap`` tokens back). :class:`AnswerSums` (the corpus' task, :class:`MqarTask`) reports loss and accuracy on
the answers by gap bucket (:func:`gap_buckets`). Training scores every token by default;
``train_loss="answers"`` makes the task's loss mask (:meth:`MqarTask.loss_mask`) the
answers, so that the training loss is the mean NLL of the answers only, as Zoology trains MQAR (the other tokens are unpredictable
by construction).

Determinism: :class:`numpy.random.SeedSequence` (``seed``) spawns one stream per split. Each
split has ``*_tokens`` tokens: whole documents, the last one truncated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from crtn.data.base import SPLITS, Corpus
from crtn.data.spec import MqarSpec, metric_name
from crtn.data.task import Task, scored_tokens, slots_hold
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
        the mean gap and the answers per gap bucket; ``task``: an :class:`MqarTask` that trains on the answers
        only when ``train_loss`` is ``"answers"``.

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
        task=MqarTask(answers_only=c["train_loss"] == "answers"),
    )


log = logging.getLogger(__name__)


# ================================================================== the task: answers
class MqarTask(Task):
    """MQAR's task (module docstring); ``answers_only``: ``data.mqar.train_loss=answers``."""

    keys = ("answers",)
    freq_buckets = False

    def __init__(self, answers_only: bool = False):
        self.answers_only = answers_only

    def loss_mask(
        self, label: torch.Tensor | None, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The answers (:func:`crtn.data.task.scored_tokens`) when ``answers_only``, else None."""
        return scored_tokens(label, device) if self.answers_only else None

    def selection_loss(self, metrics: dict[str, Any]) -> float | None:
        """``metrics["answers"]["loss"]`` when training scores the answers only (the other tokens
        are never trained), else ``metrics["loss"]`` (nats). None, with a warning, when training
        scores the answers and the validation held none of them (its first
        ``train.eval_max_step`` segments end before the first answer): ``best.pt`` stays as it is."""
        if not self.answers_only:
            return metrics["loss"]
        answers = metrics["answers"]
        if answers["tokens"] == 0:
            log.warning(
                "validation scored no answers (its first train.eval_max_step segments hold none, "
                "or only answers whose pair lies before the stream's start): best.pt is kept as it is"
            )
            return None
        return answers["loss"]

    def measure(self, corpus: Any, split: str, it: Any, device: torch.device | str) -> AnswerSums:
        return AnswerSums(corpus, device)

    @classmethod
    def format(cls, metrics: dict[str, Any]) -> list[str]:
        return format_answers(metrics)


#: ``(nll, correct, count)`` columns of :attr:`AnswerSums.sums`.
_NLL, _CORRECT, _COUNT = 0, 1, 2


class AnswerSums:
    """Sums over the answers of one pass over an MQAR split (module docstring).

    Args:
        corpus: the MQAR :class:`crtn.data.Corpus` (``labels``: gap at each answer, 0 elsewhere;
            ``info["gap_buckets"]``, ``info["n_values"]``).
        device: where the sums live (the model's device).

    Attributes:
        sums: ``float64 [n_buckets, 3]``: NLL (nats), correct predictions and count of the
            answers of each gap bucket.
        all_tokens: ``float64 [2]``: correct predictions and count over every target.
        where: ``float64 [5]``: answers whose stored value lay in the memory or the current
            segment, in a cached slot, in a slot the answer's token retrieved (with selection
            inside attention, at the top retrieving layer); answers counted; answers whose stored
            value lay in a slot that any retrieving layer retrieved for the answer's token.
        cut: answers whose stored value lies before their stream's start.
        layered: whether more than one retrieving layer selected its own slots (selection inside
            attention), so that the any-layer count differs in kind from the top layer's.
    """

    def __init__(self, corpus: Any, device: torch.device | str):
        buckets = corpus.info["gap_buckets"]
        self.bucket_names = [f"{lo}-{hi}" for lo, hi in buckets]
        self.inner_edges = torch.tensor([lo for lo, _ in buckets[1:]], dtype=torch.long, device=device)
        self.n_values = int(corpus.info["n_values"])
        self.sums = torch.zeros(len(buckets), 3, dtype=torch.float64, device=device)
        self.all_tokens = torch.zeros(2, dtype=torch.float64, device=device)
        self.where = torch.zeros(5, dtype=torch.float64, device=device)
        self.cut = torch.zeros((), dtype=torch.float64, device=device)
        self.has_cache = False
        self.layered = False

    def add(self, model: Any, batch: Any, out: Any, state: Any) -> None:
        """Add one segment: ``batch`` (a :class:`crtn.data.Batch` with labels), the model's output
        ``out`` (``nll`` [B, L'], ``hidden``, ``selection``, ``layer_selections``) and the state
        after it (its cache as read during this step)."""
        pred = model.crit.log_prob(out.hidden).argmax(-1)
        t0 = batch.index * model.tgt_len
        answer, src = self.update(batch.label, batch.target, out.nll, pred=pred, t0=t0)
        self.has_cache = self.has_cache or bool(getattr(model, "has_cache", False))
        cache = getattr(state, "cache", None)
        self.locate(
            answer,
            src,
            t0,
            mem_len=model.mem_len,
            cache=cache,
            selection=out.selection,
            layer_selections=out.layer_selections,
        )

    def update(
        self, label: torch.Tensor, target: torch.Tensor, nll: torch.Tensor, pred: torch.Tensor, t0: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the losses and predictions of one segment.

        Args:
            label: ``[B, L']`` gap of each target token (0: not an answer).
            target, pred: ``[B, L']`` token ids: the targets and the model's argmax predictions.
            nll: ``[B, L']`` NLL of the targets, nats.
            t0: stream position of the segment's first input token (``index * tgt_len``).

        Returns:
            ``(answer, src)``: ``[B, L']`` bool, the answers counted (stored value inside the
            stream), and the stream position of each target's stored value (``t0 + j + 1 - gap``).
        """
        correct = (pred == target).double()
        self.all_tokens[0] += correct.sum()
        self.all_tokens[1] += correct.numel()
        gap = label.long()
        src = t0 + 1 + torch.arange(gap.shape[1], device=gap.device)[None, :] - gap
        answer = (gap > 0) & (src >= 0)
        self.cut += ((gap > 0) & (src < 0)).sum()
        bucket = torch.bucketize(gap[answer], self.inner_edges, right=True)
        rows = torch.stack([nll[answer].double(), correct[answer], torch.ones_like(correct[answer])], 1)
        self.sums.index_add_(0, bucket, rows)
        return answer, src

    def locate(
        self,
        answer: torch.Tensor,
        src: torch.Tensor,
        t0: int,
        *,
        mem_len: int,
        cache: Any,
        selection: Any,
        layer_selections: tuple[Any, ...] = (),
    ) -> None:
        """Count where the stored values of the ``answer`` targets lay (positions ``src``, [B, L']):
        within the memory or the current segment (``src >= t0 - min(mem_len, t0)``), in a valid
        slot of ``cache`` (a :class:`crtn.model.cache.SegmentCache` or None: ``pos``,
        ``n_valid``, ``seg_len``), in one of the slots ``selection`` retrieved for that target
        (``age`` [B, L', k] in tokens; None: none retrieved; with selection inside attention the
        top retrieving layer's), and in one of the slots any of ``layer_selections`` retrieved
        (each retrieving layer's selection, bottom first, ``age`` [B, L', k]; empty: only
        ``selection``'s)."""
        in_memory = src >= t0 - min(mem_len, t0)
        zero = torch.zeros((), dtype=torch.long, device=src.device)
        cached, hit, any_hit = zero, zero, zero
        self.layered |= len(layer_selections) > 1
        if cache is not None and cache.n_valid > 0:
            seg = cache.seg_len
            slot_pos = cache.pos[:, : cache.n_valid][:, None, :]  # [B, 1, n_valid]
            cached = (slots_hold(slot_pos, seg, src) & answer).sum()
            if selection is not None:
                # selection is the top retrieving layer's, the last of layer_selections if any
                held = torch.stack(
                    [slots_hold(s.starts(t0), seg, src) for s in layer_selections or (selection,)]
                )
                hit, any_hit = (held[-1] & answer).sum(), (held.any(0) & answer).sum()
        counts = [(in_memory & answer).sum(), cached, hit, answer.sum(), any_hit]
        self.where += torch.stack(counts).double()

    def metrics(self, corpus: Any = None, split: str | None = None) -> dict[str, Any]:
        """``{"acc": accuracy on all tokens, "answers": {...}}``: the answers' ``tokens``, ``loss``
        (nats), ``ppl``, ``acc``, ``chance_acc`` (1 / n_values), ``chance_loss`` (ln n_values),
        ``cut``, ``by_gap`` (per bucket ``tokens``, ``loss``, ``acc``), ``pair_in_memory``, and
        for a model with a cache ``pair_in_cache`` and ``pair_retrieved`` (fractions of the
        answers; see :meth:`locate`; ``pair_retrieved`` reads the top retrieving layer's slots),
        and where more than one layer retrieved (selection inside attention)
        ``pair_retrieved_any_layer`` (the stored value in a slot of any retrieving layer).
        ``corpus`` and ``split`` are unused (the signature of
        :meth:`crtn.data.task.Task.measure`'s sums)."""
        correct, count = self.all_tokens.tolist()
        result: dict[str, Any] = {"acc": correct / count if count else None}
        nll, right, n = self.sums.sum(0).tolist()
        entry: dict[str, Any] = {"tokens": int(n)}
        if n > 0:
            entry.update(loss=nll / n, ppl=math.exp(min(nll / n, 700.0)), acc=right / n)
        entry.update(chance_acc=1.0 / self.n_values, chance_loss=math.log(self.n_values), cut=int(self.cut))
        entry["by_gap"] = {}
        for name, (b_nll, b_right, b_n) in zip(self.bucket_names, self.sums.tolist()):
            e: dict[str, Any] = {"tokens": int(b_n)}
            if b_n > 0:
                e.update(loss=b_nll / b_n, acc=b_right / b_n)
            entry["by_gap"][name] = e
        mem, cached, hit, located, any_hit = self.where.tolist()
        if located > 0:
            entry["pair_in_memory"] = mem / located
            if self.has_cache:
                entry.update(pair_in_cache=cached / located, pair_retrieved=hit / located)
            if self.has_cache and self.layered:
                entry["pair_retrieved_any_layer"] = any_hit / located
        result["answers"] = entry
        return result


def format_answers(m: dict[str, Any]) -> list[str]:
    """Parts of :func:`crtn.evaluate.format_metrics`'s line for the MQAR metrics of ``m`` (none
    without them): ``acc 0.412 | answers ppl 3.10 acc 0.650 (chance 0.002; by gap 1024-2047
    0.700, ...), pair retrieved 0.91`` (the top retrieving layer's), then ``; by any layer
    0.95`` where ``pair_retrieved_any_layer`` is reported."""
    a = m.get("answers")
    if not a or "acc" not in a:
        return []
    gaps = ", ".join(f"{k} {e['acc']:.3f}" for k, e in a["by_gap"].items() if "acc" in e)
    where = f", pair retrieved {a['pair_retrieved']:.2f}" if "pair_retrieved" in a else ""
    if "pair_retrieved_any_layer" in a:
        where += f"; by any layer {a['pair_retrieved_any_layer']:.2f}"
    return [
        f"acc {m['acc']:.3f}",
        f"answers ppl {a['ppl']:.2f} acc {a['acc']:.3f} (chance {a['chance_acc']:.3f}; by gap {gaps}){where}",
    ]
