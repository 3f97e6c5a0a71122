"""Options that would compute nothing are refused, in one line naming the key.

- A ``summary.*`` or ``query.*`` option that the chosen summary or strategy does not read: the
  classes declare what they read (``reads``, ``ignores_summary``); the table below is the
  reference, written from docs/configuration.md, and each refused option is shown to change
  nothing in a model built past the check (outputs equal to the last bit).
- ``same_length`` without memory: every query would attend no position (NaN).
- ``cache.n_slot``/``cache.top_k`` in crtn-eval and crtn-generate: ``eval.n_slot``/``eval.top_k``
  is the one route, and it changes the cache the evaluation builds.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch

from crtn.app_config import EvalAppSpec, GenerateAppSpec
from crtn.config import check_eval_cache, resolve, schema_node, upgrade
from crtn.errors import ConfigError
from crtn.model import (
    STRATEGIES,
    SUMMARIES,
    build_model,
    evaluation_spec,
    model_class,
    resolve_spec,
    valid_pairs,
)
from crtn.model.spec import QuerySpec, SummarySpec
from crtn.train import main as train_main
from tests.helpers import TINY_RUN, compose_train, run_main, tiny_cfg, tiny_model

#: docs/configuration.md: who reads each option (every strategy reads query.strategy and
#: query.detach, every summary summary.name)
SUMMARY_READERS = {
    "d_key": {"linear", "token_max"},
    "ngram": {"token_max"},
    "shift": {"token_max"},
    "cosine": {"token_max"},
}
#: every strategy reads query.strategy and query.detach; the options of one strategy
QUERY_READERS: dict[str, set[str]] = {"max_match": {"lookup"}}
#: summary options that query=gate (it scores with each layer's projections) and query=lookup (it
#: compares tokens) leave unused
GATE_IGNORES = {"d_key", "cosine"}
#: a value other than the default, valid for the classes that read it
SAMPLE = {"d_key": 6, "ngram": 2, "shift": 0, "cosine": True, "max_match": 8}
TEXT = {True: "true"}


def test_the_declarations_are_the_documented_readers():
    for key, readers in SUMMARY_READERS.items():
        assert {n for n, c in SUMMARIES.items() if key in c.reads} == readers, key
    for key, readers in QUERY_READERS.items():
        assert {n for n, c in STRATEGIES.items() if key in c.reads} == readers, key
    assert all({"strategy", "detach"} <= c.reads for c in STRATEGIES.values())
    assert all("name" in c.reads for c in SUMMARIES.values())
    assert {n for n, c in STRATEGIES.items() if c.ignores_summary} == {"gate", "lookup"}
    assert STRATEGIES["gate"].ignores_summary == STRATEGIES["lookup"].ignores_summary == GATE_IGNORES


def test_every_declared_name_is_an_option_and_every_option_is_read():
    """A stale name (an option deleted from the spec) or an option no class reads fails here."""
    summary_keys, query_keys = {f.name for f in fields(SummarySpec)}, {f.name for f in fields(QuerySpec)}
    for name, cls in SUMMARIES.items():
        assert cls.reads <= summary_keys, (name, cls.reads - summary_keys)
    for name, cls in STRATEGIES.items():
        assert cls.reads <= query_keys, (name, cls.reads - query_keys)
        assert cls.ignores_summary <= summary_keys, name
    assert set().union(*(c.reads for c in SUMMARIES.values())) == summary_keys
    assert set().union(*(c.reads for c in STRATEGIES.values())) == query_keys


def _pair_cfg(strategy: str, summary: str, **extra):
    return tiny_cfg(**{"model.name": "crtn", "query.strategy": strategy, "summary.name": summary, **extra})


def _expected(strategy: str, summary: str, group: str, key: str) -> str | None:
    """The refusal the reference table predicts for ``group.key`` set to its sample value, or None."""
    value = TEXT.get(SAMPLE[key], str(SAMPLE[key])).lower()
    if group == "query":
        readers = sorted(QUERY_READERS[key], key=list(STRATEGIES).index)
        if strategy in readers:
            return None
        verb = "reads" if len(readers) == 1 else "read"
        return f"query.{key}={value} is ignored by query={strategy} (only {'|'.join(readers)} {verb} it)"
    readers = sorted(SUMMARY_READERS[key], key=list(SUMMARIES).index)
    if summary not in readers:
        verb = "reads" if len(readers) == 1 else "read"
        return f"summary.{key}={value} is ignored by summary={summary} (only {'|'.join(readers)} {verb} it)"
    if strategy == "gate" and key in GATE_IGNORES:
        others = [q for q, s in valid_pairs() if s == summary and q != "gate"]  # lookup: not a pair
        verb = "reads" if len(others) == 1 else "read"
        return f"summary.{key}={value} is ignored by query=gate (with summary={summary}, only {'|'.join(others)} {verb} it)"
    return None


CASES = [
    (q, s, group, key)
    for q, s in valid_pairs()
    for group, keys in (("summary", SUMMARY_READERS), ("query", QUERY_READERS))
    for key in keys
]


@pytest.mark.parametrize("strategy,summary", valid_pairs(), ids=[f"{q}-{s}" for q, s in valid_pairs()])
def test_an_option_is_refused_exactly_where_it_is_not_read(strategy, summary):
    """Every option of the table, set alone on every valid pair: accepted where it is read, else
    refused with the exact line."""
    base = resolve_spec(_pair_cfg(strategy, summary))
    for _, _, group, key in [c for c in CASES if c[:2] == (strategy, summary)]:
        spec = replace(base, **{group: replace(getattr(base, group), **{key: SAMPLE[key]})})
        expected = _expected(strategy, summary, group, key)
        if expected is None:
            resolved = resolve_spec(spec)
            assert getattr(getattr(resolved, group), key) == SAMPLE[key], key
            assert resolve_spec(resolved) == resolved  # resolving again accepts it
        else:
            with pytest.raises(ConfigError) as e:
                resolve_spec(spec)
            assert str(e.value) == expected


def test_the_command_line_gives_the_same_refusal():
    with pytest.raises(ConfigError) as e:
        resolve(compose_train(["query=last_l", "summary=mean", "summary.ngram=8"]))
    assert str(e.value) == "summary.ngram=8 is ignored by summary=mean (only token_max reads it)"


def _outputs(spec, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of 4 segments from a model built for ``spec`` as given (no resolution)."""
    torch.manual_seed(0)
    model = model_class(spec.model.name)(11, spec).double().eval()
    state, out = None, []
    with torch.no_grad():
        for seg in tokens.split(3, dim=1):
            o = model(seg, seg, state)
            state = o.state
            out.append(o.nll)
    return torch.cat(out, 1)


