"""Evaluation with projected keys and values kept.

At evaluation (no gradient, weights fixed) the keys W_{k,E} h and values W_v h of a row do
not depend on where the row is attended from: relative positions enter only through the
separate term (q + v).W_{k,R} R_{i-j} (docs/method.md §2), and pre-LN normalises each row on its own.
So the memory's keys and values (Transformer-XL and CRTN) are projected once, when the row is
made, and reused at every later step instead of re-projecting the memory (M rows per layer and
step). Training keeps the plain path (the projections change with every update).

The cached slots' rows are not kept projected: the retrieved rows are folded (docs/method.md §3,
"Efficient main pass"); keeping their projections measured 1.04-1.07x for 2.6x the cache's
memory (docs/results.md, "Options removed").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class StepKV:
    """The memory's keys and values during one step, as the attention layers use them.

    Attributes:
        mem: per layer 0..n-1, [B, M, 2 H d_h] keys and values of the memory: those the state kept
            (evaluation) or projected once for every pass over the memory (CRTN's query pass and
            main pass); None: each layer projects its memory itself.
        out: at evaluation, a list that receives each layer's keys and values of [memory; segment]
            [B, M+L, 2 H d_h] as the layers run (``RelPartialLearnableMultiHeadAttn``); None in
            training.
    """

    mem: list[Tensor] | None = None
    out: list[Tensor] | None = None

    def next_memory(self, mem_len: int) -> list[Tensor] | None:
        """The keys and values of the next step's memory (:func:`keep_last` of :attr:`out`), or
        None when this step kept none."""
        return None if self.out is None else keep_last(self.out, mem_len)


def keep_last(cat_kv: list[Tensor], mem_len: int) -> list[Tensor] | None:
    """Keys and values of the new memory: the last ``mem_len`` rows of each layer's [S; H_t]
    keys and values [B, M+L, 2 H d_h] (views, no copy); None when ``mem_len`` is 0."""
    if mem_len <= 0:
        return None
    return [c[:, max(0, c.shape[1] - mem_len) :] for c in cat_kv]
