"""token_max's chunked row match (crtn/model/rowmatch.py; docs/method.md §3, "Summaries") against
the naive per-token loop of tests/reference.py: scores, gradients of query, rows and lead-in rows
in float64, with chunks of one and several slots, and with maxima shared by several rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from crtn.app_config import BenchSpec
from crtn.model import rowmatch
from crtn.model.rowmatch import ngram_row_scores
from tests.helpers import load_tool
from tests.reference import naive_ngram_row_scores

CASES = [(1, 0), (1, 1), (2, 0), (3, 1), (4, 1)]  # (ngram w, shift s)
#: the bfloat16 paths as a CPU with bfloat16 units takes them, whatever this machine's CPU
#: (conftest.py; a CPU without them: test_hardware.py)
pytestmark = pytest.mark.usefixtures("bf16_units")


def _inputs(
    w: int, s: int, *, G: int = 2, L: int = 4, n: int = 5, Ls: int = 3, d: int = 6, ties: bool = False
):
    """Random float64 queries [G, w-1+L, d], rows [G, n, Ls, d] and lead-in [G, n, w-1+s, d]; with
    ``ties`` every vector is one of three one-hot vectors, so equal maxima are common."""
    gen = torch.Generator().manual_seed(10 * w + s)

    def make(*shape: int) -> torch.Tensor:
        if ties:
            pick = torch.randint(0, 3, shape[:-1], generator=gen)
            return torch.nn.functional.one_hot(pick, d).double().requires_grad_()
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    lead = make(G, n, w - 1 + s, d) if w - 1 + s > 0 else None
    return make(G, w - 1 + L, d), make(G, n, Ls, d), lead


def _check(w: int, s: int, ties: bool) -> None:
    query, rows, lead = _inputs(w, s, ties=ties)
    got = ngram_row_scores(query, rows, lead, ngram=w, shift=s)
    want = naive_ngram_row_scores(query, rows, lead, w, s)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    inputs = [t for t in (query, rows, lead) if t is not None]
    g_got = torch.autograd.grad((got * weight).sum(), inputs)
    g_want = torch.autograd.grad((want * weight).sum(), inputs)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _record_chunks(monkeypatch, check=None) -> list[tuple[int, int]]:
    """Record the slot span of every chunk :func:`rowmatch._chunk_sums` scores (after ``check`` of
    its rows, where given); ``monkeypatch.undo()`` restores it."""
    spans, chunk_sums = [], rowmatch._chunk_sums

    def spy(query, rows, lead, *, span, w, **kw):
        if check is not None:
            check(rows)
        spans.append(span)
        return chunk_sums(query, rows, lead, span=span, w=w, **kw)

    monkeypatch.setattr(rowmatch, "_chunk_sums", spy)
    return spans


@pytest.mark.parametrize("chunk", [1, 2, 1 << 21], ids=["one_slot", "two_slots", "one_chunk"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_row_match_equals_the_per_token_loop(monkeypatch, w, s, chunk):
    """Scores and gradients equal the naive loop's to 1e-10, whatever the chunking (a chunk of
    two slots leaves a last chunk of one: 5 slots)."""
    rows_per_slot = 3 + w - 1 + s
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", chunk * 2 * (w - 1 + 4) * rows_per_slot)
    _check(w, s, ties=False)


@pytest.mark.parametrize(("w", "s"), [(1, 0), (4, 1)])
def test_rows_of_another_dtype_are_cast_a_chunk_at_a_time(monkeypatch, w, s):
    """Rows stored in a narrower dtype than the query's (float32 against float64 here, as the cache's
    bfloat16 against float32 queries) are copied into the query's dtype one chunk of slots at a
    time, and that copy [G, slots, Ls, d] stays within CHUNK_ELEMENTS even where it is larger than
    the chunk's score block (d > w-1+L here, as at the standard sizes); the scores and the query's
    gradient equal those of the rows cast up front (to 1e-12: products of other shapes round alike
    but not bit for bit)."""
    query, rows, lead = _inputs(w, s, d=64)
    query = query.detach().requires_grad_()
    rows32 = rows.detach().float()
    lead32 = None if lead is None else lead.detach().float()
    G, n, Ls, d = rows.shape
    assert 2 * G * query.shape[1] * (Ls + w - 1 + s) < G * Ls * d  # per slot the copy is the larger
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * G * Ls * d)
    spans = _record_chunks(monkeypatch)
    got = ngram_row_scores(query, rows32, lead32, ngram=w, shift=s)
    (g_got,) = torch.autograd.grad(got.sum(), query)
    assert spans and all(i1 - i0 <= 2 for i0, i1 in spans)
    monkeypatch.undo()
    want = ngram_row_scores(
        query, rows32.double(), None if lead32 is None else lead32.double(), ngram=w, shift=s
    )
    (g_want,) = torch.autograd.grad(want.sum(), query)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # products of other shapes: rounding
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_without_gradient_the_scores_are_the_same(monkeypatch, w, s, ties):
    """Under ``torch.no_grad`` (a selection at alpha 1) and with inputs that need no gradient the
    match takes its forward-only path: the same scores as the naive loop to 1e-10, with chunks of
    two slots."""
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * 2 * (w - 1 + 4) * (3 + w - 1 + s))
    query, rows, lead = _inputs(w, s, ties=ties)
    want = naive_ngram_row_scores(query, rows, lead, w, s)
    with torch.no_grad():
        got = ngram_row_scores(query, rows, lead, ngram=w, shift=s)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-10)
    plain = [None if t is None else t.detach() for t in (query, rows, lead)]
    torch.testing.assert_close(ngram_row_scores(*plain, ngram=w, shift=s), want.detach(), rtol=0, atol=1e-10)


@pytest.mark.parametrize(("w", "s"), CASES)
def test_a_max_shared_by_rows_splits_its_gradient_as_amax(monkeypatch, w, s):
    """One-hot vectors make many maxima equal: each attaining row gets an equal part of the
    gradient, as torch.amax gives it (chunks of two slots, so tied and untied chunks mix)."""
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * 2 * (w - 1 + 4) * (3 + w - 1 + s))
    _check(w, s, ties=True)


def _unit(t: torch.Tensor | None, cosine: bool) -> torch.Tensor | None:
    """Rows at unit length where ``cosine`` (zero rows stay zero), as the cosine match scores them."""
    return t if t is None or not cosine else torch.nn.functional.normalize(t, dim=-1)


@pytest.mark.parametrize(("w", "s"), CASES)
def test_cosine_scores_rows_at_unit_length(monkeypatch, w, s):
    """``cosine``: scores and gradients (of the rows as given, through their normalisation) equal
    the naive loop's on the rows normalised by hand to 1e-10 in float64, with and without gradient
    (chunks of two slots); with the queries normalised too, every score lies in [-1, 1]."""
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * 2 * (w - 1 + 4) * (3 + w - 1 + s))
    query, rows, lead = _inputs(w, s)
    query = torch.nn.functional.normalize(query, dim=-1)
    got = ngram_row_scores(query, rows, lead, ngram=w, shift=s, cosine=True)
    want = naive_ngram_row_scores(query, _unit(rows, True), _unit(lead, True), w, s)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert float(got.detach().abs().max()) <= 1.0 + 1e-12
    inputs = [t for t in (rows, lead) if t is not None]
    for a, b in zip(torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(want.sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with torch.no_grad():
        plain = ngram_row_scores(query, rows, lead, ngram=w, shift=s, cosine=True)
    torch.testing.assert_close(plain, want.detach(), rtol=0, atol=1e-10)


#: the bfloat16 path one batch row at a time (its CPU form) and all rows in one product (its GPU form)
ROWS_AT_A_TIME = pytest.mark.parametrize("one_row", [True, False], ids=["row_by_row", "batched"])


def _rows_at_a_time(monkeypatch, one_row: bool, elements: int, G: int = 2) -> None:
    """Make the bfloat16 path take the given form and chunks of ``elements`` per batch row (its
    budget on a CPU, ``CHUNK_ELEMENTS_ROW``; the other paths' too)."""
    monkeypatch.setattr(rowmatch, "_one_row_at_a_time", lambda device: one_row)
    for budget in ("CHUNK_ELEMENTS_ROW", "CHUNK_ELEMENTS"):
        monkeypatch.setattr(rowmatch, budget, elements * (1 if one_row else G))


@ROWS_AT_A_TIME
@pytest.mark.parametrize("cosine", [False, True], ids=["dot", "cosine"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_bfloat16_rows_score_within_their_rounding(monkeypatch, w, s, cosine, one_row):
    """A selection from bfloat16 rows (``cache.dtype=bfloat16``, no gradient) multiplies in
    bfloat16: its scores equal the naive loop's in float64 on the bfloat16-rounded query and rows
    to within the rounding of each product to bfloat16 (unit roundoff 2^-8 of the largest
    product, under a tenth of the largest score: a wrong diagonal or scale errs by about a
    product), with chunks of two slots. With ``cosine`` the reference's rows are the rounded rows
    normalised in float64; the path scales each bfloat16 product by its row's reciprocal norm,
    itself rounded to bfloat16, so the bound is twice the unit roundoff (2^-7), and a product left
    unscaled errs by its row's norm. The float32 path on the same rows (cast up chunk by chunk)
    keeps the unrounded query. Row by row (a CPU) and all batch rows in one product (a GPU)."""
    _rows_at_a_time(monkeypatch, one_row, 2 * (w - 1 + 4) * (3 + w - 1 + s))
    query, rows, lead = (None if t is None else t.detach() for t in _inputs(w, s))
    query = _unit(query.float(), cosine)
    rows16 = rows.bfloat16()
    lead16 = None if lead is None else lead.bfloat16()
    got = ngram_row_scores(query, rows16, lead16, ngram=w, shift=s, cosine=cosine)
    assert got.dtype == torch.float32 and got.shape == (2, 4, 5)
    exact = [None if t is None else t.double() for t in (query.bfloat16(), rows16, lead16)]
    exact[1:] = [_unit(t, cosine) for t in exact[1:]]
    want = naive_ngram_row_scores(*exact, w, s)
    every = [exact[1].flatten(1, 2)] + ([] if lead is None else [exact[2].flatten(1, 2)])
    largest = max(float(torch.einsum("gqd,grd->gqr", exact[0], t).abs().max()) for t in every)
    bound = (2.0**-7 if cosine else 2.0**-8) * largest
    error = float((got.double() - want).abs().max())
    assert error <= bound < 0.1 * float(want.abs().max()), (error, bound)
    unrounded = naive_ngram_row_scores(query.double(), exact[1], exact[2], w, s)
    with torch.no_grad():  # the float32 path on the same rows is exact to float32's rounding
        full = ngram_row_scores(
            query, rows16.float(), None if lead is None else lead16.float(), ngram=w, shift=s, cosine=cosine
        )
    torch.testing.assert_close(full.double(), unrounded, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("w", "s"), CASES)
def test_bfloat16_rows_can_multiply_in_the_query_s_dtype_without_gradient(monkeypatch, w, s):
    """With ``bf16_products=False`` a selection from bfloat16 rows without gradient multiplies in
    the query's dtype: the scores equal those of the same rows cast up front, the
    rows are cast a chunk of slots at a time (chunks of two slots here), and the bfloat16 path is
    not taken (its products would err by about 2^-8 of their size, 1e-2 here; products of other
    shapes round alike to float32's 1e-6)."""
    query, rows, lead = (None if t is None else t.detach() for t in _inputs(w, s))
    query, rows16 = query.float(), rows.bfloat16()
    lead16 = None if lead is None else lead.bfloat16()
    G, _, Ls, d = rows.shape
    monkeypatch.setattr(
        rowmatch, "CHUNK_ELEMENTS", 2 * max(G * Ls * d, G * query.shape[1] * (Ls + w - 1 + s))
    )

    def stored(rows):
        assert rows.dtype == torch.bfloat16  # the caller's rows as stored, not a cast copy

    def refuse(*a, **kw):
        raise AssertionError("the bfloat16 products were taken")

    spans = _record_chunks(monkeypatch, check=stored)
    monkeypatch.setattr(rowmatch, "_row_max_bf16", refuse)
    with torch.no_grad():
        got = ngram_row_scores(query, rows16, lead16, ngram=w, shift=s, bf16_products=False)
    assert spans and all(i1 - i0 <= 2 for i0, i1 in spans)
    monkeypatch.undo()
    with torch.no_grad():
        want = ngram_row_scores(
            query, rows16.float(), None if lead16 is None else lead16.float(), ngram=w, shift=s
        )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@ROWS_AT_A_TIME
@pytest.mark.parametrize("cosine", [False, True], ids=["dot", "cosine"])
@pytest.mark.parametrize("chunk", [1, 2, 5], ids=["one_slot", "two_slots", "one_chunk"])
@pytest.mark.parametrize(("w", "s"), [(2, 0), (2, 1), (3, 1)])  # w-1+s <= Ls = 3
def test_lead_in_named_by_slot_scores_as_the_gathered_rows(monkeypatch, w, s, chunk, cosine, one_row):
    """A lead-in named by the slot it comes from (:class:`rowmatch.LeadIn`, the cache's) is read,
    row by row (a CPU), from the products of the slot stored before where that is its
    predecessor, and gathered when all batch rows run in one product (a GPU): scores within the
    bfloat16 rounding of the naive loop on the lead-in gathered by hand, and of the bfloat16 path
    given those gathered rows. Batch row 0 is a full ring (segments 5, 6, 2, 3, 4: slot 0 follows
    slot 4, slot 2 holds the oldest, with no predecessor); batch row 1 has segments 0, 1, 2, 4, 3
    (slots 3 and 4 follow slots other than the one before them); chunks of one, two and five
    slots, so a predecessor lies in the chunk before. With ``cosine`` the rows at unit length
    (the zero lead-in scores 0), within 2^-7 (the products and the norms rounded)."""
    _rows_at_a_time(monkeypatch, one_row, chunk * (w - 1 + 4) * (3 + w - 1 + s))
    query, rows, _ = (None if t is None else t.detach() for t in _inputs(w, s))
    query, rows16 = _unit(query.float(), cosine), rows.bfloat16()
    pred = torch.tensor([[4, 0, 0, 2, 3], [0, 0, 1, 4, 2]])
    found = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    n = w - 1 + s
    lead16 = torch.zeros(2, 5, n, 6, dtype=torch.bfloat16)
    for g in range(2):
        for i in range(5):
            if found[g, i]:
                lead16[g, i] = rows16[g, pred[g, i], 3 - n :]
    by_slot = rowmatch.LeadIn(pred, found, n)
    got = ngram_row_scores(query, rows16, by_slot, ngram=w, shift=s, cosine=cosine)
    exact = [query.bfloat16().double()] + [_unit(t.double(), cosine) for t in (rows16, lead16)]
    want = naive_ngram_row_scores(*exact, w, s)
    largest = max(
        float(torch.einsum("gqd,grd->gqr", exact[0], t.flatten(1, 2)).abs().max()) for t in exact[1:]
    )
    bound = (2.0**-7 if cosine else 2.0**-8) * largest
    assert float((got.double() - want).abs().max()) <= bound < 0.1 * float(want.abs().max())
    gathered = ngram_row_scores(query, rows16, lead16, ngram=w, shift=s, cosine=cosine)
    assert float((got - gathered).abs().max()) <= bound


@pytest.mark.parametrize("path", ["gradient", "no_gradient", "bfloat16_row_by_row", "bfloat16_batched"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_best_rows_are_the_first_rows_that_attain_each_max(monkeypatch, w, s, path):
    """``best_row`` (``cache.pos=match``) gives, for every query and slot, the first row whose
    n-gram sum is the max, as the naive loop finds it, on every path: with a gradient, without,
    and from bfloat16 rows (row by row and batched), with chunks of two slots. The vectors are
    small integers, so every product and sum is exact in bfloat16 and float32 and equal maxima are
    common: the first row must win where several attain the max. The scores are unchanged."""
    gen = torch.Generator().manual_seed(7 * w + s)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).double()  # noqa: E731
    query, rows = ints(2, w - 1 + 4, 6), ints(2, 5, 3, 6)
    lead = ints(2, 5, w - 1 + s, 6) if w - 1 + s > 0 else None
    want, want_rows = naive_ngram_row_scores(query, rows, lead, w, s, with_row=True)
    assert (want_rows > 0).any() and (want_rows < 2).any()  # not one row everywhere
    elements = 2 * (w - 1 + 4) * (3 + w - 1 + s)
    if path.startswith("bfloat16"):
        _rows_at_a_time(monkeypatch, path.endswith("by_row"), elements)
        query, rows, lead = query.float(), rows.bfloat16(), None if lead is None else lead.bfloat16()
    else:
        monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * elements)
    if path == "gradient":
        query.requires_grad_()
    got, got_rows = ngram_row_scores(query, rows, lead, ngram=w, shift=s, best_row=True)
    assert got_rows.dtype == torch.long
    assert torch.equal(got_rows, want_rows)
    # float32 scores: exact sums, rounded by the 1/w
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-12 if got.dtype == torch.float64 else 1e-6)


def _ring(seed: int, edit=None):
    """The ring of the lead-in test above for the best rows: 2 streams of 5 slots of 3 rows, small
    integers (exact in bfloat16), w = 2, s = 1, the lead-in of 2 rows named by slot (some slots
    follow no slot, or another than the one before), ``edit(query, rows)`` applied first; returns
    the queries, the rows, the :class:`rowmatch.LeadIn` and the naive loop's (scores, best rows)
    on the lead-in gathered by hand."""
    gen = torch.Generator().manual_seed(seed)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).double()  # noqa: E731
    w, s, n = 2, 1, 2
    query, rows = ints(2, w - 1 + 4, 6), ints(2, 5, 3, 6)
    if edit is not None:
        edit(query, rows)
    pred = torch.tensor([[4, 0, 0, 2, 3], [0, 0, 1, 4, 2]])
    found = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    lead = torch.zeros(2, 5, n, 6, dtype=torch.float64)
    for g in range(2):
        for i in range(5):
            if found[g, i]:
                lead[g, i] = rows[g, pred[g, i], 3 - n :]
    naive = naive_ngram_row_scores(query, rows, lead, w, s, with_row=True)
    return query, rows, rowmatch.LeadIn(pred, found, n), naive


def test_best_rows_of_slots_scored_again_from_their_lead_in():
    """From bfloat16 rows with a lead-in named by slot (:class:`rowmatch.LeadIn`) on a CPU, slots
    whose lead-in is not the slot before are scored again from their gathered rows; their best
    rows come from that second scoring: equal to the naive loop's on the lead-in gathered by hand
    (the ring of the lead-in test above; small integers, exact in bfloat16)."""
    query, rows, by_slot, (want, want_rows) = _ring(3)
    got, got_rows = ngram_row_scores(query.float(), rows.bfloat16(), by_slot, ngram=2, shift=1, best_row=True)
    assert torch.equal(got_rows, want_rows)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)  # float32 scores, 1/w rounded


