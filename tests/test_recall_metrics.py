"""The passage-recall metrics of evaluate() (crtn/evaluate.py: source_in_memory, source_in_cache,
source_retrieved, copy_retrieved) recomputed token by token from their definitions.

A tiny corpus is written by hand: two streams of random tokens in which the repeated tokens copy
from positions chosen on the boundaries of what a step can read (the memory's first row, the row
just before it, the first row of the newest and of the oldest cached slot, the row just evicted,
the segment's first row, the previous token). A plain Python loop follows the memory (the last
mem_len positions) and the FIFO cache (slot start positions) by their definitions, takes each
token's selected slots from the naive reference (tests/reference.py NaiveCRTN), and counts.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from crtn.data.base import Corpus
from crtn.data.synthetic import RecallTask
from crtn.data.vocab import Vocab
from crtn.evaluate import evaluate
from tests.helpers import LOOKUP as LOOKUP_MODEL
from tests.helpers import tiny_model
from tests.reference import NaiveCRTN

V, B, L, N_SEG, N_SLOT = 11, 2, 3, 12, 3
KINDS = (
    "memory_first",  # the memory's first row: readable without retrieval
    "newest_slot_last",  # the row just before the memory: the newest slot's last row
    "newest_slot_first",
    "oldest_slot_first",  # the oldest valid slot's first row
    "evicted_last",  # the last row of the slot evicted when this step's cache was committed
    "segment_first",
    "previous",  # the input token itself (gap 1)
    "fresh",
)


def _source(kind: str, p: int, mem_len: int) -> int | None:
    """The stream position target ``p`` copies for ``kind``, or None (not a copy)."""
    t0 = L * ((p - 1) // L)  # first input position of the step that predicts p
    M = min(mem_len, t0)  # memory rows during that step
    src = {
        "memory_first": t0 - M if M > 0 else None,
        "newest_slot_last": t0 - M - 1,
        "newest_slot_first": t0 - M - L,
        "oldest_slot_first": t0 - M - N_SLOT * L,
        "evicted_last": t0 - M - N_SLOT * L - 1,
        "segment_first": t0,
        "previous": p - 1,
        "fresh": None,
    }[kind]
    return src if src is not None and src >= 0 else None


def _corpus(mem_len: int) -> tuple[Corpus, dict[int, str]]:
    """Two streams of 1 + N_SEG L tokens; returns the corpus and the kind of each copied flat index.
    Every seventh copy has label 1, which repeat_skip=1 leaves out of the repeat tokens."""
    n = 1 + N_SEG * L
    tokens = torch.randint(1, V, (B * n,))
    gaps = torch.zeros(B * n, dtype=torch.int32)
    labels = torch.zeros(B * n, dtype=torch.int16)
    kinds = {}
    for b in range(B):
        for p in range(1, n):
            kind = KINDS[(p + b) % len(KINDS)]
            src = _source(kind, p, mem_len)
            if src is None:
                continue
            gaps[b * n + p] = p - src
            labels[b * n + p] = 1 if len(kinds) % 7 == 6 else 2
            tokens[b * n + p] = tokens[b * n + src]
            kinds[b * n + p] = kind
    vocab = Vocab(["<eos>"] + [f"s{i}" for i in range(1, V)], eos="<eos>")
    corpus = Corpus(
        name="synthetic",
        vocab=vocab,
        level="word",
        metric="ppl",
        splits={"valid": tokens},
        train_counts=torch.bincount(tokens, minlength=V),
        labels={"valid": labels},
        repeat_gap={"valid": gaps},
        info={"repeat_skip": 1},
        task=RecallTask(),
    )
    return corpus, kinds


def _root(gaps: list[int], i: int) -> int:
    """The flat index whose text token i copies, following copies of copies."""
    while gaps[i] > 0:
        i -= gaps[i]
    return i


#: the lookup of the preceding tokens, whose tokens without a match retrieve nothing
LOOKUP = {**LOOKUP_MODEL, "summary.ngram": 1, "query.max_match": 3}


@pytest.mark.parametrize("options", [{}, LOOKUP], ids=["default", "lookup"])
@pytest.mark.parametrize("mem_len", [3, 6])
def test_recall_metrics_match_a_token_by_token_count(mem_len, options):
    torch.manual_seed(0)
    model = tiny_model(
        V, **{"model.name": "crtn", "model.mem_len": mem_len, "cache.n_slot": N_SLOT, **options}
    )
    corpus, kinds = _corpus(mem_len)
    got = evaluate(model, corpus, "valid", batch_size=B, device="cpu")["repeat"]

    n = 1 + N_SEG * L
    tokens, gaps = corpus.splits["valid"], corpus.repeat_gap["valid"].tolist()
    labels = corpus.labels["valid"].tolist()
    counts = dict.fromkeys(("memory", "cache", "retrieved", "copy", "repeat"), 0)
    by_kind = {k: dict.fromkeys(("memory", "cache", "retrieved", "n"), 0) for k in KINDS}
    for b in range(B):
        ref = NaiveCRTN(model)
        mem_lo = 0  # first stream position held by the memory (mem_lo = t0: empty)
        slots: deque[int] = deque(maxlen=N_SLOT)  # start positions of the cached segments, FIFO
        for t in range(N_SEG):
            t0 = t * L
            x = tokens[b * n + t0 : b * n + t0 + L]
            y = tokens[b * n + t0 + 1 : b * n + t0 + L + 1]
            with torch.no_grad():
                _, selected = ref.step(x, y, t0)
            for j in range(L):
                i = b * n + t0 + j + 1  # flat index of the target
                if labels[i] <= 1:  # fresh, or a copy's first token (repeat_skip=1)
                    continue
                src = t0 + j + 1 - gaps[i]
                in_memory = src >= mem_lo  # memory, or the current segment
                in_cache = any(s <= src < s + L for s in slots)
                retrieved = any(s <= src < s + L for s, _ in selected[j])
                want = _root(gaps, b * n + src)
                copy = any(_root(gaps, b * n + s + r) == want for s, _ in selected[j] for r in range(L))
                counts["repeat"] += 1
                counts["memory"] += in_memory
                counts["cache"] += in_cache and not in_memory
                counts["retrieved"] += retrieved
                counts["copy"] += copy
                k = by_kind[kinds[i]]
                k["n"] += 1
                k["memory"] += in_memory
                k["cache"] += in_cache
                k["retrieved"] += retrieved
            # renewal: the positions that leave the memory (mem_len of [memory; segment]) form a slot
            new_lo = max(0, t0 + L - mem_len)
            if new_lo > mem_lo:
                assert new_lo - mem_lo == L
                slots.append(mem_lo)
            mem_lo = new_lo if mem_len > 0 else t0 + L

    # the corpus puts sources where intended: each boundary on its side
    assert by_kind["memory_first"]["memory"] == by_kind["memory_first"]["n"] > 0
    for kind in ("newest_slot_last", "newest_slot_first", "oldest_slot_first"):
        k = by_kind[kind]
        assert k["cache"] == k["n"] > 0 and k["memory"] == 0, kind
    k = by_kind["evicted_last"]
    assert k["n"] > 0 and k["memory"] == k["cache"] == k["retrieved"] == 0
    if not options:
        assert 0 < by_kind["oldest_slot_first"]["retrieved"] < by_kind["oldest_slot_first"]["n"]
        assert 0 < counts["retrieved"] < counts["copy"]  # other copies of the text found too
    else:  # some sources retrieved, some cached sources not (no match: nothing retrieved)
        cached = sum(
            by_kind[k]["cache"] for k in ("newest_slot_last", "newest_slot_first", "oldest_slot_first")
        )
        assert 0 < counts["retrieved"] < cached

    n_rep = counts["repeat"]
    assert got["tokens"] == n_rep
    assert got["source_in_memory"] == pytest.approx(counts["memory"] / n_rep, abs=1e-12)
    assert got["source_in_cache"] == pytest.approx(counts["cache"] / n_rep, abs=1e-12)
    assert got["source_retrieved"] == pytest.approx(counts["retrieved"] / n_rep, abs=1e-12)
    assert got["copy_retrieved"] == pytest.approx(counts["copy"] / n_rep, abs=1e-12)


def test_any_layer_metrics_count_the_slots_of_every_retrieving_layer():
    """With selection inside attention each retrieving layer selects its own slots, and
    ``source_retrieved`` reads the top layer's. ``source_retrieved_any_layer`` and
    ``copy_retrieved_any_layer`` count a repeat token when the slots of any layer hold its source
    (or the same text): recomputed here token by token from each layer's selection in a
    step-by-step run of each stream alone, where the top layer's count is ``source_retrieved``
    again. The corpus is built so that the layers disagree somewhere (the any-layer count exceeds
    the top layer's)."""
    torch.manual_seed(0)
    mem_len = 3
    options = {"query.strategy": "gate", "cache.layers": None, "cache.top_k": 1}
    model = tiny_model(
        V, **{"model.name": "crtn", "model.mem_len": mem_len, "cache.n_slot": N_SLOT, **options}
    )
    corpus, _ = _corpus(mem_len)
    got = evaluate(model, corpus, "valid", batch_size=B, device="cpu")["repeat"]

    n = 1 + N_SEG * L
    tokens, gaps = corpus.splits["valid"], corpus.repeat_gap["valid"].tolist()
    labels = corpus.labels["valid"].tolist()
    counts = dict.fromkeys(("top", "any", "any_copy", "repeat"), 0)
    for b in range(B):
        state = None
        for t in range(N_SEG):
            t0 = t * L
            x = tokens[b * n + t0 : b * n + t0 + L][None]
            y = tokens[b * n + t0 + 1 : b * n + t0 + L + 1][None]
            with torch.no_grad():
                out = model(x, y, state)
            state = out.state
            starts = [(t0 - s.age[0]).tolist() for s in out.layer_selections]  # per layer: [L][k]
            for j in range(L):
                i = b * n + t0 + j + 1
                if labels[i] <= 1:
                    continue
                src = t0 + j + 1 - gaps[i]
                want = _root(gaps, b * n + src)
                held = [any(s <= src < s + L for s in layer[j]) for layer in starts]
                copy = [
                    any(_root(gaps, b * n + s + r) == want for s in layer[j] if s >= 0 for r in range(L))
                    for layer in starts
                ]
                counts["repeat"] += 1
                counts["top"] += bool(held and held[-1])
                counts["any"] += any(held)
                counts["any_copy"] += any(copy)
    n_rep = counts["repeat"]
    assert got["tokens"] == n_rep
    assert got["source_retrieved"] == pytest.approx(counts["top"] / n_rep, abs=1e-12)
    assert got["source_retrieved_any_layer"] == pytest.approx(counts["any"] / n_rep, abs=1e-12)
    assert got["copy_retrieved_any_layer"] == pytest.approx(counts["any_copy"] / n_rep, abs=1e-12)
    assert counts["top"] < counts["any"]  # the layers disagree: the count is not the top layer's
