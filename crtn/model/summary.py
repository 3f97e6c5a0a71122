"""Summaries of an L x d block of top-layer states into a cache key or a query (docs/method.md §3).

| summary      | of Y in R^{L x d}                                    | d_key    | pairs with      |
|--------------|------------------------------------------------------|----------|-----------------|
| identity     | flat(Y)                                              | L * d    | window queries  |
| linear       | Linear(flat(Y))                                      | d_key    | window queries  |
| last_state   | Y[L]; for a query window, the row of token j         | d        | both            |
| mean, max    | pooling over rows                                    | d        | both            |
| sum          | sum over rows (the authors' code)                    | d        | both            |
| weighted_sum | sum_r w_r Y[r], a learned Linear(L -> 1) over rows   | d        | both            |
| conv         | the authors' strided Conv1d over the flattened heads | d        | both            |
| token_max    | keys keep all L rows; score = max_r <q, Y[r]>         | d        | token queries   |

Keys are summaries of a cached segment's top layer (docs/method.md §3, "Summaries"); queries are the same summary applied to each token's
window (docs/method.md §3, "Query strategies"). Scores are scaled dot products, s = <q, k> / sqrt(d_key).
``sum``, ``weighted_sum`` and ``conv`` are the CRTN authors' options (xyz961014/longterm,
``CRTN/layers/cache.py``). Keys are computed without gradient when a segment enters the
cache (as in the authors' code), so a learned summary trains only through window
queries; paired with ``token`` queries its weights stay at their initialisation, as
theirs do.

Each summary is a small class registered in :data:`SUMMARIES` under its config name
(``summary.name``). A class states what the rest of the model needs to know about it:

- ``kinds``: the query kinds it pairs with (``"window"``: strategies that build an
  L x d window per token; ``"token"``: strategies that give one vector per token);
- ``key_is_view``: the key is a view of the stored top-layer states (nothing is stored
  besides the values; the cache asks :meth:`Summary.key` when it scores);
- ``row_keys``: a slot's key is several vectors (one per row), not one (no faiss index);
- ``length_bound``: its weights are built for one segment length L, so L cannot change
  at evaluation;
- ``reads``: the fields of :class:`crtn.model.spec.SummarySpec` it reads; a value other than
  the default of any other field is refused (it would be ignored), e.g. ``summary.ngram=8``
  with ``summary=mean``.

A new summary is one class here (plus ``conf/summary/NAME.yaml``); see CONTRIBUTING.md.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from crtn.errors import ConfigError, check_choice
from crtn.model.rowmatch import LeadIn, ngram_row_scores
from crtn.model.spec import ModelSpec, SummarySpec, first_unread, only_readers

WINDOW, TOKEN, GATE, LOOKUP = "window", "token", "gate", "lookup"


class Summary(nn.Module):
    """Key/query summary shared by the cache and the query strategies (base class).

    Args:
        seg_len: L, rows of a segment (and of a query window).
        d_model: d, width of a row.
        d_key: output width where configurable (``linear``); None: the summary's own.
        n_head: the model's heads (the channels of ``conv``).

    Subclasses implement :meth:`key` and :meth:`query`; scoring is the scaled dot product
    unless overridden (``token_max``).
    """

    name: str = ""
    kinds: tuple[str, ...] = (WINDOW, TOKEN)
    key_is_view: bool = False
    row_keys: bool = False
    length_bound: bool = False
    flat: bool = False  # key = flat(Y), query = flat(W): a score is a sum of per-row products
    ngram: int = 1  # token_max: aligned tokens matched per score (``summary.ngram``)
    shift: int = 0  # token_max: 1 keys a row by the rows before it (``summary.shift``)
    cosine: bool = False  # token_max: cosine scores (``summary.cosine``)
    #: the SummarySpec fields this summary reads; any other set to a non-default value is refused
    reads: frozenset[str] = frozenset({"name"})

    def __init__(self, seg_len: int, d_model: int, d_key: int | None = None, n_head: int = 1):
        super().__init__()
        self.seg_len, self.d_model, self.n_head = seg_len, d_model, n_head

    @classmethod
    def resolve(cls, spec: SummarySpec, model: ModelSpec) -> SummarySpec:
        """``spec`` with this summary's derived defaults filled and its rules checked (the base
        class fills nothing): :meth:`check_reads`, and ``summary.d_key`` > 0.

        Raises:
            ConfigError: an option this summary does not read set (:meth:`check_reads`);
                ``summary.d_key`` <= 0.
        """
        cls.check_reads(spec)
        if spec.d_key is not None and spec.d_key <= 0:
            raise ConfigError(f"summary.d_key={spec.d_key} must be > 0")
        return spec

    @classmethod
    def check_reads(cls, spec: SummarySpec) -> None:
        """Refuse a field of ``spec`` outside :attr:`reads` set to a value other than its default
        (the summary would ignore it; :func:`crtn.model.spec.first_unread`).

        Raises:
            ConfigError: ``summary.ngram=8 is ignored by summary=mean (only token_max reads it)``.
        """
        unread = first_unread(spec, cls.reads)
        if unread is not None:
            key, value = unread
            readers = only_readers(n for n, c in SUMMARIES.items() if key in c.reads)
            raise ConfigError(f"summary.{key}={value} is ignored by summary={cls.name} ({readers})")

    @classmethod
    def from_spec(cls, spec: SummarySpec, model: ModelSpec) -> Summary:
        """The summary a resolved ``spec`` describes, for segments of ``model.tgt_len`` rows."""
        return cls(model.tgt_len, model.d_model, d_key=spec.d_key, n_head=model.n_head)

    @property
    def lead_rows(self) -> int:
        """Rows of the predecessor slot that the scores of a slot read: ngram - 1 + shift."""
        return self.ngram - 1 + self.shift

    @property
    def query_lead_rows(self) -> int:
        """Rows of R_prev that go in front of a segment's queries: ngram - 1."""
        return self.ngram - 1

    @property
    def d_key(self) -> int:
        """Width of keys and queries (for ``token_max``: of one row)."""
        return self.d_model

    @property
    def d_query(self) -> int:
        """Width of the queries :meth:`score` takes (``token_max`` maps them itself)."""
        return self.d_key

    def key(self, top: Tensor) -> Tensor:
        """Key of a segment from its top-layer states: top [..., L, d] -> [..., d_key]
        (``token_max``: the rows themselves, [..., L, d])."""
        raise NotImplementedError

    @property
    def stores_key(self) -> bool:
        """Whether the cache stores a vector per slot (:meth:`stored_key`); otherwise it reads
        the slot's stored rows (``key_is_view``)."""
        return not self.key_is_view

    def stored_key(self, top: Tensor) -> Tensor | None:
        """What the cache stores of a new slot, without gradient (docs/method.md §3 step 5): its
        key, top [..., L, d] -> [..., d_key], or None when :attr:`stores_key` is false."""
        if not self.stores_key:
            return None
        with torch.no_grad():
            return self.key(top)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        """Query of each token from its window.

        Args:
            window: [B, L, Lw, d], window W_j of every token j (Lw = segment length).
            token_row: [L] long, the row of W_j that belongs to token j (``last_state``).

        Returns:
            [B, L, d_key].

        Raises:
            ValueError: the summary pairs only with ``token`` queries (no window query).
        """
        raise ValueError(f"summary={self.name} has no window query; it pairs with query=token")

    def score(self, query: Tensor, keys: Tensor) -> Tensor:
        """Scaled dot-product scores of every query against every key (docs/method.md §3 step 2).

        Args:
            query: [B, L, d_key].
            keys: [B, N, d_key] (``token_max``: [B, N, Ls, d]).

        Returns:
            [B, L, N], s = <q, k> / sqrt(d_key).
        """
        keys = keys.to(query.dtype)
        return torch.bmm(query, keys.transpose(1, 2)) * (1.0 / math.sqrt(self.d_key))

    def score_selected(self, query: Tensor, keys: Tensor) -> Tensor:
        """Scores against given keys per token: query [B, L, d_key], keys [B, L, k, ...] -> [B, L, k]."""
        keys = keys.to(query.dtype)
        return torch.einsum("bld,blkd->blk", query, keys) * (1.0 / math.sqrt(self.d_key))

    def _check_len(self, top: Tensor) -> None:
        if top.shape[-2] != self.seg_len:
            raise ValueError(
                f"summary={self.name} was built for segments of {self.seg_len} rows, got {top.shape[-2]}"
            )


