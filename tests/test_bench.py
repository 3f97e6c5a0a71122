"""crtn-bench through its Hydra app: the smoke run of every section, the ``config`` section on a
command-line config (the models really built are checked against what ``crtn-train`` composes),
the table's rows composed from YAML, the targets; and tools/bench_main_pass.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from crtn.app_config import BENCH_SMOKE, BenchSpec
from crtn.bench import main
from crtn.bench.cases import REAL_FILL_SLOTS, Stepper, make_case, model_spec, step_flops, step_peak
from crtn.bench.compare import compose_bench, compose_rows
from crtn.bench.report import check_targets
from crtn.config import spec_dict
from crtn.errors import ConfigError
from crtn.model import hardware, resolve_spec
from tests.helpers import compose_train, load_tool, run_main

SECTIONS = ["config", "table", "strategies", "range", "scaling", "retrieval"]
#: the model of the config section: tiny, one layer, and every group given on the command line
ASKED = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.tgt_len=8",
    "cache.layers=1",
    "query=last_l",
    "summary=identity",
]
#: the smoke sizes (crtn.app_config.BENCH_SMOKE) as crtn-train overrides: a table row's sizes
SMOKE_SIZES = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.tgt_len=8",
    "model.mem_len=8",
    "model.dropout=0.0",
    "cache.n_slot=8",
]
DEFAULT_ROWS = list(BenchSpec().rows)


class _Uncaptured:
    """run_main's capture for a module fixture (pytest captures the output there anyway)."""

    def readouterr(self) -> tuple[str, str]:
        return "", ""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    """One smoke run of every section, the config section on :data:`ASKED`, a table row added on
    the command line; returns bench.json and bench.md (written to the Hydra run folder)."""
    run = tmp_path_factory.mktemp("bench") / "run"
    args = [
        "bench.smoke=true",
        f"bench.sections=[{','.join(SECTIONS)}]",
        "bench.strategies=[token,last_l]",
        "+bench.rows.last_l_mean=['query=last_l','summary=mean']",
        *ASKED,
        f"hydra.run.dir={run}",
    ]
    code, _, _ = run_main(main, "crtn-bench", args, _Uncaptured())
    assert code == 0
    return json.loads((run / "bench.json").read_text()), (run / "bench.md").read_text()


def test_smoke_runs_every_section(smoke):
    res, md = smoke
    assert all(section in res for section in SECTIONS)
    # the CPU, and whether it multiplies bfloat16 natively (which sets the products' dtype)
    units = hardware.multiplies_natively(torch.bfloat16, torch.device("cpu"))
    assert res["cpu_bf16_units"] is units and res["cpu"] == hardware.cpu_features().get("cpu_name")
    assert f"{'with' if units else 'without'} bfloat16 units, {res['threads']} threads" in md
    for title in (
        "## config:",
        "## table:",
        "## strategies",
        "## range:",
        "## scaling:",
        "## retrieval",
        "## Targets",
    ):
        assert title in md
    names = [r["config"] for r in res["strategies"]["train"]]
    assert names == [
        "txl(mem_len=8)",
        "crtn(token/token_max)",
        "crtn(token/last_state)",
        "crtn(token/token_max, layers=1)",
        "crtn(last_l/identity)",
    ]
    assert all(r["measures"] for r in res["strategies"]["train"] + res["range"]["rows"])
    assert all(r["time_ratio_vs_ref"] > 0 and r["tokens_per_s"] > 0 for r in res["strategies"]["eval"])
    assert all(r["speedup_vs_txl_same_range"] > 0 for r in res["range"]["rows"][1:])
    assert [r["spec"]["cache"]["n_slot"] for r in res["scaling"]["token/last_state"]] == [4, 16]
    assert {r["backend"] for r in res["retrieval"]["rows"]} == {"torch", "faiss-flat", "faiss-hnsw"}
    ev = res["retrieval"]["eval_faiss"]
    assert 0 <= ev["float32"]["retrieval_share"] <= 1
    assert ev["float16"]["cache_mb"] == ev["float32"]["cache_mb"] / 2


