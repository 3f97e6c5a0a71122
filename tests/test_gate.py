"""Selection inside attention (query=gate, crtn/model/gate.py) beyond the naive reference of
tests/test_crtn_reference.py: no query pass, the stored block keys by hand, the selections of
the retrieving layers and heads, the options' rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import crtn.model.gate as gate_module
from crtn.config import resolve
from crtn.errors import ConfigError
from crtn.model import CRTN
from tests.helpers import compose_train, tiny_model

V = 11
GATE = {"model.name": "crtn", "query.strategy": "gate"}


def _drive(model, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    L = model.tgt_len
    tokens = torch.randint(0, V, (2, steps * L + 1))
    state, out = None, None
    for t in range(steps):
        out = model(tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1], state)
        state = out.state
    return out, state


def test_no_query_pass_each_layer_runs_once(monkeypatch):
    """A gate step runs the layers once (the main pass); the token strategy runs them twice (a
    query pass first), counted on the layers' forward calls."""
    calls = {"n": 0}
    real = torch.nn.Module.__call__

    def counting(self, *a, **k):
        if type(self).__name__ == "RelPartialLearnableDecoderLayer":
            calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "__call__", counting)
    for overrides, per_step in ((GATE, 2), ({"model.name": "crtn", "query.strategy": "token"}, 4)):
        model = tiny_model(V, **{**overrides, "summary.name": "token_max"})  # 2 layers
        calls["n"] = 0
        _drive(
            model, 4
        )  # token_max's n-gram match needs R_prev: the token strategy's query pass runs from step 0
        assert calls["n"] == per_step * 4, overrides


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("summary", ["mean", "last_state"])
def test_block_keys_are_the_pooled_layer_inputs(summary, pre_lnorm):
    """The cache stores, per slot and retrieving layer, the mean (or last) of the slot's rows of
    that layer's input, parameter-free normalised for pre-LN: recomputed here from the stored
    states by hand."""
    model = tiny_model(V, **{**GATE, "summary.name": summary, "model.pre_lnorm": pre_lnorm})
    _, state = _drive(model, 6)
    cache = state.cache
    cache.commit()
    n_ret = model.n_layer  # every layer retrieves
    for layer in range(n_ret):
        rows = cache.layer_values(layer)[:, : cache.n_valid]  # [B, nv, Ls, d]
        if pre_lnorm:
            mu = rows.mean(-1, keepdim=True)
            var = ((rows - mu) ** 2).mean(-1, keepdim=True)
            rows = (rows - mu) / torch.sqrt(var + model.layers[layer].dec_attn.layer_norm.eps)
        want = rows.mean(-2) if summary == "mean" else rows[:, :, -1]
        torch.testing.assert_close(cache.keys[:, : cache.n_valid, layer], want, rtol=0, atol=1e-12)


def test_each_layer_selects_on_its_own():
    """The layers pick different slots for some tokens: the selection is the layer's own, not one
    shared pass; the heads of a layer share it."""
    model = tiny_model(V, **{**GATE, "summary.name": "mean", "cache.n_slot": 3, "cache.top_k": 1})
    seen = []
    real = gate_module.Gate.select

    def spy(self, *a, **k):
        sel, folded = real(self, *a, **k)
        seen.append(sel.slot.clone())
        return sel, folded

    gate_module.Gate.select = spy
    try:
        _drive(model, 8, seed=3)
    finally:
        gate_module.Gate.select = real
    assert seen and all(s.shape[2] == 1 for s in seen)  # [B, L, 1, k]: one selection for the heads
    layer0, layer1 = seen[0::2], seen[1::2]  # the two retrieving layers of each step, in order
    assert any(not torch.equal(a, b) for a, b in zip(layer0, layer1))  # the layers disagree somewhere


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["query=gate", "cache.backend=faiss", "cache.alpha_norm=topk"],
            "cache.backend=faiss does not support query=gate",
        ),
        (
            ["query=gate", "summary=token_max", "summary.d_key=8"],
            "summary.d_key=8 is ignored by query=gate (with summary=token_max, only token|single_linear read it)",
        ),
        (
            ["query=gate", "summary=token_max", "summary.cosine=true"],
            "summary.cosine=true is ignored by query=gate (with summary=token_max, only token|single_linear read it)",
        ),
        (
            ["query=gate", "cache.key_layer=2"],
            "cache.key_layer=2 applies to the query strategies that score states, not query=gate",
        ),
        (["query=gate", "summary=linear"], "query=gate cannot be paired with summary=linear"),
        (
            ["query=gate", "summary=token_max", "cache.pos=match"],
            "cache.pos=match places rows by the query pass",
        ),
    ],
)
def test_gate_options_are_checked_with_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve(compose_train(overrides))


