"""The benchmark's smoke mode runs every section and reports every ratio (CI keeps it from rotting)."""

from __future__ import annotations

import json

from crtn.bench import main
from crtn.config import STRATEGIES


def test_smoke_benchmark_reports_all_sections_and_targets(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    md = (tmp_path / "bench.md").read_text()
    for section in ("strategies", "range", "scaling", "retrieval", "main_pass"):
        assert section in res
    # 1. txl plus every query strategy, training and evaluation; token also with last_state keys
    # and with cache.layers=1; every row says what it measures
    names = [r["config"] for r in res["strategies"]["train"]]
    assert names[0].startswith("txl") and len(names) == 3 + len(STRATEGIES)
    assert {"crtn(token/token_max)", "crtn(token/last_state)", "crtn(token/token_max, layers=1)"} <= set(
        names
    )
    assert all(r["measures"] for r in res["strategies"]["train"] + res["range"]["rows"])
    limits = {t["target"]: t["limit"] for t in res["targets"]}
    assert limits["crtn(token/token_max) train step / txl"] == 1.8
    assert all(r["time_ratio_vs_ref"] > 0 and r["tokens_per_s"] > 0 for r in res["strategies"]["train"])
    # 2-4. ratios present and positive
    assert all(r["speedup_vs_txl_same_range"] > 0 for r in res["range"]["rows"][1:])
    assert [r["config"].split("n_slot=")[1].rstrip(")") for r in res["scaling"]["token/last_state"]] == [
        "4",
        "16",
    ]
    backends = {r["backend"] for r in res["retrieval"]["rows"]}
    assert backends == {"torch", "faiss-flat", "faiss-hnsw"}
    ev = res["retrieval"]["eval_faiss"]
    assert (
        0 <= ev["float32"]["retrieval_share"] <= 1 and ev["float16"]["cache_mb"] < ev["float32"]["cache_mb"]
    )
    # 5. the efficient main pass is faster than the per-token reference
    assert res["main_pass"]["speedup"] > 1
    # every target of the issue is evaluated and printed
    assert len(res["targets"]) >= 6 and "## Targets" in md
    assert "## Targets" in capsys.readouterr().out
