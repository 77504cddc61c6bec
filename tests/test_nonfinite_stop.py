"""A training loss that turns NaN/inf stops train.soft with one error line naming the step,
and no checkpoint or export of the bad state is written; the last good checkpoint resumes."""

import json
import os
import re

import numpy as np
import pytest

from s2d_jax.train import loop
from tiny_models import cli_error
from train import soft

MODEL_YAML = """\
vocab_size: 64
hidden_size: 32
intermediate_size: 64
num_layers: 2
num_heads: 4
num_kv_heads: 2
max_position_embeddings: 64
"""

TRAIN_YAML = """\
model: {{path: {model}}}
draft: {{exits: [1, 2]}}
data: {{seq_len: 32, batch_size: 8}}
synthetic_data: true
optimizer: {{lr: 1.0e-3, warmup_steps: 0, total_steps: 8}}
mesh: {{data: 8}}
checkpoint: {{save_every: 2, keep_last: 5}}
log_every: 3
"""


class PoisonedBatch:
    """The trainer's iterator with the loss mask of batch `at` (1-based) set to NaN."""

    def __init__(self, iterator, at: int):
        self.iterator, self.at, self.n = iterator, at, 0

    def __getattr__(self, name):  # get_state, set_state, state_per_process, ...
        return getattr(self.iterator, name)

    def __iter__(self):
        return self

    def __next__(self):
        batch, self.n = next(self.iterator), self.n + 1
        if self.n == self.at:
            batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
        return batch


@pytest.fixture
def config(tmp_path):
    (tmp_path / "model.yaml").write_text(MODEL_YAML)
    (tmp_path / "train.yaml").write_text(TRAIN_YAML.format(model=tmp_path / "model.yaml"))
    return tmp_path, str(tmp_path / "train.yaml")


def steps(ckpt_dir) -> list[str]:
    """The checkpoint dir's saved steps (besides them it holds the run's run_plan.json)."""
    return sorted(n for n in os.listdir(ckpt_dir) if n.isdigit())


def _args(d, cfg, *overrides):
    return ["--config", cfg, "--no-progress", f"checkpoint.dir={d / 'ck'}",
            f"metrics_path={d / 'm.jsonl'}", f"export_dir={d / 'hf'}", *overrides]


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(config, capsys,
                                                                          monkeypatch):
    d, cfg = config
    real = loop.make_train_iterator
    with monkeypatch.context() as mp:
        mp.setattr(loop, "make_train_iterator", lambda *a, **k: PoisonedBatch(real(*a, **k), 5))
        err = cli_error(soft.main, capsys, _args(d, cfg))
    # Step 5 is between the boundaries (log every 3, checkpoint every 2): found at step 6.
    assert re.search(r"diverged at step 5 \(loss nan, gradient norm nan\)", err), err
    assert f"the last checkpoint, step 4 in {d / 'ck'}, is kept" in err, err
    assert steps(d / "ck") == ["2", "4"]  # nothing saved from step 5 on
    assert _steps(d / "m.jsonl") == [3] and not (d / "hf").exists()

    # The kept checkpoint loads: a clean rerun resumes from step 4 and finishes.
    soft.main(_args(d, cfg))
    assert "step 8: loss " in capsys.readouterr().out
    assert steps(d / "ck") == ["2", "4", "6", "8"]
    with open(d / "m.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert _steps(d / "m.jsonl") == [3, 6, 8] and np.all(np.isfinite(losses))


def test_diverging_learning_rate_stops_before_any_bad_checkpoint(config, capsys):
    d, cfg = config
    err = cli_error(soft.main, capsys, _args(d, cfg, "optimizer.lr=1e30"))
    step = int(re.search(r"diverged at step (\d+) \(loss \S+, gradient norm \S+\)", err).group(1))
    assert all(int(s) < step for s in steps(d / "ck")), (err, os.listdir(d / "ck"))
    assert not (d / "hf").exists()


class EndsAfter(PoisonedBatch):
    """The poisoned iterator that runs out of data right after the poisoned batch."""

    def __next__(self):
        if self.n == self.at:
            raise StopIteration
        return super().__next__()


def test_nan_in_the_last_batch_before_the_data_ends_is_not_saved_or_exported(config, capsys,
                                                                             monkeypatch):
    """Step 5 is the last (the data ends), between log and checkpoint boundaries: the final
    save and the export must still check it."""
    d, cfg = config
    real = loop.make_train_iterator
    monkeypatch.setattr(loop, "make_train_iterator", lambda *a, **k: EndsAfter(real(*a, **k), 5))
    err = cli_error(soft.main, capsys, _args(d, cfg))
    assert re.search(r"diverged at step 5 \(loss nan", err), err
    assert steps(d / "ck") == ["2", "4"] and not (d / "hf").exists()
