"""token_max's row match, computed slot chunk by slot chunk (docs/method.md §3, "Summaries").

:func:`ngram_row_scores` is the score of ``summary=token_max`` (``crtn/model/summary.py``) and of
the ``token_max`` block key of selection inside attention (``crtn/model/gate.py``): for every
query j and slot i, max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>. It reads every row of every
slot, B L N L d multiply-adds per step; what this module removes is everything else that grew with
N L L: the score block of all slots, its w shifted copies and their gradients. Where no gradient
is needed (a selection at alpha 1, :func:`crtn.model.cache.alpha_is_one`) only the maxima are
kept, not the rows that attain them; with rows stored in bfloat16 (``cache.dtype=bfloat16``) that
selection multiplies in bfloat16 (:func:`_row_max_bf16`), as low-precision indexers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from crtn.model import hardware
from crtn.model.bestrow import chunk_maxima

#: elements of one chunk's score block [G, w-1+L, slots, w-1+s+Ls] in :func:`ngram_row_scores` (16 MiB
#: in float64), and of the chunk's rows copied into the query's dtype where they are stored in another
#: (:func:`_chunk_slots`): the slots are scored this many at a time, so memory does not grow with N L L
CHUNK_ELEMENTS = 1 << 21
#: the same off the CPU (a GPU: fewer, larger chunks, since each chunk launches some 20 kernels)
CHUNK_ELEMENTS_GPU = 1 << 25
#: the same for :func:`_row_max_bf16` on a CPU, one batch row at a time (4 MiB of float32 products
#: per chunk, and as much again for each pass of their window sums): at N = 1,024 a row match ran
#: 15% faster than in chunks of twice this (docs/results.md, "The folding in bfloat16")
CHUNK_ELEMENTS_ROW = 1 << 20


@dataclass(frozen=True)
class LeadIn:
    """The n rows before each slot named by the slot they come from: the last n rows of the slot
    whose segment ends where this one starts (``SegmentCache._lead_in``), zeros where none does.
    :func:`ngram_row_scores` reads them from the products of that slot's rows where it can
    (:func:`_row_max_bf16`; docs/method.md §3, "A selection in bfloat16") instead of gathering
    them.

    Attributes:
        pred: [G, n_slots] long, the slot (index into the rows' slot dim) before each slot.
        found: [G, n_slots] bool, False where no slot precedes (its lead-in is zeros).
        n: rows wanted (w-1+s, at most Ls).
    """

    pred: Tensor
    found: Tensor
    n: int

    def rows(self, rows: Tensor, at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The lead-in rows [G, n_slots, n, d] of ``rows`` [G, n_slots, Ls, d]; with ``at`` = (g, i),
        two [E] long indices, those of slots (g, i) alone: [E, n, d]."""
        G, _, Ls, _ = rows.shape
        if at is None:
            g, pred, found = torch.arange(G, device=rows.device)[:, None], self.pred, self.found
        else:
            g, pred, found = at[0], self.pred[at], self.found[at]
        lead = rows[g, pred, Ls - self.n :]
        return lead.mul_(found[..., None, None].to(lead.dtype))  # the gather made lead: no copy

    def follows(self) -> Tensor:
        """[G, n_slots] bool: whether a slot's lead-in is the end of the slot stored just before it
        (slot i - 1), the case :func:`_row_max_bf16` reads from its products."""
        before = torch.arange(self.pred.shape[1], device=self.pred.device) - 1
        return self.found & (self.pred == before)


def ngram_row_scores(
    query: Tensor,
    rows: Tensor,
    lead: Tensor | LeadIn | None,
    *,
    ngram: int,
    shift: int,
    cosine: bool = False,
    bf16_products: bool = True,
    best_row: bool = False,
    top_k: int | None = None,
    product_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The n-gram row match of token_max, unscaled: max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>
    (w = ngram, s = shift; :class:`crtn.model.summary.TokenMax`), for every query against every slot;
    with ``cosine`` every row (lead-in rows included) is scored at unit length, <q, row / |row|>
    (the caller normalises the queries; ``summary.cosine``).

    Computed slot chunk by slot chunk (docs/method.md §3, "Summaries", the computation): per chunk
    one product of the queries with the chunk's rows (and one with their lead-in rows), the w
    aligned diagonals summed as shifted slices, the max over rows, then 1/w; only the maxima and the
    rows that attain them are kept for the backward pass, so the memory of a call is
    O(G L N) plus one chunk (:data:`CHUNK_ELEMENTS`), not O(G L N L w). The cached rows are read in
    place (no copy of them per step). Equal to the unchunked max of the same products (the
    gradient of a max shared by several rows is split evenly among them, as ``torch.amax``
    splits it; equal means equal sums before the 1/w).

    Args:
        query: [G, w-1+L, d] the L queries with the w-1 before them in front.
        rows: [G, n, Ls, d] the rows of n slots (G independent batches: batch rows, head groups);
            any floating dtype (cast to the query's chunk by chunk; bfloat16 rows without gradient:
            the products in bfloat16, :func:`_row_max_bf16`, unless ``bf16_products`` is False).
        lead: [G, n, w-1+s, d] the rows before each slot (zeros where none), or the same named by
            their slots (:class:`LeadIn`), or None when w-1+s = 0.
        cosine: divide each product by its row's norm (a zero row scores 0). The rows are normalised
            in the query's dtype first, except on the bfloat16 path, which multiplies the rows as
            stored and scales each product by its row's reciprocal norm (:func:`_inverse_norms`)
            instead of writing a normalised copy of every row (docs/method.md §3, "A selection in
            bfloat16").
        bf16_products: where no gradient is needed, multiply rows stored in bfloat16 as stored
            (:func:`_row_max_bf16`) on a device that multiplies bfloat16 natively
            (:func:`crtn.model.hardware.multiplies_natively`; elsewhere, as with False);
            False: in the query's dtype, the rows cast chunk by chunk, as
            with a gradient (a caller whose training scores multiply in the query's dtype and
            whose evaluation must select as it trained).
        best_row: return the row that attains each max too (``cache.pos=match``, docs/method.md §3,
            "Positions of retrieved rows"): the first such row where several do.
        top_k: with ``best_row``, a selection of each query's top_k slots reads the rows of
            those alone: on a CPU without a gradient the rows are found only for the slots that
            can be among them (:func:`crtn.model.bestrow.candidate_rows`), -1 for the others,
            instead of an index-tracking max over the rows of every slot, the part of the match
            whose cost grows with N (docs/results.md, "Best rows of the candidate slots
            alone"). None: every slot's row.
        product_dtype: the dtype of the products <q, row> on the paths other than
            :func:`_row_max_bf16`, with a gradient and without (:class:`_Chunked`; a selection
            inside attention whose evaluation must select as it trained, in its
            ``cache.product_dtype``). None: the query's dtype.

    Returns:
        [G, L, n] in the query's dtype; with ``best_row`` the pair (scores, rows [G, L, n] long,
        each in 0..Ls-1, or -1 for a slot that ``top_k`` leaves out).

    Raises:
        ValueError: ``lead`` is None although w-1+s > 0, or its row count is not w-1+s, or a
            :class:`LeadIn` asks for more rows than a slot has.
    """
    n_lead = ngram - 1 + shift
    lead = _checked_lead(lead, n_lead, rows.shape[2])
    inputs = [query, rows] + ([lead] if isinstance(lead, Tensor) else [])
    no_grad = not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))  # alpha of 1
    bf16 = rows.dtype == torch.bfloat16 and query.dtype != torch.bfloat16
    if no_grad and bf16_products and bf16 and hardware.multiplies_natively(rows.dtype, rows.device):
        return _row_max_bf16(
            query, rows, lead, w=ngram, n_lead=n_lead, cosine=cosine, best_row=best_row, top_k=top_k
        )
    match = _Chunked(ngram=ngram, shift=shift, best_row=best_row, top_k=top_k, product_dtype=product_dtype)
    return match(query, rows, lead, cosine=cosine, no_grad=no_grad)


@dataclass(frozen=True)
class _Chunked:
    """:func:`ngram_row_scores` on its chunked paths (all but :func:`_row_max_bf16`; the fields as
    its arguments): :func:`_row_max` without a gradient or :class:`_NgramRowMax` with one.

    Their products run in ``product_dtype`` (None: the query's), as bfloat16 autocast runs a
    matrix product: the query rounded to it once, the rows cast to it chunk by chunk (read as
    stored where they are stored in it, copied into a contiguous block where it is 16-bit), each
    product's result in it; the n-gram sums, the max and the gradient's accumulation in the
    query's dtype, and the backward pass's products in ``product_dtype`` too (docs/results.md,
    "The best-row gate's products in bfloat16")."""

    ngram: int
    shift: int
    best_row: bool
    top_k: int | None
    product_dtype: torch.dtype | None

    def __call__(
        self, query: Tensor, rows: Tensor, lead: Tensor | LeadIn | None, *, cosine: bool, no_grad: bool
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Scores [G, L, n] (and with ``best_row`` the rows) of ``query`` against ``rows`` and their
        checked ``lead``-in; with ``cosine`` the rows normalised in the query's dtype first."""
        if cosine:
            rows = F.normalize(rows.to(query.dtype), dim=-1)
            lead = F.normalize(lead.to(query.dtype), dim=-1) if isinstance(lead, Tensor) else lead
        if isinstance(lead, LeadIn):  # these paths read the lead-in rows themselves
            lead = lead.rows(rows)
        w, pd = self.ngram, self.product_dtype or query.dtype
        if no_grad:
            return _row_max(
                query, rows, lead, w=w, best_row=self.best_row, top_k=self.top_k, product_dtype=pd
            )
        extra = [] if lead is None else [lead]
        scores, where = _NgramRowMax.apply(query, rows, w, self.shift, pd, *extra)
        return (scores, where) if self.best_row else scores


def _checked_lead(lead: Tensor | LeadIn | None, n_lead: int, seg_len: int) -> Tensor | LeadIn | None:
    """``lead`` checked against the n_lead = w-1+s rows per slot that :func:`ngram_row_scores`
    reads before each slot of ``seg_len`` rows; None where it reads none.

    Raises:
        ValueError: as :func:`ngram_row_scores`."""
    got = None if lead is None else lead.n if isinstance(lead, LeadIn) else lead.shape[2]
    if n_lead > 0 and got != n_lead:
        raise ValueError(
            f"ngram_row_scores: {n_lead} lead-in rows per slot needed (ngram-1+shift), got {got}"
        )
    if isinstance(lead, LeadIn) and lead.n > seg_len:
        raise ValueError(f"ngram_row_scores: a lead-in of {lead.n} rows from slots of {seg_len}")
    return lead if n_lead > 0 else None


def _chunk_slots(query: Tensor, rows: Tensor, n_lead: int, *, cast: bool = True) -> int:
    """Slots per chunk: a score block [G, Lq, slots, Ls + n_lead] (``n_lead`` lead-in rows per
    slot) of at most :data:`CHUNK_ELEMENTS` (:data:`CHUNK_ELEMENTS_GPU` off the CPU), and on the
    CPU, where ``cast`` and the rows are stored in another dtype than the query's, their copy in
    the query's dtype [G, slots, Ls, d] too (with d > Lq that copy is the larger; docs/results.md,
    "Peak step memory on the CPU, each allocation counted once"). Off the CPU the score block
    alone sets the chunk, as it was measured there: each chunk launches some 20 kernels.
    :func:`_row_max_bf16` multiplies the rows as stored (``cast=False``), on a CPU in chunks of
    :data:`CHUNK_ELEMENTS_ROW`."""
    cpu = query.device.type == "cpu"
    budget = (CHUNK_ELEMENTS if cast else CHUNK_ELEMENTS_ROW) if cpu else CHUNK_ELEMENTS_GPU
    G, Ls, d = query.shape[0], rows.shape[2], rows.shape[3]
    per_slot = G * query.shape[1] * (Ls + n_lead)
    if cpu and cast and rows.dtype != query.dtype:
        per_slot = max(per_slot, G * Ls * d)
    return max(1, budget // max(1, per_slot))


def _chunk_sums(
    query: Tensor,
    rows: Tensor,
    lead: Tensor | None,
    *,
    span: tuple[int, int],
    w: int,
    sums_dtype: torch.dtype | None = None,
) -> Tensor:
    """The unscaled n-gram sums sum_{a<w} <q_{j-a}, row_{r-s-a}> of slots span = (i0, i1) against
    every query: [G, L, i1-i0, Ls]. One product with the slots' rows and one with their lead-in
    rows, in the query's dtype (the rows cast to it); row r - s - a of a slot is row r - s - a of
    its rows when that is >= 0, else row w - 1 + s + (r - s - a) of its lead-in, so each diagonal
    a adds two shifted slices. The sums in ``sums_dtype`` (None: the query's)."""
    i0, i1 = span
    G, Lq, d = query.shape
    Ls = rows.shape[2]
    sums_dtype = sums_dtype or query.dtype
    block = _block(rows[:, i0:i1], query.dtype).reshape(G, -1, d)
    ext = torch.bmm(query, block.transpose(1, 2)).view(G, Lq, i1 - i0, Ls)
    if lead is None:  # w = 1, s = 0: the products themselves
        return ext.to(sums_dtype)
    before = torch.einsum("bqd,bnrd->bqnr", query, _block(lead[:, i0:i1], query.dtype))
    L, shift = Lq - w + 1, lead.shape[2] - (w - 1)
    total = ext.new_empty(G, L, i1 - i0, Ls, dtype=sums_dtype)
    for a in range(w):
        j, k = w - 1 - a, min(shift + a, Ls)  # queries j.. ; the first k rows read the lead-in
        if a == 0:
            total[..., :k] = before[:, j : j + L, :, j : j + k]
            total[..., k:] = ext[:, j : j + L, :, : Ls - k]
        else:
            total[..., :k] += before[:, j : j + L, :, j : j + k]
            total[..., k:] += ext[:, j : j + L, :, : Ls - k]
    return total


def _block(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A chunk's rows ``x`` (a slice of the slots) in the products' ``dtype``, contiguous where it
    is 16-bit: a CPU's bfloat16 product of a slice of the slots (batch stride N Ls d) ran 3x
    slower than the copy and the product together (docs/results.md, "The best-row gate's
    products in bfloat16"). A cast copies anyway; rows stored in ``dtype`` are copied then."""
    x = x.to(dtype)
    return x.contiguous() if dtype.itemsize == 2 else x


def _row_max(
    query: Tensor,
    rows: Tensor,
    lead: Tensor | None,
    *,
    w: int,
    best_row: bool = False,
    top_k: int | None = None,
    product_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`ngram_row_scores` where no gradient is needed: the chunks' maxima only (and with
    ``best_row`` the rows that attain them, with ``top_k`` on a CPU those of the candidate slots
    alone), without the check for ties that the backward pass of :class:`_NgramRowMax` reads.
    The products in ``product_dtype`` (None: the query's), as :class:`_NgramRowMax` runs them.
    Returns [G, L, n], or that and the rows [G, L, n] long."""
    G, Lq, _ = query.shape
    N = rows.shape[1]
    step = _chunk_slots(query, rows, 0 if lead is None else lead.shape[2])
    q = query.to(product_dtype or query.dtype)
    best = query.new_empty(G, Lq - w + 1, N)
    where = torch.empty(best.shape, dtype=torch.long, device=query.device) if best_row else None
    candidates = top_k is not None and query.device.type == "cpu"
    for i0 in range(0, N, step):
        i1 = min(N, i0 + step)
        sums = _chunk_sums(q, rows, lead, span=(i0, i1), w=w, sums_dtype=query.dtype)  # [G, L, n, Ls]
        at = (slice(None), slice(None), slice(i0, i1))
        chunk_maxima(  # in its layout: slots, rows, queries
            sums.permute(0, 2, 3, 1),
            best[at].permute(0, 2, 1),
            None if where is None else where[at].permute(0, 2, 1),
            top_k=top_k if candidates else None,
        )
    best = best * (1.0 / w) if w > 1 else best
    return best if where is None else (best, where)


def _row_max_bf16(
    query: Tensor,
    rows: Tensor,
    lead: Tensor | LeadIn | None,
    *,
    w: int,
    n_lead: int,
    cosine: bool,
    best_row: bool = False,
    top_k: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`_row_max` of bfloat16 rows (a cache stored in bfloat16): the query rounded to
    bfloat16, each product <q, row> in bfloat16 (float32 accumulation inside the product, its
    result rounded to bfloat16), the w products of an n-gram summed and the max taken in the
    query's dtype. A low-precision first stage, as DeepSeek-V3.2's lightning indexer scores in FP8:
    its scores differ from :func:`_row_max`'s on the same rows by the rounding of the query and of
    each product (about 2^-8 of their size), so slots that score within that of each other may
    swap places. With ``cosine`` each product is multiplied by its row's reciprocal norm
    (:func:`_inverse_norms`, rounded like a product) as it is written out of the product, before
    the n-gram sums: about 2^-7 of a score then.

    Per batch row and chunk of slots on a CPU, per chunk of slots for all batch rows at once
    elsewhere (:func:`_one_row_at_a_time`): one product of the slots' rows with the queries (rows
    by queries: torch's bfloat16 product is fast on a CPU with bfloat16 matrix units for one matrix
    at a time, not batched at these shapes; on a GPU a loop over batch rows would launch some ten
    kernels per row); a slot's n-gram sums are the diagonal window sums
    (:func:`_diagonal_sums`) of ``ext`` [w-1+s+Ls, Lq], its lead-in rows' products above its
    own. With a :class:`LeadIn` on a CPU the lead-in rows are the last rows of the slot stored
    before (the ring buffer writes a stream's segments in turn), so the chunk's product starts one
    slot earlier and ``ext`` is a view of it, overlapping the previous slot's rows; the few slots
    whose lead-in comes from elsewhere (the first slot, the oldest segment's: zeros) are scored
    again from their gathered lead-in, which finding them costs a host sync. Off the CPU the
    lead-in rows are gathered instead (:meth:`LeadIn.rows`): a cheap copy there, while a host sync
    stalls a step whose time is the launching of its kernels. ``n_lead``: w-1+s, the lead-in rows
    per slot (0 without ``lead``). Returns [G, L, n], and with ``best_row`` the rows [G, L, n]
    long that attain the maxima (the first of several equal ones; with ``top_k`` on a CPU those of
    the candidate slots alone, :func:`crtn.model.bestrow.candidate_rows`, -1 elsewhere)."""
    G, Lq, _ = query.shape
    N, Ls = rows.shape[1], rows.shape[2]
    L, by_pred = Lq - w + 1, isinstance(lead, LeadIn)
    one_row = _one_row_at_a_time(query.device)
    if by_pred and not one_row:  # off the CPU the gather is cheap, a host sync for the rest is not
        lead, by_pred = lead.rows(rows), False
    inv = _inverse_norms(rows) if cosine else None  # [G, N, Ls]
    inv_lead = _inverse_norms(lead) if cosine and isinstance(lead, Tensor) else None
    q_t = query.to(torch.bfloat16).transpose(1, 2)  # [G, d, Lq]
    step = _chunk_slots(query[:1] if one_row else query, rows, n_lead, cast=False)
    best = query.new_empty(G, N, L)
    where = torch.empty(best.shape, dtype=torch.long, device=query.device) if best_row else None
    candidates = top_k is not None and one_row
    scored = lead.follows() if candidates and by_pred else None  # the others are scored again below
    for gs in [slice(g, g + 1) for g in range(G)] if one_row else [slice(None)]:
        q_g = q_t[gs]  # [Gb, d, Lq]
        for i0 in range(0, N, step):
            i1 = min(N, i0 + step)
            if by_pred:
                inv_g = None if inv is None else inv[gs]
                ext = _ext_after_pred(
                    rows[gs], q_g, span=(i0, i1), n_lead=n_lead, inv=inv_g, dtype=query.dtype
                )
            else:
                at = (gs, slice(i0, i1))
                scales = (None if inv is None else inv[at], None if inv_lead is None else inv_lead[at])
                lead_at = None if lead is None else lead[at]
                ext = _ext_gathered(rows[at], lead_at, q_g, scales=scales, dtype=query.dtype)
            # query j (j + w - 1 of the Lq) against row r: sum_{b<w} ext[r + b, j + b], since row
            # r - s - a is ext's row n_lead + r - s - a = r + (w - 1 - a)
            chunk_maxima(
                _diagonal_sums(ext, w)[..., :Ls, :],
                best[gs, i0:i1],
                None if where is None else where[gs, i0:i1],
                top_k=top_k if candidates else None,
                scored=None if scored is None else scored[gs, i0:i1],
            )
    if by_pred:
        _score_unfollowed(rows, lead, q_t, w=w, cosine=cosine, out=(best, where))
    best = best.transpose(1, 2).contiguous()
    best = best.mul_(1.0 / w) if w > 1 else best
    return best if where is None else (best, where.transpose(1, 2).contiguous())


def _ext_gathered(
    rows: Tensor,
    lead: Tensor | None,
    q_g: Tensor,
    *,
    scales: tuple[Tensor | None, Tensor | None],
    dtype: torch.dtype,
) -> Tensor:
    """The products [Gb, n, n_lead + Ls, Lq] of n slots' rows [Gb, n, Ls, d] and their lead-in rows
    [Gb, n, n_lead, d] (or None) with the queries q_g [Gb, d, Lq], the lead-in's above the slot's
    own (row x: the slot's row x - n_lead), in ``dtype``; ``scales`` = the rows' and the lead-in's
    reciprocal norms [Gb, n, Ls] and [Gb, n, n_lead] (cosine) or None (:func:`_row_max_bf16`)."""
    Gb, n, Ls, d = rows.shape
    n_lead, Lq = 0 if lead is None else lead.shape[2], q_g.shape[2]
    ext = q_g.new_empty(Gb, n, n_lead + Ls, Lq, dtype=dtype)
    _put(ext[:, :, n_lead:], _products(rows.reshape(Gb, -1, d), q_g).view(Gb, n, Ls, Lq), scales[0])
    if lead is not None:
        _put(ext[:, :, :n_lead], _products(lead.reshape(Gb, -1, d), q_g).view(Gb, n, n_lead, Lq), scales[1])
    return ext


def _ext_after_pred(
    rows: Tensor, q_g: Tensor, *, span: tuple[int, int], n_lead: int, inv: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """The products [Gb, n, n_lead + Ls, Lq] of slots span = (i0, i1) with the queries q_g
    [Gb, d, Lq], each slot's lead-in read as the last n_lead rows of the slot stored before it
    (:func:`_row_max_bf16`): one product of slots i0-1 .. i1-1 (rows [Gb, N, Ls, d], scaled by
    ``inv`` [Gb, N, Ls] where given) and a view of it in which slot i starts n_lead rows before
    its own, in ``dtype`` (the query's). Slot 0 has no slot before it: zeros there
    (:func:`_score_unfollowed` scores it again)."""
    (i0, i1), (Gb, _, Ls, d), Lq = span, rows.shape, q_g.shape[2]
    n, j0 = i1 - i0, max(i0 - 1, 0)
    prod = q_g.new_empty(Gb, n + 1, Ls, Lq, dtype=dtype)
    if i0 == 0:
        prod[:, 0].zero_()
    part = _products(rows[:, j0:i1].reshape(Gb, -1, d), q_g).view(Gb, -1, Ls, Lq)
    _put(prod[:, 1 - (i0 - j0) :], part, None if inv is None else inv[:, j0:i1])
    return prod.as_strided((Gb, n, n_lead + Ls, Lq), ((n + 1) * Ls * Lq, Ls * Lq, Lq, 1), (Ls - n_lead) * Lq)


def _score_unfollowed(
    rows: Tensor, lead: LeadIn, q_t: Tensor, *, w: int, cosine: bool, out: tuple[Tensor, Tensor | None]
) -> None:
    """Score again, in :func:`_row_max_bf16`'s way, the slots whose lead-in is not the end of the
    slot stored just before them (:meth:`LeadIn.follows`), from their gathered lead-in rows:
    rows [G, N, Ls, d] bfloat16, q_t [G, d, Lq] the bfloat16 queries; writes their maxima into
    out = (best [G, N, L], rows attaining them [G, N, L] or None). Finding them is a host sync."""
    best, where = out
    Ls, Lq = rows.shape[2], q_t.shape[2]
    g_e, i_e = (~lead.follows()).nonzero(as_tuple=True)  # host sync: a few slots per batch row
    if not len(g_e):
        return
    block = torch.cat([lead.rows(rows, at=(g_e, i_e)), rows[g_e, i_e]], 1)  # [E, n_lead + Ls, d]
    ext = best.new_empty(len(g_e), lead.n + Ls, Lq)
    _put(ext, torch.bmm(block, q_t[g_e]), _inverse_norms(block) if cosine else None)
    top, arg = _diagonal_sums(ext, w)[:, :Ls].max(1)
    best[g_e, i_e] = top
    if where is not None:
        where[g_e, i_e] = arg


def _one_row_at_a_time(device: torch.device) -> bool:
    """Whether :func:`_row_max_bf16` multiplies one batch row at a time (a CPU: one bfloat16 matrix
    product per call is what its bfloat16 units run fast) or all batch rows in one batched product
    per chunk of slots (a GPU, where each call is a kernel launch)."""
    return device.type == "cpu"


def _products(rows: Tensor, q_t: Tensor) -> Tensor:
    """rows [Gb, R, d] times q_t [Gb, d, Lq] -> [Gb, R, Lq]: one matrix product where Gb = 1."""
    return torch.mm(rows[0], q_t[0])[None] if rows.shape[0] == 1 else torch.bmm(rows, q_t)


def _inverse_norms(rows: Tensor, eps: float = 1e-12) -> Tensor:
    """1 / max(|row|, eps) for bfloat16 rows [..., d] -> [...] float32, the divisor of
    ``F.normalize`` (a zero row scores 0). The norm is accumulated in float32 inside torch's
    bfloat16 reduction and rounded to bfloat16 (relative error at most 2^-8): asking the
    reduction for a float32 result instead casts every row to float32 first, a copy that costs
    as much as the one this path avoids."""
    return torch.linalg.vector_norm(rows, dim=-1).float().clamp_min_(eps).reciprocal_()


def _put(out: Tensor, products: Tensor, scale: Tensor | None) -> None:
    """out = products [..., R, C] in out's dtype, each row times scale [..., R] where given."""
    if scale is None:
        out.copy_(products)
    else:
        torch.mul(products, scale[..., None], out=out)


def _diagonal_sums(x: Tensor, w: int) -> Tensor:
    """Window sums along the diagonals of the last two dims: out[..., i, j] = sum_{b<w}
    x[..., i + b, j + b], for x [..., R, C] -> [..., R - w + 1, C - w + 1]. By doubling: the windows
    of 1, 2, 4, ... terms, each the sum of two of the one before, and w the sum of those of its
    binary digits: about log2(w) passes over x instead of w."""
    R, C = x.shape[-2:]
    out, done, window, span = None, 0, x, 1
    while True:
        if w & span:
            part = window[..., done : done + R - w + 1, done : done + C - w + 1]
            out = part if out is None else out + part
            done += span
        if 2 * span > w:
            return out
        window = window[..., :-span, :-span] + window[..., span:, span:]  # windows of 2 * span terms
        span *= 2


class _NgramRowMax(torch.autograd.Function):
    """:func:`ngram_row_scores` with a chunked forward and a backward that rebuilds each chunk's
    gradient from the rows that attain the max (recomputing only chunks where several do); the
    products of both in ``dtype`` (the sums, maxima and gradients in the query's). With products
    in a narrower dtype than the query's, a max shared by several rows passes its gradient to the
    first of them, as ``torch.max`` does (a subgradient of the max as valid as the even split):
    sums of bfloat16-rounded products tie often, and the split would score every chunk again."""

    @staticmethod
    def forward(ctx, query, rows, w, shift, dtype, lead=None):  # type: ignore[override]
        G, Lq, _ = query.shape
        N = rows.shape[1]
        L = Lq - w + 1
        step = _chunk_slots(query, rows, 0 if lead is None else lead.shape[2])
        q = query.to(dtype)
        split = dtype.itemsize >= query.dtype.itemsize  # ties split evenly (class docstring)
        best = query.new_empty(G, L, N)
        where = torch.empty(G, L, N, dtype=torch.long, device=query.device)
        tied = []  # per chunk where ties split: whether several rows attain a max (no host sync)
        for i0 in range(0, N, step):
            i1 = min(N, i0 + step)
            sums = _chunk_sums(q, rows, lead, span=(i0, i1), w=w, sums_dtype=query.dtype)
            top, arg = sums.max(-1)
            best[:, :, i0:i1], where[:, :, i0:i1] = top, arg
            if split:
                second = sums.scatter_(-1, arg[..., None], float("-inf")).amax(-1)  # the max elsewhere
                tied.append((second == top).any())
        if w > 1:  # the max of the sums, then 1/w: the max of the scaled sums (rounding is monotone)
            best *= 1.0 / w
        ctx.w, ctx.step, ctx.has_lead, ctx.dtype, ctx.split = w, step, lead is not None, dtype, split
        saved = (
            [query, rows, where] + ([] if lead is None else [lead]) + ([torch.stack(tied)] if split else [])
        )
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(where)
        return best, where

    @staticmethod
    def backward(ctx, grad, _grad_where=None):  # type: ignore[override]
        query, rows, where, *rest = ctx.saved_tensors
        lead = rest[0] if ctx.has_lead else None
        tied = rest[-1] if ctx.split else None  # per chunk: whether several rows attain a max
        w, step, pd = ctx.w, ctx.step, ctx.dtype
        G, Lq, d = query.shape
        N, Ls = rows.shape[1], rows.shape[2]
        L = Lq - w + 1
        n_lead, shift = (0, 0) if lead is None else (lead.shape[2], lead.shape[2] - (w - 1))
        need_q, need_rows = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_lead = lead is not None and ctx.needs_input_grad[5]
        g_query = torch.zeros_like(query) if need_q else None
        g_rows = torch.zeros(rows.shape, dtype=query.dtype, device=rows.device) if need_rows else None
        g_lead = torch.zeros(lead.shape, dtype=query.dtype, device=lead.device) if need_lead else None
        grad = grad * (1.0 / w)
        q = query.detach().to(pd)
        for c, i0 in enumerate(range(0, N, step)):
            i1 = min(N, i0 + step)
            n, g, arg = i1 - i0, grad[:, :, i0:i1], where[:, :, i0:i1, None]
            g_ext = query.new_zeros(G, Lq, n, Ls)  # d score / d <q, row>
            g_before = query.new_zeros(G, Lq, n, n_lead) if lead is not None else None  # and lead rows
            if ctx.split and tied[c]:  # several rows attain a max: split evenly (as torch.amax does)
                sums = _chunk_sums(q, rows.detach(), lead, span=(i0, i1), w=w, sums_dtype=query.dtype)
                at = (sums == sums.gather(-1, arg)).to(query.dtype)
                weight = at * (g / at.sum(-1))[..., None]
                for a in range(w):  # the transpose of the diagonal sums
                    j, k = w - 1 - a, min(shift + a, Ls)
                    g_ext[:, j : j + L, :, : Ls - k] += weight[..., k:]
                    if g_before is not None:
                        g_before[:, j : j + L, :, j : j + k] += weight[..., :k]
            else:  # one row each: diagonal a puts g on row arg - s - a (a lead-in row if < 0)
                for a in range(w):
                    j, k = w - 1 - a, min(shift + a, Ls)
                    in_rows = arg >= k
                    g_ext[:, j : j + L].scatter_add_(-1, (arg - k).clamp(min=0), g[..., None] * in_rows)
                    if g_before is not None:
                        col = (arg + j).clamp(max=n_lead - 1)
                        g_before[:, j : j + L].scatter_add_(-1, col, g[..., None] * ~in_rows)
            g_ext = g_ext.view(G, Lq, n * Ls).to(pd)
            g_before = None if g_before is None else g_before.to(pd)
            if g_query is not None:
                g_query += torch.bmm(g_ext, _block(rows[:, i0:i1], pd).reshape(G, n * Ls, d))
                if g_before is not None:
                    g_query += torch.einsum("bqnr,bnrd->bqd", g_before, _block(lead[:, i0:i1], pd))
            if g_rows is not None:
                g_rows[:, i0:i1] = torch.bmm(g_ext.transpose(1, 2), q).view(G, n, Ls, d)
            if g_lead is not None:
                g_lead[:, i0:i1] = torch.einsum("bqnr,bqd->bnrd", g_before, q)
        if g_rows is not None:
            g_rows = g_rows.to(rows.dtype)
        if g_lead is not None:
            g_lead = g_lead.to(lead.dtype)
        return g_query, g_rows, None, None, None, g_lead
