"""Models: attention, transformer, cache, query strategies and summaries (docs/method.md §2-3).

| module            | what                                                              |
|-------------------|-------------------------------------------------------------------|
| ``spec.py``       | the frozen specs a model is built from (one per config group)     |
| ``attention.py``  | relative multi-head attention A_rel, rel_shift (docs/method.md §2) |
| ``flex.py``       | A_rel through FlexAttention (``model.flex``, the GPU path)        |
| ``retrieved.py``  | attention to retrieved segments weighted by alpha (§3 step 3)     |
| ``transformer.py``| Transformer-XL (``txl``) and ``vanilla``: layers, memory, the step |
| ``crtn.py``       | CRTN: the cache step (layers below, retriever, retrieving layers, renewal) |
| ``retriever.py``  | the retrievers: the query pass, selection inside attention (§3)   |
| ``gate.py``       | selection inside attention (``query=gate``)                       |
| ``cache.py``      | the key-value cache: storage, renewal, top-k retrieval            |
| ``query.py``      | query strategies (registry :data:`STRATEGIES`)                    |
| ``summary.py``    | key/query summaries (registry :data:`SUMMARIES`)                  |
| ``adaptive.py``   | adaptive input and projected adaptive softmax                     |

Models are registered in :data:`MODELS` by their config name (``model.name``); each class
states its capabilities (``has_memory``, ``has_cache``) and resolves its own options
(``resolve``), so nothing outside this package needs to know model names.

A model is built from a :class:`ResolvedSpec` (:func:`resolve_spec`: every derived default
filled, every rule checked by the class that owns it), and from nothing else: the builders check
it (:func:`crtn.model.spec.require_resolved`, TypeError). Evaluation-time lengths and cache sizes
make another resolved spec (:func:`evaluation_spec`) and another model object sharing the same
parameters (:func:`with_spec`), never a change to a built model.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from crtn.errors import ConfigError, check_choice
from crtn.model.cache import SegmentCache, Selection
from crtn.model.crtn import CRTN, CRTNState, dependency_range
from crtn.model.query import STRATEGIES, QueryStrategy, valid_pairs, valid_summaries
from crtn.model.retrieval_stats import RetrievalStats
from crtn.model.spec import (
    CacheSpec,
    ModelSpec,
    QuerySpec,
    Resolved,
    ResolvedSpec,
    Spec,
    SummarySpec,
    minting,
    model_specs,
    require_resolved,
)
from crtn.model.summary import SUMMARIES, Summary
from crtn.model.transformer import LMOutput, State, TransformerLM, VanillaLM

__all__ = [
    "CRTN",
    "CRTNState",
    "CacheSpec",
    "LMOutput",
    "MODELS",
    "ModelSpec",
    "QuerySpec",
    "QueryStrategy",
    "Resolved",
    "ResolvedSpec",
    "RetrievalStats",
    "STRATEGIES",
    "SUMMARIES",
    "SegmentCache",
    "Selection",
    "Spec",
    "State",
    "Summary",
    "SummarySpec",
    "TransformerLM",
    "VanillaLM",
    "build_model",
    "dependency_range",
    "drop_unread",
    "evaluation_spec",
    "model_class",
    "require_resolved",
    "resolve_spec",
    "valid_pairs",
    "valid_summaries",
    "with_spec",
]

#: every model by its config name (``model.name``)
MODELS: dict[str, type[TransformerLM]] = {"vanilla": VanillaLM, "txl": TransformerLM, "crtn": CRTN}


def model_class(name: str) -> type[TransformerLM]:
    """The class registered as ``name``.

    Raises:
        ConfigError: unknown name (one line listing the registered ones).
    """
    check_choice("model.name", name, MODELS)
    return MODELS[name]


def resolve_spec(source: Any) -> ResolvedSpec:
    """The :class:`ResolvedSpec` of ``source`` (an object with ``model``, ``cache``, ``query`` and
    ``summary`` attributes: a run spec, a :class:`Spec`, a composed config node): derived defaults
    filled and every rule checked, by the registered model class (:meth:`TransformerLM.resolve`,
    :meth:`crtn.model.crtn.CRTN.resolve`, which asks the cache, the strategy and the summary).
    Resolving a resolved spec returns an equal one.

    Raises:
        ConfigError: one line naming the offending key and value.
    """
    spec = model_specs(source)
    done = model_class(spec.model.name).resolve(spec)
    with minting():
        return ResolvedSpec(model=done.model, cache=done.cache, query=done.query, summary=done.summary)


def drop_unread(summary: dict[str, Any] | None, query: dict[str, Any] | None) -> None:
    """Remove from a saved config's ``summary`` and ``query`` nodes (plain dicts, changed in place;
    None: absent) the options its summary and strategy do not read (their ``reads``; the
    strategy's ``ignores_summary``), so a checkpoint trained while such an option was accepted
    loads as what it ran. Keys that are not options of the spec stay (the schema refuses them).
    """
    summary_cls = SUMMARIES.get((summary or {}).get("name"))
    strategy = STRATEGIES.get((query or {}).get("strategy"))
    if summary is not None and summary_cls is not None:
        unused = strategy.ignores_summary if strategy is not None else frozenset()
        options = {f.name for f in fields(SummarySpec)}
        for key in [k for k in summary if k in options and (k not in summary_cls.reads or k in unused)]:
            del summary[key]
    if query is not None and strategy is not None:
        options = {f.name for f in fields(QuerySpec)}
        for key in [k for k in query if k in options and k not in strategy.reads]:
            del query[key]


def evaluation_spec(spec: Resolved, ev: Any) -> ResolvedSpec:
    """The spec of evaluation-time settings (docs/method.md §5): ``ev`` (an object with the fields
    of :class:`crtn.config.EvalSpec`) replaces ``tgt_len``, ``mem_len``, ``clamp_len``,
    ``same_length`` and, for models with a cache, ``n_slot`` and ``top_k`` where it is not None;
    ``mem_len`` is ignored by models without memory and the cache sizes by models without a cache,
    so one setting serves every model of a sweep.

    Raises:
        TypeError: ``spec`` is not resolved (:func:`crtn.model.spec.require_resolved`).
        ConfigError: a new ``tgt_len`` for a summary or strategy whose weights are built for the
            trained one; any rule of :func:`resolve_spec` the new values break (named ``eval.*``
            where the value came from ``ev``).
    """
    spec = require_resolved(spec, "evaluation_spec").spec
    cls = model_class(spec.model.name)
    lengths = {k: getattr(ev, k, None) for k in ("tgt_len", "mem_len", "clamp_len", "same_length")}
    if not cls.has_memory:
        lengths.pop("mem_len")
    changed = {k: v for k, v in lengths.items() if v is not None and v != getattr(spec.model, k)}
    if "tgt_len" in changed and cls.has_cache:
        bound = [
            name
            for name, cls_ in ((spec.summary.name, SUMMARIES), (spec.query.strategy, STRATEGIES))
            if cls_[name].length_bound
        ]
        if bound:
            raise ConfigError(
                f"eval.tgt_len={changed['tgt_len']} differs from the trained tgt_len={spec.model.tgt_len}, "
                f"but summary={spec.summary.name} / query={spec.query.strategy} has weights built for it"
            )
    cache = {k: getattr(ev, k, None) for k in ("n_slot", "top_k")} if cls.has_cache else {}
    cache = {k: v for k, v in cache.items() if v is not None}
    if not changed and not cache:
        return spec
    new = replace(spec, model=replace(spec.model, **changed), cache=replace(spec.cache, **cache))
    try:
        return resolve_spec(new)
    except ConfigError as e:  # the rule is the model's; the values are the evaluation's: name them so
        message = str(e)
        for key in ("tgt_len", "mem_len", "clamp_len", "same_length"):
            message = message.replace(f"model.{key}=", f"eval.{key}=")
        for key in ("n_slot", "top_k"):
            message = message.replace(f"cache.{key}=", f"eval.{key}=")
        raise ConfigError(message) from None


def build_model(spec: Resolved, n_token: int) -> TransformerLM:
    """Build the model a resolved spec describes.

    Args:
        spec: a :class:`Resolved` spec: a :class:`ResolvedSpec` (:func:`resolve_spec`,
            :func:`evaluation_spec`) or a resolved run spec (:func:`crtn.config.resolve`, a
            checkpoint's: :func:`crtn.checkpoint.checkpoint_spec`).
        n_token: vocabulary size.

    Raises:
        TypeError: ``spec`` is not resolved (:func:`crtn.model.spec.require_resolved`).
    """
    resolved = require_resolved(spec, "build_model").spec
    return model_class(resolved.model.name)(n_token, resolved)


def with_spec(model: TransformerLM, spec: Resolved) -> TransformerLM:
    """``model``'s parameters (the very same Parameter objects, so later updates show) in a model
    built for the resolved ``spec`` (e.g. :func:`evaluation_spec`), on the same device, in the
    same mode. Returns ``model`` itself when the spec is its own.

    Raises:
        TypeError: ``spec`` is not resolved (:func:`crtn.model.spec.require_resolved`).
        RuntimeError: a spec whose parameters differ (another size).
    """
    resolved = require_resolved(spec, "with_spec").spec
    if resolved == model.spec:
        return model
    twin = build_model(resolved, model.n_token)
    twin.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    device = next(model.parameters()).device
    return twin.to(device).train(model.training)
