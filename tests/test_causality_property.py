"""No prediction depends on a later token or on another stream, over configurations drawn from
the whole option space (docs/method.md §3; the sampler: tests/config_space.py).

For every sampled configuration a tiny float64 model runs a batch of streams segment by
segment, with memory and cache carried as in evaluation, long enough for the memory to fill
and the cache to fill and evict; then, in the last :data:`FLIPPED` segments of one randomly
chosen stream, every position in turn gets another token, each changed copy run as an extra
stream of the same batch. The prediction at position p (the top-layer state and the
next-token log-probabilities) reads the inputs up to p only, so in each copy everything
before its changed position must equal the original stream's, and the original streams must
not move when the copies join the batch. Checked in evaluation mode, in training mode (every
dropout rate 0) and in the evaluation twin of ``crtn-eval`` with a larger cache and memory
(``eval.n_slot``, ``eval.mem_len``: :func:`crtn.model.evaluation_spec`, :func:`crtn.model.with_spec`),
and no output may be NaN or infinite.

The same sampler drives the comparison with the naive per-token float64 references
(tests/reference.py, tests/reference_gate.py) wherever they implement the configuration.
"""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crtn.model import (
    Spec,
    build_model,
    evaluation_spec,
    valid_pairs,
    with_spec,
)
from tests.config_space import OVERRIDES, Tally, Underivable, V, configs, derived, field_strategy, schema_keys

FLIPPED = 2  # segments at the end whose every position is changed
ATOL = 1e-10  # float64: the same computation in another batch row may round differently
PROFILE = dict(
    derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=False
)
#: every (query strategy, summary) pair of the registries, the lookup of the preceding tokens
#: (which retrieves one row: k 1), then the models without a cache
LOOKUP = {"query.strategy": "lookup", "summary.name": "token_max", "cache.top_k": 1}
CASES = [{"model.name": "crtn", "query.strategy": q, "summary.name": s} for q, s in valid_pairs()] + [
    {"model.name": "crtn", **LOOKUP},
    *({"model.name": name} for name in ("txl", "vanilla")),
]
PER_CASE = 4  # sampled configurations per case
PER_CASE_TOKEN_MAX = 12  # token_max has four options of its own (ngram, shift, d_key, cosine)


def tiny(spec, seed: int) -> torch.nn.Module:
    """The model of ``spec`` in float64 with non-trivial biases and LayerNorm gains."""
    torch.manual_seed(seed)
    model = build_model(spec, V).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def segments_to_fill(model) -> int:
    """Segments after which the memory is full and the cache has evicted once."""
    spec, L = model.spec, model.tgt_len
    slots = spec.cache.n_slot if model.has_cache else 0
    return spec.model.mem_len // L + slots + 1


