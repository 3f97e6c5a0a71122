"""``crtn-convert``: pretrained Transformer-XL weights into a crtn checkpoint (a Hydra app).

    crtn-convert src=HF_DIR out=OUT [vocab=FILE] [data=ptb data.root=...] [model.KEY=VALUE ...]
    crtn-convert src=model.pt out=OUT model.tgt_len=150 model.mem_len=150 ...

Sources (``format=auto`` tells them apart):

- ``hf``: a Hugging Face ``TransfoXLLMHeadModel`` folder (``config.json`` and
  ``model.safetensors`` or ``pytorch_model.bin``, possibly sharded with an
  ``*.index.json``), as written by ``save_pretrained`` in transformers <= 4.35
  (``models/transfo_xl/modeling_transfo_xl.py``; later releases removed the model).
  Keys lose their ``transformer.`` prefix; the rows of ``crit.cluster_weight`` and
  ``crit.cluster_bias`` are reversed, because HF 4.35's working ``forward`` reads
  tail cluster ``i`` from head column ``cutoffs[0] + i - 1`` while crtn (like the
  PyTorch release) reads column ``-i`` (see :mod:`crtn.model.adaptive`).
  Hyper-parameters come from ``config.json`` (``tie_word_embeddings`` ->
  ``tie_weight``, ``tie_projs`` / ``proj_share_all_but_first`` -> ``tie_projs``,
  ``layer_norm_epsilon`` -> ``layer_norm_eps``, ``vocab_size`` -> ``n_token``; keys
  that ``save_pretrained`` left out take :data:`HF_DEFAULTS`, the 4.35 defaults).
- ``release``: a checkpoint of the Transformer-XL release (kimiyoung/transformer-xl,
  ``pytorch/mem_transformer.py``, ``MemTransformerLM``). Its ``train.py`` saves the
  whole pickled module (``torch.save(model, f)``); a re-saved ``state_dict`` works
  too. Parameter names are crtn's already (crtn follows the release); the release's
  cluster order is crtn's. Files are read with ``torch.load(weights_only=True)``,
  which never runs code from the file. A whole-module pickle needs the release's
  classes, and unpickling them executes code named by the file, so it is refused
  with an explanation unless ``trust_pickle=true`` is given (with the release's
  ``pytorch/`` folder on ``PYTHONPATH``); then ``.state_dict()`` and the module's
  attributes (``tgt_len``, ``mem_len``, ``same_length``, ``clamp_len``, dropout
  rates, ``pre_lnorm``, ``attn_type``...) are used.

Hyper-parameters, in increasing priority: :class:`crtn.config.ModelConfig`
defaults (the command line's; ``mem_len`` defaults to ``tgt_len``) < inferred from tensor shapes (:func:`infer_hparams`: ``n_layer``,
``n_head``, ``d_head``, ``d_model``, ``d_embed``, ``d_inner``, ``div_val``,
``cutoffs`` when ``div_val > 1``, ``untie_r``, ``tie_weight``, ``tie_projs``) <
the source's config or module attributes < ``model.KEY=VALUE`` on the command
line. Values that neither shapes nor the source determine (a bare release
state_dict: ``tgt_len``, ``mem_len``, ``clamp_len``, ``same_length``,
``pre_lnorm``, dropout rates) are logged as assumed; ``pre_lnorm`` changes the
computation, so set it when the model was trained with it.

Output, in ``out``:

- ``model.pt``: a crtn checkpoint (:mod:`crtn.checkpoint`) whose ``config`` is a
  complete ``crtn-train`` config with ``model.name=txl`` and the converted sizes
  (``data`` as given by ``data=...``, else the default), ``vocab`` (the
  ``vocab=FILE`` symbols, or None) and ``model`` (crtn parameter names, the
  source's floating dtype);
- ``model/converted.yaml``: the model as a config-group option, so that
  ``crtn-train --config-dir OUT model=converted model.name=crtn init_from=OUT/model.pt
  data=...`` fine-tunes CRTN from it;
- ``convert.log``.

Errors (bad input that the user can fix) are :class:`ConversionError` and print as
one line naming the tensor, key or file: unknown or missing tensors, shape
mismatches, ``attn_type`` other than 0, ``sample_softmax > 0``, a vocabulary of
the wrong size, a whole-module pickle without ``trust_pickle=true``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, OmegaConf

from crtn.config import DataConfig
from crtn.errors import UserError

log = logging.getLogger("crtn.convert")

#: ``TransfoXLConfig`` defaults of transformers 4.35 (``configuration_transfo_xl.py``), used for keys
#: that a ``config.json`` leaves out; ``tie_word_embeddings`` is ``PretrainedConfig``'s default.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 267735,
    "cutoffs": [20000, 40000, 200000],
    "d_model": 1024,
    "d_embed": 1024,
    "n_head": 16,
    "d_head": 64,
    "d_inner": 4096,
    "div_val": 4,
    "pre_lnorm": False,
    "n_layer": 18,
    "mem_len": 1600,
    "clamp_len": 1000,
    "same_length": True,
    "proj_share_all_but_first": True,
    "attn_type": 0,
    "sample_softmax": -1,
    "dropout": 0.1,
    "dropatt": 0.0,
    "untie_r": True,
    "init_std": 0.02,
    "proj_init_std": 0.01,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}

#: config.json key -> crtn ``ModelConfig`` key (copied as they are).
_HF_KEYS = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "d_model": "d_model",
    "d_head": "d_head",
    "d_inner": "d_inner",
    "d_embed": "d_embed",
    "div_val": "div_val",
    "cutoffs": "cutoffs",
    "pre_lnorm": "pre_lnorm",
    "mem_len": "mem_len",
    "clamp_len": "clamp_len",
    "same_length": "same_length",
    "dropout": "dropout",
    "dropatt": "dropatt",
    "untie_r": "untie_r",
    "init_std": "init_std",
    "proj_init_std": "proj_init_std",
    "layer_norm_epsilon": "layer_norm_eps",
    "tie_word_embeddings": "tie_weight",
    "tgt_len": "tgt_len",
}

#: ModelConfig keys that neither the shapes nor a state_dict determine.
NOT_INFERABLE = ("tgt_len", "mem_len", "clamp_len", "same_length", "pre_lnorm", "dropout", "dropatt")

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


class ConversionError(UserError):
    """A source that cannot be converted; the message (one line) names the tensor, key or file."""


# ============================================================================ config schema
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


def register_configs() -> None:
    """Register ``convert_schema`` (and crtn-train's schemas, for the data group) in the ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from crtn.config import register_configs as register_train

    register_train()
    ConfigStore.instance().store(name="convert_schema", node=ConvertAppConfig)


# ============================================================================ reading sources
@dataclass
class Source:
    """Weights and what is known about them, before conversion.

    Attributes:
        kind: ``"hf"`` or ``"release"``.
        path: the file or folder read.
        tensors: release/crtn parameter names (no ``transformer.`` prefix) -> tensor,
            softmax clusters in the release's order.
        names: crtn name -> name in the source file (for messages).
        hparams: crtn ``ModelConfig`` keys known from the source's config or attributes.
        n_token: vocabulary size stated by the source, or None.
    """

    kind: str
    path: Path
    tensors: dict[str, torch.Tensor]
    names: dict[str, str]
    hparams: dict[str, Any] = field(default_factory=dict)
    n_token: int | None = None

    def name(self, key: str) -> str:
        """The source's own name of crtn tensor ``key`` (present or expected)."""
        if key in self.names:
            return self.names[key]
        if self.kind == "hf" and not key.startswith("crit."):
            return "transformer." + key
        return key


def read_source(src: str | Path, fmt: str = "auto", trust_pickle: bool = False) -> Source:
    """Read a Hugging Face folder or a release checkpoint (see the module docstring).

    Raises:
        ConversionError: missing/unreadable source, a whole-module pickle without
            ``trust_pickle``, an unsupported model type.
    """
    path = Path(src)
    if fmt not in ("auto", "hf", "release"):
        raise ConversionError(f"format={fmt!r} is not one of: auto, hf, release")
    if not path.exists():
        raise ConversionError(f"src={str(path)!r} does not exist")
    if fmt == "hf" or (fmt == "auto" and path.is_dir()):
        return read_hf(path)
    return read_release(path, trust_pickle)


def _load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConversionError(
                f"{str(path)!r}: reading safetensors files needs the safetensors package (pip install safetensors)"
            ) from None

        return load_file(str(path))
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConversionError(f"{str(path)!r} cannot be read as a torch file ({_first_line(e)})") from None
    if not isinstance(sd, dict):
        raise ConversionError(f"{str(path)!r} does not hold a state_dict (got {type(sd).__name__})")
    return sd


def read_hf(folder: Path) -> Source:
    """A ``TransfoXLLMHeadModel`` folder written by ``save_pretrained`` (transformers <= 4.35).

    Raises:
        ConversionError: no ``config.json`` or weights, another model type, ``attn_type != 0``,
            ``sample_softmax > 0``, a tensor outside ``transformer.*`` / ``crit.*``.
    """
    if not folder.is_dir():
        raise ConversionError(f"src={str(folder)!r}: a Hugging Face model is a folder with config.json")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"src={str(folder)!r} has no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{str(cfg_path)!r} cannot be read ({_first_line(e)})") from None
    model_type = config.get("model_type")
    if model_type not in (None, "transfo-xl"):
        raise ConversionError(f"{str(cfg_path)!r}: model_type={model_type!r}, expected 'transfo-xl'")
    archs = config.get("architectures") or []
    if archs and "TransfoXLLMHeadModel" not in archs:
        raise ConversionError(
            f"{str(cfg_path)!r}: architectures={archs}; only TransfoXLLMHeadModel (with its softmax) converts"
        )
    c = {**HF_DEFAULTS, **config}
    _check_supported(c.get("attn_type"), c.get("sample_softmax"), str(cfg_path))

    raw: dict[str, torch.Tensor] = {}
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            for shard in shards:
                raw.update(_load_weights_file(folder / shard))
            break
    else:
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (folder / name).is_file():
                raw = _load_weights_file(folder / name)
                break
        else:
            raise ConversionError(
                f"src={str(folder)!r} has no model.safetensors or pytorch_model.bin (weights of save_pretrained)"
            )

    tensors, names = {}, {}
    for key, value in raw.items():
        if key.startswith("transformer."):
            new = key[len("transformer.") :]
        elif key.startswith("crit."):
            new = key
        else:
            raise ConversionError(
                f"unknown tensor {key!r} in {str(folder)!r}: a TransfoXLLMHeadModel has only "
                "transformer.* and crit.* tensors"
            )
        tensors[new], names[new] = value, key
    from crtn.model.adaptive import flip_cluster_order

    tensors = flip_cluster_order(tensors, "crit.")  # HF 4.35 order -> release order

    hp = {crtn_key: c[hf_key] for hf_key, crtn_key in _HF_KEYS.items() if hf_key in c}
    hp["cutoffs"] = list(c["cutoffs"])
    if "tie_projs" in config:
        hp["tie_projs"] = [bool(t) for t in config["tie_projs"]]
    else:
        hp["tie_projs"] = [False] + [bool(c["proj_share_all_but_first"])] * len(hp["cutoffs"])
    for ignored in ("ext_len",):
        if c.get(ignored):
            log.warning(
                "%s: %s=%s is an evaluation setting crtn does not use; ignored", cfg_path, ignored, c[ignored]
            )
    return Source("hf", folder, tensors, names, hp, int(c["vocab_size"]))


