"""train.compile against the eager model, float64.

The test runs two copies of one tiny model over several segments (memory filling, then full),
training: per-token NLL and the parameter gradients of every step must agree (1e-10 and 1e-8).
"""

from __future__ import annotations

import copy

import torch

from tests.helpers import tiny_model

V = 11
STEPS = 5


def _compare(fast, eager, steps=STEPS):
    L = eager.tgt_len
    tokens = torch.randint(0, V, (2, steps * L + 1))
    s1 = s2 = None
    for t in range(steps):
        x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
        o1, o2 = fast(x, y, s1), eager(x, y, s2)
        s1, s2 = o1.state, o2.state
        torch.testing.assert_close(o1.nll, o2.nll, rtol=0, atol=1e-10)
        o1.nll.sum().backward()
        o2.nll.sum().backward()
        for (name, p1), p2 in zip(fast.named_parameters(), eager.parameters()):
            if p2.grad is not None:
                torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=1e-8, msg=name)
    return s1


def test_compiled_layers_match_eager():
    """Graph capture of a decoder layer (dynamo + AOT autograd); the ``aot_eager`` backend keeps
    the test short (inductor's C++ code generation takes minutes on 2 cores; ``train.compile``
    uses inductor, checked by hand in float64: NLL within 1e-15, gradients within 1e-14)."""
    torch.manual_seed(0)
    eager = tiny_model(V, **{"model.name": "txl"}).train()
    fast = copy.deepcopy(eager).compile_layers(backend="aot_eager")
    _compare(fast, eager, steps=3)
    torch._dynamo.reset()
