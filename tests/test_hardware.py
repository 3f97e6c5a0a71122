"""The products' dtype by what the device multiplies natively (crtn/model/hardware.py;
docs/method.md §3, "The products' dtype"): each CPU is made up here by the features it reports,
whatever this machine's CPU is."""

from __future__ import annotations

import pytest
import torch

from crtn.model import hardware, rowmatch
from crtn.model.retrieved import products_dtype
from crtn.model.rowmatch import ngram_row_scores

CPU = torch.device("cpu")
WITH_UNITS = {"avx2": True, "avx512_bf16": True}
WITHOUT_UNITS = {"avx2": True, "avx512_bf16": False, "amx_bf16": False}


def as_cpu(monkeypatch, features: dict) -> None:
    """Report this machine's CPU as one with ``features``."""
    monkeypatch.setattr(hardware, "cpu_features", lambda: features)


@pytest.mark.parametrize(
    ("features", "bf16", "fp16"),
    [
        (WITHOUT_UNITS, False, False),
        (WITH_UNITS, True, False),
        ({"amx_bf16": True, "amx_fp16": True}, True, True),
        ({"avx512_fp16": True}, False, True),
        ({}, False, False),  # another architecture: nothing reported
    ],
)
def test_a_cpu_multiplies_a_16_bit_dtype_natively_only_with_its_units(monkeypatch, features, bf16, fp16):
    """A 16-bit dtype is native on a CPU exactly where one of its units is reported; float32 and
    float64 everywhere, and every dtype off the CPU (a GPU), whatever the CPU reports."""
    as_cpu(monkeypatch, features)
    assert hardware.multiplies_natively(torch.bfloat16, CPU) is bf16
    assert hardware.multiplies_natively(torch.float16, CPU) is fp16
    for dtype in (torch.float32, torch.float64):
        assert hardware.multiplies_natively(dtype, CPU)
    for dtype in (torch.bfloat16, torch.float16):
        assert hardware.multiplies_natively(dtype, torch.device("cuda"))


def test_the_features_are_torch_s_own():
    """:func:`hardware.cpu_features` is what torch detected (its flags are booleans)."""
    features = hardware.cpu_features()
    assert features == dict(torch._C._cpu._get_cpu_capability())
    assert all(
        isinstance(features.get(name, False), bool) for names in hardware.CPU_UNITS.values() for name in names
    )


def test_a_torch_that_cannot_report_its_cpu_multiplies_in_float32(monkeypatch, request):
    """Where this torch build has no CPU report, or its report fails, no 16-bit dtype is
    native on the CPU."""
    request.addfinalizer(hardware.cpu_features.cache_clear)  # the next test reads the real report
    for failure in (AttributeError("no _get_cpu_capability"), RuntimeError("cpuinfo failed")):

        def report(failure=failure):
            raise failure

        monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", report)
        hardware.cpu_features.cache_clear()
        assert hardware.cpu_features() == {}
        assert not hardware.multiplies_natively(torch.bfloat16, CPU)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_products_default_to_the_stored_dtype_only_where_it_is_native(monkeypatch, stored):
    """``cache.product_dtype`` None: the rows' dtype on a CPU with its units, float32 on one
    without; a product dtype given is kept on both, and wider stored dtypes are multiplied as
    stored."""
    values = torch.zeros(2, 3, 4, dtype=stored)
    as_cpu(monkeypatch, WITHOUT_UNITS)
    assert products_dtype(None, values) == torch.float32
    assert products_dtype(torch.bfloat16, values) == torch.bfloat16
    assert products_dtype(None, values.double()) == torch.float64
    as_cpu(monkeypatch, {"avx512_bf16": True, "avx512_fp16": True})
    assert products_dtype(None, values) == stored
    assert products_dtype(torch.float32, values) == torch.float32


def test_a_selection_from_bfloat16_rows_multiplies_in_float32_without_units(monkeypatch):
    """Without a gradient a row match of bfloat16 rows multiplies them in bfloat16 on a CPU with
    bfloat16 units (:func:`rowmatch._row_max_bf16`, whose products round to 2^-8); on one
    without, it casts them chunk by chunk and multiplies in the query's float32: its scores equal
    the float32 match of the rows cast up front, and differ from the bfloat16 path's."""
    g = torch.Generator().manual_seed(3)
    w, s = 3, 1
    query = torch.randn(2, w - 1 + 4, 8, generator=g)
    rows = torch.randn(2, 5, 6, 8, generator=g).bfloat16()
    lead = torch.randn(2, 5, w - 1 + s, 8, generator=g).bfloat16()
    taken = []
    real = rowmatch._row_max_bf16

    def spy(*args, **kw):
        taken.append(True)
        return real(*args, **kw)

    monkeypatch.setattr(rowmatch, "_row_max_bf16", spy)
    with torch.no_grad():
        as_cpu(monkeypatch, WITHOUT_UNITS)
        f32 = ngram_row_scores(query, rows, lead, ngram=w, shift=s)
        assert not taken
        want = ngram_row_scores(query, rows.float(), lead.float(), ngram=w, shift=s)
        as_cpu(monkeypatch, WITH_UNITS)
        b16 = ngram_row_scores(query, rows, lead, ngram=w, shift=s)
        assert taken
    torch.testing.assert_close(f32, want, rtol=0, atol=1e-6)
    assert f32.dtype == b16.dtype == torch.float32
    assert not torch.allclose(f32, b16, rtol=0, atol=1e-6)
