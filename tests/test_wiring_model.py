"""Every option of the model's groups (``model.*``, ``cache.*``, ``query.*``, ``summary.*``) reaches
the model it documents: set on the command line, it shows in the built modules, the cache or a
forward pass, and does not without it (harness: tests/wiring.py)."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import faiss
import pytest
import torch
from torch import nn

import crtn.model.flex as flex_module
import crtn.model.grouped as grouped
import crtn.model.retrieved as retrieved
import crtn.model.retriever as retriever_module
from crtn.model import CRTN, TransformerLM, hardware, resolve_spec, with_spec
from crtn.model.dropout import LockedDropout
from crtn.model.faiss_index import FaissRows
from crtn.model.summary import Mean
from tests.wiring import Ctx, Wire, build, run_wire, steps, tokens

LAST_STATE = "summary.name=last_state"
FAISS = ("cache.backend=faiss", "cache.alpha_norm=topk", LAST_STATE)
LOOKUP = ("query.strategy=lookup", "summary.name=token_max", "cache.top_k=1", "cache.alpha_norm=topk")


def layers_all(ctx: Ctx, test) -> None:
    """``test(layer)`` holds for every layer with the value and for none without it."""
    assert all(test(layer) for layer in build(ctx.on).layers)
    assert not any(test(layer) for layer in build(ctx.off).layers)


def last_state(ctx: Ctx, n_seg: int, *, spec=None, train: bool = False):
    """The CRTN state after ``n_seg`` segments of two streams (model of ``spec``, default ``ctx.on``)."""
    model = build(ctx.on if spec is None else spec).train(train)
    return steps(model, tokens(n_seg))[-1].state


# ------------------------------------------------------------------ model.*
def rates(model: TransformerLM) -> dict[str, list[float]]:
    """Every dropout rate of a model, by the key documented to set it."""
    dropouts = (nn.Dropout, LockedDropout)
    return {
        "dropout": [model.drop.p],  # the top-layer output
        "dropinp": [model.drop_inp.p],
        "dropemb": [model.dropemb],
        "dropatt": [layer.dec_attn.dropatt.p for layer in model.layers],
        "dropatt_out": [layer.dec_attn.drop.p for layer in model.layers],
        "dropfor": [m.p for layer in model.layers for m in layer.pos_ff.CoreNet if isinstance(m, dropouts)],
    }


def only_rates(**changed: float):
    """Exactly the rates named (by :func:`rates`' keys) take the value; every other stays the default."""

    def check(ctx: Ctx) -> None:
        on, off = rates(build(ctx.on)), rates(build(ctx.off))
        for name, values in on.items():
            want = [changed[name]] * len(values) if name in changed else off[name]
            assert values == pytest.approx(want), name
            assert values and (name not in changed or off[name] != values), name

    return check


def check_name(ctx: Ctx) -> None:
    assert type(build(ctx.on)) is TransformerLM and type(build(ctx.off)) is CRTN
    assert build(ctx.on).init_state(2).cache is None


def check_n_layer(ctx: Ctx) -> None:
    assert len(build(ctx.on).layers) == 3 and len(build(ctx.off).layers) == 2


def check_n_head(ctx: Ctx) -> None:
    model = build(ctx.on)
    assert model.r_w_bias.shape == (4, 8)
    for layer in model.layers:
        assert layer.dec_attn.n_head == 4 and layer.dec_attn.qkv_net.out_features == 3 * 4 * 8
    assert build(ctx.off).layers[0].dec_attn.n_head == 2


def check_d_model(ctx: Ctx) -> None:
    model = build(ctx.on).eval()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(m.normalized_shape == (24,) for m in norms)
    assert steps(model, tokens(1))[0].hidden.shape == (2, 4, 24)
    assert steps(build(ctx.off).eval(), tokens(1))[0].hidden.shape == (2, 4, 16)


def check_d_head(ctx: Ctx) -> None:
    for layer in build(ctx.on).layers:
        assert layer.dec_attn.d_head == 6 and layer.dec_attn.qkv_net.out_features == 3 * 2 * 6
    assert build(ctx.on).r_r_bias.shape == (2, 6) and build(ctx.off).r_r_bias.shape == (2, 8)


def check_d_inner(ctx: Ctx) -> None:
    layers_all(
        ctx, lambda layer: layer.pos_ff.CoreNet[0].out_features == 20 == layer.pos_ff.CoreNet[3].in_features
    )


def check_d_embed(ctx: Ctx) -> None:
    emb = build(ctx.on).word_emb
    assert emb.emb_layers[0].weight.shape == (20, 8) and emb.emb_projs[0].shape == (16, 8)
    assert build(ctx.off).word_emb.emb_layers[0].weight.shape == (20, 16)


def locked(model: TransformerLM) -> tuple[list[bool], bool]:
    """Which dropouts are locked: (output, inputs, each layer's attention output and feed-forward
    dropouts), and the attention probabilities' dropout."""
    lockable = [model.drop, model.drop_inp]
    for layer in model.layers:
        lockable += [layer.dec_attn.drop, layer.pos_ff.CoreNet[2], layer.pos_ff.CoreNet[4]]
    probs = any(isinstance(layer.dec_attn.dropatt, LockedDropout) for layer in model.layers)
    return [isinstance(m, LockedDropout) for m in lockable], probs


def check_locked(ctx: Ctx) -> None:
    assert locked(build(ctx.on)) == ([True] * 8, False)  # attention probabilities: never locked
    assert locked(build(ctx.off)) == ([False] * 8, False)


def check_pre_lnorm(ctx: Ctx) -> None:
    layers_all(ctx, lambda layer: layer.dec_attn.pre_lnorm and layer.pos_ff.pre_lnorm)


def check_tgt_len(ctx: Ctx) -> None:
    model = build(ctx.on)
    assert (model.tgt_len, model.mem_len, model.summary.seg_len) == (6, 6, 6)  # mem_len: tgt_len
    assert build(ctx.off).tgt_len == 4


def check_mem_len(ctx: Ctx) -> None:
    assert last_state(ctx, 3).mem.shape[2] == 8
    assert last_state(ctx, 3, spec=ctx.off).mem.shape[2] == 4


def check_clamp_len(ctx: Ctx) -> None:
    def table(spec):  # embeddings of the distances 5, 4, ..., 0
        return build(spec).eval()._position_embeddings(6, None, torch.float64, "cpu")[0]

    on, off = table(ctx.on), table(ctx.off)
    assert all(torch.equal(on[i], on[3]) for i in range(4)) and not torch.equal(on[3], on[4])  # 5..2 -> 2
    assert not torch.equal(off[0], off[3])


def check_same_length(ctx: Ctx) -> None:
    def visible(spec):  # keys each query sees over one segment of memory
        return (~build(spec)._attn_mask(4, 4, "cpu")).sum(1).tolist()

    assert visible(ctx.on) == [4, 4, 4, 4] and visible(ctx.off) == [5, 6, 7, 8]


def check_untie_r(ctx: Ctx) -> None:
    on, off = build(ctx.on), build(ctx.off)
    assert not hasattr(on, "r_w_bias") and all(hasattr(layer.dec_attn, "r_w_bias") for layer in on.layers)
    assert hasattr(off, "r_w_bias") and not any(hasattr(layer.dec_attn, "r_w_bias") for layer in off.layers)


def check_cutoffs(ctx: Ctx) -> None:
    crit = build(ctx.on).crit
    assert crit.cutoffs == [5, 10, 20] and crit.n_clusters == 2 and crit.cluster_weight.shape == (2, 16)
    assert build(ctx.off).crit.n_clusters == 0


def check_div_val(ctx: Ctx) -> None:
    dims = [layer.embedding_dim for layer in build(ctx.on).word_emb.emb_layers]
    assert dims == [16, 8, 4] and [e.embedding_dim for e in build(ctx.off).word_emb.emb_layers] == [16]


def check_tie_weight(ctx: Ctx) -> None:
    on, off = build(ctx.on), build(ctx.off)
    assert on.crit.out_layers[0].weight is not on.word_emb.emb_layers[0].weight
    assert off.crit.out_layers[0].weight is off.word_emb.emb_layers[0].weight


def check_tie_projs(ctx: Ctx) -> None:
    def tied(model):
        return [a is b for a, b in zip(model.crit.out_projs, model.word_emb.emb_projs)]

    assert tied(build(ctx.on)) == [False, True, False]
    assert tied(build(ctx.off)) == [False, True, True]  # the default: [False] + [True] * len(cutoffs)


def check_init_std(ctx: Ctx) -> None:
    assert build(ctx.on).layers[0].dec_attn.qkv_net.weight.std().item() == pytest.approx(0.5, rel=0.15)
    assert build(ctx.off).layers[0].dec_attn.qkv_net.weight.std().item() == pytest.approx(0.02, rel=0.15)


def check_proj_init_std(ctx: Ctx) -> None:
    assert build(ctx.on).word_emb.emb_projs[0].std().item() == pytest.approx(0.5, rel=0.2)
    assert build(ctx.off).word_emb.emb_projs[0].std().item() == pytest.approx(0.01, rel=0.2)


def check_layer_norm_eps(ctx: Ctx) -> None:
    for spec, eps in ((ctx.on, 1e-3), (ctx.off, 1e-5)):
        norms = [m for m in build(spec).modules() if isinstance(m, nn.LayerNorm)]
        assert norms and all(m.eps == eps for m in norms)


def check_flex(ctx: Ctx) -> None:
    layers_all(ctx, lambda layer: layer.dec_attn.flex)
    for spec, used in ((ctx.on, True), (ctx.off, False)):
        with mock.patch.object(flex_module, "rel_attention", wraps=flex_module.rel_attention) as spy:
            steps(build(spec).eval(), tokens(1))
        assert spy.called == used


# ------------------------------------------------------------------ cache.*
def check_n_slot(ctx: Ctx) -> None:
    assert build(ctx.on).init_state(2).cache.n_slot == 6
    assert last_state(ctx, 9).cache.n_valid == 6 and last_state(ctx, 9, spec=ctx.off).cache.n_valid == 4


def selections(spec, n_seg: int = 6, model=None):
    model = build(spec).eval() if model is None else model
    return [o.selection for o in steps(model, tokens(n_seg)) if o.selection is not None]


def check_top_k(ctx: Ctx) -> None:
    assert selections(ctx.on)[-1].slot.shape == (2, 4, 3)
    assert selections(ctx.off)[-1].slot.shape == (2, 4, 1)


def check_alpha_norm(ctx: Ctx) -> None:
    on, off = selections(ctx.on)[-1].alpha.sum(-1), selections(ctx.off)[-1].alpha.sum(-1)
    assert (on < 1 - 1e-4).all()  # all: the k selected of a softmax over every slot
    torch.testing.assert_close(off, torch.ones_like(off))  # topk: a softmax over the k selected


def check_weighted(ctx: Ctx) -> None:
    """Unweighted values make the output independent of alpha (here: of alpha_norm, which changes
    alpha but not the slots selected); weighted ones not."""

    def nll(spec, alpha_norm):
        model = build(spec).eval()
        model = with_spec(
            model, resolve_spec(replace(spec, cache=replace(spec.cache, alpha_norm=alpha_norm)))
        )
        return torch.stack([o.nll for o in steps(model, tokens(6))])

    assert build(ctx.on).weighted is False
    torch.testing.assert_close(nll(ctx.on, "all"), nll(ctx.on, "topk"), rtol=0, atol=0)
    assert not torch.allclose(nll(ctx.off, "all"), nll(ctx.off, "topk"))


def check_pos(ctx: Ctx) -> None:
    """real: position terms at the rows' stream distances; concat: none besides the concatenated
    context's; match, the default of the base's token_max (and its default summary=mean's
    concat): terms placed by each selection's best rows."""
    concat, mean = ctx.spec("cache.pos=concat", value=False), ctx.spec("summary=mean", value=False)
    for spec, mode in ((ctx.on, "real"), (ctx.off, "match"), (concat, "concat"), (mean, "concat")):
        assert build(spec).pos_mode == mode
        with (
            mock.patch.object(
                retriever_module, "RealPositions", wraps=retriever_module.RealPositions
            ) as real,
            mock.patch.object(
                retriever_module, "MatchPositions", wraps=retriever_module.MatchPositions
            ) as by_row,
        ):
            found = selections(spec)
        assert real.called is (mode == "real") and by_row.called is (mode == "match")
        assert all((sel.row is not None) is (mode == "match") for sel in found)


def check_backend(ctx: Ctx) -> None:
    assert isinstance(last_state(ctx, 4).cache._faiss, FaissRows)
    assert last_state(ctx, 4, spec=ctx.off).cache._faiss is None


def faiss_index(ctx: Ctx, spec=None):
    return last_state(ctx, 4, spec=spec).cache._faiss.indexes[0]


def check_faiss_index(ctx: Ctx) -> None:
    assert isinstance(faiss_index(ctx), faiss.IndexHNSWFlat) and faiss_index(ctx).hnsw.efConstruction == 64
    assert isinstance(faiss_index(ctx, ctx.off), faiss.IndexFlatIP)


def check_layers(ctx: Ctx) -> None:
    """Retrieval in the top layer only: the cache stores that layer's input (layer 1) alone."""
    assert build(ctx.on).retrieve_from == 1 and build(ctx.off).retrieve_from == 0
    assert last_state(ctx, 3).cache.values.shape[0] == 1
    assert last_state(ctx, 3, spec=ctx.off).cache.values.shape[0] == 3


def check_key_layer(ctx: Ctx) -> None:
    """last_state keys are the last row of the slot's states at the key layer (the keys in the
    states' dtype, the values in the cache's: the same numbers rounded alike)."""
    for spec, layer in ((ctx.on, 1), (ctx.off, 2)):
        assert build(spec).key_layer == layer
        cache = last_state(ctx, 5, spec=spec).cache
        cache.commit()
        nv = cache.n_valid
        keys = cache.keys[:, :nv].to(cache.values.dtype)
        torch.testing.assert_close(keys, cache.layer_values(layer)[:, :nv, -1], rtol=0, atol=0)


def check_dtype(ctx: Ctx) -> None:
    assert last_state(ctx, 3).cache.values.dtype == torch.float16
    assert last_state(ctx, 3, spec=ctx.off).cache.values.dtype == torch.bfloat16  # the default


def check_product_dtype(ctx: Ctx) -> None:
    """The retrieved rows, stored in bfloat16 (the default), are multiplied in float32 with the
    option; without it in bfloat16 (as stored) on a CPU with bfloat16 units, in float32 on one
    without (``crtn.model.hardware``; each CPU reported as such here). The folding's products
    with W_{k,E} and W_v run in the 16-bit product dtype too, in the model's float32 otherwise."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    folds: list[torch.dtype] = []
    real, real_fold = grouped._TileProduct.forward, retrieved.weights_dtype

    def spy(c, x, values, groups, to_rows, normalize, eps, dtype):
        seen.append((values.dtype, dtype))
        return real(c, x, values, groups, to_rows, normalize, eps, dtype)

    def spy_fold(dtype, x):
        folds.append(real_fold(dtype, x))
        return folds[-1]

    def run(spec, units: dict) -> tuple[set, set]:
        seen.clear()
        folds.clear()
        with mock.patch.object(hardware, "cpu_features", lambda: units):
            last_state(ctx, 6, spec=spec, train=True)
        return set(seen), set(folds)

    with (
        mock.patch.object(grouped._TileProduct, "forward", staticmethod(spy)),
        mock.patch.object(retrieved, "weights_dtype", spy_fold),
    ):
        for units in ({"avx512_bf16": True}, {}):  # the option holds on either CPU
            assert run(ctx.on, units) == ({(torch.bfloat16, torch.float32)}, {torch.float32})
        as_stored = run(ctx.off, {"amx_bf16": True})
        without_units = run(ctx.off, {"avx2": True})
    assert as_stored == ({(torch.bfloat16, torch.bfloat16)}, {torch.bfloat16})
    assert without_units == ({(torch.bfloat16, torch.float32)}, {torch.float32})


# ------------------------------------------------------------------ query.*, summary.*
def check_strategy(ctx: Ctx) -> None:
    assert build(ctx.on).query.strategy == "last_l" and build(ctx.off).query.strategy == "token"


def check_detach(ctx: Ctx) -> None:
    """With query.detach the query pass gets no gradient: token queries (no weights of their own)
    with last_state keys give weights alpha outside the graph."""
    for spec, detached in ((ctx.on, True), (ctx.off, False)):
        model = build(spec).train()
        assert model.detach is detached
        alpha = [o.selection.alpha for o in steps(model, tokens(4)) if o.selection is not None][-1]
        assert alpha.requires_grad is not detached


def check_max_match(ctx: Ctx) -> None:
    """The lengths a lookup tries end at query.max_match, and the tokens it keeps before the
    segment are the memory's and that many more."""
    on, off = build(ctx.on), build(ctx.off)
    assert (on.match_lengths, off.match_lengths) == ((4, 8), (4, 8, 16))
    assert (on.history_len - on.mem_len, off.history_len - off.mem_len) == (8, 16)


def check_summary_name(ctx: Ctx) -> None:
    assert isinstance(build(ctx.on).summary, Mean) and build(ctx.off).summary.name == "token_max"


def check_d_key(ctx: Ctx) -> None:
    summary = build(ctx.on).summary
    assert summary.d_key == 6 and summary.proj_q.weight.shape == summary.proj_k.weight.shape == (6, 16)
    assert build(ctx.off).summary.proj_q is None


def check_ngram(ctx: Ctx) -> None:
    on, off = build(ctx.on).summary, build(ctx.off).summary
    assert (on.ngram, on.query_lead_rows) == (2, 1) and (off.ngram, off.query_lead_rows) == (4, 3)


def check_shift(ctx: Ctx) -> None:
    on, off = build(ctx.on).summary, build(ctx.off).summary
    assert (on.shift, on.lead_rows) == (0, 3) and (off.shift, off.lead_rows) == (1, 4)


def check_cosine(ctx: Ctx) -> None:
    """A row five times the query scores its cosine, 1, with the option; 5 |q|^2 / sqrt(d) without."""
    q = torch.randn(1, 1, 16)
    rows = 5 * q[:, :, None, None, :]  # [B, L, k=1, rows=1, d]
    on, off = build(ctx.on).summary.score_selected(q, rows), build(ctx.off).summary.score_selected(q, rows)
    torch.testing.assert_close(on, torch.ones(1, 1, 1))
    torch.testing.assert_close(off, 5 * q.pow(2).sum().view(1, 1, 1) / 4)


ADAPTIVE = ("model.cutoffs=[5,10]",)
MODEL_WIRING: dict[str, Wire] = {
    "model.name": Wire("txl", check_name),
    "model.n_layer": Wire(3, check_n_layer),
    "model.n_head": Wire(4, check_n_head),
    "model.d_model": Wire(24, check_d_model),
    "model.d_head": Wire(6, check_d_head),
    "model.d_inner": Wire(20, check_d_inner),
    "model.d_embed": Wire(8, check_d_embed),
    "model.dropout": Wire(0.1, only_rates(dropout=0.1, dropinp=0.1, dropfor=0.1, dropatt_out=0.1)),
    "model.dropatt": Wire(0.2, only_rates(dropatt=0.2)),
    "model.dropemb": Wire(0.3, only_rates(dropemb=0.3)),
    "model.dropinp": Wire(0.15, only_rates(dropinp=0.15)),
    "model.dropfor": Wire(0.25, only_rates(dropfor=0.25)),
    "model.dropatt_out": Wire(0.35, only_rates(dropatt_out=0.35)),
    "model.locked_dropout": Wire(True, check_locked),
    "model.tgt_len": Wire(6, check_tgt_len),
    "model.mem_len": Wire(8, check_mem_len),
    "model.clamp_len": Wire(2, check_clamp_len),
    "model.same_length": Wire(True, check_same_length),
    "model.pre_lnorm": Wire(True, check_pre_lnorm),
    "model.untie_r": Wire(True, check_untie_r),
    "model.cutoffs": Wire([5, 10], check_cutoffs),
    "model.div_val": Wire(2, check_div_val, extra=ADAPTIVE),
    "model.tie_weight": Wire(False, check_tie_weight),
    "model.tie_projs": Wire([False, True, False], check_tie_projs, extra=(*ADAPTIVE, "model.div_val=2")),
    "model.init_std": Wire(0.5, check_init_std),
    "model.proj_init_std": Wire(0.5, check_proj_init_std, extra=("model.d_embed=8",)),
    "model.layer_norm_eps": Wire(1e-3, check_layer_norm_eps),
    "model.flex": Wire(True, check_flex),
    "cache.n_slot": Wire(6, check_n_slot),
    "cache.top_k": Wire(3, check_top_k),
    "cache.alpha_norm": Wire("all", check_alpha_norm, extra=("cache.top_k=2",)),
    "cache.weighted": Wire(False, check_weighted),
    "cache.pos": Wire("real", check_pos),
    "cache.backend": Wire("faiss", check_backend, extra=FAISS[1:]),
    "cache.faiss_index": Wire("hnsw", check_faiss_index, extra=FAISS),
    "cache.layers": Wire(1, check_layers),
    "cache.key_layer": Wire(1, check_key_layer, extra=(LAST_STATE,)),
    "cache.dtype": Wire("float16", check_dtype),
    "cache.product_dtype": Wire("float32", check_product_dtype),
    "query.strategy": Wire("last_l", check_strategy, extra=(LAST_STATE,)),
    # alpha below 1 (alpha_norm all): with an alpha of 1 the selection has no gradient to stop
    "query.detach": Wire(True, check_detach, extra=(LAST_STATE, "cache.alpha_norm=all")),
    "query.max_match": Wire(8, check_max_match, extra=LOOKUP),
    "summary.name": Wire("mean", check_summary_name),
    "summary.d_key": Wire(6, check_d_key),
    "summary.ngram": Wire(2, check_ngram),
    "summary.shift": Wire(0, check_shift),
    "summary.cosine": Wire(True, check_cosine),
}


@pytest.mark.parametrize("key", list(MODEL_WIRING))
def test_model_option_is_wired(key, tmp_path):
    run_wire(MODEL_WIRING, key, tmp_path)
