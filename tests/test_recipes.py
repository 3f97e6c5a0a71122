"""The paper recipes (``+experiment=ptb_paper`` / ``wt2_paper``): they compose to the numbers of
the CRTN authors' script (CRTN/runfn.sh) for ``model=crtn`` and ``model=txl`` with identical
training, pass validation, and build a model that trains (one forward and backward)."""

from __future__ import annotations

import pytest
import torch

from crtn.config import resolve
from crtn.model import build_model, resolve_spec
from tests.test_config import composed, flat

#: the authors' runfn.sh, key by key
RECIPE = {
    "model.n_layer": 12,
    "model.d_model": 400,
    "model.n_head": 10,
    "model.d_head": 40,
    "model.d_inner": 1024,
    "model.tgt_len": 80,
    "model.mem_len": 80,
    "model.cutoffs": [2000, 4000, 8000],
    "model.tie_weight": True,
    "model.dropout": 0.6,
    "model.dropatt": 0.3,
    "model.dropatt_out": 0.3,
    "model.dropemb": 0.15,
    "model.dropinp": 0.65,
    "model.locked_dropout": True,
    "model.dropfor": 0.25,
    "cache.n_slot": 5,
    "cache.top_k": 2,
    "data.batch_size": 30,
    "data.eval_batch_size": 10,
    "optim.name": "adam",
    "optim.lr": 8e-4,
    "optim.warmup_step": 20000,
    "optim.scheduler": "cosine",
    "optim.eta_min": 1e-4,
    "optim.clip": 0.25,
    "optim.weight_decay": 7e-6,
    "optim.emb_lr_mult": 2.0,
    "train.max_epoch": 250,
    "train.avg_start": 0.8,
    "train.tar": 0.05,
}
VOCAB = {"ptb": 10000, "wt2": 33278}


@pytest.mark.parametrize("recipe,data", [("ptb_paper", "ptb"), ("wt2_paper", "wt2")])
def test_recipe_composes_identically_for_crtn_and_txl(recipe, data):
    cfgs = {m: composed("train", [f"+experiment={recipe}", f"model={m}"]) for m in ("crtn", "txl")}
    flats = {m: flat(c) for m, c in cfgs.items()}
    for m, f in flats.items():
        assert {k: f[k] for k in RECIPE} == RECIPE, m
        assert f["data.name"] == data and f["model.name"] == m
        resolve(cfgs[m])
    # identical training: only the model's name differs
    assert {k for k in flats["crtn"] if flats["crtn"][k] != flats["txl"][k]} == {"model.name"}


def test_wt2_recipe_is_the_ptb_recipe_on_wt2():
    ptb = flat(composed("train", ["+experiment=ptb_paper"]))
    wt2 = flat(composed("train", ["+experiment=wt2_paper"]))
    assert {k for k in ptb if ptb[k] != wt2[k]} == {"data.name", "data.dir"}


@pytest.mark.parametrize("model", ["crtn", "txl", "crtn_original"])
@pytest.mark.parametrize("recipe,data", [("ptb_paper", "ptb"), ("wt2_paper", "wt2")])
def test_recipe_builds_and_trains(recipe, data, model):
    cfg = composed("train", [f"+experiment={recipe}", f"model={model}"])
    torch.manual_seed(0)
    lm = build_model(resolve_spec(cfg), VOCAB[data]).train()
    assert lm.n_layer == 12 and lm.d_model == 400 and lm.tgt_len == 80
    assert lm.word_emb.emb_layers[0].weight is lm.crit.out_layers[0].weight  # tied
    x = torch.randint(0, VOCAB[data], (1, 81))
    out = lm(x[:, :-1], x[:, 1:])
    out.nll.mean().backward()
    assert torch.isfinite(out.nll).all() and lm.layers[0].pos_ff.CoreNet[0].weight.grad is not None
