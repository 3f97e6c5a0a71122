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

from omegaconf import DictConfig, ListConfig, OmegaConf

from crtn.data.spec import (
    DataSpec,
    resolve_data,
)
from crtn.errors import ConfigError, check_choice
from crtn.model import MODELS as MODEL_CLASSES
from crtn.model import STRATEGIES as STRATEGY_CLASSES
from crtn.model import SUMMARIES as SUMMARY_CLASSES
from crtn.model import (
    drop_unread,
    evaluation_spec,
    resolve_spec,
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
    node of an entry whose value is None (``crtn.app_config.ConvertAppSpec.data``), which Hydra must still merge
    an option into."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        for key in node.keys():
            _writable(node._get_node(key))
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i in range(len(node)):
            _writable(node._get_node(i))


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
    ``eval.top_k``, its one route (:class:`crtn.app_config.EvalCacheSpec`).

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
    - options since removed (:data:`REMOVED`) are dropped where the saved value is the behaviour
      the code keeps or the saved summary or strategy did not read them, and refused otherwise;
    - ``summary.*`` and ``query.*`` keys that the saved summary or strategy does not read (its
      ``reads``; the strategy's ``ignores_summary``) are dropped: they changed nothing in training,
      and resolving now refuses them where they are set;
    - ``data.split`` and ``data.level`` as the schema once wrote them for every corpus are cleared
      where the corpus ignores them (only ``data.name=text`` reads either).

    Returns a new dict; the saved one is not changed.

    Raises:
        ConfigError: a removed option saved with a value whose behaviour the code no longer has.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    summary, model = out.get("summary"), out.get("model") or {}
    cls = SUMMARY_CLASSES.get((summary or {}).get("name"))
    if uses_cache(model.get("name")) and cls is not None:
        for key, value in getattr(cls, "LEGACY", {}).items():
            summary.setdefault(key, value)
    if uses_cache(model.get("name")):
        drop_removed(out)
        drop_unread(summary, out.get("query"))
    data = out.get("data")
    if isinstance(data, dict) and data.get("name") != "text":
        data["split"] = None
        if data.get("level") == "word":
            data["level"] = None
    return out


#: options removed from the schema (docs/results.md, "Options removed"): (group, key) -> (the
#: summaries or strategies that read it, None: all; the value whose behaviour the code keeps, a
#: function of the saved group for query.tanh, which single_linear always applies now). An option
#: that computed the same as the kept path (model.sdpa, cache.eval_kv) keeps any value.
REMOVED: dict[tuple[str, str], tuple[frozenset[str] | None, Any]] = {
    ("model", "sdpa"): (None, lambda group: group["sdpa"]),
    ("cache", "eval_kv"): (None, lambda group: group["eval_kv"]),
    ("cache", "theta"): (None, 1.0),
    ("cache", "renew"): (None, "fifo"),
    ("cache", "hnsw_m"): (None, 32),
    ("cache", "hnsw_ef_search"): (None, 128),
    ("cache", "hnsw_ef_construction"): (None, 64),
    ("summary", "tanh"): (frozenset({"linear"}), False),
    ("summary", "shortlist"): (frozenset({"token_max"}), None),
    ("query", "per_head"): (frozenset({"gate"}), False),
    ("query", "tanh"): (
        frozenset({"linear", "single_linear"}),
        lambda group: group.get("strategy") == "single_linear",
    ),
}


def drop_removed(config: dict[str, Any]) -> None:
    """Drop from a saved config (plain dicts, changed in place) the options of :data:`REMOVED`.

    Raises:
        ConfigError: one saved with a value whose behaviour the code no longer has, naming it.
    """
    for (group_name, key), (readers, kept) in REMOVED.items():
        group = config.get(group_name)
        if not isinstance(group, dict) or key not in group:
            continue
        name = group.get("name", group.get("strategy"))
        kept_value = kept(group) if callable(kept) else kept
        if readers is None or name in readers:
            if group[key] != kept_value:
                raise ConfigError(
                    f'{group_name}.{key}={group[key]} was removed (docs/results.md, "Options removed"): '
                    f"this checkpoint was trained with a behaviour crtn no longer has"
                )
        del group[key]


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
