"""Tests of the synthetic passage-recall corpus (docs/method.md §4, crtn.data.synthetic)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from crtn.data import StreamIterator, load_corpus, make_synthetic
from crtn.data.spec import DataSpec, SyntheticSpec
from crtn.data.synthetic import copy_roots
from crtn.errors import ConfigError
from tests.helpers import TEST_SYNTHETIC

SMALL = {
    "vocab_size": 48,
    "branching": 6,
    "concentration": 0.5,
    "passage_len": 8,
    "doc_passages": 20,
    "p_repeat": 0.5,
    "min_gap": 20,  # gaps of 3..6 passages (24..48 tokens)
    "max_gap": 50,
    "train_tokens": 60_000,
    "valid_tokens": 5_000,
    "test_tokens": 4_321,
    "seed": 7,
    "repeat_skip": 2,
}


def small(**kw) -> SyntheticSpec:
    return SyntheticSpec(**{**SMALL, **kw})


@pytest.fixture(scope="module")
def corpus():
    return make_synthetic(small())


def documents(tokens: np.ndarray, labels: np.ndarray):
    """Split a stream at <eos> (id 0) into (tokens, labels) per document, the <eos> left out."""
    ends = np.flatnonzero(tokens == 0)
    start = 0
    for e in list(ends) + [len(tokens)]:
        if e > start:
            yield tokens[start:e], labels[start:e]
        start = e + 1


def dense(source) -> np.ndarray:
    """Independent dense transition matrix P[prev, next] from the sparse source."""
    V = source.vocab_size
    P = np.zeros((V, V))
    for s in range(V):
        for j in range(source.succ.shape[1]):
            P[s, source.succ[s, j]] += source.prob[s, j]
    return P


def test_shapes_types_and_sizes(corpus):
    c = corpus
    assert (c.name, c.level, c.metric) == ("synthetic", "word", "ppl")
    assert len(c.vocab) == 48 and c.vocab.eos_idx == 0 and c.vocab.unk_idx is None
    assert c.vocab.idx2sym[0] == "<eos>"
    assert {s: len(t) for s, t in c.splits.items()} == {"train": 60_000, "valid": 5_000, "test": 4_321}
    for s in c.splits:
        assert c.splits[s].dtype == torch.int64
        assert c.labels[s].dtype == torch.int16 and c.labels[s].shape == c.splits[s].shape
        assert c.source_nll[s].dtype == torch.float32 and c.source_nll[s].shape == c.splits[s].shape
        assert int(c.splits[s].min()) >= 0 and int(c.splits[s].max()) < 48
    doc_len = 20 * 8 + 1
    train = c.splits["train"].numpy()
    # an <eos> closes every document; the last one is truncated
    assert np.array_equal(np.flatnonzero(train == 0), np.arange(doc_len - 1, 60_000, doc_len))
    assert torch.equal(c.train_counts, torch.bincount(c.splits["train"], minlength=48))
    assert c.info["gap_passages"] == [3, 6] and c.info["doc_len"] == doc_len


@pytest.mark.parametrize("concentration", [0.5, 50.0])
def test_repeats_are_verbatim_copies_at_an_allowed_gap(concentration):
    cfg = small(concentration=concentration)
    corpus = make_synthetic(cfg)
    P = cfg.passage_len
    n_rep = n_eligible = 0
    for s in ("train", "valid", "test"):
        tokens, labels = corpus.splits[s].numpy(), corpus.labels[s].numpy()
        for toks, labs in documents(tokens, labels):
            n_pass = len(toks) // P
            for i in range(n_pass):
                seg, lab = toks[i * P : (i + 1) * P], labs[i * P : (i + 1) * P]
                # candidates: earlier passages whose start is min_gap..max_gap tokens back
                cands = [j for j in range(i) if cfg.min_gap <= (i - j) * P <= cfg.max_gap]
                n_eligible += bool(cands)
                if lab[0] == 0:
                    assert (lab == 0).all(), "a passage is either fresh or repeated as a whole"
                    # labels mark exactly the copies: no unlabelled passage equals an allowed source
                    # (with a near-uniform source an accidental 8-token match has odds ~ 8^-8; a peaky
                    # source, concentration 0.5, produces loops such as 40 40 40 ... by chance)
                    if concentration > 1:
                        assert not any(np.array_equal(seg, toks[j * P : (j + 1) * P]) for j in cands)
                else:
                    n_rep += 1
                    assert lab.tolist() == list(range(1, P + 1))
                    assert any(np.array_equal(seg, toks[j * P : (j + 1) * P]) for j in cands)
    # repeats happen with probability p_repeat among passages that have a candidate
    p = cfg.p_repeat
    assert abs(n_rep / n_eligible - p) < 4 * math.sqrt(p * (1 - p) / n_eligible)
    assert corpus.info["splits"]["train"]["repeated_tokens"] == int((corpus.labels["train"] > 0).sum())
    assert n_rep > 100
    # repeat_gap points every copied token at the token it copies, and is 0 elsewhere
    for s in ("train", "valid", "test"):
        tokens, labels, gaps = (x.numpy() for x in (corpus.splits[s], corpus.labels[s], corpus.repeat_gap[s]))
        rep = np.flatnonzero(labels > 0)
        assert (gaps[labels == 0] == 0).all()
        assert (
            (gaps[rep] >= cfg.min_gap).all()
            and (gaps[rep] <= cfg.max_gap).all()
            and (gaps[rep] % P == 0).all()
        )
        assert np.array_equal(tokens[rep], tokens[rep - gaps[rep]])


def test_source_nll_against_dense_matrix(corpus):
    src = corpus.source
    P = dense(src)
    assert np.allclose(P[1:].sum(axis=1), 1.0) and (P[0] == 0).all() and (P[:, 0] == 0).all()
    assert ((P[1:] > 0).sum(axis=1) == 6).all()  # exactly `branching` successors per symbol
    V = src.vocab_size
    for s in ("train", "valid"):
        tok = corpus.splits[s].numpy()
        lab = corpus.labels[s].numpy()
        nll = corpus.source_nll[s].numpy().astype(np.float64)
        prev = np.concatenate([[0], tok[:-1]])
        with np.errstate(divide="ignore"):
            expected = np.where(prev == 0, math.log(V - 1), -np.log(P[prev, tok]))
        eos = tok == 0
        assert np.isnan(nll[eos]).all() and not np.isnan(nll[~eos]).any()
        assert np.allclose(nll[~eos], expected[~eos], rtol=1e-6)
        # the source can produce every fresh token, and every repeated one but the first of a copy
        assert np.isfinite(nll[(lab != 1) & ~eos]).all()
        assert np.isinf(nll).sum() <= (lab == 1).sum()


def test_fresh_nll_matches_the_source_entropy(corpus):
    """Mean source NLL of fresh tokens = expected entropy of the source at those states (within noise)."""
    src = corpus.source
    P = dense(src)
    V = src.vocab_size
    with np.errstate(divide="ignore", invalid="ignore"):
        H = -np.where(P > 0, P * np.log(P), 0.0).sum(axis=1)
    tok = corpus.splits["train"].numpy()
    lab = corpus.labels["train"].numpy()
    nll = corpus.source_nll["train"].numpy().astype(np.float64)
    prev = np.concatenate([[0], tok[:-1]])
    fresh = (lab == 0) & (tok != 0)
    expected_h = np.where(prev == 0, math.log(V - 1), H[prev])[fresh]
    realised = nll[fresh]
    se = realised.std() / math.sqrt(fresh.sum())
    assert abs(realised.mean() - expected_h.mean()) < 4 * se
    stats = corpus.info["splits"]["train"]
    assert stats["fresh_tokens"] == int(fresh.sum())
    assert stats["fresh_entropy"] == pytest.approx(expected_h.mean(), rel=1e-9)
    assert stats["fresh_source_nll"] == pytest.approx(realised.mean(), rel=1e-6)
    # entropy rate from the stationary distribution (independently, by eigen-decomposition)
    w, vec = np.linalg.eig(P[1:, 1:].T)
    pi = np.real(vec[:, np.argmin(np.abs(w - 1))])
    pi = pi / pi.sum()
    rate = float(pi @ H[1:])
    assert corpus.info["markov_entropy"] == pytest.approx(rate, rel=1e-6)
    assert 0 < rate < math.log(6)  # at most log(branching); Dirichlet weights make it lower
    assert abs(realised.mean() - rate) < 0.1


def test_sampler_follows_the_transition_probabilities(corpus):
    src = corpus.source
    P = dense(src)
    tok = corpus.splits["train"].numpy()
    lab = corpus.labels["train"].numpy()
    prev = np.concatenate([[0], tok[:-1]])
    fresh = (lab == 0) & (tok != 0) & (prev != 0)
    for state in np.argsort(-np.bincount(prev[fresh], minlength=len(P)))[:3]:
        nxt = tok[fresh & (prev == state)]
        freq = np.bincount(nxt, minlength=len(P)) / len(nxt)
        sd = np.sqrt(P[state] * (1 - P[state]) / len(nxt))
        assert (np.abs(freq - P[state]) <= 5 * sd + 1e-12).all()
    starts = tok[np.concatenate([[0], np.flatnonzero(tok == 0) + 1])[:-1]]
    assert (starts != 0).all()


def test_determinism_and_seeds(corpus):
    again = make_synthetic(small())
    for s in corpus.splits:
        assert torch.equal(corpus.splits[s], again.splits[s])
        assert torch.equal(corpus.labels[s], again.labels[s])
        assert torch.equal(corpus.source_nll[s].isnan(), again.source_nll[s].isnan())
    other = make_synthetic(small(seed=8))
    assert not torch.equal(corpus.splits["train"], other.splits["train"])
    assert not np.array_equal(corpus.source.succ, other.source.succ)
    # valid/test differ from train but come from the same source
    n = len(corpus.splits["valid"])
    assert not torch.equal(corpus.splits["valid"], corpus.splits["train"][:n])
    assert not torch.equal(corpus.splits["valid"][: len(corpus.splits["test"])], corpus.splits["test"])
    # changing a split's size does not change the source
    bigger = make_synthetic(small(valid_tokens=6000))
    assert np.array_equal(bigger.source.succ, corpus.source.succ)
    assert torch.equal(bigger.splits["train"], corpus.splits["train"])


def test_no_repeats_when_p_is_zero():
    c = make_synthetic(small(p_repeat=0.0, train_tokens=5000))
    assert int(c.labels["train"].abs().sum()) == 0
    assert c.info["splits"]["train"]["repeat_fraction"] == 0.0


def test_default_config_through_load_corpus_is_fast():
    t0 = time.perf_counter()
    c = load_corpus(OmegaConf.structured(DataSpec(synthetic=SyntheticSpec(**TEST_SYNTHETIC))))
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"generating the default synthetic corpus took {elapsed:.1f} s"
    assert c.name == "synthetic" and len(c.splits["train"]) == 1_000_000 and len(c.vocab) == 128
    stats = c.info["splits"]["train"]
    # 54 of 64 passages have a candidate; half of them repeat
    assert stats["repeat_fraction"] == pytest.approx(0.5 * 54 / 64 * 1024 / 1025, abs=0.01)
    assert c.info["repeat_skip"] == 4
    it = StreamIterator(c.splits["valid"], 4, 64, labels=c.labels["valid"])
    b = it[3]
    assert torch.equal(b.label, c.labels["valid"].view(4, -1)[:, 3 * 64 + 1 : 4 * 64 + 1])
    it2 = c.iterator("valid", 4, 64)
    assert torch.equal(it2[3].label, b.label)


def test_unaligned_repeats_copy_from_any_token_at_every_distance():
    """aligned=false: each repeated passage is a verbatim copy of the P tokens that start g tokens
    before it in its own document, g over every integer in [max(min_gap, P), min(max_gap, i*P)]
    (not only multiples of P); the passages and labels are laid out as with aligned copies."""
    cfg = small(aligned=False)
    corpus = make_synthetic(cfg)
    P = cfg.passage_len
    seen, n_rep, n_eligible = set(), 0, 0
    for s in ("train", "valid", "test"):
        tokens, labels, gaps = (x.numpy() for x in (corpus.splits[s], corpus.labels[s], corpus.repeat_gap[s]))
        start = 0
        for toks, labs in documents(tokens, labels):
            g = gaps[start : start + len(toks)]
            for i in range(len(toks) // P):
                lab, gap = labs[i * P : (i + 1) * P], g[i * P : (i + 1) * P]
                n_eligible += max(cfg.min_gap, P) <= min(cfg.max_gap, i * P)
                if lab[0] == 0:
                    assert (lab == 0).all() and (gap == 0).all()
                    continue
                n_rep += 1
                assert lab.tolist() == list(range(1, P + 1)) and (gap == gap[0]).all()
                back = int(gap[0])
                assert max(cfg.min_gap, P) <= back <= min(cfg.max_gap, i * P)  # inside the document
                assert np.array_equal(toks[i * P : (i + 1) * P], toks[i * P - back : (i + 1) * P - back])
                seen.add(back)
            start += len(toks) + 1
    assert seen == set(range(max(cfg.min_gap, P), cfg.max_gap + 1))  # every distance occurs
    p = cfg.p_repeat
    assert abs(n_rep / n_eligible - p) < 4 * math.sqrt(p * (1 - p) / n_eligible)
    assert corpus.info["gap_tokens"] == [20, 50] and "gap_passages" not in corpus.info


@pytest.mark.parametrize(
    "override, key",
    [
        ({"branching": 48}, "branching"),
        ({"vocab_size": 2}, "vocab_size"),
        ({"concentration": 0.0}, "concentration"),
        ({"passage_len": 0}, "passage_len"),
        ({"p_repeat": 1.5}, "p_repeat"),
        ({"min_gap": 60, "max_gap": 50}, "min_gap"),
        ({"min_gap": 17, "max_gap": 23}, "min_gap, max_gap"),  # no multiple of 8 in [17, 23]
        ({"doc_passages": 3}, "doc_passages"),
        ({"aligned": False, "doc_passages": 3, "min_gap": 30}, "aligned"),  # 30 > 2 passages of 8
        ({"train_tokens": 0}, "train_tokens"),
    ],
)
def test_config_errors(override, key):
    with pytest.raises(ConfigError, match=key.split(",")[0]):
        make_synthetic(small(**override))


def test_copy_roots_follow_copies_of_copies_by_hand():
    """Token 3 copies 1; 4 copies 2; 6 copies 3 (itself a copy of 1) and 7 copies 4 (of 2):
    the roots are where each text was first drawn."""
    gap = torch.tensor([0, 0, 0, 2, 2, 0, 3, 3])
    assert copy_roots(gap).tolist() == [0, 1, 2, 1, 2, 5, 1, 2]


def test_copy_roots_agree_with_following_gaps_one_by_one(corpus):
    """On a generated split, against the chain followed token by token; the split has copies
    of copies, so the chain is followed more than one step."""
    gap = corpus.repeat_gap["valid"].long()
    roots, g = copy_roots(gap).tolist(), gap.tolist()
    for i in range(len(g)):
        p = i
        while g[p] > 0:
            p -= g[p]
        assert roots[i] == p
    assert sum(r != i for i, r in enumerate(roots)) > 0 and any(
        g[i - g[i]] > 0 for i in range(len(g)) if g[i] > 0
    )
