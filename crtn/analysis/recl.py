"""Relative effective context length, RECL (Dai et al. 2019, "Transformer-XL", arXiv:1901.02860,
section 4.3 and appendix; docs/method.md §5): how far back the context still helps a model,
measured against a group of models.

Definition, for a group of models M evaluated on the same T tokens at context lengths
``c0, c0 + Δ, ...``, with ``l_m(c, t)`` the NLL of token t under model m at context c:

- base: ``b(c, t) = min_m l_m(c, t)``, the best of the group;
- hardest tokens: ``τ(c)``, the ``r`` fraction of the tokens with the largest ``b(c, t)``
  (``round(r·T)`` tokens, at least one);
- relative loss of m at context c' against base context c:
  ``f_m(c, c') = mean_{t in τ(c)} min(b(c, t), l_m(c', t))``;
- relative gain: ``g_m(c, c + Δ) = (f_m(c, c) - f_m(c, c + Δ)) / f_m(c, c)`` (0 when
  ``f_m(c, c) = 0``); clipping at the base makes a model gain only where it beats the group's
  best at the shorter context;
- RECL of m: the largest c with ``g_m(c, c + Δ) >= threshold``, scanning c upwards from c0 and
  stopping at the first c whose gain falls below the threshold (as the paper's procedure, which
  increases c while the gain stays above it). :func:`recl_of` says how the scan ended:
  ``found`` (a gain fell below the threshold: RECL is the c before it), ``at_least`` (no gain
  fell below it inside the scanned range: RECL is at least the last c scanned, the true value
  may be larger) or ``below_range`` (already ``g_m(c0, c0 + Δ)`` is below it: RECL < c0, None).

:func:`relative_gains` and :func:`recl_of` are pure; :func:`recl_markdown` and
:func:`plot_gains` render the ``recl.json`` that ``crtn-recl`` (:mod:`crtn.analysis.recl_app`)
writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: how the scan of :func:`recl_of` ended
FOUND, AT_LEAST, BELOW_RANGE = "found", "at_least", "below_range"


def n_hardest(ratio: float, n_tokens: int) -> int:
    """|τ(c)|: ``round(ratio · n_tokens)`` (halves up), at least 1.

    Raises:
        ValueError: ratio outside (0, 1] or no tokens.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio} must be in (0, 1]")
    if n_tokens <= 0:
        raise ValueError("no tokens")
    return max(1, int(math.floor(ratio * n_tokens + 0.5)))


def relative_gains(losses: torch.Tensor, ratio: float) -> torch.Tensor:
    """Relative gains ``g_m(c_i, c_{i+1})`` of every model of a group (module docstring).

    Args:
        losses: [M, C, T] per-token NLL (nats) of M models at C context lengths ``c_0 < c_1 <
            ...`` (equally spaced, ``Δ`` apart), on the same T tokens.
        ratio: r, the fraction of hardest tokens.

    Returns:
        float64 [M, C-1]: entry [m, i] is ``g_m(c_i, c_i + Δ)``.

    Raises:
        ValueError: fewer than two contexts, or a bad ratio (:func:`n_hardest`).
    """
    if losses.dim() != 3 or losses.shape[1] < 2:
        raise ValueError(f"losses must be [models, contexts >= 2, tokens], got {tuple(losses.shape)}")
    losses = losses.double()
    n_model = losses.shape[0]
    base = losses.min(0).values  # b(c, t): [C, T]
    hard = base[:-1].topk(n_hardest(ratio, losses.shape[2]), dim=-1)  # τ(c_i): [C-1, k]
    idx = hard.indices.expand(n_model, -1, -1)
    b = hard.values  # b(c_i, t), t in τ(c_i)
    f_same = torch.minimum(b, losses[:, :-1].gather(-1, idx)).mean(-1)  # f_m(c_i, c_i): [M, C-1]
    f_next = torch.minimum(b, losses[:, 1:].gather(-1, idx)).mean(-1)  # f_m(c_i, c_i + Δ)
    return torch.where(f_same > 0, (f_same - f_next) / f_same.clamp(min=1e-300), 0.0)