def _top_k_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[G, L, n] bool: the slots scoring at least each query's k-th best over all slots (ties
    included): every slot a top-k selection can take, whatever its order among equal scores."""
    return scores >= scores.topk(k, dim=-1).values[..., -1:]


def _assert_candidate_rows(got_rows, want_rows, takeable) -> None:
    assert torch.equal(got_rows[takeable], want_rows[takeable])
    other = got_rows[~takeable]
    assert ((other == -1) | (other == want_rows[~takeable])).all()
    assert (other == -1).any()  # the rows of the slots no selection takes are left out


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("path", ["no_gradient", "bfloat16_row_by_row"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_best_rows_for_a_top_k_cover_every_slot_it_can_take(monkeypatch, w, s, path, k):
    """With ``top_k`` (a selection of k slots per query reads the best rows of those alone) the
    CPU paths without a gradient find the rows of the slots that can be among each query's top k
    only: equal to the naive loop's first best rows at every slot that scores at least the k-th
    best over all slots, ties included, -1 at (some of) the others, with chunks of k + 1 slots
    so that a chunk's k-th best differs from the whole row's. Small integers: exact sums, many
    ties."""
    gen = torch.Generator().manual_seed(11 * w + s + k)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).double()  # noqa: E731
    query, rows = ints(2, w - 1 + 6, 6), ints(2, 7, 3, 6)
    lead = ints(2, 7, w - 1 + s, 6) if w - 1 + s > 0 else None
    want, want_rows = naive_ngram_row_scores(query, rows, lead, w, s, with_row=True)
    elements = (k + 1) * (w - 1 + 6) * (3 + w - 1 + s)  # chunks of k + 1 slots
    if path.startswith("bfloat16"):
        _rows_at_a_time(monkeypatch, True, elements)
        query, rows, lead = query.float(), rows.bfloat16(), None if lead is None else lead.bfloat16()
    else:
        monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", 2 * elements)
    got, got_rows = ngram_row_scores(query, rows, lead, ngram=w, shift=s, best_row=True, top_k=k)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-12 if got.dtype == torch.float64 else 1e-6)
    _assert_candidate_rows(got_rows, want_rows, _top_k_slots(want, k))


@pytest.mark.parametrize("k", [1, 2])
def test_best_rows_for_a_top_k_of_slots_scored_again_from_their_lead_in(k):
    """The same from bfloat16 rows with a lead-in named by slot, where slots whose lead-in is not
    the slot before are scored again after their chunk: a first score from a wrong (zero)
    lead-in must not decide which other slots of the chunk are candidates. The ring of the test
    above, with the scored-again slots' zero-lead-in scores made the largest of their chunks by
    queries equal to their rows' first row."""

    def first_row_is_a_query(query, rows):  # slot 2 of stream 0 follows no slot: scored again
        rows[0, 2, 0] = query[0, 1]

    query, rows, by_slot, (want, want_rows) = _ring(5 + k, first_row_is_a_query)
    got, got_rows = ngram_row_scores(
        query.float(), rows.bfloat16(), by_slot, ngram=2, shift=1, best_row=True, top_k=k
    )
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    _assert_candidate_rows(got_rows, want_rows, _top_k_slots(want, k))


