"""The roots of the apps' configs other than ``crtn-train``'s (``crtn-eval``, ``crtn-generate``,
``crtn-convert``, ``crtn-recl``, ``crtn-bench``) and their registration in Hydra's ConfigStore.

Each root reuses the run's groups (:mod:`crtn.config`: ``eval``, and the model and data specs) and
adds the app's own settings; every default is written once, here. :func:`register_configs` stores
every app's schema (``conf/NAME.yaml`` starts from ``NAME_schema``) and the ``pair`` options of the
ablation sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from crtn.config import STRATEGIES, EvalSpec, RunSpec, schema_node
from crtn.data.spec import DataSpec
from crtn.model import dependency_range, valid_pairs
from crtn.model.spec import CacheSpec, ModelSpec, QuerySpec, SummarySpec


@dataclass(frozen=True)
class EvalCacheSpec(CacheSpec):
    """The ``cache`` group of ``crtn-eval`` and ``crtn-generate``: the checkpoint's cache options
    that evaluation may change (``cache.backend=faiss``, ``cache.dtype``...). The cache's sizes
    have one route, ``eval.n_slot`` and ``eval.top_k`` (:class:`EvalSpec`, as in ``crtn-train``):
    here they are null, and a value is refused (:func:`check_eval_cache`)."""

    n_slot: int | None = None  # refused: eval.n_slot sets the evaluation's cache size
    top_k: int | None = None  # refused: eval.top_k sets the segments retrieved at evaluation


@dataclass(frozen=True)
class EvalAppSpec:
    """Root of ``crtn-eval``'s config (``conf/eval.yaml``). ``cache.*`` and ``data.*`` keys given on
    the command line replace the checkpoint's (:func:`crtn.app.given_keys`); the others keep it.
    The evaluation's cache size is ``eval.n_slot``/``eval.top_k`` (``cache.n_slot`` and
    ``cache.top_k`` are refused, :func:`check_eval_cache`)."""

    checkpoint: str = MISSING
    splits: list[str] = field(default_factory=lambda: ["valid", "test"])
    eval: EvalSpec = field(default_factory=EvalSpec)
    cache: EvalCacheSpec = field(default_factory=EvalCacheSpec)
    data: DataSpec = field(default_factory=DataSpec)
    device: str = "cpu"
    progress: bool = True


@dataclass(frozen=True)
class GenerateAppSpec:
    """Root of ``crtn-generate``'s config (``conf/generate.yaml``); ``cache.*``/``data.*`` as crtn-eval's."""

    checkpoint: str = MISSING
    prompt: str = ""  # the text to continue; empty: start after an <eos> (word level)
    prompt_file: str | None = None  # read the prompt from this UTF-8 file instead
    max_new_tokens: int = 50
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # sample among the k most likely tokens; 0: all (eval.top_k is unrelated)
    seed: int = 1111
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    out: str | None = None  # also write a JSON record (prompt, ids, text, settings) here
    eval: EvalSpec = field(default_factory=EvalSpec)  # eval-time lengths and cache size, as crtn-eval
    cache: EvalCacheSpec = field(default_factory=EvalCacheSpec)
    data: DataSpec = field(default_factory=DataSpec)  # where the corpus is (vocab fallback)


@dataclass(frozen=True)
class ConvertAppSpec:
    """Root of ``crtn-convert``'s config (``conf/convert.yaml``); ``model.KEY=VALUE`` on the command
    line overrides what the source says or implies."""

    src: str = MISSING  # HF TransfoXLLMHeadModel folder, or a release model.pt / state_dict file
    out: str = MISSING  # output folder: model.pt, model/converted.yaml, convert.log
    vocab: str | None = None  # vocabulary file: one symbol per line (first field), id order
    format: str = "auto"  # auto | hf | release
    trust_pickle: bool = False  # allow unpickling a whole MemTransformerLM module (runs its code)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec | None = None  # the data group (data=ptb ...), stored in the checkpoint's config


@dataclass(frozen=True)
class ReclAppSpec:
    """Root of ``crtn-recl``'s config (``conf/recl.yaml``): the relative effective context length
    of a group of checkpoints (Dai et al. 2019, section 4.3 and appendix, or the CRTN authors'
    variant: ``definition``; :mod:`crtn.analysis.recl`).
    ``cache.*``/``data.*`` given on the command line apply to every checkpoint, as in crtn-eval."""

    checkpoints: list[str] = MISSING  # the model group, evaluated on the corpus of the first
    names: list[str] | None = None  # one per checkpoint; None: each checkpoint's model.name
    split: str = "valid"
    # contexts c = c0, c0 + delta, ..., c_max: memory mem_len = c (no cache), n_slot = (c - m) / L
    # (cache); c0 None: the smallest multiple of delta that is >= every cached model's mem_len
    c0: int | None = None
    delta: int = MISSING
    c_max: int = MISSING
    ratios: list[float] = field(default_factory=lambda: [0.1, 0.5, 1.0])  # r, fraction of hardest tokens
    # dai (Dai et al. 2019, appendix: relative perplexity reduction) | crtn_authors (the CRTN
    # authors' CRTN/recl.py: relative loss reduction); crtn.analysis.recl, docs/method.md §5
    definition: str = "dai"
    threshold: float | None = None  # on the relative gain; None: the definition's (recl.THRESHOLDS)
    max_tokens: int = 10_000  # tokens scored (the same for every model), max_tokens // batch_size per stream
    batch_size: int | None = None  # streams; None: the first checkpoint's data.eval_batch_size
    # each query attends exactly mem_len positions (itself included), as Transformer-XL's RECL
    same_length: bool = True
    cache: CacheSpec = field(default_factory=CacheSpec)
    data: DataSpec = field(default_factory=DataSpec)
    device: str = "cpu"
    progress: bool = True


# ================================================================== crtn-bench
#: the CRTN paper's cache as crtn-train overrides: retrieval in every layer, two segments, alpha
#: over every slot (the paper's equation; docs/method.md §3 step 2); crtn's defaults are one
#: segment at alpha 1 in the top two layers (docs/results.md, "The default cache")
PAPER_CACHE = ("cache.layers=null", "cache.top_k=2", "cache.alpha_norm=all")


def _table_rows() -> dict[str, list[str]]:
    """The cost table's default rows: txl; the default CRTN (``model=crtn``: the lookup of the
    preceding tokens), also with retrieval in every layer and in the top layer only
    (``cache.layers``); the row match of the token's own state (``query=token``) in its place;
    and, each with retrieval in every layer, in the top 2 and in the top 1 (``_layers2``,
    ``_layers1``): the CRTN authors' model, the row match with the CRTN paper's cache
    (:data:`PAPER_CACHE`) and selection inside attention with it (``query=gate``: mean-pooled block
    keys and the best row of token_max, shared by the heads)."""
    rows: dict[str, list[str]] = {
        "txl": ["model=txl"],
        "default": ["model=crtn"],
        "default_every_layer": ["model=crtn", "cache.layers=null"],
        "default_layers1": ["model=crtn", "cache.layers=1"],
        # the 4-gram row match of the token's own state in the default's layers (docs/method.md §3)
        "row_match": ["model=crtn", "query=token"],
    }
    crtns = {
        "crtn_original": ["model=crtn_original"],
        "paper_cache": ["model=crtn", "query=token", *PAPER_CACHE],
        "gate": ["model=crtn", "query=gate", *PAPER_CACHE],
        "gate_token_max": ["model=crtn", "query=gate", "summary=token_max", *PAPER_CACHE],
    }
    for name, options in crtns.items():
        rows[name] = options
        for layers in (2, 1):
            rows[f"{name}_layers{layers}"] = [
                *(o for o in options if not o.startswith("cache.layers=")),
                f"cache.layers={layers}",
            ]
    return rows


@dataclass(frozen=True)
class BenchSpec:
    """``crtn-bench``'s settings (the ``bench`` node of ``conf/bench.yaml``): what to run, how to
    time it, and the standard sizes of every section but ``config`` (which times the model that
    ``model``/``cache``/``query``/``summary`` compose, at its own sizes). docs/results.md,
    "Performance"."""

    # config | table | strategies | range | scaling | retrieval (crtn/bench/__init__.py); run in that order
    sections: list[str] = field(default_factory=lambda: ["config", "table"])
    rounds: int = 7  # timed steps per configuration, alternating; the median is reported
    warmup: int = 2  # untimed steps per configuration once its memory and cache are full
    batch: int = 16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    amp: bool = False  # bf16 autocast (CUDA)
    memory: bool = True  # peak step memory (on CPU through the profiler: slow)
    # the sizes of BENCH_SMOKE (seconds); bench.* keys given on the command line still apply
    smoke: bool = False
    out: str | None = None  # folder of bench.json and bench.md; None: the Hydra run folder
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))  # the strategies section's
    # the table's rows: name -> crtn-train command-line overrides (model=..., query=..., cache.x=...)
    # applied over the standard sizes below (a row may override them too)
    rows: dict[str, list[str]] = field(default_factory=_table_rows)
    reference: str = "txl"  # the table row every ratio is taken against (a Transformer-XL row)
    # the names of the rows to time (the reference is always timed); None: every row
    only: list[str] | None = None
    # the standard sizes
    vocab: int = 256
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    d_head: int = 64
    d_inner: int = 1024
    tgt_len: int = 64  # and mem_len
    n_slot: int = 32
    # k of every row that sets none; None: the row's own (cache.top_k's default, or its model option's)
    top_k: int | None = None
    n_slot_large: int = 1024  # the N-scaling target: step at n_slot_large / step at n_slot
    slots_scaling: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])  # the scaling section's
    keys_retrieval: list[int] = field(default_factory=lambda: [1_000, 10_000, 100_000])  # keys per row
    eval_slots: int = 10_000  # n_slot of the faiss evaluation step (retrieval section)

    def __post_init__(self) -> None:
        for key in ("sections", "strategies", "slots_scaling", "keys_retrieval"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        object.__setattr__(self, "rows", {k: tuple(v) for k, v in self.rows.items()})
        if self.only is not None:
            object.__setattr__(self, "only", tuple(self.only))


#: ``bench.smoke=true``: these values replace the standard sizes and the timing settings (no peak
#: memory: the CPU profiler would take most of the time)
BENCH_SMOKE: dict[str, Any] = {
    "vocab": 64,
    "n_layer": 2,
    "d_model": 32,
    "n_head": 2,
    "d_head": 16,
    "d_inner": 64,
    "tgt_len": 8,
    "batch": 2,
    "n_slot": 8,
    "n_slot_large": 80,  # above crtn.bench.cases.REAL_FILL_SLOTS: the random fill runs too
    "slots_scaling": [4, 16],
    "keys_retrieval": [100, 1000],
    "eval_slots": 200,
    "rounds": 3,
    "warmup": 1,
    "memory": False,
}


@dataclass(frozen=True)
class BenchAppSpec:
    """Root of ``crtn-bench``'s config (``conf/bench.yaml``): the model groups of ``crtn-train``
    (the model the ``config`` section times) and ``bench.*``."""

    model: ModelSpec = field(default_factory=ModelSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    query: QuerySpec = field(default_factory=QuerySpec)
    summary: SummarySpec = field(default_factory=SummarySpec)
    bench: BenchSpec = field(default_factory=BenchSpec)


#: The schema of each Hydra app, by primary config name (``conf/NAME.yaml`` starts from ``NAME_schema``).
APP_SCHEMAS: dict[str, type] = {
    "train": RunSpec,
    "eval": EvalAppSpec,
    "generate": GenerateAppSpec,
    "convert": ConvertAppSpec,
    "recl": ReclAppSpec,
    "bench": BenchAppSpec,
}


def register_configs() -> None:
    """Register every app's schema (``train_schema``, ``eval_schema``, ``generate_schema``,
    ``convert_schema``, ``recl_schema``, ``bench_schema``) and the ``pair`` options
    (:func:`pair_options`) in Hydra's ConfigStore, and the ``crtn_range`` resolver (idempotent)."""
    if not OmegaConf.has_resolver("crtn_range"):
        OmegaConf.register_new_resolver("crtn_range", dependency_range)
    cs = ConfigStore.instance()
    for name, schema in APP_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema_node(schema))
    for name, node in pair_options().items():
        cs.store(group="pair", name=name, node=node, package="_global_")


def pair_options() -> dict[str, dict[str, Any]]:
    """The options of the ``pair`` group, one per valid query x summary pairing
    (:func:`crtn.model.valid_pairs`, the one list of them): ``+pair=QUERY-SUMMARY`` selects
    ``query=QUERY summary=SUMMARY``, and ``+experiment=ablation_query`` sweeps them all
    (``pair: glob(*)`` over its default ``token-token_max``)."""
    return {
        f"{q}-{s}": {"defaults": [{"override /query": q}, {"override /summary": s}]} for q, s in valid_pairs()
    }
