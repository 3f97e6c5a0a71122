"""tools/first_stage_recall.py: its window vectors against a naive n-gram match, its counts on
hand-computed cases, and a run over a trained checkpoint."""

from __future__ import annotations

import pytest
import torch

from crtn.model.rowmatch import ngram_row_scores
from crtn.train import train_in
from tests.helpers import TINY_RUN, compose_train, load_tool


def _naive(query, rows, lead, *, ngram, shift):
    """max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>, rows before the slot from ``lead``, by loops."""
    G, n, Ls, _ = rows.shape
    L = query.shape[1] - (ngram - 1)
    out = torch.empty(G, L, n, dtype=torch.float64)
    for g in range(G):
        for i in range(n):
            ext = rows[g, i] if lead is None else torch.cat([lead[g, i], rows[g, i]])
            nl = ext.shape[0] - Ls
            for j in range(L):
                sums = [
                    sum(float(query[g, ngram - 1 + j - a] @ ext[nl + r - shift - a]) for a in range(ngram))
                    for r in range(Ls)
                ]
                out[g, j, i] = max(sums) / ngram
    return out


@pytest.mark.parametrize(("ngram", "shift"), [(1, 0), (1, 1), (3, 0), (3, 1)])
def test_window_vectors_give_the_row_match(ngram, shift, monkeypatch):
    """max_r <Q_j, R_r> / w equals the naive loop and ngram_row_scores."""
    tool = load_tool("first_stage_recall", monkeypatch)  # a dataclass: registered
    g = torch.Generator().manual_seed(ngram * 10 + shift)
    G, n, Ls, d, L = 2, 3, 5, 4, 6
    query = torch.randn(G, ngram - 1 + L, d, generator=g, dtype=torch.float64)
    rows = torch.randn(G, n, Ls, d, generator=g, dtype=torch.float64)
    n_lead = ngram - 1 + shift
    lead = torch.randn(G, n, n_lead, d, generator=g, dtype=torch.float64) if n_lead else None
    Q, R = tool.window_vectors(query, rows, lead, ngram=ngram, shift=shift)
    assert Q.shape == (G, L, ngram * d) and R.shape == (G, n, Ls, ngram * d)
    got = torch.einsum("gld,gnrd->glnr", Q.double(), R.double()).amax(-1) / ngram
    want = _naive(query, rows, lead, ngram=ngram, shift=shift)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # Q, R are float32
    lib = ngram_row_scores(query, rows, lead, ngram=ngram, shift=shift)
    torch.testing.assert_close(lib, want, rtol=1e-12, atol=1e-12)


def test_counts_on_hand_computed_slots(monkeypatch):
    """Two one-row slots [3, 0] and [0, 1], query [1, 4]: the match picks slot 1 (4 against 3).
    The one-dim principal direction of the rows is e0 (norm 3 against 1), which ranks slot 0
    first: with c = 1 a miss of regret (4 - 3) / (4 - 3.5) = 2; with c = 2 a hit. Both dims
    of the basis keep every choice."""
    tool = load_tool("first_stage_recall", monkeypatch)  # a dataclass: registered
    Q = torch.tensor([[[1.0, 4.0]]])  # [G 1, L 1, D 2]
    R = torch.tensor([[[[3.0, 0.0]], [[0.0, 1.0]]]])  # [G 1, n 2, Ls 1, D 2]
    tally = tool.Tally(dims=(1, 2), tops=(1, 2), bases=("pca",))
    tally.add(Q, R)
    assert tally.queries == 1 and tally.calls == 1
    assert tally.hits["pca", 1, 1] == 0 and tally.regret["pca", 1, 1] == pytest.approx(2.0)
    assert tally.hits["pca", 1, 2] == 1 and tally.regret["pca", 1, 2] == 0.0
    assert tally.hits["pca", 2, 1] == 1 and tally.regret["pca", 2, 1] == pytest.approx(0.0, abs=1e-6)
    assert "| 1 | 0.0000 (2.000) | 1.0000 (0.000) |" in tally.table("pca")


def test_a_fitted_first_stage_finds_the_direction_that_ranks(monkeypatch):
    """Rows vary most along two directions that do not decide the match (std 5) and little along
    the one that does (std 1), which the queries point along: PCA's one-dim first stage ranks by
    noise (about 1/n of the best slots among its top 1), the fitted one learns the deciding
    direction and keeps most of them, on windows it was not fitted on."""
    tool = load_tool("first_stage_recall", monkeypatch)
    g = torch.Generator().manual_seed(0)
    G, L, n, Ls = 96, 4, 6, 3
    R = torch.randn(G, n, Ls, 3, generator=g) * torch.tensor([5.0, 5.0, 1.0])
    Q = torch.randn(G, L, 3, generator=g) * torch.tensor([0.01, 0.01, 1.0]) + torch.tensor([0.0, 0.0, 2.0])
    fit = tool.Tally(dims=(1,), tops=(1,), bases=("pca", "fitted"))
    for at in range(0, 64, 8):  # eight row matches of eight streams (FIT_STREAMS)
        fit.keep(Q[at : at + 8], R[at : at + 8])
    fit.fit()
    w_q, w_k = fit.fitted[1]
    assert w_q.shape == w_k.shape == (3, 1) and not fit.kept
    fit.add(Q[64:], R[64:])
    assert fit.queries == 32 * L
    assert fit.hits["fitted", 1, 1] / fit.queries > 0.8
    assert fit.hits["pca", 1, 1] / fit.queries < 0.5
    with pytest.raises(RuntimeError, match="not fitted"):
        tool.Tally(dims=(2,), tops=(1,), bases=("fitted",)).add(Q, R)


def test_a_run_over_a_checkpoint(tmp_path, monkeypatch):
    """Over a trained checkpoint: one row match per segment once the cache is full, every query
    counted, a basis of the windows' full dimension keeps every choice, a one-dim random sketch
    does not, a fitted one is fitted on the segments before the counted ones, and the row match
    is restored afterwards."""
    import crtn.model.summary as summary

    tool = load_tool("first_stage_recall", monkeypatch)  # a dataclass: registered
    run = tmp_path / "run"
    train_in(compose_train([*TINY_RUN, "query=token", "train.max_step=30", "train.eval_interval=30"]), run)
    D = 4 * 16  # summary.ngram 4 (the default) windows of d_model 16
    monkeypatch.setattr(tool, "FIT_STEPS", 20)
    tally = tool.Tally(dims=(1, D), tops=(1,), bases=("random", "pca", "fitted"))
    match = summary.ngram_row_scores
    tool.measure(
        str(run / "checkpoints/best.pt"), tally, n_slot=None, segments=(3, 5), split="valid", batch_size=4
    )
    assert summary.ngram_row_scores is match
    assert tally.calls == 5 and tally.queries == 5 * 4 * 8  # counted segments x streams x tgt_len
    assert set(tally.fitted) == {1, D} and not tally.kept
    assert tally.hits["pca", D, 1] == tally.queries
    assert tally.regret["pca", D, 1] == pytest.approx(0.0, abs=1e-3)
    assert tally.hits["random", 1, 1] < tally.queries


def test_an_unknown_first_stage_is_refused(monkeypatch):
    """A basis name outside BASES is an error, not silently a random projection."""
    tool = load_tool("first_stage_recall", monkeypatch)
    with pytest.raises(ValueError, match="basis sketch: each must be one of random, pca, fitted"):
        tool.Tally(dims=(1,), tops=(1,), bases=("sketch",))