def recl_of(gains: Sequence[float], contexts: Sequence[int], threshold: float) -> tuple[int | None, str]:
    """RECL of one model from its gains (module docstring): scan ``c = contexts[0], contexts[1],
    ...``, stop at the first ``gains[i] < threshold``.

    Args:
        gains: ``g(contexts[i], contexts[i+1])`` for i = 0 .. C-2.
        contexts: the C context lengths (tokens).

    Returns:
        (RECL in tokens or None, status): ``(contexts[i-1], "found")`` when ``gains[i]`` is the
        first below the threshold (i >= 1), ``(None, "below_range")`` when it is ``gains[0]``,
        ``(contexts[C-2], "at_least")`` when none is.
    """
    if len(gains) != len(contexts) - 1 or not gains:
        raise ValueError(f"{len(gains)} gains for {len(contexts)} contexts; expected one fewer (>= 1)")
    for i, g in enumerate(gains):
        if g < threshold:
            return (None, BELOW_RANGE) if i == 0 else (int(contexts[i - 1]), FOUND)
    return int(contexts[-2]), AT_LEAST


def recl_text(entry: dict[str, Any], contexts: Sequence[int]) -> str:
    """A RECL for a table: ``448``, ``>= 448`` (at_least) or ``< 64`` (below_range)."""
    if entry["status"] == BELOW_RANGE:
        return f"< {contexts[0]:,}"
    prefix = ">= " if entry["status"] == AT_LEAST else ""
    return f"{prefix}{entry['recl']:,}"


def recl_markdown(result: dict[str, Any]) -> str:
    """``recl.md``: the RECL table (model x r), then per r the gains ``g(c, c + Δ)`` against c, then
    the mean NLL of each model at each context, from a ``recl.json`` dict."""
    names = [m["name"] for m in result["models"]]
    contexts = result["contexts"]
    ratios = list(result["recl"])
    lines = [
        f"# RECL: {result['corpus']} ({result['split']} split)",
        "",
        f"Relative effective context length (Dai et al. 2019, section 4.3) of a group of {len(names)} models on "
        f"the same {result['tokens']:,} tokens, contexts c = {contexts[0]:,} .. {contexts[-1]:,} step "
        f"Δ = {result['delta']:,}, threshold {result['threshold']:g}. RECL = the largest c with "
        "g(c, c + Δ) >= threshold, scanning up from c0 and stopping at the first gain below it; "
        "'>= c': it never fell below inside the range; '< c0': already the first gain did.",
        "",
        "| model | context | " + " | ".join(f"r = {r}" for r in ratios) + " |",
        "|---|---|" + "---:|" * len(ratios),
    ]
    for m in result["models"]:
        cells = [recl_text(result["recl"][r][m["name"]], contexts) for r in ratios]
        lines.append(f"| {m['name']} | {m['context']} | " + " | ".join(cells) + " |")
    for r in ratios:
        lines += ["", f"## Relative gain g(c, c + Δ), r = {r}", ""]
        lines += ["| c | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for i, c in enumerate(contexts[:-1]):
            cells = [f"{result['recl'][r][n]['gains'][i]:.4f}" for n in names]
            lines.append(f"| {c:,} | " + " | ".join(cells) + " |")
    lines += ["", "## Mean NLL (nats) at each context", ""]
    lines += ["| c | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for i, c in enumerate(contexts):
        lines.append(f"| {c:,} | " + " | ".join(f"{m['loss'][i]:.4f}" for m in result["models"]) + " |")
    return "\n".join(lines) + "\n"


def plot_gains(result: dict[str, Any], path: Path) -> bool:
    """``recl_gain.png``: per r, ``g_m(c, c + Δ)`` against c, one line per model, the threshold
    dashed and each model's RECL marked; from a ``recl.json`` dict."""
    from matplotlib.figure import Figure

    ratios = list(result["recl"])
    contexts = result["contexts"][:-1]
    if not ratios or not contexts:
        return False
    fig = Figure(figsize=(5.5 * len(ratios), 4.6), dpi=110, layout="constrained")
    axes = fig.subplots(1, len(ratios), squeeze=False)[0]
    for ax, r in zip(axes, ratios):
        for i, m in enumerate(result["models"]):
            entry = result["recl"][r][m["name"]]
            color = f"C{i % 10}"
            label = f"{m['name']}: RECL {recl_text(entry, result['contexts'])}"
            ax.plot(contexts, entry["gains"], marker="o", markersize=3.5, color=color, label=label)
            if entry["recl"] is not None:
                ax.axvline(entry["recl"], color=color, linestyle=":", linewidth=1.2)
        ax.axhline(result["threshold"], color="0.3", linestyle="--", linewidth=1.0, label="threshold")
        ax.set_xlabel(f"context c (tokens); gain from c to c + Δ, Δ = {result['delta']}")
        ax.set_ylabel("relative gain g(c, c + Δ)")
        ax.set_title(f"r = {r}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(
        f"RECL, {result['corpus']} ({result['split']} split, {result['tokens']:,} tokens)", fontsize=11
    )
    fig.savefig(path)
    return True
