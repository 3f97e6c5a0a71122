"""The ``config`` and ``table`` sections of ``crtn-bench``: models as ``crtn-train`` composes them,
against Transformer-XL (docs/results.md, "Performance").

- ``config``: the model of the command line (``model``/``cache``/``query``/``summary``, at the
  sizes of its ``model.*``) against Transformer-XL of the same sizes, ``tgt_len`` and ``mem_len``
  (``model.name=txl``), and, for a model with a cache, against Transformer-XL whose memory covers
  the same range, m + N L (docs/method.md §3).
- ``table``: the rows of ``bench.rows`` (name: ``crtn-train`` overrides), each composed by Hydra's
  compose API from ``conf/bench.yaml`` exactly as the command line would (so ``model=crtn_original``
  brings the query, summary and cache settings its option sets), at the standard sizes.

Every comparison alternates its configurations in one process (:func:`crtn.bench.cases.time_cases`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from crtn.app import check_keys, one_line
from crtn.app_config import BenchAppSpec, BenchSpec, register_configs
from crtn.bench.cases import Bench, Case, Row, free, make_case, median, row, size_overrides, time_cases
from crtn.bench.cases import tokens_per_s as tps
from crtn.config import uses_cache
from crtn.errors import ConfigError
from crtn.model import Spec, dependency_range, resolve_spec

#: the config groups a table row may set (``pair`` selects a query and a summary at once)
ROW_GROUPS = ("model", "cache", "query", "summary", "pair")


# ================================================================== specs
def has_cache(spec: Spec) -> bool:
    """Whether the model ``spec`` describes keeps a cache (a model with one, n_slot and top_k > 0)."""
    return uses_cache(spec.model.name) and spec.cache.enabled


def same_range(spec: Spec) -> int:
    """CRTN's dependency range in tokens, m + N L (docs/method.md §3)."""
    return dependency_range(spec.model.mem_len, spec.cache.n_slot, spec.model.tgt_len)


def txl_of(spec: Spec, mem_len: int | None = None) -> Spec:
    """Transformer-XL of ``spec``'s sizes (``model.name=txl``; the same ``tgt_len``, and ``mem_len``
    unless given), resolved."""
    m = replace(spec.model, name="txl", mem_len=spec.model.mem_len if mem_len is None else mem_len)
    return resolve_spec(replace(spec, model=m))


def describe(spec: Spec) -> str:
    """A short name of a model: ``txl(mem_len=64)``, ``crtn(token/token_max, n_slot=32, top_k=2, layers=1)``."""
    m, c = spec.model, spec.cache
    if not has_cache(spec):
        return f"{m.name}(mem_len={m.mem_len})"
    layers = "" if c.layers == m.n_layer else f", layers={c.layers}"
    return f"{m.name}({spec.query.strategy}/{spec.summary.name}, n_slot={c.n_slot}, top_k={c.top_k}{layers})"


