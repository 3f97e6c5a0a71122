"""Models: attention, transformer, cache, query strategies and summaries (SPEC §2-3)."""

from __future__ import annotations

from typing import Any

from crtn.model.cache import RetrievalStats, SegmentCache, Selection
from crtn.model.summary import Summary
from crtn.model.transformer import LMOutput, State, TransformerLM

__all__ = [
    "LMOutput",
    "RetrievalStats",
    "SegmentCache",
    "Selection",
    "State",
    "Summary",
    "TransformerLM",
    "build_model",
]


def build_model(cfg: Any, n_token: int) -> TransformerLM:
    """Build the model a config describes.

    Args:
        cfg: a node with ``model``, ``cache``, ``query`` and ``summary`` children
            (the ``crtn-train`` config or a checkpoint's stored config).
        n_token: vocabulary size.

    Raises:
        ConfigError: invalid values or pairings (see :func:`crtn.config.validate_model`).
    """
    from crtn.config import validate_model

    validate_model(cfg.model, cfg.cache, cfg.query, cfg.summary)
    return TransformerLM(n_token, cfg.model, cfg.cache, cfg.query, cfg.summary)
