"""CRTN against the naive per-token float64 references (tests/reference.py, tests/reference_gate.py)
over configurations drawn from the whole option space (tests/config_space.py), wherever the
references implement them: every (query strategy, summary) pair of the registries, every other
option sampled, except what the references leave out, held at a value they implement (the
cache's storage dtype and its products' dtype: the states' own; ``same_length``: off, as their
CRTN passes have it; the faiss backend: its scores are float32 and approximate). Per-token NLL
must agree to 1e-9 in float64 (docs/method.md §3 asks for 1e-5), segment by segment past the
cache's first eviction.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.config_space import Tally, V, configs
from tests.reference import NaiveCRTN
from tests.reference_gate import NaiveGate
from tests.test_causality_property import CASES, PROFILE, _describe, segments_to_fill, tiny

ATOL = 1e-9
#: what the references do not implement, held at a value they do (module docstring)
SUPPORTED = {
    "cache.dtype": None,
    "cache.product_dtype": None,
    "model.same_length": False,
    "cache.backend": "torch",
}
PER_CASE = 2


def check_against_reference(spec, seed: int) -> int:
    """Two streams through the model (evaluation mode) and through one reference each; returns
    the segments that read the cache."""
    model = tiny(spec, seed).eval()
    L = model.tgt_len
    steps = segments_to_fill(model) + 1
    tokens = torch.randint(0, V, (2, steps * L + 1), generator=torch.Generator().manual_seed(seed))
    naive = NaiveGate if model.query.in_attention else NaiveCRTN
    refs = [naive(model) for _ in range(2)]
    state, retrieved = None, 0
    with torch.no_grad():
        for t in range(steps):
            x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
            out = model(x, y, state)
            state = out.state
            retrieved += out.selection is not None
            for b, ref in enumerate(refs):
                nll, _ = ref.step(x[b], y[b], t * L)
                torch.testing.assert_close(
                    out.nll[b],
                    nll,
                    rtol=0,
                    atol=ATOL,
                    msg=lambda m, t=t, b=b: f"segment {t}, stream {b}, {_describe(model.spec)}: {m}",
                )
    return retrieved


CACHED = [c for c in CASES if c["model.name"] == "crtn"]


@pytest.mark.parametrize("fixed", CACHED, ids=[f"{c['query.strategy']}-{c['summary.name']}" for c in CACHED])
def test_sampled_configurations_match_the_naive_reference(fixed):
    tally = Tally()

    @settings(max_examples=PER_CASE, **PROFILE)
    @given(configs(tally, fixed={**fixed, **SUPPORTED}), st.integers(0, 2**16))
    def check(drawn, seed):
        tally.counts["retrieved"] += check_against_reference(drawn[0], seed)

    check()
    assert tally.counts["accepted"] >= PER_CASE, tally.counts
    assert tally.counts["retrieved"] > 0, "no sampled configuration read its cache"
