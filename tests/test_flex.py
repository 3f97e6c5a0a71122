"""model.flex (crtn/model/flex.py): Transformer-XL's relative attention through FlexAttention.

On the CPU in float64: the flex model against the eager one over several segments (memory
filling, then full; CRTN with its cache in use), in training (per-token NLL and every parameter
gradient, the dense evaluation of the same score_mod and mask_mod: FlexAttention has no CPU
backward) and at evaluation (NLL, FlexAttention's own unfused ``flex_attention``), each counting
that the flex path really ran; the mask and the score_mod against naive references; the option
from the command line and its refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import crtn.model.flex as flex
from crtn.config import resolve
from crtn.errors import ConfigError
from crtn.model import build_model
from crtn.model.attention import RelPartialLearnableMultiHeadAttn, rel_shift
from tests.helpers import compose_train, load_tool, tiny_model

V = 11
STEPS = 5

CASES = {
    # memory of two segments (tgt_len 3): M = 0, 3, 6, 6, 6
    "txl-mem2": {"model.name": "txl", "model.mem_len": 6},
    "txl-preln-samelen-clamp": {
        "model.name": "txl",
        "model.mem_len": 6,
        "model.pre_lnorm": True,
        "model.same_length": True,
        "model.clamp_len": 2,
    },
    "vanilla": {"model.name": "vanilla"},
    # query passes and the main pass before the first retrieval through flex, later main passes eager
    "crtn": {"model.name": "crtn", "summary.name": "token_max"},
    # layer 0 (below the retrieving layer) through flex in every pass; fixed_length_2's hidden
    # memory rows (extra_mask) in its query pass
    "crtn-layers1-fixed_length_2": {
        "model.name": "crtn",
        "cache.layers": 1,
        "query.strategy": "fixed_length_2",
        "summary.name": "max",
    },
}


def _pair(overrides):
    """An eager model and its flex twin with the same parameters (float64)."""
    torch.manual_seed(0)
    eager = tiny_model(V, **overrides)
    fast = tiny_model(V, **overrides, **{"model.flex": True})
    fast.load_state_dict(eager.state_dict())
    assert all(layer.dec_attn.flex for layer in fast.layers)
    return fast, eager


def _count(monkeypatch, name):
    """Count the calls of ``crtn.model.flex.<name>`` (still calling it)."""
    calls = []
    fn = getattr(flex, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(flex, name, counted)
    return calls


def _segments(steps, L):
    tokens = torch.randint(0, V, (2, steps * L + 1), generator=torch.Generator().manual_seed(1))
    for t in range(steps):
        yield tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]


def _expected_flex_layers(name, steps, n_layer):
    """Layer calls through flex for txl/vanilla (every layer, every step); None: checked as > 0."""
    return steps * n_layer if name in ("txl-mem2", "txl-preln-samelen-clamp", "vanilla") else None


@pytest.mark.parametrize("name", list(CASES))
def test_flex_matches_eager_in_training(name, monkeypatch):
    """Training with gradients: the dense evaluation of the score_mod and mask_mod on the CPU."""
    fast, eager = _pair(CASES[name])
    fast.train(), eager.train()
    dense = _count(monkeypatch, "dense_attention")
    s1 = s2 = None
    for x, y in _segments(STEPS, eager.tgt_len):
        o1, o2 = fast(x, y, s1), eager(x, y, s2)
        s1, s2 = o1.state, o2.state
        torch.testing.assert_close(o1.nll, o2.nll, rtol=0, atol=1e-10)
        o1.nll.sum().backward()
        o2.nll.sum().backward()
        for (pname, p1), p2 in zip(fast.named_parameters(), eager.parameters()):
            assert (p1.grad is None) == (p2.grad is None), pname
            if p2.grad is not None:
                torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=1e-10, msg=pname)
    expected = _expected_flex_layers(name, STEPS, eager.n_layer)
    assert len(dense) == expected if expected is not None else len(dense) > 0
    if eager.has_cache:
        assert s1.cache.n_insert > 0 and o1.selection is not None  # the eager retrieval path ran too


@pytest.mark.parametrize("name", list(CASES))
def test_flex_matches_eager_at_evaluation(name, monkeypatch):
    """Evaluation without gradients runs FlexAttention's own (unfused) flex_attention on the CPU."""
    fast, eager = _pair(CASES[name])
    real = _count(monkeypatch, "flex_attention")
    s1 = s2 = None
    with torch.no_grad():
        for x, y in _segments(STEPS, eager.tgt_len):
            o1, o2 = fast(x, y, s1), eager(x, y, s2)
            s1, s2 = o1.state, o2.state
            torch.testing.assert_close(o1.nll, o2.nll, rtol=0, atol=1e-10)
    expected = _expected_flex_layers(name, STEPS, eager.n_layer)
    assert len(real) == expected if expected is not None else len(real) > 0


