"""Three behaviours pinned at their edges: a key layer of 0 (the embeddings, not "unset"), MQAR's
answers by gap bucket at every bucket edge, and the distance buckets of an evaluation whose
streams are split across processes (docs/method.md §3, §4 and §5)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from crtn.analysis.distance import DistanceBuckets
from crtn.data import make_synthetic
from crtn.data.mqar import AnswerSums, _split_stats, gap_buckets, make_mqar
from tests.helpers import tiny_model
from tests.test_mqar import TINY_MQAR

V = 11
#: the key layer under test, written here (the test never reads it back from a resolved spec)
KEY_LAYER = 0


@pytest.mark.parametrize("summary", ["mean", "token_max"])
def test_key_layer_zero_keys_are_summaries_of_the_embeddings(summary):
    """With ``cache.key_layer=0`` every cached key is the summary of its segment's embeddings
    (layer 0, ``word_emb`` of the segment's tokens), not of the top layer (what an unset key layer
    gives): mean keys are stored, token_max's are the rows of the key layer themselves."""
    overrides = {
        "model.name": "crtn",
        "model.n_layer": 2,
        "cache.key_layer": KEY_LAYER,
        "summary.name": summary,
    }
    if summary == "mean":
        overrides["query.strategy"] = "middle_l"
    model = tiny_model(V, **overrides)
    L = model.tgt_len
    tokens = torch.randint(0, V, (2, 7 * L))
    state = None
    with torch.no_grad():
        for t in range(0, tokens.shape[1], L):
            state = model(tokens[:, t : t + L], None, state).state
    cache = state.cache
    cache.commit()
    keys = cache.valid_keys()  # [B, n_valid, d] (mean) or [B, n_valid, L, d] (token_max)
    assert cache.n_valid == model.n_slot
    for b in range(tokens.shape[0]):
        for slot in range(cache.n_valid):
            pos = int(cache.pos[b, slot])
            emb = model.word_emb(tokens[b, pos : pos + L][None])[0]  # [L, d]: layer 0
            top = cache.layer_values(model.n_layer)[b, slot]
            want, unset = (emb.mean(0), top.mean(0)) if summary == "mean" else (emb, top)
            torch.testing.assert_close(keys[b, slot], want, rtol=0, atol=1e-12)
            assert not torch.allclose(keys[b, slot], unset)


def test_answers_by_gap_at_every_bucket_edge():
    """Both countings of MQAR answers by gap (the corpus statistics of crtn/data/mqar.py and the
    evaluation sums of crtn/data/mqar.py) put a gap equal to a bucket's low or high edge in that
    bucket, and their buckets sum to the number of answers."""
    buckets = gap_buckets(20, 100)
    assert buckets == [(20, 39), (40, 79), (80, 100)]
    edges = [g for lo, hi in buckets for g in (lo, hi)]  # 20 39 40 79 80 100
    gaps = np.array([0, *edges, 0, 30, 0], dtype=np.int32)  # 0: not an answer
    want = {"20-39": 3, "40-79": 2, "80-100": 2}
    stats = _split_stats({"tokens": np.ones(len(gaps), dtype=np.int64), "gaps": gaps}, buckets)
    assert stats["answers_by_gap"] == want
    assert sum(stats["answers_by_gap"].values()) == stats["answers"] == 7

    sums = AnswerSums(SimpleNamespace(name="mqar", info={"gap_buckets": buckets, "n_values": 4}), "cpu")
    label = torch.from_numpy(gaps)[None]
    nll = torch.arange(len(gaps), dtype=torch.float64)[None]  # the loss names the position
    answer, _ = sums.update(
        label, torch.zeros_like(label).long(), nll, torch.zeros_like(label).long(), t0=200
    )
    assert int(answer.sum()) == 7
    by_gap = sums.metrics()["answers"]["by_gap"]
    assert {k: e["tokens"] for k, e in by_gap.items()} == want
    # positions 1, 2, 8 (gaps 20, 39, 30); 3, 4 (40, 79); 5, 6 (80, 100)
    assert [e["loss"] for e in by_gap.values()] == pytest.approx([11 / 3, 3.5, 5.5])


def test_answers_by_gap_of_a_generated_corpus_sum_to_its_answers():
    info = make_mqar(TINY_MQAR).info
    for split, s in info["splits"].items():
        assert s["answers"] > 0, split
        assert sum(s["answers_by_gap"].values()) == s["answers"], split


@pytest.mark.parametrize("world_size", [2, 4])
def test_distance_buckets_of_streams_split_across_ranks_sum_to_the_unsplit_ones(world_size):
    """Evaluation is not split across processes today (rank 0 evaluates every stream), but
    :class:`DistanceBuckets` takes a rank's rows of the streams: the sums of every rank, each fed
    its rows of the per-token losses, add up to the sums of one process fed them all."""
    corpus = make_synthetic({"train_tokens": 2000, "valid_tokens": 900, "test_tokens": 500})
    B, L = 8, 5
    whole = corpus.iterator("valid", B, L)
    lengths = [batch.target.shape[1] for batch in whole.iterate(0)]  # the last may be shorter
    nll = torch.rand(B, sum(lengths), dtype=torch.float64)
    one = DistanceBuckets(corpus, "valid", whole, "cpu")
    ranks = [
        DistanceBuckets(corpus, "valid", corpus.iterator("valid", B, L, rank=r, world_size=world_size), "cpu")
        for r in range(world_size)
    ]
    rows = B // world_size
    for index, n in enumerate(lengths):
        cols = slice(index * L, index * L + n)
        one.add(index, nll[:, cols])
        for r, part in enumerate(ranks):
            part.add(index, nll[r * rows : (r + 1) * rows, cols])
    merged = sum(part.sums for part in ranks)
    torch.testing.assert_close(merged, one.sums, rtol=0, atol=1e-9)
    assert one.sums[1, : one.sums.shape[1] // 2].sum() > 0
    # and a rank's codes are its own rows, not the first rows again
    assert not all(torch.equal(part.symbol, ranks[0].symbol) for part in ranks[1:])
