"""CRTN against the naive per-token reference (docs/method.md §3, "Efficient main pass").

The model runs B=2 streams for several segments, long enough for the cache to fill,
to hold fewer valid slots than top_k at first, and to evict by FIFO. The reference
(tests/reference.py) runs each stream on its own, building every token's context
[selected slots; memory; segment] explicitly. NLL and the selections (slot stream
positions and alpha) must agree, in float64.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import pytest
import torch

from crtn.errors import ConfigError
from crtn.model import valid_pairs
from tests.helpers import LOOKUP as LOOKUP_MODEL
from tests.helpers import once_per_run, tiny_model, tiny_spec
from tests.reference import NaiveCRTN
from tests.reference_gate import NaiveGate

V = 11
STEPS = 7
PAIR_GRAD_STEPS = 5  # the gradients of test_every_pair_has_the_reference_gradients
ATOL = 1e-9  # docs/method.md §3 asks for 1e-5; float64 agreement is far tighter
GRAD_ATOL = 1e-8  # parameter gradients, float64


def naive_run(model, tokens: torch.Tensor, steps: int, grad: bool | int) -> tuple[list, list[torch.Tensor]]:
    """The naive reference of ``model``'s weights and config over ``tokens`` [B, steps * L + 1], each
    stream on its own: per step and stream (NLL, selections), and with ``grad`` the parameter
    gradients of the summed NLL (each step back-propagated before the next, as in training);
    ``grad`` a number of steps (not a bool): the gradients of the first ``grad`` steps only."""
    L = model.tgt_len
    naive = NaiveGate if model.query.in_attention else NaiveCRTN  # selection inside attention
    refs = [naive(model) for _ in range(tokens.shape[0])]
    params = [p for p in model.parameters() if p.requires_grad]
    g_ref = [torch.zeros_like(p) for p in params]
    per_step = []
    n_grad = steps if grad is True else int(grad)
    for t in range(steps):
        x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
        outs = []
        for b, ref in enumerate(refs):
            with torch.set_grad_enabled(t < n_grad):
                nll_ref, sel_ref = ref.step(x[b], y[b], t * L)
                if t < n_grad:
                    _accumulate(g_ref, nll_ref.sum(), params)
            outs.append((nll_ref.detach(), sel_ref))
        per_step.append(outs)
    return per_step, g_ref


def shared_naive(horizon: int, grad_steps: int) -> Callable:
    """A ``naive`` for :func:`run_both` whose reference covers ``horizon`` steps, back-propagated
    over the first ``grad_steps`` (:func:`naive_run`), computed once per model config, weights and
    tokens in a test session: the values test of a variant (``horizon`` steps, no gradient) and its
    gradients test (``grad_steps`` steps) compare against one reference run, which computes the
    same values with or without autograd (:func:`tests.helpers.once_per_run`: the two tests of a
    variant may land on either pytest-xdist worker)."""

    def naive(model, tokens: torch.Tensor, steps: int, grad: bool) -> tuple[list, list[torch.Tensor]]:
        assert steps == (grad_steps if grad else horizon), (steps, grad)
        assert tokens.shape[1] == horizon * model.tgt_len + 1
        key = hashlib.sha256(repr((model.spec, horizon, grad_steps)).encode())
        for p in model.state_dict().values():
            key.update(p.detach().numpy().tobytes())
        key.update(tokens.numpy().tobytes())
        per_step, g_ref = once_per_run(key.hexdigest(), lambda: naive_run(model, tokens, horizon, grad_steps))
        return per_step[:steps], g_ref

    return naive


def run_both(
    steps: int = STEPS,
    grad: bool = False,
    atol: float = ATOL,
    grad_atol: float = GRAD_ATOL,
    naive: Callable = naive_run,
    horizon: int | None = None,
    vocab: int = V,
    **overrides,
):
    """Run the model and the reference (``naive``: :func:`naive_run`) side by side; compare NLL and
    selections per step (to ``atol``), and with ``grad`` the parameter gradients of the summed NLL
    (each step back-propagated before the next, as in training; to ``grad_atol``). The tokens,
    drawn from the first ``vocab`` ids, cover ``horizon`` steps (default ``steps``), of which the
    first ``steps`` are run."""
    model = tiny_model(V, **{"model.name": "crtn", **overrides})
    L = model.tgt_len
    tokens = torch.randint(0, vocab, (2, (horizon or steps) * L + 1))
    reference, g_ref = naive(model, tokens, steps, grad)
    params = [p for p in model.parameters() if p.requires_grad]
    g_model = [torch.zeros_like(p) for p in params]
    state = None
    n_compared = 0
    for t in range(steps):
        x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
        with torch.set_grad_enabled(grad):
            out = model(x, y, state)
            if grad:
                _accumulate(g_model, out.nll.sum(), params)
        state = out.state
        for b, (nll_ref, sel_ref) in enumerate(reference[t]):
            torch.testing.assert_close(out.nll[b], nll_ref, rtol=0, atol=atol)
            if out.selection is None:
                assert all(not s for s in sel_ref)
                continue
            sel = out.selection
            found = torch.ones_like(sel.age, dtype=torch.bool) if sel.found is None else sel.found
            pos, alpha = (t * L - sel.age[b]).tolist(), sel.alpha[b].tolist()
            for j in range(L):  # the slots a token reads (a lookup's without a match: none)
                read = found[b, j].tolist()
                assert [p for p, f in zip(pos[j], read) if f] == [p for p, _ in sel_ref[j]], (t, b, j)
                got = [a for a, f in zip(alpha[j], read) if f]
                assert got == pytest.approx([a for _, a in sel_ref[j]], abs=atol)
                n_compared += len(sel_ref[j])
    assert n_compared > 0, "the cache was never used"
    if grad:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, gm, gr in zip(names, g_model, g_ref):
            torch.testing.assert_close(gm, gr, rtol=0, atol=grad_atol, msg=lambda m, n=name: f"{n}: {m}")
    return model, state


def _accumulate(total: list[torch.Tensor], loss: torch.Tensor, params: list[torch.Tensor]) -> None:
    for acc, g in zip(total, torch.autograd.grad(loss, params, allow_unused=True)):
        if g is not None:
            acc += g


PAIRS = valid_pairs()


@pytest.mark.parametrize("pos,weighted", list(itertools.product(["concat", "real"], [True, False])))
@pytest.mark.parametrize("strategy,summary", PAIRS, ids=[f"{q}-{s}" for q, s in PAIRS])
def test_every_pair_matches_naive_reference(strategy, summary, pos, weighted):
    run_both(
        horizon=STEPS,
        naive=shared_naive(STEPS, PAIR_GRAD_STEPS),
        **{
            "query.strategy": strategy,
            "summary.name": summary,
            "cache.pos": pos,
            "cache.weighted": weighted,
            **_d_key(strategy, summary),
        },
    )


@pytest.mark.parametrize("pos,weighted", list(itertools.product(["concat", "real"], [True, False])))
@pytest.mark.parametrize("strategy,summary", PAIRS, ids=[f"{q}-{s}" for q, s in PAIRS])
def test_every_pair_has_the_reference_gradients(strategy, summary, pos, weighted):
    run_both(
        steps=PAIR_GRAD_STEPS,
        grad=True,
        horizon=STEPS,
        naive=shared_naive(STEPS, PAIR_GRAD_STEPS),
        **{
            "query.strategy": strategy,
            "summary.name": summary,
            "cache.pos": pos,
            "cache.weighted": weighted,
            **_d_key(strategy, summary),
        },
    )


# query=lookup (one row per token, alpha 1): the n-gram lengths, the shift, positions, layers
LOOKUP = {
    **LOOKUP_MODEL,
    "model.tgt_len": 4,
    "model.mem_len": 4,
}
LOOKUP_OPTIONS = {
    "match_1_2": {"summary.ngram": 1, "query.max_match": 2},
    "match_2_4_shift_0": {"summary.ngram": 2, "query.max_match": 4, "summary.shift": 0},
    "match_1_3_real": {"summary.ngram": 1, "query.max_match": 3, "cache.pos": "real"},
    "match_1_4_concat_every_layer": {
        "summary.ngram": 1,
        "query.max_match": 4,
        "cache.pos": "concat",
        "cache.layers": None,
    },
    "match_2_2_n_slot_2": {"summary.ngram": 2, "query.max_match": 2, "cache.n_slot": 2},
}


@pytest.mark.parametrize("grad", [False, True], ids=["values", "gradients"])
@pytest.mark.parametrize("variant", list(LOOKUP_OPTIONS.values()), ids=list(LOOKUP_OPTIONS))
def test_lookup_matches_naive_reference(variant, grad):
    """The lookup's rows (the longest n-gram that occurred, its most recent occurrence, nothing
    where none did) and the attention over them equal a brute-force search of every cached row
    per token, in values and parameter gradients; 4 symbols make matches of every length."""
    torch.manual_seed(0)
    run_both(steps=8, grad=grad, vocab=4, **{**LOOKUP, **variant})


def _d_key(strategy: str, summary: str) -> dict:
    """summary.d_key 5 where the summary has learned maps of that width (linear, token_max), except
    for query=gate, which scores with each layer's own projections; the others refuse it."""
    return {"summary.d_key": 5} if strategy != "gate" and summary in ("linear", "token_max") else {}


