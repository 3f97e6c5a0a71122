"""What ``crtn-bench`` reports: the targets (:func:`check_targets`) and ``bench.md``
(:func:`markdown`)."""

from __future__ import annotations

from typing import Any

#: The targets every configuration with a cache is measured against, in the ``config`` section and
#: in each row of the ``table`` (docs/results.md, "Performance"): training step and peak step
#: memory over Transformer-XL's at the same sizes and mem_len (N = n_slot), tokens/s over that of
#: Transformer-XL whose memory covers the same range (m + N L), and the step at n_slot_large over
#: the step at n_slot.
STEP_LIMIT, MEMORY_LIMIT, RANGE_LIMIT, SCALING_LIMIT = 1.3, 1.5, 5.0, 1.5
#: the share of a faiss evaluation step (batch 1, ``bench.eval_slots`` slots) spent in retrieval
RETRIEVAL_SHARE_LIMIT = 0.30


def _subjects(res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(which configuration, its ratios) of every configuration with a cache that was measured."""
    out = []
    cfg = res.get("config")
    if cfg and "range_ratio" in cfg["ratios"]:
        out.append((cfg["label"], cfg["ratios"]))
    for r in res.get("table", {}).get("rows", []):
        if "range_ratio" in r:
            out.append((f"table {r['row']}: {r['config']} ({' '.join(r['overrides'])})", r))
    return out


def check_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets (:data:`STEP_LIMIT`, :data:`MEMORY_LIMIT`, :data:`RANGE_LIMIT`,
    :data:`SCALING_LIMIT`, :data:`RETRIEVAL_SHARE_LIMIT`) evaluated on this run's ratios: one row per
    target and configuration (``config`` says which), with the measured ratio, the limit and
    whether it is met. A ratio that was not measured (``bench.memory=false``) gives no row."""
    out = []
    for config, r in _subjects(res):
        targets = [
            ("step_ratio", "train step / txl", STEP_LIMIT),
            ("memory_ratio", "peak step memory / txl", MEMORY_LIMIT),
            ("range_ratio", f"tokens/s / txl(mem_len={r['range_tokens']})", RANGE_LIMIT),
        ]
        if "scaling_ratio" in r:
            n0, n1 = res["table"]["n_slot"], res["table"]["n_slot_large"]
            targets.append(("scaling_ratio", f"step(n_slot={n1}) / step(n_slot={n0})", SCALING_LIMIT))
        for key, name, limit in targets:
            if r.get(key) is not None:
                out.append(_target(config, name, r[key], limit=limit, higher=key == "range_ratio"))
    if "retrieval" in res:
        ev = res["retrieval"]["eval_faiss"]
        config = f"crtn(token/last_state), faiss, batch 1, n_slot={ev['n_slot']}"
        share = ev["float32"]["retrieval_share"]
        out.append(_target(config, "eval retrieval share", share, limit=RETRIEVAL_SHARE_LIMIT, higher=False))
    return out


def _target(config: str, name: str, measured: float, limit: float, higher: bool) -> dict[str, Any]:
    """A target's row; ``higher``: the measured value must reach the limit (else stay below it)."""
    met = measured >= limit if higher else measured <= limit
    return {"config": config, "target": name, "measured": measured, "limit": limit, "met": bool(met)}


def _cell(v: Any, ratio: bool = False) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.2f}x" if ratio else f"{v:,.3g}"
    return str(v)


def _table(lines: list[str], rows: list[dict], cols: list[str], ratios: tuple[str, ...] = ()) -> None:
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c), c in ratios) for c in cols) + " |")
    lines.append("")


COLS = [
    "config",
    "step_ms",
    "tokens_per_s",
    "time_ratio_vs_ref",
    "gflop",
    "gflop_per_s",
    "peak_step_mb",
    "state_mb",
    "measures",
]


