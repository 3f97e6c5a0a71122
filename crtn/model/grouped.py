"""Products with retrieved rows, grouped by slot (docs/method.md §3, "Efficient main pass").

Every token t of a segment retrieves k cached slots, and its attention needs, per head, the
products of its folded query (a d-vector, ``retrieved.py``) with the Ls rows of each slot, and
later the probability-weighted sum of those rows. Gathering the k·Ls rows of d per token costs
B·L·k·Ls·d reads per product, four products per layer (two forward, two backward), and splits
the arithmetic into one tiny product per token.

Here the (token, slot) pairs are grouped by slot, as MoBA groups the queries of a block
(Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs"): the
pairs of one slot are cut into tiles of P pairs, and each tile is one dense product of its
P·H query rows with the slot's Ls rows. A slot's rows are read once per tile instead of once
per token; what is gathered per pair is the folded query (H·d values) or a probability row
(H·Ls values). The pairs' results go back to the tokens' layout [T, H, k·Ls] (position p·Ls + r:
row r of the token's p-th slot, oldest first), where the joint softmax with the memory and the
current segment runs as before, so the position of a row (which depends on the rank p of its
slot among the token's selections) never enters the grouping.

P is chosen per selection from a cost model (:func:`choose_tile`): a tile costs its padded
P·H·Ls·d multiply-adds and the read of the slot's rows; with many tokens on few slots large
tiles waste nothing, with selections spread over many slots small ones pad less. On a CPU the
tiles run in chunks whose rows and operands (4 MB) are read into reused buffers (large fresh
allocations cost page faults on every call).

The products run in a dtype of their own (``dtype``; ``cache.product_dtype``), by default the
dtype the cache stores: bfloat16 rows are multiplied as stored, with the per-token operands
rounded to bfloat16 and the results rounded to bfloat16 before they return in the operands'
dtype, as bfloat16 autocast rounds a matrix product. A CPU with bfloat16 instructions runs
these products faster than float32's, but only in calls of many tiles: 16-bit products run in
chunks of :data:`CHUNK_VALUES_16` values (the step's cost: docs/results.md, "Products in
bfloat16").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: tile sizes tried (pairs per tile); the largest is also capped by the largest group
TILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
#: cost of reading one tile's rows (Ls·d values), in units of one padded pair of that tile (H·Ls·d
#: multiply-adds); a rough value: on the development machine's CPU, at the standard sizes with
#: selections spread over the slots, tiles of 2, 4 and 8 pairs ran within noise of each other
ROW_READ_PAIRS = 4.0
#: values (rows and operands) per chunk of tiles on a CPU: 4 MB in float32; the CRTN authors'
#: model, whose cache is float32, stepped 0.1-0.2x of Transformer-XL's step faster than with
#: chunks of 1 MB, whose calls were many and small (docs/results.md, "Chunks of float32 products")
CHUNK_VALUES = 1 << 20
#: the same for 16-bit products (4 MB): on the development machine's CPU a bfloat16 batched
#: product of a few tiles costs about what float32's does, and gains only at a hundred tiles or
#: more; a step with selection inside attention peaks inside one such chunk, and chunks of twice
#: this ran no faster (docs/results.md, "Peak step memory on the CPU, each allocation counted once")
CHUNK_VALUES_16 = 1 << 21
#: the most rows' values a product may gather token by token (:func:`pairs_of`; 512 MB in bfloat16):
#: above it, as with long segments, large k or many streams, the products group by slot instead
GATHER_VALUES = 1 << 28


@dataclass
class SlotGroups:
    """The (token, slot) pairs of a selection, grouped by slot into tiles of ``size`` pairs.

    Pair i = t·k + p is token t's p-th selected slot. Shapes: T tokens (rows of the selection),
    k slots per token, n_t tiles of P pairs.

    Attributes:
        n_tokens: T; k: slots per token; size: P, pairs per tile.
        slots: [n_t] long, the slot (row of the cache layer ``values``) each tile reads.
        place: [T·k] long, where pair i sits in the tiles' pair layout [n_t·P].
        pair: [n_t·P] long, the pair at each tile position (T·k for padding).
        token: [n_t·P] long, the token at each tile position (0 for padding, whose products are
            never read).
    """

    n_tokens: int
    k: int
    size: int
    slots: Tensor
    place: Tensor
    pair: Tensor
    token: Tensor

    @classmethod
    def of(cls, index: Tensor, size: int | None = None) -> SlotGroups:
        """Group the selection ``index`` [T, k] (rows of a cache layer) by slot, in tiles of
        ``size`` pairs (None: :func:`choose_tile`).

        Raises:
            ValueError: ``size`` < 1.
        """
        T, k = index.shape
        dev = index.device
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        slot, count = torch.unique_consecutive(flat[order], return_counts=True)
        size = choose_tile(count) if size is None else size
        if size < 1:
            raise ValueError(f"tile size {size} must be >= 1")
        tiles = (count + size - 1) // size  # [n_groups]
        start = torch.cumsum(count, 0) - count  # first sorted pair of each group
        group = torch.repeat_interleave(torch.arange(len(count), device=dev), count)
        rank = torch.arange(T * k, device=dev) - start[group]  # a pair's place in its group
        first = (torch.cumsum(tiles, 0) - tiles)[group]  # its group's first tile
        place = torch.empty_like(flat)
        place[order] = first * size + rank
        n_tiles = int(tiles.sum())
        pair = torch.full((n_tiles * size,), T * k, dtype=torch.long, device=dev)
        pair[place] = torch.arange(T * k, device=dev)
        token = torch.where(pair < T * k, pair // k, 0)
        slots = torch.repeat_interleave(slot, tiles)
        return cls(T, k, size, slots=slots, place=place, pair=pair, token=token)

    @property
    def n_tiles(self) -> int:
        """Tiles of the grouping: one dense product each, over one slot's rows."""
        return self.slots.shape[0]

    def _chunk(self, values: Tensor, width: int, dtype: torch.dtype) -> int:
        """Tiles per chunk: on a CPU :data:`CHUNK_VALUES` values of rows and operands (``width``
        values per pair), so that the reused buffers stay in cache, or :data:`CHUNK_VALUES_16`
        for products in a 16-bit ``dtype``; on a GPU all of them."""
        per_tile = values.shape[1] * values.shape[2] + self.size * width
        limit = CHUNK_VALUES_16 if dtype.itemsize == 2 else CHUNK_VALUES
        return self.n_tiles if values.is_cuda else max(1, min(self.n_tiles, limit // per_tile))

    @staticmethod
    def _buffers(values: Tensor, c: int, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """Reused buffers for the rows of ``c`` tiles: as stored, and cast to ``dtype`` (None
        where the cache stores ``dtype``)."""
        rows = values.new_empty(c, *values.shape[1:])
        return rows, None if values.dtype == dtype else torch.empty_like(rows, dtype=dtype)

    def _rows(
        self, values: Tensor, bufs: tuple[Tensor, Tensor | None], tiles: slice, *, normalize: bool, eps: float
    ) -> Tensor:
        """The rows of the slots of ``tiles`` [n, Ls, d], read into the buffers ``bufs``
        (:meth:`_buffers`: cast to the compute dtype where the cache stores another) and with
        ``normalize`` given a parameter-free LayerNorm (pre-LN)."""
        slots = self.slots[tiles]
        buf, cast = bufs
        z = torch.index_select(values, 0, slots, out=buf[: len(slots)])
        if cast is not None:
            z = cast[: len(slots)].copy_(z)
        return F.layer_norm(z, (z.shape[-1],), eps=eps) if normalize else z

    def to_rows(
        self, x: Tensor, values: Tensor, *, normalize: bool, eps: float, dtype: torch.dtype
    ) -> Tensor:
        """Products of each token's vectors with its slots' rows: x [T, H, d] -> [T, H, k·Ls],
        out[t, h, p·Ls + r] = x[t, h] · Z_{t,p}[r] (Z_{t,p}: the rows of token t's p-th slot in
        ``values`` [S, Ls, d]), computed in ``dtype``, returned in x's."""
        T, H, d = x.shape
        P, Ls = self.size, values.shape[1]
        out_dtype, x = x.dtype, x.to(dtype)
        c = self._chunk(values, H * d, dtype)
        tiles = x.new_empty(self.n_tiles, P * H, Ls)
        zbufs, qbuf = self._buffers(values, c, x.dtype), x.new_empty(c * P, H, d)
        for s in range(0, self.n_tiles, c):
            e = min(self.n_tiles, s + c)
            z = self._rows(values, zbufs, slice(s, e), normalize=normalize, eps=eps)
            q = torch.index_select(x, 0, self.token[s * P : e * P], out=qbuf[: (e - s) * P])
            torch.bmm(q.view(e - s, P * H, d), z.transpose(1, 2), out=tiles[s:e])
        return self._by_token(tiles, H).to(out_dtype).transpose(1, 2).reshape(T, H, self.k * Ls)

    def from_rows(
        self, y: Tensor, values: Tensor, *, normalize: bool, eps: float, dtype: torch.dtype
    ) -> Tensor:
        """Each token's mixture of its slots' rows: y [T, H, k·Ls] -> [T, H, d], out[t, h] =
        sum_{p,r} y[t, h, p·Ls + r] Z_{t,p}[r] (the adjoint of :meth:`to_rows`), computed in
        ``dtype``, returned in y's. Each chunk of tiles writes its results straight to the pairs'
        layout [T·k, H, d] (padding to one spare row), so neither the padded tiles' results nor a
        second copy of them in the tokens' layout is ever held; then a sum over the k slots in
        y's dtype, slot by slot (no [T, k, H, d] copy in y's dtype)."""
        T, H, _ = y.shape
        P, (Ls, d) = self.size, values.shape[1:]
        pairs = y.new_empty(T * self.k + 1, H, Ls, dtype=dtype)  # the last row: padding's zeros
        pairs[-1].zero_()
        pairs[:-1].view(T, self.k, H, Ls).copy_(y.view(T, H, self.k, Ls).transpose(1, 2))  # cast here
        c = self._chunk(values, H * (Ls + d), dtype)
        mixed = pairs.new_empty(T * self.k + 1, H, d)  # by pair; the last row takes the padding's
        zbufs, wbuf = self._buffers(values, c, dtype), pairs.new_empty(c * P, H, Ls)
        rbuf = pairs.new_empty(c, P * H, d)
        for s in range(0, self.n_tiles, c):
            e = min(self.n_tiles, s + c)
            z = self._rows(values, zbufs, slice(s, e), normalize=normalize, eps=eps)
            at = self.pair[s * P : e * P]
            w = torch.index_select(pairs, 0, at, out=wbuf[: (e - s) * P])
            res = torch.bmm(w.view(e - s, P * H, Ls), z, out=rbuf[: e - s])
            mixed.index_copy_(0, at, res.view(-1, H, d))
        by_token = mixed[:-1].view(T, self.k, H, d)
        # the sum's own buffer where it adds more slots; with k = 1 the pairs are the tokens and
        # ``mixed`` is returned as it is where the dtypes agree
        out = by_token[:, 0].to(y.dtype, copy=self.k > 1)
        for p in range(1, self.k):
            out += by_token[:, p]
        return out

    def _by_token(self, tiles: Tensor, n_head: int) -> Tensor:
        """The tiles' results [n_t, P·H, X] in the tokens' layout [T, k, H, X]: pair i = t·k + p
        is tiles' pair row ``place[i]``; padding rows are left out."""
        X = tiles.shape[-1]
        return tiles.view(-1, n_head, X).index_select(0, self.place).view(self.n_tokens, self.k, n_head, X)


@dataclass(frozen=True)
class TokenRows:
    """The (token, slot) pairs of a selection read token by token: the same products as
    :class:`SlotGroups` (``to_rows``, ``from_rows``, the adjoint of each other), each token's k·Ls
    rows gathered and multiplied with its operand in one batched product. Its shapes depend
    only on the selection's [T, k], so building it costs no host sync and no sorting: the form
    for a GPU, whose step is the launching of its kernels and where a gather of T·k·Ls·d values
    is cheap (:func:`pairs_of`). On a CPU the gather is the cost the grouping removes.

    Attributes:
        index: [T, k] long, each token's k slots (rows of the cache layer).
    """

    index: Tensor

    @classmethod
    def of(cls, index: Tensor) -> TokenRows:
        """The pairs of the selection ``index`` [T, k] (rows of a cache layer), as :meth:`SlotGroups.of`."""
        return cls(index)

    def _rows(self, values: Tensor, *, normalize: bool, eps: float, dtype: torch.dtype) -> Tensor:
        """Each token's k·Ls rows [T, k·Ls, d] of ``values`` [S, Ls, d] in ``dtype`` (slot p's rows
        at p·Ls ..), with ``normalize`` given a parameter-free LayerNorm (pre-LN)."""
        (T, k), (Ls, d) = self.index.shape, values.shape[1:]
        z = values.index_select(0, self.index.reshape(-1)).to(dtype)
        z = F.layer_norm(z, (d,), eps=eps) if normalize else z
        return z.view(T, k * Ls, d)

    def to_rows(
        self, x: Tensor, values: Tensor, *, normalize: bool, eps: float, dtype: torch.dtype
    ) -> Tensor:
        """:meth:`SlotGroups.to_rows`: x [T, H, d] -> [T, H, k·Ls] in x's dtype."""
        z = self._rows(values, normalize=normalize, eps=eps, dtype=dtype)
        return torch.bmm(x.to(dtype), z.transpose(1, 2)).to(x.dtype)

    def from_rows(
        self, y: Tensor, values: Tensor, *, normalize: bool, eps: float, dtype: torch.dtype
    ) -> Tensor:
        """:meth:`SlotGroups.from_rows`: y [T, H, k·Ls] -> [T, H, d] in y's dtype (the sum over
        the k slots inside the one product, in ``dtype``'s accumulation)."""
        z = self._rows(values, normalize=normalize, eps=eps, dtype=dtype)
        return torch.bmm(y.to(dtype), z).to(y.dtype)


def pairs_of(index: Tensor, rows: tuple[int, int]) -> SlotGroups | TokenRows:
    """The pairs of the selection ``index`` [T, k] of slots of ``rows`` = (Ls, d) in the form for
    their device and size: read token by token (:class:`TokenRows`) off the CPU, where the
    grouping's data-dependent tile counts cost host syncs in a step that is the launching of its
    kernels, unless the gathered rows would exceed :data:`GATHER_VALUES`; grouped by slot
    (:class:`SlotGroups`) otherwise (docs/method.md §3, "Efficient main pass"; docs/results.md,
    "The selection without per-row loops or host syncs on the GPU")."""
    gathered = index.numel() * rows[0] * rows[1]
    if index.device.type == "cpu" or gathered > GATHER_VALUES:
        return SlotGroups.of(index)
    return TokenRows.of(index)


def choose_tile(count: Tensor) -> int:
    """The tile size for groups of ``count`` [n_groups] pairs: the P of :data:`TILE_SIZES` (or the
    largest group, when smaller) that minimises sum_g ceil(c_g / P) (P + ROW_READ_PAIRS), the
    padded pairs plus the reads of the tiles' rows, in units of one pair's products. Ties go
    to the smaller tile."""
    c = count.to("cpu", torch.long)
    largest = int(c.max())
    sizes = torch.tensor([P for P in TILE_SIZES if P < largest] + [min(largest, TILE_SIZES[-1])])
    tiles = ((c[None, :] + sizes[:, None] - 1) // sizes[:, None]).sum(1)  # [n_sizes]
    cost = tiles.double() * (sizes.double() + ROW_READ_PAIRS)
    return int(sizes[int(cost.argmin())])  # the first minimum: the smaller tile


class _TileProduct(torch.autograd.Function):
    """:meth:`SlotGroups.to_rows` (``to_rows``) or :meth:`SlotGroups.from_rows` of x with the
    rows of the cache layer ``values`` (gradient-stopped); each is the other's backward, which
    reads the rows again instead of saving them, in the same ``dtype``. ``values`` is saved with
    ``save_for_backward`` (no copy), so a backward pass after the cache was renewed in place
    raises autograd's "modified by an inplace operation" error instead of silently using the new
    values."""

    @staticmethod
    def forward(ctx, x, values, groups, to_rows, normalize, eps, dtype):  # noqa: D102
        ctx.groups, ctx.to_rows, ctx.normalize, ctx.eps, ctx.dtype = groups, to_rows, normalize, eps, dtype
        ctx.save_for_backward(values)
        product = groups.to_rows if to_rows else groups.from_rows
        return product(x, values, normalize=normalize, eps=eps, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (values,) = ctx.saved_tensors
        g: SlotGroups | TokenRows = ctx.groups
        adjoint = g.from_rows if ctx.to_rows else g.to_rows
        # to_rows gathers its operand's rows from any layout (the mixture's gradient arrives
        # transposed: no copy of it); from_rows views its operand's last dim as [k, Ls], which
        # not every layout allows
        grad = grad.contiguous() if ctx.to_rows else grad
        dx = adjoint(grad, values, normalize=ctx.normalize, eps=ctx.eps, dtype=ctx.dtype)
        return dx, None, None, None, None, None, None


def grouped_product(
    x: Tensor,
    values: Tensor,
    groups: SlotGroups | TokenRows,
    *,
    to_rows: bool,
    normalize: bool = False,
    eps: float = 1e-5,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Products of per-token operands with the rows of each token's retrieved slots, grouped by
    slot (module docstring; docs/method.md §3, "Efficient main pass").

    Args:
        x: [T, H, d] (``to_rows``: scores of folded queries) or [T, H, k·Ls] (mixing weights).
        values: [S, Ls, d] one layer of the cache (gradient-stopped; cast to ``dtype``).
        groups: the selection's pairs grouped by slot (:meth:`SlotGroups.of`), or read token by
            token (:meth:`TokenRows.of`; :func:`pairs_of` picks by device).
        to_rows: True -> [T, H, k·Ls]; False -> [T, H, d].
        normalize, eps: a parameter-free LayerNorm of the rows (pre-LN).
        dtype: the products' dtype (module docstring); None: ``values``'s. The result is in x's.

    Raises:
        RuntimeError: from ``torch.bmm`` when the shapes above do not hold.
    """
    return _TileProduct.apply(x, values, groups, to_rows, normalize, eps, dtype or values.dtype)
