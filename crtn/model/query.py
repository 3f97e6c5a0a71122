"""Query strategies: how each token j of segment X_t builds its query q_j (docs/method.md §3, "Query strategies").

R_cur [L, d] is the top layer of the query pass over X_t (no cache), R_prev [L, d] the
same for X_{t-1}. Masked_j(Y) zeroes the rows of Y after token j. Every window
W_j is L x d and q_j = summary(W_j); indices below are 1-based as in docs/method.md.

| strategy        | window W_j                                                              |
|-----------------|-------------------------------------------------------------------------|
| fixed_length_1  | top layer of a separate pass (shared weights, no memory) over the raw   |
|                 | tokens x_{j-L+1..j}, which span X_{t-1} and X_t                          |
| fixed_length_2  | [R_prev[j+1..L]; T_j], T_j = top layer of a pass over X_t[1..j] whose   |
|                 | memory is the stored states of X_{t-1}[j+1..L] only                      |
| last_l          | rows L+1..2L of Masked_j([R_prev; R_cur])  (= Masked_j(R_cur))          |
| middle_l        | rows j+1..j+L of [R_prev; R_cur]                                        |
| linear          | Linear_{2L->L} along the sequence axis of Masked_j([R_prev; R_cur])     |
| token           | q_j = R_cur[j] (the CRTN paper's default)                               |
| single_linear   | q_j = tanh(Linear_{d->d_key}(R_cur[j])) (the authors' code)             |
| gate            | none here: each retrieving layer selects with its own attention queries |
|                 | (selection inside attention, ``gate.py``; no query pass)                |

``single_linear`` applies tanh to its queries, as the authors' code does; ``linear`` does not
(the authors' code applies tanh there too; the ablation in docs/results.md ran without it).

All strategies are causal: q_j depends on tokens up to j only, so a partial segment
(generation) gives the same queries as the full one. ``last_state`` takes "the row of
token j" of each window: row j for ``last_l`` and ``linear`` (whose output rows are
aligned with X_t), row L for the others.

The two ``fixed_length`` strategies run L extra passes per step; they are batched into
one pass over B*L sequences (L times the tokens of a normal pass) and their cost is
reported by the benchmark.

Each strategy is a small class registered in :data:`STRATEGIES` under its config name
(``query.strategy``). A class states what the CRTN step must provide for it
(``needs_query_pass``: R_cur; ``needs_r_prev``: R_prev; ``needs_prev_tokens``:
X_{t-1}'s tokens; ``needs_prev_states``: X_{t-1}'s stored states), its ``kind``
(``window`` or ``token``, which decides the summaries it pairs with, see
``summary.py``) and whether its weights are built for one L (``length_bound``), and the
fields of :class:`crtn.model.spec.QuerySpec` it reads (``reads``: a value other than the
default of any other field is refused) and those
of :class:`crtn.model.spec.SummarySpec` it leaves unused (``ignores_summary``: ``gate`` scores
with each layer's own projections, so a summary's ``d_key`` and ``cosine`` would be ignored).
A new strategy is one class here (plus ``conf/query/NAME.yaml``); see CONTRIBUTING.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from crtn.errors import ConfigError, check_choice
from crtn.model.spec import ModelSpec, QuerySpec, SummarySpec, first_unread, only_readers
from crtn.model.summary import GATE, LOOKUP, SUMMARIES, TOKEN, WINDOW, Summary

# core(tokens [B', L'], mem [n+1, B', M, d] | None, extra_mask [B', 1, 1, M+L'] | None) -> top layer [B', L', d]
CoreFn = Callable[..., Tensor]  # (tokens, mem, extra_mask[, mem_kv]) -> top layer


@dataclass
class QueryInputs:
    """What a strategy may read to build the queries of segment X_t (docs/method.md §3 step 1).

    Attributes:
        r_cur: [B, L', d] top layer of the query pass over X_t (None if not run).
        r_prev: [B, L, d] the same for X_{t-1} (zeros before the first segment), or None.
        core: runs the Transformer with shared weights (fixed_length strategies).
        tokens: [B, L'] X_t; prev_tokens: [B, L] X_{t-1} (zeros before the first segment).
        prev_states: [n+1, B, L, d] stored states of X_{t-1}, or None.
        memory_kv: the model's projection of a memory into per-layer keys and values
            (``TransformerLM.memory_kv``), so that passes over copies of one memory share it.
    """

    r_cur: Tensor | None
    r_prev: Tensor | None = None
    core: CoreFn | None = None
    tokens: Tensor | None = None
    prev_tokens: Tensor | None = None
    prev_states: Tensor | None = None
    memory_kv: Callable[[Tensor], list[Tensor] | None] | None = None


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


def fixed_length_2_windows(
    core: CoreFn,
    tokens: Tensor,
    prev_states: Tensor,
    r_prev: Tensor,
    memory_kv: Callable[[Tensor], list[Tensor] | None] | None = None,
) -> Tensor:
    """W_j = [R_prev[j+1..L]; T_j] for every j: -> [B, L', L, d].

    T_j is the top layer of a pass over X_t[1..j] whose memory is the stored states of
    X_{t-1}[j+1..L]. All L' passes run as one batch of B*L' sequences over X_t with the
    whole of X_{t-1} as memory and the first j memory positions masked (causality
    makes rows after j irrelevant to T_j). The L' copies of the memory share one projection
    into keys and values (``memory_kv``, exact: each copy's would be the same), instead of
    projecting B*L' memories per layer.

    Args:
        tokens: [B, L'] X_t. prev_states: [n+1, B, L, d] stored states of X_{t-1}.
        r_prev: [B, L, d].
        memory_kv: the model's projection of a memory (:class:`QueryInputs`), or None.
    """
    B, Lq = tokens.shape
    n1, _, L, d = prev_states.shape
    toks = tokens.repeat_interleave(Lq, 0)  # [B*L', L'], sequence (b, j)
    mem = prev_states.repeat_interleave(Lq, 1)  # [n+1, B*L', L, d]
    j = torch.arange(Lq, device=tokens.device)
    c = torch.arange(L + Lq, device=tokens.device)
    hide = (c[None, :] <= j[:, None]) & (c[None, :] < L)  # [L', L+L'] memory rows 1..j hidden
    extra = hide[None].expand(B, Lq, L + Lq).reshape(B * Lq, 1, 1, L + Lq)
    kv = None if memory_kv is None else memory_kv(prev_states)
    if kv is not None:
        kv = [t.repeat_interleave(Lq, 0) for t in kv]  # [B*L', L, 2 H d_h] per layer
    top = core(toks, mem, extra, mem_kv=kv).view(B, Lq, Lq, d)  # T_j = top[:, j, :j+1]
    g = torch.cat([r_prev[:, None].expand(B, Lq, L, d), top], 2)  # [B, L', L+L', d]
    idx = j[:, None] + 1 + torch.arange(L, device=tokens.device)[None, :]  # rows j+1 .. j+L
    return g.gather(2, idx[None, :, :, None].expand(B, Lq, L, d))


class QueryStrategy(nn.Module):
    """How each token's query is built (docs/method.md §3, "Query strategies"); base class.

    Args:
        seg_len: L (``linear``'s Linear_{2L->L} is built for it).

    Window strategies implement :meth:`windows`; :meth:`forward` applies the summary.
    """

    strategy: str = ""
    kind: str = WINDOW
    needs_query_pass: bool = True
    needs_r_prev: bool = False
    needs_prev_tokens: bool = False
    needs_prev_states: bool = False
    length_bound: bool = False
    in_attention: bool = False  # selects inside each retrieving layer's attention (no queries here)
    by_lookup: bool = False  # selects by a lookup of the preceding tokens (no queries here)
    #: the QuerySpec fields this strategy reads; any other set to a non-default value is refused
    reads: frozenset[str] = frozenset({"strategy", "detach"})
    #: SummarySpec fields its summary reads that this strategy leaves unused (refused when set)
    ignores_summary: frozenset[str] = frozenset()

    def __init__(self, seg_len: int, d_model: int = 0, d_key: int = 0):
        super().__init__()
        self.seg_len = seg_len

    @classmethod
    def resolve(cls, spec: QuerySpec, summary: str) -> QuerySpec:
        """Check the strategy's options (nothing to fill): the pairing with ``summary`` (by the
        strategy's ``kind``, :func:`valid_summaries`) and the options it reads (:attr:`reads`).

        Raises:
            ConfigError: an invalid pairing (listing the valid ones); a field outside
                :attr:`reads` set to a value other than its default.
        """
        if summary not in valid_summaries(cls.strategy):
            by_kind: dict[str, list[str]] = {}
            for q in STRATEGIES:
                by_kind.setdefault("|".join(valid_summaries(q)), []).append(q)
            pairs = "; ".join(f"{'|'.join(qs)} with {s}" for s, qs in by_kind.items())
            raise ConfigError(
                f"query={cls.strategy} cannot be paired with summary={summary}. Valid pairs: {pairs}"
            )
        unread = first_unread(spec, cls.reads)
        if unread is not None:
            key, value = unread
            readers = only_readers(q for q, c in STRATEGIES.items() if key in c.reads)
            raise ConfigError(f"query.{key}={value} is ignored by query={cls.strategy} ({readers})")
        return spec

    @classmethod
    def check_summary(cls, summary: SummarySpec) -> None:
        """Refuse a field of the (resolved) ``summary`` spec that this strategy leaves unused
        (:attr:`ignores_summary`) set to a value other than its default.

        Raises:
            ConfigError: ``summary.d_key=8 is ignored by query=gate (...)``.
        """
        unread = first_unread(summary, {f.name for f in fields(SummarySpec)} - cls.ignores_summary)
        if unread is not None:
            key, value = unread
            readers = only_readers(
                q
                for q, c in STRATEGIES.items()
                if key not in c.ignores_summary and summary.name in valid_summaries(q)
            )
            raise ConfigError(
                f"summary.{key}={value} is ignored by query={cls.strategy} (with summary={summary.name}, {readers})"
            )

    @classmethod
    def from_spec(cls, spec: QuerySpec, model: ModelSpec, d_key: int) -> QueryStrategy:
        """The strategy a resolved ``spec`` describes, producing queries of width ``d_key``."""
        return cls(model.tgt_len, model.d_model, d_key=d_key)

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        """Windows W_j [B, L', L, d] and the row of token j in each, [L'] long."""
        raise ValueError(f"query={self.strategy} has no windows")

    def fast_scores(self, summary: Summary, r_cur: Tensor | None) -> Callable[[Tensor], Tensor] | None:
        """A function keys -> scores [B, L', n] that avoids building queries, or None (the default)."""
        return None

    def forward(self, summary: Summary, x: QueryInputs) -> Tensor:
        """Queries [B, L', d_key] (``token``: R_cur itself, [B, L', d])."""
        w, token_row = self.windows(x)
        return summary.query(w, token_row)

    def _last_row(self, w: Tensor) -> tuple[Tensor, Tensor]:
        return w, torch.full((w.shape[1],), self.seg_len - 1, dtype=torch.long, device=w.device)


class FixedLength1(QueryStrategy):
    """Top layer of a memory-less pass over x_{j-L+1..j} (docs/method.md §3, Query strategies)."""

    strategy, needs_query_pass, needs_prev_tokens = "fixed_length_1", False, True

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        assert x.core is not None and x.tokens is not None and x.prev_tokens is not None
        return self._last_row(fixed_length_1_windows(x.core, x.prev_tokens, x.tokens))


class FixedLength2(QueryStrategy):
    """[R_prev[j+1..L]; T_j], T_j a pass over X_t[1..j] with X_{t-1}[j+1..L] as memory (docs/method.md §3, Query strategies)."""

    strategy, needs_r_prev, needs_prev_states = "fixed_length_2", True, True

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        assert x.core is not None and x.tokens is not None
        assert x.prev_states is not None and x.r_prev is not None
        windows = fixed_length_2_windows(
            x.core, x.tokens, x.prev_states, r_prev=x.r_prev, memory_kv=x.memory_kv
        )
        return self._last_row(windows)


class LastL(QueryStrategy):
    """Rows L+1..2L of Masked_j([R_prev; R_cur]) (docs/method.md §3, Query strategies)."""

    strategy = "last_l"

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        assert x.r_cur is not None
        lq = x.r_cur.shape[1]
        return last_l_windows(x.r_cur, self.seg_len), torch.arange(lq, device=x.r_cur.device)

    def fast_scores(self, summary: Summary, r_cur: Tensor | None) -> Callable[[Tensor], Tensor] | None:
        """``identity`` keys: W_j = Masked_j(R_cur), so <flat(W_j), flat(K_i)> =
        sum_{r<=j} <R_cur[r], K_i[r]>, a cumulative sum of per-row dot products:
        O(B L n d) instead of O(B L n L d), and no [B, L, L, d] windows."""
        if not summary.flat or r_cur is None:
            return None
        B, Lq, d = r_cur.shape
        scale = 1.0 / math.sqrt(summary.d_key)

        def scores(keys: Tensor) -> Tensor:  # keys [B, n, L*d]
            rows = keys.view(B, keys.shape[1], -1, d)[:, :, :Lq].to(r_cur.dtype)
            return torch.einsum("brd,bnrd->brn", r_cur, rows).cumsum(1) * scale

        return scores


class MiddleL(QueryStrategy):
    """Rows j+1..j+L of [R_prev; R_cur] (docs/method.md §3, Query strategies)."""

    strategy, needs_r_prev = "middle_l", True

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        assert x.r_prev is not None and x.r_cur is not None
        return self._last_row(middle_l_windows(x.r_prev, x.r_cur))


class Linear(QueryStrategy):
    """Linear_{2L->L} along the sequence axis of Masked_j([R_prev; R_cur]) (docs/method.md §3, Query strategies)."""

    strategy, needs_r_prev, length_bound = "linear", True, True

    def __init__(self, seg_len: int, d_model: int = 0, d_key: int = 0):
        super().__init__(seg_len, d_model, d_key=d_key)
        self.seq_linear = nn.Linear(2 * seg_len, seg_len)

    def windows(self, x: QueryInputs) -> tuple[Tensor, Tensor]:
        assert x.r_prev is not None and x.r_cur is not None
        lq = x.r_cur.shape[1]
        return linear_windows(x.r_prev, x.r_cur, self.seq_linear), torch.arange(lq, device=x.r_cur.device)


class Token(QueryStrategy):
    """q_j = R_cur[j], the token's own top-layer state (the CRTN paper's default)."""

    strategy, kind = "token", TOKEN

    def forward(self, summary: Summary, x: QueryInputs) -> Tensor:
        """R_cur [B, L, d]; with ``summary.ngram`` w > 1 the last w-1 rows of R_prev in front."""
        return _with_lead_in(summary, x)


class SingleLinear(QueryStrategy):
    """q_j = tanh(Linear_{d->d_key}(R_cur[j])) (the authors' ``single_linear``).

    The projection maps the token's top-layer state into the key space of the summary
    (d_key = d for the summaries it pairs with; keys are not projected, as in the authors' code).
    """

    strategy, kind = "single_linear", TOKEN

    def __init__(self, seg_len: int, d_model: int = 0, d_key: int = 0):
        super().__init__(seg_len, d_model, d_key=d_key)
        self.proj = nn.Linear(d_model, d_key)

    def forward(self, summary: Summary, x: QueryInputs) -> Tensor:
        return torch.tanh(self.proj(_with_lead_in(summary, x)))


def _with_lead_in(summary: Summary, x: QueryInputs) -> Tensor:
    """R_cur [B, L, d], or [R_prev[-n:]; R_cur] [B, n+L, d] with the n = ``summary.query_lead_rows``
    rows a summary reads before each query (token_max's n-gram match: n = ngram - 1)."""
    assert x.r_cur is not None
    n = summary.query_lead_rows
    if n == 0:
        return x.r_cur
    assert x.r_prev is not None
    return torch.cat([x.r_prev[:, x.r_prev.shape[1] - n :].to(x.r_cur.dtype), x.r_cur], 1)


class Gate(QueryStrategy):
    """Selection inside attention: every retrieving layer scores the cached segments with its own
    attention queries and selects one set of segments shared by the heads (``crtn/model/gate.py``; MoBA, NSA, landmark
    attention). No query pass and no queries here: the CRTN step hands the layers a
    :class:`crtn.model.gate.Gate`."""

    strategy, kind, needs_query_pass, in_attention = "gate", GATE, False, True
    ignores_summary = frozenset({"d_key", "cosine"})  # it scores with each layer's own projections

    def forward(self, summary: Summary, x: QueryInputs) -> Tensor:
        raise ValueError("query=gate selects inside attention (crtn/model/gate.py): it builds no queries")


class Lookup(QueryStrategy):
    """Selection by an exact lookup of the preceding tokens (``crtn/model/lookup.py``; docs/method.md
    §3, "Lookup of the preceding tokens"): token j's query is the tokens that end at it, matched
    against the tokens before each cached row as token_max's n-gram match (``summary.ngram``,
    the shortest length looked up; ``summary.shift``) matches states, at the lengths up to
    ``query.max_match``. No query pass and no learned weights; the CRTN step's
    :class:`crtn.model.retriever.Lookup` selects."""

    strategy, kind, needs_query_pass, by_lookup = "lookup", LOOKUP, False, True
    reads = QueryStrategy.reads | {"max_match"}
    ignores_summary = frozenset({"d_key", "cosine"})  # tokens are compared, not states

    @classmethod
    def resolve(cls, spec: QuerySpec, summary: str) -> QuerySpec:
        """The base checks, then ``query.max_match`` at least 1 (the lengths below it start at
        ``summary.ngram``: :meth:`crtn.model.crtn.CRTN.resolve` compares the two).

        Raises:
            ConfigError: as :meth:`QueryStrategy.resolve`; ``query.max_match`` below 1, or
                ``query.detach`` set (nothing is learned to detach).
        """
        spec = super().resolve(spec, summary)
        if spec.max_match < 1:
            raise ConfigError(f"query.max_match={spec.max_match} must be >= 1")
        if spec.detach:
            raise ConfigError("query.detach=true is ignored by query=lookup (its selection learns nothing)")
        return spec

    def forward(self, summary: Summary, x: QueryInputs) -> Tensor:
        raise ValueError("query=lookup selects by the tokens (crtn/model/lookup.py): it builds no queries")


#: every query strategy by its config name, in the order of docs/method.md §3
STRATEGIES: dict[str, type[QueryStrategy]] = {
    cls.strategy: cls
    for cls in (FixedLength1, FixedLength2, LastL, MiddleL, Linear, Token, SingleLinear, Gate, Lookup)
}


def valid_summaries(strategy: str) -> tuple[str, ...]:
    """Summaries that may be paired with query ``strategy``: those whose ``kinds`` hold the
    strategy's kind (docs/method.md §3, "Summaries")."""
    kind = STRATEGIES[strategy].kind
    return tuple(name for name, cls in SUMMARIES.items() if kind in cls.kinds)


def valid_pairs() -> list[tuple[str, str]]:
    """Every valid (query strategy, summary) pair of the strategies that score the slots, in the
    order of :data:`STRATEGIES`: the axis of the query ablation (``+experiment=ablation_query``,
    whose k and alpha over all slots a lookup does not have). ``query=lookup`` compares tokens and
    pairs with token_max alone (:func:`valid_summaries`)."""
    return [(q, s) for q, c in STRATEGIES.items() if not c.by_lookup for s in valid_summaries(q)]


def make_query(strategy: str, seg_len: int, d_model: int = 0, d_key: int = 0) -> QueryStrategy:
    """Build the strategy registered as ``strategy`` (see :data:`STRATEGIES`) from plain values.

    Args:
        seg_len: L; d_model: d; d_key: the summary's key width (``single_linear``'s output).

    Raises:
        ConfigError: unknown name.
    """
    check_choice("query.strategy", strategy, STRATEGIES)
    return STRATEGIES[strategy](seg_len, d_model, d_key=d_key)