# the authors' options and the retrieval options, values and gradients
NEW_OPTIONS = {
    "alpha_original": {"cache.alpha_norm": "original"},
    # 3 slots, k=2: eviction while slots compete
    "n_slot_3": {"cache.n_slot": 3},
    "single_linear": {"query.strategy": "single_linear", "summary.name": "last_state"},
    "single_linear_token_max": {"query.strategy": "single_linear", "summary.name": "token_max"},
    "linear_query": {"query.strategy": "linear", "summary.name": "mean"},
    "token_max_plain": {"summary.name": "token_max"},
    "token_max_proj": {"summary.name": "token_max", "summary.d_key": 6},
    "key_layer_1": {"cache.key_layer": 1, "summary.name": "token_max", "summary.d_key": 6},
    "key_layer_0_window": {"cache.key_layer": 0, "query.strategy": "middle_l", "summary.name": "mean"},
    "ngram_1": {"summary.name": "token_max", "summary.ngram": 1},
    "ngram_2_proj_real": {
        "summary.name": "token_max",
        "summary.ngram": 2,
        "summary.d_key": 6,
        "cache.pos": "real",
    },
    "ngram_2_layers_1": {"summary.name": "token_max", "summary.ngram": 2, "cache.layers": 1},
    "shift_1_ngram_2_proj": {
        "summary.name": "token_max",
        "summary.ngram": 2,
        "summary.shift": 1,
        "summary.d_key": 6,
        # 2 slots: with 3, slots without a cached predecessor tie at score 0 (shift 1: their row 0
        # is scored against zero lead-in rows) and the model and the reference break ties apart
        "cache.n_slot": 2,
    },
    # cosine scores: the embeddings' n-gram match (key_layer 0), the learned maps with k = 1, and
    # alpha over all slots (the scores no longer divided by sqrt(d_key))
    "cosine_ngram_2_shift_1_key_layer_0": {
        "summary.name": "token_max",
        "summary.cosine": True,
        "summary.ngram": 2,
        "summary.shift": 1,
        "cache.key_layer": 0,
        "cache.n_slot": 2,  # as in shift_1_ngram_2_proj: no tie at a zero lead-in
    },
    "cosine_proj_k1": {
        "summary.name": "token_max",
        "summary.cosine": True,
        "summary.d_key": 6,
        "summary.ngram": 1,
        "summary.shift": 0,
        "cache.top_k": 1,
    },
    "cosine": {"summary.name": "token_max", "summary.cosine": True},
    "layers_1": {"cache.layers": 1},
    "layers_1_token_max_real": {"cache.layers": 1, "summary.name": "token_max", "cache.pos": "real"},
    "layers_1_fixed_length_2": {"cache.layers": 1, "query.strategy": "fixed_length_2", "summary.name": "max"},
    "layers_1_linear_summary": {"cache.layers": 1, "query.strategy": "last_l", "summary.name": "linear"},
    "layers_1_detach": {"cache.layers": 1, "query.detach": True, "query.strategy": "single_linear"},
    "detach_token": {"query.detach": True},
    "detach_linear": {"query.strategy": "linear", "summary.name": "linear", "query.detach": True},
    "detach_fixed_length_1": {
        "query.strategy": "fixed_length_1",
        "summary.name": "weighted_sum",
        "query.detach": True,
    },
    "detach_fixed_length_2": {
        "query.strategy": "fixed_length_2",
        "summary.name": "conv",
        "query.detach": True,
    },
    "original_model": {
        "query.strategy": "token",
        "summary.name": "last_state",
        "cache.alpha_norm": "original",
        "cache.pos": "real",
    },
    # model=crtn's own cache (crtn/model/spec.py CacheSpec): one slot at alpha 1, read by the top
    # two of three layers, with its query and summary (token / token_max), positions at the
    # best-matching row (cache.pos=match, the default: NEW_OPTION_ALIASES "match_default_cache")
    "crtn_default_cache": {
        "model.n_layer": 3,
        "cache.layers": 2,
        "cache.top_k": 1,
        "cache.alpha_norm": "topk",
        "query.strategy": "token",
        "summary.name": "token_max",
    },
    # positions aligned on each selected slot's best-matching row (cache.pos=match): alpha over
    # every slot (the row match's gradient path), at alpha 1 in crtn's default layers
    # ("crtn_default_cache" above), a single-row match with learned maps, and distances clamped with a pair of biases per layer
    "match_ngram2": {"summary.name": "token_max", "summary.ngram": 2, "cache.pos": "match"},
    "match_ngram1_shift0_proj": {
        "summary.name": "token_max",
        "summary.ngram": 1,
        "summary.shift": 0,
        "summary.d_key": 6,
        "cache.pos": "match",
    },
    "match_clamp_untie_pre_ln": {
        "summary.name": "token_max",
        "cache.pos": "match",
        "model.clamp_len": 10,
        "model.untie_r": True,
        "model.pre_lnorm": True,
    },
}

