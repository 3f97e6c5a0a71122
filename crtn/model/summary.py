"""Summaries of an L x d block of top-layer states into a cache key or a query (SPEC §3).

| summary      | of Y in R^{L x d}                                    | d_key    |
|--------------|------------------------------------------------------|----------|
| identity     | flat(Y)                                              | L * d    |
| linear       | Linear(flat(Y)), tanh optional                       | d_key    |
| last_state   | Y[L]; for a query window, the row of token j         | d        |
| mean, max    | pooling over rows                                    | d        |
| token_max    | keys keep all L rows; score = max_r <q, Y[r]>         | d        |

Keys are summaries of a cached segment's top layer (seed 003, "3 更新 Memory":
3.1 identity, 3.2 linear); queries are the same summary applied to each token's
window (seed 003, "1 查询"). Scores are scaled dot products, s = <q, k> / sqrt(d_key).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Summary(nn.Module):
    """Key/query summary shared by the cache and the query strategies.

    Args:
        name: identity | linear | last_state | mean | max | token_max.
        seg_len: L, rows of a segment (and of a query window).
        d_model: d, width of a row.
        d_key: output width of ``linear`` (default d); ignored otherwise.
        tanh: apply tanh after ``linear``.
    """

    def __init__(self, name: str, seg_len: int, d_model: int, d_key: int | None = None, tanh: bool = False):
        super().__init__()
        self.name, self.seg_len, self.d_model, self.tanh = name, seg_len, d_model, tanh
        if name == "linear":
            self.proj = nn.Linear(seg_len * d_model, d_key or d_model)

    @property
    def d_key(self) -> int:
        """Width of keys and queries (for ``token_max``: of one row)."""
        if self.name == "identity":
            return self.seg_len * self.d_model
        if self.name == "linear":
            return self.proj.out_features
        return self.d_model

    def _linear(self, flat: Tensor) -> Tensor:
        out = self.proj(flat)
        return torch.tanh(out) if self.tanh else out

    def key(self, top: Tensor) -> Tensor:
        """Key of a segment from its top-layer states.

        Args:
            top: [..., L, d].

        Returns:
            [..., d_key]; for ``token_max`` the rows themselves, [..., L, d].

        Raises:
            ValueError: if L differs from the configured segment length for identity/linear.
        """
        if self.name in ("identity", "linear") and top.shape[-2] != self.seg_len:
            raise ValueError(
                f"summary={self.name} was built for segments of {self.seg_len} rows, got {top.shape[-2]}"
            )
        if self.name == "identity":
            return top.flatten(-2)
        if self.name == "linear":
            return self._linear(top.flatten(-2))
        if self.name == "last_state":
            return top[..., -1, :]
        if self.name == "mean":
            return top.mean(-2)
        if self.name == "max":
            return top.amax(-2)
        return top  # token_max

    def query(self, window: Tensor, token_row: Tensor) -> Tensor:
        """Query of each token from its window.

        Args:
            window: [B, L, Lw, d], window W_j of every token j (Lw = segment length).
            token_row: [L] long, the row of W_j that belongs to token j (``last_state``).

        Returns:
            [B, L, d_key].
        """
        if self.name == "identity":
            return window.flatten(-2)
        if self.name == "linear":
            return self._linear(window.flatten(-2))
        if self.name == "last_state":
            idx = token_row.view(1, -1, 1, 1).expand(window.shape[0], -1, 1, window.shape[-1])
            return window.gather(2, idx).squeeze(2)
        if self.name == "mean":
            return window.mean(2)
        if self.name == "max":
            return window.amax(2)
        raise ValueError(f"summary={self.name} has no window query; it pairs with query=token")

    def score(self, query: Tensor, keys: Tensor) -> Tensor:
        """Scaled dot-product scores of every query against every key.

        Args:
            query: [B, L, d_key].
            keys: [B, N, d_key], or [B, N, Ls, d] for ``token_max``.

        Returns:
            [B, L, N], s = <q, k> / sqrt(d_key); ``token_max``: max over the key's rows.
        """
        scale = 1.0 / math.sqrt(self.d_key)
        keys = keys.to(query.dtype)
        if self.name == "token_max":
            B, N, Ls, d = keys.shape
            rows = torch.bmm(query, keys.reshape(B, N * Ls, d).transpose(1, 2))  # [B, L, N*Ls]
            return rows.view(B, -1, N, Ls).amax(-1) * scale
        return torch.bmm(query, keys.transpose(1, 2)) * scale

    def score_selected(self, query: Tensor, keys: Tensor) -> Tensor:
        """Scores against given keys per token: query [B, L, d_key], keys [B, L, k, ...] -> [B, L, k]."""
        scale = 1.0 / math.sqrt(self.d_key)
        keys = keys.to(query.dtype)
        if self.name == "token_max":
            return torch.einsum("bld,blkrd->blkr", query, keys).amax(-1) * scale
        return torch.einsum("bld,blkd->blk", query, keys) * scale
