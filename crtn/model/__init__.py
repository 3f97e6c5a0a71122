"""Models: attention, transformer, cache, query strategies and summaries (SPEC §2-3).

| module            | what                                                              |
|-------------------|-------------------------------------------------------------------|
| ``attention.py``  | relative multi-head attention, with retrieved segments (SPEC §2, §3 step 3) |
| ``transformer.py``| Transformer-XL (``txl``) and ``vanilla``: layers, memory, the step |
| ``crtn.py``       | CRTN: the cache step (query pass, selection, main pass, renewal)  |
| ``cache.py``      | the key-value cache: storage, renewal, top-k retrieval            |
| ``query.py``      | query strategies (registry :data:`STRATEGIES`)                    |
| ``summary.py``    | key/query summaries (registry :data:`SUMMARIES`)                  |
| ``adaptive.py``   | adaptive input and projected adaptive softmax                     |

Models are registered in :data:`MODELS` by their config name (``model.name``); each class
states its capabilities (``has_memory``, ``has_cache``), so nothing outside this package
needs to know model names.
"""

from __future__ import annotations

from typing import Any

from crtn.errors import ConfigError
from crtn.model.cache import (
    ALPHA_NORMS,
    BACKENDS,
    CACHE_DTYPES,
    FAISS_INDEXES,
    POS_MODES,
    RENEWALS,
    RetrievalStats,
    SegmentCache,
    Selection,
)
from crtn.model.crtn import CRTN, CRTNState, dependency_range
from crtn.model.query import STRATEGIES, QueryStrategy
from crtn.model.summary import SUMMARIES, Summary, conv_out_len
from crtn.model.transformer import LMOutput, State, TransformerLM, VanillaLM

__all__ = [
    "CRTN",
    "CRTNState",
    "LMOutput",
    "MODELS",
    "QueryStrategy",
    "RetrievalStats",
    "STRATEGIES",
    "SUMMARIES",
    "SegmentCache",
    "Selection",
    "State",
    "Summary",
    "TransformerLM",
    "VanillaLM",
    "build_model",
    "dependency_range",
    "model_class",
    "valid_pairs",
    "valid_summaries",
    "validate_model",
]

#: every model by its config name (``model.name``)
MODELS: dict[str, type[TransformerLM]] = {"vanilla": VanillaLM, "txl": TransformerLM, "crtn": CRTN}


def model_class(name: str) -> type[TransformerLM]:
    """The class registered as ``name``.

    Raises:
        ConfigError: unknown name (one line listing the registered ones).
    """
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not one of: {', '.join(MODELS)}")
    return MODELS[name]


def valid_summaries(strategy: str) -> tuple[str, ...]:
    """Summaries that may be paired with query ``strategy`` (SPEC §3: by the strategy's kind)."""
    kind = STRATEGIES[strategy].kind
    return tuple(name for name, cls in SUMMARIES.items() if kind in cls.kinds)


def valid_pairs() -> list[tuple[str, str]]:
    """Every valid (query strategy, summary) pair of SPEC §3, strategies in SPEC order."""
    return [(q, s) for q in STRATEGIES for s in valid_summaries(q)]


def _choice(key: str, value: Any, options: tuple[str, ...] | dict) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(options)}")


