"""Ahead-of-time compile of the training step on abstract shapes (nothing allocated)."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.train.config import load_train_config
from s2d_jax.train.loop import compile_step_aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_step_compiles_from_abstract_shapes_and_reports_memory():
    # A model whose float32 state (params + 2 Adam moments) is ~3.5 GB: allocating it
    # would be noticed; AOT only reads shapes. Split over fsdp=4 x tensor=2.
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_layers=4,
                      num_heads=16, num_kv_heads=16)
    tc = load_train_config(None, ["model.path=unused", "draft.exits=[2,3,4]", "mesh.fsdp=4",
                                  "mesh.tensor=2", "data.batch_size=8", "data.seq_len=256",
                                  "optimizer.grad_accum_steps=2", "remat=full"])
    compiled, _, _ = compile_step_aot(tc, cfg, (2, 3, 4), jax.devices())
    m = compiled.memory_analysis()
    state_bytes = 3 * 4 * cfg.num_params()
    # Each device holds 1/8 of the state (plus replicated norms): argument ~ state / 8.
    assert state_bytes / 8 <= m.argument_size_in_bytes < state_bytes / 8 * 1.05
    batch_bytes = (8 // 4) * 256 * 4 * 5  # this device's rows of the 5 batch arrays
    assert m.alias_size_in_bytes == m.argument_size_in_bytes - batch_bytes  # state donated
    assert m.temp_size_in_bytes > 0


@pytest.mark.slow
def test_paper_7b_soft_step_compiles_on_8_fake_devices():
    proc = subprocess.run(
        [sys.executable, "-m", "train.aot", "--fake-devices", "8", "--config",
         "configs/train/vicuna7b_soft.yaml", "--target-config", "configs/models/vicuna-7b-v1.5.yaml"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "devices: 8 x cpu" in out and "exits [6, 9, 12]" in out
    for row in ("argument", "output", "temp", "generated code", "compile"):
        assert row in out
    print(out)


def _train_aot(*args):
    return subprocess.run(
        [sys.executable, "-m", "train.aot", "--config", "configs/train/engine_h100.yaml",
         "--target-config", "configs/train/cpu_draft_model.yaml", *args, "draft.exits=[2,4]",
         "data.seq_len=64", "data.batch_size=32", "mesh.data=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})


def test_a_config_whose_model_path_a_pipeline_sets_compiles_for_the_target_config():
    # engine_h100.yaml has no model.path (data_engine fills it in): the shapes come from
    # --target-config, and the step compiled is the run's, KD term and teacher states included
    proc = _train_aot("--fake-devices", "8", "mesh.fsdp=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exits [2, 4]" in proc.stdout and "remat save_dot_with_context_except_mlp" in proc.stdout


LIBTPU = os.environ.get("S2D_LIBTPU_PATH", "")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None and not os.path.isfile(LIBTPU),
                    reason="libtpu (the TPU compiler) is not installed and S2D_LIBTPU_PATH "
                           "names no libtpu.so")
def test_the_tpu_report_gives_model_flops_and_mfu_at_the_compilers_time():
    proc = _train_aot("--topology", "v5p:2x2x2", "mesh.fsdp=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "layers and exit losses unrolled" in out
    # a micro-batch's compiler time, from the tokens a second (printed to the token)
    per_second = float(re.search(r"([\d,]+) tokens a second", out).group(1).replace(",", ""))
    micro_seconds = 32 * 64 / per_second / 4
    number = r"([\d.]+(?:e[-+]?\d+)?)"
    flops = float(re.search(rf"model flops a micro-batch per chip: {number} TFLOP", out).group(1))
    mfu = float(re.search(rf"MFU at the compiler's time: {number} \(peak 459", out).group(1))
    assert flops > 0 and mfu == pytest.approx(flops * 1e12 / (micro_seconds * 459e12), rel=0.01)
