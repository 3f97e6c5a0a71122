"""Retrieved rows grouped by slot (crtn/model/grouped.py; docs/method.md §3, "Efficient main pass"),
and read token by token (the GPU's form).

The products are checked against gathering every token's rows explicitly, the tile layout and
the tile size against values worked out by hand, and the model that uses them against the naive
per-token float64 references (tests/reference.py, tests/reference_gate.py) to 1e-10 in outputs
and parameter gradients, with tile sizes and chunks forced small so that slots span several
tiles, tiles hold padding, and the rows are read in several chunks.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

import crtn.model.grouped as grouped
import crtn.model.retrieved as retrieved
from crtn.model.grouped import SlotGroups, TokenRows, choose_tile, grouped_product, pairs_of
from tests.helpers import once_per_run
from tests.test_crtn_reference import naive_run, run_both

ATOL = 1e-10


def _explicit(x: torch.Tensor, values: torch.Tensor, index: torch.Tensor, to_rows: bool, normalize: bool):
    """The products by gathering every token's k·Ls rows (the definition)."""
    T, k = index.shape
    z = values[index].reshape(T, k * values.shape[1], values.shape[2])
    if normalize:
        z = F.layer_norm(z, (z.shape[-1],))
    return x @ z.transpose(1, 2) if to_rows else x @ z


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("size", [1, 2, 3, 64, None, "token_rows"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("to_rows", [True, False], ids=["to_rows", "from_rows"])
def test_grouped_product_equals_the_explicit_gather(to_rows, normalize, size, k, monkeypatch):
    """Every tile size (1: no padding; 2, 3: slots over several tiles, padding; 64: one tile per
    slot; None: the cost model's), rows read one tile per chunk, and the token-by-token form
    (:class:`TokenRows`, a GPU's); k = 2 with a token selecting a slot twice, and k = 1 (the pairs
    are the tokens: ``from_rows`` returns its buffer without a sum); heads 3; values and
    gradients to 1e-12 in float64, the gradient arriving in a transposed layout (as the
    mixture's does in the model), and gradcheck."""
    monkeypatch.setattr(grouped, "CHUNK_VALUES", 1)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 4, 5, dtype=torch.float64, generator=g)  # 6 slots of 4 rows, d = 5
    index = torch.randint(0, 6, (9, k), generator=g)  # 9 tokens
    index[0] = 3  # a slot twice where k = 2
    shape = (9, 3, 5) if to_rows else (9, 3, 4 * k)
    x = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    groups = TokenRows.of(index) if size == "token_rows" else SlotGroups.of(index, size=size)
    out = grouped_product(x, values, groups, to_rows=to_rows, normalize=normalize)
    x_ref = x.detach().clone().requires_grad_()
    ref = _explicit(x_ref, values, index, to_rows, normalize)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # the weights made [H, T, X] and viewed [T, H, X]: a transposed gradient
    w = torch.randn(ref.shape[1], ref.shape[0], ref.shape[2], dtype=torch.float64, generator=g).transpose(
        0, 1
    )
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    fn = lambda y: grouped_product(y, values, groups, to_rows=to_rows, normalize=normalize)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x.detach().requires_grad_(),))


def test_pairs_take_the_form_of_their_device_and_size(monkeypatch):
    """A CPU selection is grouped by slot; another device's is read token by token (a meta tensor
    stands for a GPU here: only its device type is read), unless its gathered rows would exceed
    GATHER_VALUES: 3 tokens x 2 slots x 4 rows x 5 = 120 values."""
    meta = torch.zeros(3, 2, dtype=torch.long, device="meta")
    assert isinstance(pairs_of(torch.tensor([[0, 1]]), (4, 5)), SlotGroups)
    assert isinstance(pairs_of(meta, (4, 5)), TokenRows)
    monkeypatch.setattr(grouped, "GATHER_VALUES", 120)
    assert isinstance(pairs_of(meta, (4, 5)), TokenRows)
    monkeypatch.setattr(grouped, "GATHER_VALUES", 119)
    monkeypatch.setattr(SlotGroups, "of", classmethod(lambda cls, index: "grouped by slot"))
    assert pairs_of(meta, (4, 5)) == "grouped by slot"  # a meta selection cannot be grouped itself