def run(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-layer states [B, T, d] and log-probabilities [B, T, V] of ``tokens`` [B, T], segment by segment."""
    L, state, hidden = model.tgt_len, None, []
    with torch.no_grad():
        for t in range(0, tokens.shape[1], L):
            out = model(tokens[:, t : t + L], None, state)
            state = out.state
            hidden.append(out.hidden)
    h = torch.cat(hidden, 1)
    return h, model.crit.log_prob(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)


def check_causal(model, tokens: torch.Tensor, stream: int, first: int, label: str) -> None:
    """Change ``tokens[stream, p]`` for every p >= ``first``, each change a copy appended to the batch."""
    B, T = tokens.shape
    positions = list(range(first, T))
    copies = tokens[stream].repeat(len(positions), 1)
    for i, p in enumerate(positions):
        copies[i, p] = (copies[i, p] + 1 + (p * 7 + stream) % (V - 1)) % V
    alone = run(model, tokens)
    together = run(model, torch.cat([tokens, copies]))
    for a, b in zip(alone, together):
        assert torch.isfinite(b).all(), f"{label}: an output is NaN or infinite"
        torch.testing.assert_close(
            b[:B],
            a,
            rtol=0,
            atol=ATOL,
            msg=lambda m: f"{label}: a stream moved when changed copies joined: {m}",
        )
    h, logp = together
    for i, p in enumerate(positions):
        for name, x in (("state", h), ("log-probability", logp)):
            torch.testing.assert_close(
                x[B + i, :p],
                x[stream, :p],
                rtol=0,
                atol=ATOL,
                msg=lambda m, p=p, name=name: f"{label}: changing position {p} moved an earlier {name}: {m}",
            )
        assert (h[B + i, p] - h[stream, p]).abs().max() > 1e-6, f"{label}: the change at {p} is not seen"


def check_configuration(
    spec, seed: int, n_stream: int, stream: int, extra_slots: int, extra_mem: int
) -> None:
    """The three checks of the module docstring for one resolved ``spec``."""
    model = tiny(spec, seed)
    L = model.tgt_len
    ev = SimpleNamespace(n_slot=spec.cache.n_slot + extra_slots, mem_len=spec.model.mem_len + extra_mem * L)
    twin = with_spec(model, evaluation_spec(model.spec, ev))
    g = torch.Generator().manual_seed(seed)
    for label, m in (("eval", model.eval()), ("train", model.train()), ("eval twin", twin.eval())):
        steps = segments_to_fill(m) + FLIPPED
        tokens = torch.randint(0, V, (n_stream, steps * L), generator=g)
        check_causal(m, tokens, stream, (steps - FLIPPED) * L, f"{label} {_describe(m.spec)}")


def _describe(spec) -> str:
    """The dotted values of ``spec`` that differ from the schema's defaults."""
    default = Spec()
    return " ".join(
        f"{g}.{f.name}={getattr(getattr(spec, g), f.name)}"
        for g in ("model", "cache", "query", "summary")
        for f in fields(getattr(spec, g))
        if getattr(getattr(spec, g), f.name) != getattr(getattr(default, g), f.name)
    )


@st.composite
def _runs(draw, fixed: dict, tally: Tally):
    spec, _ = draw(configs(tally, fixed=fixed))
    n_stream = draw(st.integers(1, 3))
    return spec, {
        "seed": draw(st.integers(0, 2**16)),
        "n_stream": n_stream,
        "stream": draw(st.integers(0, n_stream - 1)),
        "extra_slots": draw(st.integers(1, 2)),
        "extra_mem": draw(st.integers(0, 1)),
    }


@pytest.mark.parametrize("fixed", CASES, ids=["-".join(map(str, c.values())) for c in CASES])
def test_no_prediction_reads_a_later_token_or_another_stream(fixed):
    tally = Tally()
    n = PER_CASE_TOKEN_MAX if fixed.get("summary.name") == "token_max" else PER_CASE

    @settings(max_examples=n, **PROFILE)
    @given(_runs(fixed, tally))
    def check(drawn):
        spec, args = drawn
        check_configuration(spec, **args)

    check()
    assert tally.counts["accepted"] >= n, tally.counts
    # summary=conv's shape rules refuse about half of the sizes drawn; a quarter accepted is the floor
    assert 4 * tally.counts["accepted"] >= tally.counts["drawn"], f"almost every draw refused: {tally.counts}"


# ------------------------------------------------------------------------------ the sampler itself
def test_every_schema_field_has_a_strategy():
    """Every field of the four spec groups gets a strategy (derived, or an override); a field
    added to the schema without one fails here, naming itself."""
    for key in schema_keys():
        field_strategy(key)  # raises Underivable
    assert not set(OVERRIDES) - set(schema_keys()), "overrides of fields the schema no longer has"


def test_a_field_of_an_underivable_type_fails_loudly():
    with pytest.raises(Underivable, match="model.bogus"):
        derived("model.bogus", float)
    with pytest.raises(Underivable, match="model.bogus"):
        derived("model.bogus", list[int])


def test_the_sampler_covers_the_option_space():
    """300 draws (resolution only, no model): most drawn configurations are accepted, and every
    field with more than one possible value is seen with several, among them the edges the
    causality checks are about."""
    tally, specs = Tally(), []

    @settings(max_examples=300, **PROFILE)
    @given(configs(tally))
    def draw(drawn):
        specs.append(drawn[0])

    draw()
    assert tally.counts["discarded"] < tally.counts["drawn"] // 4, tally.counts
    for key in schema_keys():
        if key not in OVERRIDES or not repr(OVERRIDES[key]).startswith(("just(", "none()")):
            assert len(tally.seen[key]) >= 2, f"{key} only ever took {tally.seen[key]}"
    crtn = [s for s in specs if s.model.name == "crtn"]  # the pairs: CASES, from the registries
    assert any(s.model.mem_len == 0 and s.cache.enabled for s in crtn)
    assert any(s.cache.key_layer == 0 for s in crtn)
    assert any(s.cache.layers is not None and s.cache.layers < s.model.n_layer for s in crtn)
    # a key layer below the first retrieving layer's input, stored in each slot apart
    assert any(
        s.cache.key_layer is not None and s.cache.key_layer < s.model.n_layer - s.cache.layers for s in crtn
    )