class Identity(Summary):
    """flat(Y), d_key = L d (docs/method.md §3, Summaries)."""

    name, kinds, key_is_view, flat = "identity", (WINDOW,), True, True

    @property
    def d_key(self) -> int:
        return self.seg_len * self.d_model

    def key(self, top: Tensor) -> Tensor:
        self._check_len(top)
        return top.flatten(-2)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return window.flatten(-2)


class Linear(Summary):
    """Linear(flat(Y)) to d_key (default d) (docs/method.md §3, Summaries); weights built for L."""

    name, kinds, length_bound = "linear", (WINDOW,), True
    reads = Summary.reads | {"d_key"}

    def __init__(self, seg_len: int, d_model: int, d_key: int, n_head: int = 1):
        super().__init__(seg_len, d_model, d_key=d_key, n_head=n_head)
        self.proj = nn.Linear(seg_len * d_model, d_key)

    @classmethod
    def resolve(cls, spec: SummarySpec, model: ModelSpec) -> SummarySpec:
        """As :meth:`Summary.resolve`, and ``summary.d_key`` None becomes ``d_model``."""
        spec = super().resolve(spec, model)
        return replace(spec, d_key=model.d_model if spec.d_key is None else spec.d_key)

    @property
    def d_key(self) -> int:
        return self.proj.out_features

    def _linear(self, flat: Tensor) -> Tensor:
        return self.proj(flat)

    def key(self, top: Tensor) -> Tensor:
        self._check_len(top)
        return self._linear(top.flatten(-2))

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return self._linear(window.flatten(-2))


