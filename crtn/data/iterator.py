"""Segment iterator over a token stream, as in Transformer-XL but batch-first (docs/method.md §4).

A split of N tokens is cut into ``B = batch_size`` contiguous streams of
``n = N // B`` tokens each (``data[:n*B].view(B, n)``; the last ``N - n*B``
tokens are dropped). Segment ``t`` feeds columns ``[tL, tL+L')`` of every
stream as input and ``[tL+1, tL+L'+1)`` as target, with
``L' = min(L, n-1-tL)``; there are ``ceil((n-1)/L)`` segments, or
``floor((n-1)/L)`` full ones with ``drop_last=True``. Memory and cache carry
over from segment t to t+1 because row b of every batch continues stream b.

Data parallel (``world_size`` W > 1): rank r gets rows ``[r*B/W, (r+1)*B/W)``
of the same B global streams, so W processes together see exactly the batches
of one process with the same global batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from crtn.errors import ConfigError, DataError


@dataclass
class Batch:
    """One segment of every (local) stream.

    Attributes:
        index: segment index t.
        input: ``torch.int64 [B_local, L']``: tokens ``[tL, tL+L')`` of each stream.
        target: ``torch.int64 [B_local, L']``: the next tokens, ``[tL+1, tL+L'+1)``.
        label: labels of the *target* tokens, ``[B_local, L']`` (dtype of the
            labels given to the iterator), or None.
    """

    index: int
    input: torch.Tensor
    target: torch.Tensor
    label: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """L', the number of positions of this segment."""
        return self.input.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with its tensors on ``device``."""
        label = None if self.label is None else self.label.to(device, non_blocking=non_blocking)
        return Batch(
            self.index,
            self.input.to(device, non_blocking=non_blocking),
            self.target.to(device, non_blocking=non_blocking),
            label,
        )


class StreamIterator:
    """Transformer-XL-style segment iterator, batch-first (module docstring).

    Args:
        data: 1-D integer tensor (or array) of token ids of one split.
        batch_size: B, the global number of streams (all ranks together).
        tgt_len: L, tokens predicted per segment.
        labels: optional 1-D tensor aligned with ``data`` (per-token labels);
            batches then carry the labels of their target tokens.
        rank, world_size: data-parallel position; B must be divisible by world_size.
        drop_last: produce only full segments (L' == L), as in training.
        split: name of the split, used in error messages.

    Raises:
        ConfigError: ``batch_size <= 0``, ``tgt_len <= 0``, bad ``rank``/``world_size``,
            or ``batch_size`` not divisible by ``world_size``.
        DataError: fewer than ``2*B`` tokens (each stream needs an input and a
            target), or with ``drop_last`` fewer than ``B*(L+1)``; ``labels`` of a
            different length than ``data``.
    """

    def __init__(
        self,
        data: torch.Tensor | np.ndarray,
        batch_size: int,
        tgt_len: int,
        labels: torch.Tensor | np.ndarray | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        split: str | None = None,
    ):
        if int(batch_size) <= 0:
            raise ConfigError(f"batch_size={batch_size} must be > 0")
        if int(tgt_len) <= 0:
            raise ConfigError(f"tgt_len={tgt_len} must be > 0")
        if int(world_size) <= 0 or not 0 <= int(rank) < int(world_size):
            raise ConfigError(f"rank={rank} and world_size={world_size}: need 0 <= rank < world_size")
        if batch_size % world_size != 0:
            raise ConfigError(f"batch_size={batch_size} must be divisible by world_size={world_size}")
        data = torch.as_tensor(data)
        where = f"split {split!r}" if split else "the data"
        if data.dim() != 1:
            raise DataError(f"{where} must be a 1-D token tensor, got shape {tuple(data.shape)}")
        if data.dtype != torch.int64:
            data = data.long()
        self.batch_size, self.tgt_len, self.drop_last = int(batch_size), int(tgt_len), bool(drop_last)
        self.rank, self.world_size, self.split = int(rank), int(world_size), split
        n_tok = data.numel()
        n = n_tok // self.batch_size
        if n < 2:
            raise DataError(
                f"{where} has {n_tok:,} tokens, too few for batch_size={batch_size}: one segment needs at "
                f"least {2 * self.batch_size:,} (2 per stream)"
            )
        if drop_last and n - 1 < self.tgt_len:
            raise DataError(
                f"{where} has {n_tok:,} tokens, too few for one full segment of tgt_len={tgt_len} with "
                f"batch_size={batch_size}: needs at least {self.batch_size * (self.tgt_len + 1):,}"
            )
        local = self.batch_size // self.world_size
        rows = slice(self.rank * local, (self.rank + 1) * local)
        self.stream_len = n
        self.streams = data[: n * self.batch_size].reshape(self.batch_size, n)[rows]
        self.labels = None
        if labels is not None:
            labels = torch.as_tensor(labels)
            if labels.shape != data.shape:
                raise DataError(
                    f"labels of {where} have shape {tuple(labels.shape)}, expected {tuple(data.shape)}"
                )
            self.labels = labels[: n * self.batch_size].reshape(self.batch_size, n)[rows]
        if self.drop_last:
            self.n_segments = (n - 1) // self.tgt_len
        else:
            self.n_segments = -(-(n - 1) // self.tgt_len)

    @property
    def local_batch_size(self) -> int:
        """Rows per batch on this rank: ``batch_size // world_size``."""
        return self.streams.shape[0]

    @property
    def n_targets(self) -> int:
        """Target tokens per pass on this rank (sum of ``B_local * L'`` over segments)."""
        cols = min(self.n_segments * self.tgt_len, self.stream_len - 1)
        return self.local_batch_size * cols

    def __len__(self) -> int:
        return self.n_segments

    def __getitem__(self, t: int) -> Batch:
        if not 0 <= t < self.n_segments:
            raise IndexError(f"segment {t} out of range [0, {self.n_segments})")
        start = t * self.tgt_len
        seq = min(self.tgt_len, self.stream_len - 1 - start)
        inp = self.streams[:, start : start + seq].contiguous()
        tgt = self.streams[:, start + 1 : start + 1 + seq].contiguous()
        lab = None if self.labels is None else self.labels[:, start + 1 : start + 1 + seq].contiguous()
        return Batch(t, inp, tgt, lab)

    def iterate(self, start: int = 0) -> Iterator[Batch]:
        """Batches of segments ``start, start+1, ..., len(self)-1`` (resume mid-pass with ``start``).

        Raises:
            ValueError: ``start`` outside ``[0, len(self)]``.
        """
        if not 0 <= start <= self.n_segments:
            raise ValueError(f"start={start} must be in [0, {self.n_segments}]")
        for t in range(start, self.n_segments):
            yield self[t]

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate(0)

    def __repr__(self) -> str:
        return (
            f"StreamIterator(split={self.split!r}, batch_size={self.batch_size}, tgt_len={self.tgt_len}, "
            f"rank={self.rank}/{self.world_size}, streams={self.local_batch_size}x{self.stream_len}, "
            f"segments={self.n_segments})"
        )