#: Options spelled otherwise that resolve to the spec of an entry of NEW_OPTIONS (the schema's
#: defaults: token_max matches 3-grams shifted by 1 at cache.pos=match): the same model, weights and
#: tokens, so the same run; test_option_aliases_resolve_to_the_same_spec holds them to it.
NEW_OPTION_ALIASES = {
    "ngram_3": ("token_max_plain", {"summary.name": "token_max", "summary.ngram": 3}),
    "ngram_3_n_slot_3": (
        "token_max_plain",
        {"summary.name": "token_max", "summary.ngram": 3, "cache.n_slot": 3},
    ),
    "shift_1_ngram_3": (
        "token_max_plain",
        {"summary.name": "token_max", "summary.ngram": 3, "summary.shift": 1},
    ),
    "ngram_3_single_linear": (
        "single_linear_token_max",
        {"query.strategy": "single_linear", "summary.name": "token_max", "summary.ngram": 3},
    ),
    "shift_1_ngram_1": ("ngram_1", {"summary.name": "token_max", "summary.ngram": 1, "summary.shift": 1}),
    "match_default_cache": (
        "crtn_default_cache",
        {
            "model.n_layer": 3,
            "cache.layers": 2,
            "cache.top_k": 1,
            "cache.alpha_norm": "topk",
            "summary.name": "token_max",
            "summary.ngram": 3,
            "cache.pos": "match",
        },
    ),
}