REFUSED = [c for c in CASES if _expected(*c) is not None]
#: one pair per summary and per strategy (the others repeat them)
SHOWN = sorted({next(c for c in REFUSED if c[1] == s) for s in SUMMARIES if any(c[1] == s for c in REFUSED)})
SHOWN += sorted(
    {
        next(c for c in REFUSED if c[0] == q and c[2] == "query")
        for q in STRATEGIES
        if any(c[0] == q and c[2] == "query" for c in REFUSED)
    }
)
SHOWN += [c for c in REFUSED if c[0] == "gate" and c[1] == "token_max"]


@pytest.mark.parametrize(
    "strategy,summary,group,key", SHOWN, ids=[f"{q}-{s}-{g}.{k}" for q, s, g, k in SHOWN]
)
def test_a_refused_option_changes_nothing(strategy, summary, group, key):
    """Built past the check, the model with the option computes the same as without it: it was
    ignored (so refusing it loses nothing)."""
    spec = resolve_spec(_pair_cfg(strategy, summary))
    with_option = replace(spec, **{group: replace(getattr(spec, group), **{key: SAMPLE[key]})})
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_outputs(spec, tokens), _outputs(with_option, tokens))


def test_models_without_a_cache_take_the_cache_groups_unchecked():
    """An experiment sweeping model=txl,crtn sets the CRTN groups for both."""
    run = resolve(compose_train(["model=txl", "summary=mean", "query=last_l", "summary.ngram=8"]))
    assert run.summary.ngram == 8 and run.model.name == "txl"