class LastState(Summary):
    """Y[L] (for a query window: the row of token j), d_key = d; the CRTN paper's key."""

    name, kinds = "last_state", (WINDOW, TOKEN, GATE)

    def key(self, top: Tensor) -> Tensor:
        return top[..., -1, :]

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        idx = token_row.view(1, -1, 1, 1).expand(window.shape[0], -1, 1, window.shape[-1])
        return window.gather(2, idx).squeeze(2)


class Mean(Summary):
    """Mean over rows, d_key = d (also the block key of selection inside attention, as MoBA's)."""

    name, kinds = "mean", (WINDOW, TOKEN, GATE)

    def key(self, top: Tensor) -> Tensor:
        return top.mean(-2)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return window.mean(2)


class Max(Summary):
    """Max over rows, d_key = d."""

    name = "max"

    def key(self, top: Tensor) -> Tensor:
        return top.amax(-2)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return window.amax(2)


class Sum(Summary):
    """Sum over rows, d_key = d (the authors' ``sum``)."""

    name = "sum"

    def key(self, top: Tensor) -> Tensor:
        return top.sum(-2)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return window.sum(2)


class WeightedSum(Summary):
    """sum_r w_r Y[r] with learned w in R^L (``Linear(L, 1, bias=False)`` over the rows), d_key = d
    (the authors' ``weighted_sum``); weights built for L."""

    name, length_bound = "weighted_sum", True

    def __init__(self, seg_len: int, d_model: int, d_key: int | None = None, n_head: int = 1):
        super().__init__(seg_len, d_model, d_key=d_key, n_head=n_head)
        self.row_weight = nn.Linear(seg_len, 1, bias=False)

    def key(self, top: Tensor) -> Tensor:
        self._check_len(top)
        return torch.einsum("...rd,r->...d", top, self.row_weight.weight[0])

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return self.key(window)


