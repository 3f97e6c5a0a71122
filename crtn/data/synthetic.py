"""The synthetic passage-recall corpus (docs/method.md §4), generated from a seed.

Symbols: 0 is ``<eos>``, the document separator appended after each document;
1..V-1 (``V = vocab_size``) belong to a random sparse first-order Markov source:
each symbol has ``branching`` distinct successors drawn uniformly from 1..V-1,
with probabilities drawn from Dirichlet(``concentration``); a document's first
token is drawn from the uniform start distribution over 1..V-1.

A document is ``doc_passages`` passages of P = ``passage_len`` tokens. Passage
i (starting at token i*P of its document) is, with probability ``p_repeat`` and
if some earlier passage j of the document starts between ``min_gap`` and
``max_gap`` tokens before it (``min_gap <= (i-j)*P <= max_gap``), a verbatim copy
of one such passage chosen uniformly; otherwise its tokens are drawn from the
Markov source, continuing from the previous token. With ``aligned`` false the
copy may start at any earlier token of the document instead: the P tokens that
start g tokens before passage i, g uniform over the integers in
[max(min_gap, P), min(max_gap, i*P)] (at least P, so that the source lies before
the copy), and copy distances are no longer multiples of P. Labels: 0 for a
fresh token or ``<eos>``, k (1-based) for the k-th token of a repeated passage.

Determinism: :class:`numpy.random.SeedSequence` (``seed``) spawns one stream
for the source and one per split, so valid and test differ from train but share
its source. Each split has ``*_tokens`` tokens (the last document is truncated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from crtn.data.base import SPLITS, Corpus
from crtn.data.spec import SyntheticSpec, metric_name
from crtn.data.task import Task, slots_hold
from crtn.data.vocab import EOS, Vocab
from crtn.errors import ConfigError

EOS_IDX = 0


@dataclass
class MarkovSource:
    """The generating source over symbols 1..V-1 (row 0, ``<eos>``, is unused).

    Attributes:
        succ: ``int64 [V, b]``: the successors of each symbol.
        prob: ``float64 [V, b]``: their probabilities (rows sum to 1; row 0 is 0).
        start: ``float64 [V]``: distribution of a document's first token (0 at ``<eos>``).
    """

    succ: np.ndarray
    prob: np.ndarray
    start: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.start)

    def entropy(self) -> np.ndarray:
        """``float64 [V]``: entropy in nats of the next token given each symbol (0 for row 0)."""
        p = self.prob
        return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)

    def start_entropy(self) -> float:
        """Entropy in nats of the first token of a document."""
        p = self.start[self.start > 0]
        return float(-(p * np.log(p)).sum())

    def stationary(self, iters: int = 2000, tol: float = 1e-13) -> np.ndarray:
        """``float64 [V]``: stationary distribution (Cesaro-averaged power iteration from the start distribution)."""
        V = self.vocab_size
        pi = self.start.copy()
        avg = np.zeros(V)
        flat_succ = self.succ.reshape(-1)
        for k in range(1, iters + 1):
            nxt = np.bincount(flat_succ, weights=(pi[:, None] * self.prob).reshape(-1), minlength=V)
            avg += (nxt - avg) / k
            if np.abs(nxt - pi).sum() < tol:
                return nxt
            pi = nxt
        return avg

    def entropy_rate(self) -> float:
        """Entropy rate of the chain in nats per token: sum_s pi(s) H(s)."""
        return float(self.stationary() @ self.entropy())

    def nll(self, prev: np.ndarray, token: np.ndarray) -> np.ndarray:
        """``-log P(token | prev)`` (float64, inf where the probability is 0); ``prev`` < 0 means a document start."""
        prev = np.asarray(prev)
        token = np.asarray(token)
        out = np.empty(prev.shape, dtype=np.float64)
        start = prev < 0
        with np.errstate(divide="ignore"):
            out[start] = -np.log(self.start[token[start]])
            p, t = prev[~start], token[~start]
            hit = self.succ[p] == t[:, None]
            out[~start] = -np.log((self.prob[p] * hit).sum(axis=1))
        return out


def _settings(cfg: Any) -> dict[str, Any]:
    """The fields of :class:`crtn.data.spec.SyntheticSpec` read from ``cfg`` (None or missing: defaults)."""
    out = {}
    for f in fields(SyntheticSpec):
        default = getattr(SyntheticSpec(), f.name)
        if cfg is None:
            value = default
        elif isinstance(cfg, dict):
            value = cfg.get(f.name, default)
        else:
            value = getattr(cfg, f.name, default)
        out[f.name] = default if value is None else value
    return out


def _validate(c: dict) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"data.synthetic.{key}={c[key]} {why}")

    if c["vocab_size"] < 3:
        raise bad("vocab_size", "must be >= 3 (<eos> and at least 2 source symbols)")
    if not 1 <= c["branching"] <= c["vocab_size"] - 1:
        raise bad("branching", f"must be in [1, vocab_size-1={c['vocab_size'] - 1}]")
    if not c["concentration"] > 0:
        raise bad("concentration", "must be > 0")
    for key in ("passage_len", "doc_passages", "train_tokens", "valid_tokens", "test_tokens"):
        if c[key] <= 0:
            raise bad(key, "must be > 0")
    if not 0.0 <= c["p_repeat"] <= 1.0:
        raise bad("p_repeat", "must be in [0, 1]")
    if c["min_gap"] < 1 or c["max_gap"] < c["min_gap"]:
        raise ConfigError(
            f"data.synthetic.min_gap={c['min_gap']} and max_gap={c['max_gap']}: need 1 <= min_gap <= max_gap"
        )
    if c["repeat_skip"] < 0:
        raise bad("repeat_skip", "must be >= 0")
    if not c["aligned"]:
        lo = max(c["min_gap"], c["passage_len"])
        if c["p_repeat"] > 0 and lo > min(c["max_gap"], (c["doc_passages"] - 1) * c["passage_len"]):
            raise ConfigError(
                f"data.synthetic.aligned=false: no copy distance in [max(min_gap, passage_len), max_gap] = "
                f"[{lo}, {c['max_gap']}] fits in a document of doc_passages={c['doc_passages']} x "
                f"passage_len={c['passage_len']}, so no passage can be repeated"
            )
        return
    lo, hi = math.ceil(c["min_gap"] / c["passage_len"]), c["max_gap"] // c["passage_len"]
    if c["p_repeat"] > 0 and lo > hi:
        raise ConfigError(
            f"data.synthetic: no multiple of passage_len={c['passage_len']} lies in [min_gap, max_gap] = "
            f"[{c['min_gap']}, {c['max_gap']}], so no passage can be repeated"
        )
    if c["p_repeat"] > 0 and lo > c["doc_passages"] - 1:
        raise ConfigError(
            f"data.synthetic.doc_passages={c['doc_passages']} x passage_len={c['passage_len']}: documents are too "
            f"short for a repeat from min_gap={c['min_gap']} tokens back"
        )


def make_source(
    vocab_size: int, branching: int, concentration: float, rng: np.random.Generator
) -> MarkovSource:
    """Draw the sparse Markov source (module docstring) from ``rng``."""
    n = vocab_size - 1
    succ = np.zeros((vocab_size, branching), dtype=np.int64)
    prob = np.zeros((vocab_size, branching), dtype=np.float64)
    # b distinct successors per symbol, drawn uniformly without replacement
    for s in range(1, vocab_size):
        succ[s] = 1 + rng.choice(n, size=branching, replace=False)
    prob[1:] = rng.dirichlet(np.full(branching, float(concentration)), size=n)
    start = np.full(vocab_size, 1.0 / n)
    start[EOS_IDX] = 0.0
    return MarkovSource(succ, prob, start)


def generate_split(
    c: dict, source: MarkovSource, n_tokens: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One split: ``{"tokens": int64 [n_tokens], "labels": int16, "gaps": int32, "nll": float64, "entropy": float64}``.

    ``gaps`` is, for every token of a copied passage, the distance in tokens back to the
    token it copies (0 for fresh tokens and ``<eos>``).

    ``entropy`` is the entropy (nats) of the source's prediction at each token
    (that of the start distribution at a document start; nan at ``<eos>``).
    """
    P, D = c["passage_len"], c["doc_passages"]
    V = source.vocab_size
    doc_len = D * P + 1
    n_docs = -(-n_tokens // doc_len)
    # repeat decisions and sources, vectorised: passage i copies the P tokens starting `back`
    # tokens before it, back = d*P with d in [lo, min(hi, i)] passages (aligned), or any
    # back in [lo, min(hi, i*P)] tokens
    i = np.arange(D)
    if c["aligned"]:
        lo, hi, unit = math.ceil(c["min_gap"] / P), c["max_gap"] // P, P
        n_cand = np.clip(np.minimum(hi, i) - lo + 1, 0, None)
    else:
        lo, hi, unit = max(c["min_gap"], P), c["max_gap"], 1
        n_cand = np.clip(np.minimum(hi, i * P) - lo + 1, 0, None)
    rep = (rng.random((n_docs, D)) < c["p_repeat"]) & (n_cand > 0)[None, :]
    back = unit * (lo + np.floor(rng.random((n_docs, D)) * n_cand[None, :]).astype(np.int64))
    src = np.where(rep, i[None, :] * P - back, -1)  # first token of each copied passage's source
    u = rng.random((n_docs, D * P))

    cum = np.cumsum(source.prob, axis=1)
    cum[:, -1] = 1.0
    toks = np.zeros((n_docs, D * P), dtype=np.int64)
    rows = np.arange(n_docs)
    for p in range(D):
        copy = rep[:, p]
        src_col = np.maximum(src[:, p], 0)
        for k in range(P):
            col = p * P + k
            if col == 0:
                fresh = 1 + np.minimum((u[:, 0] * (V - 1)).astype(np.int64), V - 2)
            else:
                prev = toks[:, col - 1]
                choice = (cum[prev] <= u[:, col, None]).sum(axis=1)
                fresh = source.succ[prev, np.minimum(choice, source.succ.shape[1] - 1)]
            toks[:, col] = np.where(copy, toks[rows, src_col + k], fresh)

    labels = np.where(rep[:, :, None], np.arange(1, P + 1)[None, None, :], 0).reshape(n_docs, D * P)
    gaps = np.repeat(np.where(rep, back, 0), P, axis=1)  # tokens back to the copied token
    prev = np.concatenate([np.full((n_docs, 1), -1), toks[:, :-1]], axis=1)
    nll = source.nll(prev.reshape(-1), toks.reshape(-1)).reshape(n_docs, D * P)
    ent_state = source.entropy()
    entropy = np.where(prev < 0, source.start_entropy(), ent_state[np.maximum(prev, 0)])

    def with_eos(a: np.ndarray, fill: Any, dtype: Any) -> np.ndarray:
        out = np.empty((n_docs, doc_len), dtype=dtype)
        out[:, :-1] = a
        out[:, -1] = fill
        return out.reshape(-1)[:n_tokens]

    return {
        "tokens": with_eos(toks, EOS_IDX, np.int64),
        "labels": with_eos(labels, 0, np.int16),
        "gaps": with_eos(gaps, 0, np.int32),
        "nll": with_eos(nll, np.nan, np.float64),
        "entropy": with_eos(entropy, np.nan, np.float64),
    }


def _split_stats(g: dict[str, np.ndarray], repeat_skip: int) -> dict[str, Any]:
    tok, lab = g["tokens"], g["labels"]
    fresh = (lab == 0) & (tok != EOS_IDX)
    scored = lab > repeat_skip

    def mean(x: np.ndarray) -> float:
        return float(x.mean()) if len(x) else float("nan")

    return {
        "tokens": len(tok),
        "docs": int(np.count_nonzero(tok == EOS_IDX)) + int(tok[-1] != EOS_IDX),
        "fresh_tokens": int(fresh.sum()),
        "repeated_tokens": int((lab > 0).sum()),
        "repeat_fraction": float((lab > 0).mean()),
        "fresh_entropy": mean(g["entropy"][fresh]),
        "fresh_source_nll": mean(g["nll"][fresh]),
        "scored_repeat_tokens": int(scored.sum()),
        "scored_repeat_source_nll": mean(g["nll"][scored]),
    }


def make_synthetic(cfg: Any = None) -> Corpus:
    """Generate the passage-recall corpus (module docstring; docs/method.md §4).

    Args:
        cfg: an object with the fields of :class:`crtn.data.spec.SyntheticSpec`
            (None: the defaults).

    Returns:
        A :class:`Corpus` named ``"synthetic"`` with ``labels`` (int16),
        ``source_nll`` (float32 nats; nan at ``<eos>``, inf at the first token of
        a repeat when the source cannot produce it there), ``source`` (the
        :class:`MarkovSource`) and ``info``: ``markov_entropy`` (entropy rate of
        the source, nats/token), ``start_entropy``, ``gap_passages`` (the allowed
        copy distances in passages; with ``aligned`` false ``gap_tokens``, in tokens),
        ``doc_len``, ``repeat_skip``, and per split
        (``info["splits"][name]``) token, document and repeat counts,
        ``fresh_entropy`` (expected source NLL of the fresh tokens, nats),
        ``fresh_source_nll`` (realised mean), ``repeat_fraction``.

    Raises:
        ConfigError: an invalid ``data.synthetic.*`` value (named).
    """
    c = _settings(cfg)
    _validate(c)
    seeds = np.random.SeedSequence(int(c["seed"])).spawn(1 + len(SPLITS))
    source = make_source(c["vocab_size"], c["branching"], c["concentration"], np.random.default_rng(seeds[0]))
    gen = {
        s: generate_split(c, source, int(c[f"{s}_tokens"]), np.random.default_rng(seeds[1 + j]))
        for j, s in enumerate(SPLITS)
    }
    V = c["vocab_size"]
    vocab = Vocab([EOS] + [f"s{i}" for i in range(1, V)], eos=EOS)
    splits = {s: torch.from_numpy(gen[s]["tokens"]) for s in SPLITS}
    P = c["passage_len"]
    info = {
        "markov_entropy": source.entropy_rate(),
        "start_entropy": source.start_entropy(),
        "uniform_entropy": math.log(V - 1),
        **(
            {"gap_passages": [math.ceil(c["min_gap"] / P), c["max_gap"] // P]}
            if c["aligned"]
            else {"gap_tokens": [max(c["min_gap"], P), c["max_gap"]]}
        ),
        "doc_len": c["doc_passages"] * P + 1,
        "repeat_skip": int(c["repeat_skip"]),
        "tokens": {s: len(splits[s]) for s in SPLITS},
        "splits": {s: _split_stats(gen[s], int(c["repeat_skip"])) for s in SPLITS},
        "config": dict(c),
    }
    return Corpus(
        name="synthetic",
        vocab=vocab,
        level="word",
        metric=metric_name("word"),
        splits=splits,
        train_counts=torch.bincount(splits["train"], minlength=V),
        labels={s: torch.from_numpy(gen[s]["labels"]) for s in SPLITS},
        repeat_gap={s: torch.from_numpy(gen[s]["gaps"]) for s in SPLITS},
        source_nll={s: torch.from_numpy(gen[s]["nll"].astype(np.float32)) for s in SPLITS},
        info=info,
        source=source,
        task=RecallTask(),
    )


def copy_roots(gap: torch.Tensor) -> torch.Tensor:
    """The original of every token of a synthetic split: ``gap`` [n] (copy distance of each
    token, 0 for a token not copied; docs/method.md §4) -> [n] index of the token that its text was
    first drawn at, following copies of copies back (i - gap[i], and so on). Two tokens
    hold the same copied text exactly when their roots are equal."""
    idx = torch.arange(gap.numel(), device=gap.device)
    root = torch.where(gap > 0, (idx - gap.long()).clamp(min=0), idx)
    while True:  # pointer jumping: each pass doubles the copy chain followed
        nxt = root[root]
        if torch.equal(nxt, root):
            return root
        root = nxt


# ================================================================== the task: passage recall
class RecallTask(Task):
    """The passage-recall corpus' task: its evaluation keeps :class:`RecallSums`."""

    keys = ("repeat", "fresh")
    freq_buckets = False

    def measure(self, corpus: Any, split: str, it: Any, device: torch.device | str) -> RecallSums:
        return RecallSums(corpus, split, it, device)

    @classmethod
    def format(cls, metrics: dict[str, Any]) -> list[str]:
        """``repeat ppl 1.10 acc 0.970, source ppl 1.05, retrieved 0.91 (or a copy 0.95) | fresh ...``."""
        parts = []
        for k in cls.keys:
            e = metrics.get(k)
            if e and "ppl" in e:
                src = f", source ppl {e['source_ppl']:.2f}" if "source_ppl" in e else ""
                hit = f", retrieved {e['source_retrieved']:.2f}" if "source_retrieved" in e else ""
                if "copy_retrieved" in e:
                    hit += f" (or a copy {e['copy_retrieved']:.2f})"
                if "source_retrieved_any_layer" in e:
                    hit += f"; by any layer {e['source_retrieved_any_layer']:.2f}"
                    hit += f" (or a copy {e['copy_retrieved_any_layer']:.2f})"
                parts.append(f"{k} ppl {e['ppl']:.2f} acc {e['acc']:.3f}{src}{hit}")
        return parts


class RecallSums:
    """Passage-recall sums over a split of the synthetic corpus (docs/method.md §4): NLL, correct predictions
    and count on ``repeat`` and ``fresh`` tokens, and where the copied source of repeat tokens lay."""

    def __init__(self, corpus: Any, split: str, it: Any, device: torch.device | str):
        self.eos = corpus.vocab.eos_idx
        self.sums = {k: torch.zeros(3, dtype=torch.float64, device=device) for k in ("repeat", "fresh")}
        self.skip = corpus.info.get("repeat_skip", 0)
        self.gap_all = None if corpus.repeat_gap is None else corpus.repeat_gap[split].to(device)
        self.root_all = None if self.gap_all is None else copy_roots(self.gap_all)
        self.row_base = torch.arange(it.local_batch_size, device=device)[:, None] * it.stream_len
        # repeat tokens: source in memory, cached, retrieved; all; a copy retrieved; the source and
        # a copy retrieved by any retrieving layer (selection inside attention)
        self.where = torch.zeros(7, dtype=torch.float64, device=device)
        self.layered = False  # whether the retrieving layers selected apart

    def add(self, model: Any, batch: Any, out: Any, state: Any) -> None:
        label = batch.label
        correct = (model.crit.log_prob(out.hidden).argmax(-1) == batch.target).double()
        masks = {"repeat": label > self.skip, "fresh": (label == 0) & (batch.target != self.eos)}
        for k, m in masks.items():
            m = m.double()
            self.sums[k] += torch.stack([(out.nll.double() * m).sum(), (correct * m).sum(), m.sum()])
        if self.gap_all is not None:
            self.where += source_location(
                out,
                state,
                batch,
                gap_all=self.gap_all,
                root_all=self.root_all,
                row_base=self.row_base,
                repeat=masks["repeat"],
                model=model,
            )
            self.layered |= len(out.layer_selections) > 1

    def metrics(self, corpus: Any, split: str) -> dict[str, Any]:
        """``{"repeat": {...}, "fresh": {...}}``: tokens, loss, ppl, acc, the source's ppl, where the source lay."""
        src = corpus.source_nll[split] if corpus.source_nll is not None else None
        labels_all = corpus.labels[split].long()
        target_all = corpus.splits[split]
        result: dict[str, Any] = {}
        for k in ("repeat", "fresh"):
            s_nll, s_acc, n = self.sums[k].tolist()
            entry: dict[str, Any] = {"tokens": int(n)}
            if n > 0:
                entry.update(loss=s_nll / n, ppl=math.exp(min(s_nll / n, 700.0)), acc=s_acc / n)
            if src is not None:
                m = labels_all > self.skip if k == "repeat" else (labels_all == 0) & (target_all != self.eos)
                m = m & torch.isfinite(src)
                if m.any():
                    entry["source_ppl"] = math.exp(src[m].double().mean().item())
            result[k] = entry
        if self.gap_all is not None and self.where[3] > 0:
            mem, cached, hit, n, chain, any_hit, any_chain = self.where.tolist()
            result["repeat"]["source_in_memory"] = mem / n
            result["repeat"]["source_in_cache"] = cached / n
            result["repeat"]["source_retrieved"] = hit / n
            result["repeat"]["copy_retrieved"] = chain / n
            if self.layered:
                result["repeat"]["source_retrieved_any_layer"] = any_hit / n
                result["repeat"]["copy_retrieved_any_layer"] = any_chain / n
        return result


def source_location(
    out: Any,
    state: Any,
    batch: Any,
    gap_all: torch.Tensor,
    root_all: torch.Tensor,
    row_base: torch.Tensor,
    repeat: torch.Tensor,
    model: Any,
) -> torch.Tensor:
    """Where the token that each repeated target copies lies, for the passage-recall corpus.

    Returns [7] counts over ``repeat`` targets: source within the memory or current
    segment (reachable without retrieval), source in a cached slot, source in one of the
    token's retrieved slots, all repeat targets, and targets for which a retrieved slot
    holds *the same text*: the source or any other copy of the same original passage
    (the source's own source, or another copy made from it; ``root_all``, see
    :func:`copy_roots`). A passage copied more than once appears several times in a
    large cache, and any occurrence lets the model copy. Positions are per-stream (docs/method.md §4).
    The retrieved slots are ``out.selection``'s (with selection inside attention, the top
    retrieving layer's); the last two counts are the source and the same text in the slots of
    any retrieving layer (``out.layer_selections``; the same as the top one's without them).
    """
    L = batch.input.shape[1]
    t0 = batch.index * model.tgt_len
    j = torch.arange(L, device=repeat.device)
    gap = gap_all[row_base + t0 + j + 1].long()  # [B, L] gap of each target token
    src = (t0 + j + 1)[None, :] - gap  # stream position of the copied token
    in_memory = src >= t0 - min(model.mem_len, t0)  # memory as read during this step
    counts = [(in_memory & repeat).sum()]
    cache = state.cache
    zero = torch.zeros((), device=repeat.device, dtype=torch.long)
    if cache is not None and cache.n_valid > 0 and out.selection is not None:
        seg = cache.seg_len
        valid_pos = cache.pos[:, : cache.n_valid][:, None, :]  # [B, 1, n_valid]
        # the cache as it was read during this step: renewal is committed at the next step
        cached = slots_hold(valid_pos, seg, src)
        where = {"src": src, "seg": seg, "root_all": root_all, "row_base": row_base}
        # out.selection is the top retrieving layer's, the last of out.layer_selections if any
        layers = [_held(s.starts(t0), **where) for s in out.layer_selections or [out.selection]]
        hit, same = layers[-1]
        any_hit = torch.stack([h for h, _ in layers]).any(0)
        any_same = torch.stack([m for _, m in layers]).any(0)
        counts += [(cached & repeat & ~in_memory).sum(), (hit & repeat).sum()]
        chain, extra = (same & repeat).sum(), [(any_hit & repeat).sum(), (any_same & repeat).sum()]
    else:
        counts += [zero] * 2
        chain, extra = zero, [zero] * 2
    counts += [repeat.sum(), chain, *extra]
    return torch.stack(counts).double()


def _held(
    pos: torch.Tensor, *, src: torch.Tensor, seg: int, root_all: torch.Tensor, row_base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the slots starting at stream positions ``pos`` [B, L, k] hold each target's source
    ``src`` [B, L] (the hit), and whether a row of theirs holds the same text (the source's copy
    root, :func:`copy_roots`): two [B, L] bool. A position below 0 is no slot (a token that
    retrieved nothing: :meth:`crtn.model.cache.Selection.starts`) and holds nothing."""
    hit = slots_hold(pos, seg, src)
    flat_src = row_base + src  # [B, L]; < 0 only before the first stream's start
    want = root_all[flat_src.clamp(min=0)]
    rows = (row_base[..., None, None] + pos[..., None] + torch.arange(seg, device=pos.device)).clamp(
        min=0, max=root_all.numel() - 1
    )  # [B, L, k, seg] split index of each row of the selected slots
    # a direct hit is one of these: the source row has the source's root
    held = (root_all[rows] == want[..., None, None]) & (pos >= 0)[..., None]
    same = held.flatten(-2).any(-1) & (flat_src >= 0)
    return hit, same
