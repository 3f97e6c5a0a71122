"""One source of defaults: the schema (crtn/config.py) is what the command line composes, and the
tests', the benchmark's and the config groups' options build on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from crtn.app_config import APP_SCHEMAS, BenchSpec, pair_options, register_configs
from crtn.bench.cases import model_cfg, size_overrides
from crtn.config import STRATEGIES, RunSpec, default_summary, train_config
from crtn.data import load_corpus
from crtn.errors import ConfigError
from crtn.model import resolve_spec, valid_pairs, valid_summaries
from crtn.model.crtn import dependency_range
from tests.helpers import TEST_DEFAULTS, TINY, register_configs_once, tiny_cfg

CONF = Path(__file__).resolve().parents[1] / "conf"


def composed(config_name: str, overrides: list[str] | None = None):
    """The config an app composes from ``conf/`` (as on its command line), without the hydra node."""
    register_configs_once()
    with initialize_config_module(config_module="crtn.conf", version_base="1.3"):
        return compose(config_name, overrides=overrides or [])


def flat(cfg) -> dict[str, object]:
    """Dotted key -> value of a config (interpolations unresolved)."""
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


@pytest.mark.parametrize("app", sorted(APP_SCHEMAS))
def test_command_line_config_is_the_schema(app):
    cli = composed(app)
    assert "hydra" not in cli
    assert OmegaConf.to_container(cli) == OmegaConf.to_container(OmegaConf.structured(APP_SCHEMAS[app]))


def test_train_defaults_resolve_like_the_command_line():
    cli, schema = composed("train"), train_config()
    assert schema == OmegaConf.structured(RunSpec)
    assert OmegaConf.to_container(cli, resolve=True) == OmegaConf.to_container(schema, resolve=True)
    assert schema.model.mem_len == schema.model.tgt_len == 32  # mem_len follows tgt_len
    assert train_config({"model.tgt_len": 5}).model.mem_len == 5


def test_tests_and_benchmark_build_on_the_schema():
    """Both start from train_config(): they differ from the schema only in the keys they set."""
    schema = flat(train_config())

    def changed(cfg) -> set[str]:
        values = flat(cfg)
        assert set(values) == set(schema)  # nothing added or lost
        return {k for k, v in values.items() if v != schema[k]}

    assert changed(tiny_cfg()) <= set(TINY) | set(TEST_DEFAULTS)
    sizes = BenchSpec()
    given = {**size_overrides(sizes, 64), "model.name": "crtn", "query.strategy": "last_l"}
    assert changed(model_cfg(sizes, "crtn", 64, **{"query.strategy": "last_l"})) <= set(given)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_query_option_selects_its_default_summary(strategy):
    cfg = composed("train", [f"query={strategy}"])
    assert cfg.query.strategy == strategy
    assert cfg.summary.name == default_summary(strategy)
    assert default_summary(strategy) in valid_summaries(strategy)
    assert cfg.summary == composed("train", [f"summary={cfg.summary.name}"]).summary


def test_token_defaults_to_token_max():
    assert default_summary("token") == train_config().summary.name == "token_max"


def test_pair_options_are_exactly_the_valid_pairs():
    """The ablation sweep's options (``pair: glob(*)``) as Hydra lists them: no file and no
    option beyond the valid pairings."""
    register_configs()
    assert not (CONF / "pair").exists()
    with initialize_config_module(config_module="crtn.conf", version_base="1.3"):
        options = set(GlobalHydra.instance().config_loader().get_group_options("pair"))
    assert options == {f"{q}-{s}" for q, s in valid_pairs()}
    sweep = OmegaConf.create((CONF / "experiment" / "ablation_query.yaml").read_text())
    assert OmegaConf.to_container(sweep.hydra.sweeper.params) == {"pair": "glob(*)"}


@pytest.mark.parametrize("strategy,summary", valid_pairs(), ids=[f"{q}-{s}" for q, s in valid_pairs()])
def test_each_pair_option_selects_its_pair(strategy, summary):
    defaults = pair_options()[f"{strategy}-{summary}"]["defaults"]
    assert defaults == [{"override /query": strategy}, {"override /summary": summary}]
    cfg = composed("train", [f"+pair={strategy}-{summary}"])
    assert (cfg.query.strategy, cfg.summary.name) == (strategy, summary)
    # a job of the ablation sweep: the sweeper puts its parameter before the command line's
    cfg = composed("train", [f"pair={strategy}-{summary}", "+experiment=ablation_query"])
    assert (cfg.query.strategy, cfg.summary.name) == (strategy, summary)


def test_default_corpus_is_the_schemas():
    """The default corpus is the synthetic one the schema describes (its load time is the
    benchmark's business, not a test's)."""
    c = load_corpus(train_config().data)
    assert c.name == "synthetic" and len(c.splits["train"]) == 2_000_000 and len(c.vocab) == 512


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_each_experiment_composes_into_a_valid_model(name):
    cfg = composed("train", [f"+experiment={name}"])
    resolve_spec(cfg)


def test_recall_long_reaches_its_farthest_copy():
    """m + N L covers max_gap (and Transformer-XL's n_layer m + L does not reach min_gap)."""
    cfg = composed("train", ["+experiment=recall_long"])
    m, syn = cfg.model, cfg.data.synthetic
    assert dependency_range(m.mem_len, cfg.cache.n_slot, m.tgt_len) >= syn.max_gap
    assert m.n_layer * m.mem_len + m.tgt_len < syn.min_gap


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["summary=mean", "query=last_l", "summary.ngram=2"],
            "summary.ngram=2 is ignored by summary=mean (only token_max reads it)",
        ),
        (["summary.ngram=0"], "summary.ngram=0 must be in 1..model.tgt_len"),
        (["summary.ngram=33"], "summary.ngram=33 must be in 1..model.tgt_len (32)"),
        (["summary.shift=2"], "summary.shift=2 must be 0 or 1"),
        (
            ["summary=mean", "query=last_l", "summary.shift=1"],
            "summary.shift=1 is ignored by summary=mean (only token_max reads it)",
        ),
        (
            ["summary=mean", "query=last_l", "summary.cosine=true"],
            "summary.cosine=true is ignored by summary=mean (only token_max reads it)",
        ),
    ],
)
def test_ngram_validation_names_the_key(overrides, needle):
    cfg = composed("train", overrides)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve_spec(cfg)
