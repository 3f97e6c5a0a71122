"""Tests of crtn.model.adaptive: adaptive input and projected adaptive log-softmax.

References used here: the defining formulae (hand-built), and Hugging Face
transformers 4.35's Transformer-XL modules (a test dependency: imported at the
top so that the tests fail, not skip, when it is missing).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.models.transfo_xl.modeling_transfo_xl import (
    AdaptiveEmbedding as HFEmbedding,
)
from transformers.models.transfo_xl.modeling_transfo_xl_utilities import (
    ProjectedAdaptiveLogSoftmax as HFSoftmax,
)

from crtn.model.adaptive import (
    AdaptiveEmbedding,
    ProjectedAdaptiveLogSoftmax,
    flip_cluster_order,
    tie_adaptive_weights,
)

D = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-10}

# (n_token, d_embed, d_proj, cutoffs, div_val)
CONFIGS = [
    (23, 8, 8, [], 1),
    (23, 8, 6, [], 1),
    (23, 8, 8, [4, 9, 15], 1),
    (23, 8, 6, [4, 9, 15], 1),
    (23, 16, 8, [4, 9, 15], 2),
    (23, 8, 8, [4, 9, 15], 2),
    (23, 16, 16, [5, 11], 4),
    (23, 16, 12, [5], 4),
]
IDS = [f"V{c[0]}-e{c[1]}-p{c[2]}-cut{'_'.join(map(str, c[3])) or 'none'}-div{c[4]}" for c in CONFIGS]


def _randomize(module: torch.nn.Module, scale: float = 1.0) -> torch.nn.Module:
    """Large random values everywhere (biases too), so that every term matters."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return module


def _softmax(cfg, **kw) -> ProjectedAdaptiveLogSoftmax:
    n_token, d_embed, d_proj, cutoffs, div_val = cfg
    return _randomize(ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_proj, cutoffs, div_val, **kw).to(D))


def _embedding(cfg) -> AdaptiveEmbedding:
    n_token, d_embed, d_proj, cutoffs, div_val = cfg
    return _randomize(AdaptiveEmbedding(n_token, d_embed, d_proj, cutoffs, div_val).to(D))


def _targets_all_clusters(n_token: int, cutoffs: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """Random targets of ``shape`` that include both ends of every cluster."""
    ends = [0, *cutoffs, n_token]
    edges = [t for lo, hi in itertools.pairwise(ends) for t in (lo, hi - 1)]
    flat = torch.randint(0, n_token, shape).reshape(-1)
    flat[: len(edges)] = torch.tensor(edges)
    return flat[torch.randperm(flat.numel())].reshape(shape)


def _reference_log_prob(crit: ProjectedAdaptiveLogSoftmax, hidden: torch.Tensor, order: str) -> torch.Tensor:
    """Adaptive log-softmax written out from its definition, token by token."""
    ends, n_cl = crit.cutoff_ends, crit.n_clusters

    def weights(i):
        if crit.div_val == 1:
            w = crit.out_layers[0].weight[ends[i] : ends[i + 1]]
            b = crit.out_layers[0].bias[ends[i] : ends[i + 1]]
        else:
            w, b = crit.out_layers[i].weight, crit.out_layers[i].bias
        proj = crit.out_projs[i]
        x = hidden if proj is None else hidden @ proj
        return x, w, b

    x, w, b = weights(0)
    short = x @ w.T + b
    if n_cl == 0:
        return short - torch.logsumexp(short, dim=-1, keepdim=True)
    # row of cluster_weight used by tail cluster i
    row = {i: (n_cl - i if order == "release" else i - 1) for i in range(1, n_cl + 1)}
    cluster = x @ crit.cluster_weight.T + crit.cluster_bias
    log_z = torch.logsumexp(torch.cat([short, cluster], dim=-1), dim=-1, keepdim=True)
    out = [short - log_z]
    for i in range(1, n_cl + 1):
        xi, wi, bi = weights(i)
        tail = xi @ wi.T + bi
        tail = tail - torch.logsumexp(tail, dim=-1, keepdim=True)
        out.append(cluster[:, row[i] : row[i] + 1] - log_z + tail)
    return torch.cat(out, dim=-1)


# 1. normalisation -------------------------------------------------------------


@pytest.mark.parametrize("order", ["release", "hf"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_log_prob_normalised(cfg, order):
    crit = _softmax(cfg, cluster_order=order)
    hidden = torch.randn(3, 5, cfg[2], dtype=D) * 3
    lp = crit.log_prob(hidden)
    assert lp.shape == (3, 5, cfg[0]) and lp.dtype == D
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(3, 5, dtype=D), **TOL)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 5, dtype=D), **TOL)
    assert torch.isfinite(lp).all() and (lp <= 0).all()


