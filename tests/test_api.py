"""The public API in s2d_jax/__init__.py on the committed demo family: lazy imports,
load_model + Decoder / Engine, the generate convenience (lossless against AR), train_soft."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

import s2d_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
TARGET, DRAFT = os.path.join(DEMO, "target-s"), os.path.join(DEMO, "draft")
PROMPT = "ROMEO:"


def test_import_of_a_leaf_module_stays_cheap():
    code = ("import sys, s2d_jax.errors, s2d_jax; "
            "heavy = [m for m in ('jax', 'flax', 'orbax', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; "
            "from s2d_jax import load_model; assert 'jax' in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_public_name_resolves():
    for name in s2d_jax.__all__:
        assert callable(getattr(s2d_jax, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        s2d_jax.nope


@pytest.fixture(scope="module")
def ar_tokens():
    cfg, params, _ = s2d_jax.load_model(TARGET)
    tok = s2d_jax.load_tokenizer(TARGET)
    decoder = s2d_jax.Decoder(cfg, params, method="ar")
    out, = decoder.generate([tok.encode(PROMPT, bos=True)], max_new_tokens=24, eos_id=tok.eos_id)
    return out["token_ids"]


def test_generate_s2d_equals_greedy_ar_and_speculates(ar_tokens):
    out = s2d_jax.generate(PROMPT, target=TARGET, draft=DRAFT, max_new_tokens=24)
    assert len(ar_tokens) >= 8
    assert out["token_ids"] == ar_tokens  # lossless: greedy S2D is greedy AR, EOS included
    assert out["stats"]["rounds"] < len(ar_tokens) and out["stats"]["mean_accepted_tokens"] > 1
    assert out["text"] and isinstance(out["text"], str)


def test_engine_routes_to_a_target_built_from_load_model(ar_tokens):
    cfg, params, _ = s2d_jax.load_model(TARGET)
    dcfg, dparams, extra = s2d_jax.load_model(DRAFT)
    tok = s2d_jax.load_tokenizer(TARGET)
    engine = s2d_jax.Engine({"s": s2d_jax.TargetSpec(cfg, params, gamma=3, tokenizer=tok)},
                            draft_cfg=dcfg, draft_params=dparams, method="sd", exits=[1])
    out, = engine.generate("s", [tok.encode(PROMPT, bos=True)], max_new_tokens=24,
                           eos_id=tok.eos_id)
    assert out["token_ids"] == ar_tokens
    with pytest.raises(s2d_jax.S2DError, match="unknown target 'l'"):
        engine.generate("l", [[1, 2]])


def test_generate_rejects_s2d_without_a_draft():
    with pytest.raises(s2d_jax.S2DError, match="needs a draft"):
        s2d_jax.generate(PROMPT, target=TARGET, method="s2d")


@pytest.mark.slow  # CI time: a training run; train.soft's tests cover the same loop fast
def test_train_soft_trains_and_exports_a_sorted_draft(tmp_path):
    out = s2d_jax.train_soft(os.path.join(ROOT, "configs", "train", "cpu_soft.yaml"), [
        f"model.path={os.path.join(ROOT, 'configs', 'train', 'cpu_draft_model.yaml')}",
        f"data.paths=[{os.path.join(ROOT, 'data', 'sharegpt_dummy_conversation.json')}]",
        f"data.tokenizer={os.path.join(ROOT, 'assets', 'llama2_tokenizer')}",
        "data.seq_len=64", "optimizer.total_steps=2", "optimizer.warmup_steps=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_every=2",
        f"metrics_path={tmp_path / 'metrics.jsonl'}", f"export_dir={tmp_path / 'hf'}"],
        devices=jax.devices()[:1])
    hist = out["history"]
    assert [h["step"] for h in hist] == [1, 2]
    assert all(math.isfinite(v) for h in hist for v in h["exit_loss"].values())
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["s2d_exits"] == [2, 3, 4]
