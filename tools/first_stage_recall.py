#!/usr/bin/env python
"""Whether a first stage on projected rows would keep the row match's choice of slot.

    python tools/first_stage_recall.py CHECKPOINT [--n-slot N] [--segments S] [--basis random,pca,fitted]
        [--dims 16,32,64,128] [--top 1,2,4,8] [--fit-segments F] [--split valid] [--batch-size 16]

``token_max``'s row match (docs/method.md §3, "Summaries"; :func:`crtn.model.rowmatch.ngram_row_scores`)
scores slot i for query j as max_r (1/w) <Q_j, R_r>, where Q_j is the concatenation of the w
queries q_j, q_{j-1}, ... and R_r that of the w rows row_{r-s}, row_{r-s-1}, ... of the slot and
its lead-in (:func:`window_vectors`). It reads all N Ls rows of d values for every query, which
is why the step grows with N. A two-stage selection would rank the slots by a cheaper score
first, max_r <P^T Q_j, P^T R_r> with a projection P [w d, d'], then score the top c of them exactly
and select among those: it selects what the row match selects wherever the row match's best slot
is among the first stage's c (a *hit*). Its first stage multiplies d'-dim window vectors,
d' / d of the row match's products (no window sums), so it pays only where d' is well below d.

The tool runs the checkpoint over a split as ``crtn-eval`` does (``--batch-size`` streams,
memory and cache carried over, the cache at ``--n-slot`` slots, by default the trained number),
and at every row match of the query pass, once the cache is full, counts for each projection and
c the hits and the *regret*: (best - chosen) / (best - mean), the exact score the two-stage
selection would choose against the best and the mean over the slots (0 where it chooses the
best; 1 where it chooses a slot no better than the mean). Bases (``--basis``):

- ``random``: P Gaussian, entries N(0, 1/d') (a Johnson-Lindenstrauss sketch), fixed per run;
- ``pca``: the top d' right singular vectors of the call's own row windows (up to 8,192 of them),
  the best linear map of these rows by reconstruction, fitted on the very rows it ranks: an
  optimistic bound for a fixed linear first stage, not a first stage a model could run;
- ``fitted``: a first stage that learns to rank, max_r <W_q^T Q_j, W_k^T R_r> with W_q, W_k
  [w d, d'] fitted (:func:`fit_ranker`) to the row match's best slot on the windows of the
  ``--fit-segments`` segments before the counted ones (up to :data:`FIT_STREAMS` streams each):
  a linear indexer trained towards the score it stands in for, as DeepSeek Sparse Attention's is
  trained towards its attention, here offline and measured on later text.

A ``fitted`` first stage keeps the windows of its fitting segments in memory, 4 FIT_STREAMS N Ls
w d bytes a segment (67 MB at N = 32, Ls 64, w d = 1,024); fitting d' = 32, 64 and 128 took
minutes at N = 32 and about 45 minutes at N = 128 on one thread: give it fewer
``--fit-segments`` there.

Prints one table per basis (docs/results.md, "A first stage on projected rows").

Raises SystemExit with one line when the checkpoint's retrieval makes no row match through a
query strategy (Transformer-XL, ``query=gate``, a summary other than ``token_max``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

#: the first stages the tool measures (``--basis``)
BASES = ("random", "pca", "fitted")
#: the most row windows a ``pca`` basis is fitted on per call
PCA_ROWS = 8192
#: streams of each fitting segment whose windows a ``fitted`` first stage is fitted on
FIT_STREAMS = 8
#: Adam steps of :func:`fit_ranker`, each on 8 stream-segments, and their learning rate
FIT_STEPS, FIT_LR = 800, 3e-3


def window_vectors(
    query: Tensor, rows: Tensor, lead: Tensor | None, *, ngram: int, shift: int
) -> tuple[Tensor, Tensor]:
    """The n-gram windows that :func:`crtn.model.rowmatch.ngram_row_scores` matches, as vectors.

    Args:
        query: [G, w-1+L, d] the L queries with the w-1 before them (w = ``ngram``).
        rows: [G, n, Ls, d] the rows of n slots.
        lead: [G, n, w-1+s, d] the rows before each slot (s = ``shift``), or None when w-1+s = 0.

    Returns:
        (Q [G, L, w d], R [G, n, Ls, w d]) in float32, Q_j = [q_j; q_{j-1}; ...; q_{j-w+1}] and
        R_r = [row_{r-s}; ...; row_{r-s-w+1}] (rows before the slot from ``lead``), so that the
        row match is max_r <Q_j, R_r> / w.
    """
    G, n, Ls, d = rows.shape
    ext = rows.float() if lead is None else torch.cat([lead.float(), rows.float()], 2)
    n_lead = ext.shape[2] - Ls
    a = torch.arange(ngram)
    at = n_lead - shift + torch.arange(Ls)[:, None] - a  # [Ls, w]
    L = query.shape[1] - (ngram - 1)
    qa = ngram - 1 + torch.arange(L)[:, None] - a  # [L, w]
    return query.float()[:, qa].reshape(G, L, ngram * d), ext[:, :, at].reshape(G, n, Ls, ngram * d)


def pca_basis(R: Tensor, dim: int, generator: torch.Generator) -> Tensor:
    """[D, dim] the top ``dim`` right singular vectors of up to :data:`PCA_ROWS` of the row
    windows R [..., D] (sampled with ``generator``)."""
    flat = R.reshape(-1, R.shape[-1])
    pick = torch.randperm(flat.shape[0], generator=generator)[:PCA_ROWS]
    return torch.linalg.svd(flat[pick], full_matrices=False).Vh[:dim].T


def fit_ranker(Q: Tensor, R: Tensor, dim: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A first stage that learns to rank: W_q, W_k [D, dim] such that max_r <W_q^T Q_j, W_k^T R_r>
    ranks first the slot the row match max_r <Q_j, R_r> ranks first.

    Both start as :func:`pca_basis` of R; :data:`FIT_STEPS` Adam steps (:data:`FIT_LR`) on 8
    stream-segments each minimise the cross-entropy of the softmax over slots of the first
    stage's scores (times a learned scale) against the row match's best slot.

    Args:
        Q: [G, L, D] query windows of G stream-segments (:func:`window_vectors`).
        R: [G, n, Ls, D] their row windows.
        dim: d'.
        generator: draws the PCA sample and each step's stream-segments.

    Returns:
        (W_q, W_k), each [D, dim], without gradient.
    """
    best = torch.einsum("gld,gnrd->glnr", Q, R).amax(-1).argmax(-1)  # [G, L]
    start = pca_basis(R, dim, generator)
    w_q, w_k = start.clone().requires_grad_(), start.clone().requires_grad_()
    log_scale = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([w_q, w_k, log_scale], lr=FIT_LR)
    with torch.enable_grad():
        for _ in range(FIT_STEPS):
            at = torch.randint(0, Q.shape[0], (min(8, Q.shape[0]),), generator=generator)
            first = torch.einsum("gld,gnrd->glnr", Q[at] @ w_q, R[at] @ w_k).amax(-1)  # [g, L, n]
            loss = F.cross_entropy((first * log_scale.exp()).flatten(0, 1), best[at].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w_q.detach(), w_k.detach()


@dataclass
class Tally:
    """Hits and regrets of every (basis, d', c) over the calls seen."""

    dims: tuple[int, ...]
    tops: tuple[int, ...]
    bases: tuple[str, ...]
    seed: int = 0
    hits: dict[tuple[str, int, int], int] = field(default_factory=dict)
    regret: dict[tuple[str, int, int], float] = field(default_factory=dict)
    queries: int = 0
    calls: int = 0

    def __post_init__(self) -> None:
        """Raises:
        ValueError: a basis other than :data:`BASES`."""
        if not set(self.bases) <= set(BASES):
            raise ValueError(
                f"first_stage_recall: basis {','.join(self.bases)}: each must be one of {', '.join(BASES)}"
            )
        self.generator = torch.Generator().manual_seed(self.seed)
        self.random: dict[tuple[int, int], Tensor] = {}
        self.fitted: dict[int, tuple[Tensor, Tensor]] = {}
        self.kept: list[tuple[Tensor, Tensor]] = []

    def basis(self, name: str, dim: int, R: Tensor) -> tuple[Tensor, Tensor]:
        """The maps ([D, dim] of the queries, [D, dim] of the rows) of first stage ``name`` for row
        windows R [..., D].

        Raises:
            RuntimeError: ``fitted`` before :meth:`fit`."""
        D = R.shape[-1]
        if name == "fitted":
            if dim not in self.fitted:
                raise RuntimeError(
                    f"first_stage_recall: the fitted first stage of d'={dim} is not fitted yet"
                )
            return self.fitted[dim]
        if name == "pca":
            p = pca_basis(R, dim, self.generator)
            return p, p
        if (D, dim) not in self.random:
            self.random[D, dim] = torch.randn(D, dim, generator=self.generator) / math.sqrt(dim)
        return self.random[D, dim], self.random[D, dim]

    def keep(self, Q: Tensor, R: Tensor) -> None:
        """Keep the windows of up to :data:`FIT_STREAMS` streams of one row match (Q [G, L, D],
        R [G, n, Ls, D]) for :meth:`fit`, where a ``fitted`` first stage is asked for."""
        if "fitted" in self.bases:
            self.kept.append((Q[:FIT_STREAMS], R[:FIT_STREAMS]))

    def fit(self) -> None:
        """Fit the ``fitted`` first stage of every d' on the kept windows (:func:`fit_ranker`; the
        row matches of the most common slot count n), then drop them."""
        if not self.kept:
            return
        n = max(r.shape[1] for _, r in self.kept)
        kept = [(q, r) for q, r in self.kept if r.shape[1] == n]
        Q, R = torch.cat([q for q, _ in kept]), torch.cat([r for _, r in kept])
        self.fitted = {dim: fit_ranker(Q, R, dim, self.generator) for dim in self.dims}
        self.kept = []

    def add(self, Q: Tensor, R: Tensor) -> None:
        """Count one row match: queries Q [G, L, D] against the row windows R [G, n, Ls, D] of
        their streams (each basis fitted once per call)."""
        P = {(name, dim): self.basis(name, dim, R) for name in self.bases for dim in self.dims}
        for g in range(Q.shape[0]):
            full = torch.einsum("ld,nrd->lnr", Q[g], R[g]).amax(-1)  # [L, n]
            best, mean = full.amax(-1), full.mean(-1)
            spread = (best - mean).clamp_min(torch.finfo(full.dtype).tiny)
            self.queries += Q.shape[1]
            for (name, dim), (p_q, p_k) in P.items():
                first = torch.einsum("ld,nrd->lnr", Q[g] @ p_q, R[g] @ p_k).amax(-1)  # [L, n]
                for c in self.tops:
                    chosen = full.gather(-1, first.topk(min(c, full.shape[-1]), -1).indices).amax(-1)
                    key = (name, dim, c)
                    self.hits[key] = self.hits.get(key, 0) + int((chosen == best).sum())
                    self.regret[key] = self.regret.get(key, 0.0) + float(((best - chosen) / spread).sum())
        self.calls += 1

    def table(self, name: str) -> str:
        """A markdown table of basis ``name``: hit rate (mean regret) by d' and c."""
        head = "| d' | " + " | ".join(f"top {c}" for c in self.tops) + " |"
        lines = [head, "|---:|" + "---:|" * len(self.tops)]
        for dim in self.dims:
            cells = (
                f"{self.hits[name, dim, c] / self.queries:.4f} ({self.regret[name, dim, c] / self.queries:.3f})"
                for c in self.tops
            )
            lines.append(f"| {dim} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


@contextlib.contextmanager
def watching(tally: Tally, phase: list[str | None]) -> Iterator[None]:
    """Inside, every row match of the query pass (``crtn.model.summary``'s ``ngram_row_scores``)
    is kept for fitting (:meth:`Tally.keep`) while ``phase[0]`` is ``"fit"`` and counted
    (:meth:`Tally.add`) while it is ``"count"``; its result is unchanged. Restored on exit."""
    import crtn.model.summary as summary
    from crtn.model.rowmatch import LeadIn

    match = summary.ngram_row_scores

    def counted(query: Tensor, rows: Tensor, lead: Tensor | LeadIn | None, **kw: object) -> object:
        out = match(query, rows, lead, **kw)
        if phase[0] is not None:
            if isinstance(lead, LeadIn):
                lead = lead.rows(rows)
            if kw.get("cosine"):  # the caller normalised the queries; the rows are scored at unit length
                rows = F.normalize(rows.float(), dim=-1)
                lead = None if lead is None else F.normalize(lead.float(), dim=-1)
            windows = window_vectors(query, rows, lead, ngram=kw["ngram"], shift=kw["shift"])
            (tally.keep if phase[0] == "fit" else tally.add)(*windows)
        return out

    summary.ngram_row_scores = counted
    try:
        yield
    finally:
        summary.ngram_row_scores = match


def measure(
    checkpoint: str,
    tally: Tally,
    *,
    n_slot: int | None,
    segments: tuple[int, int],
    split: str,
    batch_size: int,
) -> Tally:
    """Run ``checkpoint`` over ``split`` (its cache at ``n_slot`` slots; None: as trained): once the
    cache has filled, the row matches of ``segments[0]`` segments fit a ``fitted`` first stage
    (none without one), and those of the ``segments[1]`` after them are counted into ``tally``.

    Raises:
        SystemExit: the checkpoint's retrieval makes no row match through a query strategy, or
            the split ends before a row match is counted.
        CheckpointError: unreadable checkpoint.
    """
    from crtn.checkpoint import checkpoint_spec, load_checkpoint, restore_model

    ckpt = load_checkpoint(checkpoint)
    cfg = checkpoint_spec(ckpt, None if n_slot is None else {"cache": {"n_slot": n_slot}})
    if cfg.model.name != "crtn" or cfg.summary.name != "token_max" or cfg.query.strategy == "gate":
        sys.exit(f"{checkpoint}: needs a crtn model whose query pass uses summary=token_max")
    corpus, model = restore_model(ckpt, cfg, checkpoint)
    fit = segments[0] if "fitted" in tally.bases else 0
    phase: list[str | None] = [None]
    state, N = None, cfg.cache.n_slot  # N segments fill the cache
    with torch.no_grad(), watching(tally, phase):
        for i, batch in enumerate(corpus.iterator(split, batch_size, model.tgt_len)):
            if i >= N + fit + segments[1]:
                break
            if i == N + fit:
                tally.fit()
            phase[0] = None if i < N else "fit" if i < N + fit else "count"
            state = model(batch.input, batch.target, state).state
    if tally.calls == 0:
        sys.exit(f"{checkpoint}: no row match counted in {split} (shorter than {N + fit} segments?)")
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument(
        "--n-slot", type=int, default=None, help="cache slots at evaluation (default: as trained)"
    )
    ap.add_argument("--segments", type=int, default=20, help="segments counted (after the fitting ones)")
    ap.add_argument("--basis", default="random,pca", help="comma-separated: random, pca, fitted")
    ap.add_argument("--fit-segments", type=int, default=60, help="segments a fitted first stage is fitted on")
    ap.add_argument("--dims", default="16,32,64,128")
    ap.add_argument("--top", default="1,2,4,8")
    ap.add_argument("--split", default="valid")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--seed", type=int, default=Tally.seed, help="draws of the random and PCA stages and of the fitting"
    )
    a = ap.parse_args()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(","))

    bases = tuple(a.basis.split(","))
    try:
        tally = Tally(dims=ints(a.dims), tops=ints(a.top), bases=bases, seed=a.seed)
    except ValueError as e:
        sys.exit(f"--basis: {e}")
    segments = (a.fit_segments, a.segments)
    measure(a.checkpoint, tally, n_slot=a.n_slot, segments=segments, split=a.split, batch_size=a.batch_size)
    print(f"{a.checkpoint}: {tally.queries} queries in {tally.calls} row matches; hit rate (mean regret)")
    for name in bases:
        print(f"\n{name}\n{tally.table(name)}")


if __name__ == "__main__":
    main()