def test_config_section_times_the_model_crtn_train_composes(smoke):
    res, _ = smoke
    cfg = res["config"]
    assert cfg["command"] == " ".join(ASKED)
    model, txl, long = cfg["train"]
    # what crtn-train composes and resolves from the same command line
    expected = spec_dict(resolve_spec(compose_train(ASKED)))
    assert model["spec"] == expected
    assert (model["spec"]["cache"]["layers"], model["spec"]["query"]["strategy"]) == (1, "last_l")
    assert model["spec"]["summary"]["name"] == "identity" and model["spec"]["model"]["n_layer"] == 1
    # Transformer-XL of the same sizes and lengths; then over the range m + N L = 8 + 8 * 8
    same = {k: v for k, v in expected["model"].items() if k != "name"}
    assert txl["spec"]["model"] == {**same, "name": "txl"}
    assert long["spec"]["model"] == {**same, "name": "txl", "mem_len": 72}
    # batch bench.batch (smoke: 2) of tgt_len 8 tokens per step
    for r in cfg["train"] + cfg["eval"]:
        assert r["tokens_per_s"] * r["step_ms"] / 1000 == pytest.approx(2 * 8)
    for r in cfg["train"]:  # the products' rate over the whole step
        assert r["gflop_per_s"] * r["step_ms"] / 1000 == pytest.approx(r["gflop"])
    ratios = cfg["ratios"]
    assert ratios["step_ratio"] == pytest.approx(model["step_ms"] / txl["step_ms"])
    assert ratios["flop_ratio"] == pytest.approx(model["gflop"] / txl["gflop"])
    assert ratios["range_ratio"] == pytest.approx(model["tokens_per_s"] / long["tokens_per_s"])
    assert ratios["eval_ratio"] == pytest.approx(cfg["eval"][0]["step_ms"] / cfg["eval"][1]["step_ms"])
    assert ratios["range_tokens"] == 72 and ratios["memory_ratio"] is None  # smoke: no profiler


def test_table_rows_are_composed_from_yaml(smoke):
    res, md = smoke
    t = res["table"]
    rows = {r["row"]: r for r in t["rows"]}
    assert list(rows) == [*DEFAULT_ROWS, "last_l_mean"]
    assert DEFAULT_ROWS == [
        "txl",
        "default",
        "default_every_layer",
        "default_layers1",
        "row_match",
        "crtn_original",
        "crtn_original_layers2",
        "crtn_original_layers1",
        "paper_cache",
        "paper_cache_layers2",
        "paper_cache_layers1",
        "gate",
        "gate_layers2",
        "gate_layers1",
        "gate_token_max",
        "gate_token_max_layers2",
        "gate_token_max_layers1",
    ]
    spec = {name: r["spec"] for name, r in rows.items()}
    n = spec["txl"]["model"]["n_layer"]
    for name in ("gate", "gate_layers1", "gate_token_max", "gate_token_max_layers2"):
        assert spec[name]["query"]["strategy"] == "gate"
    # model=crtn_original brings its query, summary and cache settings (conf/model/crtn_original.yaml)
    for name in ("crtn_original", "crtn_original_layers2", "crtn_original_layers1"):
        c = spec[name]["cache"]
        assert (c["alpha_norm"], c["pos"], c["top_k"]) == ("original", "real", 2)
        assert (spec[name]["query"]["strategy"], spec[name]["summary"]["name"]) == ("token", "last_state")
    for name in ("default", "default_every_layer", "default_layers1", "row_match"):
        c = spec[name]["cache"]
        assert (c["alpha_norm"], c["top_k"], c["pos"]) == ("topk", 1, "match")
        strategy = "token" if name == "row_match" else "lookup"
        assert (spec[name]["query"]["strategy"], spec[name]["summary"]["name"]) == (strategy, "token_max")
    for name in (
        "paper_cache",
        "paper_cache_layers2",
        "paper_cache_layers1",
        "gate",
        "gate_token_max_layers1",
    ):
        c = spec[name]["cache"]
        assert (c["alpha_norm"], c["top_k"]) == ("all", 2)
    layers = {name: spec[name]["cache"]["layers"] for name in spec if name != "txl"}
    assert layers["default"] == min(2, n) and layers["default_every_layer"] == n
    assert layers["paper_cache"] == layers["gate"] == layers["crtn_original"] == n
    assert layers["paper_cache_layers1"] == layers["gate_token_max_layers1"] == 1
    assert (spec["last_l_mean"]["query"]["strategy"], spec["last_l_mean"]["summary"]["name"]) == (
        "last_l",
        "mean",
    )
    assert spec["txl"]["model"]["name"] == "txl"
    # each row is what crtn-train composes from its overrides at the standard (smoke) sizes
    for name, overrides in (
        ("crtn_original_layers1", ["model=crtn_original", "cache.layers=1"]),
        ("txl", ["model=txl"]),
    ):
        assert spec[name] == spec_dict(resolve_spec(compose_train([*SMOKE_SIZES, *overrides])))
    # columns: ratios to the reference row; the crtn rows against txl over 8 + 8 * 8 tokens and at N = 80
    assert rows["txl"]["step_ratio"] == 1 and "range_ratio" not in rows["txl"]
    for name in DEFAULT_ROWS[1:]:
        r = rows[name]
        assert r["step_ratio"] == pytest.approx(r["step_ms"] / rows["txl"]["step_ms"])
        # every row with a cache retrieves somewhere: more products than Transformer-XL's
        assert r["flop_ratio"] == pytest.approx(r["gflop"] / rows["txl"]["gflop"]) and r["flop_ratio"] > 1
        assert r["gflop_per_s"] * r["step_ms"] / 1000 == pytest.approx(r["gflop"])
        assert r["range_tokens"] == 72 and r["range_ratio"] > 0 and r["eval_ratio"] > 0
        assert r["scaling_ratio"] > 0 and r["step_ms_large"] > 0
    assert [r["spec"]["model"]["mem_len"] for r in t["range_references"]] == [72]
    assert (t["n_slot"], t["n_slot_large"]) == (8, 80)
    assert (
        "| row | overrides | step ms | step / txl | products / txl | products GFLOP/s | memory / txl | tokens/s / txl(72) |"
        in md
    )