@pytest.mark.parametrize("w", [1, 2, 3, 5, 6, 7, 8])
def test_diagonal_window_sums_equal_the_loop(w):
    """The doubling window sums of the bfloat16 path, out[i, j] = sum_{b<w} x[i + b, j + b],
    against a plain loop over b (float64), for window lengths of one to three binary digits."""
    x = torch.randn(3, 11, 9, generator=torch.Generator().manual_seed(w), dtype=torch.float64)
    want = sum(x[:, b : b + 12 - w, b : b + 10 - w] for b in range(w))
    torch.testing.assert_close(rowmatch._diagonal_sums(x, w), want, rtol=0, atol=1e-12)


def test_a_max_shared_by_two_rows_by_hand():
    """q = e0 against a slot of rows e0, e0, e1 (w = 1, s = 0): score 1, attained by rows 0 and 1,
    so each gets half the gradient, d score / d row = q / 2 for rows 0 and 1, 0 for row 2; and
    d score / d q = (row_0 + row_1) / 2 = e0."""
    e = torch.eye(2, dtype=torch.float64)
    query = e[None, :1].clone().requires_grad_()  # [1, 1, 2]
    rows = torch.stack([e[0], e[0], e[1]])[None, None].clone().requires_grad_()  # [1, 1, 3, 2]
    score = ngram_row_scores(query, rows, None, ngram=1, shift=0)
    assert score.item() == 1.0
    g_query, g_rows = torch.autograd.grad(score.sum(), [query, rows])
    torch.testing.assert_close(g_query[0, 0], e[0], rtol=0, atol=0)
    torch.testing.assert_close(g_rows[0, 0], torch.stack([e[0] / 2, e[0] / 2, 0 * e[0]]), rtol=0, atol=0)


