"""train.soft end to end on the shipped ShareGPT sample: crash + resume, export, bad input."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
# the `bench` extra's torch (HF reference models); `.[test]` leaves it out: a CUDA wheel is GBs
torch = pytest.importorskip("torch")
import transformers

from s2d_jax.model import transformer as model
from s2d_jax.errors import S2DError
from s2d_jax.io.hf import export_hf
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.train.config import load_train_config
from s2d_jax.parallel.mesh import make_mesh
from s2d_jax.train.loop import initial_params, resolve_draft, train
from train import soft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAREGPT = os.path.join(ROOT, "data", "sharegpt_dummy_conversation.json")
TOKENIZER = os.path.join(ROOT, "assets", "llama2_tokenizer")

MODEL_YAML = """\
vocab_size: {vocab}
hidden_size: 32
intermediate_size: 64
num_layers: 2
num_heads: 4
num_kv_heads: 2
max_position_embeddings: 256
"""

TRAIN_YAML = """\
model: {{path: {model}}}
draft: {{exits: [1, 2]}}
data:
  paths: [{data}]
  tokenizer: {tokenizer}
  seq_len: 64
  batch_size: 8
  seed: 3
optimizer: {{lr: 3.0e-3, warmup_steps: 2, total_steps: 8}}
checkpoint: {{save_every: 3, keep_last: 2}}
log_every: 1
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("soft")
    for vocab in (32000, 64):
        (d / f"model{vocab}.yaml").write_text(MODEL_YAML.format(vocab=vocab))
    cfg = d / "train.yaml"
    cfg.write_text(TRAIN_YAML.format(model=d / "model32000.yaml", data=SHAREGPT,
                                     tokenizer=TOKENIZER))
    return d, str(cfg)


class Crash(Exception):
    pass


def steps(ckpt_dir) -> list[str]:
    """The checkpoint dir's saved steps (besides them it holds the run's run_plan.json)."""
    return sorted(n for n in os.listdir(ckpt_dir) if n.isdigit())


def _crash(code):
    raise Crash(code)


def _train(cfg, *overrides):
    return train(load_train_config(cfg, list(overrides)), devices=jax.devices()[:1],
                 progress=False)


