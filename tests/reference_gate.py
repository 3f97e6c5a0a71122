"""Naive reference of selection inside attention (``query=gate``), per token and per head.

Written from the definitions of docs/method.md §3, "Selection inside attention": for every
retrieving layer, token j and head h, the gate score of every cached slot is computed from the
layer's own projections (q_j^h + u^h against W_{k,E}^h x(z) of the slot's rows, with x the
layer's attention input, LayerNorm'ed for pre-LN), pooled by the block key (mean of the projected
keys, the last row's key, the best row's score, or the n-gram row match of token_max); the heads'
scores are summed row by row; the k best slots are every head's context before the memory,
values scaled by alpha. It shares nothing with ``crtn/model`` but the
parameters, the embedding/softmax modules and the stream bookkeeping of :class:`NaiveCRTN`
(slots, memory, eviction), and it is slow by design.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.reference import NaiveCRTN, Slot, _ln, feed_forward, naive_alpha, naive_evict, sinusoid


def attend_token_per_head(attn, h_j: Tensor, contexts: list, u: Tensor, v: Tensor, clamp_len: int) -> Tensor:
    """One query token over a context of its own for every head: ``contexts[h]`` = (rows [C, d],
    value scales [C], distances [C]). Returns the attention sub-layer output [d]."""
    H, dh = attn.n_head, attn.d_head
    d = h_j.shape[-1]
    w_q, w_k, w_v = attn.qkv_net.weight.view(3, H * dh, d)
    pre = attn.pre_lnorm
    q = (w_q @ (_ln(h_j, attn.layer_norm) if pre else h_j)).view(H, dh)
    heads = []
    for h, (rows, scale, dist) in enumerate(contexts):
        x = _ln(rows, attn.layer_norm) if pre else rows
        k = (x @ w_k.T).view(-1, H, dh)[:, h]
        val = (x @ w_v.T).view(-1, H, dh)[:, h] * scale[:, None]
        dist = dist.clamp(max=clamp_len) if clamp_len > 0 else dist
        r = (sinusoid(dist, d).to(rows.dtype) @ attn.r_net.weight.T).view(-1, H, dh)[:, h]
        score = k @ (q[h] + u[h]) + r @ (q[h] + v[h])
        heads.append(torch.softmax(score / math.sqrt(dh), -1) @ val)
    out = attn.o_net(torch.cat(heads))
    return h_j + out if pre else _ln(h_j + out, attn.layer_norm)


class NaiveGate(NaiveCRTN):
    """:class:`NaiveCRTN` whose retrieving layers select inside attention (module docstring)."""

    def _x(self, attn, rows: Tensor) -> Tensor:
        return _ln(rows, attn.layer_norm) if attn.pre_lnorm else rows

    def _head_query(self, attn, u: Tensor, row: Tensor | None, h: int) -> Tensor:
        """q^h + u^h of a position's layer input ``row`` [d]; zeros where there is none."""
        H, dh = attn.n_head, attn.d_head
        if row is None:
            return torch.zeros(dh, dtype=u.dtype)
        w_q = attn.qkv_net.weight[: H * dh]
        return (w_q @ self._x(attn, row)).view(H, dh)[h] + u[h]

    def _block_score(self, attn, layer: int, queries: list, j: int, slot: Slot, h: int) -> Tensor:
        """Head h's score of token j against ``slot`` before the 1/sqrt(d_h) scale, per row for
        token_max ([Ls]: the n-gram match ending at each row, maximised by the caller after the
        heads are summed), else one number; ``queries`` the q^h + u^h of
        the positions [lead-in; segment] for head h."""
        H, dh = attn.n_head, attn.d_head
        w_k = attn.qkv_net.weight[H * dh : 2 * H * dh]
        keys = (self._x(attn, slot.states[layer]) @ w_k.T).view(-1, H, dh)[:, h]  # [Ls, dh]
        summ = self.m.summary
        q = queries[len(queries) - self.L + j]
        if summ.name == "mean":
            return q @ (keys.sum(0) / keys.shape[0])
        if summ.name == "last_state":
            return q @ keys[-1]
        assert summ.name == "token_max", summ.name
        w, s = summ.ngram, summ.shift
        lead = self._lead(slot)
        lead_keys = None
        if lead is not None:
            lead_slot = next(o for o in self.row.slots if o.pos == slot.pos - slot.states.shape[1])
            lead_keys = (self._x(attn, lead_slot.states[layer]) @ w_k.T).view(-1, H, dh)[:, h]
        Ls, per_row = keys.shape[0], []
        for r in range(Ls):
            total = torch.zeros((), dtype=keys.dtype)
            for a in range(w):
                qa = queries[len(queries) - self.L + j - a]
                if r - s - a >= 0:
                    total = total + qa @ keys[r - s - a]
                elif lead_keys is not None:
                    total = total + qa @ lead_keys[Ls + r - s - a]
            per_row.append(total / w)
        return torch.stack(per_row)

    def _select(self, attn, layer: int, u: Tensor, h_in: Tensor, mem_rows: Tensor | None, j: int):
        """Token j's selection at ``layer``, one for all heads: per head, the same sorted
        (slot, alpha) pairs."""
        c, qspec = self.m.spec.cache, self.m.spec.query
        H = attn.n_head
        n_lead = self.m.summary.ngram - 1
        positions = []
        for p in range(-n_lead, self.L):  # lead-in positions come from the layer's memory
            if p >= 0:
                positions.append(h_in[p])
            else:
                M = 0 if mem_rows is None else mem_rows.shape[0]
                positions.append(mem_rows[M + p] if M + p >= 0 else None)
        slots = self.row.slots
        per_head = []
        for h in range(H):
            queries = [self._head_query(attn, u, row, h) for row in positions]
            if qspec.detach:
                queries = [q.detach() for q in queries]
            per_head.append(torch.stack([self._block_score(attn, layer, queries, j, sl, h) for sl in slots]))
        # per_head[h]: [n_slots] (pooled keys) or [n_slots, Ls] (token_max's rows)
        g = sum(per_head)  # the heads summed row by row
        if self.m.summary.name == "token_max":  # the best row
            g = g.max(-1).values
        k = min(c.top_k, len(slots))
        s = g / math.sqrt(attn.d_head)
        top = sorted(range(len(slots)), key=lambda i: (-float(s[i].detach()), -slots[i].pos))[:k]
        alpha = naive_alpha(s, top, c.alpha_norm)
        top = sorted(top, key=lambda i: slots[i].pos)
        return [[(i, alpha[i]) for i in top]] * H

    def gate_segment(self, tokens: Tensor, t0: int) -> tuple[list[Tensor], list]:
        """The main pass of one segment with selection inside attention; returns the states at
        layers 0..n and, per retrieving layer, every token's selection (one per head, the same)."""
        m, st, c = self.m, self.row, self.m.spec.cache
        L, M = tokens.shape[0], 0 if st.mem is None else st.mem[0].shape[0]
        h = m.word_emb(tokens[None])[0]
        hs, selections = [h], []
        for i, layer in enumerate(m.layers):
            attn = layer.dec_attn
            u = attn.r_w_bias if m.untie_r else m.r_w_bias
            v = attn.r_r_bias if m.untie_r else m.r_r_bias
            retrieving = i >= self.first and st.slots and c.top_k > 0
            mem_rows = None if M == 0 else st.mem[i]
            layer_sel, out = [], []
            for j in range(L):
                sel = self._select(attn, i, u, h, mem_rows, j) if retrieving else [[]] * attn.n_head
                layer_sel.append(sel)
                contexts = [self._context(attn, i, h, mem_rows, sel[hd], j, t0) for hd in range(attn.n_head)]
                a = attend_token_per_head(attn, h[j], contexts, u, v, m.clamp_len)
                out.append(feed_forward(layer.pos_ff, a))
            if retrieving:
                selections.append(layer_sel)
            h = torch.stack(out)
            hs.append(h)
        return hs, selections

    def _context(self, attn, layer: int, h: Tensor, mem_rows, sel: list, j: int, t0: int):
        """(rows, value scales, distances) of token j's context for one head: its selected slots
        (oldest first), the memory, the segment up to j."""
        c, slots = self.m.spec.cache, self.row.slots
        M = 0 if mem_rows is None else mem_rows.shape[0]
        n_ret = sum(slots[i].states.shape[1] for i, _ in sel)
        rows, scale, dist, col = [], [], [], 0
        for i, alpha in sel:
            for r in range(slots[i].states.shape[1]):
                rows.append(slots[i].states[layer, r])
                scale.append(alpha if c.weighted else torch.ones((), dtype=h.dtype))
                dist.append((t0 + j) - (slots[i].pos + r) if c.pos == "real" else (n_ret + M + j) - col)
                col += 1
        for r in range(M):
            rows.append(mem_rows[r])
            scale.append(torch.ones((), dtype=h.dtype))
            dist.append(M - r + j)
        for r in range(j + 1):
            rows.append(h[r])
            scale.append(torch.ones((), dtype=h.dtype))
            dist.append(j - r)
        return (
            torch.stack(rows),
            torch.stack([torch.as_tensor(x, dtype=h.dtype) for x in scale]),
            torch.tensor(dist),
        )

    def step(self, tokens: Tensor, target: Tensor, t0: int):
        """One segment: NLL [L] and the top retrieving layer's selections, per token the list of
        (slot stream position, alpha), as the model reports them."""
        m, L, st = self.m, self.L, self.row
        n = m.n_layer
        hs, selections = self.gate_segment(tokens, t0)
        logp = m.crit.log_prob(F.dropout(hs[-1], 0.0))
        nll = -logp.gather(-1, target[:, None])[:, 0]
        reported: list[list[tuple[int, float]]] = [[] for _ in range(L)]
        if selections:
            heads = selections[-1]
            for j in range(L):
                reported[j] = [(st.slots[i].pos, float(a.detach())) for i, a in heads[j][0]]
        M = 0 if st.mem is None else st.mem[0].shape[0]
        cat = [torch.cat([st.mem[i], hs[i]]) if M else hs[i] for i in range(n + 1)]
        over = M + L - m.mem_len
        if over > 0 and m.n_slot > 0:
            states = torch.stack([x[:over] for x in cat]).detach()
            if len(st.slots) == m.n_slot:
                st.slots.pop(naive_evict(st.slots))
            st.slots.append(Slot(states, states[n], t0 - M))
        st.mem = [x[x.shape[0] - m.mem_len :].detach() for x in cat] if m.mem_len > 0 else None
        return nll, reported