def test_resolving_a_gate_spec_again_gives_the_same_spec():
    run = resolve(compose_train(["query=gate", "cache.layers=2", "summary=token_max"]))
    assert run.cache.key_layer is None and run.cache.layers == 2
    assert resolve(run) == run
    assert isinstance(CRTN(7, run), CRTN)


def test_lead_queries_come_from_the_memory():
    """For token_max's n-gram match the queries before the segment are the layer's queries of
    the memory's last rows (zeros before a stream's first segment): by hand with W_q and u."""
    model = tiny_model(V, **{**GATE, "summary.name": "token_max", "summary.ngram": 3})
    attn = model.layers[0].dec_attn
    H, dh, d = attn.n_head, attn.d_head, model.d_model
    mem = torch.randn(2, 5, d, dtype=torch.float64)
    rw_q = torch.zeros(2, 3, H, dh, dtype=torch.float64)
    got = attn._lead_queries(mem, rw_q, model.r_w_bias, n=2)
    want = (F.linear(mem[:, -2:], attn.qkv_net.weight[: H * dh])).view(2, 2, H, dh) + model.r_w_bias
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    short = attn._lead_queries(mem[:, -1:], rw_q, model.r_w_bias, n=2)  # one memory row: a zero in front
    assert torch.equal(short[:, 0], torch.zeros_like(short[:, 0]))
    torch.testing.assert_close(short[:, 1], want[:, 1], rtol=0, atol=1e-12)
    assert torch.equal(
        attn._lead_queries(None, rw_q, model.r_w_bias, n=2), torch.zeros(2, 2, H, dh, dtype=torch.float64)
    )


@pytest.mark.parametrize("product", [None, "float32"], ids=["bfloat16_products", "queries_dtype_products"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_gradient"])
def test_best_row_gate_multiplies_bfloat16_rows_in_its_product_dtype(monkeypatch, grad, product, bf16_units):
    """With the cache in bfloat16 (``cache.dtype``) the best-row gate's match multiplies in the
    retrieved attention's product dtype (``cache.product_dtype``; by default the cache's
    bfloat16; a wider one keeps the queries' dtype), with a gradient and without: evaluation selects as training does, and its scores
    are bit for bit those of a call with a gradient on the same inputs. The match gets the
    cache's own bfloat16 rows (cast chunk by chunk where the products are float32, and in
    training kept for the backward pass as stored) instead of a copy of every slot's rows, and
    scores them exactly as it scores the same rows cast up first. ``bf16_products`` stays False:
    the no-gradient path of bfloat16 rows (``rowmatch.py``, row by row) rounds otherwise. On a
    CPU with bfloat16 units (``bf16_units``; without them the default is float32:
    ``test_hardware.py``)."""
    options = {
        "summary.name": "token_max",
        "cache.dtype": "bfloat16",
        "cache.alpha_norm": "all",
        "cache.top_k": 2,
        "cache.product_dtype": product,
    }
    model = tiny_model(V, **{**GATE, **options})
    real, calls = gate_module.ngram_row_scores, []

    def spy(query, rows, lead, **kw):
        out = real(query, rows, lead, **kw)
        calls.append((query.detach(), rows, lead, kw, out.detach()))
        return out

    monkeypatch.setattr(gate_module, "ngram_row_scores", spy)
    with torch.set_grad_enabled(grad):
        _drive(model, 5)
    assert len(calls) >= 4
    for query, rows, lead, kw, out in calls:
        assert rows.dtype == torch.bfloat16 and kw["bf16_products"] is False
        # a product dtype wider than 16 bits: the queries' own (the model's float64 here)
        assert kw["product_dtype"] == (torch.bfloat16 if product is None else query.dtype)
        assert out.dtype == query.dtype
        up = [None if t is None else t.to(query.dtype) for t in (rows, lead)]
        q = query.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            want = real(q, *up, **kw)
            assert torch.equal(out, want.detach())
            if grad:
                with torch.no_grad():  # evaluation's path scores as training's does
                    assert torch.equal(real(q, rows, lead, **kw), out)
                weight = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
                got = real(q, rows, lead, **kw)
                assert torch.equal(
                    torch.autograd.grad(got, q, weight)[0], torch.autograd.grad(want, q, weight)[0]
                )