def test_only_times_the_named_rows_and_the_reference():
    """bench.only keeps the named rows (in bench.rows' order) and the reference; a name that is no
    row is refused in one line naming it."""
    spec = BenchSpec(**{**BENCH_SMOKE, "only": ["gate_layers1", "default"]})
    assert [r.name for r in compose_rows(spec)] == ["txl", "default", "gate_layers1"]
    with pytest.raises(ConfigError, match="bench.only: 'gate_layer1' is not one of bench.rows"):
        compose_rows(replace(spec, only=("gate_layer1",)))


def test_targets_are_evaluated_for_every_configuration_with_a_cache(smoke):
    res, md = smoke
    by_config: dict[str, dict[str, dict]] = {}
    for t in res["targets"]:
        by_config.setdefault(t["config"], {})[t["target"]] = t
        assert t["met"] == (
            t["measured"] >= t["limit"] if t["target"].startswith("tokens/s") else t["measured"] <= t["limit"]
        )
    crtn_rows = [name for name in (*DEFAULT_ROWS, "last_l_mean") if name != "txl"]
    table = {
        c.split(":")[0].removeprefix("table "): v for c, v in by_config.items() if c.startswith("table ")
    }
    assert sorted(table) == sorted(crtn_rows)
    for targets in table.values():
        assert {k: v["limit"] for k, v in targets.items()} == {
            "train step / txl": 1.3,
            "tokens/s / txl(mem_len=72)": 5.0,
            "step(n_slot=80) / step(n_slot=8)": 1.5,
        }
    config = [v for c, v in by_config.items() if c.startswith("config ")]
    assert len(config) == 1 and set(config[0]) == {"train step / txl", "tokens/s / txl(mem_len=72)"}
    assert "last_l/identity" in next(c for c in by_config if c.startswith("config "))
    faiss = [v for c, v in by_config.items() if "faiss" in c]
    assert faiss[0]["eval retrieval share"]["limit"] == 0.3
    assert "## Targets" in md


def test_targets_against_hand_values():
    res = {
        "config": {
            "label": "config x",
            "ratios": {"step_ratio": 1.2, "memory_ratio": 1.6, "range_ratio": 6.0, "range_tokens": 72},
        },
        "table": {
            "n_slot": 32,
            "n_slot_large": 1024,
            "rows": [
                {"row": "txl", "config": "txl(mem_len=64)", "overrides": ["model=txl"], "step_ratio": 1.0},
                {
                    "row": "a",
                    "config": "crtn(...)",
                    "overrides": ["model=crtn"],
                    "step_ratio": 1.31,
                    "memory_ratio": 1.5,
                    "range_ratio": 4.9,
                    "range_tokens": 2112,
                    "scaling_ratio": 1.49,
                },
            ],
        },
    }
    got = [(t["config"], t["target"], t["met"]) for t in check_targets(res)]
    assert got == [
        ("config x", "train step / txl", True),
        ("config x", "peak step memory / txl", False),
        ("config x", "tokens/s / txl(mem_len=72)", True),
        ("table a: crtn(...) (model=crtn)", "train step / txl", False),
        ("table a: crtn(...) (model=crtn)", "peak step memory / txl", True),
        ("table a: crtn(...) (model=crtn)", "tokens/s / txl(mem_len=2112)", False),
        ("table a: crtn(...) (model=crtn)", "step(n_slot=1024) / step(n_slot=32)", True),
    ]