class Conv(Summary):
    """The authors' ``conv`` summary (``CRTN/layers/cache.py``): a strided Conv1d, d_key = d.

    Y [L, d] is viewed as H channels (H = ``n_head``) of L * (d/H) samples: channel h holds
    the h-th d/H-wide slice of every row, rows one after another. ``Conv1d(H, H,
    kernel_size=d/H, stride=L, padding=ceil((d/H - H)/2))`` maps it to H x d/H outputs,
    flattened to d. Output o of a channel reads d/H consecutive samples from o L - padding
    on, i.e. parts of one or two rows near row o L / (d/H): a strided subsampling of the
    segment, not a pooling. It needs H <= L and an output length of exactly d/H
    (:func:`conv_out_len`), which ``resolve_spec`` checks.

    """

    name, length_bound = "conv", True

    def __init__(self, seg_len: int, d_model: int, d_key: int | None = None, n_head: int = 1):
        super().__init__(seg_len, d_model, d_key=d_key, n_head=n_head)
        width = d_model // n_head
        self.conv = nn.Conv1d(
            n_head, n_head, kernel_size=width, stride=seg_len, padding=conv_padding(d_model, n_head)
        )

    @classmethod
    def resolve(cls, spec: SummarySpec, model: ModelSpec) -> SummarySpec:
        """As :meth:`Summary.resolve`, and the shapes the convolution needs (class docstring).

        Raises:
            ConfigError: d_model not divisible by n_head, n_head > tgt_len, or an output length
                other than d_model / n_head.
        """
        H, d, L = model.n_head, model.d_model, model.tgt_len
        if d % H != 0 or H > L or conv_out_len(L, d, H) != d // H:
            raise ConfigError(
                f"summary=conv needs model.d_model ({d}) divisible by model.n_head ({H}), n_head <= tgt_len "
                f"({L}) and a conv output of d_model/n_head = {d // H} per head (got {conv_out_len(L, d, H)})"
            )
        return super().resolve(spec, model)

    def key(self, top: Tensor) -> Tensor:
        self._check_len(top)
        *lead, L, d = top.shape
        H = self.n_head
        x = top.reshape(-1, L, H, d // H).transpose(1, 2).reshape(-1, H, L * (d // H))
        return self.conv(x).reshape(*lead, d)

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        return self.key(window)


def conv_padding(d_model: int, n_head: int) -> int:
    """Padding of the ``conv`` summary, ceil((d/H - H) / 2) (the authors' formula)."""
    return max(0, -(-(d_model // n_head - n_head) // 2))


def conv_out_len(seg_len: int, d_model: int, n_head: int) -> int:
    """Outputs per channel of the ``conv`` summary; it works only when this equals d / H."""
    width = d_model // n_head
    return (seg_len * width + 2 * conv_padding(d_model, n_head) - width) // seg_len + 1


#: token_max's n-gram length when ``summary.ngram`` is None (at most tgt_len; docs/results.md,
#: "Retrieval that scales")
DEFAULT_NGRAM = 4
#: token_max's row shift when ``summary.shift`` is None (docs/results.md, "Retrieval that scales")
DEFAULT_SHIFT = 1


class TokenMax(Summary):
    """Keys keep all L rows; score(q, slot) = max over rows of <q, row> / sqrt(d_key).

    With ``d_key`` set, queries and rows are first mapped by learned linear maps (d -> d_key,
    no bias), one for queries and one for rows: score = max_r <P_q q, P_k row_r> / sqrt(d_key).
    Two maps let a query match rows by other features than its own (e.g. a row's record of
    the tokens before it). Rows are views of the cached states, so P_k is applied when
    scoring and trains like P_q (a learned retrieval space). Without ``d_key`` the
    score is the plain dot product.

    With ``ngram`` w > 1 (``summary.ngram``) a token matches a row together with the w - 1
    tokens before each, aligned (an n-gram match instead of a single-state match):

        score(q_j, slot) = max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-a}> / sqrt(d_key)

    where q_{j-a} for j - a < 0 is a row of the previous segment's R (R_prev) and row_{r-a}
    for r - a < 0 a row of the slot holding the segment just before (zero where there is
    none: the first segment, or a predecessor evicted or never cached). The caller passes
    them in front: queries [B, w-1+L, d] and rows [B, n, w-1+Ls, d]. On the passage-recall
    corpus a top-layer state mostly encodes its own token, so a single-state match confuses
    the copy source with every earlier use of the token, and more so the larger the cache;
    w aligned tokens make a chance match rare (docs/results.md, "Retrieval that scales").

    With ``cosine`` (``summary.cosine``) every query and row is L2-normalised (after the maps P_q,
    P_k, if any) and the score is not divided by sqrt(d_key):

        score(q_j, slot) = max_r (1/w) sum_{a<w} cos(q_{j-a}, row_{r-s-a})

    so a row equal to the query scores 1, the most any row can: with ``cache.key_layer=0`` (the
    embeddings) the slot holding the query's own token, or its n-gram, always wins, whatever the
    norms of the embedding (a raw dot product <e_k, e_j> can exceed <e_k, e_k>). A zero row (no
    predecessor) scores 0. The scores lie in [-1, 1], so alpha is flatter than with dot products
    (docs/method.md §3, "Summaries"). The rows are normalised inside :func:`ngram_row_scores`: a
    normalised float32 copy of every scored row, except for a selection without gradient from
    bfloat16 rows, which divides each bfloat16 product by its row's norm instead (a score then
    within about 2^-7 of its float32 value; docs/method.md §3, "A selection in bfloat16").

    With ``shift`` s = 1 (``summary.shift``) a row is keyed by the w rows *before* it:

        score(q_j, slot) = max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-1-a}>

    so the slot that wins holds the row that *follows* the matched n-gram: the token to be
    copied next, which is what the attention must read. With s = 0 a match on a slot's last
    row selects the slot before the one holding the next token (docs/results.md, "Retrieval
    that scales"). The rows before a slot then number w - 1 + s.

    Args (beyond :class:`Summary`'s):
        ngram: w, aligned tokens per score (``summary.ngram``, resolved); shift: s, 0 or 1.
        cosine: cosine scores.
    """

    name, kinds, key_is_view, row_keys = "token_max", (TOKEN, GATE, LOOKUP), True, True
    #: what a checkpoint saved before ``summary.ngram``/``summary.shift`` existed was trained with
    LEGACY = {"ngram": 1, "shift": 0}
    reads = Summary.reads | {"d_key", "ngram", "shift", "cosine"}

    def __init__(
        self,
        seg_len: int,
        d_model: int,
        d_key: int | None = None,
        n_head: int = 1,
        *,
        ngram: int,
        shift: int,
        cosine: bool = False,
    ):
        super().__init__(seg_len, d_model, d_key=d_key, n_head=n_head)
        self.ngram, self.shift, self.cosine = ngram, shift, cosine
        self.proj_q = None if d_key is None else nn.Linear(d_model, d_key, bias=False)
        self.proj_k = None if d_key is None else nn.Linear(d_model, d_key, bias=False)

    @classmethod
    def resolve(cls, spec: SummarySpec, model: ModelSpec) -> SummarySpec:
        """``summary.ngram`` None becomes :data:`DEFAULT_NGRAM` (at most ``tgt_len``) and
        ``summary.shift`` None :data:`DEFAULT_SHIFT`; ``summary.d_key`` None stays (no learned map).

        Raises:
            ConfigError: an option token_max does not read set (:meth:`Summary.check_reads`),
                ngram outside 1..tgt_len, shift other than 0 or 1, d_key <= 0.
        """
        cls.check_reads(spec)
        ngram = min(DEFAULT_NGRAM, model.tgt_len) if spec.ngram is None else spec.ngram
        shift = DEFAULT_SHIFT if spec.shift is None else spec.shift
        if not 1 <= ngram <= model.tgt_len:
            raise ConfigError(f"summary.ngram={ngram} must be in 1..model.tgt_len ({model.tgt_len})")
        if shift not in (0, 1):
            raise ConfigError(f"summary.shift={shift} must be 0 or 1")
        if spec.d_key is not None and spec.d_key <= 0:
            raise ConfigError(f"summary.d_key={spec.d_key} must be > 0")
        return replace(spec, ngram=ngram, shift=shift)

    @classmethod
    def from_spec(cls, spec: SummarySpec, model: ModelSpec) -> Summary:
        return cls(
            model.tgt_len,
            model.d_model,
            d_key=spec.d_key,
            n_head=model.n_head,
            ngram=spec.ngram,
            shift=spec.shift,
            cosine=spec.cosine,
        )

    @property
    def d_key(self) -> int:
        return self.d_model if self.proj_q is None else self.proj_q.out_features

    @property
    def d_query(self) -> int:
        return self.d_model

    def key(self, top: Tensor) -> Tensor:
        return top

    @property
    def scale(self) -> float:
        """The factor of every score: 1/sqrt(d_key), or 1 for cosine scores."""
        return 1.0 if self.cosine else 1.0 / math.sqrt(self.d_key)

    def _map_rows(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows (or pooled rows, or the lead-in) mapped by P_k, if any. Plain rows stay in their
        storage dtype and are not normalised here: :func:`ngram_row_scores` casts them chunk by
        chunk, or multiplies bfloat16 rows in bfloat16, and scores them at unit length with
        ``cosine``, instead of a normalised copy of the whole cache layer in ``dtype``."""
        return rows if self.proj_k is None else self.proj_k(rows.to(dtype))

    def _map_query(self, query: Tensor) -> Tensor:
        query = query if self.proj_q is None else self.proj_q(query)
        return F.normalize(query, dim=-1) if self.cosine else query

    def score(
        self,
        query: Tensor,
        keys: Tensor,
        lead: Tensor | LeadIn | None = None,
        *,
        best_row: bool = False,
        top_k: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Scores [B, L, n] of queries [B, w-1+L, d] against rows [B, n, Ls, d] (w = ngram), with
        ``lead`` the rows before each slot (s = shift; needed when w-1+s > 0): [B, n, w-1+s, d],
        or named by the slots they come from (:class:`crtn.model.rowmatch.LeadIn`,
        SegmentCache._lead_in): :func:`ngram_row_scores` times :attr:`scale`. With ``best_row``
        the pair (scores, r*), r* [B, L, n] long the row of each slot that attains its score
        (with s = 1 the row that follows the matched n-gram; ``cache.pos=match``), with ``top_k``
        possibly only for the slots that can be among each query's top_k (-1 elsewhere)."""
        if isinstance(lead, Tensor):
            lead = self._map_rows(lead, query.dtype)
        query = self._map_query(query)
        keys = self._map_rows(keys, query.dtype)
        out = ngram_row_scores(
            query,
            keys,
            lead,
            ngram=self.ngram,
            shift=self.shift,
            cosine=self.cosine,
            best_row=best_row,
            top_k=top_k,
        )
        return (out[0] * self.scale, out[1]) if best_row else out * self.scale

    def score_selected(self, query: Tensor, keys: Tensor) -> Tensor:
        query = self._map_query(query)
        keys = self._map_rows(keys, query.dtype).to(query.dtype)
        keys = F.normalize(keys, dim=-1) if self.cosine else keys
        return torch.einsum("bld,blkrd->blkr", query, keys).amax(-1) * self.scale


#: every summary by its config name, in the order of docs/method.md §3
SUMMARIES: dict[str, type[Summary]] = {
    cls.name: cls for cls in (Identity, Linear, LastState, Mean, Max, Sum, WeightedSum, Conv, TokenMax)
}


def make_summary(name: str, seg_len: int, d_model: int, **options: object) -> Summary:
    """The summary registered as ``name`` (:data:`SUMMARIES`) built from plain values: ``options``
    are its constructor's keywords (``d_key``, ``n_head``; token_max: ``ngram``,
    ``shift``). Models build theirs from a resolved spec (:meth:`Summary.from_spec`).

    Raises:
        ConfigError: unknown name.
    """
    check_choice("summary.name", name, SUMMARIES)
    return SUMMARIES[name](seg_len, d_model, **options)
