"""Transformer-XL (``txl``) and ``vanilla`` against independent references (docs/method.md §2)."""

from __future__ import annotations

import pytest
import torch

from crtn.model.attention import rel_shift
from tests.helpers import tiny_model
from tests.reference import naive_segment

V = 13


def _segments(model, tokens, L, state=None):
    """Feed [B, T] tokens segment by segment; returns NLL [B, T-1] and the final state."""
    nll = []
    for t in range(0, tokens.shape[1] - 1, L):
        x, y = tokens[:, t : t + L], tokens[:, t + 1 : t + L + 1]
        x = x[:, : y.shape[1]]
        out = model(x, y, state)
        nll.append(out.nll)
        state = out.state
    return torch.cat(nll, 1), state


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"model.pre_lnorm": True},
        {"model.untie_r": True},
        {"model.cutoffs": [4, 8], "model.div_val": 2, "model.d_embed": 8},
        {"model.d_embed": 6, "model.tie_weight": False},
    ],
    ids=["post_ln", "pre_ln", "untie_r", "adaptive", "proj"],
)
def test_txl_segments_equal_one_causal_pass(variant):
    """Segment-wise recurrence with memory >= history == one causal pass over everything (1e-5, float64)."""
    T, L = 13, 3
    model = tiny_model(V, **{"model.name": "txl", "model.tgt_len": L, "model.mem_len": 16, **variant})
    tokens = torch.randint(0, V, (2, T))
    seg_nll, state = _segments(model, tokens, L)
    full = model(tokens[:, :-1], tokens[:, 1:]).nll
    assert seg_nll.shape == full.shape == (2, T - 1)
    torch.testing.assert_close(seg_nll, full, rtol=0, atol=1e-10)
    assert state.mem.shape == (model.n_layer + 1, 2, 12, model.d_model)
    assert state.pos == T - 1


def test_short_memory_differs_from_full_pass():
    """Sanity check of the test above: with mem_len < history the two must differ."""
    T, L = 13, 3
    model = tiny_model(V, **{"model.name": "txl", "model.tgt_len": L, "model.mem_len": 3})
    tokens = torch.randint(0, V, (2, T))
    seg_nll, _ = _segments(model, tokens, L)
    full = model(tokens[:, :-1], tokens[:, 1:]).nll
    assert (seg_nll[:, L:] - full[:, L:]).abs().max() > 1e-4
    torch.testing.assert_close(seg_nll[:, :L], full[:, :L], rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"model.clamp_len": 2},
        {"model.pre_lnorm": True, "model.untie_r": True},
        {"model.same_length": True},
    ],
    ids=["plain", "clamp", "pre_ln_untie", "same_length"],
)
def test_relative_attention_matches_naive_loop(variant):
    """Every layer's states equal a per-query loop that builds each A_ij from the formula."""
    L = 4
    model = tiny_model(V, **{"model.name": "txl", "model.tgt_len": L, "model.mem_len": 5, **variant})
    mem = torch.randn(model.n_layer + 1, 2, 5, model.d_model, dtype=torch.float64)
    tokens = torch.randint(0, V, (2, L))
    hids, _ = model.core(tokens, mem)
    for b in range(2):
        ref = naive_segment(model, tokens[b], list(mem[:, b]), t0=100, same_length=model.same_length)
        for layer in range(model.n_layer + 1):
            torch.testing.assert_close(hids[layer][b], ref[layer], rtol=0, atol=1e-10)


def test_rel_shift_hand_computed():
    """rel_shift maps column K-1-c (distance) to key position: y[i, j] = x[i, K-1-(K-L+i-j)]."""
    L, K = 3, 5
    x = torch.arange(L * K, dtype=torch.float64).view(L, K)
    y = rel_shift(x)
    for i in range(L):
        for j in range(K - L + i + 1):  # visible keys only
            dist = K - L + i - j
            assert y[i, j] == x[i, K - 1 - dist]


def test_vanilla_has_no_memory_and_sees_only_its_segment():
    model = tiny_model(V, **{"model.name": "vanilla", "model.mem_len": 8})
    tokens = torch.randint(0, V, (2, 10))
    nll, state = _segments(model, tokens, 3)
    assert state.mem is None
    # each segment alone gives the same result
    for t in range(0, 9, 3):
        alone = model(tokens[:, t : t + 3], tokens[:, t + 1 : t + 4]).nll
        torch.testing.assert_close(nll[:, t : t + 3], alone, rtol=0, atol=1e-12)


def test_memory_is_gradient_stopped():
    model = tiny_model(V, **{"model.name": "txl"})
    tokens = torch.randint(0, V, (2, 7))
    out = model(tokens[:, :3], tokens[:, 1:4])
    assert not out.state.mem.requires_grad
    out2 = model(tokens[:, 3:6], tokens[:, 4:7], out.state)
    out2.nll.sum().backward()  # would fail or reach the first segment's graph otherwise
    assert out.state.mem.grad is None