def test_config_section_measures_peak_memory(tmp_path, capfd):
    """With bench.memory=true every training row has its peak step memory and the memory target is
    evaluated; a bench.* key given with bench.smoke=true wins (batch 3)."""
    run = tmp_path / "run"
    args = ["bench.smoke=true", "bench.memory=true", "bench.batch=3", "bench.sections=[config]", *ASKED]
    code, out, err = run_main(main, "crtn-bench", [*args, f"hydra.run.dir={run}"], capfd)
    assert code == 0, err
    cfg = json.loads((run / "bench.json").read_text())["config"]
    assert all(r["peak_step_mb"] > 0 and r["state_mb"] > 0 for r in cfg["train"])
    assert cfg["ratios"]["memory_ratio"] == pytest.approx(
        cfg["train"][0]["peak_step_mb"] / cfg["train"][1]["peak_step_mb"]
    )
    assert all(r["tokens_per_s"] * r["step_ms"] / 1000 == pytest.approx(3 * 8) for r in cfg["train"])
    targets = json.loads((run / "bench.json").read_text())["targets"]
    assert "peak step memory / txl" in {t["target"] for t in targets}
    assert "## config:" in out


def test_bench_composes_the_model_groups_as_crtn_train():
    overrides = ["model=crtn", "query=last_l", "summary=mean", "cache.layers=2", "cache.top_k=1"]
    bench, train = compose_bench(overrides), compose_train(overrides)
    for group in ("model", "cache", "query", "summary"):
        assert bench[group] == train[group]
    assert resolve_spec(bench) == resolve_spec(train)
    original = resolve_spec(compose_bench(["model=crtn_original", "query=last_l"]))  # the command line wins
    assert (original.cache.alpha_norm, original.query.strategy) == ("original", "last_l")


def test_main_pass_tool_runs_from_the_checkout():
    tool = load_tool("bench_main_pass")
    res = tool.measure(replace(BenchSpec(), **BENCH_SMOKE), batch=1, tgt_len=4, memory=False)
    assert (res["batch"], res["tgt_len"], res["pair"]) == (1, 4, "token/token_max")
    assert res["efficient_ms"] > 0 and res["naive_ms"] > 0
    assert res["speedup"] == pytest.approx(res["naive_ms"] / res["efficient_ms"])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"query.strategy": "token", "summary.name": "last_state", "cache.layers": 1, "cache.pos": "real"}],
)
def test_fill_leaves_a_full_cache_at_consistent_positions(overrides):
    """A cache larger than REAL_FILL_SLOTS: real steps, then random states in every slot, each slot
    one segment before the next and the newest right before the memory; training steps go on."""
    s = replace(BenchSpec(), **BENCH_SMOKE)
    n = REAL_FILL_SLOTS + 6
    case = make_case(
        "c", model_spec(s, "crtn", s.tgt_len, **{"cache.n_slot": n, **overrides}), s, torch.device("cpu")
    )
    stepper = Stepper(torch.device("cpu"), amp=False)
    stepper.fill(case)
    cache, L = case.state.cache, s.tgt_len
    assert cache.n_valid == n and cache.layer_values(0).std() > 0.5  # random states, not the real ones
    first = case.state.pos - s.tgt_len - n * L  # memory: one segment (mem_len = tgt_len)
    assert cache.pos.tolist() == [[first + i * L for i in range(n)]] * s.batch and first >= 0
    if cache.keys is not None:  # last_state keys: the key layer's last row of each slot
        top = cache.layer_values(cache.key_layer % cache.values.shape[0])
        assert torch.equal(cache.keys.to(top.dtype), top[:, :, -1])  # the values rounded as stored
    # two training steps: the segments leaving the memory replace slots 0 and 1 (FIFO), right
    # after the newest filled slot
    stepper(case)
    stepper(case)
    cache.commit()
    assert (
        cache.n_insert == n + 2
        and (cache.pos[:, :2] == torch.tensor([first + n * L, first + (n + 1) * L])).all()
    )