def _config(lines: list[str], cfg: dict[str, Any]) -> None:
    lines.append(f"## config: {cfg['model']} against Transformer-XL")
    lines += [
        "",
        f"composed from: `{cfg['command']}`",
        "",
        "Training (ratio = step time / the reference's):",
        "",
    ]
    _table(lines, cfg["train"], COLS)
    lines += ["Evaluation:", ""]
    _table(lines, cfg["eval"], COLS)
    r = cfg["ratios"]
    parts = [f"training step {r['step_ratio']:.2f}x txl's"]
    if r.get("flop_ratio") is not None:
        parts.append(f"its matrix products {r['flop_ratio']:.2f}x txl's FLOPs")
    if r["memory_ratio"] is not None:
        parts.append(f"peak step memory {r['memory_ratio']:.2f}x")
    if "range_ratio" in r:
        parts.append(f"tokens/s {r['range_ratio']:.2f}x txl(mem_len={r['range_tokens']})'s")
    parts.append(f"evaluation step {r['eval_ratio']:.2f}x")
    lines += ["Ratios: " + ", ".join(parts) + ".", ""]


def _cost_table(lines: list[str], t: dict[str, Any]) -> None:
    ref, n0, n1 = t["reference"], t["n_slot"], t["n_slot_large"]
    ranges = sorted({r["range_tokens"] for r in t["rows"] if "range_tokens" in r})
    span = f"txl({ranges[0]})" if len(ranges) == 1 else "txl(m + N L)"
    lines += [f"## table: cost against `{ref}` (standard sizes, n_slot {n0})", ""]
    head = {
        "row": "row",
        "overrides": "overrides",
        "step_ms": "step ms",
        "step_ratio": f"step / {ref}",
        "flop_ratio": f"products / {ref}",
        "gflop_per_s": "products GFLOP/s",
        "memory_ratio": f"memory / {ref}",
        "range_ratio": f"tokens/s / {span}",
        "scaling_ratio": f"step N={n1} / N={n0}",
        "eval_ratio": f"eval step / {ref}",
    }
    rows = [{**r, "overrides": " ".join(f"`{o}`" for o in r["overrides"])} for r in t["rows"]]
    ratios = ("step_ratio", "flop_ratio", "memory_ratio", "range_ratio", "scaling_ratio", "eval_ratio")
    lines.append("| " + " | ".join(head.values()) + " |")
    lines.append("|" + "---|" * len(head))
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c), c in ratios) for c in head) + " |")
    lines.append("")


def markdown(res: dict[str, Any]) -> str:
    """The benchmark's tables as Markdown (``bench.md``)."""
    units = "with" if res.get("cpu_bf16_units") else "without"
    cpu = f"CPU {res.get('cpu')}, {units} bfloat16 units, {res.get('threads')} threads"
    lines = [
        f"# crtn-bench ({res['device']}, {res['time']})",
        "",
        cpu,
        "",
        f"settings: `{res['settings']}`",
        "",
    ]
    if "config" in res:
        _config(lines, res["config"])
    if "table" in res:
        _cost_table(lines, res["table"])
    if "strategies" in res:
        for mode in ("train", "eval"):
            lines.append(f"## strategies against txl ({mode}; ratio = step time / txl's)")
            _table(lines, res["strategies"][mode], COLS)
    if "range" in res:
        lines.append(f"## range: same dependency range ({res['range']['range_tokens']} tokens)")
        _table(lines, res["range"]["rows"], [*COLS, "speedup_vs_txl_same_range"])
    if "scaling" in res:
        for key, rows in res["scaling"].items():
            lines.append(f"## scaling: step time against n_slot ({key}; ratio to the smallest)")
            _table(lines, rows, COLS[:4])
    if "retrieval" in res:
        lines.append("## retrieval alone (batch 1, one segment of queries)")
        _table(lines, res["retrieval"]["rows"], ["keys", "backend", "ms", "recall_at_k"])
        ev = res["retrieval"]["eval_faiss"]
        lines += [f"Evaluation step, batch 1, faiss, n_slot={ev['n_slot']:,}:", ""]
        dtypes = [{"cache dtype": k, **v} for k, v in ev.items() if isinstance(v, dict)]
        _table(lines, dtypes, ["cache dtype", "step_ms", "retrieval_share", "cache_mb"])
    if res.get("targets"):
        lines.append("## Targets")
        _table(lines, res["targets"], ["config", "target", "measured", "limit", "met"])
    return "\n".join(lines)
