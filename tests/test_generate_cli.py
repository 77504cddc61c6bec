"""`python -m infer.generate` on tiny exported HF models with the Llama-2 tokenizer."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.generate import main
from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.io.hf import export_hf
from s2d_jax.io.tokenizer import load_tokenizer
from tiny_models import cli_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "assets", "llama2_tokenizer")
if not os.path.isdir(TOKENIZER):
    TOKENIZER = "/work/shared/data/llama2_tokenizer"
CFG = ModelConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=128)


def _params(cfg, seed):
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(x.shape, np.float32)
        return (0.5 * rng.standard_normal(x.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, model.abstract_params(cfg))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    target = _params(CFG, 0)
    export_hf(target, CFG, str(root / "target"), tokenizer_dir=TOKENIZER)
    draft_cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 2})
    draft = dict(target, layers=jax.tree.map(lambda x: x[:2], target["layers"]))
    export_hf(draft, draft_cfg, str(root / "draft"), extra={"s2d_exits": [1, 2]},
              tokenizer_dir=TOKENIZER)
    bad_cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 2, "vocab_size": 32008})
    export_hf(_params(bad_cfg, 1), bad_cfg, str(root / "bad_draft"))
    prompts = root / "q.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 7, "category": "math", "turns": ["What is 2+2?", "x"]}) + "\n"
        + json.dumps({"question_id": 8, "category": "writing", "turns": ["Say hi."]}) + "\n")
    return root, target


def greedy_reference(params, ids, n):
    fwd = jax.jit(lambda p, t: model.forward(p, CFG, t)[0])
    buf = np.zeros((1, 128), np.int32)
    buf[0, :len(ids)] = ids
    for t in range(len(ids), len(ids) + n):
        buf[0, t] = int(jnp.argmax(fwd(params, jnp.asarray(buf))[0, t - 1]))
    return buf[0, len(ids):len(ids) + n].tolist()


def test_s2d_cli_writes_lossless_jsonl(models):
    root, target = models
    out = root / "out.jsonl"
    rc = main(["--target", f"vic={root / 'target'}", "--draft", str(root / "draft"),
               "--method", "s2d", "--thresholds", "0.3,0", "--gamma", "2",
               "--max-new-tokens", "6", "--questions", str(root / "q.jsonl"),
               "--batch-size", "2", "--time-split", "--chat-template", "vicuna",
               "--out-file", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # every turn answered, in order: question 7's second turn after its own first answer
    assert [(r["question_id"], r["turn"]) for r in rows] == [(7, 1), (7, 2), (8, 1)]
    assert set(rows[0]) == {"question_id", "category", "target", "turn", "token_ids", "text",
                            "stats"}
    tok = load_tokenizer(TOKENIZER)
    from s2d_jax.data.prompts import prompt_ids, reply_text
    first = reply_text(tok, rows[0]["token_ids"])
    prompts = [prompt_ids(tok, "vicuna", ["What is 2+2?"]),
               prompt_ids(tok, "vicuna", ["What is 2+2?", "x"], [first]),
               prompt_ids(tok, "vicuna", ["Say hi."])]
    for r, ids in zip(rows, prompts):
        ref = greedy_reference(target, ids, 6)
        eos_cut = ref.index(tok.eos_id) + 1 if tok.eos_id in ref else len(ref)
        assert r["token_ids"] == ref[:eos_cut]
        assert r["text"] == tok.decode(r["token_ids"])
        assert r["target"] == "vic"
        s = r["stats"]
        assert s["method"] == "s2d" and s["exits"] == [1, 2]  # exits read from config.json
        assert sum(s["exit_usage"]) > 0 and s["rounds"] >= 1
        # --time-split: prefill vs rounds from the in-loop probe (loop_costs.LoopProbe)
        split = s["time_split"]
        assert split["prefill_s"] > 0 and len(split["round_s_per_exit"]) == 2
        lo, hi = min(split["round_s_per_exit"]), max(split["round_s_per_exit"])
        # a weighted mean of the per-exit costs: between them, up to float rounding
        assert lo * (1 - 1e-9) <= split["round_s"] <= hi * (1 + 1e-9)
        assert split["rounds_s"] == pytest.approx(s["rounds"] * split["round_s"])
        assert split["prefill_fraction"] == pytest.approx(
            split["prefill_s"] / (split["prefill_s"] + split["rounds_s"]))


def _error(capsys, argv):
    return cli_error(main, capsys, argv)


def test_cli_bad_input_is_one_line_exit_2(models, capsys):
    root, _ = models
    # an explicit template: auto would note its fallback (no template) on stderr first
    base = ["--target", str(root / "target"), "--draft", str(root / "draft"),
            "--chat-template", "vicuna", "--prompt", "hi"]
    assert "threshold" in _error(capsys, base + ["--thresholds", "0.5,0.5,0.5"])
    assert "[0, 1]" in _error(capsys, base + ["--thresholds", "0.5,2"])
    assert "gamma" in _error(capsys, base + ["--gamma", "0"])
    assert "--draft-stop must lie in [0, 1]" in _error(capsys, base + ["--draft-stop", "2"])
    assert "does not fit the context" in _error(capsys, base[:-1] + ["word " * 300])
    assert "unknown target" in _error(capsys, base + ["--route", "nope"])
    assert "vocab_size" in _error(capsys, ["--target", str(root / "target"), "--draft",
                                           str(root / "bad_draft"), "--prompt", "hi"])
    assert "does not exist" in _error(capsys, base[:-2] + ["--questions", str(root / "no.jsonl")])


@pytest.mark.parametrize("method", ["sd", None])  # None: the default, auto (here s2d)
def test_a_missing_draft_fails_before_any_model_loads(models, method):
    import time
    root, _ = models
    start = time.perf_counter()
    proc = subprocess.run(
        # a target that does not exist: the draft check must come before reading it
        [sys.executable, "-m", "infer.generate", "--target", str(root / "no-such-model"),
         "--prompt", "hi"] + (["--method", method] if method else []),
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    if method:
        assert line == (f"error: method {method} needs --draft PATH (a draft model); pass "
                        f"one, or use --method ar")
    else:  # no calibration to choose with: S2D, which needs the draft
        assert line.startswith("error: --method auto decodes with s2d here") and \
            "needs --draft PATH" in line and "--method lookup or ar" in line
    assert time.perf_counter() - start < 5  # no model loaded (that takes ~20 s on SmolLM2)


@pytest.mark.slow
def test_cli_streams_single_prompt(models, capsys):
    root, target = models
    rc = main(["--target", str(root / "target"), "--method", "self", "--exit", "1",
               "--gamma", "2", "--max-new-tokens", "6", "--prompt", "Say hi."])
    assert rc == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(TOKENIZER)
    from s2d_jax.data.chat import vicuna_prompt
    ref = greedy_reference(target, tok.encode(vicuna_prompt(["Say hi."])), 6)
    eos_cut = ref.index(tok.eos_id) + 1 if tok.eos_id in ref else len(ref)
    assert printed.strip() == tok.decode(ref[:eos_cut]).strip()


@pytest.mark.slow
def test_a_calibration_slower_than_ar_is_noted(models, capsys, tmp_path):
    import shutil

    from s2d_jax.decode.serving_config import write_serving_config
    root, _ = models
    target = tmp_path / "target"
    shutil.copytree(root / "target", target)
    argv = ["--target", str(target), "--draft", str(root / "draft"), "--method", "s2d",
            "--max-new-tokens", "4", "--prompt", "Say hi."]
    for measured, noted in ((0.89, True), (1.2, False)):
        write_serving_config(str(target), {"exits": [1, 2], "thresholds": [0.3, 0.0],
                                           "gamma": 2, "measured_speedup": measured})
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert ("measured 0.89x of AR" in err and "--method ar" in err) == noted, err
