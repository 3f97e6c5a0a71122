"""Structured configs: the schema of every Hydra config group, and validation.

The dataclasses below are registered in Hydra's ConfigStore and sit first in
the defaults list of ``conf/train.yaml`` (and of the other primary configs), so
the YAML files of each group (``conf/model/*.yaml``, ``conf/data/*.yaml``, ...)
are merged into typed, struct-mode nodes: an unknown key or a value of the wrong
type is rejected by Hydra before any work starts. :func:`validate` then checks
the relations between values (SPEC §3, §4) and raises :class:`ConfigError`
with a one-line message naming the key.

Names follow the Transformer-XL release (``n_layer``, ``d_model``, ``tgt_len``,
``mem_len``, ``clamp_len``, ``cutoffs``, ``div_val``, ...) and SPEC §1 for the
cache (``n_slot``, ``top_k``, ``d_key``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from crtn.errors import ConfigError
from crtn.model import MODELS as MODEL_CLASSES
from crtn.model import STRATEGIES as STRATEGY_CLASSES
from crtn.model import SUMMARIES as SUMMARY_CLASSES
from crtn.model import dependency_range, model_class, valid_pairs, valid_summaries, validate_model  # noqa: F401  (re-exported)
from crtn.optim import validate_training

# the names of the registered models, query strategies and summaries (crtn/model/)
MODELS = tuple(MODEL_CLASSES)
STRATEGIES = tuple(STRATEGY_CLASSES)
SUMMARIES = tuple(SUMMARY_CLASSES)
WINDOW_STRATEGIES = tuple(q for q, cls in STRATEGY_CLASSES.items() if cls.kind == "window")
# SPEC §3, "Summaries": which summaries each query kind may be paired with.
WINDOW_SUMMARIES = tuple(s for s, cls in SUMMARY_CLASSES.items() if "window" in cls.kinds)
TOKEN_SUMMARIES = tuple(s for s, cls in SUMMARY_CLASSES.items() if "token" in cls.kinds)
#: Every value of ``data.name``.
DATASETS = ("wt2", "wt103", "ptb", "enwik8", "text8", "text", "synthetic")
#: Character-level corpora (metric bpc); ``text`` is either, by ``data.level``.
CHAR_DATASETS = ("enwik8", "text8")
SCHEDULERS = ("cosine", "inv_sqrt", "constant")


@dataclass
class ModelConfig:
    """Transformer hyper-parameters shared by ``vanilla``, ``txl`` and ``crtn`` (SPEC §1-2)."""

    name: str = "crtn"  # vanilla | txl | crtn
    n_layer: int = 3
    n_head: int = 4
    d_model: int = 128
    d_head: int = 32
    d_inner: int = 256
    d_embed: int | None = None  # None: d_model
    dropout: float = 0.0
    dropatt: float = 0.0
    # regularisation of the CRTN authors' recipe (off by default; see crtn/model/dropout.py)
    dropemb: float = 0.0  # word dropout: whole word types (embedding rows) dropped per forward call
    dropinp: float | None = None  # dropout on word and position embeddings; None: dropout
    dropfor: float | None = None  # dropout inside the feed-forward; None: dropout
    dropatt_out: float | None = None  # dropout on the attention output; None: dropout
    locked_dropout: bool = False  # variational dropout (one mask per sequence) except dropatt/dropemb
    tgt_len: int = 32  # L: tokens predicted per step
    mem_len: int = II("model.tgt_len")  # m: short-term memory, positions per layer; one segment by default
    clamp_len: int = -1  # relative distances above this use clamp_len's embedding; -1: none
    same_length: bool = False
    pre_lnorm: bool = False
    untie_r: bool = False  # a pair of biases u, v per layer instead of one shared pair
    cutoffs: list[int] = field(default_factory=list)  # adaptive input/softmax cluster bounds
    div_val: int = 1
    tie_weight: bool = True
    tie_projs: list[bool] | None = None  # None: [False] + [True] * len(cutoffs)
    init_std: float = 0.02
    proj_init_std: float = 0.01
    layer_norm_eps: float = 1e-5
    # attention without retrieved rows through F.scaled_dot_product_attention, the relative-position
    # term passed as its additive mask (same results; fused kernels where the backend has them)
    sdpa: bool = False


@dataclass
class CacheConfig:
    """The key-value cache of past segments (SPEC §3)."""

    n_slot: int = 8  # N: past segments held per batch row
    top_k: int = 2  # k: segments retrieved per query token
    alpha_norm: str = "all"  # all | topk | original (the authors' code), see crtn/model/cache.py
    theta: float = 1.0  # temperature multiplying the retrieval scores before the softmax
    weighted: bool = True  # values scaled by alpha (keys never are)
    pos: str = "concat"  # concat | real: relative positions of retrieved segments
    backend: str = "torch"  # torch | faiss
    faiss_index: str = "flat"  # flat (IndexFlatIP, exact) | hnsw (approximate)
    hnsw_m: int = 32
    hnsw_ef_search: int = 128
    hnsw_ef_construction: int = 64
    renew: str = "fifo"  # fifo | least_used | discard_worst
    layers: int | None = None  # retrieval in the top `layers` layers only; None: all (the paper)
    key_layer: int | None = (
        None  # hidden layer of keys and queries (0 emb .. n top); None: top, or below `layers`
    )
    dtype: str | None = None  # storage of cached values: None (the model's) | float32 | float16 | bfloat16
    # evaluation: keep each slot's projected keys and values too (exact; 2.6x the cache's memory
    # for 1.04-1.07x eval tokens/s on 2 CPU cores, issue 15); the memory's are always kept
    eval_kv: bool = False


@dataclass
class QueryConfig:
    """How each token's query is built (SPEC §3, "Query strategies")."""

    strategy: str = "token"
    detach: bool = False  # stop gradients from the retrieval weights into the query pass
    tanh: bool = False  # tanh on the queries (strategies with their own weights: linear, single_linear)


