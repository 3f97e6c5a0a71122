"""Small builders shared by the tests."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from crtn.config import TrainAppConfig
from crtn.model import TransformerLM, build_model


def tiny_cfg(**overrides: Any):
    """A ``crtn-train`` config with a tiny model; ``overrides`` are dotted keys, e.g. ``model.n_layer=2``."""
    cfg = OmegaConf.structured(TrainAppConfig)
    base = {
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.d_model": 8,
        "model.d_head": 4,
        "model.d_inner": 16,
        "model.tgt_len": 3,
        "model.mem_len": 3,
        "model.dropout": 0.0,
        "model.dropatt": 0.0,
        "model.init_std": 0.3,
        "model.proj_init_std": 0.3,
        "cache.n_slot": 3,
        "cache.top_k": 2,
    }
    base.update(overrides)
    for key, value in base.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def tiny_model(n_token: int = 11, double: bool = True, **overrides: Any) -> TransformerLM:
    """A tiny model in eval mode (float64 by default), with non-trivial LayerNorm and bias values."""
    import torch

    model = build_model(tiny_cfg(**overrides), n_token)
    if double:
        model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()
