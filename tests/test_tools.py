"""tools/recall_diagnosis.py against crtn-eval's repeat metrics on the same checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers import TINY_RUN, cli

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("recall_diagnosis", ROOT / "tools/recall_diagnosis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recall_diagnosis_counts_match_evaluation(tmp_path):
    """Its own hit test (copy source inside a selected slot) and argmax accuracy, computed in
    another way, give evaluate()'s repeat token count, accuracy and source_retrieved exactly."""
    run = tmp_path / "run"
    p = cli(
        "crtn.train",
        [
            *TINY_RUN,
            "data.synthetic.repeat_skip=1",
            "cache.n_slot=12",  # 96 tokens: a copy's source and the source's own source (gaps 24-40)
            "train.max_step=40",
            "train.eval_interval=40",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    valid = json.loads((run / "results.json").read_text())["valid"]["repeat"]
    t = _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4)
    keys = ("copy position", "distance // 32", "j // 8", "source row", "offset j - source row")
    for key in keys:  # each covers every token
        hits, correct, n = (sum(r[i] for r in t[key].values()) for i in range(3))
        assert n == valid["tokens"] > 0
        assert correct == round(valid["acc"] * n)
        assert hits == round(valid["source_retrieved"] * n)
    assert 0 < hits < n  # both outcomes occur, so the comparison says something
    assert (
        t["copy hits"] == round(valid["copy_retrieved"] * n) > hits
    )  # other copies of the text are found too
    ok_hit = sum(ok for ok, _ in t["alpha"].values())
    ok_miss, n_miss = t["misses"]["all"]
    assert n_miss == n - hits and ok_hit + ok_miss == correct
    assert sum(c for _, c in t["alpha"].values()) == hits
    assert set(t["copy position"]) <= set(range(2, 5))  # only tokens after repeat_skip=1 (passage_len 4)
    assert set(t["source row"]) <= set(range(8))  # the source's row in its slot: 0..tgt_len-1 (TINY_RUN: 8)
    # gaps are multiples of passage_len 4, so j - row = j - (j + 1 - gap) mod 8 is 3 or 7 mod 8
    assert set(t["offset j - source row"]) <= {-5, -1, 3, 7}


def test_recall_diagnosis_rejects_txl(tmp_path):
    run = tmp_path / "run"
    txl = [a for a in TINY_RUN if not a.startswith("cache.")]  # txl has no cache: no cache.* settings
    p = cli("crtn.train", [*txl, "model=txl", "train.max_step=2", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr
    with pytest.raises(SystemExit, match="needs a crtn model"):
        _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4)