def test_missing_lead_in_is_refused():
    query, rows, _ = _inputs(2, 1)
    with pytest.raises(ValueError, match="2 lead-in rows"):
        ngram_row_scores(query, rows, None, ngram=2, shift=1)
    # a lead-in named by slot longer than a slot (Ls = 3): refused, not read from before the slot
    pred, found = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    query, rows, _ = _inputs(4, 1)
    with pytest.raises(ValueError, match="a lead-in of 4 rows from slots of 3"):
        ngram_row_scores(query, rows, rowmatch.LeadIn(pred, found, 4), ngram=4, shift=1)


def test_the_bench_tool_s_unchunked_reference_agrees_and_its_smoke_run_completes():
    """tools/bench_row_match.py times the chunked match against its unchunked formula: that formula
    gives the same scores and gradients (float64), and the score section runs at tiny sizes."""
    tool = load_tool("bench_row_match")
    query, rows, lead = _inputs(4, 1)
    got = ngram_row_scores(query, rows, lead, ngram=4, shift=1)
    want = tool.unchunked_row_scores(query, rows, lead, ngram=4, shift=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    g_got = torch.autograd.grad(got.sum(), query)[0]
    torch.testing.assert_close(g_got, torch.autograd.grad(want.sum(), query)[0], rtol=0, atol=1e-10)
    s = replace(BenchSpec(), batch=1, d_model=8, tgt_len=4, n_slot=2)
    (row,) = tool.bench_score(s, [3], rounds=1, device=torch.device("cpu"))
    assert row["n_slot"] == 3 and row["chunked_ms"] > 0 and row["unchunked_ms"] > 0


def _at_rows(
    query: torch.Tensor, rows: torch.Tensor, lead: torch.Tensor | None, where: torch.Tensor, w: int, s: int
):
    """The n-gram sum (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}> at the given row r = where[g, j, i]
    of each slot, a function linear in the query (float64): its gradient is the one the max
    passes to that row alone. Returns [G, L, n]."""
    G, n = rows.shape[:2]
    ext = rows if lead is None else torch.cat([lead, rows], 2)  # row m of a slot at n_lead + m
    n_lead = 0 if lead is None else lead.shape[2]
    L = query.shape[1] - w + 1
    g = torch.arange(G)[:, None, None]
    i = torch.arange(n)[None, None, :]
    total = 0
    for a in range(w):
        picked = ext[g, i, where - s - a + n_lead]  # [G, L, n, d]
        total = total + torch.einsum("gjd,gjid->gji", query[:, w - 1 - a : w - 1 - a + L], picked)
    return total / w


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("chunk", [2, 1 << 21], ids=["two_slots", "one_chunk"])
@pytest.mark.parametrize(("w", "s"), CASES)
def test_products_in_bfloat16_with_a_gradient(monkeypatch, w, s, chunk, ties):
    """``product_dtype=bfloat16`` (the best-row gate with the cache's bfloat16 products, with
    ``bf16_products=False`` as it passes): with a gradient and without, the scores are bit for
    bit the same (evaluation selects as training does) and within 2^-8 of the largest product of
    the float64 loop on the bfloat16-rounded query and rows (each product rounded once). The max passes its gradient to one row, the one
    the forward pass found (ties, common in bfloat16, are not split): the query's gradient is
    that of the n-gram sum at that row in float64 on the rounded inputs, to within 2·2^-8 of its
    terms' absolute sum (the incoming gradient and the product each rounded to bfloat16). That
    row attains the max of the rounded products. With ``ties`` (one-hot vectors: exact in
    bfloat16, many equal maxima) the scores are exact, and an even split of the gradient would
    err by half of it."""
    monkeypatch.setattr(rowmatch, "CHUNK_ELEMENTS", chunk * 2 * (w - 1 + 4) * (3 + w - 1 + s))
    query, rows, lead = (None if t is None else t.detach() for t in _inputs(w, s, ties=ties))
    query = query.float().requires_grad_()
    rows16, lead16 = rows.bfloat16(), None if lead is None else lead.bfloat16()
    kw = {"ngram": w, "shift": s, "product_dtype": torch.bfloat16, "best_row": True, "bf16_products": False}
    got, where = ngram_row_scores(query, rows16, lead16, **kw)
    with torch.no_grad():
        plain, plain_where = ngram_row_scores(query, rows16, lead16, **kw)
    assert got.dtype == torch.float32 and torch.equal(plain, got.detach()) and torch.equal(plain_where, where)
    exact = [None if t is None else t.double() for t in (query.detach().bfloat16(), rows16, lead16)]
    want = naive_ngram_row_scores(*exact, w, s)
    every = [exact[1].flatten(1, 2)] + ([] if lead is None else [exact[2].flatten(1, 2)])
    largest = max(float(torch.einsum("gqd,grd->gqr", exact[0], t).abs().max()) for t in every)
    assert float((got.detach().double() - want).abs().max()) <= 2.0**-8 * largest
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    (g_got,) = torch.autograd.grad((got * weight).sum(), query)
    q64 = exact[0].clone().requires_grad_()
    w64 = weight.bfloat16().double()
    (g_want,) = torch.autograd.grad((_at_rows(q64, exact[1], exact[2], where, w, s) * w64).sum(), q64)
    absq = q64.detach().abs().requires_grad_()
    ab = [None if t is None else t.abs() for t in exact[1:]]
    (terms,) = torch.autograd.grad((_at_rows(absq, ab[0], ab[1], where, w, s) * w64.abs()).sum(), absq)
    assert bool(((g_got.double() - g_want).abs() <= 2 * 2.0**-8 * terms + 1e-30).all())
    if ties:  # the sums exact (then 1/w in float32); the gradient's sums over slots still rounded
        torch.testing.assert_close(got.detach().double(), want, rtol=2**-23, atol=0)
    else:
        assert not torch.equal(g_got.double(), g_want)  # the bfloat16 path ran: its rounding shows
    at_where = _at_rows(exact[0], exact[1], exact[2], where, w, s)
    assert float((at_where - want).abs().max()) <= 2.0**-8 * largest  # a best row of the rounded sums
