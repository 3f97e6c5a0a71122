"""The retrieval statistics of each retrieving layer (crtn/model/retrieval_stats.py ``layers``;
eval.json's ``retrieval`` block): by hand, and from an evaluation against a plain loop over the
model's outputs. The top-level keys stay the reported (top retrieving layer's) selection's."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from crtn.data.mqar import make_mqar
from crtn.evaluate import evaluate
from crtn.model import RetrievalStats
from tests.helpers import tiny_model
from tests.test_mqar import TINY_MQAR


def _selection(ages: list, alphas: list) -> SimpleNamespace:
    """A selection of B = 1, L = 2, k = 2: ``age`` [1, 2, 2] tokens, ``alpha`` [1, 2, 2]."""
    return SimpleNamespace(age=torch.tensor([ages]), alpha=torch.tensor([alphas]))


def test_layer_statistics_by_hand():
    """Two steps, two retrieving layers (segments of 3 tokens, k = 2: alpha mass bins of 0.2)."""
    top_alpha = [[0.5, 0.5], [0.7, 0.1]]  # mass 1.0, 0.8 -> bins 5, 4; top share 0.5, 0.875 -> 5, 8
    bottom_alpha = [[0.6, 0.3], [0.05, 0.25]]  # mass 0.9, 0.3 -> bins 4, 1; share 0.667, 0.833 -> 6, 8
    steps = [
        (_selection([[3, 9], [6, 6]], bottom_alpha), _selection([[12, 12], [0, 3]], top_alpha)),
        (_selection([[15, 0], [0, 3]], bottom_alpha), _selection([[3, 3], [3, 3]], top_alpha)),
    ]
    stats = RetrievalStats()
    for bottom, top in steps:  # as crtn.measures.Measures.add: the top one, then every layer
        stats.update(top.age, seg_len=3, alpha=top.alpha)
        stats.update_layers((bottom, top), seg_len=3)
    s = stats.summary()
    # bottom: segments 1, 3, 2, 2 then 5, 0, 0, 1; tokens 3+9+6+6+15+0+0+3 = 42 over 8
    bottom = s["layers"][0]
    assert bottom["distance_hist"] == [2, 2, 2, 1, 0, 1]
    assert bottom["mean_distance_tokens"] == pytest.approx(42 / 8)
    assert bottom["alpha_mass_mean"] == pytest.approx(0.6)
    assert bottom["alpha_mass_hist"] == [0, 2, 0, 0, 2, 0, 0, 0, 0, 0]
    assert bottom["alpha_top_share_hist"] == [0, 0, 0, 0, 0, 0, 2, 0, 2, 0]
    # top: segments 4, 4, 0, 1 then 1, 1, 1, 1; tokens 12+12+0+3+3*4 = 39 over 8
    assert s["distance_hist"] == [1, 5, 0, 0, 2]
    assert s["mean_distance_tokens"] == pytest.approx(39 / 8)
    assert s["alpha_mass_mean"] == pytest.approx(0.9)
    assert s["alpha_mass_hist"] == [0, 0, 0, 0, 2, 2, 0, 0, 0, 0]
    assert s["alpha_top_share_hist"] == [0, 0, 0, 0, 0, 2, 0, 0, 2, 0]
    assert s["seg_len"] == bottom["seg_len"] == 3 and bottom["alpha_mass_max"] == 2.0
    top_level = {k: v for k, v in s.items() if k != "layers"}
    assert len(s["layers"]) == 2 and s["layers"][1] == top_level


def test_selections_a_token_does_not_read_count_no_distance():
    """A lookup's tokens without a match (found False, alpha 0) add no distance; their alpha mass
    of 0 is counted."""
    stats = RetrievalStats()
    age = torch.tensor([[[8], [4], [12]]])  # segments 2, 1, 3 back (Ls 4)
    found = torch.tensor([[[True], [False], [True]]])
    stats.update(age, 4, found.float(), found=found)
    out = stats.summary()
    assert out["distance_hist"] == [0, 0, 1, 1]
    assert out["alpha_mass_mean"] == pytest.approx(2 / 3)


def test_one_selection_for_every_layer_adds_no_layers():
    """Without a gate (no layer selections) or with one retrieving layer, ``layers`` is absent;
    a change in the number of retrieving layers is an error."""
    sel = _selection([[3, 6], [6, 6]], [[0.5, 0.5], [0.5, 0.5]])
    stats = RetrievalStats()
    stats.update(sel.age, seg_len=3, alpha=sel.alpha)
    stats.update_layers((), seg_len=3)
    stats.update_layers((sel,), seg_len=3)
    assert "layers" not in stats.summary() and stats.summary()["distance_hist"] == [0, 1, 3]
    stats.update_layers((sel, sel), seg_len=3)
    with pytest.raises(ValueError, match="3 retrieving layers after 2"):
        stats.update_layers((sel, sel, sel), seg_len=3)


def _reference(model, corpus, batch_size: int) -> list[tuple[Counter, float, int]]:
    """Per retrieving layer, from the model's outputs segment by segment: the count of each
    distance in segments, the alpha mass summed over tokens, and the tokens."""
    it = corpus.iterator("valid", batch_size, model.tgt_len)
    state = model.init_state(batch_size, "cpu")
    layers: list[tuple[Counter, float, int]] = []
    with torch.no_grad():
        for batch in it:
            out = model(batch.input, batch.target, state)
            state = out.state
            if not layers:
                layers = [(Counter(), 0.0, 0) for _ in out.layer_selections]
            for i, s in enumerate(out.layer_selections):
                hist, mass, n = layers[i]
                hist.update(int(a) // state.cache.seg_len for a in s.age.reshape(-1))
                layers[i] = (hist, mass + float(s.alpha.sum()), n + s.alpha[..., 0].numel())
    return layers


def test_evaluation_reports_every_retrieving_layer():
    """query=gate with both layers retrieving: ``retrieval["layers"]`` holds each layer's
    histogram and alpha mass, recomputed from the outputs; the top-level keys are the top
    layer's. Selection by the query pass (one selection for every layer) reports no ``layers``."""
    torch.manual_seed(0)
    corpus = make_mqar(TINY_MQAR)
    options = {"query.strategy": "gate", "cache.layers": None, "cache.top_k": 2}
    model = tiny_model(len(corpus.vocab), **{"model.name": "crtn", "cache.n_slot": 12, **options})
    ret = evaluate(model, corpus, "valid", batch_size=2, device="cpu")["retrieval"]
    ref = _reference(model, corpus, 2)
    assert len(ret["layers"]) == len(ref) == 2
    for got, (hist, mass, n) in zip(ret["layers"], ref):
        assert got["distance_hist"] == [hist[d] for d in range(max(hist) + 1)]
        assert got["alpha_mass_mean"] == pytest.approx(mass / n)
    assert ret["layers"][0]["distance_hist"] != ret["layers"][1]["distance_hist"]  # apart
    assert {k: v for k, v in ret.items() if k != "layers"} == ret["layers"][-1]

    plain = tiny_model(len(corpus.vocab), **{"model.name": "crtn", "cache.n_slot": 12})
    ret = evaluate(plain, corpus, "valid", batch_size=2, device="cpu")["retrieval"]
    assert ret["distance_hist"] and "layers" not in ret
