"""The regularisers of the CRTN authors' recipe, each against a hand computation:
locked dropout shares one mask over time; word dropout drops whole word types; position
embeddings pass through the same dropout in both ``cache.pos`` modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tests.reference as reference
from crtn.model.dropout import LockedDropout, word_dropout
from tests.helpers import tiny_model
from tests.test_crtn_reference import run_both

V = 11


def test_locked_dropout_shares_one_mask_over_time():
    torch.manual_seed(0)
    drop = LockedDropout(0.5).train()
    x = torch.ones(3, 50, 8)  # [B, T, d]
    y = drop(x)
    # every (row, feature) unit is either dropped for all 50 steps or kept (scaled by 2) for all
    assert torch.equal(y, y[:, :1].expand_as(y))
    assert set(y.unique().tolist()) == {0.0, 2.0}
    # different rows and features draw different masks
    assert 0 < (y[:, 0] == 0).float().mean() < 1
    # time_dim picks the shared axis: [T, d] tables share over dim 0
    t = drop(torch.ones(40, 8), time_dim=0)
    assert torch.equal(t, t[:1].expand_as(t))
    assert torch.equal(drop.eval()(x), x)


def test_word_dropout_drops_whole_word_types():
    torch.manual_seed(1)
    tokens = torch.randint(0, 6, (4, 30))
    embed = torch.randn(4, 30, 5)
    out = word_dropout(embed, tokens, 6, 0.5, training=True)
    seen = set()
    for w in tokens.unique().tolist():
        at = tokens == w
        ratio = out[at] / embed[at]
        # one decision per word type, shared by all of its occurrences
        assert torch.allclose(ratio, ratio[0, 0].expand_as(ratio))
        assert ratio[0, 0].item() in (0.0, 2.0)
        seen.add(ratio[0, 0].item())
    assert seen == {0.0, 2.0}
    assert torch.equal(word_dropout(embed, tokens, 6, 0.5, training=False), embed)


def test_model_word_dropout_and_locked_input_dropout_in_training_only():
    model = tiny_model(
        V, **{"model.name": "txl", "model.dropemb": 0.5, "model.dropinp": 0.3, "model.locked_dropout": True}
    )
    x = torch.randint(0, V, (2, 3))
    ref = model(x).hidden
    assert torch.equal(model(x).hidden, ref)  # eval: no dropout
    model.train()
    torch.manual_seed(0)
    a = model(x).hidden
    torch.manual_seed(1)
    b = model(x).hidden
    assert not torch.allclose(a, b)


class _Warp(nn.Module):
    """A deterministic stand-in for dropout on position embeddings: a fixed function of each
    value, so the embedding of a distance is transformed the same way wherever it stands.
    Word embeddings ([B, L, d]; the model's input dropout sees them too) pass unchanged."""

    p = 0.5

    def forward(self, x, time_dim: int = -2):  # noqa: ARG002
        return x * (1 + 0.5 * torch.sin(7 * x)) if x.dim() == 2 else x


@pytest.mark.parametrize("pos", ["concat", "real", "match"])
def test_position_embeddings_are_treated_alike_in_every_pos_mode(pos, monkeypatch):
    """In training, cache.pos=real and match drop out the position embeddings of retrieved rows
    as cache.pos=concat does: with the dropout replaced by a fixed transformation of the
    embeddings, every mode equals the naive reference whose sinusoids are transformed the same
    way (match: token_max, whose best rows place the second term)."""
    warp = _Warp()
    plain = reference.sinusoid
    monkeypatch.setattr(reference, "sinusoid", lambda dist, d: warp(plain(dist, d)))
    original = tiny_model

    def warped_model(*args, **kw):
        m = original(*args, **kw).train()  # dropout rates are 0: only the warp acts
        m.drop_inp = warp
        return m

    monkeypatch.setattr("tests.test_crtn_reference.tiny_model", warped_model)
    match = {"summary.name": "token_max", "summary.ngram": 2} if pos == "match" else {}
    run_both(steps=6, **{"cache.pos": pos, "model.clamp_len": 7, **match})