def _check_supported(attn_type: Any, sample_softmax: Any, where: str) -> None:
    if attn_type is not None and attn_type != 0:
        raise ConversionError(
            f"{where}: attn_type={attn_type} is not supported; crtn implements Transformer-XL's relative "
            "attention only (attn_type=0)"
        )
    if sample_softmax is not None and sample_softmax > 0:
        raise ConversionError(
            f"{where}: sample_softmax={sample_softmax} (a sampled softmax with out_layer) is not supported; "
            "crtn converts the adaptive softmax (sample_softmax <= 0) only"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unsafe_globals(path: Path, error: BaseException) -> list[str]:
    """Classes/functions a pickle would import (without running it)."""
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:
        found = []
    if not found:
        m = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        found = [m.group(1)] if m else []
    own = [g for g in found if not g.startswith("torch.")]  # the model's own classes first
    return own + [g for g in found if g.startswith("torch.")]


def read_release(path: Path, trust_pickle: bool = False) -> Source:
    """A release ``model.pt``: a whole pickled ``MemTransformerLM`` or a state_dict file.

    Raises:
        ConversionError: unreadable file; a whole-module pickle without ``trust_pickle``
            (nothing from the file is executed), or with it but without the release's code
            on the path; a crtn checkpoint given as source.
    """
    if path.is_dir():
        raise ConversionError(
            f"src={str(path)!r} is a folder without config.json; format=release needs a file"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if not isinstance(e, __import__("pickle").UnpicklingError) or "Weights only load failed" not in str(
            e
        ):
            raise ConversionError(
                f"{str(path)!r} cannot be read as a torch file ({_first_line(e)})"
            ) from None
        classes = _unsafe_globals(path, e)
        if not trust_pickle:
            what = ", ".join(classes[:3]) or "Python objects"
            raise ConversionError(
                f"{str(path)!r} is a whole pickled module ({what}), not a state_dict; unpickling it runs code "
                "named by the file. If you trust it, pass trust_pickle=true with the Transformer-XL release's "
                "pytorch/ folder on PYTHONPATH, or re-save its weights with "
                "torch.save(torch.load(f, weights_only=False).state_dict(), 'state_dict.pt')"
            ) from None
        log.warning("trust_pickle=true: unpickling %s (imports %s)", path, ", ".join(classes) or "?")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except (ModuleNotFoundError, AttributeError) as e2:
            raise ConversionError(
                f"{str(path)!r} needs the Transformer-XL release's code to unpickle ({_first_line(e2)}); put "
                "the release's pytorch/ folder (mem_transformer.py, utils/) on PYTHONPATH"
            ) from None
        except Exception as e2:
            raise ConversionError(f"{str(path)!r} cannot be unpickled ({_first_line(e2)})") from None
        return _from_module(path, obj)
    if isinstance(obj, dict) and obj.get("format") == "crtn-checkpoint":
        raise ConversionError(f"{str(path)!r} is already a crtn checkpoint; nothing to convert")
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, dict) or not obj:
        raise ConversionError(f"{str(path)!r} does not hold a state_dict (got {type(obj).__name__})")
    bad = next((k for k, v in obj.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise ConversionError(
            f"{str(path)!r}: entry {bad!r} is not a tensor; expected a MemTransformerLM state_dict"
        )
    tensors = dict(obj)
    return Source("release", path, tensors, {k: k for k in tensors})


def _from_module(path: Path, module: Any) -> Source:
    """State dict and hyper-parameters of an unpickled release ``MemTransformerLM``."""
    module = getattr(module, "module", module)  # (Balanced)DataParallel wrappers
    if not isinstance(module, torch.nn.Module):
        raise ConversionError(
            f"{str(path)!r} unpickles to {type(module).__name__}, not a MemTransformerLM module"
        )
    _check_supported(getattr(module, "attn_type", 0), getattr(module, "sample_softmax", -1), str(path))
    hp: dict[str, Any] = {}
    for key in (
        "n_layer",
        "n_head",
        "d_model",
        "d_head",
        "d_embed",
        "tgt_len",
        "mem_len",
        "clamp_len",
        "same_length",
    ):
        value = getattr(module, key, None)
        if value is not None:
            hp[key] = value
    drop = getattr(module, "drop", None)
    if isinstance(drop, torch.nn.Dropout):
        hp["dropout"] = drop.p
    layers = getattr(module, "layers", None)
    if layers is not None and len(layers) > 0:
        attn = getattr(layers[0], "dec_attn", None)
        if attn is not None:
            if hasattr(attn, "pre_lnorm"):
                hp["pre_lnorm"] = bool(attn.pre_lnorm)
            if isinstance(getattr(attn, "dropatt", None), torch.nn.Dropout):
                hp["dropatt"] = attn.dropatt.p
            ln = getattr(attn, "layer_norm", None)
            if isinstance(ln, torch.nn.LayerNorm):
                hp["layer_norm_eps"] = ln.eps
    emb = getattr(module, "word_emb", None)
    if emb is not None and getattr(emb, "cutoffs", None) is not None:
        hp["cutoffs"] = [int(c) for c in list(emb.cutoffs)[:-1]]
        hp["div_val"] = int(emb.div_val)
    if getattr(module, "ext_len", 0):
        log.warning(
            "%s: ext_len=%s is an evaluation setting crtn does not use; ignored", path, module.ext_len
        )
    tensors = dict(module.state_dict())
    n_token = getattr(module, "n_token", None)
    return Source("release", path, tensors, {k: k for k in tensors}, hp, n_token)


# ============================================================================ hyper-parameters
def _require(src: Source, key: str) -> torch.Tensor:
    if key not in src.tensors:
        raise ConversionError(f"missing tensor {src.name(key)!r} in {str(src.path)!r}")
    return src.tensors[key]


def infer_hparams(src: Source) -> dict[str, Any]:
    """Model sizes and tying read off the tensor shapes (release names).

    Returns ModelConfig keys plus ``n_token``; ``cutoffs`` is left out when it cannot be
    inferred (``div_val == 1`` with tail clusters share one output layer).

    Raises:
        ConversionError: a tensor needed to read a size is missing.
    """
    t = src.tensors
    hp: dict[str, Any] = {}
    if any(k in t for k in ("r_emb", "r_bias")) or any(k.endswith("dec_attn.r_emb") for k in t):
        bad = next(k for k in t if k.endswith(("r_emb", "r_bias")))
        raise ConversionError(
            f"tensor {src.name(bad)!r}: this is a Transformer-XL with attn_type != 0 (learnable relative or "
            "absolute positions), which crtn does not support (attn_type=0 only)"
        )
    if "out_layer.weight" in t:
        raise ConversionError(
            f"tensor {src.name('out_layer.weight')!r}: sample_softmax > 0 (sampled softmax) is not supported"
        )
    emb0 = _require(src, "word_emb.emb_layers.0.weight")
    n_emb = 1
    while f"word_emb.emb_layers.{n_emb}.weight" in t:
        n_emb += 1
    hp["d_embed"] = int(emb0.shape[1])
    if n_emb == 1:
        hp["div_val"] = 1
        hp["n_token"] = int(emb0.shape[0])
        n_clusters = int(t["crit.cluster_weight"].shape[0]) if "crit.cluster_weight" in t else 0
        if n_clusters == 0:
            hp["cutoffs"] = []
    else:
        sizes = [int(t[f"word_emb.emb_layers.{i}.weight"].shape[0]) for i in range(n_emb)]
        d1 = int(t["word_emb.emb_layers.1.weight"].shape[1])
        hp["div_val"] = max(1, hp["d_embed"] // max(d1, 1))
        hp["cutoffs"] = [sum(sizes[: i + 1]) for i in range(n_emb - 1)]
        hp["n_token"] = sum(sizes)
    layer_ids = {int(m.group(1)) for k in t if (m := _LAYER_RE.match(k))}
    hp["n_layer"] = max(layer_ids) + 1 if layer_ids else 0
    o_net = _require(src, "layers.0.dec_attn.o_net.weight")
    hp["d_model"] = int(o_net.shape[0])
    if n_emb == 1 and "word_emb.emb_projs.0" in t and hp["d_embed"] == hp["d_model"] and "cutoffs" in hp:
        hp["div_val"] = 2  # one cluster with a projection of equal width: only div_val > 1 builds it
    hp["d_inner"] = int(_require(src, "layers.0.pos_ff.CoreNet.0.weight").shape[0])
    per_layer = [t.get(f"layers.{i}.dec_attn.r_w_bias") for i in range(hp["n_layer"])]
    if "r_w_bias" in t:
        bias = t["r_w_bias"]
        hp["untie_r"] = False
    elif per_layer and all(b is not None for b in per_layer):
        bias = per_layer[0]
        hp["untie_r"] = not (len(per_layer) > 1 and all(torch.equal(b, bias) for b in per_layer))
    else:
        bias = _require(src, "r_w_bias")
    hp["n_head"], hp["d_head"] = int(bias.shape[0]), int(bias.shape[1])

    n_out = n_emb if hp["div_val"] > 1 else 1
    tied = []
    for i in range(n_out):
        out_w, emb_w = t.get(f"crit.out_layers.{i}.weight"), t.get(f"word_emb.emb_layers.{i}.weight")
        tied.append(out_w is None or (emb_w is not None and _same(out_w, emb_w)))
    hp["tie_weight"] = all(tied)
    n_clusters = int(t["crit.cluster_weight"].shape[0]) if "crit.cluster_weight" in t else 0
    tie_projs = []
    for i in range(n_clusters + 1):
        proj = t.get(f"crit.out_projs.{i}")
        emb_proj = t.get("word_emb.emb_projs.0" if hp["div_val"] == 1 else f"word_emb.emb_projs.{i}")
        if emb_proj is None:
            tie_projs.append(False)
        else:
            tie_projs.append(proj is None or _same(proj, emb_proj))
    hp["tie_projs"] = tie_projs
    return hp


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def resolve_hparams(
    src: Source, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int, list[str]]:
    """The converted model's config: defaults < shapes < the source's config < overrides.

    Returns:
        (model config dict with ``name="txl"`` and every ModelConfig key, n_token,
        keys whose value was assumed rather than known).

    Raises:
        ConversionError: ``cutoffs`` needed but not determinable, vocabulary sizes disagree.
    """
    from crtn.config import train_config

    inferred = infer_hparams(src)
    n_token = inferred.pop("n_token")
    if src.n_token is not None and src.n_token != n_token:
        key = "word_emb.emb_layers.0.weight"
        raise ConversionError(
            f"tensor {src.name(key)!r}: the embeddings hold {n_token} symbols but the source says "
            f"vocab_size/n_token={src.n_token}"
        )
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    known = {**inferred, **src.hparams, **given}
    # the schema's defaults; mem_len follows tgt_len (known or default), as on the command line
    schema = train_config({"model.tgt_len": known["tgt_len"]} if "tgt_len" in known else {})
    defaults = OmegaConf.to_container(schema.model, resolve=True)
    cfg = {**defaults, **known, "name": "txl"}
    assumed = [k for k in NOT_INFERABLE if k not in src.hparams and k not in given]
    if "cutoffs" not in inferred and "cutoffs" not in src.hparams and "cutoffs" not in given:
        c = int(src.tensors["crit.cluster_weight"].shape[0])
        raise ConversionError(
            f"tensor {src.name('crit.cluster_weight')!r}: {c} tail clusters with div_val=1 share one output "
            f"layer, so the cutoffs cannot be read off the shapes; pass model.cutoffs=[...] ({c} values)"
        )
    cfg["cutoffs"] = [int(c) for c in cfg["cutoffs"]]
    if cfg["d_embed"] == cfg["d_model"]:
        cfg["d_embed"] = None
    if cfg["tie_projs"] is not None:
        cfg["tie_projs"] = [bool(x) for x in cfg["tie_projs"]]
        if len(cfg["tie_projs"]) != len(cfg["cutoffs"]) + 1:
            raise ConversionError(
                f"tie_projs={cfg['tie_projs']} needs len(cutoffs)+1={len(cfg['cutoffs']) + 1} entries "
                f"(cutoffs={cfg['cutoffs']})"
            )
    return cfg, n_token, assumed


# ============================================================================ tensors
def convert_tensors(src: Source, cfg: dict[str, Any], n_token: int) -> dict[str, torch.Tensor]:
    """Map the source's tensors onto the crtn Transformer-XL that ``cfg`` describes.

    Returns:
        crtn state dict (every key of ``TransformerLM.state_dict()``, tied entries filled).

    Raises:
        ConversionError: unknown tensor, missing tensor, shape mismatch, inconsistent tying
            or shared biases, a non-standard ``pos_emb.inv_freq`` -- naming the tensor.
    """
    from omegaconf import OmegaConf

    from crtn.config import ConfigError, ModelConfig, validate_model
    from crtn.model.transformer import TransformerLM

    mcfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
    try:
        validate_model(mcfg)
        model = TransformerLM(n_token, mcfg)
    except (ConfigError, ValueError) as e:
        raise ConversionError(f"the converted config is invalid: {_first_line(e)}") from None
    expected = model.state_dict()
    t = dict(src.tensors)

    # buffers of the release/HF that crtn recomputes: the sinusoid frequencies
    if "pos_emb.inv_freq" in t:
        inv = t.pop("pos_emb.inv_freq")
        d = mcfg.d_model
        ref = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
        if inv.shape != ref.shape:
            raise ConversionError(
                f"tensor {src.name('pos_emb.inv_freq')!r} has shape {tuple(inv.shape)}, expected "
                f"{tuple(ref.shape)} for d_model={d}"
            )
        if not torch.allclose(inv.double(), ref, rtol=1e-5, atol=0):
            raise ConversionError(
                f"tensor {src.name('pos_emb.inv_freq')!r} is not the standard sinusoid 1/10000^(2i/d_model); "
                "crtn cannot represent other positional frequencies"
            )

    # shared relative biases u, v: copies under layer names (HF registers them per layer too)
    if not mcfg.untie_r:
        for name in ("r_w_bias", "r_r_bias"):
            copies = [f"layers.{i}.dec_attn.{name}" for i in range(mcfg.n_layer)]
            present = [c for c in copies if c in t]
            if name not in t and present:
                t[name] = t[present[0]]
            for c in present:
                if not _same(t[c], t[name]):
                    raise ConversionError(
                        f"tensor {src.name(c)!r} differs from {src.name(name)!r} but untie_r=false "
                        "(one shared pair of biases); set model.untie_r=true"
                    )
                del t[c]

    # tied output weights and projections: fill or check
    n_out = len(model.crit.out_layers)
    for i in range(n_out if mcfg.tie_weight else 0):
        out_k, emb_k = f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight"
        if out_k not in t and emb_k in t:
            t[out_k] = t[emb_k]
        elif out_k in t and emb_k in t and not _same(t[out_k], t[emb_k]):
            raise ConversionError(
                f"tensor {src.name(out_k)!r} differs from {src.name(emb_k)!r} but tie_weight=true "
                "(tie_word_embeddings); set model.tie_weight=false"
            )
    for i, tie in enumerate(model.tie_projs):
        out_k = f"crit.out_projs.{i}"
        if not tie or out_k not in expected:
            continue
        emb_k = "word_emb.emb_projs.0" if mcfg.div_val == 1 else f"word_emb.emb_projs.{i}"
        if out_k not in t and emb_k in t:
            t[out_k] = t[emb_k]
        elif out_k in t and emb_k in t and not _same(t[out_k], t[emb_k]):
            raise ConversionError(
                f"tensor {src.name(out_k)!r} differs from {src.name(emb_k)!r} but tie_projs[{i}]=true; "
                f"set model.tie_projs (now {list(model.tie_projs)})"
            )

    for key in t:
        if key not in expected:
            raise ConversionError(
                f"unknown tensor {src.name(key)!r} in {str(src.path)!r}: no such parameter in a Transformer-XL "
                f"with {_describe(mcfg, n_token)}"
            )
    for key, ref in expected.items():
        if key not in t:
            raise ConversionError(
                f"missing tensor {src.name(key)!r} in {str(src.path)!r} (needed by a Transformer-XL with "
                f"{_describe(mcfg, n_token)})"
            )
        if tuple(t[key].shape) != tuple(ref.shape):
            raise ConversionError(
                f"tensor {src.name(key)!r} has shape {tuple(t[key].shape)}, expected {tuple(ref.shape)} for "
                f"{_describe(mcfg, n_token)}"
            )
    dtypes = {v.dtype for v in t.values() if v.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    model = model.to(dtype)
    model.load_state_dict(t, strict=True)
    return {k: v.detach() for k, v in model.state_dict().items()}  # tied entries share storage


def _describe(m: Any, n_token: int) -> str:
    return (
        f"n_layer={m.n_layer}, n_head={m.n_head}, d_head={m.d_head}, d_model={m.d_model}, "
        f"d_inner={m.d_inner}, d_embed={m.d_embed or m.d_model}, n_token={n_token}, "
        f"cutoffs={list(m.cutoffs)}, div_val={m.div_val}, untie_r={m.untie_r}"
    )


# ============================================================================ vocabulary
def read_vocab(path: str | Path) -> list[str]:
    """A vocabulary file, symbols in id order: a JSON list of strings (``*.json``; any symbol,
    e.g. the space and newline of character-level corpora), else one symbol per line, its first
    whitespace-separated field (the release's ``Vocab._build_from_file`` format; trailing counts
    are ignored).

    Raises:
        ConversionError: missing or malformed file, an empty line, a repeated symbol.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"vocab={str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            symbols = json.loads(text)
        except ValueError as e:
            raise ConversionError(f"vocab={str(path)!r} is not valid JSON ({_first_line(e)})") from None
        if not isinstance(symbols, list) or not all(isinstance(x, str) for x in symbols):
            raise ConversionError(f"vocab={str(path)!r}: expected a JSON list of strings")
    else:
        symbols = []
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields:
                raise ConversionError(
                    f"vocab={str(path)!r}: line {n} is empty (one symbol per line expected)"
                )
            symbols.append(fields[0])
    seen: dict[str, int] = {}
    for i, s in enumerate(symbols):
        if s in seen:
            raise ConversionError(
                f"vocab={str(path)!r}: symbol {s!r} appears on lines {seen[s] + 1} and {i + 1}"
            )
        seen[s] = i
    return symbols


# ============================================================================ entry points
def convert(
    src: str | Path,
    out: str | Path,
    vocab: str | Path | None = None,
    data: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    fmt: str = "auto",
    trust_pickle: bool = False,
) -> dict[str, Any]:
    """Convert Transformer-XL weights into ``out/model.pt`` and ``out/model/converted.yaml``.

    Args:
        src: a Hugging Face folder or a release checkpoint file.
        out: output folder (created).
        vocab: vocabulary file (one symbol per line in id order), or None.
        data: a ``data`` config node (dict) for the checkpoint's config, or None (default data).
        model: ``ModelConfig`` overrides (None values are ignored).
        fmt: ``auto``, ``hf`` or ``release``.
        trust_pickle: allow unpickling a whole release module (runs code from the file).

    Returns:
        ``{"checkpoint": path, "model_yaml": path, "config": model dict, "n_token": int,
        "assumed": [...], "kind": "hf" | "release"}``.

    Raises:
        ConversionError: see the module docstring.
    """
    from omegaconf import OmegaConf

    from crtn.checkpoint import save_checkpoint
    from crtn.config import TrainAppConfig

    source = read_source(src, fmt, trust_pickle)
    cfg, n_token, assumed = resolve_hparams(source, model)
    state = convert_tensors(source, cfg, n_token)

    symbols = None
    if vocab is not None:
        symbols = read_vocab(vocab)
        if len(symbols) != n_token:
            raise ConversionError(
                f"vocab={str(vocab)!r} has {len(symbols)} symbols but the model has {n_token}"
            )
    train_cfg = OmegaConf.structured(TrainAppConfig)
    train_cfg.model = OmegaConf.merge(train_cfg.model, cfg)
    if data is not None:
        train_cfg.data = OmegaConf.merge(train_cfg.data, data)
        _check_corpus(train_cfg.data, n_token, symbols)
    config = OmegaConf.to_container(train_cfg, resolve=True)

    out = Path(out)
    ckpt_path = out / "model.pt"
    save_checkpoint(
        ckpt_path,
        {
            "config": config,
            "vocab": symbols,
            "model": state,
            "converted_from": {"kind": source.kind, "path": str(Path(src).resolve())},
        },
    )
    yaml_path = out / "model" / "converted.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Transformer-XL converted by crtn-convert from {source.kind} weights {str(Path(src).resolve())}.\n"
        f"# Fine-tune CRTN from it: crtn-train --config-dir {out} model=converted model.name=crtn \\\n"
        f"#   init_from={ckpt_path} data=...\n"
    )
    yaml_path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(config["model"])))
    n_params = sum(v.numel() for v in {v.data_ptr(): v for v in state.values()}.values())  # tied once
    log.info(
        "converted %s weights %s: %s, %s tensors (%s values); wrote %s and %s",
        source.kind,
        src,
        _describe(train_cfg.model, n_token),
        len(state),
        f"{n_params:,}",
        ckpt_path,
        yaml_path,
    )
    if assumed:
        log.warning(
            "not given by the source, assumed: %s (override with model.KEY=VALUE)",
            ", ".join(f"{k}={cfg[k]}" for k in assumed),
        )
    if symbols is None:
        log.info("no vocab=FILE given: the checkpoint has no vocabulary (crtn uses the corpus' own)")
    return {
        "checkpoint": ckpt_path,
        "model_yaml": yaml_path,
        "config": cfg,
        "n_token": n_token,
        "assumed": assumed,
        "kind": source.kind,
    }


def _check_corpus(data: Any, n_token: int, symbols: list[str] | None) -> None:
    """The corpus of ``data`` must match the model's vocabulary (size, and symbols when known)."""
    from crtn.data import load_corpus

    corpus = load_corpus(data)
    vocab = corpus.vocab.idx2sym
    if len(vocab) != n_token:
        raise ConversionError(
            f"data.name={data.name}: the corpus has {len(vocab)} symbols but the model has {n_token}"
        )
    if symbols is not None and symbols != vocab:
        i = next(i for i, (a, b) in enumerate(zip(symbols, vocab)) if a != b)
        raise ConversionError(
            f"vocab file and data.name={data.name} disagree at id {i}: {symbols[i]!r} vs {vocab[i]!r} "
            "(the ids must follow the corpus' vocabulary order)"
        )


def run_convert(cfg: Any) -> dict[str, Any]:
    """``crtn-convert``: convert ``cfg.src`` into ``cfg.out`` (see :func:`convert`)."""
    from omegaconf import OmegaConf

    for key in ("src", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise ConversionError(f"{key}=... is required: crtn-convert src=HF_DIR_OR_MODEL_PT out=OUT_DIR")
    overrides = OmegaConf.to_container(cfg.model, resolve=True)
    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") is not None else None
    result = convert(cfg.src, cfg.out, cfg.vocab, data, overrides, cfg.format, cfg.trust_pickle)
    out = Path(cfg.out)
    print(f"wrote {result['checkpoint']} and {result['model_yaml']}", flush=True)
    print(
        f"fine-tune CRTN from it: crtn-train --config-dir {out} model=converted model.name=crtn "
        f"init_from={result['checkpoint']} data=...",
        flush=True,
    )
    return result


def _task(cfg: Any) -> dict[str, Any]:
    from crtn.train import report_user_errors

    with report_user_errors("crtn-convert"):
        return run_convert(cfg)


def main() -> None:
    """Console entry point of ``crtn-convert`` (a Hydra app, config ``conf/convert.yaml``)."""
    import hydra

    register_configs()
    hydra.main(config_path="pkg://crtn.conf", config_name="convert", version_base="1.3")(_task)()


if __name__ == "__main__":
    main()
