"""Adaptive input embeddings and the projected adaptive log-softmax.

Sources:

- A. Baevski and M. Auli, "Adaptive Input Representations for Neural Language
  Modeling", 2018 (arXiv:1809.10853) -- :class:`AdaptiveEmbedding`;
- E. Grave et al., "Efficient softmax approximation for GPUs", ICML 2017
  (arXiv:1609.04309) -- :class:`ProjectedAdaptiveLogSoftmax`;
- the Transformer-XL release (kimiyoung/transformer-xl), ``pytorch/mem_transformer.py``
  (``AdaptiveEmbedding``, the tying in ``MemTransformerLM.__init__``),
  ``pytorch/utils/proj_adaptive_softmax.py`` and ``pytorch/train.py``
  (``weights_init``), and its port in Hugging Face transformers 4.35
  (``models/transfo_xl/modeling_transfo_xl.py`` and
  ``modeling_transfo_xl_utilities.py``).

Both modules use the release's attribute and parameter names, shapes and maths,
so a state dict of either source loads 1:1 (``strict=True``, same keys).

Vocabulary partition. ``cutoffs`` (constructor argument) are the cluster
boundaries *without* ``n_token``; as in the release, the attribute
``self.cutoffs`` is ``cutoffs + [n_token]`` and ``self.cutoff_ends`` is
``[0] + cutoffs + [n_token]``. Cluster 0 (the head, or "shortlist") holds tokens
``[0, cutoffs[0])``, tail cluster ``i`` holds ``[cutoff_ends[i], cutoff_ends[i+1])``.
With ``div_val > 1`` cluster ``i`` uses width ``d_embed // div_val**i``.
Empty ``cutoffs`` means one cluster: a plain (possibly projected) softmax.

Parameters (state-dict keys), ``C = len(cutoffs)`` tail clusters:

- ``AdaptiveEmbedding``: ``emb_layers.{i}.weight`` (an ``nn.Embedding`` per
  cluster; only ``emb_layers.0`` of shape ``(n_token, d_embed)`` when
  ``div_val == 1``) and ``emb_projs.{i}`` of shape ``(d_proj, d_emb_i)``
  (none at all when ``div_val == 1 and d_proj == d_embed``; only
  ``emb_projs.0`` when ``div_val == 1 and d_proj != d_embed``).
- ``ProjectedAdaptiveLogSoftmax``: ``cluster_weight`` ``(C, d_embed)`` and
  ``cluster_bias`` ``(C,)`` (only if ``C > 0``), ``out_layers.{i}.weight/.bias``
  (one ``nn.Linear(d_embed, n_token)`` when ``div_val == 1``, else one
  ``nn.Linear(d_emb_i, cluster size)`` per cluster) and ``out_projs.{i}``
  ``(d_proj, d_emb_i)``, one per cluster. When ``div_val == 1 and d_proj ==
  d_embed`` every ``out_projs`` entry is ``None`` (no key), exactly as in the
  release; note that with ``div_val == 1`` the ``C + 1`` output projections are
  separate parameters although all clusters share ``out_layers.0``.

Projections map the model width to the embedding width: the embedding computes
``F.linear(emb, proj)`` (``d_emb_i -> d_proj``), the softmax computes
``F.linear(hidden, proj.t())`` (``d_proj -> d_emb_i``).

Order of the cluster logits in the head. The head has ``cutoffs[0] + C``
outputs: the shortlist tokens, then one logit per tail cluster, computed from
the rows of ``cluster_weight``/``cluster_bias``. The two sources disagree on
which row belongs to which tail cluster when ``C >= 2``:

- ``cluster_order="release"`` (default): the PyTorch release uses head column
  ``-i`` for tail cluster ``i`` (``head_logprob_i[:, -i]``), i.e.
  ``cluster_weight`` row ``C - i``;
- ``cluster_order="hf"``: Hugging Face 4.35 ``ProjectedAdaptiveLogSoftmax.forward``
  (and the release's TensorFlow code, from which the published checkpoints were
  converted) uses column ``cutoffs[0] + i - 1``, i.e. row ``i - 1``.

The two orders agree for ``C <= 1``; otherwise a state dict moves from one to
the other by reversing the rows of ``cluster_weight`` and ``cluster_bias``
(:func:`flip_cluster_order`), or by loading it into a module built with the
matching ``cluster_order``. (HF 4.35's own ``log_prob`` method uses ``-i`` but
fails with an indexing error whenever ``C >= 1``, so HF's usable order is ``hf``.)

Initialisation (release ``weights_init`` with ``init="normal"``): embedding and
output-layer weights and ``cluster_weight`` ~ N(0, ``init_std`` = 0.02), biases
and ``cluster_bias`` = 0, projections ~ N(0, ``proj_init_std`` = 0.01). Both
modules apply it in their constructor; call ``init_weights`` to redo it with
other values.

Weight tying is done by the caller with :func:`tie_adaptive_weights`.
"""