# 2. forward == -gather(log_prob) ---------------------------------------------


@pytest.mark.parametrize("order", ["release", "hf"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_forward_matches_log_prob(cfg, order):
    crit = _softmax(cfg, cluster_order=order)
    hidden = torch.randn(4, 7, cfg[2], dtype=D) * 3
    target = _targets_all_clusters(cfg[0], cfg[3], (4, 7))
    nll = crit(hidden, target)
    assert nll.shape == target.shape and nll.dtype == D
    expected = -crit.log_prob(hidden).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(nll, expected, **TOL)
    # batch-agnostic: flat, 1-D and 0-D leading shapes give the same numbers
    torch.testing.assert_close(crit(hidden.reshape(-1, cfg[2]), target.reshape(-1)), nll.reshape(-1), **TOL)
    torch.testing.assert_close(crit(hidden[1, 2], target[1, 2]), nll[1, 2], **TOL)


def test_forward_with_empty_clusters_and_order_kept():
    cfg = (23, 16, 8, [4, 9, 15], 2)
    crit = _softmax(cfg)
    hidden = torch.randn(11, 8, dtype=D)
    target = torch.tensor([20, 1, 3, 22, 0, 16, 2, 21, 1, 3, 15])  # head and last cluster only
    nll = crit(hidden, target)
    expected = -crit.log_prob(hidden).gather(-1, target[:, None]).squeeze(-1)
    torch.testing.assert_close(nll, expected, **TOL)
    nll.sum().backward()
    # clusters 1 and 2 (tokens 4..14) hold no target: their layers are never evaluated
    assert crit.out_layers[1].weight.grad is None and crit.out_layers[2].weight.grad is None
    assert crit.out_layers[3].weight.grad is not None and crit.out_layers[0].weight.grad is not None


class _LinearRows(TorchFunctionMode):
    """Records the number of rows of every F.linear input."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
        return func(*args, **(kwargs or {}))


def test_forward_evaluates_tails_only_on_their_tokens():
    cfg = (23, 16, 8, [4, 9, 15], 2)  # 3 tail clusters, a projection each
    crit = _softmax(cfg)
    target = torch.tensor([0, 5, 6, 10, 10, 10, 1, 2, 3, 0])  # 2 in cluster 1, 3 in cluster 2, none in 3
    hidden = torch.randn(10, 8, dtype=D)
    with _LinearRows() as mode:
        crit(hidden, target)
    # head: projection + linear on all 10 rows; cluster 1: 2 rows; cluster 2: 3 rows
    assert mode.rows == [10, 10, 2, 2, 3, 3]


# 3. independent references --------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [c for c in CONFIGS if not c[3]],
    ids=[i for c, i in zip(CONFIGS, IDS) if not c[3]],
)
def test_no_cutoffs_is_plain_softmax(cfg):
    n_token, d_embed, d_proj, _, _ = cfg
    crit = _softmax(cfg)
    layer = torch.nn.Linear(d_proj, n_token, dtype=D)
    with torch.no_grad():
        proj = crit.out_projs[0]
        w = crit.out_layers[0].weight
        layer.weight.copy_(w if proj is None else w @ proj.T)
        layer.bias.copy_(crit.out_layers[0].bias)
    assert (proj is None) == (d_proj == d_embed)
    hidden = torch.randn(6, 5, d_proj, dtype=D)
    target = torch.randint(0, n_token, (6, 5))
    expected = F.log_softmax(layer(hidden), dim=-1)
    torch.testing.assert_close(crit.log_prob(hidden), expected, **TOL)
    torch.testing.assert_close(
        crit(hidden, target), -expected.gather(-1, target[..., None]).squeeze(-1), **TOL
    )


@pytest.mark.parametrize("order", ["release", "hf"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_matches_definition(cfg, order):
    crit = _softmax(cfg, cluster_order=order)
    hidden = torch.randn(9, cfg[2], dtype=D)
    torch.testing.assert_close(crit.log_prob(hidden), _reference_log_prob(crit, hidden, order), **TOL)


def test_cluster_orders_differ_and_flip():
    cfg = (23, 8, 6, [4, 9, 15], 1)
    rel = _softmax(cfg, cluster_order="release")
    hf = ProjectedAdaptiveLogSoftmax(*cfg, cluster_order="hf").to(D)
    hidden = torch.randn(9, 6, dtype=D)
    hf.load_state_dict(rel.state_dict())
    assert not torch.allclose(rel.log_prob(hidden), hf.log_prob(hidden))
    hf.load_state_dict(flip_cluster_order(rel.state_dict()))
    torch.testing.assert_close(rel.log_prob(hidden), hf.log_prob(hidden), **TOL)
    # with a single tail cluster the two orders coincide
    one = (23, 8, 6, [4], 1)
    a, b = (
        _softmax(one, cluster_order="release"),
        ProjectedAdaptiveLogSoftmax(*one, cluster_order="hf").to(D),
    )
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a.log_prob(hidden), b.log_prob(hidden), **TOL)


def test_embedding_matches_definition():
    for cfg in CONFIGS:
        n_token, d_embed, d_proj, cutoffs, div_val = cfg
        emb = _embedding(cfg)
        tokens = _targets_all_clusters(n_token, cutoffs, (3, 8))
        out = emb(tokens)
        assert out.shape == (3, 8, d_proj) and out.dtype == D
        ends = emb.cutoff_ends
        for t, vec in zip(tokens.reshape(-1).tolist(), out.reshape(-1, d_proj)):
            if div_val == 1:
                e = emb.emb_layers[0].weight[t]
                e = e if d_proj == d_embed else emb.emb_projs[0] @ e
            else:
                i = max(k for k in range(len(ends) - 1) if ends[k] <= t)
                e = emb.emb_projs[i] @ emb.emb_layers[i].weight[t - ends[i]]
            torch.testing.assert_close(vec, e * d_proj**0.5, **TOL)


# 4. Hugging Face transformers 4.35 -------------------------------------------


def _hf_pair(cfg):
    n_token, d_embed, d_proj, cutoffs, div_val = cfg
    hf_emb = _randomize(HFEmbedding(n_token, d_embed, d_proj, list(cutoffs), div_val=div_val).to(D))
    hf_crit = _randomize(
        HFSoftmax(n_token, d_embed, d_proj, list(cutoffs), div_val=div_val, keep_order=True).to(D)
    )
    return hf_emb, hf_crit


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_against_huggingface(cfg):
    n_token, d_embed, d_proj, cutoffs, div_val = cfg
    hf_emb, hf_crit = _hf_pair(cfg)
    emb = AdaptiveEmbedding(n_token, d_embed, d_proj, cutoffs, div_val).to(D)
    crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_proj, cutoffs, div_val, cluster_order="hf").to(D)
    for ours, theirs in ((emb, hf_emb), (crit, hf_crit)):
        assert {k: v.shape for k, v in ours.state_dict().items()} == {
            k: v.shape for k, v in theirs.state_dict().items()
        }
        ours.load_state_dict(theirs.state_dict(), strict=True)
        for name in (
            "n_token",
            "d_embed",
            "d_proj",
            "div_val",
            "cutoffs",
            "cutoff_ends",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("shortlist_size", "n_clusters", "head_size"):
        assert getattr(crit, name) == getattr(hf_crit, name), name
    assert emb.emb_scale == hf_emb.emb_scale
    assert len(crit.out_projs) == len(hf_crit.out_projs)
    assert [p is None for p in crit.out_projs] == [p is None for p in hf_crit.out_projs]

    tokens = _targets_all_clusters(n_token, cutoffs, (4, 9))
    torch.testing.assert_close(emb(tokens), hf_emb(tokens), **TOL)

    hidden = torch.randn(4, 9, d_proj, dtype=D) * 2
    # full distribution: HF's forward without labels (its log_prob() breaks with clusters)
    torch.testing.assert_close(crit.log_prob(hidden).reshape(-1, n_token), hf_crit(hidden), **TOL)
    if not cutoffs:
        torch.testing.assert_close(crit.log_prob(hidden), hf_crit.log_prob(hidden), **TOL)
    # NLL: HF shifts (hidden[:, :-1] predicts labels[:, 1:]) and flattens
    labels = _targets_all_clusters(n_token, cutoffs, (4, 9))
    ours = crit(hidden[:, :-1], labels[:, 1:])
    torch.testing.assert_close(ours.reshape(-1), hf_crit(hidden, labels, keep_order=True), **TOL)

    # the default (release) order reads the same weights with the cluster rows reversed
    rel = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_proj, cutoffs, div_val).to(D)
    rel.load_state_dict(flip_cluster_order(hf_crit.state_dict()), strict=True)
    torch.testing.assert_close(rel.log_prob(hidden).reshape(-1, n_token), hf_crit(hidden), **TOL)


def test_state_dict_keys_example():
    emb = AdaptiveEmbedding(10, 8, 6, [2, 5], div_val=2)
    crit = ProjectedAdaptiveLogSoftmax(10, 8, 6, [2, 5], div_val=2)
    assert {k: tuple(v.shape) for k, v in emb.state_dict().items()} == {
        "emb_layers.0.weight": (2, 8),
        "emb_layers.1.weight": (3, 4),
        "emb_layers.2.weight": (5, 2),
        "emb_projs.0": (6, 8),
        "emb_projs.1": (6, 4),
        "emb_projs.2": (6, 2),
    }
    assert {k: tuple(v.shape) for k, v in crit.state_dict().items()} == {
        "cluster_weight": (2, 8),
        "cluster_bias": (2,),
        "out_layers.0.weight": (2, 8),
        "out_layers.0.bias": (2,),
        "out_layers.1.weight": (3, 4),
        "out_layers.1.bias": (3,),
        "out_layers.2.weight": (5, 2),
        "out_layers.2.bias": (5,),
        "out_projs.0": (6, 8),
        "out_projs.1": (6, 4),
        "out_projs.2": (6, 2),
    }
    assert crit.cutoffs == [2, 5, 10] and crit.cutoff_ends == [0, 2, 5, 10]
    same = ProjectedAdaptiveLogSoftmax(10, 8, 8, [2, 5])
    assert list(same.state_dict()) == [
        "cluster_weight",
        "cluster_bias",
        "out_layers.0.weight",
        "out_layers.0.bias",
    ]
    assert list(same.out_projs) == [None, None, None]
    assert list(AdaptiveEmbedding(10, 8, 8, [2, 5]).state_dict()) == ["emb_layers.0.weight"]


# 5. tying ----------------------------------------------------------------------


TIE_CONFIGS = [c for c in CONFIGS if c[3]] + [(23, 8, 6, [], 1)]


@pytest.mark.parametrize("cfg", TIE_CONFIGS, ids=[f"tie-{i}" for i in range(len(TIE_CONFIGS))])
def test_tying_shares_parameters_and_gradients(cfg):
    n_token, d_embed, d_proj, cutoffs, div_val = cfg
    emb, crit = _embedding(cfg), _softmax(cfg)
    # untied copies with the same values, to get each side's gradient separately
    emb_u, crit_u = copy.deepcopy(emb), copy.deepcopy(crit)
    tie_projs = [False] + [True] * len(cutoffs) if cutoffs else [True]  # the release's default
    tie_adaptive_weights(emb, crit, True, tie_projs, d_proj, d_embed, div_val)
    with torch.no_grad():  # make the untied copies equal to the tied values
        for i, layer in enumerate(crit_u.out_layers):
            layer.weight.copy_(emb.emb_layers[i].weight)
        for i, p in enumerate(crit.out_projs):
            if p is not None:
                crit_u.out_projs[i].copy_(p)

    tied_pairs = [
        (
            crit.out_layers[i].weight,
            emb.emb_layers[i].weight,
            ("emb_layers", i),
            ("out_layers", i),
        )
        for i in range(len(crit.out_layers))
    ]
    for i, tie in enumerate(tie_projs):
        src = None
        if tie and div_val == 1 and d_proj != d_embed:
            src = 0
        elif tie and div_val != 1:
            src = i
        if src is None:
            assert crit.out_projs[i] is None or all(crit.out_projs[i] is not p for p in emb.emb_projs)
        else:
            tied_pairs.append(
                (
                    crit.out_projs[i],
                    emb.emb_projs[src],
                    ("emb_projs", src),
                    ("out_projs", i),
                )
            )
    assert len(tied_pairs) > len(crit.out_layers) or (div_val == 1 and d_proj == d_embed)
    for a, b, _, _ in tied_pairs:
        assert a is b and isinstance(a, torch.nn.Parameter)

    tokens = _targets_all_clusters(n_token, cutoffs, (3, 8))
    target = _targets_all_clusters(n_token, cutoffs, (3, 8))
    crit(emb(tokens) * 0.3, target).sum().backward()
    crit_u(emb_u(tokens) * 0.3, target).sum().backward()

    def get(module, name, i):
        obj = getattr(module, name)[i]
        return obj.weight if name.endswith("layers") else obj

    for shared, _, (e_name, e_i), (c_name, c_i) in tied_pairs:
        g_emb, g_crit = get(emb_u, e_name, e_i).grad, get(crit_u, c_name, c_i).grad
        assert g_emb is not None and g_crit is not None
        assert g_emb.abs().sum() > 0 and g_crit.abs().sum() > 0  # both ends contribute
        expected = g_emb + g_crit if not (c_name == "out_projs" and div_val == 1) else None
        if expected is not None:
            torch.testing.assert_close(shared.grad, expected, **TOL)
    if div_val == 1 and d_proj != d_embed:  # emb_projs[0] is shared by every tied out_projs[i]
        expected = emb_u.emb_projs[0].grad + sum(
            crit_u.out_projs[i].grad for i, t in enumerate(tie_projs) if t
        )
        torch.testing.assert_close(emb.emb_projs[0].grad, expected, **TOL)

    # a tied pair still loads an (untied) state dict with the same keys
    crit.load_state_dict(crit_u.state_dict(), strict=True)


def test_tying_without_projections_and_errors():
    cfg = (23, 8, 8, [4, 9], 1)
    emb, crit = _embedding(cfg), _softmax(cfg)
    tie_adaptive_weights(emb, crit, True, [False, True, True], 8, 8, 1)
    assert crit.out_layers[0].weight is emb.emb_layers[0].weight
    assert list(crit.out_projs) == [None, None, None] and len(emb.emb_projs) == 0
    emb2, crit2 = _embedding(cfg), _softmax(cfg)
    tie_adaptive_weights(emb2, crit2, False, None, 8, 8, 1)
    assert crit2.out_layers[0].weight is not emb2.emb_layers[0].weight
    with pytest.raises(ValueError, match="d_model"):
        tie_adaptive_weights(emb2, crit2, True, [], 16, 8, 1)
    with pytest.raises(ValueError, match="tie_projs"):
        tie_adaptive_weights(emb2, crit2, True, [True] * 4, 8, 8, 1)
    other = AdaptiveEmbedding(23, 8, 8, [4, 10])
    with pytest.raises(ValueError, match="partition"):
        tie_adaptive_weights(other, crit2, True, [], 8, 8, 1)


# 6. gradient check ---------------------------------------------------------------


@pytest.mark.parametrize("cfg", [(7, 4, 3, [2, 4], 2), (7, 4, 3, [3], 1), (7, 4, 4, [], 1)])
def test_gradcheck(cfg):
    n_token, _, d_proj, cutoffs, _ = cfg
    crit, emb = _softmax(cfg), _embedding(cfg)
    names = [n for n, _ in crit.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in crit.named_parameters()]
    hidden = torch.randn(6, d_proj, dtype=D, requires_grad=True)
    target = _targets_all_clusters(n_token, cutoffs, (6,))

    def nll(h, *ps):
        return torch.func.functional_call(crit, dict(zip(names, ps)), (h, target))

    def log_prob(h, *ps):
        return _call_log_prob(crit, dict(zip(names, ps)), h)

    assert torch.autograd.gradcheck(nll, (hidden, *params))
    assert torch.autograd.gradcheck(log_prob, (hidden, *params))

    e_names = [n for n, _ in emb.named_parameters()]
    e_params = [p.detach().clone().requires_grad_() for _, p in emb.named_parameters()]
    tokens = _targets_all_clusters(n_token, cutoffs, (2, 4))

    def embed(*ps):
        return torch.func.functional_call(emb, dict(zip(e_names, ps)), (tokens,))

    assert torch.autograd.gradcheck(embed, tuple(e_params))


def _call_log_prob(crit, params, hidden):
    """``crit.log_prob`` with substituted parameters."""

    class _Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return self.inner.log_prob(h)

    wrapped = _Wrap(crit)
    return torch.func.functional_call(wrapped, {f"inner.{k}": v for k, v in params.items()}, (hidden,))


# construction, validation, dtypes ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 8, 8, [5, 3]), "strictly increasing"),
        ((10, 8, 8, [3, 3]), "strictly increasing"),
        ((10, 8, 8, [3, 10]), "strictly increasing"),
        ((10, 8, 8, [0, 4]), "strictly increasing"),
        ((10, 8, 8, [12]), "strictly increasing"),
        ((10, 8, 8, [2.5]), "integers"),
        ((10, 8, 8, [2, 4, 6], 4), "div_val"),
        ((10, 0, 8, [2]), "d_embed"),
        ((10, 8, 8, [2], 0), "div_val"),
    ],
)
def test_invalid_sizes(args, match):
    for cls in (AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax):
        with pytest.raises(ValueError, match=match):
            cls(*args)


def test_invalid_inputs():
    crit = _softmax((10, 8, 6, [3, 6], 2))
    emb = _embedding((10, 8, 6, [3, 6], 2))
    with pytest.raises(ValueError, match="outside"):
        crit(torch.randn(3, 6, dtype=D), torch.tensor([1, 10, 2]))
    with pytest.raises(ValueError, match="outside"):
        crit(torch.randn(3, 6, dtype=D), torch.tensor([1, -1, 2]))
    with pytest.raises(ValueError, match="outside"):
        emb(torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="leading shape"):
        crit(torch.randn(3, 6, dtype=D), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="d_proj"):
        crit.log_prob(torch.randn(3, 5, dtype=D))
    with pytest.raises(ValueError, match="cluster_order"):
        ProjectedAdaptiveLogSoftmax(10, 8, 6, [3], cluster_order="tf")


def test_default_init_and_float32():
    emb = AdaptiveEmbedding(3000, 64, 32, [1000, 2000], div_val=2)
    crit = ProjectedAdaptiveLogSoftmax(3000, 64, 32, [1000, 2000], div_val=2)
    assert abs(emb.emb_layers[0].weight.std().item() - 0.02) < 2e-3
    assert abs(crit.out_layers[0].weight.std().item() - 0.02) < 2e-3
    assert abs(crit.out_projs[0].std().item() - 0.01) < 1e-3
    assert abs(emb.emb_projs[1].std().item() - 0.01) < 1e-3
    assert crit.cluster_bias.eq(0).all() and all(layer.bias.eq(0).all() for layer in crit.out_layers)
    crit.init_weights(init_std=0.05, proj_init_std=0.0)
    assert abs(crit.out_layers[0].weight.std().item() - 0.05) < 5e-3 and crit.out_projs[1].eq(0).all()
    tokens = torch.randint(0, 3000, (4, 16))
    h = emb(tokens)
    assert h.dtype == torch.float32 and h.shape == (4, 16, 32)
    nll = crit(h, tokens)
    assert nll.dtype == torch.float32 and torch.isfinite(nll).all()
    torch.testing.assert_close(nll, -crit.log_prob(h).gather(-1, tokens[..., None]).squeeze(-1))