def _visible(L, M, mem_len, same_length):
    """The naive rule: query i (position M+i) sees key j iff 0 <= M+i-j, and with same_length only
    the last mem_len positions (distance < mem_len) once [memory; segment] is longer than mem_len."""
    out = torch.zeros(L, M + L, dtype=torch.bool)
    for i in range(L):
        for j in range(M + L):
            dist = M + i - j
            out[i, j] = dist >= 0 and (not same_length or M + L <= mem_len or dist < mem_len)
    return out


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("L,M,mem_len", [(3, 0, 3), (3, 3, 3), (3, 3, 6), (3, 6, 6), (4, 2, 5), (5, 0, 2)])
def test_block_mask_is_the_attention_mask(L, M, mem_len, same_length):
    """The BlockMask's mask_mod and TransformerLM._attn_mask against the naive rule; hidden rows too."""
    model = tiny_model(V, **{"model.name": "txl", "model.mem_len": mem_len, "model.same_length": same_length})
    expected = _visible(L, M, mem_len, same_length)
    assert torch.equal(~model._attn_mask(L, M, torch.device("cpu")), expected)
    shift = model._same_length_shift(L, M)
    bm = flex.block_mask(L, M, shift=shift, hidden=None, device=torch.device("cpu"))
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, L, M + L)[0, 0], expected)
    hidden = torch.rand(2, M + L, generator=torch.Generator().manual_seed(0)) < 0.3
    bm = flex.block_mask(L, M, shift=shift, hidden=hidden, device=torch.device("cpu"))
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, L, M + L)[:, 0], expected & ~hidden[:, None, :])


def test_score_mod_reads_the_shifted_position_scores():
    """score_mod on a zero score = scale * rel_shift(bd_raw) on every visible entry (j <= M+i)."""
    B, H, L, M = 2, 3, 4, 5
    K = M + L
    bd_raw = torch.randn(B, H, L, K, dtype=torch.float64)
    mod = flex.position_score_mod(bd_raw, 0.3)
    idx = flex.index_grids((B, H, L, K), device=torch.device("cpu"))
    got = mod(torch.zeros(B, H, L, K, dtype=torch.float64), *idx)
    visible = _visible(L, M, M, False)
    torch.testing.assert_close(got[..., visible], 0.3 * rel_shift(bd_raw)[..., visible], rtol=0, atol=0)