from __future__ import annotations

import itertools
import numbers
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AdaptiveEmbedding",
    "ProjectedAdaptiveLogSoftmax",
    "flip_cluster_order",
    "tie_adaptive_weights",
]

CLUSTER_ORDERS = ("release", "hf")


def _check_sizes(n_token: int, d_embed: int, d_proj: int, cutoffs: Sequence[int], div_val: int) -> list[int]:
    """Validate the sizes shared by both modules; return ``cutoffs`` as a list of ints.

    Raises:
        ValueError: one line naming the bad value.
    """
    for name, value in (
        ("n_token", n_token),
        ("d_embed", d_embed),
        ("d_proj", d_proj),
        ("div_val", div_val),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        cuts = [operator.index(c) for c in cutoffs]
    except TypeError:
        raise ValueError(f"cutoffs must be a list of integers, got {cutoffs!r}") from None
    ends = [0, *cuts, n_token]
    if any(a >= b for a, b in itertools.pairwise(ends)):
        raise ValueError(
            f"cutoffs must be strictly increasing integers in (0, n_token={n_token}) "
            f"(without n_token), got {cuts}"
        )
    last = d_embed // div_val ** len(cuts)
    if last == 0:
        raise ValueError(
            f"d_embed // div_val**{len(cuts)} is 0 (d_embed={d_embed}, div_val={div_val}, "
            f"{len(cuts)} tail clusters): the last cluster would have no embedding width"
        )
    return cuts


def _init(weight: torch.Tensor, init: str, init_std: float, init_range: float) -> None:
    if init == "normal":
        nn.init.normal_(weight, 0.0, init_std)
    elif init == "uniform":
        nn.init.uniform_(weight, -init_range, init_range)
    else:
        raise ValueError(f"init must be 'normal' or 'uniform', got {init!r}")


def _cluster_of(tokens: torch.Tensor, cutoff_ends: list[int]) -> list[torch.Tensor]:
    """Flat indices of ``tokens`` (1-D) lying in each cluster; checks the range.

    Raises:
        ValueError: a token is outside ``[0, n_token)``.
    """
    n_token = cutoff_ends[-1]
    bad = (tokens < 0) | (tokens >= n_token)
    if bool(bad.any()):
        value = int(tokens[bad][0])
        raise ValueError(f"token id {value} is outside [0, n_token={n_token})")
    return [
        ((tokens >= lo) & (tokens < hi)).nonzero().flatten() for lo, hi in itertools.pairwise(cutoff_ends)
    ]


class AdaptiveEmbedding(nn.Module):
    """Adaptive input embedding (Baevski & Auli 2018), as the Transformer-XL release.

    Token ``t`` of cluster ``i`` is embedded as
    ``emb_layers[i].weight[t - cutoff_ends[i]] @ emb_projs[i].T * d_proj**0.5``
    (with ``div_val == 1`` one table and, if ``d_proj != d_embed``, one projection).

    Args:
        n_token: vocabulary size.
        d_embed: embedding width of the head cluster.
        d_proj: output width (the model width ``d_model``).
        cutoffs: cluster boundaries without ``n_token``, strictly increasing in
            ``(0, n_token)``; ``[]`` for a single cluster.
        div_val: width divisor per cluster (``d_embed // div_val**i``).

    Raises:
        ValueError: invalid sizes or cutoffs (see :func:`_check_sizes`).
    """

    def __init__(
        self,
        n_token: int,
        d_embed: int,
        d_proj: int,
        cutoffs: Sequence[int],
        div_val: int = 1,
    ) -> None:
        super().__init__()
        cuts = _check_sizes(n_token, d_embed, d_proj, cutoffs=cutoffs, div_val=div_val)
        self.n_token = n_token
        self.d_embed = d_embed
        self.d_proj = d_proj
        self.div_val = div_val
        self.cutoffs = cuts + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.emb_scale = d_proj**0.5

        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, (lo, hi) in enumerate(itertools.pairwise(self.cutoff_ends)):
                d_emb_i = d_embed // div_val**i
                self.emb_layers.append(nn.Embedding(hi - lo, d_emb_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_emb_i)))
        self.init_weights()

    def init_weights(
        self,
        init_std: float = 0.02,
        proj_init_std: float = 0.01,
        init: str = "normal",
        init_range: float = 0.1,
    ) -> None:
        """Release initialisation: tables ~ N(0, init_std) (or U(+-init_range) with
        ``init="uniform"``), projections ~ N(0, proj_init_std)."""
        with torch.no_grad():
            for layer in self.emb_layers:
                _init(layer.weight, init, init_std, init_range)
            for proj in self.emb_projs:
                if proj is not None:
                    nn.init.normal_(proj, 0.0, proj_init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens``.

        Args:
            tokens: LongTensor of any shape ``(...)`` with ids in ``[0, n_token)``.

        Returns:
            ``(..., d_proj)`` embeddings, already multiplied by ``d_proj**0.5``,
            in the parameters' dtype.

        Raises:
            ValueError: (``div_val > 1``) a token id outside ``[0, n_token)``;
            IndexError: (``div_val == 1``) the same, raised by ``nn.Embedding``.
        """
        if self.div_val == 1:
            embed = self.emb_layers[0](tokens)
            if self.d_proj != self.d_embed:
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.emb_scale

        flat = tokens.reshape(-1)
        weight = self.emb_layers[0].weight
        embed = torch.zeros(flat.numel(), self.d_proj, dtype=weight.dtype, device=weight.device)
        for i, idx in enumerate(_cluster_of(flat, self.cutoff_ends)):
            if idx.numel() == 0:
                continue
            emb_i = self.emb_layers[i](flat.index_select(0, idx) - self.cutoff_ends[i])
            embed = embed.index_copy(0, idx, F.linear(emb_i, self.emb_projs[i]))
        return embed.view(*tokens.shape, self.d_proj) * self.emb_scale

    def extra_repr(self) -> str:
        return (
            f"n_token={self.n_token}, d_embed={self.d_embed}, d_proj={self.d_proj}, "
            f"cutoffs={self.cutoffs[:-1]}, div_val={self.div_val}"
        )


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Projected adaptive log-softmax (Grave et al. 2017), as the Transformer-XL release.

    ``log p(t | h) = log p_head(t | h)`` for a shortlist token and
    ``log p_head(cluster i | h) + log p_i(t | h)`` for a token of tail cluster ``i``,
    where each softmax is over ``F.linear(F.linear(h, proj.t()), W, b)`` with the
    cluster's projection (skipped when it is ``None``), weight and bias; the head's
    weight is ``[W_shortlist; cluster_weight]``. See the module docstring for
    parameter names, shapes and ``cluster_order``.

    Args:
        n_token: vocabulary size.
        d_embed: width of the head cluster's output embedding.
        d_proj: input width (the model width ``d_model``).
        cutoffs: cluster boundaries without ``n_token``, strictly increasing in
            ``(0, n_token)``; ``[]`` for a plain softmax.
        div_val: width divisor per cluster (``d_embed // div_val**i``).
        cluster_order: ``"release"`` (tail cluster ``i`` <-> head column ``-i``,
            the PyTorch release) or ``"hf"`` (column ``cutoffs[0] + i - 1``,
            Hugging Face 4.35 and the TensorFlow release). Keyword only.

    Raises:
        ValueError: invalid sizes, cutoffs or ``cluster_order``.
    """

    def __init__(
        self,
        n_token: int,
        d_embed: int,
        d_proj: int,
        cutoffs: Sequence[int],
        div_val: int = 1,
        *,
        cluster_order: str = "release",
    ) -> None:
        super().__init__()
        cuts = _check_sizes(n_token, d_embed, d_proj, cutoffs=cutoffs, div_val=div_val)
        if cluster_order not in CLUSTER_ORDERS:
            raise ValueError(f"cluster_order must be one of {CLUSTER_ORDERS}, got {cluster_order!r}")
        self.n_token = n_token
        self.d_embed = d_embed
        self.d_proj = d_proj
        self.div_val = div_val
        self.cluster_order = cluster_order
        self.cutoffs = cuts + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(cuts)
        self.head_size = self.shortlist_size + self.n_clusters

        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.empty(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(self.n_clusters))

        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in self.cutoffs:
                if d_proj != d_embed:
                    self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
                else:
                    self.out_projs.append(None)  # no key in the state dict, as the release
            self.out_layers.append(nn.Linear(d_embed, n_token))
        else:
            for i, (lo, hi) in enumerate(itertools.pairwise(self.cutoff_ends)):
                d_emb_i = d_embed // div_val**i
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_emb_i)))
                self.out_layers.append(nn.Linear(d_emb_i, hi - lo))
        self.init_weights()

    def init_weights(
        self,
        init_std: float = 0.02,
        proj_init_std: float = 0.01,
        init: str = "normal",
        init_range: float = 0.1,
    ) -> None:
        """Release initialisation: output weights and ``cluster_weight`` ~ N(0, init_std)
        (or U(+-init_range) with ``init="uniform"``), biases 0, projections
        ~ N(0, proj_init_std)."""
        with torch.no_grad():
            for layer in self.out_layers:
                _init(layer.weight, init, init_std, init_range)
                nn.init.zeros_(layer.bias)
            if self.n_clusters > 0:
                _init(self.cluster_weight, init, init_std, init_range)
                nn.init.zeros_(self.cluster_bias)
            for proj in self.out_projs:
                if proj is not None:
                    nn.init.normal_(proj, 0.0, proj_init_std)

    # -- helpers ---------------------------------------------------------------

    def _head_column(self, i: int) -> int:
        """Column of the head log-softmax holding tail cluster ``i`` (1-based)."""
        if self.cluster_order == "release":
            return self.head_size - i
        return self.shortlist_size + i - 1

    def _cluster_params(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Weight, bias and projection of cluster ``i`` (0 = head, with the cluster rows)."""
        if self.div_val == 1:
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            weight = self.out_layers[0].weight[lo:hi]
            bias = self.out_layers[0].bias[lo:hi]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_clusters > 0:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        return weight, bias, self.out_projs[i]

    def _logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        weight, bias, proj = self._cluster_params(i)
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def _flat_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 0 or hidden.shape[-1] != self.d_proj:
            raise ValueError(f"hidden must have shape (..., d_proj={self.d_proj}), got {tuple(hidden.shape)}")
        return hidden.reshape(-1, self.d_proj)

    # -- public ----------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Negative log-likelihood of ``target`` under the distribution at ``hidden``.

        Only the tail clusters that contain a target are evaluated, and each only
        on the positions whose target lies in it.

        Args:
            hidden: ``(..., d_proj)`` float tensor.
            target: LongTensor ``(...)`` (same leading shape) with ids in ``[0, n_token)``.

        Returns:
            ``(...)`` NLL in nats per token, not reduced, in ``hidden``'s order.

        Raises:
            ValueError: shape mismatch, or (with cutoffs) a target outside
                ``[0, n_token)``; without cutoffs ``F.cross_entropy`` raises for that.
        """
        if hidden.shape[:-1] != target.shape:
            raise ValueError(
                f"hidden (..., d_proj) and target (...) must share the leading shape, got "
                f"{tuple(hidden.shape)} and {tuple(target.shape)}"
            )
        flat_hidden = self._flat_hidden(hidden)
        flat_target = target.reshape(-1)
        if self.n_clusters == 0:
            nll = F.cross_entropy(self._logits(flat_hidden, 0), flat_target, reduction="none")
            return nll.view(target.shape)

        members = _cluster_of(flat_target, self.cutoff_ends)
        # Head term: the token itself for the shortlist, its cluster's column otherwise.
        head_target = flat_target.clone()
        for i in range(1, self.n_clusters + 1):
            head_target[members[i]] = self._head_column(i)
        nll = F.cross_entropy(self._logits(flat_hidden, 0), head_target, reduction="none")
        for i in range(1, self.n_clusters + 1):
            idx = members[i]
            if idx.numel() == 0:
                continue
            tail_logit = self._logits(flat_hidden.index_select(0, idx), i)
            tail_target = flat_target.index_select(0, idx) - self.cutoff_ends[i]
            nll = nll.index_add(0, idx, F.cross_entropy(tail_logit, tail_target, reduction="none"))
        return nll.view(target.shape)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full log-distribution over the vocabulary.

        Args:
            hidden: ``(..., d_proj)`` float tensor.

        Returns:
            ``(..., n_token)`` log-probabilities (nats); ``exp`` sums to 1 over the last axis.

        Raises:
            ValueError: ``hidden``'s last dimension is not ``d_proj``.
        """
        flat_hidden = self._flat_hidden(hidden)
        head_logprob = F.log_softmax(self._logits(flat_hidden, 0), dim=-1)
        if self.n_clusters == 0:
            return head_logprob.view(*hidden.shape[:-1], self.n_token)
        parts = [head_logprob[:, : self.shortlist_size]]
        for i in range(1, self.n_clusters + 1):
            col = self._head_column(i)
            tail_logprob = F.log_softmax(self._logits(flat_hidden, i), dim=-1)
            parts.append(head_logprob[:, col : col + 1] + tail_logprob)
        return torch.cat(parts, dim=-1).view(*hidden.shape[:-1], self.n_token)

    def extra_repr(self) -> str:
        return (
            f"n_token={self.n_token}, d_embed={self.d_embed}, d_proj={self.d_proj}, "
            f"cutoffs={self.cutoffs[:-1]}, div_val={self.div_val}, "
            f"cluster_order={self.cluster_order!r}"
        )


def flip_cluster_order(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Convert a softmax state dict between ``cluster_order`` "release" and "hf".

    Returns a shallow copy of ``state_dict`` whose ``{prefix}cluster_weight`` and
    ``{prefix}cluster_bias`` rows are reversed (the conversion is its own inverse).
    Keys other than those two are passed through; a dict without them (no cutoffs)
    is returned unchanged.
    """
    out = dict(state_dict)
    for name in ("cluster_weight", "cluster_bias"):
        key = prefix + name
        if key in out:
            out[key] = out[key].flip(0)
    return out


def tie_adaptive_weights(
    word_emb: AdaptiveEmbedding,
    crit: ProjectedAdaptiveLogSoftmax,
    tie_weight: bool,
    tie_projs: Sequence[bool] | None,
    d_model: int,
    d_embed: int,
    div_val: int,
) -> None:
    """Share input and output parameters, as ``MemTransformerLM.__init__`` of the release.

    - ``tie_weight``: ``crit.out_layers[i].weight = word_emb.emb_layers[i].weight``
      for every output layer (biases stay separate);
    - ``tie_projs[i]`` true: ``crit.out_projs[i] = word_emb.emb_projs[0]`` when
      ``div_val == 1 and d_model != d_embed``, ``word_emb.emb_projs[i]`` when
      ``div_val != 1``; nothing when ``div_val == 1 and d_model == d_embed``
      (neither side has a projection). The release's default is
      ``tie_projs = [False] + [True] * len(cutoffs)``.

    The tied entries become the very same ``nn.Parameter`` objects, so gradients
    from both modules accumulate in one tensor.

    Raises:
        ValueError: ``d_model``/``d_embed``/``div_val`` disagree with the modules, the
            modules' vocabularies differ, or ``tie_projs`` is longer than the number
            of clusters.
    """
    for name, value in (
        ("d_model", d_model),
        ("d_embed", d_embed),
        ("div_val", div_val),
    ):
        attr = "d_proj" if name == "d_model" else name
        if getattr(word_emb, attr) != value or getattr(crit, attr) != value:
            raise ValueError(
                f"{name}={value} disagrees with the modules ({attr}: embedding "
                f"{getattr(word_emb, attr)}, softmax {getattr(crit, attr)})"
            )
    if word_emb.cutoff_ends != crit.cutoff_ends:
        raise ValueError(
            f"embedding and softmax partition the vocabulary differently: "
            f"{word_emb.cutoff_ends} vs {crit.cutoff_ends}"
        )
    tie_projs = list(tie_projs or [])
    if len(tie_projs) > len(crit.out_projs):
        raise ValueError(
            f"tie_projs has {len(tie_projs)} entries but there are only {len(crit.out_projs)} clusters"
        )
    if tie_weight:
        for i, layer in enumerate(crit.out_layers):
            layer.weight = word_emb.emb_layers[i].weight
    for i, tie in enumerate(tie_projs):
        if tie and div_val == 1 and d_model != d_embed:
            crit.out_projs[i] = word_emb.emb_projs[0]
        elif tie and div_val != 1:
            crit.out_projs[i] = word_emb.emb_projs[i]