def compose_bench(overrides: list[str]) -> Any:
    """``conf/bench.yaml`` composed with ``overrides`` by Hydra's compose API (inside the running
    app, or on its own), checked against the schema.

    Raises:
        ConfigError: Hydra's or OmegaConf's error (an unknown option or key, a wrong type), one line.
    """
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name="bench", overrides=overrides)
        else:
            register_configs()
            with initialize_config_module("crtn.conf", version_base="1.3"):
                cfg = compose(config_name="bench", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(one_line(e)) from None
    check_keys(cfg, BenchAppSpec)
    return cfg


def compose_rows(s: BenchSpec) -> tuple[Row, ...]:
    """The table's rows (``bench.rows``, those named by ``bench.only`` and the reference when it
    is set): each row's overrides over the standard sizes (a size the row sets is the row's),
    composed (:func:`compose_bench`) and resolved; ``Row.large`` is the same spec with
    ``n_slot = bench.n_slot_large`` (models with a cache).

    Raises:
        ConfigError: ``bench.rows.NAME: ...`` (an override outside the model groups, any error of
            composition or resolution), or a ``bench.reference`` or ``bench.only`` entry that
            names no row.
    """
    if s.reference not in s.rows:
        raise ConfigError(f"bench.reference={s.reference!r} is not one of bench.rows: {', '.join(s.rows)}")
    unknown = [n for n in s.only or () if n not in s.rows]
    if unknown:
        raise ConfigError(f"bench.only: {unknown[0]!r} is not one of bench.rows: {', '.join(s.rows)}")
    rows = []
    for name, overrides in s.rows.items():
        if s.only is not None and name not in s.only and name != s.reference:
            continue
        keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
        try:
            outside = [o for o, k in zip(overrides, keys) if k.split(".")[0] not in ROW_GROUPS]
            if outside:
                raise ConfigError(f"{outside[0]!r} sets no model group ({', '.join(ROW_GROUPS)})")
            sizes = [f"{k}={v}" for k, v in size_overrides(s, s.tgt_len).items() if k not in keys]
            spec = resolve_spec(compose_bench([*sizes, *overrides]))
            large = None
            if has_cache(spec):
                large = resolve_spec(replace(spec, cache=replace(spec.cache, n_slot=s.n_slot_large)))
        except ConfigError as e:
            raise ConfigError(f"bench.rows.{name}: {e}") from None
        rows.append(Row(name, tuple(overrides), spec, large))
    return tuple(rows)


# ================================================================== config
def bench_config(b: Bench) -> dict[str, Any]:
    """The composed model against Transformer-XL of the same sizes (training: step time, FLOPs of
    the step's matrix products, peak step memory, tokens/s; evaluation: step time) and, with a
    cache, against Transformer-XL of the same range (tokens/s). ``ratios`` holds the model's:
    ``step_ratio``, ``flop_ratio``, ``memory_ratio``, ``range_ratio``, ``eval_ratio``."""
    spec, s = b.model, b.s
    assert spec is not None, "the config section needs the composed model (Bench.model)"
    command = b.command or "the defaults"
    named = [
        (f"model: {describe(spec)}", spec, f"the model crtn-train composes from: {command}"),
        (f"txl(mem_len={spec.model.mem_len})", txl_of(spec), "Transformer-XL, same sizes (the reference)"),
    ]
    if has_cache(spec):
        n = same_range(spec)
        named.append(
            (f"txl(mem_len={n})", txl_of(spec, n), f"Transformer-XL over the same range, m + N L = {n}")
        )
    what = {name: measures for name, _, measures in named}
    b.log(f"config: {describe(spec)} against Transformer-XL, training")
    cases = [make_case(name, sp, s, device=b.device) for name, sp, _ in named]
    time_cases(cases, b)
    model, ref = cases[0], cases[1]
    ratios = {
        "step_ratio": median(model) / median(ref),
        "flop_ratio": _ratio(model.flops, ref.flops),
        "memory_ratio": _ratio(model.peak, ref.peak),
    }
    if len(cases) > 2:
        ratios["range_ratio"] = tps(model) / tps(cases[2])
        ratios["range_tokens"] = same_range(spec)
    train = [{**row(c, ref), "measures": what[c.name]} for c in cases]
    free(cases)
    b.log("config: evaluation")
    cases = [make_case(name, sp, s, device=b.device, train=False) for name, sp, _ in named[:2]]
    time_cases(cases, b, measure_step=False)
    ratios["eval_ratio"] = median(cases[0]) / median(cases[1])
    evaluation = [
        {**row(c, cases[1]), "measures": f"evaluation step (no gradient); {what[c.name]}"} for c in cases
    ]
    free(cases)
    label = f"config {describe(spec)} ({command})"
    return {
        "command": command,
        "model": describe(spec),
        "label": label,
        "train": train,
        "eval": evaluation,
        "ratios": ratios,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ================================================================== table
def bench_table(b: Bench) -> dict[str, Any]:
    """Every row of ``bench.rows`` against the reference row (``bench.reference``): training step
    time, FLOPs of the step's matrix products and peak step memory, tokens/s against
    Transformer-XL of the row's range, step time at ``n_slot_large`` over step time at
    ``n_slot`` (same row), evaluation step time."""
    s = b.s
    ref = next(r for r in b.rows if r.name == s.reference)
    out = {
        r.name: {"row": r.name, "overrides": list(r.overrides), "config": describe(r.spec)} for r in b.rows
    }
    long = {n: txl_of(ref.spec, n) for n in sorted({same_range(r.spec) for r in b.rows if has_cache(r.spec)})}
    # training, every row and the same-range references alternating
    cases = {r.name: make_case(r.name, r.spec, s, device=b.device) for r in b.rows}
    refs = {n: make_case(f"txl(mem_len={n})", sp, s, device=b.device) for n, sp in long.items()}
    b.log(f"table: training, {len(cases)} rows and {len(refs)} same-range reference(s)")
    time_cases([*cases.values(), *refs.values()], b)
    for r in b.rows:
        out[r.name].update(_train_columns(r, cases[r.name], cases[ref.name], refs))
    references = [
        {**row(c), "measures": "Transformer-XL over the range of the rows with a cache"}
        for c in refs.values()
    ]
    free([*cases.values(), *refs.values()])
    for r in b.rows:
        if r.large is not None:
            out[r.name].update(_scaling_columns(r, b))
    b.log("table: evaluation")
    cases = {r.name: make_case(r.name, r.spec, s, device=b.device, train=False) for r in b.rows}
    time_cases(list(cases.values()), b, measure_step=False)
    for r in b.rows:
        c = cases[r.name]
        out[r.name].update(eval_step_ms=1000 * median(c), eval_ratio=median(c) / median(cases[ref.name]))
    free(list(cases.values()))
    return {
        "reference": ref.name,
        "n_slot": s.n_slot,
        "n_slot_large": s.n_slot_large,
        "range_references": references,
        "rows": list(out.values()),
    }


def _train_columns(r: Row, c: Case, ref: Case, refs: dict[int, Case]) -> dict[str, Any]:
    """A row's training columns: its measurements and spec, ratios to the reference (step time,
    matrix-product FLOPs, peak memory), and (with a cache) tokens/s over that of Transformer-XL of
    the same range."""
    out = {
        **row(c, ref),
        "step_ratio": median(c) / median(ref),
        "flop_ratio": _ratio(c.flops, ref.flops),
        "memory_ratio": _ratio(c.peak, ref.peak),
    }
    del out["time_ratio_vs_ref"], out["config"]
    if has_cache(r.spec):
        n = same_range(r.spec)
        out.update(range_tokens=n, range_ratio=tps(c) / tps(refs[n]))
    return out


def _scaling_columns(r: Row, b: Bench) -> dict[str, Any]:
    """Step time of a row at ``n_slot_large`` over its step time at its own ``n_slot`` (training,
    the two alternating)."""
    assert r.large is not None
    n0, n1 = r.spec.cache.n_slot, r.large.cache.n_slot
    b.log(f"table: {r.name} at n_slot {n0} and {n1}")
    cases = [
        make_case(f"{r.name} n_slot={n}", sp, b.s, device=b.device) for n, sp in ((n0, r.spec), (n1, r.large))
    ]
    time_cases(cases, b, measure_step=False)
    out = {"step_ms_large": 1000 * median(cases[1]), "scaling_ratio": median(cases[1]) / median(cases[0])}
    free(cases)
    return out
