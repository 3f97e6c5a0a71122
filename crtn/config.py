"""The config schema of every app, and the one resolve step that turns a composed config into a
frozen, fully resolved run spec.

The schema is a tree of frozen dataclasses: the model's four groups
(:mod:`crtn.model.spec`), the data group (:mod:`crtn.data.spec`) and, here, ``optim``,
``train``, ``eval`` and the roots of the apps. They are registered in Hydra's ConfigStore and
sit first in the defaults list of ``conf/train.yaml`` (and of the other primary configs), so the
YAML files of each group (``conf/model/*.yaml``, ``conf/data/*.yaml``, ...) are merged into
typed, struct-mode nodes: an unknown key or a value of the wrong type is rejected by Hydra before
any work starts. Every default is written once, in these dataclasses.

:func:`resolve` then makes the run spec: every derived default filled (``None`` where a field
says "None: ..."), every rule checked once, by the part that owns it (the registered model,
query strategy and summary: :func:`crtn.model.resolve_spec`; the corpus:
:func:`crtn.data.spec.resolve_data`; training: :func:`resolve_training`; evaluation-time
settings: :func:`resolve_eval`), with a :class:`ConfigError` naming the key. The run spec is what
``crtn-train`` runs, what its checkpoints store, and what evaluation, generation and the
benchmark rebuild models from (:func:`load_spec`).

Names follow the Transformer-XL release (``n_layer``, ``d_model``, ``tgt_len``, ``mem_len``,
``clamp_len``, ``cutoffs``, ``div_val``, ...) and docs/method.md §1 for the cache (``n_slot``,
``top_k``, ``d_key``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from importlib import resources
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from crtn.data.spec import (
    DataSpec,
    resolve_data,
)
from crtn.errors import ConfigError, check_choice
from crtn.model import MODELS as MODEL_CLASSES
from crtn.model import STRATEGIES as STRATEGY_CLASSES
from crtn.model import SUMMARIES as SUMMARY_CLASSES
from crtn.model import (
    dependency_range,
    drop_unread,
    evaluation_spec,
    resolve_spec,
    valid_pairs,
)
from crtn.model.spec import (
    CacheSpec,
    ModelSpec,
    QuerySpec,
    Resolved,
    ResolvedSpec,
    Spec,
    SummarySpec,
    minting,
)
from crtn.optim import validate_training

# the names of the registered models, query strategies and summaries (crtn/model/)
MODELS = tuple(MODEL_CLASSES)
STRATEGIES = tuple(STRATEGY_CLASSES)
SUMMARIES = tuple(SUMMARY_CLASSES)
SCHEDULERS = ("cosine", "inv_sqrt", "constant")
OPTIMIZERS = ("adam",)  # the Trainer builds torch.optim.Adam


@dataclass(frozen=True)
class OptimSpec:
    """Adam with warm-up and a schedule, gradient clipping (docs/method.md §5)."""

    name: str = "adam"  # adam (the only optimizer; another name is refused)
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    scheduler: str = "cosine"  # cosine | inv_sqrt | constant
    warmup_step: int = 100
    eta_min: float = 0.0  # cosine: final learning rate
    clip: float = 0.25
    # learning rate of the word embedding's parameters (tables, projections, and the output layer's
    # tied weights) relative to lr; the CRTN authors' --emb_mult (crtn/optim.py)
    emb_lr_mult: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))


@dataclass(frozen=True)
class TrainSpec:
    """Length, logging, evaluation and checkpointing of a training run."""

    max_step: int = 1500
    max_epoch: int | None = None  # epochs of training; with max_step, whichever comes first
    max_time: float | None = None  # wall-clock seconds of training; stops early
    # temporal activation regularisation (Merity et al. 2018): adds tar * mean((h_{t+1} - h_t)^2)
    # of the top-layer outputs to the loss (crtn/optim.py, tar_penalty); 0: off
    tar: float = 0.0
    # Polyak averaging of the weights (torch.optim.swa_utils.AveragedModel) after this step, or
    # this fraction of the run if < 1; validation, best.pt and the final evaluation use the
    # averaged weights once it started; null: off (crtn/optim.py, WeightAverage)
    avg_start: float | None = None
    batch_chunk: int = 1  # gradient accumulation: the batch is split into this many chunks
    log_interval: int = 100
    eval_interval: int = 500
    eval_max_step: int | None = None  # segments per validation during training; None: all
    checkpoint_interval: int | None = None  # None: every eval_interval steps
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    amp: bool = False  # bf16 autocast on CUDA
    compile: bool = False  # torch.compile every decoder layer (inductor; the first steps compile)
    progress: bool = True  # tqdm progress bar
    resume: bool = True  # continue from checkpoints/last.pt of the run directory if present
    # resume=false on a run directory that holds a run: refused unless overwrite=true (deletes it)
    overwrite: bool = False
    # resume although train.* keys that shape the run (max_step, eval_interval...) changed
    allow_change: bool = False
    tensorboard: bool = False


@dataclass(frozen=True)
class EvalSpec:
    """Evaluation-time settings (docs/method.md §5): a longer memory and a larger cache than in
    training. None: the trained value (``batch_size``: ``data.eval_batch_size``)."""

    tgt_len: int | None = None
    mem_len: int | None = None
    clamp_len: int | None = None
    same_length: bool | None = None
    n_slot: int | None = None
    top_k: int | None = None
    batch_size: int | None = None
    max_step: int | None = None  # evaluate only the first max_step segments; None: all


@dataclass(frozen=True)
class RunSpec:
    """Root of ``crtn-train``'s config (``conf/train.yaml``); resolved (:func:`resolve`), the run spec."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    query: QuerySpec = field(default_factory=QuerySpec)
    summary: SummarySpec = field(default_factory=SummarySpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    seed: int = 1111
    init_from: str | None = None  # a crtn checkpoint (e.g. from crtn-convert) to start from


@dataclass(frozen=True)
class ResolvedRun(RunSpec, Resolved):
    """A :class:`RunSpec` made by :func:`resolve` (and so by :func:`load_spec`): every derived
    default filled, every rule checked. What :class:`crtn.trainer.Trainer` runs and the builders
    take (:func:`crtn.model.spec.require_resolved`); ``dataclasses.replace`` on one gives a plain
    :class:`RunSpec`, to resolve again.

    ``spec``: the model of training, ``eval_spec``: the model of evaluation (``eval.*`` applied,
    :func:`crtn.model.evaluation_spec`), both :class:`crtn.model.ResolvedSpec`, made once by
    :func:`resolve`.
    """

    _unresolved = RunSpec

    def __post_init__(self) -> None:
        self._demote_unless_minted()

    @property
    def spec(self) -> ResolvedSpec:
        return self._spec  # type: ignore[attr-defined]  # set by resolve()

    @property
    def eval_spec(self) -> ResolvedSpec:
        return self._eval_spec  # type: ignore[attr-defined]  # set by resolve()


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
def _table_rows() -> dict[str, list[str]]:
    """The cost table's default rows: txl, the CRTN authors' model, the default CRTN and selection
    inside attention (``query=gate``: mean-pooled block keys and the best row of token_max, shared by
    the heads), each CRTN also with retrieval in the top 2 layers and in the
    top layer only (``cache.layers``)."""
    rows: dict[str, list[str]] = {"txl": ["model=txl"]}
    crtns = {
        "crtn_original": ["model=crtn_original"],
        "default": ["model=crtn"],
        "gate": ["model=crtn", "query=gate"],
        "gate_token_max": ["model=crtn", "query=gate", "summary=token_max"],
    }
    for name, options in crtns.items():
        rows[name] = options
        for layers in (2, 1):
            rows[f"{name}_layers{layers}"] = [*options, f"cache.layers={layers}"]
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
    top_k: int = 2
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


def schema_node(cls: type) -> DictConfig:
    """The schema ``cls`` (a frozen dataclass) as a config node that Hydra and
    ``OmegaConf.update`` can merge into: OmegaConf marks the nodes of frozen dataclasses read-only,
    which would refuse every option and override; the frozen objects come back from
    :func:`resolve` (``OmegaConf.to_object``)."""
    node = OmegaConf.structured(cls)
    _writable(node)
    return node


def _writable(node: Any) -> None:
    """Clear the read-only flag of ``node`` and of every node below it. Through OmegaConf's
    node-level API (``_set_flag``, ``_get_node``): the public ``set_readonly`` cannot reach the
    node of an entry whose value is None (``ConvertAppSpec.data``), which Hydra must still merge
    an option into."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        for key in node.keys():
            _writable(node._get_node(key))
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i in range(len(node)):
            _writable(node._get_node(i))


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
    (``+pair: glob(*)``)."""
    return {
        f"{q}-{s}": {"defaults": [{"override /query": q}, {"override /summary": s}]} for q, s in valid_pairs()
    }


def train_config(overrides: dict[str, Any] | None = None) -> DictConfig:
    """``crtn-train``'s default config, i.e. the schema (what ``crtn-train`` composes without
    arguments), with ``overrides`` applied: dotted keys, e.g. ``{"model.n_layer": 2}``.

    The tests (``tests/helpers.py``) and the benchmark build their configs from it, then
    :func:`resolve` it as the command line does.
    """
    cfg = schema_node(RunSpec)
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


# ================================================================== resolution
def resolve(cfg: Any) -> ResolvedRun:
    """The run spec of a composed ``crtn-train`` config (or of a :class:`RunSpec`): frozen, every
    derived default filled, every rule checked once by the part that owns it (module docstring),
    the model specs of training and evaluation made (:class:`ResolvedRun`). Resolving a run spec
    returns an equal one.

    Raises:
        ConfigError: one line naming the offending key and value.
    """
    run = cfg if isinstance(cfg, RunSpec) else OmegaConf.to_object(cfg)
    model = resolve_spec(run)
    data = resolve_data(run.data)
    optim, train = resolve_training(run.optim, run.train, data)
    ev = resolve_eval(run.eval, model, data)
    # the evaluation settings' rules: fail now, not after hours of training
    evaluation = evaluation_spec(model, ev)
    parts = {f.name: getattr(run, f.name) for f in fields(RunSpec)}
    parts.update(model=model.model, cache=model.cache, query=model.query, summary=model.summary)
    with minting():
        resolved = ResolvedRun(**{**parts, "data": data, "optim": optim, "train": train, "eval": ev})
    object.__setattr__(resolved, "_spec", model)
    object.__setattr__(resolved, "_eval_spec", evaluation)
    return resolved


def resolve_training(optim: OptimSpec, train: TrainSpec, data: DataSpec) -> tuple[OptimSpec, TrainSpec]:
    """``optim`` and ``train`` checked (``optim.name`` among :data:`OPTIMIZERS`; with
    :func:`crtn.optim.validate_training`'s rules of the authors' recipe),
    ``train.checkpoint_interval`` None filled with ``train.eval_interval``.

    Raises:
        ConfigError: naming the key.
    """
    check_choice("optim.name", optim.name, OPTIMIZERS)
    check_choice("optim.scheduler", optim.scheduler, SCHEDULERS)
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr={optim.lr} must be > 0")
    if optim.warmup_step < 0:
        raise ConfigError(f"optim.warmup_step={optim.warmup_step} must be >= 0")
    for key in ("max_step", "log_interval", "eval_interval", "batch_chunk"):
        if getattr(train, key) <= 0:
            raise ConfigError(f"train.{key}={getattr(train, key)} must be > 0")
    if train.checkpoint_interval is not None and train.checkpoint_interval <= 0:
        raise ConfigError(f"train.checkpoint_interval={train.checkpoint_interval} must be > 0")
    validate_training(train, optim)
    if train.max_time is not None and train.max_time <= 0:
        raise ConfigError(f"train.max_time={train.max_time} must be > 0 (seconds)")
    if data.batch_size % train.batch_chunk != 0:
        raise ConfigError(
            f"data.batch_size={data.batch_size} must be divisible by train.batch_chunk={train.batch_chunk}"
        )
    interval = train.eval_interval if train.checkpoint_interval is None else train.checkpoint_interval
    return optim, replace(train, checkpoint_interval=interval)


def resolve_eval(ev: EvalSpec, spec: Spec, data: DataSpec) -> EvalSpec:
    """The evaluation settings with None filled by the trained values (``batch_size``:
    ``data.eval_batch_size``; ``max_step`` None stays: all segments); the sizes checked here, their
    relations by the model (:func:`crtn.model.evaluation_spec`).

    Raises:
        ConfigError: naming the ``eval.*`` key.
    """
    if ev.tgt_len is not None and ev.tgt_len <= 0:
        raise ConfigError(f"eval.tgt_len={ev.tgt_len} must be > 0")
    if ev.mem_len is not None and ev.mem_len < 0:
        raise ConfigError(f"eval.mem_len={ev.mem_len} must be >= 0")
    for key in ("n_slot", "top_k"):
        value = getattr(ev, key)
        if value is not None and value < 0:
            raise ConfigError(f"eval.{key}={value} must be >= 0")
    for key in ("batch_size", "max_step"):
        value = getattr(ev, key)
        if value is not None and value <= 0:
            raise ConfigError(f"eval.{key}={value} must be > 0")
    m, c = spec.model, spec.cache

    def pick(value: Any, trained: Any) -> Any:
        return trained if value is None else value

    return replace(
        ev,
        tgt_len=pick(ev.tgt_len, m.tgt_len),
        mem_len=pick(ev.mem_len, m.mem_len),
        clamp_len=pick(ev.clamp_len, m.clamp_len),
        same_length=pick(ev.same_length, m.same_length),
        n_slot=pick(ev.n_slot, c.n_slot),
        top_k=pick(ev.top_k, c.top_k),
        batch_size=pick(ev.batch_size, data.eval_batch_size),
    )


def check_eval_cache(cache: Any) -> None:
    """Refuse ``cache.n_slot`` and ``cache.top_k`` in ``crtn-eval``/``crtn-generate``, wherever they
    were set (command line or config file): the evaluation's cache size is ``eval.n_slot`` and
    ``eval.top_k``, its one route (:class:`EvalCacheSpec`).

    Raises:
        ConfigError: ``cache.n_slot=16 is not read at evaluation: give eval.n_slot=16``.
    """
    for key in ("n_slot", "top_k"):
        value = getattr(cache, key)
        if value is not None:
            raise ConfigError(
                f"cache.{key}={value} is not read at evaluation: give eval.{key}={value} "
                "(the evaluation's cache size)"
            )


def spec_dict(spec: Any) -> dict[str, Any]:
    """A spec as plain nested dicts and lists (what a checkpoint stores as its ``config``)."""
    return _plain(OmegaConf.to_container(OmegaConf.structured(spec), resolve=True))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def load_spec(config: dict[str, Any], overrides: dict[str, Any] | None = None) -> ResolvedRun:
    """The run spec of a config dict as a checkpoint stores it (:func:`spec_dict`), after
    :func:`upgrade` and with ``overrides`` (a nested dict, e.g. evaluation-time ``cache.*``) merged
    in; resolved as :func:`resolve` does, so keys added to the schema since take their defaults.

    Raises:
        ConfigError: a value the schema or the rules refuse (a saved value, or an override).
    """
    node = schema_node(RunSpec)
    try:
        node = OmegaConf.merge(node, upgrade(config), overrides or {})
    except Exception as e:  # omegaconf's validation errors: a wrong type or an unknown key
        raise ConfigError(str(e).splitlines()[0]) from None
    return resolve(node)


def upgrade(config: dict[str, Any]) -> dict[str, Any]:
    """A config saved by an earlier version, made loadable with the behaviour it was trained with:

    - keys a summary gained later take the value its training used (the class's ``LEGACY``, e.g.
      token_max's ``ngram`` 1 and ``shift`` 0) when the saved config lacks them;
    - ``summary.*`` and ``query.*`` keys that the saved summary or strategy does not read (its
      ``reads``; the strategy's ``ignores_summary``) are dropped: they changed nothing in training,
      and resolving now refuses them where they are set;
    - ``data.split`` and ``data.level`` as the schema once wrote them for every corpus are cleared
      where the corpus ignores them (only ``data.name=text`` reads either).

    Returns a new dict; the saved one is not changed.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    summary, model = out.get("summary"), out.get("model") or {}
    cls = SUMMARY_CLASSES.get((summary or {}).get("name"))
    if uses_cache(model.get("name")) and cls is not None:
        for key, value in getattr(cls, "LEGACY", {}).items():
            summary.setdefault(key, value)
    if uses_cache(model.get("name")):
        drop_unread(summary, out.get("query"))
    data = out.get("data")
    if isinstance(data, dict) and data.get("name") != "text":
        data["split"] = None
        if data.get("level") == "word":
            data["level"] = None
    return out


def default_summary(strategy: str) -> str:
    """The summary that ``query=<strategy>`` selects by default: read from the option's own file,
    ``conf/query/<strategy>.yaml`` (its defaults list overrides the summary group).

    Raises:
        ConfigError: no such query option, or it selects no summary.
    """
    path = resources.files("crtn.conf") / "query" / f"{strategy}.yaml"
    if not path.is_file():
        raise ConfigError(f"query={strategy!r} is not one of: {', '.join(STRATEGIES)}")
    for entry in OmegaConf.create(path.read_text()).get("defaults", []):
        for key, value in entry.items():
            if key.split("@")[0].removeprefix("override ").strip("/") == "summary":
                return str(value)
    raise ConfigError(f"conf/query/{strategy}.yaml selects no summary")


def _model_name(model: Any) -> Any:
    if isinstance(model, str):
        return model
    return model.get("name") if isinstance(model, dict) else getattr(model, "name", None)


def uses_cache(model: Any) -> bool:
    """Whether a model keeps the key-value cache of past segments (and so uses the cache, query and
    summary nodes). ``model``: a model config node, a model, or a model name.

    Asks the model registry (``has_cache``); unknown names have none.
    """
    cls = MODEL_CLASSES.get(_model_name(model))
    return cls is not None and cls.has_cache
