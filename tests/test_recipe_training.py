"""The training features of the CRTN authors' recipe, each off by default and checked
against a hand computation: TAR's value and its place in the loss, the embedding learning-rate
group, Polyak averaging (the averaged weights are the mean of the weights after each step since
the start; evaluation and best.pt use them; an interrupted run resumes them exactly), and the
training length in epochs."""

from __future__ import annotations

import copy

import pytest
import torch

from crtn.checkpoint import load_checkpoint
from crtn.config import resolve
from crtn.distributed import DistributedContext
from crtn.errors import ConfigError
from crtn.optim import avg_start_step, param_groups, tar_penalty
from crtn.trainer import Trainer
from tests.helpers import tiny_cfg

#: a tiny synthetic corpus and model (train split: 4000 tokens; batch 4 x 8: 124 steps per epoch)
SMALL = {
    "model.n_layer": 1,
    "model.d_model": 16,
    "model.n_head": 2,
    "model.d_head": 8,
    "model.d_inner": 32,
    "model.tgt_len": 8,
    "model.mem_len": 8,
    "cache.n_slot": 4,
    "data.batch_size": 4,
    "data.eval_batch_size": 4,
    "data.synthetic.vocab_size": 24,
    "data.synthetic.branching": 4,
    "data.synthetic.passage_len": 4,
    "data.synthetic.doc_passages": 16,
    "data.synthetic.min_gap": 24,
    "data.synthetic.max_gap": 40,
    "data.synthetic.train_tokens": 4000,
    "data.synthetic.valid_tokens": 256,
    "data.synthetic.test_tokens": 256,
    "train.progress": False,
    "optim.scheduler": "constant",
    "optim.warmup_step": 0,
    "optim.lr": 1e-2,
}