@dataclass
class SummaryConfig:
    """Summary of an L x d block into a key or query (SPEC §3, "Summaries")."""

    name: str = "token_max"  # the default of query=token; each conf/query option selects its own
    # linear: output width (None: d_model; conf/summary/linear.yaml: 128); token_max: a learned map
    # of queries and rows to d_key (None: none)
    d_key: int | None = None
    tanh: bool = False  # linear only
    # token_max: a token and the ngram-1 before it matched against aligned rows (an n-gram
    # match; 1: a single-state match); None: crtn.model.summary.DEFAULT_NGRAM (4, at most
    # tgt_len). README, "Retrieval that scales"
    ngram: int | None = None
    # token_max: 1 keys each row by the ngram rows before it, so the slot that wins holds the token
    # that follows the match (the one to copy); 0: by the row itself and the ngram-1 before it;
    # None: crtn.model.summary.DEFAULT_SHIFT. README, "Retrieval that scales"
    shift: int | None = None


@dataclass
class SyntheticConfig:
    """The passage-recall corpus (SPEC §4)."""

    vocab_size: int = 512
    branching: int = 16  # successors per symbol in the sparse Markov source
    concentration: float = 1.0  # Dirichlet concentration of the successor probabilities
    passage_len: int = 16  # P
    doc_passages: int = 64  # passages per document
    p_repeat: float = 0.5  # probability that a passage copies an earlier one
    min_gap: int = 160  # tokens between the copied passage and its copy, at least
    max_gap: int = 256  # ... and at most
    train_tokens: int = 2_000_000
    valid_tokens: int = 65_536
    test_tokens: int = 65_536
    seed: int = 1234
    repeat_skip: int = 4  # first tokens of each repeat left out of the repeat metrics


@dataclass
class DataConfig:
    """Which corpus, where it lives, and how it is batched (SPEC §4)."""

    name: str = "synthetic"  # wt2 | wt103 | ptb | enwik8 | text8 | text | synthetic
    root: str = "data"  # folder holding the corpus folders (see conf/data/*.yaml)
    dir: str | None = None  # corpus folder under root, e.g. wikitext-2
    path: str | None = None  # name=text: the UTF-8 file
    level: str = "word"  # name=text: word | char
    split: list[float] = field(default_factory=lambda: [0.9, 0.05, 0.05])  # name=text
    cache_dir: str | None = None  # vocabulary/encoding cache; None: beside the data
    batch_size: int = 16
    eval_batch_size: int = 16  # conf/data options of real corpora: 10
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class OptimConfig:
    """Adam with warm-up and a schedule, gradient clipping (SPEC §5)."""

    name: str = "adam"
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


@dataclass
class TrainConfig:
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


@dataclass
class EvalConfig:
    """Evaluation-time overrides (SPEC §5): a longer memory and a larger cache than in training."""

    tgt_len: int | None = None
    mem_len: int | None = None
    clamp_len: int | None = None
    same_length: bool | None = None
    n_slot: int | None = None
    top_k: int | None = None
    batch_size: int | None = None  # None: data.eval_batch_size
    max_step: int | None = None  # evaluate only the first max_step segments


