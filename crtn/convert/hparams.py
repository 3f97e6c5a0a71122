"""The converted model's hyper-parameters: read off the tensor shapes, then completed from the
source's config and the command line (``crtn-convert``)."""

from __future__ import annotations

import re
from typing import Any

import torch
from omegaconf import OmegaConf

from crtn.config import train_config
from crtn.convert.source import ConversionError, Source, require, same

#: ModelSpec keys that neither the shapes nor a state_dict determine.
NOT_INFERABLE = ("tgt_len", "mem_len", "clamp_len", "same_length", "pre_lnorm", "dropout", "dropatt")

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def infer_hparams(src: Source) -> dict[str, Any]:
    """Model sizes and tying read off the tensor shapes (release names).

    Returns ModelSpec keys plus ``n_token``; ``cutoffs`` is left out when it cannot be
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
    emb0 = require(src, "word_emb.emb_layers.0.weight")
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
    o_net = require(src, "layers.0.dec_attn.o_net.weight")
    hp["d_model"] = int(o_net.shape[0])
    if n_emb == 1 and "word_emb.emb_projs.0" in t and hp["d_embed"] == hp["d_model"] and "cutoffs" in hp:
        hp["div_val"] = 2  # one cluster with a projection of equal width: only div_val > 1 builds it
    hp["d_inner"] = int(require(src, "layers.0.pos_ff.CoreNet.0.weight").shape[0])
    per_layer = [t.get(f"layers.{i}.dec_attn.r_w_bias") for i in range(hp["n_layer"])]
    if "r_w_bias" in t:
        bias = t["r_w_bias"]
        hp["untie_r"] = False
    elif per_layer and all(b is not None for b in per_layer):
        bias = per_layer[0]
        hp["untie_r"] = not (len(per_layer) > 1 and all(torch.equal(b, bias) for b in per_layer))
    else:
        bias = require(src, "r_w_bias")
    hp["n_head"], hp["d_head"] = int(bias.shape[0]), int(bias.shape[1])

    n_out = n_emb if hp["div_val"] > 1 else 1
    tied = []
    for i in range(n_out):
        out_w, emb_w = t.get(f"crit.out_layers.{i}.weight"), t.get(f"word_emb.emb_layers.{i}.weight")
        tied.append(out_w is None or (emb_w is not None and same(out_w, emb_w)))
    hp["tie_weight"] = all(tied)
    n_clusters = int(t["crit.cluster_weight"].shape[0]) if "crit.cluster_weight" in t else 0
    tie_projs = []
    for i in range(n_clusters + 1):
        proj = t.get(f"crit.out_projs.{i}")
        emb_proj = t.get("word_emb.emb_projs.0" if hp["div_val"] == 1 else f"word_emb.emb_projs.{i}")
        if emb_proj is None:
            tie_projs.append(False)
        else:
            tie_projs.append(proj is None or same(proj, emb_proj))
    hp["tie_projs"] = tie_projs
    return hp


def resolve_hparams(
    src: Source, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int, list[str]]:
    """The converted model's config: defaults < shapes < the source's config < overrides.

    Returns:
        (model config dict with ``name="txl"`` and every ModelSpec key, n_token,
        keys whose value was assumed rather than known).

    Raises:
        ConversionError: ``cutoffs`` needed but not determinable, vocabulary sizes disagree.
    """
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