@pytest.mark.parametrize("alias", list(NEW_OPTION_ALIASES))
def test_option_aliases_resolve_to_the_same_spec(alias):
    name, overrides = NEW_OPTION_ALIASES[alias]
    spec = tiny_spec(**{"model.name": "crtn", **overrides})
    assert spec == tiny_spec(**{"model.name": "crtn", **NEW_OPTIONS[name]})


#: selection inside attention (query=gate), against tests/reference_gate.py
GATE = {"query.strategy": "gate"}
GATE_OPTIONS = {
    "mean": {**GATE, "summary.name": "mean"},
    "token_max_ngram3": {**GATE, "summary.name": "token_max", "summary.ngram": 3},
    "shared_token_max_ngram2_real": {
        **GATE,
        "summary.name": "token_max",
        "summary.ngram": 2,
        "cache.pos": "real",
    },
    "last_state_real_topk": {
        **GATE,
        "summary.name": "last_state",
        "cache.pos": "real",
        "cache.alpha_norm": "topk",
    },
    "original": {**GATE, "summary.name": "mean", "cache.alpha_norm": "original"},
    "unweighted": {**GATE, "summary.name": "token_max", "cache.weighted": False},
    "pre_ln_mean": {**GATE, "summary.name": "mean", "model.pre_lnorm": True},
    "pre_ln_token_max_ngram2": {
        **GATE,
        "summary.name": "token_max",
        "summary.ngram": 2,
        "model.pre_lnorm": True,
    },
    "layers_1": {**GATE, "summary.name": "token_max", "cache.layers": 1},
    "pre_ln_token_max_k1": {**GATE, "summary.name": "token_max", "cache.top_k": 1, "model.pre_lnorm": True},
    "layers_2_of_3": {**GATE, "summary.name": "mean", "model.n_layer": 3, "cache.layers": 2},
    "last_state_n_slot_3": {**GATE, "summary.name": "last_state", "cache.n_slot": 3},
    "mem0_ngram3": {**GATE, "summary.name": "token_max", "summary.ngram": 3, "model.mem_len": 0},
    "k_gt_n": {**GATE, "summary.name": "mean", "cache.n_slot": 2, "cache.top_k": 3, "model.mem_len": 6},
    "detach": {**GATE, "summary.name": "token_max", "query.detach": True},
    "clamp_real_untie": {
        **GATE,
        "summary.name": "mean",
        "cache.pos": "real",
        "model.clamp_len": 4,
        "model.untie_r": True,
    },
}