def test_a_saved_config_drops_the_options_its_classes_did_not_read():
    """A checkpoint trained while an ignored option was accepted still loads, as what it ran."""
    saved = {
        "model": {"name": "crtn"},
        "summary": {"name": "mean", "tanh": True, "d_key": 8, "window": 2},
        "query": {"strategy": "last_l", "tanh": True, "detach": True},
    }
    out = upgrade(saved)
    assert out["summary"] == {"name": "mean", "window": 2}  # an unknown key stays (the schema refuses it)
    assert out["query"] == {"strategy": "last_l", "detach": True}
    assert saved["summary"]["tanh"] is True  # the saved dict is not changed
    txl = {"model": {"name": "txl"}, "summary": {"name": "mean", "tanh": True}}
    assert upgrade(txl)["summary"] == {"name": "mean", "tanh": True}


def test_a_saved_config_drops_removed_options_whose_behaviour_stayed():
    """Options removed from the schema: a checkpoint that used the behaviour the code keeps loads
    (the key dropped), one that used another is refused in one line naming the key."""
    saved = {
        "model": {"name": "crtn", "sdpa": True},
        "cache": {"theta": 1.0, "renew": "fifo", "eval_kv": True, "hnsw_m": 32},
        "summary": {"name": "token_max", "tanh": False, "shortlist": None},
        "query": {"strategy": "single_linear", "tanh": True, "per_head": False},
    }
    out = upgrade(saved)
    assert out["model"] == {"name": "crtn"} and out["cache"] == {}
    assert out["summary"] == {"name": "token_max", "ngram": 1, "shift": 0}  # LEGACY: what it trained with
    assert out["query"] == {"strategy": "single_linear"}
    for group, values, key in [
        ("cache", {"theta": 2.0}, "cache.theta=2.0"),
        ("summary", {"name": "token_max", "shortlist": 4}, "summary.shortlist=4"),
        ("summary", {"name": "linear", "tanh": True}, "summary.tanh=True"),
        ("query", {"strategy": "linear", "tanh": True}, "query.tanh=True"),
        ("query", {"strategy": "gate", "per_head": True}, "query.per_head=True"),
    ]:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} was removed"):
            upgrade({"model": {"name": "crtn"}, group: values})


# ---------------------------------------------------------------------------- same_length


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=txl", "model.mem_len=0", "model.same_length=true"],
            "model.same_length=true with model.mem_len=0 masks every position of every query (each attends "
            "its mem_len latest positions): use model.same_length=false or a memory",
        ),
        (
            ["model=crtn", "model.mem_len=0", "model.same_length=true"],
            "model.same_length=true with model.mem_len=0 masks every position of every query (each attends "
            "its mem_len latest positions): use model.same_length=false or a memory",
        ),
        (
            ["model=vanilla", "model.same_length=true"],
            "model.same_length=true masks every position of every query of model=vanilla, which has no "
            "memory (use model.same_length=false)",
        ),
        (
            ["model=txl", "model.same_length=true", "eval.mem_len=0"],
            "eval.same_length=true with eval.mem_len=0 masks every position of every query (each attends "
            "its mem_len latest positions): use eval.same_length=false or a memory",
        ),
        (
            ["model=vanilla", "eval.same_length=true"],
            "eval.same_length=true masks every position of every query of model=vanilla, which has no "
            "memory (use eval.same_length=false)",
        ),
    ],
)
def test_same_length_without_memory_is_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        resolve(compose_train(overrides))
    assert str(e.value) == message


