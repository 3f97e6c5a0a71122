"""What a model is built from: four frozen specs, one per config group (docs/method.md §1-3).

Each spec is a frozen dataclass; its fields are the options of one config group (``model``,
``cache``, ``query``, ``summary``) and their defaults, written here once. They are the Hydra
schema of those groups (``crtn/config.py`` registers them), and a *resolved* spec (every
derived default filled in, every rule checked by the class that owns it:
:func:`crtn.model.resolve_spec`) is what the model, the cache, the query strategies and the
summaries are built from and what a checkpoint stores. Nothing in ``crtn/model`` holds a
config node.

``None`` marks a default derived from other options (e.g. ``model.d_embed``: ``d_model``);
resolution replaces it. Where ``None`` is an option of its own (``summary.d_key`` of
``token_max``: no learned map; ``cache.dtype``: the states' dtype) the field says so.

Not every option applies to every choice of its group: each summary and each query strategy
class declares the fields of its spec it reads (``reads``), and its ``resolve`` refuses any
other field set to a value other than its default (:func:`first_unread`), so an option that
would be ignored is never accepted silently.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any

#: the default of ``model.mem_len``: an interpolation the config resolves to ``model.tgt_len``
#: (a spec built in Python without a config gets ``tgt_len`` when it is resolved)
MEM_LEN_DEFAULT = "${model.tgt_len}"
_TUPLES = ("cutoffs", "tie_projs")


@dataclass(frozen=True)
class ModelSpec:
    """Transformer hyper-parameters shared by ``vanilla``, ``txl`` and ``crtn`` (docs/method.md §1-2)."""

    name: str = "crtn"  # vanilla | txl | crtn (crtn.model.MODELS)
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
    mem_len: int = MEM_LEN_DEFAULT  # type: ignore[assignment]  # m: short-term memory, positions per layer; one segment by default
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
    # attention without retrieved rows through FlexAttention (torch >= 2.5; crtn/model/flex.py), the
    # relative-position term as its score_mod, the mask a BlockMask: fused kernels on CUDA (compiled);
    # no attention dropout, so refused with dropatt > 0
    flex: bool = False

    def __post_init__(self) -> None:
        _freeze_lists(self)


@dataclass(frozen=True)
class CacheSpec:
    """The key-value cache of past segments and its retrieval (docs/method.md §3)."""

    # the defaults: one retrieved segment at alpha 1, read by the top two layers, the cheapest
    # configuration that keeps the recall task's accuracy (docs/results.md, "The default cache");
    # the CRTN paper's cache is top_k 2, alpha_norm all, layers null
    n_slot: int = 8  # N: past segments held per batch row
    top_k: int = 1  # k: segments retrieved per query token
    alpha_norm: str = "topk"  # all (the paper) | topk | original (the authors' code), crtn/model/cache.py
    weighted: bool = True  # values scaled by alpha (keys never are)
    # relative positions of the retrieved rows (crtn/model/retrieved.py): concat | real | match;
    # None: match where token_max scores the slots for a query strategy (its best rows place the
    # copy: docs/results.md, "Positions aligned on the best-matching row"), else concat
    pos: str | None = None
    backend: str = "torch"  # torch | faiss (faiss: alpha_norm=topk only)
    faiss_index: str = "flat"  # flat (IndexFlatIP, exact) | hnsw (approximate)
    # retrieval in the top min(layers, n_layer) layers only, the layers below run once; None: every
    # layer (the paper)
    layers: int | None = 2
    # hidden layer of keys and queries (0 embeddings .. n top); None: the top, or the input of the
    # first retrieving layer with `layers`
    key_layer: int | None = None
    # storage of the cached values: bfloat16 (half float32's memory, and a selection at alpha 1
    # that multiplies in bfloat16: docs/method.md §3, "A selection in bfloat16") | float32 |
    # float16 | float64 | None (the states' own dtype)
    dtype: str | None = "bfloat16"
    # dtype of the retrieved attention's products with the stored rows (crtn/model/grouped.py),
    # and where 16-bit of the folding's with W_{k,E} and W_v (crtn/model/retrieved.py):
    # None: the storage dtype where the device multiplies it natively, so bfloat16 rows are
    # multiplied as stored, without a cast, and float32 on a CPU without bfloat16 units
    # (crtn/model/hardware.py; docs/method.md §3, "Efficient main pass"; cost and accuracy in
    # docs/results.md, "Products in bfloat16") | float32 | float16 | bfloat16 | float64
    product_dtype: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether a cache is kept at all (``n_slot > 0`` and ``top_k > 0``; else the model is
        exactly Transformer-XL)."""
        return self.n_slot > 0 and self.top_k > 0


@dataclass(frozen=True)
class QuerySpec:
    """How each token's query is built (docs/method.md §3, "Query strategies")."""

    # crtn.model.STRATEGIES; gate: selection inside attention (no query pass); lookup: an exact lookup
    # of the preceding tokens (no query pass; docs/results.md, "The lookup as a retriever")
    strategy: str = "lookup"
    detach: bool = False  # stop gradients from the retrieval weights into the query pass (gate: the query)
    # lookup: the longest n-gram a token looks up (crtn/model/lookup.py: summary.ngram, twice it, ...
    # below this, and this)
    max_match: int = 16


