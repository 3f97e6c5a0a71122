#!/usr/bin/env python
"""Whether a first stage on projected rows would keep the row match's choice of slot.

    python tools/first_stage_recall.py CHECKPOINT [--n-slot N] [--segments S] [--basis random,pca]
        [--dims 16,32,64,128] [--top 1,2,4,8] [--split valid] [--batch-size 16]

``token_max``'s row match (docs/method.md §3, "Summaries"; :func:`crtn.model.rowmatch.ngram_row_scores`)
scores slot i for query j as max_r (1/w) <Q_j, R_r>, where Q_j is the concatenation of the w
queries q_j, q_{j-1}, ... and R_r that of the w rows row_{r-s}, row_{r-s-1}, ... of the slot and
its lead-in (:func:`window_vectors`). It reads all N Ls rows of d values for every query, which
is why the step grows with N. A two-stage selection would rank the slots by a cheaper score
first, max_r <P^T Q_j, P^T R_r> with a d' x ... projection P, then score the top c of them exactly
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
  optimistic bound for a fixed linear first stage, not a first stage a model could run.

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

#: the most row windows a ``pca`` basis is fitted on per call
PCA_ROWS = 8192


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
        self.generator = torch.Generator().manual_seed(self.seed)
        self.random: dict[int, Tensor] = {}

    def basis(self, name: str, dim: int, R: Tensor) -> Tensor:
        """[D, dim] the projection ``name`` for row windows R [..., D]."""
        D = R.shape[-1]
        if name == "pca":
            return pca_basis(R, dim, self.generator)
        if (D, dim) not in self.random:
            self.random[D, dim] = torch.randn(D, dim, generator=self.generator) / math.sqrt(dim)
        return self.random[D, dim]

    def add(self, Q: Tensor, R: Tensor) -> None:
        """Count one row match: queries Q [G, L, D] against the row windows R [G, n, Ls, D] of
        their streams (each basis fitted once per call)."""
        P = {(name, dim): self.basis(name, dim, R) for name in self.bases for dim in self.dims}
        for g in range(Q.shape[0]):
            full = torch.einsum("ld,nrd->lnr", Q[g], R[g]).amax(-1)  # [L, n]
            best, mean = full.amax(-1), full.mean(-1)
            spread = (best - mean).clamp_min(torch.finfo(full.dtype).tiny)
            self.queries += Q.shape[1]
            for (name, dim), p in P.items():
                first = torch.einsum("ld,nrd->lnr", Q[g] @ p, R[g] @ p).amax(-1)  # [L, n]
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
def watching(tally: Tally, live: list[bool]) -> Iterator[None]:
    """Inside, every row match of the query pass (``crtn.model.summary``'s ``ngram_row_scores``)
    is counted into ``tally`` while ``live[0]`` is true; its result is unchanged. Restored on exit."""
    import crtn.model.summary as summary
    from crtn.model.rowmatch import LeadIn

    match = summary.ngram_row_scores

    def counted(query: Tensor, rows: Tensor, lead: Tensor | LeadIn | None, **kw: object) -> object:
        out = match(query, rows, lead, **kw)
        if live[0]:
            if isinstance(lead, LeadIn):
                lead = lead.rows(rows)
            if kw.get("cosine"):  # the caller normalised the queries; the rows are scored at unit length
                rows = F.normalize(rows.float(), dim=-1)
                lead = None if lead is None else F.normalize(lead.float(), dim=-1)
            tally.add(*window_vectors(query, rows, lead, ngram=kw["ngram"], shift=kw["shift"]))
        return out

    summary.ngram_row_scores = counted
    try:
        yield
    finally:
        summary.ngram_row_scores = match


def measure(
    checkpoint: str, tally: Tally, *, n_slot: int | None, segments: int, split: str, batch_size: int
) -> Tally:
    """Run ``checkpoint`` over ``split`` (its cache at ``n_slot`` slots; None: as trained) and count
    the row matches of ``segments`` segments after the cache has filled into ``tally``.

    Raises:
        SystemExit: the checkpoint's retrieval makes no row match through a query strategy.
        CheckpointError: unreadable checkpoint.
    """
    from crtn.checkpoint import checkpoint_spec, load_checkpoint
    from crtn.data import load_corpus
    from crtn.model import build_model

    ckpt = load_checkpoint(checkpoint)
    cfg = checkpoint_spec(ckpt, None if n_slot is None else {"cache": {"n_slot": n_slot}})
    if cfg.model.name != "crtn" or cfg.summary.name != "token_max" or cfg.query.strategy == "gate":
        sys.exit(f"{checkpoint}: needs a crtn model whose query pass uses summary=token_max")
    corpus = load_corpus(cfg.data)
    model = build_model(cfg, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    model.eval()
    live, state, N = [False], None, cfg.cache.n_slot
    with torch.no_grad(), watching(tally, live):
        for i, batch in enumerate(corpus.iterator(split, batch_size, model.tgt_len)):
            if i >= N + segments:
                break
            live[0] = i >= N  # N segments have filled the cache
            state = model(batch.input, batch.target, state).state
    if tally.calls == 0:
        sys.exit(
            f"{checkpoint}: no row match with a full cache in {split} (a split shorter than {N} segments?)"
        )
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument(
        "--n-slot", type=int, default=None, help="cache slots at evaluation (default: as trained)"
    )
    ap.add_argument("--segments", type=int, default=20, help="segments counted once the cache is full")
    ap.add_argument("--basis", default="random,pca")
    ap.add_argument("--dims", default="16,32,64,128")
    ap.add_argument("--top", default="1,2,4,8")
    ap.add_argument("--split", default="valid")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(","))

    bases = tuple(a.basis.split(","))
    if not set(bases) <= {"random", "pca"}:
        sys.exit(f"--basis {a.basis}: each must be random or pca")
    tally = Tally(dims=ints(a.dims), tops=ints(a.top), bases=bases, seed=a.seed)
    measure(a.checkpoint, tally, n_slot=a.n_slot, segments=a.segments, split=a.split, batch_size=a.batch_size)
    print(f"{a.checkpoint}: {tally.queries} queries in {tally.calls} row matches; hit rate (mean regret)")
    for name in bases:
        print(f"\n{name}\n{tally.table(name)}")


if __name__ == "__main__":
    main()