@pytest.mark.parametrize("grad", [False, True], ids=["values", "gradients"])
@pytest.mark.parametrize("variant", list(GATE_OPTIONS.values()), ids=list(GATE_OPTIONS))
def test_selection_inside_attention_matches_naive_reference(variant, grad):
    run_both(steps=8 if not grad else 6, grad=grad, horizon=8, naive=shared_naive(8, 6), **variant)


@pytest.mark.parametrize("grad", [False, True], ids=["values", "gradients"])
@pytest.mark.parametrize("variant", list(NEW_OPTIONS.values()), ids=list(NEW_OPTIONS))
def test_new_options_match_naive_reference(variant, grad):
    run_both(steps=8 if not grad else 6, grad=grad, horizon=8, naive=shared_naive(8, 6), **variant)


@pytest.mark.parametrize(
    "variant",
    [
        {"cache.alpha_norm": "topk"},
        {"model.mem_len": 0},
        {"model.mem_len": 6, "cache.n_slot": 2, "cache.top_k": 3},
        {"model.pre_lnorm": True, "model.untie_r": True},
        {"model.clamp_len": 4, "cache.pos": "real"},
        {"model.clamp_len": 4, "cache.pos": "concat"},
        {"summary.name": "linear", "query.strategy": "middle_l"},
    ],
    ids=["alpha_topk", "mem0", "k_gt_n", "pre_ln_untie", "clamp_real", "clamp_concat", "linear_summary"],
)
def test_variants_match_naive_reference(variant):
    run_both(steps=8, **variant)


def test_zero_slots_or_zero_k_is_exactly_txl():
    """n_slot=0 (or top_k=0): crtn gives exactly the logits of txl with the same weights."""
    crtn = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 0})
    txl = tiny_model(V, **{"model.name": "txl"})
    txl.load_state_dict(crtn.state_dict(), strict=False)
    crtn_k0 = tiny_model(V, **{"model.name": "crtn", "cache.top_k": 0})
    crtn_k0.load_state_dict(crtn.state_dict())
    tokens = torch.randint(0, V, (2, 16))
    states = [None, None, None]
    for t in range(0, 15, 3):
        x, y = tokens[:, t : t + 3], tokens[:, t + 1 : t + 4]
        outs = [m(x, y, s) for m, s in zip((crtn, txl, crtn_k0), states)]
        states = [o.state for o in outs]
        assert torch.equal(outs[0].hidden, outs[1].hidden)
        assert torch.equal(outs[0].nll, outs[1].nll)
        assert torch.equal(outs[2].nll, outs[1].nll)


def test_more_retrieving_layers_than_the_model_has_is_every_layer():
    """cache.layers counts from the top and stops at the model's depth (docs/method.md §3,
    "Retrieval in the upper layers only"): on 3 layers, 5 resolves to 3 and builds the model of
    cache.layers=null, equal in its outputs to the last bit; 0 retrieving layers is refused."""
    torch.manual_seed(0)
    every = tiny_model(V, **{"model.name": "crtn", "model.n_layer": 3, "cache.layers": None})
    deep = tiny_model(V, **{"model.name": "crtn", "model.n_layer": 3, "cache.layers": 5})
    assert (deep.spec.cache.layers, deep.spec.cache.key_layer) == (3, 3)
    assert (every.spec.cache.layers, every.spec.cache.key_layer) == (3, 3)
    deep.load_state_dict(every.state_dict())
    tokens = torch.randint(0, V, (2, 6 * deep.tgt_len + 1))
    states = [None, None]
    for x, y in zip(tokens[:, :-1].split(deep.tgt_len, 1), tokens[:, 1:].split(deep.tgt_len, 1)):
        outs = [m(x, y, s) for m, s in zip((every, deep), states)]
        states = [o.state for o in outs]
        assert torch.equal(outs[0].nll, outs[1].nll)
    assert outs[1].selection is not None  # the cache was read
    with pytest.raises(ConfigError, match=r"cache.layers=0 must be >= 1 \(null: every layer\)"):
        tiny_model(V, **{"model.name": "crtn", "cache.layers": 0})