@dataclass(frozen=True)
class SummarySpec:
    """Summary of an L x d block into a key or query (docs/method.md §3, "Summaries")."""

    name: str = "token_max"  # the default of query=token; each conf/query option selects its own
    # linear: output width (None: d_model); token_max: a learned map of queries and rows to d_key
    # (None: no map); ignored by the summaries without weights
    d_key: int | None = None
    # token_max: a token and the ngram-1 before it matched against aligned rows (an n-gram match;
    # 1: a single-state match); None: crtn.model.summary.DEFAULT_NGRAM (at most tgt_len)
    ngram: int | None = None
    # token_max: 1 keys each row by the ngram rows before it, so the slot that wins holds the token
    # that follows the match (the one to copy); 0: by the row itself and the ngram-1 before it;
    # None: crtn.model.summary.DEFAULT_SHIFT
    shift: int | None = None
    # token_max: score by cosine similarity (queries and rows L2-normalised after the d_key maps, no
    # 1/sqrt(d_key)), so a row equal to the query scores 1, the most any row can, whatever the norms
    cosine: bool = False


@dataclass(frozen=True)
class Spec:
    """Everything a model is built from: the four groups (a resolved run spec has these fields too)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    query: QuerySpec = field(default_factory=QuerySpec)
    summary: SummarySpec = field(default_factory=SummarySpec)


#: set while a resolve step makes its resolved object (:func:`minting`); nothing else may make one
_MINTING: ContextVar[bool] = ContextVar("crtn_minting_resolved", default=False)


@contextmanager
def minting() -> Iterator[None]:
    """The context in which a resolve step (:func:`crtn.model.resolve_spec`,
    :func:`crtn.config.resolve`) makes its :class:`Resolved` object; made outside it (e.g. by
    ``dataclasses.replace`` on a resolved spec), the object is of the unresolved base class."""
    token = _MINTING.set(True)
    try:
        yield
    finally:
        _MINTING.reset(token)


class Resolved:
    """Marker of a resolved spec: every derived default filled, every rule checked by the part
    that owns it. The builders (:func:`crtn.model.build_model`, :func:`crtn.model.with_spec`,
    :func:`crtn.model.evaluation_spec`, the benchmark) take nothing else
    (:func:`require_resolved`). ``spec``: the four model groups as a :class:`ResolvedSpec`.

    Only a resolve step makes one (:func:`minting`): ``dataclasses.replace`` on a resolved spec
    gives an instance of the unresolved base class (the new values are unchecked), which the
    builders refuse and the resolve steps accept.
    """

    _unresolved: type  # the base class an instance made outside a resolve step becomes

    @property
    def spec(self) -> ResolvedSpec:
        raise NotImplementedError

    def _demote_unless_minted(self) -> None:
        if not _MINTING.get():
            object.__setattr__(self, "__class__", self._unresolved)


@dataclass(frozen=True)
class ResolvedSpec(Spec, Resolved):
    """A :class:`Spec` made by :func:`crtn.model.resolve_spec`: what a model is built from and
    what it keeps as ``model.spec``."""

    _unresolved = Spec

    def __post_init__(self) -> None:
        self._demote_unless_minted()

    @property
    def spec(self) -> ResolvedSpec:
        return self


def require_resolved(spec: Any, where: str, cls: type = Resolved) -> Any:
    """``spec`` itself, checked to be resolved: an instance of ``cls``, :class:`Resolved` (a
    resolved model spec or run spec) by default; the one check of every builder.

    Raises:
        TypeError: ``spec`` is not (a config node, a :class:`Spec`, a run spec that was not
            resolved or was changed after it), naming ``where`` it was passed.
    """
    if not isinstance(spec, cls):
        raise TypeError(
            f"{where} takes a resolved spec ({cls.__name__}: crtn.model.resolve_spec or "
            f"crtn.config.resolve), not {type(spec).__name__}"
        )
    return spec


def spec_of(cls: type, node: Any) -> Any:
    """An instance of the spec dataclass ``cls`` with the values of ``node``: any object with those
    attributes (a spec, a config node, a namespace); lists become tuples."""
    if isinstance(node, cls):
        return node
    return cls(**{f.name: _plain(getattr(node, f.name)) for f in fields(cls)})


def model_specs(source: Any) -> Spec:
    """The four model specs of ``source`` (an object with ``model``, ``cache``, ``query`` and
    ``summary`` attributes: a run spec, a :class:`Spec`, a composed config)."""
    return Spec(
        model=spec_of(ModelSpec, source.model),
        cache=spec_of(CacheSpec, source.cache),
        query=spec_of(QuerySpec, source.query),
        summary=spec_of(SummarySpec, source.summary),
    )


def first_unread(spec: Any, reads: Collection[str]) -> tuple[str, str] | None:
    """The first field of ``spec`` (a spec dataclass instance) outside ``reads`` whose value is not
    the schema's default, as (field name, value as written on a command line: ``true``,
    ``null``, ``8``), or None when every such field has its default.

    The rule behind "an option the chosen class ignores is refused": a class lists the fields it
    reads, and a non-default value of any other field would change nothing.
    """
    default = type(spec)()
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name not in reads and value != getattr(default, f.name):
            return f.name, option_text(value)
    return None


def only_readers(names: Iterable[str]) -> str:
    """``only a reads it`` / ``only a|b read it`` / ``none reads it`` for the names of the classes
    that read an option (the tail of a refusal of an ignored option)."""
    names = list(names)
    if not names:
        return "none reads it"
    return f"only {'|'.join(names)} {'reads' if len(names) == 1 else 'read'} it"


def option_text(value: Any) -> str:
    """A value as a command line writes it: ``true``/``false``, ``null``, else ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def _freeze_lists(spec: Any) -> None:
    """Store list fields as tuples, so a frozen spec cannot change through them."""
    for name in _TUPLES:
        value = getattr(spec, name, None)
        if isinstance(value, list):
            object.__setattr__(spec, name, tuple(value))