@dataclass
class TrainAppConfig:
    """Root of ``crtn-train``'s config (``conf/train.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 1111
    init_from: str | None = None  # a crtn checkpoint (e.g. from crtn-convert) to start from


@dataclass
class CacheOverrides:
    """Eval-time overrides of a checkpoint's cache node (null: keep the trained value)."""

    backend: str | None = None
    faiss_index: str | None = None
    hnsw_m: int | None = None
    hnsw_ef_search: int | None = None
    hnsw_ef_construction: int | None = None
    alpha_norm: str | None = None
    dtype: str | None = None


@dataclass
class DataOverrides:
    """Eval-time overrides of a checkpoint's data node (null: keep the trained value)."""

    root: str | None = None
    dir: str | None = None
    path: str | None = None
    cache_dir: str | None = None
    eval_batch_size: int | None = None


@dataclass
class EvalAppConfig:
    """Root of ``crtn-eval``'s config (``conf/eval.yaml``)."""

    checkpoint: str = MISSING
    splits: list[str] = field(default_factory=lambda: ["valid", "test"])
    eval: EvalConfig = field(default_factory=EvalConfig)
    cache: CacheOverrides = field(default_factory=CacheOverrides)
    data: DataOverrides = field(default_factory=DataOverrides)
    device: str = "cpu"
    progress: bool = True


@dataclass
class GenerateAppConfig:
    """Root of ``crtn-generate``'s config (``conf/generate.yaml``)."""

    checkpoint: str = MISSING
    prompt: str = ""  # the text to continue; empty: start after an <eos> (word level)
    prompt_file: str | None = None  # read the prompt from this UTF-8 file instead
    max_new_tokens: int = 50
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # sample among the k most likely tokens; 0: all (cache.top_k is unrelated)
    seed: int = 1111
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    out: str | None = None  # also write a JSON record (prompt, ids, text, settings) here
    eval: EvalConfig = field(default_factory=EvalConfig)  # eval-time lengths, as crtn-eval
    cache: CacheOverrides = field(default_factory=CacheOverrides)
    data: DataOverrides = field(default_factory=DataOverrides)  # where the corpus is (vocab fallback)


@dataclass
class ModelOverrides:
    """``model.KEY=VALUE`` of ``crtn-convert``: null keeps what the source says (or implies)."""

    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    d_head: int | None = None
    d_inner: int | None = None
    d_embed: int | None = None
    dropout: float | None = None
    dropatt: float | None = None
    tgt_len: int | None = None
    mem_len: int | None = None
    clamp_len: int | None = None
    same_length: bool | None = None
    pre_lnorm: bool | None = None
    untie_r: bool | None = None
    cutoffs: list[int] | None = None
    div_val: int | None = None
    tie_weight: bool | None = None
    tie_projs: list[bool] | None = None
    init_std: float | None = None
    proj_init_std: float | None = None
    layer_norm_eps: float | None = None


@dataclass
class ConvertAppConfig:
    """Root of ``crtn-convert``'s config (``conf/convert.yaml``)."""

    src: str = MISSING  # HF TransfoXLLMHeadModel folder, or a release model.pt / state_dict file
    out: str = MISSING  # output folder: model.pt, model/converted.yaml, convert.log
    vocab: str | None = None  # vocabulary file: one symbol per line (first field), id order
    format: str = "auto"  # auto | hf | release
    trust_pickle: bool = False  # allow unpickling a whole MemTransformerLM module (runs its code)
    model: ModelOverrides = field(default_factory=ModelOverrides)
    data: DataConfig | None = None  # the data group (data=ptb ...), stored in the checkpoint's config


@dataclass
class ReclAppConfig:
    """Root of ``crtn-recl``'s config (``conf/recl.yaml``): the relative effective context length
    of a group of checkpoints (Dai et al. 2019, section 4.3; :mod:`crtn.analysis.recl`)."""

    checkpoints: list[str] = MISSING  # the model group, evaluated on the corpus of the first
    names: list[str] | None = None  # one per checkpoint; None: each checkpoint's model.name
    split: str = "valid"
    # contexts c = c0, c0 + delta, ..., c_max: memory mem_len = c (no cache), n_slot = (c - m) / L
    # (cache); c0 None: the smallest multiple of delta that is >= every cached model's mem_len
    c0: int | None = None
    delta: int = MISSING
    c_max: int = MISSING
    ratios: list[float] = field(default_factory=lambda: [0.1, 0.5, 1.0])  # r, fraction of hardest tokens
    threshold: float = 0.01
    max_tokens: int = 10_000  # tokens scored (the same for every model), max_tokens // batch_size per stream
    batch_size: int | None = None  # streams; None: the first checkpoint's data.eval_batch_size
    same_length: bool = (
        True  # each query attends exactly mem_len positions (itself included), as Transformer-XL's RECL
    )
    cache: CacheOverrides = field(default_factory=CacheOverrides)
    data: DataOverrides = field(default_factory=DataOverrides)
    device: str = "cpu"
    progress: bool = True


