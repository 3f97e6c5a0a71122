"""Reading a Hugging Face ``TransfoXLLMHeadModel`` folder (transformers <= 4.35) for ``crtn-convert``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from crtn.convert.source import ConversionError, Source, check_supported, first_line, load_weights_file
from crtn.model.adaptive import flip_cluster_order

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

#: config.json key -> crtn ``ModelSpec`` key (copied as they are).
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
        raise ConversionError(f"{str(cfg_path)!r} cannot be read ({first_line(e)})") from None
    model_type = config.get("model_type")
    if model_type not in (None, "transfo-xl"):
        raise ConversionError(f"{str(cfg_path)!r}: model_type={model_type!r}, expected 'transfo-xl'")
    archs = config.get("architectures") or []
    if archs and "TransfoXLLMHeadModel" not in archs:
        raise ConversionError(
            f"{str(cfg_path)!r}: architectures={archs}; only TransfoXLLMHeadModel (with its softmax) converts"
        )
    c = {**HF_DEFAULTS, **config}
    check_supported(c.get("attn_type"), c.get("sample_softmax"), str(cfg_path))

    raw: dict[str, torch.Tensor] = {}
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            for shard in shards:
                raw.update(load_weights_file(folder / shard))
            break
    else:
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (folder / name).is_file():
                raw = load_weights_file(folder / name)
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
    return Source(
        kind="hf", path=folder, tensors=tensors, names=names, hparams=hp, n_token=int(c["vocab_size"])
    )