def test_a_key_layer_above_the_first_retrieving_layers_input_is_refused():
    """With cache.layers below the model's depth the keys come from the shared lower layers: the
    first retrieving layer's input (layer 1 of 3 at cache.layers=2) or below; above it, the
    key would need a pass of retrieving layers without the cache, and resolution says so."""
    with pytest.raises(
        ConfigError, match=r"^cache.key_layer=2: with cache.layers=2 keys and queries come from layer 1 "
    ):
        tiny_model(V, **{"model.name": "crtn", "model.n_layer": 3, "cache.layers": 2, "cache.key_layer": 2})
    assert tiny_model(
        V, **{"model.name": "crtn", "model.n_layer": 3, "cache.layers": 2, "cache.key_layer": 0}
    ).key_apart


# cache.layers and cache.key_layer on a 3-layer model: every valid pairing (crtn/model/crtn.py
# _resolve_layers: with cache.layers < n_layer the keys come from layer n_layer - cache.layers or one
# below it, stored apart; cache.layers = n_layer is "all layers" and takes any key layer), with the
# default summary and token_max
LAYER_KEYS = [
    (2, None),
    (2, 1),
    (2, 0),
    (3, None),
    (3, 0),
    (3, 1),
    (3, 2),
    (3, 3),
    (None, 0),
    (None, 1),
    (None, 2),
    (None, 3),
]
#: pairings that resolve to the spec of another (key layer null: the first retrieving layer's
#: input; cache.layers null: all 3), so the same model, weights and tokens, the same run:
#: test_layer_key_aliases_resolve_to_the_same_spec holds them to it
LAYER_KEY_ALIASES = {
    (2, 1): (2, None),
    (3, 3): (3, None),
    (None, 3): (3, None),
    (None, 0): (3, 0),
    (None, 1): (3, 1),
    (None, 2): (3, 2),
}
LAYER_KEYS_RUN = [pair for pair in LAYER_KEYS if pair not in LAYER_KEY_ALIASES]


def _layers(layers: int | None, key_layer: int | None, summary: str) -> dict:
    return {"model.n_layer": 3, "cache.layers": layers, "cache.key_layer": key_layer, "summary.name": summary}


def _stored(layers: int | None, key_layer: int | None) -> int:
    """Slots hold every layer 0..n (the paper), or with fewer retrieving layers only their inputs,
    after the key layer's where it lies below them."""
    return 4 if layers in (None, 3) else layers + (key_layer is not None and key_layer < 3 - layers)


@pytest.mark.parametrize("summary", ["last_state", "token_max"])
def test_layer_key_aliases_resolve_to_the_same_spec(summary):
    for (layers, key_layer), (same_layers, same_key) in LAYER_KEY_ALIASES.items():
        assert tiny_spec(**{"model.name": "crtn", **_layers(layers, key_layer, summary)}) == tiny_spec(
            **{"model.name": "crtn", **_layers(same_layers, same_key, summary)}
        ), (layers, key_layer)
        assert _stored(layers, key_layer) == _stored(same_layers, same_key)


@pytest.mark.parametrize("summary", ["last_state", "token_max"])
@pytest.mark.parametrize(
    "layers,key_layer", LAYER_KEYS_RUN, ids=[f"layers_{a}-key_{b}" for a, b in LAYER_KEYS_RUN]
)
def test_cache_layers_and_key_layer_of_three_layers_match_naive_reference(layers, key_layer, summary):
    """Values and parameter gradients against the naive reference, which reads the key layer and
    the first retrieving layer from the config on its own (tests/reference.py NaiveCRTN)."""
    model, state = run_both(steps=6, grad=True, **_layers(layers, key_layer, summary))
    assert state.cache.values.shape[0] == _stored(layers, key_layer)