#: The schema of each Hydra app, by primary config name (``conf/NAME.yaml`` starts from ``NAME_schema``).
APP_SCHEMAS: dict[str, type] = {
    "train": TrainAppConfig,
    "eval": EvalAppConfig,
    "generate": GenerateAppConfig,
    "convert": ConvertAppConfig,
    "recl": ReclAppConfig,
}


def register_configs() -> None:
    """Register every app's schema (``train_schema``, ``eval_schema``, ``generate_schema``,
    ``convert_schema``, ``recl_schema``) in Hydra's ConfigStore and the ``crtn_range`` resolver (idempotent)."""
    if not OmegaConf.has_resolver("crtn_range"):
        OmegaConf.register_new_resolver("crtn_range", dependency_range)
    cs = ConfigStore.instance()
    for name, schema in APP_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema)


def train_config(overrides: dict[str, Any] | None = None) -> DictConfig:
    """``crtn-train``'s default config, i.e. the schema (what ``crtn-train`` composes without
    arguments), with ``overrides`` applied: dotted keys, e.g. ``{"model.n_layer": 2}``.

    The tests (``tests/helpers.py``) and the benchmark build their configs from it.
    """
    cfg = OmegaConf.structured(TrainAppConfig)
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


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


def data_level(data: Any) -> str:
    """``word`` or ``char``: the level of the corpus a ``data`` node (or plain dict) describes,
    without reading it (``data.name=text`` says it in ``data.level``)."""
    get = data.get if isinstance(data, dict) else lambda k, d=None: getattr(data, k, d)
    name = get("name")
    if name in CHAR_DATASETS:
        return "char"
    if name == "text":
        return get("level") or "word"
    return "word"


def metric_name(level: str) -> str:
    """``ppl`` for word-level corpora (and the synthetic one), ``bpc`` for character-level ones (SPEC §5)."""
    return "bpc" if level == "char" else "ppl"


def _choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(options)}")


def validate_train(cfg: Any) -> None:
    """Check a ``crtn-train`` config (see :func:`validate_model`); raises :class:`ConfigError`."""
    validate_model(cfg.model, cfg.cache, cfg.query, cfg.summary)
    _choice("data.name", cfg.data.name, DATASETS)
    _choice("optim.scheduler", cfg.optim.scheduler, SCHEDULERS)
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.optim.warmup_step < 0:
        raise ConfigError(f"optim.warmup_step={cfg.optim.warmup_step} must be >= 0")
    for key in ("max_step", "log_interval", "eval_interval", "batch_chunk"):
        if getattr(cfg.train, key) <= 0:
            raise ConfigError(f"train.{key}={getattr(cfg.train, key)} must be > 0")
    validate_training(cfg.train, cfg.optim)
    if cfg.train.max_time is not None and cfg.train.max_time <= 0:
        raise ConfigError(f"train.max_time={cfg.train.max_time} must be > 0 (seconds)")
    if cfg.data.batch_size <= 0 or cfg.data.eval_batch_size <= 0:
        raise ConfigError("data.batch_size and data.eval_batch_size must be > 0")
    if cfg.data.batch_size % cfg.train.batch_chunk != 0:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} must be divisible by "
            f"train.batch_chunk={cfg.train.batch_chunk}"
        )
    validate_eval(cfg.eval, cfg.model)


def validate_eval(ev: Any, model: Any) -> None:
    """Check evaluation-time overrides against the trained model; raises :class:`ConfigError`."""
    if ev.tgt_len is not None and ev.tgt_len <= 0:
        raise ConfigError(f"eval.tgt_len={ev.tgt_len} must be > 0")
    if ev.mem_len is not None and ev.mem_len < 0:
        raise ConfigError(f"eval.mem_len={ev.mem_len} must be >= 0")
    for key in ("n_slot", "top_k"):
        value = getattr(ev, key)
        if value is not None and value < 0:
            raise ConfigError(f"eval.{key}={value} must be >= 0")
    if ev.batch_size is not None and ev.batch_size <= 0:
        raise ConfigError(f"eval.batch_size={ev.batch_size} must be > 0")
    if uses_cache(model):
        tgt = ev.tgt_len if ev.tgt_len is not None else model.tgt_len
        mem = ev.mem_len if ev.mem_len is not None else model.mem_len
        if mem % tgt != 0:
            raise ConfigError(f"eval.mem_len={mem} must be a multiple of eval.tgt_len={tgt} for model=crtn")
