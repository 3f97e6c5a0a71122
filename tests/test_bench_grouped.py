"""tools/bench_grouped.py's side-by-side versions (``--before``): the older code loaded from a
commit's files in a folder, and the adapters that call an older row match as today's code does."""

from __future__ import annotations

import shutil

import torch

from crtn.model.rowmatch import LeadIn, ngram_row_scores
from tests.helpers import ROOT, load_tool
from tests.reference import naive_ngram_row_scores


def _tool():
    return load_tool("bench_grouped")


def test_before_from_a_folder_loads_each_swap_from_its_files(tmp_path, capsys):
    """A folder holding crtn/model/*.py (as ``git archive COMMIT crtn`` writes it) gives one
    older value per holder of every swap, each loaded from the folder's file, not today's
    object; a swap whose file the folder lacks keeps today's and says so."""
    tool = _tool()
    shutil.copytree(ROOT / "crtn/model", tmp_path / "crtn/model")
    (tmp_path / "crtn/model/gate.py").unlink()
    versions = tool.implementations(str(tmp_path))
    now, before = versions[""], versions["_before"]
    assert [(h, n) for h, n, _ in now] == [(h, n) for h, n, _ in before]
    assert "no Gate._row_scores in crtn/model/gate.py; that part is today's" in capsys.readouterr().out
    for (holder, name, today), (_, _, old) in zip(now, before, strict=True):
        if holder is tool.gate.Gate:
            assert old is today
        else:
            assert old is not today, name
    loaded = {n: v for h, n, v in before if n in ("attend_with_cache", "forward")}
    assert loaded["attend_with_cache"].__module__ == "retrieved_before"
    # the older attention layer calls the retrieved attention of the version being timed (the
    # swapped global of today's attention module), not the one its own file imported
    assert loaded["forward"].__module__ == "attention_before"
    calls = []
    saved = tool.attention.attend_with_cache
    tool.attention.attend_with_cache = lambda *a, **k: calls.append((a, k)) or "timed"
    try:
        assert loaded["forward"].__globals__["attend_with_cache"](1, x=2) == "timed"
    finally:
        tool.attention.attend_with_cache = saved
    assert calls == [((1,), {"x": 2})]


def test_an_older_row_match_without_cosine_gets_its_rows_normalised():
    """A row match from before it took ``cosine`` is called as the summary called it then, with
    the rows (and a lead-in, gathered by slot for a match from before LeadIn) normalised first:
    the same scores as today's cosine match, to 1e-12 in float64."""
    tool = _tool()

    def old_match(query, rows, lead, *, ngram, shift):  # the naive loop, with no cosine
        return naive_ngram_row_scores(query, rows, lead, ngram, shift)

    adapted = tool._row_match_as_then(old_match, None)
    g = torch.Generator().manual_seed(0)
    query = torch.nn.functional.normalize(torch.randn(2, 5, 6, dtype=torch.float64, generator=g), dim=-1)
    rows = 3 * torch.randn(2, 4, 3, 6, dtype=torch.float64, generator=g)
    lead = LeadIn(
        torch.tensor([[3, 0, 1, 2], [0, 0, 1, 2]]), torch.tensor([[True] * 4, [False] + [True] * 3]), 2
    )
    want = ngram_row_scores(query, rows, lead, ngram=2, shift=1, cosine=True)
    got = adapted(query, rows, lead, ngram=2, shift=1, cosine=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    plain = adapted(query, rows, lead, ngram=2, shift=1, cosine=False)
    assert not torch.allclose(plain, want)  # unnormalised rows of norm about 3 score otherwise


def test_products_by_shape_counts_each_product_by_hand_and_sums_to_the_flop_counter():
    """A linear layer's forward and backward and an ``out=`` batched product, listed by operator
    and factor shapes with FLOPs counted by hand (2 m k n, times the batch), and summing to
    ``step_flops``'s count of the same work (torch's FlopCounterMode: an independent count)."""
    tool = _tool()
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    x = torch.randn(3, 8, generator=g, requires_grad=True)
    a, b = torch.randn(2, 4, 6, generator=g), torch.randn(2, 6, 7, generator=g)
    out = torch.empty(2, 4, 7)

    def work():
        lin(x).sum().backward()
        torch.bmm(a, b, out=out)

    table = tool.products_by_shape(work)
    flops = {key: v[1] for key, v in table.items()}
    calls = {key: v[0] for key, v in table.items()}
    assert flops[("aten::addmm", "[3, 8] x [8, 5]")] == 2 * 3 * 8 * 5  # the forward
    assert flops[("aten::bmm", "[2, 4, 6] x [2, 6, 7]")] == 2 * 2 * 4 * 6 * 7
    assert calls[("aten::bmm", "[2, 4, 6] x [2, 6, 7]")] == 1
    # the backward: input gradient [3, 5] x [5, 8] and weight gradient [5, 3] x [3, 8]
    assert sum(flops[k] for k in flops if k[0] == "aten::mm") == 2 * (2 * 3 * 5 * 8)
    assert sum(flops.values()) == tool.step_flops(work)


def test_faults_compare_the_first_and_last_quarter_of_the_rounds(capsys):
    """``--faults``: per case the median page faults and step over the first and the last quarter
    of the rounds, and the step's ratio to Transformer-XL's over the same rounds (hand-computed
    here: 8 rounds, quarters of 2)."""
    tool = _tool()

    class Case:
        def __init__(self, name, times, faults):
            self.name, self.times, self.faults = name, times, faults

    txl = Case("txl", [0.10, 0.10, 0.2, 0.2, 0.2, 0.2, 0.10, 0.12], [0, 2, 5, 5, 5, 5, 0, 0])
    gate = Case("gate", [0.30, 0.34, 0.9, 0.9, 0.9, 0.9, 0.22, 0.22], [900, 1100, 7, 7, 7, 7, 2, 4])
    tool.print_faults([txl, gate], lambda c: txl)
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0].split()
        == "faults txl first 2: 1 faults 100.0 ms 1.00x txl | last 2: 0 faults 110.0 ms 1.00x txl".split()
    )
    assert (
        out[1].split()
        == "faults gate first 2: 1000 faults 320.0 ms 3.20x txl | last 2: 3 faults 220.0 ms 2.00x txl".split()
    )
    assert out[2].startswith("resident size ") and out[2].endswith(" MB")
