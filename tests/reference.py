"""Naive reference implementations for the tests.

Everything here is written from the formulas of docs/method.md §2-3 , with
explicit loops over tokens and batch rows, and shares nothing with ``crtn.model``
except the parameters it reads from a built model (and its embedding/softmax
modules, which ``test_adaptive.py`` checks separately). It is slow by design:
every token builds its context [retrieved segments; memory; current segment]
explicitly, every relative distance is computed from stream or context positions
and embedded with its own sinusoid, and the cache is a Python list of slots.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def sinusoid(dist: Tensor, d: int) -> Tensor:
    """R_dist = [sin(dist w), cos(dist w)], w_i = 10000^(-2i/d): dist [C] -> [C, d] (float64)."""
    ang = dist.to(torch.float64)[:, None] * _inv_freq(d)[None, :]
    return torch.cat([ang.sin(), ang.cos()], -1)


@functools.cache
def _inv_freq(d: int) -> Tensor:
    """w_i = 10000^(-2i/d) of :func:`sinusoid`, once per width (a constant, read-only)."""
    return 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def _ln(x: Tensor, ln) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps)


def attend_token(
    attn,
    h_j: Tensor,
    rows: Tensor,
    val_scale: Tensor,
    dist: Tensor,
    u: Tensor,
    v: Tensor,
    clamp_len: int,
    match_dist: Tensor | None = None,
) -> Tensor:
    """Attention of one query token over an explicit context (Dai et al. 2019, eq. A_rel; docs/method.md §2-3).

    A_c = (q + u).(W_kE x_c) + (q + v).(W_kR R_{dist_c});  a = sum_c softmax(A/sqrt(dh))_c * s_c W_v x_c
    where x = LN(row) for pre_lnorm else row, and s_c is the value scale (alpha for
    retrieved rows when weighted, else 1). With ``match_dist`` (``cache.pos=match``) a row c whose
    entry is >= 0 scores (q + v).(W_kR R_{match_dist_c}) on top.

    Args:
        h_j: [d] layer input of the query token; rows: [C, d] layer inputs of the context;
        val_scale: [C]; dist: [C] relative distances (query position - row position);
        match_dist: [C] the second distance of each row, -1 where it has none.

    Returns:
        [d] the attention sub-layer output (residual and LayerNorm applied).
    """
    H, dh = attn.n_head, attn.d_head
    d = h_j.shape[-1]
    w_q, w_k, w_v = attn.qkv_net.weight.view(3, H * dh, d)
    pre = attn.pre_lnorm
    xq = _ln(h_j, attn.layer_norm) if pre else h_j
    xr = _ln(rows, attn.layer_norm) if pre else rows
    q = (w_q @ xq).view(H, dh)
    k = (xr @ w_k.T).view(-1, H, dh)
    val = (xr @ w_v.T).view(-1, H, dh) * val_scale[:, None, None]
    dist = dist.clamp(max=clamp_len) if clamp_len > 0 else dist
    r = (sinusoid(dist, d).to(rows.dtype) @ attn.r_net.weight.T).view(-1, H, dh)
    score = torch.einsum("hd,chd->hc", q + u, k) + torch.einsum("hd,chd->hc", q + v, r)
    if match_dist is not None:
        has = match_dist >= 0
        m_dist = match_dist.clamp(min=0)
        m_dist = m_dist.clamp(max=clamp_len) if clamp_len > 0 else m_dist
        r2 = (sinusoid(m_dist, d).to(rows.dtype) @ attn.r_net.weight.T).view(-1, H, dh)
        score = score + torch.einsum("hd,chd->hc", q + v, r2) * has
    prob = torch.softmax(score / math.sqrt(dh), -1)
    out = attn.o_net(torch.einsum("hc,chd->hd", prob, val).reshape(H * dh))
    return h_j + out if pre else _ln(h_j + out, attn.layer_norm)


def feed_forward(ff, x: Tensor) -> Tensor:
    """Position-wise FF with residual and LayerNorm: x [d] -> [d]."""
    net = ff.CoreNet
    inner = lambda y: net[3](torch.relu(net[0](y)))  # noqa: E731
    if ff.pre_lnorm:
        return x + inner(_ln(x, ff.layer_norm))
    return _ln(x + inner(x), ff.layer_norm)


@dataclass
class Retrieved:
    """One retrieved segment of one token: states [n+1, Ls, d], weight, stream position, and the
    row r* that attains its token_max score (for ``cache.pos=match``)."""

    states: Tensor
    alpha: float | Tensor
    pos: int
    row: int | None = None


def naive_segment(
    model,
    tokens: Tensor,
    mem: list[Tensor] | None,
    t0: int,
    retrieved: list[list[Retrieved]] | None = None,
    pos_mode: str = "concat",
    weighted: bool = True,
    hide_mem: int = 0,
    same_length: bool = False,
    retrieve_from: int = 0,
) -> list[Tensor]:
    """Forward one segment of ONE stream, token by token.

    Args:
        tokens: [L] ids. mem: n+1 tensors [M, d] (memory at each layer input) or None.
        t0: stream position of tokens[0]; memory row r sits at t0 - M + r.
        retrieved: per token, its retrieved segments ordered oldest first (CRTN main pass).
        pos_mode: ``concat``: context positions are contiguous (retrieved rows then memory
            then segment); ``real``: true stream distances; ``match``: those of ``concat``, and a
            retrieved row r of a segment whose best match is row r* also at distance
            m + L + Ls + r* - r (m = ``model.mem_len``, L = ``model.tgt_len``).
        hide_mem: the first ``hide_mem`` memory rows are invisible (fixed_length_2).
        same_length: Transformer-XL's ``same_length``: when M + L > mem_len every token
            sees only the positions at distance < mem_len.
        retrieve_from: layers below this one (0-based) ignore ``retrieved`` (``cache.layers``).

    Returns:
        n+1 tensors [L, d]: the states at layers 0..n.
    """
    L = tokens.shape[0]
    M = 0 if mem is None else mem[0].shape[0]
    h = model.word_emb(tokens[None])[0]
    hs = [h]
    for layer_i, layer in enumerate(model.layers):
        attn = layer.dec_attn
        u = attn.r_w_bias if model.untie_r else model.r_w_bias
        v = attn.r_r_bias if model.untie_r else model.r_r_bias
        out = []
        for j in range(L):
            # the context's rows [retrieved; memory; segment up to j], each block a slice of its
            # states; a value scale and a distance (and with cache.pos=match a second one) per row
            rows, scale, dist, match = [], [], [], []
            segs = [] if retrieved is None or layer_i < retrieve_from else retrieved[j]
            n_ret = sum(s.states.shape[1] for s in segs)
            c = 0
            for seg in segs:
                Ls = seg.states.shape[1]
                rows.append(seg.states[layer_i])
                scale.append(torch.as_tensor(seg.alpha if weighted else 1.0, dtype=h.dtype).expand(Ls))
                for r in range(Ls):
                    if pos_mode == "real":
                        dist.append((t0 + j) - (seg.pos + r))
                    else:
                        dist.append((n_ret + M + j) - c)
                    if pos_mode == "match":
                        match.append(model.mem_len + model.tgt_len + Ls + seg.row - r)
                    c += 1
            if M > hide_mem:
                rows.append(mem[layer_i][hide_mem:])
            rows.append(h[: j + 1])
            dist += [(t0 + j) - (t0 - M + r) for r in range(hide_mem, M)] + [j - r for r in range(j + 1)]
            scale.append(torch.ones(M - hide_mem + j + 1, dtype=h.dtype))
            match += [-1] * (len(dist) - len(match))  # memory and segment rows: no second term
            rows_t, scale_t, dist_t = torch.cat(rows), torch.cat(scale), torch.tensor(dist)
            if same_length and M + L > model.mem_len:
                keep = torch.tensor([i for i, x in enumerate(dist) if x < model.mem_len])
                rows_t, scale_t, dist_t = rows_t[keep], scale_t[keep], dist_t[keep]
            m_dist = torch.tensor(match) if pos_mode == "match" else None
            a = attend_token(attn, h[j], rows_t, scale_t, dist_t, u, v, model.clamp_len, m_dist)
            out.append(feed_forward(layer.pos_ff, a))
        h = torch.stack(out)
        hs.append(h)
    return hs


# ----------------------------------------------------------------- CRTN recurrence
def naive_conv(summary, top: Tensor) -> Tensor:
    """The authors' conv summary from its definition, with explicit loops: Y [L, d] -> [d].

    Channel h's signal is x_h[r*w + c] = Y[r, h*w + c] (w = d/H), zero-padded by p on both
    sides; output o of channel g is bias[g] + sum_{h,c} W[g, h, c] * xpad_h[o*L + c].
    """
    L, d = top.shape
    conv = summary.conv
    H = conv.in_channels
    w, p, stride = d // H, conv.padding[0], conv.stride[0]
    n_out = (L * w + 2 * p - w) // stride + 1

    def xpad(h: int, i: int) -> Tensor:
        t = i - p
        return top[t // w, h * w + t % w] if 0 <= t < L * w else top.new_zeros(())

    out = []
    for g in range(H):
        for o in range(n_out):
            acc = conv.bias[g]
            for h in range(H):
                for c in range(w):
                    acc = acc + conv.weight[g, h, c] * xpad(h, o * stride + c)
            out.append(acc)
    return torch.stack(out)


def naive_summary(summary, top: Tensor, token_row: int | None) -> Tensor:
    """A summary of Y [L, d] from its definition (docs/method.md §3 table; the authors' sum, weighted_sum,
    conv); ``last_state`` takes row ``token_row`` (the last row for keys)."""
    name = summary.name
    if name == "identity":
        return top.reshape(-1)
    if name == "linear":
        return summary.proj.weight @ top.reshape(-1) + summary.proj.bias
    if name == "last_state":
        return top[-1 if token_row is None else token_row]
    if name == "mean":
        return top.sum(0) / top.shape[0]
    if name == "max":
        return top.max(0).values
    if name == "sum":
        return top.sum(0)
    if name == "weighted_sum":
        w = summary.row_weight.weight[0]
        return sum(w[r] * top[r] for r in range(top.shape[0]))
    if name == "conv":
        return naive_conv(summary, top)
    raise AssertionError(name)


def naive_key(summary, top: Tensor) -> Tensor:
    """Key of a slot from its top layer Y [Ls, d] (token_max: all rows)."""
    return top if summary.name == "token_max" else naive_summary(summary, top, None)


def naive_query_summary(summary, window: Tensor, token_row: int) -> Tensor:
    """q = summary(W_j), W_j [L, d]; ``last_state`` takes row ``token_row``."""
    if summary.name == "token_max":
        raise AssertionError("token_max has no window query")
    return naive_summary(summary, window, token_row)


def naive_score(summary, q: Tensor, key: Tensor) -> Tensor:
    """<q, k> / sqrt(d_key); token_max: max over the key's rows (after the learned map P of
    queries and rows when it has one; with ``summary.cosine`` the cosine, unscaled)."""
    if summary.name == "token_max":
        if summary.proj_q is not None:
            q, key = summary.proj_q.weight @ q, key @ summary.proj_k.weight.T  # [d_key, d] maps
        if summary.cosine:
            return max(_cos(q, row) for row in key)
        return (key @ q).max() / math.sqrt(q.shape[0])
    return (q @ key) / math.sqrt(q.shape[0])


def _cos(a: Tensor, b: Tensor) -> Tensor:
    """cos(a, b) = <a, b> / (|a| |b|); 0 when either is zero."""
    norm = a.norm() * b.norm()
    return a @ b / norm if norm > 0 else (a @ b) * 0


def naive_ngram_score(
    summary, qs: list[Tensor], j: int, rows: Tensor, lead: Tensor | None, with_row: bool = False
) -> Tensor | tuple[Tensor, int]:
    """token_max with ``summary.ngram`` w and ``summary.shift`` s: max over rows r of
    (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}> / sqrt(d_key) (with ``summary.cosine`` the cosine of
    each pair, unscaled), one term at a time. ``qs``: the queries of R_prev then R_cur ([L]
    each, j indexes R_cur); ``lead``: the predecessor slot's rows [Ls, d] or None (zero terms).
    ``with_row``: also the first row r that attains the max (r*)."""
    w, shift, L = summary.ngram, summary.shift, len(qs) // 2
    Ls, d = rows.shape
    best, best_r = None, -1
    for r in range(Ls):
        total = torch.zeros((), dtype=rows.dtype)
        for a in range(w):
            q = qs[L + j - a]
            if r - shift - a >= 0:
                row = rows[r - shift - a]
            elif lead is not None:
                row = lead[Ls + r - shift - a]
            else:
                continue
            if summary.proj_q is not None:
                q, row = summary.proj_q.weight @ q, summary.proj_k.weight @ row
            total = total + (_cos(q, row) if summary.cosine else q @ row)
        s = total / w if summary.cosine else total / w / math.sqrt(summary.d_key)
        if best is None or s > best:
            best, best_r = s, r
    return (best, best_r) if with_row else best


def naive_ngram_row_scores(
    query: Tensor, rows: Tensor, lead: Tensor | None, ngram: int, shift: int, with_row: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """token_max's unscaled row match, one dot product at a time (docs/method.md §3, "Summaries"):
    out[g, j, i] = max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>, with row_{-m} = lead[w-1+s-m]
    (the predecessor's last rows). The max is ``torch.amax`` over the per-row scores, so a max
    shared by several rows passes its gradient to each of them in equal parts.

    Args:
        query: [G, w-1+L, d]; rows: [G, n, Ls, d]; lead: [G, n, w-1+s, d] or None (w-1+s = 0).
        with_row: also the first row that attains each max (r*).

    Returns:
        [G, L, n], and with ``with_row`` r* [G, L, n] long.
    """
    G, Lq, _ = query.shape
    n, Ls = rows.shape[1], rows.shape[2]
    w, n_lead = ngram, ngram - 1 + shift
    out, best_rows = [], torch.zeros(G, Lq - w + 1, n, dtype=torch.long)
    for g in range(G):
        per_token = []
        for j in range(Lq - w + 1):
            per_slot = []
            for i in range(n):
                per_row = []
                best = None
                for r in range(Ls):
                    total = torch.zeros((), dtype=query.dtype)
                    for a in range(w):
                        m = r - shift - a
                        row = rows[g, i, m] if m >= 0 else lead[g, i, n_lead + m]
                        total = total + query[g, j + w - 1 - a] @ row
                    per_row.append(total / w)
                    if best is None or total > best:  # the first row that attains the max
                        best, best_rows[g, j, i] = total, r
                per_slot.append(torch.stack(per_row).amax())
            per_token.append(torch.stack(per_slot))
        out.append(torch.stack(per_token))
    return (torch.stack(out), best_rows) if with_row else torch.stack(out)


@dataclass
class Slot:
    states: Tensor  # [n+1, Ls, d]
    key: Tensor
    pos: int


def naive_alpha(s: Tensor, top: list[int], norm: str) -> dict[int, Tensor]:
    """Weights of the selected slots ``top`` from the scores s [n] (docs/method.md §3 step 2):
    ``all``: softmax over all slots; ``topk``: softmax over the selected scores; ``original``:
    k softmax of the selected entries of p = softmax(s) (the authors' code)."""
    if norm == "all":
        p = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
        return {i: p[i] for i in top}
    sel = torch.stack([s[i] for i in top])
    if norm == "original":
        p = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
        sel = torch.stack([p[i] for i in top])
    w = torch.exp(sel - sel.max()) / torch.exp(sel - sel.max()).sum()
    if norm == "original":
        w = len(top) * w
    return dict(zip(top, w))


def naive_evict(slots: list[Slot]) -> int:
    """Index of the slot to drop: the oldest (FIFO renewal)."""
    return min(range(len(slots)), key=lambda i: slots[i].pos)


@dataclass
class RowState:
    mem: list[Tensor] | None = None
    slots: list[Slot] = field(default_factory=list)
    r_prev: Tensor | None = None
    prev_tokens: Tensor | None = None
    stream: list[int] = field(default_factory=list)  # every token of the stream so far (query=lookup)


def naive_lookup(stream: list[int], p: int, slots: list[Slot], lengths: tuple[int, ...], shift: int):
    """``query=lookup``'s row for the token at stream position p (docs/method.md §3, "Lookup of
    the preceding tokens"), by brute force over every cached row: for the longest w in
    ``lengths`` such that some cached row at position P has x_{P-shift-w+1..P-shift} =
    x_{p-w+1..p} (all positions >= 0), the most recent such row, as (slot, row); None when no
    length occurs."""
    for w in sorted(lengths, reverse=True):
        if p - w + 1 < 0:
            continue
        want = stream[p - w + 1 : p + 1]
        best = None
        for slot in slots:
            for r in range(slot.states.shape[1]):
                end = slot.pos + r - shift
                if end - w + 1 >= 0 and stream[end - w + 1 : end + 1] == want:
                    if best is None or slot.pos + r > best[0].pos + best[1]:
                        best = (slot, r)
        if best is not None:
            return best
    return None


class NaiveCRTN:
    """The CRTN recurrence of docs/method.md §3 for one stream, written from the definitions.

    Uses the model's parameters and its config (strategy, summary, n_slot, top_k,
    alpha_norm, weighted, pos, query.detach). ``step`` returns the per-token NLL and, per token,
    the selected (slot position, alpha) pairs.
    """

    def __init__(self, model):
        self.m = model
        self.L = model.tgt_len
        self.row = RowState()

    def _pass(self, tokens, mem, t0, retrieved=None, hide_mem=0):
        c = self.m.spec.cache
        return naive_segment(
            self.m, tokens, mem, t0, retrieved, c.pos, c.weighted, hide_mem, retrieve_from=self.first
        )

    @property
    def first(self) -> int:
        """The first layer (0-based) that reads retrieved segments: 0, or n - cache.layers."""
        c = self.m.spec.cache
        return 0 if c.layers is None else self.m.n_layer - c.layers

    @property
    def key_layer(self) -> int:
        """The hidden layer of keys and queries: cache.key_layer, else the top (or the input of
        the first retrieving layer with cache.layers)."""
        c = self.m.spec.cache
        return c.key_layer if c.key_layer is not None else (self.first or self.m.n_layer)

    def _queries(self, tokens, r_cur, qmem, t0) -> list[Tensor]:
        """q_j for every token (docs/method.md §3 table; single_linear's tanh from the authors' code).
        ``query.detach``: no gradient into the query pass (R_cur, the fixed_length passes)."""
        m, qc = self.m, self.m.spec.query
        if qc.detach:
            r_cur = r_cur.detach()
        strategy = m.query.strategy
        if m.summary.ngram > 1 or m.summary.shift > 0:  # R_prev's rows too: the window reaches back
            r_prev = self.row.r_prev if self.row.r_prev is not None else torch.zeros_like(r_cur)
            r_cur = torch.cat([r_prev, r_cur], 0)
        if strategy == "token":
            return [r_cur[j] for j in range(r_cur.shape[0])]
        if strategy == "single_linear":
            proj = m.query.proj
            return [torch.tanh(proj.weight @ r_cur[j] + proj.bias) for j in range(r_cur.shape[0])]
        wins, rows = self._windows(tokens, r_cur, qmem, t0)
        return [naive_query_summary(m.summary, w, r) for w, r in zip(wins, rows)]

    def _windows(self, tokens, r_cur, qmem, t0):
        m, L, st = self.m, self.L, self.row
        detach = m.spec.query.detach
        strategy = m.query.strategy
        d = m.d_model
        r_prev = st.r_prev if st.r_prev is not None else torch.zeros(L, d, dtype=r_cur.dtype)
        G = torch.cat([r_prev, r_cur], 0)  # [2L, d]
        wins, rows = [], []
        for j in range(L):
            if strategy == "last_l":
                masked = G.clone()
                masked[L + j + 1 :] = 0
                wins.append(masked[L:])
                rows.append(j)
            elif strategy == "middle_l":
                wins.append(G[j + 1 : j + 1 + L])
                rows.append(L - 1)
            elif strategy == "linear":
                masked = G.clone()
                masked[L + j + 1 :] = 0
                lin = m.query.seq_linear
                wins.append(lin.weight @ masked + lin.bias[:, None])
                rows.append(j)
            elif strategy == "fixed_length_1":
                prev = st.prev_tokens if st.prev_tokens is not None else torch.zeros(L, dtype=tokens.dtype)
                raw = torch.cat([prev, tokens])[j + 1 : j + 1 + L]
                top = naive_segment(m, raw, None, 0)[self.key_layer]
                wins.append(top.detach() if detach else top)
                rows.append(L - 1)
            elif strategy == "fixed_length_2":
                prev_states = [x[-L:] for x in qmem]  # stored states of X_{t-1}
                t_j = naive_segment(m, tokens[: j + 1], prev_states, t0, hide_mem=j + 1)[self.key_layer]
                t_j = t_j.detach() if detach else t_j
                wins.append(torch.cat([r_prev[j + 1 :], t_j], 0))
                rows.append(L - 1)
            else:
                raise AssertionError(strategy)
        return wins, rows

    def _lead(self, slot: Slot) -> Tensor | None:
        """Key rows of the cached segment just before ``slot`` (stream position pos - Ls), if any."""
        for other in self.row.slots:
            if other.pos == slot.pos - slot.key.shape[0]:
                return other.key
        return None

    def step(self, tokens: Tensor, target: Tensor, t0: int):
        m, L, st = self.m, self.L, self.row
        c = m.spec.cache
        n = m.n_layer
        # 1. query pass: memory S, or the newest slot (X_{t-1}) when S is shorter than L
        if st.mem is not None and st.mem[0].shape[0] >= L:
            qmem = st.mem
        elif st.slots:
            newest = max(st.slots, key=lambda s: s.pos)
            qmem = [newest.states[i] for i in range(n + 1)]
        else:
            qmem = None
        if self.first == 0:  # a query pass over X_t without cache
            r_cur = self._pass(tokens, qmem, t0)[self.key_layer]
        else:  # cache.layers: the main pass's own states at or below the first retrieving layer
            r_cur = self._pass(tokens, st.mem, t0)[self.key_layer]
        selected: list[list[tuple[int, float]]] = [[] for _ in range(L)]
        retrieved = None
        st.stream += tokens.tolist()
        if st.slots and m.query.strategy == "lookup":
            retrieved = []
            for j in range(L):
                hit = naive_lookup(st.stream, t0 + j, st.slots, m.match_lengths, m.summary.shift)
                one = torch.ones((), dtype=r_cur.dtype)
                retrieved.append([] if hit is None else [Retrieved(hit[0].states, one, hit[0].pos, hit[1])])
                selected[j] = [] if hit is None else [(hit[0].pos, 1.0)]
        elif st.slots and m.top_k > 0:
            queries = self._queries(tokens, r_cur, qmem, t0)
            retrieved = []
            k = min(m.top_k, len(st.slots))
            for j in range(L):
                best_rows = [None] * len(st.slots)
                if c.pos == "match":  # token_max: each slot's best row too
                    qs = queries if len(queries) == 2 * L else [queries[0] * 0] * L + queries
                    scored = [
                        naive_ngram_score(m.summary, qs, j, sl.key, self._lead(sl), True) for sl in st.slots
                    ]
                    s = torch.stack([x for x, _ in scored])
                    best_rows = [r for _, r in scored]
                elif m.summary.ngram > 1 or m.summary.shift > 0:
                    s = torch.stack(
                        [naive_ngram_score(m.summary, queries, j, sl.key, self._lead(sl)) for sl in st.slots]
                    )
                else:
                    s = torch.stack([naive_score(m.summary, queries[j], sl.key) for sl in st.slots])
                # the k best; equal scores go to the most recent slot
                top = sorted(range(len(st.slots)), key=lambda i: (-float(s[i].detach()), -st.slots[i].pos))[
                    :k
                ]
                alpha = naive_alpha(s, top, c.alpha_norm)
                top = sorted(top, key=lambda i: st.slots[i].pos)  # oldest first
                retrieved.append(
                    [Retrieved(st.slots[i].states, alpha[i], st.slots[i].pos, best_rows[i]) for i in top]
                )
                selected[j] = [(st.slots[i].pos, float(alpha[i].detach())) for i in top]
        hs = self._pass(tokens, st.mem, t0, retrieved)
        logp = m.crit.log_prob(F.dropout(hs[-1], 0.0))
        nll = -logp.gather(-1, target[:, None])[:, 0]
        # 5. renewal: [S; H_t]; the oldest L positions that no longer fit in S become a slot
        M = 0 if st.mem is None else st.mem[0].shape[0]
        cat = [torch.cat([st.mem[i], hs[i]]) if M else hs[i] for i in range(n + 1)]
        over = M + L - m.mem_len
        if over > 0 and m.n_slot > 0:
            states = torch.stack([x[:over] for x in cat])
            key = naive_key(m.summary, states[self.key_layer]).detach()
            if len(st.slots) == m.n_slot:
                st.slots.pop(naive_evict(st.slots))
            st.slots.append(Slot(states.detach(), key, t0 - M))
        st.mem = [x[x.shape[0] - m.mem_len :].detach() for x in cat] if m.mem_len > 0 else None
        st.r_prev = r_cur.detach()
        st.prev_tokens = tokens
        return nll, selected
