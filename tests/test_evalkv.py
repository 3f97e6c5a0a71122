"""Evaluation with projected keys and values kept (crtn/model/evalkv.py) equals re-projecting them.

Two copies of the same float64 model run the same streams for several segments (memory full,
cache filled and evicting, so kept projections are reused many times): one keeps the memory's
keys and values (the default at evaluation), the other re-projects them every step
(``eval_kv = False``, the training path). Per-token NLL must agree to 1e-10.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import tiny_model

V = 11
STEPS = 8


def _run(model, tokens, steps):
    L = model.tgt_len
    state, nlls = None, []
    with torch.no_grad():
        for t in range(steps):
            x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
            out = model(x, y, state)
            state = out.state
            nlls.append(out.nll)
    return torch.stack(nlls), state


CASES = [
    {"model.name": "txl"},
    {"model.name": "txl", "model.mem_len": 7, "model.pre_lnorm": True},
    {"model.name": "crtn"},
    {"model.name": "crtn", "summary.name": "token_max"},
    {"model.name": "crtn", "model.pre_lnorm": True, "cache.pos": "real"},
    {"model.name": "crtn", "model.n_layer": 3, "cache.layers": 1, "summary.name": "token_max"},
    {"model.name": "crtn", "model.mem_len": 0, "query.strategy": "last_l", "summary.name": "identity"},
    {"model.name": "crtn", "cache.weighted": False, "model.mem_len": 6},
    # selection inside attention: a selection per layer
    {"model.name": "crtn", "query.strategy": "gate", "summary.name": "mean"},
    {"model.name": "crtn", "query.strategy": "gate", "summary.name": "token_max", "summary.ngram": 2},
    {"model.name": "crtn", "query.strategy": "gate", "model.pre_lnorm": True, "cache.pos": "real"},
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_kept_projections_equal_reprojection(overrides):
    torch.manual_seed(0)
    kept = tiny_model(V, **overrides)
    plain = copy.deepcopy(kept)
    plain.eval_kv = False
    tokens = torch.randint(0, V, (2, STEPS * kept.tgt_len + 1))
    nll_kept, state = _run(kept, tokens, STEPS)
    nll_plain, plain_state = _run(plain, tokens, STEPS)
    torch.testing.assert_close(nll_kept, nll_plain, rtol=0, atol=1e-10)
    # the kept path was taken: projections of the memory
    if kept.mem_len > 0:
        assert state.mem_kv is not None and plain_state.mem_kv is None
        assert state.mem_kv[0].shape[1] == state.mem.shape[2]
    if kept.has_cache:
        assert state.cache.n_insert > kept.n_slot


def test_training_does_not_keep_projections():
    model = tiny_model(V, **{"model.name": "crtn"}).train()
    tokens = torch.randint(0, V, (2, 4 * model.tgt_len + 1))
    L, state = model.tgt_len, None
    for _ in range(6):
        out = model(tokens[:, :L], tokens[:, 1 : L + 1], state)
        state = out.state
    assert state.mem_kv is None