def test_step_peak_counts_each_allocation_once_by_hand():
    """A 4 MB tensor, then a 4 MB product made inside three nested operators (``linear`` ->
    ``matmul`` -> ``mm``), both freed, then another product: at most two are alive together, so
    the peak is 8,000,000 bytes (summing the operators' memory would count the products three
    times). A tensor alive before the call and freed in it is not seen (the profiler knows no
    size for it): 4 MB freed, then 4 MB allocated, peaks at 4,000,000 bytes."""
    a = torch.ones(1000, 1000)
    w = torch.ones(1000, 1000)

    def two_alive():
        b = torch.ones(1000, 1000)
        c = torch.nn.functional.linear(a, w)
        del b, c
        d = torch.nn.functional.linear(a, w)
        del d

    assert step_peak(two_alive, torch.device("cpu")) == 8_000_000
    held = [torch.ones(1000, 1000)]

    def free_then_allocate():
        held.pop()
        e = torch.ones(1000, 1000)
        del e

    assert step_peak(free_then_allocate, torch.device("cpu")) == 4_000_000


class _OutProduct(torch.autograd.Function):
    """a @ b through ``torch.bmm(..., out=)`` inside an autograd function, as the grouped
    products of crtn/model/grouped.py are computed; its backward is one more such product."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(b)
        return torch.bmm(a, b, out=a.new_empty(a.shape[0], a.shape[1], b.shape[2]))

    @staticmethod
    def backward(ctx, grad):
        (b,) = ctx.saved_tensors
        return torch.bmm(
            grad, b.transpose(1, 2), out=grad.new_empty(grad.shape[0], grad.shape[1], b.shape[1])
        ), None


def test_step_flops_counts_products_by_hand():
    """A linear layer on x [8, 16] -> [8, 32], forward and backward: 2·8·16·32 = 8,192 FLOPs for
    the output, as many for each of the gradients of x and of the weight; a product of [3, 5, 7]
    by [3, 7, 2] called with ``out=`` inside an autograd function: 2·3·5·7·2 = 420 FLOPs forward
    and 420 for its backward's one product. Element-wise work (the ReLU, the sum) counts
    nothing."""
    x = torch.randn(8, 16, requires_grad=True)
    lin = torch.nn.Linear(16, 32, bias=False)
    assert step_flops(lambda: torch.relu(lin(x)).sum().backward()) == 3 * 8_192
    a = torch.randn(3, 5, 7, requires_grad=True)
    b = torch.randn(3, 7, 2)
    assert step_flops(lambda: _OutProduct.apply(a, b).sum().backward()) == 2 * 420


def test_step_flops_of_a_transformer_xl_step_by_hand():
    """One training step of Transformer-XL at the smoke sizes (2 layers, d 32, 2 heads of 16,
    d_inner 64, L = M = 8, batch 2, vocabulary 64) against its products counted by hand
    (docs/method.md §1): per layer, forward, W_q and W_{k,E}, W_v of the segment, W_{k,E}, W_v of
    the memory, W_{k,R} of the M + L position embeddings, the three attention products (content
    and position scores, the mixing of values), W_o and the two feed-forward maps; the output
    layer; the backward pass twice the forward, less the input gradients that are not taken (the
    memory and the position embeddings are gradient-stopped)."""
    s = replace(BenchSpec(), **BENCH_SMOKE)
    B, L, d, H, dh, di, V = s.batch, s.tgt_len, s.d_model, s.n_head, s.d_head, s.d_inner, s.vocab
    M = L  # the benchmark's mem_len = tgt_len
    case = make_case("txl", model_spec(s, "txl", M), s, torch.device("cpu"))
    stepper = Stepper(torch.device("cpu"), amp=False)
    stepper.fill(case)
    T, R, hd = B * L, M + L, H * dh
    q, kv, mem_kv, r = 2 * T * d * hd, 2 * T * d * 2 * hd, 2 * B * M * d * 2 * hd, 2 * R * d * hd
    attention = 3 * 2 * B * H * L * (M + L) * dh
    o, ff = 2 * T * hd * d, 2 * 2 * T * d * di
    forward = q + kv + mem_kv + r + attention + o + ff
    layer = 3 * forward - mem_kv - r  # no gradient into the memory or the position embeddings
    output = 3 * 2 * T * d * V
    assert step_flops(lambda: stepper(case)) == s.n_layer * layer + output