def test_rel_attention_matches_the_formula():
    """rel_attention (dense, with gradients; and FlexAttention's flex_attention, without) against
    softmax((q+u).k/sqrt(d) + (q+v).W R_{M+i-j}/sqrt(d)) v written out per (i, j)."""
    torch.manual_seed(0)
    B, L, M, H, dh = 2, 3, 4, 2, 5
    K = M + L
    rw_q, rr_q = (torch.randn(B, L, H, dh, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, K, H, dh, dtype=torch.float64) for _ in range(2))
    r = torch.randn(K + 2, H, dh, dtype=torch.float64)  # distances K+1 .. 0, the last K used
    score = torch.full((B, H, L, K), float("-inf"), dtype=torch.float64)
    for i in range(L):
        for j in range(M + i + 1):
            dist = M + i - j
            ac = torch.einsum("bhd,bhd->bh", rw_q[:, i], k[:, j])
            bd = torch.einsum("bhd,hd->bh", rr_q[:, i], r[K + 1 - dist])
            score[:, :, i, j] = (ac + bd) / math.sqrt(dh)
    expected = (score.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(B, L, H * dh)
    mask = flex.block_mask(L, M, shift=None, hidden=None, device=torch.device("cpu"))
    with torch.no_grad():
        got = flex.rel_attention((rw_q, rr_q), k, v, r_head_k=r, mask=mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    got = flex.rel_attention((rw_q.requires_grad_(), rr_q), k, v, r_head_k=r, mask=mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("model", ["txl", "crtn"])
def test_model_flex_on_the_command_line_turns_the_path_on(model):
    for flag, expected in (([], False), (["model.flex=true"], True)):
        run = resolve(compose_train([f"model={model}", *flag]))
        built = build_model(run, V)
        assert run.model.flex is expected and built.flex is expected
        assert [layer.dec_attn.flex for layer in built.layers] == [expected] * run.model.n_layer


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["model.flex=true", "model.dropatt=0.1"], ["model.flex=true", "model.dropatt=0.1"]),
    ],
    ids=["flex-with-dropatt"],
)
def test_flex_refusals_are_one_line(overrides, needles):
    with pytest.raises(ConfigError) as err:
        resolve(compose_train(["model=txl", *overrides]))
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_layer_refuses_flex_with_attention_dropout():
    """A layer built outside a resolved spec refuses it too."""
    with pytest.raises(ValueError, match="dropatt=0.1"):
        RelPartialLearnableMultiHeadAttn(2, 8, 4, dropout=0.0, dropatt=0.1, flex=True)


def test_compiled_flex_layers_match_eager():
    """train.compile with model.flex (dynamo + AOT autograd, the ``aot_eager`` backend as in
    test_fused.py): the BlockMask and the score_mod's closure pass through graph capture; training
    (NLL and gradients) and a step of evaluation (FlexAttention's operator inside the graph)."""
    fast, eager = _pair(CASES["txl-mem2"])
    fast.train().compile_layers(backend="aot_eager")
    eager.train()
    segs = list(_segments(4, eager.tgt_len))
    s1 = s2 = None
    for x, y in segs[:3]:
        o1, o2 = fast(x, y, s1), eager(x, y, s2)
        s1, s2 = o1.state, o2.state
        torch.testing.assert_close(o1.nll, o2.nll, rtol=0, atol=1e-10)
        o1.nll.sum().backward()
        o2.nll.sum().backward()
        for (pname, p1), p2 in zip(fast.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=1e-10, msg=pname)
    fast.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(*segs[3], s1).nll, eager(*segs[3], s2).nll, rtol=0, atol=1e-10)
    torch._dynamo.reset()


def test_gpu_attention_check_runs_on_the_cpu(tmp_path, monkeypatch):
    """tools/gpu_attention_check.py at tiny sizes on the CPU (its plumbing; the GPU is the lead's):
    every row of the table present and within tolerance, the table written to --out."""
    tool = load_tool("gpu_attention_check", monkeypatch)  # its dataclasses look their module up
    out = tmp_path / "check.md"
    sizes = ["--batch", "2", "--tgt-len", "4", "--n-layer", "2", "--d-model", "16", "--n-head", "2"]
    rounds = ["--vocab", "20", "--n-slot", "2", "--check-steps", "3", "--warmup", "1", "--rounds", "1"]
    compiled = ["--compile-backend", "aot_eager"]  # dynamo's graphs and autograd, no code generation
    assert tool.main(["--out", str(out), "--device", "cpu", *sizes, *rounds, *compiled]) == 0
    rows = [
        line for line in out.read_text().splitlines() if line.startswith("| txl") or line.startswith("| crtn")
    ]
    assert len(rows) == 2 * 2 * 3 and all(row.endswith("| yes |") for row in rows)  # model x precision x path
    torch._dynamo.reset()
