"""``model=crtn_original``: the CRTN authors' default model (xyz961014/longterm, ``CRTN/runfn.sh``)
in one word. Its composed config holds the authors' choices, and its forward values and parameter
gradients agree with the naive reference (tests/reference.py) in float64."""

from __future__ import annotations

import pytest

from tests.test_config import composed, flat
from tests.test_crtn_reference import NEW_OPTIONS, run_both

#: the authors' choices: --query_method single (the token's own state), --summary_method
#: last_state, alpha as in CRTN/layers/transformer.py with cache_theta 1 (the only temperature here),
#: values weighted by alpha,
#: real positions (close to their --farnear distances), FIFO renewal, two segments retrieved in every
#: layer, the cache holding the states in their own dtype
AUTHORS = {
    "model.name": "crtn",
    "query.strategy": "token",
    "query.detach": False,
    "summary.name": "last_state",
    "cache.alpha_norm": "original",
    "cache.weighted": True,
    "cache.pos": "real",
    "cache.top_k": 2,
    "cache.layers": None,
    "cache.dtype": None,
}
RETRIEVAL = [k for k in AUTHORS if k.split(".")[0] in ("query", "summary", "cache")]


def test_crtn_original_composes_to_the_authors_choices():
    cfg = flat(composed("train", ["model=crtn_original"]))
    assert {k: cfg[k] for k in AUTHORS} == AUTHORS
    # only the retrieval differs from model=crtn: sizes and training are the same
    plain = flat(composed("train", ["model=crtn"]))
    assert {k for k in cfg if cfg[k] != plain[k]} <= set(AUTHORS)
    # the reference tests' 'original_model' variant is this model
    assert all(cfg[k] == v for k, v in NEW_OPTIONS["original_model"].items())


def test_crtn_original_leaves_command_line_choices_alone():
    cfg = composed("train", ["model=crtn_original", "query=single_linear", "summary=sum"])
    assert (cfg.query.strategy, cfg.summary.name, cfg.cache.alpha_norm) == (
        "single_linear",
        "sum",
        "original",
    )


@pytest.mark.parametrize("grad", [False, True], ids=["values", "gradients"])
def test_crtn_original_matches_the_reference(grad):
    cfg = flat(composed("train", ["model=crtn_original"]))
    run_both(steps=8 if not grad else 6, grad=grad, **{k: cfg[k] for k in RETRIEVAL})