def _validate_transformer(model: Any) -> None:
    for key in ("n_layer", "n_head", "d_model", "d_head", "d_inner", "tgt_len"):
        if getattr(model, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be > 0")
    if model.mem_len < 0:
        raise ConfigError(f"model.mem_len={model.mem_len} must be >= 0")
    if model.d_embed is not None and model.d_embed <= 0:
        raise ConfigError(f"model.d_embed={model.d_embed} must be > 0")
    for key in ("dropout", "dropatt", "dropemb", "dropinp", "dropfor", "dropatt_out"):
        value = getattr(model, key)
        if value is not None and not 0.0 <= value < 1.0:
            raise ConfigError(f"model.{key}={value} must be in [0, 1)")
    if model.div_val < 1:
        raise ConfigError(f"model.div_val={model.div_val} must be >= 1")
    if list(model.cutoffs) != sorted(set(model.cutoffs)) or any(c <= 0 for c in model.cutoffs):
        raise ConfigError(f"model.cutoffs={list(model.cutoffs)} must be increasing positive integers")
    if model.tie_projs is not None and len(model.tie_projs) != len(model.cutoffs) + 1:
        raise ConfigError(
            f"model.tie_projs has {len(model.tie_projs)} entries; expected len(model.cutoffs)+1 "
            f"= {len(model.cutoffs) + 1}"
        )


def _validate_cache(model: Any, cache: Any, query: Any, summary: Any) -> None:
    if model.mem_len % model.tgt_len != 0:
        raise ConfigError(
            f"model.mem_len={model.mem_len} must be a multiple of model.tgt_len={model.tgt_len} "
            f"for model={model.name} (SPEC §3, renewal)"
        )
    if cache.n_slot < 0 or cache.top_k < 0:
        raise ConfigError(f"cache.n_slot={cache.n_slot} and cache.top_k={cache.top_k} must be >= 0")
    if not cache.theta > 0:
        raise ConfigError(f"cache.theta={cache.theta} must be > 0")
    _choice("cache.alpha_norm", cache.alpha_norm, ALPHA_NORMS)
    _choice("cache.pos", cache.pos, POS_MODES)
    _choice("cache.backend", cache.backend, BACKENDS)
    _choice("cache.faiss_index", cache.faiss_index, FAISS_INDEXES)
    _choice("cache.renew", cache.renew, RENEWALS)
    if cache.dtype is not None:
        _choice("cache.dtype", cache.dtype, CACHE_DTYPES)
    _choice("query.strategy", query.strategy, STRATEGIES)
    _choice("summary.name", summary.name, SUMMARIES)
    if cache.backend == "faiss" and cache.renew != "fifo":
        raise ConfigError("cache.backend=faiss supports cache.renew=fifo only")
    if cache.backend == "faiss" and cache.alpha_norm == "original":
        raise ConfigError(
            "cache.alpha_norm=original needs every slot's score; cache.backend=faiss supports all|topk"
        )
    if cache.backend == "faiss" and SUMMARIES[summary.name].row_keys:
        raise ConfigError(
            f"cache.backend=faiss does not support summary={summary.name} (one key per slot needed)"
        )
    allowed = valid_summaries(query.strategy)
    if summary.name not in allowed:
        by_kind: dict[str, list[str]] = {}
        for q in STRATEGIES:
            by_kind.setdefault("|".join(valid_summaries(q)), []).append(q)
        pairs = "; ".join(f"{'|'.join(qs)} with {s}" for s, qs in by_kind.items())
        raise ConfigError(
            f"query={query.strategy} cannot be paired with summary={summary.name}. Valid pairs: {pairs}"
        )
    if summary.d_key is not None and summary.d_key <= 0:
        raise ConfigError(f"summary.d_key={summary.d_key} must be > 0")
    ngram = getattr(summary, "ngram", None)
    if ngram is not None and ngram != 1:
        if not SUMMARIES[summary.name].row_keys:
            raise ConfigError(f"summary.ngram={ngram} applies to summary=token_max only, not {summary.name}")
    if ngram is not None and not 1 <= ngram <= model.tgt_len:
        raise ConfigError(f"summary.ngram={ngram} must be in 1..model.tgt_len ({model.tgt_len})")
    shift = getattr(summary, "shift", None)
    if shift is not None and shift not in (0, 1):
        raise ConfigError(f"summary.shift={shift} must be 0 or 1")
    if shift not in (None, 0) and not SUMMARIES[summary.name].row_keys:
        raise ConfigError(f"summary.shift={shift} applies to summary=token_max only, not {summary.name}")
    if query.tanh and not STRATEGIES[query.strategy].learned:
        learned = "|".join(q for q, cls in STRATEGIES.items() if cls.learned)
        raise ConfigError(
            f"query.tanh=true applies to the strategies with weights ({learned}), not query={query.strategy}"
        )
    if summary.name == "conv":
        _validate_conv(model)
    _validate_layers(model, cache)


def _validate_layers(model: Any, cache: Any) -> None:
    n = model.n_layer
    if cache.layers is not None:
        if not 1 <= cache.layers <= n:
            raise ConfigError(f"cache.layers={cache.layers} must be in 1..model.n_layer={n} (null: all)")
        if cache.layers < n and model.mem_len < model.tgt_len:
            raise ConfigError(
                f"cache.layers={cache.layers} needs model.mem_len >= model.tgt_len (the shared lower "
                f"layers' memory); got mem_len={model.mem_len}"
            )
        below = n - cache.layers
        if cache.layers < n and cache.key_layer not in (None, below):
            raise ConfigError(
                f"cache.key_layer={cache.key_layer}: with cache.layers={cache.layers} keys and queries come "
                f"from layer {below}, the input of the first retrieving layer (leave key_layer null)"
            )
    if cache.key_layer is not None and not 0 <= cache.key_layer <= n:
        raise ConfigError(f"cache.key_layer={cache.key_layer} must be in 0..model.n_layer={n}")


def _validate_conv(model: Any) -> None:
    H, d, L = model.n_head, model.d_model, model.tgt_len
    if d % H != 0 or H > L or conv_out_len(L, d, H) != d // H:
        raise ConfigError(
            f"summary=conv needs model.d_model ({d}) divisible by model.n_head ({H}), n_head <= tgt_len ({L}) "
            f"and a conv output of d_model/n_head = {d // H} per head (got {conv_out_len(L, d, H)})"
        )


def validate_model(model: Any, cache: Any = None, query: Any = None, summary: Any = None) -> None:
    """Check a model's config before any work starts (SPEC §1-3).

    Args:
        model, cache, query, summary: nodes with the fields of :class:`crtn.config.ModelConfig`,
            ``CacheConfig``, ``QueryConfig``, ``SummaryConfig``; the last three are needed
            by models with a cache.

    Raises:
        ConfigError: one line naming the offending key and value.
    """
    cls = model_class(model.name)
    _validate_transformer(model)
    if not cls.has_cache:
        return
    if cache is None or query is None or summary is None:
        raise ConfigError(f"model.name={model.name} needs the cache, query and summary config nodes")
    _validate_cache(model, cache, query, summary)


def build_model(cfg: Any, n_token: int) -> TransformerLM:
    """Build the model a config describes.

    Args:
        cfg: a node with ``model``, ``cache``, ``query`` and ``summary`` children
            (the ``crtn-train`` config or a checkpoint's stored config).
        n_token: vocabulary size.

    Raises:
        ConfigError: invalid values or pairings (see :func:`validate_model`).
    """
    validate_model(cfg.model, cfg.cache, cfg.query, cfg.summary)
    cls = model_class(cfg.model.name)
    if cls.has_cache:
        return cls(n_token, cfg.model, cache=cfg.cache, query=cfg.query, summary=cfg.summary)
    return cls(n_token, cfg.model)