def make_trainer(tmp_path, **overrides) -> Trainer:
    cfg = tiny_cfg(**{**SMALL, **overrides})
    torch.manual_seed(cfg.seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Trainer(resolve(cfg), dist=DistributedContext(), device=torch.device("cpu"), run_dir=tmp_path)


def batches(trainer: Trainer, n: int):
    it = trainer.train_it.iterate(0)
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------- TAR
def test_tar_value_by_hand():
    # one stream, 3 positions, 2 features: differences (1, -2) and (2, 4)
    h = torch.tensor([[[0.0, 1.0], [1.0, -1.0], [3.0, 3.0]]])
    # squares 1, 4, 4, 16: mean 25 / 4
    assert tar_penalty(h, 0.1).item() == pytest.approx(0.1 * 25 / 4)
    # two streams: the mean runs over B * (L-1) * d
    h2 = torch.cat([h, torch.zeros_like(h)])
    assert tar_penalty(h2, 2.0).item() == pytest.approx(2.0 * 25 / 8)
    assert tar_penalty(h[:, :1], 5.0).item() == 0.0  # one position: no pair


def test_tar_enters_the_training_loss(tmp_path):
    """One step with train.tar > 0 moves the weights as plain Adam on nll + TAR does."""
    beta = 0.7
    t = make_trainer(tmp_path, **{"train.tar": beta, "optim.clip": 0.0})
    t.start()
    batch = batches(t, 1)[0]
    model = copy.deepcopy(t.model)
    opt = torch.optim.Adam(model.parameters(), lr=t.cfg.optim.lr)
    out = model(batch.input, batch.target, model.init_state(4, torch.device("cpu")))
    loss = out.nll.mean() + beta * ((out.hidden[:, 1:] - out.hidden[:, :-1]) ** 2).mean()
    loss.backward()
    opt.step()
    t.train_step(batch)
    for (name, a), b in zip(t.model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
    # the logged loss is the NLL alone
    assert t.loss_sum.item() == pytest.approx(out.nll.mean().item(), rel=1e-6)


# ---------------------------------------------------------------- embedding learning rate
def test_emb_lr_mult_param_groups(tmp_path):
    t = make_trainer(tmp_path, **{"optim.emb_lr_mult": 2.0, "optim.lr": 3e-3})
    rest, emb = t.optimizer.param_groups
    assert rest["lr"] == pytest.approx(3e-3) and emb["lr"] == pytest.approx(6e-3)
    emb_ids = {id(p) for p in emb["params"]}
    assert emb_ids == {id(p) for p in t.model.word_emb.parameters()}
    # the output layer's weights are tied to the embedding: they take the embedding's rate
    assert id(t.model.crit.out_layers[0].weight) in emb_ids
    everything = [id(p) for g in (rest, emb) for p in g["params"]]
    assert sorted(everything) == sorted(id(p) for p in t.model.parameters())  # each once
    # the schedule scales both groups alike
    t2 = make_trainer(
        tmp_path,
        **{"optim.emb_lr_mult": 2.0, "optim.scheduler": "cosine", "optim.warmup_step": 4, "optim.lr": 1e-3},
    )
    t2.optimizer.step()  # no gradients: no change
    t2.scheduler.step()
    lrs = [g["lr"] for g in t2.optimizer.param_groups]
    assert lrs == pytest.approx([1e-3 * 2 / 4, 2e-3 * 2 / 4])
    # off: one group, as before the key existed
    assert len(make_trainer(tmp_path).optimizer.param_groups) == 1
    assert len(param_groups(t.model, 1.0, 1.0)) == 1


# ---------------------------------------------------------------- averaging
def test_avg_start_fraction_or_step():
    assert avg_start_step(None, 100) is None
    assert avg_start_step(0.8, 250) == 200
    assert avg_start_step(0.0, 10) == 0
    assert avg_start_step(37, 100) == 37
    with pytest.raises(ConfigError, match="train.avg_start=2.5"):
        avg_start_step(2.5, 100)
    with pytest.raises(ConfigError, match="train.avg_start=-1"):
        avg_start_step(-1, 100)


def test_averaged_weights_are_the_hand_mean(tmp_path):
    t = make_trainer(tmp_path, **{"train.avg_start": 3})
    t.start()
    after = []
    for batch in batches(t, 7):
        t.train_step(batch)
        after.append({n: p.detach().clone() for n, p in t.model.named_parameters()})
        assert t.average.active == (t.step > 3)
        assert (t.eval_model is t.average.module) == (t.step > 3)
    avg = dict(t.average.module.named_parameters())
    for name in after[0]:
        hand = sum(a[name] for a in after[3:]) / 4  # weights after steps 4, 5, 6, 7
        torch.testing.assert_close(avg[name], hand, rtol=1e-6, atol=1e-7)  # float32 running mean
    # best.pt holds the averaged weights, last.pt the trained ones and the average
    t.validate()
    best = load_checkpoint(t.best)["model"]
    assert torch.equal(best["word_emb.emb_layers.0.weight"], avg["word_emb.emb_layers.0.weight"])
    t.save_last()
    last = load_checkpoint(t.last)
    assert torch.equal(
        last["model"]["word_emb.emb_layers.0.weight"], after[-1]["word_emb.emb_layers.0.weight"]
    )
    assert int(last["averaged"]["n_averaged"]) == 4


def test_averaging_resumes_exactly(tmp_path):
    keys = {"train.avg_start": 3, "train.eval_interval": 100, "model.dropout": 0.1}
    full = make_trainer(tmp_path / "full", **keys, **{"train.max_step": 9})
    full.start()
    full.fit()
    part = make_trainer(tmp_path / "part", **keys, **{"train.max_step": 5})
    part.start()
    part.fit()
    part.save_last()
    # a resume may not change train.* unless asked; the schedule here is constant
    rest = make_trainer(tmp_path / "part", **keys, **{"train.max_step": 9, "train.allow_change": True})
    rest.start()
    assert rest.step == 5
    rest.fit()
    for a, b in zip(full.average.module.parameters(), rest.average.module.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- epochs
def test_max_epoch_stops_at_the_epoch_end(tmp_path):
    t = make_trainer(
        tmp_path, **{"train.max_epoch": 2, "train.max_step": 10**6, "train.eval_interval": 10**6}
    )
    per_epoch = len(t.train_it)
    assert per_epoch == (t.corpus.splits["train"].numel() - 1) // 4 // 8  # segments of 8 per stream
    assert t.total_steps == 2 * per_epoch
    t.start()
    assert t.fit() is None
    assert t.step == 2 * per_epoch and t.progress.epoch == 1  # two passes: epochs 0 and 1
    # max_step first
    assert make_trainer(tmp_path, **{"train.max_epoch": 2, "train.max_step": 5}).total_steps == 5


@pytest.mark.parametrize(
    "key,value",
    [("train.tar", -0.1), ("train.max_epoch", 0), ("optim.emb_lr_mult", 0.0), ("train.avg_start", 1.5)],
)
def test_bad_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve(tiny_cfg(**{key: value}))
