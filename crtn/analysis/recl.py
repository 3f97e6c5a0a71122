"""Relative effective context length, RECL: how far back the context still helps a model,
measured against a group of models (docs/method.md §5). Two definitions, chosen by
``recl.definition``:

- ``dai``: Dai et al. 2019, "Transformer-XL" (arXiv:1901.02860), section 4.3 and appendix
  "Details about RECL", the metric that paper reports;
- ``crtn_authors``: the CRTN authors' ``CRTN/recl.py`` (github.com/xyz961014/longterm), a
  second definition with another gain, threshold, hardest-token count and base.

Both, for a group of models M evaluated on the same T tokens at context lengths
``c_0 < c_1 < ...`` (``Δ`` apart), with ``l_m(c, t)`` the NLL (nats) of token t under model m
at context c:

- base ``b(c, t)``: ``dai`` ``min_m l_m(c, t)``, the best of the group at c; ``crtn_authors``
  ``min_m min_{c_j <= c} l_m(c_j, t)``, the best of the group at any context scanned so far
  (their script carries the base forward from step to step);
- hardest tokens ``τ(c)``: the ``k`` tokens with the largest ``b(c, t)``, ``k = round(r·T)``
  (halves up; the paper's "top-r positions") for ``dai``, ``k = ceil(r·T)`` for
  ``crtn_authors``, at least one;
- relative loss of m at context c' against base context c:
  ``f_m(c, c') = mean_{t in τ(c)} min(b(c, t), l_m(c', t))``, so ``f_m(c, c)`` is the mean base
  over τ(c); clipping at the base makes a model gain only where it beats the group's best;
- relative gain: ``dai`` the relative perplexity reduction
  ``g_m(c, c') = (exp f_m(c, c) - exp f_m(c, c')) / exp f_m(c, c) = 1 - exp(f_m(c, c') - f_m(c, c))``;
  ``crtn_authors`` the relative loss reduction ``(f_m(c, c) - f_m(c, c')) / f_m(c, c)`` (0 when
  ``f_m(c, c) = 0``), about ``f_m(c, c)`` times smaller for small gains;
- threshold (:data:`THRESHOLDS`): 0.01 for ``dai``, 0.001 for ``crtn_authors``;
- stopping rule, the same in both: start at ``c = c_0``; while ``g_m(c, c + Δ) >= threshold``
  set ``c = c + Δ``; RECL is the first c whose gain ``g_m(c, c + Δ)`` falls below the
  threshold (the c of the failing step, not the one before it).

:func:`recl_of` also says how the scan ended: ``found`` (the gain of some ``c_i``, i >= 1, fell
below the threshold: RECL = ``c_i``), ``at_most`` (already ``g_m(c_0, c_1)`` did: the scan
returns ``c_0``, and one started lower could stop lower) or ``at_least`` (no gain fell below it
inside the scanned range: RECL >= the last context, which was reached but whose gain is not
measured).

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

from crtn.errors import check_choice

#: the definitions of RECL (module docstring)
DAI, CRTN_AUTHORS = "dai", "crtn_authors"
#: each definition's threshold on its relative gain: Dai et al. 2019, appendix (0.01); the
#: ``--threshold`` default of the CRTN authors' ``CRTN/recl.py`` (0.001)
THRESHOLDS = {DAI: 0.01, CRTN_AUTHORS: 0.001}
DEFINITIONS = tuple(THRESHOLDS)

#: how the scan of :func:`recl_of` ended
FOUND, AT_LEAST, AT_MOST = "found", "at_least", "at_most"


def n_hardest(ratio: float, n_tokens: int, definition: str) -> int:
    """|τ(c)|: ``round(ratio · n_tokens)`` (halves up) for ``dai``, ``ceil(ratio · n_tokens)`` for
    ``crtn_authors`` (the product rounded to 9 decimals first, so that 0.3 · 10 is 3); at least 1.

    Raises:
        ValueError: ratio outside (0, 1] or no tokens. ConfigError: an unknown definition.
    """
    check_choice("definition", definition, DEFINITIONS)
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio} must be in (0, 1]")
    if n_tokens <= 0:
        raise ValueError("no tokens")
    exact = round(ratio * n_tokens, 9)
    return max(1, math.ceil(exact) if definition == CRTN_AUTHORS else int(math.floor(exact + 0.5)))


def relative_gains(losses: torch.Tensor, ratio: float, definition: str) -> torch.Tensor:
    """Relative gains ``g_m(c_i, c_{i+1})`` of every model of a group under ``definition``
    (module docstring).

    Args:
        losses: [M, C, T] per-token NLL (nats) of M models at C context lengths ``c_0 < c_1 <
            ...`` (equally spaced, ``Δ`` apart), on the same T tokens.
        ratio: r, the fraction of hardest tokens.
        definition: ``dai`` or ``crtn_authors`` (:data:`DEFINITIONS`).

    Returns:
        float64 [M, C-1]: entry [m, i] is ``g_m(c_i, c_i + Δ)``.

    Raises:
        ValueError: fewer than two contexts or a bad ratio; ConfigError: an unknown definition
            (:func:`n_hardest`).
    """
    if losses.dim() != 3 or losses.shape[1] < 2:
        raise ValueError(f"losses must be [models, contexts >= 2, tokens], got {tuple(losses.shape)}")
    k = n_hardest(ratio, losses.shape[2], definition)
    losses = losses.double()
    n_model = losses.shape[0]
    base = losses.min(0).values  # [C, T]: the group's best at each context
    if definition == CRTN_AUTHORS:
        base = base.cummin(0).values  # ... at any context up to c
    hard = base[:-1].topk(k, dim=-1)  # τ(c_i): [C-1, k]
    idx = hard.indices.expand(n_model, -1, -1)
    b = hard.values  # b(c_i, t), t in τ(c_i)
    f_same = b.mean(-1).expand(n_model, -1)  # f_m(c_i, c_i) = mean base: [M, C-1]
    f_next = torch.minimum(b, losses[:, 1:].gather(-1, idx)).mean(-1)  # f_m(c_i, c_i + Δ)
    if definition == DAI:
        # 1 - exp(f' - f), the relative perplexity reduction; + 0.0 turns -0.0 into 0.0
        return -torch.expm1(f_next - f_same) + 0.0
    return torch.where(f_same > 0, (f_same - f_next) / f_same.clamp(min=1e-300), 0.0)


def recl_of(gains: Sequence[float], contexts: Sequence[int], threshold: float) -> tuple[int, str]:
    """RECL of one model from its gains (module docstring): scan ``c = contexts[0], contexts[1],
    ...``; RECL is the first c whose gain is below ``threshold``.

    Args:
        gains: ``g(contexts[i], contexts[i+1])`` for i = 0 .. C-2.
        contexts: the C context lengths (tokens).
        threshold: the definition's threshold (:data:`THRESHOLDS`); a gain equal to it passes.

    Returns:
        (RECL in tokens, status): ``(contexts[i], "found")`` when ``gains[i]`` is the first below
        the threshold and i >= 1, ``(contexts[0], "at_most")`` when it is ``gains[0]``,
        ``(contexts[C-1], "at_least")`` when none is.

    Raises:
        ValueError: not one gain fewer than contexts, or no gain.
    """
    if len(gains) != len(contexts) - 1 or not gains:
        raise ValueError(f"{len(gains)} gains for {len(contexts)} contexts; expected one fewer (>= 1)")
    for i, g in enumerate(gains):
        if g < threshold:
            return int(contexts[i]), (FOUND if i else AT_MOST)
    return int(contexts[-1]), AT_LEAST


def recl_text(entry: dict[str, Any]) -> str:
    """A RECL for a table: ``448``, ``>= 4,128`` (at_least) or ``<= 96`` (at_most)."""
    prefix = {AT_LEAST: ">= ", AT_MOST: "<= "}.get(entry["status"], "")
    return f"{prefix}{entry['recl']:,}"


#: the gain and its source, for the outputs
DEFINITION_TEXT = {
    DAI: "Dai et al. 2019, appendix: g = 1 - exp(f(c, c + Δ) - f(c, c)), the relative perplexity reduction",
    CRTN_AUTHORS: "the CRTN authors' CRTN/recl.py: g = (f(c, c) - f(c, c + Δ)) / f(c, c), the relative loss "
    "reduction, over a base carried forward from c0",
}


def recl_markdown(result: dict[str, Any]) -> str:
    """``recl.md``: the RECL table (model x r), then per r the gains ``g(c, c + Δ)`` against c, then
    the mean NLL of each model at each context, from a ``recl.json`` dict."""
    names = [m["name"] for m in result["models"]]
    contexts = result["contexts"]
    ratios = list(result["recl"])
    lines = [
        f"# RECL: {result['corpus']} ({result['split']} split)",
        "",
        f"Relative effective context length, definition `{result['definition']}` "
        f"({DEFINITION_TEXT[result['definition']]}), of a group of {len(names)} models on the same "
        f"{result['tokens']:,} tokens, contexts c = {contexts[0]:,} .. {contexts[-1]:,} step "
        f"Δ = {result['delta']:,}, threshold {result['threshold']:g}. RECL = the first c, scanning up "
        "from c0, whose gain g(c, c + Δ) is below the threshold; '<= c0': already the first gain "
        "was (a scan started lower could stop lower); '>= c': no gain inside the range was.",
        "",
        "| model | context | " + " | ".join(f"r = {r}" for r in ratios) + " |",
        "|---|---|" + "---:|" * len(ratios),
    ]
    for m in result["models"]:
        cells = [recl_text(result["recl"][r][m["name"]]) for r in ratios]
        lines.append(f"| {m['name']} | {m['context']} | " + " | ".join(cells) + " |")
    for r in ratios:
        lines += ["", f"## Relative gain g(c, c + Δ), r = {r}", ""]
        lines += ["| c | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for i, c in enumerate(contexts[:-1]):
            cells = [f"{result['recl'][r][n]['gains'][i]:.5f}" for n in names]
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
            label = f"{m['name']}: RECL {recl_text(entry)}"
            ax.plot(contexts, entry["gains"], marker="o", markersize=3.5, color=color, label=label)
            ax.axvline(entry["recl"], color=color, linestyle=":", linewidth=1.2)
        ax.axhline(result["threshold"], color="0.3", linestyle="--", linewidth=1.0, label="threshold")
        ax.set_xlabel(f"context c (tokens); gain from c to c + Δ, Δ = {result['delta']}")
        ax.set_ylabel("relative gain g(c, c + Δ)")
        ax.set_title(f"r = {r}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(
        f"RECL ({result['definition']}), {result['corpus']} ({result['split']} split, "
        f"{result['tokens']:,} tokens)",
        fontsize=11,
    )
    fig.savefig(path)
    return True