@pytest.mark.parametrize("model", ["txl", "crtn"])
def test_same_length_without_memory_stops_crtn_train_before_any_step(model, tmp_path, capfd):
    """The run that used to end in "training loss became nan by step 5" is refused before the
    run folder gets a checkpoint or a logged step."""
    run = tmp_path / "run"
    args = [*TINY_RUN, f"model={model}", "model.mem_len=0", "model.same_length=true", f"hydra.run.dir={run}"]
    args = [a for a in args if model != "txl" or not a.startswith("cache.")]
    code, out, err = run_main(train_main, "crtn-train", args, capfd)
    assert code == 2 and err.strip().splitlines() == [
        "crtn-train: error: model.same_length=true with model.mem_len=0 masks every position of every "
        "query (each attends its mem_len latest positions): use model.same_length=false or a memory"
    ]
    assert not (run / "checkpoints").exists() and "step" not in out


@pytest.mark.parametrize("name", ["vanilla", "txl", "crtn"])
def test_same_length_without_memory_was_nan(name):
    """Why: built past the check, every query attends nothing and every output is NaN."""
    spec = resolve_spec(tiny_cfg(**{"model.name": name, "model.mem_len": 0}))
    spec = replace(spec, model=replace(spec.model, same_length=True))
    model = model_class(name)(11, spec).eval()
    tokens = torch.randint(0, 11, (2, 3))
    with torch.no_grad():
        assert model(tokens, tokens).nll.isnan().all()


def test_same_length_masks_no_whole_row_with_memory():
    """Every other memory length leaves each query at least itself, memory empty or full, for
    segments longer and shorter than the memory (the mask of crtn/model/transformer.py)."""
    for mem_len in range(1, 7):
        spec = resolve_spec(
            tiny_cfg(**{"model.name": "txl", "model.mem_len": mem_len, "model.same_length": True})
        )
        model = build_model(spec, 11)
        for L in range(1, 8):
            for M in range(0, mem_len + 1):
                mask = model._attn_mask(L, M, torch.device("cpu"))
                assert not mask.all(1).any(), (mem_len, L, M)
                assert (~mask).sum(1).max() <= max(mem_len, M + L) and not mask[:, M:].diagonal().any()


# ---------------------------------------------------------------------------- eval cache route


@pytest.mark.parametrize("schema", [EvalAppSpec, GenerateAppSpec])
@pytest.mark.parametrize("key,value", [("n_slot", 16), ("top_k", 1)])
def test_eval_apps_refuse_the_cache_route(schema, key, value):
    node = schema_node(schema)
    check_eval_cache(node.cache)  # the default: nothing set
    node.cache[key] = value  # as a config file or the command line would
    with pytest.raises(ConfigError) as e:
        check_eval_cache(node.cache)
    assert str(e.value) == (
        f"cache.{key}={value} is not read at evaluation: give eval.{key}={value} (the evaluation's cache size)"
    )


def test_eval_route_changes_the_evaluated_cache():
    """eval.n_slot and eval.top_k build the evaluation model's cache: N slots filled, k selected."""
    model = tiny_model(11, **{"model.name": "crtn", "cache.n_slot": 3, "cache.top_k": 2})
    ev = SimpleNamespace(n_slot=5, top_k=1)
    twin = build_model(evaluation_spec(model.spec, ev), 11).double().eval()
    twin.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 11, (2, 3 * 8), generator=torch.Generator().manual_seed(2))
    state = None
    with torch.no_grad():
        for seg in tokens.split(3, dim=1):
            out = twin(seg, seg, state)
            state = out.state
    assert state.cache.n_slot == 5 and state.cache.n_valid == 5
    assert out.selection.slot.shape[-1] == 1  # top-1 retrieval
    assert (model.spec.cache.n_slot, model.spec.cache.top_k) == (3, 2)  # the trained model is unchanged
