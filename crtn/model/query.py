"""Query strategies: how each token j of segment X_t builds its query q_j (SPEC §3; seed 003, "1 查询").

R_cur [L, d] is the top layer of the query pass over X_t (no cache), R_prev [L, d] the
same for X_{t-1}. Masked_j(Y) zeroes the rows of Y after token j. Every window
W_j is L x d and q_j = summary(W_j); indices below are 1-based as in the SPEC.

| strategy        | window W_j                                                              | seed  |
|-----------------|-------------------------------------------------------------------------|-------|
| fixed_length_1  | top layer of a separate pass (shared weights, no memory) over the raw   | 1.1.1 |
|                 | tokens x_{j-L+1..j}, which span X_{t-1} and X_t                          |       |
| fixed_length_2  | [R_prev[j+1..L]; T_j], T_j = top layer of a pass over X_t[1..j] whose   | 1.1.2 |
|                 | memory is the stored states of X_{t-1}[j+1..L] only                      |       |
| last_l          | rows L+1..2L of Masked_j([R_prev; R_cur])  (= Masked_j(R_cur))          | 1.2.1 |
| middle_l        | rows j+1..j+L of [R_prev; R_cur]                                        | 1.2.2 |
| linear          | Linear_{2L->L} along the sequence axis of Masked_j([R_prev; R_cur])     | 1.2.3 |
| token           | q_j = R_cur[j] (the CRTN paper's default)                               |  —    |

All strategies are causal: q_j depends on tokens up to j only, so a partial segment
(generation) gives the same queries as the full one. ``last_state`` takes "the row of
token j" of each window: row j for ``last_l`` and ``linear`` (whose output rows are
aligned with X_t), row L for the others.

The two ``fixed_length`` strategies run L extra passes per step; they are batched into
one pass over B*L sequences (L times the tokens of a normal pass) and their cost is
reported by the benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from crtn.model.summary import Summary

# core(tokens [B', L'], mem [n+1, B', M, d] | None, extra_mask [B', 1, 1, M+L'] | None) -> top layer [B', L', d]
CoreFn = Callable[[Tensor, Tensor | None, Tensor | None], Tensor]


def last_l_windows(r_cur: Tensor, seg_len: int) -> Tensor:
    """W_j = Masked_j(R_cur): r_cur [B, L', d] (L' <= L) -> [B, L', L, d]."""
    B, Lq, d = r_cur.shape
    rc = torch.nn.functional.pad(r_cur, (0, 0, 0, seg_len - Lq))  # [B, L, d]
    j = torch.arange(Lq, device=r_cur.device)
    r = torch.arange(seg_len, device=r_cur.device)
    keep = (r[None, :] <= j[:, None]).to(r_cur.dtype)  # [L', L]
    return rc[:, None] * keep[None, :, :, None]


def middle_l_windows(r_prev: Tensor, r_cur: Tensor) -> Tensor:
    """W_j = rows j+1..j+L of [R_prev; R_cur]: r_prev [B, L, d], r_cur [B, L', d] -> [B, L', L, d]."""
    L, Lq = r_prev.shape[1], r_cur.shape[1]
    g = torch.cat([r_prev, r_cur], 1)  # [B, L+L', d]
    return g.unfold(1, L, 1)[:, 1 : Lq + 1].transpose(-1, -2)


def linear_windows(r_prev: Tensor, r_cur: Tensor, seq_linear: nn.Linear) -> Tensor:
    """W_j = A Masked_j([R_prev; R_cur]) + b, A in R^{L x 2L}: -> [B, L', L, d].

    Computed incrementally: W_j = A[:, :L] R_prev + sum_{i<=j} A[:, L+i] (x) R_cur[i] + b,
    O(B L' L d) instead of O(B L' L 2L d).
    """
    L, Lq = r_prev.shape[1], r_cur.shape[1]
    A, b = seq_linear.weight, seq_linear.bias  # [L, 2L], [L]
    base = torch.einsum("rc,bcd->brd", A[:, :L], r_prev)  # [B, L, d]
    steps = torch.einsum("rj,bjd->bjrd", A[:, L : L + Lq], r_cur)  # [B, L', L, d]
    return base[:, None] + steps.cumsum(1) + b[None, None, :, None]


def fixed_length_1_windows(core: CoreFn, prev_tokens: Tensor, tokens: Tensor) -> Tensor:
    """Top layer of a memory-less pass over x_{j-L+1..j} for every j: -> [B, L', L, d].

    Args:
        core: runs the transformer (shared weights).
        prev_tokens: [B, L] tokens of X_{t-1}; tokens: [B, L'] of X_t.
    """
    B, L = prev_tokens.shape
    Lq = tokens.shape[1]
    seq = torch.cat([prev_tokens, tokens], 1)
    win = seq.unfold(1, L, 1)[:, 1 : Lq + 1]  # [B, L', L], window of token j ends at j
    top = core(win.reshape(B * Lq, L), None, None)
    return top.view(B, Lq, L, -1)


def fixed_length_2_windows(core: CoreFn, tokens: Tensor, prev_states: Tensor, r_prev: Tensor) -> Tensor:
    """W_j = [R_prev[j+1..L]; T_j] for every j: -> [B, L', L, d].

    T_j is the top layer of a pass over X_t[1..j] whose memory is the stored states of
    X_{t-1}[j+1..L]. All L' passes run as one batch of B*L' sequences over X_t with the
    whole of X_{t-1} as memory and the first j memory positions masked (causality
    makes rows after j irrelevant to T_j).

    Args:
        tokens: [B, L'] X_t. prev_states: [n+1, B, L, d] stored states of X_{t-1}.
        r_prev: [B, L, d].
    """
    B, Lq = tokens.shape
    n1, _, L, d = prev_states.shape
    toks = tokens.repeat_interleave(Lq, 0)  # [B*L', L'], sequence (b, j)
    mem = prev_states.repeat_interleave(Lq, 1)  # [n+1, B*L', L, d]
    j = torch.arange(Lq, device=tokens.device)
    c = torch.arange(L + Lq, device=tokens.device)
    hide = (c[None, :] <= j[:, None]) & (c[None, :] < L)  # [L', L+L'] memory rows 1..j hidden
    extra = hide[None].expand(B, Lq, L + Lq).reshape(B * Lq, 1, 1, L + Lq)
    top = core(toks, mem, extra).view(B, Lq, Lq, d)  # T_j = top[:, j, :j+1]
    g = torch.cat([r_prev[:, None].expand(B, Lq, L, d), top], 2)  # [B, L', L+L', d]
    idx = j[:, None] + 1 + torch.arange(L, device=tokens.device)[None, :]  # rows j+1 .. j+L
    return g.gather(2, idx[None, :, :, None].expand(B, Lq, L, d))


class QueryBuilder(nn.Module):
    """Builds the query of every token of a segment (SPEC §3, "Query strategies").

    Args:
        strategy: fixed_length_1 | fixed_length_2 | last_l | middle_l | linear | token.
        seg_len: L (the ``linear`` strategy's Linear_{2L->L} is built for it).
    """

    def __init__(self, strategy: str, seg_len: int):
        super().__init__()
        self.strategy, self.seg_len = strategy, seg_len
        if strategy == "linear":
            self.seq_linear = nn.Linear(2 * seg_len, seg_len)

    @property
    def needs_r_prev(self) -> bool:
        """Whether R_prev (the previous segment's query-pass top layer) is used."""
        return self.strategy in ("middle_l", "linear", "fixed_length_2")

    @property
    def needs_query_pass(self) -> bool:
        """Whether R_cur (the query pass) is needed; fixed_length_1 builds its own windows."""
        return self.strategy != "fixed_length_1"

    def windows(
        self,
        r_prev: Tensor | None,
        r_cur: Tensor | None,
        core: CoreFn | None = None,
        tokens: Tensor | None = None,
        prev_tokens: Tensor | None = None,
        prev_states: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Windows W_j [B, L', L, d] and the row of token j in each, [L'] long.

        Raises:
            ValueError: for ``token`` (no windows) or an unknown strategy.
        """
        s, L = self.strategy, self.seg_len
        if s == "last_l":
            assert r_cur is not None
            lq = r_cur.shape[1]
            return last_l_windows(r_cur, L), torch.arange(lq, device=r_cur.device)
        if s == "linear":
            assert r_prev is not None and r_cur is not None
            lq = r_cur.shape[1]
            return linear_windows(r_prev, r_cur, self.seq_linear), torch.arange(lq, device=r_cur.device)
        if s == "middle_l":
            assert r_prev is not None and r_cur is not None
            w = middle_l_windows(r_prev, r_cur)
        elif s == "fixed_length_1":
            assert core is not None and tokens is not None and prev_tokens is not None
            w = fixed_length_1_windows(core, prev_tokens, tokens)
        elif s == "fixed_length_2":
            assert core is not None and tokens is not None and prev_states is not None and r_prev is not None
            w = fixed_length_2_windows(core, tokens, prev_states, r_prev)
        else:
            raise ValueError(f"query={s} has no windows")
        return w, torch.full((w.shape[1],), L - 1, dtype=torch.long, device=w.device)

    def fast_scores(self, summary: Summary, r_cur: Tensor | None) -> Callable[[Tensor], Tensor] | None:
        """A function keys -> scores [B, L', n] that avoids building windows, when one exists.

        ``last_l`` with ``identity`` keys: W_j = Masked_j(R_cur), so
        <flat(W_j), flat(K_i)> = sum_{r<=j} <R_cur[r], K_i[r]>, a cumulative sum of per-row
        dot products: O(B L n d) instead of O(B L n L d), and no [B, L, L, d] windows.
        Returns None for the other pairings (the caller builds queries).
        """
        if self.strategy != "last_l" or summary.name != "identity" or r_cur is None:
            return None
        B, Lq, d = r_cur.shape
        scale = 1.0 / math.sqrt(summary.d_key)

        def scores(keys: Tensor) -> Tensor:  # keys [B, n, L*d]
            rows = keys.view(B, keys.shape[1], -1, d)[:, :, :Lq].to(r_cur.dtype)
            return torch.einsum("brd,bnrd->brn", r_cur, rows).cumsum(1) * scale

        return scores

    def forward(
        self,
        summary: Summary,
        r_prev: Tensor | None,
        r_cur: Tensor | None,
        core: CoreFn | None = None,
        tokens: Tensor | None = None,
        prev_tokens: Tensor | None = None,
        prev_states: Tensor | None = None,
    ) -> Tensor:
        """Queries [B, L', d_key] (``token``: R_cur itself, [B, L', d])."""
        if self.strategy == "token":
            assert r_cur is not None
            return r_cur
        w, token_row = self.windows(r_prev, r_cur, core, tokens, prev_tokens, prev_states)
        return summary.query(w, token_row)
