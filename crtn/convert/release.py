"""Reading a checkpoint of the Transformer-XL release (a ``state_dict``, or with ``trust_pickle`` a
whole pickled ``MemTransformerLM``) for ``crtn-convert``."""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from crtn.convert.source import ConversionError, Source, check_supported, first_line

log = logging.getLogger("crtn.convert")


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
        if not isinstance(e, pickle.UnpicklingError) or "Weights only load failed" not in str(e):
            raise ConversionError(f"{str(path)!r} cannot be read as a torch file ({first_line(e)})") from None
        classes = _unsafe_globals(path, e)
        if not classes:  # no class or function named: not a pickle of Python objects at all
            raise ConversionError(f"{str(path)!r} is not a torch file (it does not unpickle)") from None
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
                f"{str(path)!r} needs the Transformer-XL release's code to unpickle ({first_line(e2)}); put "
                "the release's pytorch/ folder (mem_transformer.py, utils/) on PYTHONPATH"
            ) from None
        except Exception as e2:
            raise ConversionError(f"{str(path)!r} cannot be unpickled ({first_line(e2)})") from None
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
    check_supported(getattr(module, "attn_type", 0), getattr(module, "sample_softmax", -1), str(path))
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
    names = {k: k for k in tensors}
    return Source(kind="release", path=path, tensors=tensors, names=names, hparams=hp, n_token=n_token)
