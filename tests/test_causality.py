"""No prediction depends on a later token or on another stream (docs/method.md §3).

This check needs no reference implementation, so it also guards the references: change one
input token of one stream and run the streams again, segment by segment with memory and cache
carried as in evaluation. The prediction at position j (the top-layer state, from which the
next-token distribution follows) reads the inputs up to j, so every prediction before the
changed position must stay exactly as it was, and so must every prediction of the other
stream. The changed positions lie in the last segments, after the cache has filled and started
to evict, so the retrieval (its query, the slots' keys and the selected values) is part of what
is checked, for every query x summary pairing, selection inside attention, the lookup of the
preceding tokens and the exact n-gram
retrieval of the character-level results (cache.key_layer=0, cosine scores, one slot at full
weight).
"""

from __future__ import annotations

import pytest
import torch

from crtn.model import valid_pairs
from tests.helpers import LOOKUP, tiny_model

V = 11
STEPS = 8  # segments of 3 tokens; 3 slots of 3 tokens fill by the fifth segment

PAIRS = {f"{q}-{s}": {"query.strategy": q, "summary.name": s} for q, s in valid_pairs()}
OTHERS = {
    "exact_ngram": {
        "cache.key_layer": 0,
        "summary.name": "token_max",
        "summary.ngram": 3,
        "summary.cosine": True,
        "cache.top_k": 1,
        "cache.alpha_norm": "topk",
    },
    "gate_layers_1": {"query.strategy": "gate", "summary.name": "token_max", "cache.layers": 1},
    "gate_ngram2": {"query.strategy": "gate", "summary.name": "token_max", "summary.ngram": 2},
    "lookup": {**LOOKUP, "summary.ngram": 1, "query.max_match": 3},
    "mem0": {"model.mem_len": 0},
    "alpha_original": {"cache.alpha_norm": "original"},
}
CONFIGS = {**PAIRS, **OTHERS}


def stream_states(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Top-layer states [B, STEPS * L, d] of the inputs ``tokens`` [B, STEPS * L], one segment at a time."""
    L = model.tgt_len
    state, hidden = None, []
    with torch.no_grad():
        for t in range(STEPS):
            out = model(tokens[:, t * L : (t + 1) * L], None, state)
            state = out.state
            hidden.append(out.hidden)
    return torch.cat(hidden, dim=1)


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_a_changed_token_changes_no_earlier_prediction_and_no_other_stream(config):
    torch.manual_seed(0)
    model = tiny_model(V, **{"model.name": "crtn", **config})
    L = model.tgt_len
    tokens = torch.randint(0, V, (2, STEPS * L))
    base = stream_states(model, tokens)
    for p in range((STEPS - 3) * L, STEPS * L):  # the last three segments
        changed = tokens.clone()
        changed[0, p] = (changed[0, p] + 1) % V
        hidden = stream_states(model, changed)
        assert torch.equal(hidden[0, :p], base[0, :p]), f"a prediction before position {p} moved"
        assert torch.equal(hidden[1], base[1]), f"changing stream 0 at {p} moved stream 1"
        assert not torch.equal(hidden[0, p], base[0, p])  # the change itself is seen