@pytest.fixture(scope="module")
def runs(files):
    """In-process: an uninterrupted run (with export) and one 'crashing' after step 6."""
    d, cfg = files
    a = _train(cfg, f"checkpoint.dir={d / 'ck_a'}", f"metrics_path={d / 'a.jsonl'}",
               f"export_dir={d / 'hf'}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "_exit", _crash)  # the debug hard exit raises instead of ending pytest
        with pytest.raises(Crash):
            _train(cfg, f"checkpoint.dir={d / 'ck_b'}", f"metrics_path={d / 'b.jsonl'}",
                   "stop_after_step=6")
    return a


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _fingerprints(path):
    return [(r["step"], r["batch_fingerprint"]) for r in _records(path)]


def _final_params(ck_dir):
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer().restore(os.path.join(ck_dir, "8", "state"))["params"]


def _check_resumed_run(d, ck, log):
    assert steps(ck) == ["6", "8"]  # resumed from 6; keep_last=2
    # Data order continues where it stopped: the same batches as the uninterrupted run,
    # none repeated or skipped.
    fp = _fingerprints(log)
    assert fp == _fingerprints(d / "a.jsonl")
    assert len({f for _, f in fp}) == len(fp) == 8
    for x, y in zip(jax.tree.leaves(_final_params(d / "ck_a")), jax.tree.leaves(_final_params(ck))):
        assert np.array_equal(x, y)


def test_stop_after_checkpoint_then_resume_is_bit_identical(files, runs):
    d, cfg = files
    ck, log = d / "ck_b", d / "b.jsonl"
    assert steps(ck) == ["3", "6"]
    assert [s for s, _ in _fingerprints(log)] == list(range(1, 7))
    resumed = _train(cfg, f"checkpoint.dir={ck}", f"metrics_path={log}")
    assert resumed["start_step"] == 6 and int(resumed["state"].step) == 8
    _check_resumed_run(d, ck, log)


def _cli(cfg, *overrides):
    """train.soft in a subprocess on 1 CPU device (same environment for every run)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_DEFAULT_MATMUL_PRECISION="highest")
    return subprocess.Popen([sys.executable, "-m", "train.soft", "--config", cfg, "--no-progress",
                             *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=900)
    return proc.returncode, out, err


@pytest.mark.slow
def test_killed_process_resumes_bit_identical(tmp_path, files):
    """A real process death (hard exit after the step-6 checkpoint), resumed by a new process,
    ends bit-identical to an uninterrupted process."""
    _, cfg = files
    d = tmp_path
    a = _cli(cfg, f"checkpoint.dir={d / 'ck_a'}", f"metrics_path={d / 'a.jsonl'}")
    b = _cli(cfg, f"checkpoint.dir={d / 'ck_b'}", f"metrics_path={d / 'b.jsonl'}",
             "stop_after_step=6")
    (rc_a, _, err_a), (rc_b, _, err_b) = _finish(a), _finish(b)
    assert rc_a == 0, err_a[-2000:]
    assert rc_b == 3, err_b[-2000:]  # the hard exit right after step 6, not a clean end
    assert steps(d / "ck_b") == ["3", "6"]
    rc, _, err = _finish(_cli(cfg, f"checkpoint.dir={d / 'ck_b'}", f"metrics_path={d / 'b.jsonl'}"))
    assert rc == 0, err[-2000:]
    _check_resumed_run(d, d / "ck_b", d / "b.jsonl")


def test_losses_fall_on_sharegpt(files, runs):
    d, _ = files
    hist = _records(d / "a.jsonl")
    for e in ("1", "2"):
        assert hist[-1]["exit_loss"][e] < hist[0]["exit_loss"][e] - 0.3
    for r in hist:
        np.testing.assert_allclose(r["loss"], np.mean(list(r["exit_loss"].values())), rtol=1e-6)


def test_export_loads_in_transformers_with_exits(files, runs):
    d, cfg = files
    with open(d / "hf" / "config.json") as f:
        assert json.load(f)["s2d_exits"] == [1, 2]
    hf = transformers.LlamaForCausalLM.from_pretrained(d / "hf", dtype=torch.float32)
    assert hf.config.num_hidden_layers == 2
    tokens = np.array([[1, 319, 13563, 1546, 263, 12758, 1404, 29889]], np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    params = jax.device_get(runs["state"].params)
    got, _ = jax.jit(model.forward, static_argnums=(1,))(params, runs["cfg"], tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def test_draft_initialised_from_first_layers_of_target(tmp_path):
    tcfg = model.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                             num_heads=4, num_kv_heads=2)
    target = jax.device_get(model.init_params(tcfg, jax.random.key(7)))
    export_hf(target, tcfg, str(tmp_path / "target"))
    tc = load_train_config(None, [f"model.path={tmp_path / 'target'}", "draft.exits=[1,2]",
                                  "synthetic_data=true"])
    cfg, exits, source = resolve_draft(tc)
    assert (cfg.num_layers, exits) == (2, (1, 2))
    params = initial_params(cfg, source, make_mesh(MeshConfig(), jax.devices()[:1]), 0)
    for name, x in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(x), target["layers"][name][:2])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), target["lm_head"])
    with pytest.raises(S2DError, match=r"go beyond the 4 layers"):
        resolve_draft(load_train_config(None, [f"model.path={tmp_path / 'target'}",
                                               "draft.exits=[2,5]"]))


def _tree_snapshot(path):
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = f.read()
    return out


MESH8 = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.mark.parametrize("overrides,message", [
    (["data.paths=[/nonexistent/sharegpt.json]"], "/nonexistent/sharegpt.json"),
    (["draft.exits=[2,1]"], r"draft exits \[2, 1\] are invalid for a 2-layer draft"),
    (["draft.exits=[1,3]"], r"draft exits \[1, 3\] are invalid for a 2-layer draft"),
    (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"], "product is 8"),
    (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"], "mesh tensor=8 does not divide"),
    (["model.path={d}/model64.yaml"], "tokenizer .* has 32000 tokens but the model's vocab_size is 64"),
    (["optimizer.bogus=1"], "unknown config key 'optimizer.bogus'"),
    (["model.path={d}/missing.yaml"], "model.path .*missing.yaml does not exist"),
])
def test_bad_input_is_one_error_line_exit_2_and_checkpoint_untouched(files, capsys, overrides,
                                                                     message):
    import re
    d, cfg = files
    ck = d / "ck_keep"
    (ck / "5").mkdir(parents=True, exist_ok=True)
    (ck / "5" / "sentinel").write_text("do not touch")
    before = _tree_snapshot(ck)
    args = ["--config", cfg, "--no-progress", f"checkpoint.dir={ck}", *MESH8,
            *[o.format(d=d) for o in overrides]]
    with pytest.raises(SystemExit) as exc:
        soft.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert _tree_snapshot(ck) == before


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit) as exc:
        soft.main(["--config", "/nonexistent/train.yaml"])
    assert exc.value.code == 2
    assert "config file /nonexistent/train.yaml not found" in capsys.readouterr().err