@pytest.mark.parametrize("form", ["slot_groups", "token_rows"])
@pytest.mark.parametrize("chunk", [1, None], ids=["tile_per_chunk", "one_chunk"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("to_rows", [True, False], ids=["to_rows", "from_rows"])
def test_bfloat16_products_round_once_like_a_bfloat16_matrix_product(
    to_rows, normalize, chunk, form, monkeypatch
):
    """Products in bfloat16 of float32 operands with bfloat16 rows (``cache.product_dtype``'s
    default with ``cache.dtype=bfloat16``): the operand is rounded to bfloat16, and the result
    and the gradient, returned in float32, are within 2·2^-8 of the sum of the absolute terms of
    the float64 products of the rounded operands (the operand and the result each rounded once,
    2^-8 each; 3·2^-8 with pre-LN, whose normalised rows are rounded too). The float32 products of
    the same rows
    (``dtype=float32``) differ from them: the bfloat16 path is the one that ran. Both forms: tiles
    of 2 pairs, and token by token (its sum over the k slots inside one product, rounded once)."""
    if chunk is not None:
        monkeypatch.setattr(grouped, "CHUNK_VALUES_16", chunk)
    g = torch.Generator().manual_seed(1)
    values = torch.randn(6, 4, 16, generator=g).to(torch.bfloat16)  # 6 slots of 4 rows, d = 16
    index = torch.randint(0, 6, (9, 2), generator=g)
    shape = (9, 3, 16) if to_rows else (9, 3, 8)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    groups = SlotGroups.of(index, size=2) if form == "slot_groups" else TokenRows.of(index)
    out = grouped_product(x, values, groups, to_rows=to_rows, normalize=normalize)
    assert out.dtype == torch.float32
    x64 = x.detach().to(torch.bfloat16).double().requires_grad_()
    exact = _explicit(x64, values.double(), index, to_rows, normalize)
    rows = F.layer_norm(values.double(), (16,)) if normalize else values.double()
    terms = _explicit(x64.detach().abs(), rows.abs(), index, to_rows, False)
    bound = (3 if normalize else 2) * 2**-8
    assert bool(((out.double() - exact).abs() <= bound * terms).all())
    w = torch.randn(exact.shape, generator=g)
    (out * w).sum().backward()
    w64 = w.to(torch.bfloat16).double()
    (exact * w64).sum().backward()
    grad_terms = _explicit(w64.abs(), rows.abs(), index, not to_rows, False)
    assert x.grad.dtype == torch.float32
    assert bool(((x.grad.double() - x64.grad).abs() <= bound * grad_terms).all())
    f32 = grouped_product(x, values, groups, to_rows=to_rows, normalize=normalize, dtype=torch.float32)
    assert not torch.equal(f32, out)


def test_slot_groups_layout_by_hand():
    """Tokens 0..2 select slots [0, 2], [2, 3], [2, 0]: pairs t·k + p = 0..5. With tiles of 2
    pairs, slot 0 holds pairs 0 and 5 (one tile), slot 2 pairs 1, 2, 4 (two tiles, the second
    padded), slot 3 pair 3 (one padded tile)."""
    groups = SlotGroups.of(torch.tensor([[0, 2], [2, 3], [2, 0]]), size=2)
    assert groups.slots.tolist() == [0, 2, 2, 3]
    assert groups.place.tolist() == [0, 2, 3, 6, 4, 1]
    assert groups.pair.tolist() == [0, 5, 1, 2, 4, 6, 3, 6]  # 6 = T·k: padding
    assert groups.token.tolist() == [0, 2, 0, 1, 2, 0, 1, 0]


def test_choose_tile_by_hand():
    """Groups of 10, 1 and 1 pairs, a row read costing 4 pairs: P = 1 costs 12·5 = 60, P = 2
    7·6 = 42, P = 4 5·8 = 40, P = 8 4·12 = 48, P = 10 (the largest group) 3·14 = 42: P = 4.
    Groups of 6 and 6: P = 6 costs 2·10 = 20, P = 4 4·8 = 32: the largest group."""
    assert grouped.ROW_READ_PAIRS == 4.0
    assert choose_tile(torch.tensor([10, 1, 1])) == 4
    assert choose_tile(torch.tensor([6, 6])) == 6
    assert choose_tile(torch.tensor([1, 1, 1])) == 1


def test_bad_tile_size_raises():
    with pytest.raises(ValueError, match="tile size 0"):
        SlotGroups.of(torch.tensor([[0, 1]]), size=0)


GATE = {"query.strategy": "gate"}
#: both retrievers (the query pass's selection shared by the layers; each layer's own, shared by
#: the heads or per head), alpha variants, k = 1 and k > filled slots, cache.layers, pre-LN (the
#: rows normalised per chunk), unweighted values and real positions
MODELS = {
    "query_all": {},
    "query_topk_k1": {"cache.alpha_norm": "topk", "cache.top_k": 1},
    "query_original_layers_1": {"cache.alpha_norm": "original", "cache.layers": 1},
    "query_token_max_pre_ln": {"summary.name": "token_max", "model.pre_lnorm": True},
    "query_k_gt_n_mem0": {"cache.n_slot": 2, "cache.top_k": 3, "model.mem_len": 0},
    "query_real_unweighted": {"cache.pos": "real", "cache.weighted": False},
    "gate_mean": {**GATE, "summary.name": "mean"},
    "gate_token_max_topk_k1": {
        **GATE,
        "summary.name": "token_max",
        "cache.alpha_norm": "topk",
        "cache.top_k": 1,
    },
    "gate_original_layers_2_of_3": {
        **GATE,
        "summary.name": "mean",
        "cache.alpha_norm": "original",
        "model.n_layer": 3,
        "cache.layers": 2,
    },
    "gate_pre_ln": {**GATE, "summary.name": "last_state", "model.pre_lnorm": True},
    "gate_k_gt_n": {**GATE, "summary.name": "mean", "cache.n_slot": 2, "cache.top_k": 3, "model.mem_len": 6},
}


def naive_once(model, tokens: torch.Tensor, steps: int, grad: bool) -> tuple:
    """:func:`tests.test_crtn_reference.naive_run`, once per model config, weights, tokens and
    steps: the four forms of one variant differ in how the model reads its rows (the patches
    below), not in the reference's inputs, so they share one reference run
    (:func:`tests.helpers.once_per_run`: the four may land on either pytest-xdist worker)."""
    key = hashlib.sha256(repr((model.spec, steps, grad)).encode())
    for p in model.state_dict().values():
        key.update(p.detach().numpy().tobytes())
    key.update(tokens.numpy().tobytes())
    return once_per_run(key.hexdigest(), lambda: naive_run(model, tokens, steps, grad))


@pytest.mark.parametrize("size", [1, 2, None, "token_rows"], ids=["tile1", "tile2", "chosen", "token_rows"])
@pytest.mark.parametrize("variant", list(MODELS.values()), ids=list(MODELS))
def test_model_matches_the_naive_reference_to_1e_10(variant, size, monkeypatch):
    """NLL, selections and every parameter gradient against the per-token float64 reference,
    over segments that fill the cache (fewer filled slots than k at first) and evict, with the
    rows read one tile per chunk; and with the pairs read token by token (a GPU's form)."""
    monkeypatch.setattr(grouped, "CHUNK_VALUES", 1)
    if size == "token_rows":
        monkeypatch.setattr(retrieved, "pairs_of", lambda index, rows: TokenRows.of(index))
    elif size is not None:
        monkeypatch.setattr(grouped, "choose_tile", lambda count: size)
    run_both(steps=6, grad=True, atol=ATOL, grad_atol=ATOL, naive=naive_once, **variant)
