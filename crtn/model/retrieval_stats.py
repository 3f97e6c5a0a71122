"""Statistics of what retrieval did over an evaluation (``crtn-eval``'s ``retrieval`` block in
``eval.json``; docs/method.md §5): the distances of the selected segments and the weights alpha,
of the model's reported selection (``LMOutput.selection``: with selection inside attention the top
retrieving layer's) and, where more than one layer retrieves, of each retrieving layer's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class RetrievalStats:
    """What retrieval did over an evaluation: histograms accumulated on device.

    - distances of the selected segments, in segments (``age // seg_len``; times ``seg_len``
      for tokens);
    - the weights alpha: per token the total weight of its k segments (``alpha_mass``: 1
      for ``topk``, k for ``original``, below 1 and shrinking with N for ``all``) and the
      share of the largest weight in it (``alpha_top_share``: 1/k = spread evenly, 1 = one
      segment takes all), each as a histogram of :data:`ALPHA_BINS` bins.

    :meth:`update` counts the reported selection (with selection inside attention, the top
    retrieving layer's); :meth:`update_layers` counts each retrieving layer's own selection in
    :attr:`layers` (bottom first), kept only where more than one layer retrieves.

    Cheap enough to leave on in evaluation: a few ``bincount`` per step, no host sync.
    """

    ALPHA_BINS = 10

    def __init__(self) -> None:
        self.hist: Tensor | None = None
        self.seg_len = 0
        self.n_selected = 0
        self.mass_sum = 0.0
        self.n_tokens = 0
        self.share_hist: Tensor | None = None
        self.mass_hist: Tensor | None = None
        self.mass_max = 1.0
        self.layers: list[RetrievalStats] = []  # one per retrieving layer, bottom first

    def update(
        self, age: Tensor, seg_len: int, alpha: Tensor | None = None, found: Tensor | None = None
    ) -> None:
        """Count one step's selections: age [B, L, k] in tokens; alpha [B, L, k] their weights;
        found [B, L, k] bool, the selections a token reads (a lookup's tokens without a match
        read none: ``Selection.found``; their alpha is 0), or None: all. Distances are counted
        for the selections read."""
        if alpha is not None:
            self._update_alpha(alpha.detach().float())
        seg = (age // seg_len).reshape(-1)
        if found is not None:
            seg = seg[found.reshape(-1)]
        counts = torch.bincount(seg, minlength=1)
        if self.hist is None:
            self.hist = counts
        else:
            if counts.numel() > self.hist.numel():
                self.hist = torch.nn.functional.pad(self.hist, (0, counts.numel() - self.hist.numel()))
            self.hist[: counts.numel()] += counts
        self.seg_len = seg_len
        self.n_selected += seg.numel()

    def update_layers(self, selections: Sequence[Any], seg_len: int) -> None:
        """Count one step's selection at each retrieving layer into :attr:`layers`.

        Args:
            selections: each retrieving layer's selection, bottom first (``LMOutput.layer_selections``),
                each with ``age`` [B, L, k] in tokens and ``alpha`` [B, L, k]; fewer than two
                (one selection serves every layer): nothing is counted.
            seg_len: tokens per cached segment.

        Raises:
            ValueError: the number of retrieving layers differs from the first counted step's.
        """
        if len(selections) < 2:
            return
        if not self.layers:
            self.layers = [RetrievalStats() for _ in selections]
        if len(selections) != len(self.layers):
            raise ValueError(f"{len(selections)} retrieving layers after {len(self.layers)}")
        for stats, sel in zip(self.layers, selections):
            stats.update(sel.age, seg_len, sel.alpha)

    def _update_alpha(self, alpha: Tensor) -> None:
        n = self.ALPHA_BINS
        k = alpha.shape[-1]
        mass = alpha.sum(-1).reshape(-1)  # [B*L]
        self.mass_max = float(max(1, k))  # alpha mass lies in [0, k] (original) or [0, 1]
        share = (alpha.amax(-1).reshape(-1) / mass.clamp(min=1e-30)).clamp(max=1.0)
        share_bins = torch.bincount((share * n).long().clamp(max=n - 1), minlength=n)
        mass_bins = torch.bincount((mass / self.mass_max * n).long().clamp(max=n - 1), minlength=n)
        self.share_hist = share_bins if self.share_hist is None else self.share_hist + share_bins
        self.mass_hist = mass_bins if self.mass_hist is None else self.mass_hist + mass_bins
        self.mass_sum += float(mass.sum())
        self.n_tokens += mass.numel()

    def summary(self) -> dict[str, Any]:
        """JSON-ready: ``distance_hist`` (count per distance in segments), ``seg_len``, mean
        distance (tokens); ``alpha_mass_mean``, ``alpha_mass_hist`` (bins of width mass_max/10
        over [0, ``alpha_mass_max``]) and ``alpha_top_share_hist`` (bins of 0.1 over [0, 1]), all
        of the reported selection (the top retrieving layer's); where :attr:`layers` counted more
        than one retrieving layer, ``layers``: their summaries with the same keys, bottom first."""
        out: dict[str, Any] = {"distance_hist": [], "seg_len": self.seg_len, "mean_distance_tokens": None}
        if self.hist is not None:
            hist = self.hist.cpu().tolist()
            total = sum(hist)
            mean = sum(i * c for i, c in enumerate(hist)) / total * self.seg_len if total else None
            out.update(distance_hist=hist, mean_distance_tokens=mean)
        if self.n_tokens:
            out.update(
                alpha_mass_mean=self.mass_sum / self.n_tokens,
                alpha_mass_max=self.mass_max,
                alpha_mass_hist=self.mass_hist.cpu().tolist(),
                alpha_top_share_hist=self.share_hist.cpu().tolist(),
            )
        if self.layers:
            out["layers"] = [stats.summary() for stats in self.layers]
        return out
