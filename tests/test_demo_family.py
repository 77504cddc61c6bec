"""The demo-family pipeline end to end in smoke mode, its prompt set, and refused overwrites."""

import hashlib
import json
import os

import jax
import numpy as np
import pytest
# the `bench` extra's torch (HF reference models); `.[test]` leaves it out: a CUDA wheel is GBs
torch = pytest.importorskip("torch")
import transformers

from examples.demo_family import pipeline as df
from examples.demo_family import questions as dq
from s2d_jax.model import transformer as model
from s2d_jax.io.checkpoint import load_model
from s2d_jax.errors import S2DError
from s2d_jax.io.tokenizer import load_tokenizer
from examples.demo_family import build as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")
CONFIGS = os.path.join(ROOT, "configs")
SMOKE = df.SmokeSettings()


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "models")
    argv = ["--out", out, "--smoke", "--corpus", CORPUS, "--configs", CONFIGS]
    cli.main(argv)
    run = os.path.join(out, "run")
    paths = df.FamilyPaths(out=out, run_dir=run, corpus=CORPUS,
                           questions=os.path.join(run, "demo_questions.jsonl"),
                           calibration=os.path.join(run, "demo_calibration.jsonl"),
                           model_configs=os.path.join(CONFIGS, "models"),
                           train_configs=os.path.join(CONFIGS, "train"))
    return paths, argv


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_split_is_first_90_percent_in_order(family):
    paths, _ = family
    paras = df.read_paragraphs(CORPUS, SMOKE.paragraphs)
    train = df.read_paragraphs(paths.train_split)
    held = df.read_paragraphs(paths.heldout_split)
    assert train + held == paras
    assert len(held) == round(0.1 * len(paras))


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_outputs_load_with_shared_tokenizer_and_exits(family):
    paths, _ = family
    fingerprints = set()
    cfgs = {}
    for name in ("target-s", "target-m", "target-l", "draft"):
        d = os.path.join(paths.out, name)
        cfg, params, extra = load_model(d)
        assert params["embed"].dtype == jax.numpy.bfloat16
        assert "lm_head" not in params and cfg.tie_word_embeddings
        with open(os.path.join(d, "config.json")) as f:
            assert json.load(f)["torch_dtype"] == "bfloat16"
        tok = load_tokenizer(d)
        assert tok.vocab_size == cfg.vocab_size == SMOKE.vocab_size
        fingerprints.add(tok.fingerprint())
        cfgs[name] = (cfg, params, extra)
    assert len(fingerprints) == 1  # draft and targets give ids the same meaning
    layers = dict(SMOKE.layers)
    for s in df.TARGETS:
        assert cfgs[f"target-{s}"][0].num_layers == layers[s]
        assert "s2d_exits" not in cfgs[f"target-{s}"][2]  # a target is not a draft
    dcfg, dparams, dextra = cfgs["draft"]
    scfg, sparams, _ = cfgs["target-s"]
    assert dextra["s2d_exits"] == [1, 2, 3] and dcfg.num_layers == 3 < scfg.num_layers
    for f in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(dcfg, f) == getattr(scfg, f)
    # Initialised from demo-s's first 3 layers and trained 3 small steps: still close to
    # them (two independent random inits would be uncorrelated).
    for key in ("wq", "w_up"):
        a = np.asarray(dparams["layers"][key], np.float32).ravel()
        b = np.asarray(sparams["layers"][key][:dcfg.num_layers], np.float32).ravel()
        assert np.corrcoef(a, b)[0, 1] > 0.9
    assert os.path.getsize(os.path.join(paths.out, "draft", "model.safetensors")) < \
        os.path.getsize(os.path.join(paths.out, "target-s", "model.safetensors"))


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_exported_draft_matches_transformers(family):
    paths, _ = family
    d = os.path.join(paths.out, "draft")
    cfg, params, _ = load_model(d, dtype="float32")
    tokens = np.array([[1, 50, 51, 52, 53, 60, 70]], np.int32)
    ours, _ = model.forward(params, cfg, tokens)
    lm = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = lm(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=2e-4)


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_questions_come_from_held_out_split(family):
    paths, _ = family
    with open(paths.questions) as f:
        qs = [json.loads(line) for line in f]
    with open(paths.heldout_split) as f:
        held = f.read()
    assert [q["question_id"] for q in qs] == list(range(1, len(qs) + 1))
    cats = [q["category"] for q in qs]
    assert sorted(set(cats)) == sorted(dq.QUESTION_CATEGORIES)
    assert all(cats.count(c) == 2 for c in dq.QUESTION_CATEGORIES)
    with open(paths.calibration) as f:
        dev = [json.loads(line) for line in f]
    assert [q["category"] for q in dev] == list(dq.QUESTION_CATEGORIES)
    # The dev prompts come from held-out speeches the benchmark's prompts do not read.
    texts = [q["turns"][0] for q in qs]
    assert not any(d["turns"][0].split("\n")[1] and d["turns"][0].split("\n")[1] in t
                   for d in dev for t in texts if d["category"] != "speaker")
    for q in qs + dev:
        (text,) = q["turns"]
        assert text in held or text.rstrip("\n") in held, q
        tag = text.split("\n")[0] if q["category"] != "dialogue" else text.rstrip("\n").split("\n")[-1]
        assert tag.endswith(":"), q


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_eval_report_written(family):
    paths, _ = family
    with open(os.path.join(paths.run_dir, "report-all.json")) as f:
        rep = json.load(f)
    ev = rep["eval"]
    assert ev["tokens"] > 0
    assert set(ev["models"]) == {"target-s", "target-m", "target-l"}
    assert set(ev["draft"]) == {"1", "2", "3"}
    for m in [*ev["models"].values(), *ev["draft"].values()]:
        assert 0 < m["nll"] < 2 * np.log(SMOKE.vocab_size)
    for e in ev["draft"].values():
        assert all(0 <= a <= 1 for a in e["agree"].values())
    assert rep["total_bytes"] > 0


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_existing_outputs_refused_and_untouched(family, capsys):
    paths, argv = family
    before = {p: _sha(os.path.join(p, "model.safetensors"))
              for p in [paths.target("s"), paths.draft]}
    q_before = _sha(paths.questions)
    for stage in ("all", "tokenizer", "targets", "draft"):
        with pytest.raises(SystemExit) as e:
            cli.main(argv + ["--stage", stage])
        assert e.value.code == 2
        assert "--overwrite" in capsys.readouterr().err
    assert {p: _sha(os.path.join(p, "model.safetensors")) for p in before} == before
    assert _sha(paths.questions) == q_before


def test_missing_earlier_stage_is_an_error(tmp_path):
    paths = df.FamilyPaths(out=str(tmp_path / "out"), run_dir=str(tmp_path / "run"),
                           corpus=CORPUS, questions=str(tmp_path / "q.jsonl"),
                           model_configs=os.path.join(CONFIGS, "models"),
                           train_configs=os.path.join(CONFIGS, "train"))
    with pytest.raises(S2DError, match="earlier stage"):
        df.build_family(paths, "draft", smoke=SMOKE, log=lambda *_: None)
    with pytest.raises(S2DError, match="earlier stage"):
        df.build_family(paths, "targets", smoke=SMOKE, log=lambda *_: None)
    assert not os.path.exists(paths.out)


def test_make_questions_categories_and_determinism():
    names = [f"SPEAKER {chr(65 + i // 26)}{chr(65 + i % 26)}" for i in range(40)]
    held = [f"{n}:\n" + "\n".join(f"line {i}.{j}" for j in range(4 + i % 3))
            for i, n in enumerate(names)]
    qs = dq.make_questions(held, seed=5, per_category=3)
    assert qs == dq.make_questions(held, seed=5, per_category=3)
    assert qs != dq.make_questions(held, seed=6, per_category=3)
    by_cat = {c: [q["turns"][0] for q in qs if q["category"] == c] for c in dq.QUESTION_CATEGORIES}
    for t in by_cat["speaker"]:
        assert t.count("\n") == 1 and t.endswith(":\n")
    for t in by_cat["line"]:
        assert t.count("\n") == 2 and ".0\n" in t
    for t in by_cat["passage"]:
        assert t.count("\n") == 4 and t.endswith(".2\n")
    for t in by_cat["dialogue"]:
        speech, nxt = t.split("\n\n")
        i = names.index(speech.split(":")[0])
        assert speech == held[i] and nxt == f"{names[i + 1]}:\n"
    with pytest.raises(S2DError, match="usable"):
        dq.make_questions(held[:3], per_category=3)  # 2 speeches have a next speech
    bench, dev = dq.make_question_sets(held, per_category=2, dev_per_category=2)
    assert bench == dq.make_questions(held, per_category=2)
    assert {q["turns"][0] for q in dev}.isdisjoint(q["turns"][0] for q in bench)
    with pytest.raises(S2DError, match="usable"):
        dq.make_question_sets(held[:12], per_category=3, dev_per_category=3)


def test_bad_stage_and_tiny_corpus(tmp_path):
    paths = df.FamilyPaths(out=str(tmp_path / "o"), run_dir=str(tmp_path / "r"))
    with pytest.raises(S2DError, match="stage"):
        df.check_outputs(paths, "everything", False)
    small = tmp_path / "small.txt"
    small.write_text("A:\nhi\n\nB:\nho\n")
    with pytest.raises(S2DError, match="paragraphs"):
        df.read_paragraphs(str(small))


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_draft_is_the_better_of_corpus_and_mixture_soft(family):
    """The draft stage trains SoFT on the corpus and on the targets' own text, measures
    greedy S2D MAT of both on held-in prompts, and exports the winner."""
    paths, _ = family
    with open(os.path.join(paths.run_dir, "report-all.json")) as f:
        report = json.load(f)
    variants = report["draft"]["variants"]
    assert set(variants) == set(df.DRAFT_VARIANTS)
    mats = {v: variants[v]["mean_accepted_tokens"] for v in variants}
    for m in mats.values():
        assert set(m) == {"target-s", "target-m", "target-l", "mean"}
        assert all(1.0 <= x <= 5.0 for x in m.values())  # gamma 4: 1 .. gamma + 1
    chosen = report["draft"]["chosen"]
    assert mats[chosen]["mean"] == max(m["mean"] for m in mats.values())
    # The exported bfloat16 draft is the chosen variant's weights.
    _, exported, _ = load_model(paths.draft)
    _, other, _ = load_model(paths.draft_f32(next(v for v in variants if v != chosen)))
    _, best, _ = load_model(paths.draft_f32(chosen))
    w = np.asarray(exported["layers"]["wq"], np.float32)
    assert np.array_equal(w, np.asarray(best["layers"]["wq"].astype(jax.numpy.bfloat16),
                                        np.float32))
    assert not np.array_equal(w, np.asarray(other["layers"]["wq"].astype(jax.numpy.bfloat16),
                                            np.float32))
    # The mixture holds every target's continuations of the held-in prompts.
    texts = df.read_paragraphs(paths.mixture)
    assert len(texts) >= 3 * 4 * 2
    heldout = open(paths.heldout_split, encoding="utf-8").read()
    prompts, mat_prompts, _ = df._held_in_prompts(paths, SMOKE)
    assert len(set(prompts + mat_prompts)) == len(prompts + mat_prompts)
    assert not any(p in heldout for p in prompts + mat_prompts)


@pytest.mark.slow  # CI time: shares the pipeline smoke run (~1.5 min under load)
def test_sizes_retrains_only_the_named_targets(family, capsys):
    """`--sizes s` rewrites target-s and leaves target-m/l alone; a bad size is refused.
    Runs last in this module: it rewrites the fixture's target-s (same seed, same data)."""
    paths, argv = family
    untouched = {s: _sha(os.path.join(paths.target(s), "model.safetensors")) for s in "ml"}
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--stage", "targets", "--sizes", "s,xl", "--overwrite"])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a named target that exists is still refused
        cli.main(argv + ["--stage", "targets", "--sizes", "s"])
    assert e.value.code == 2 and "target-s" in capsys.readouterr().err
    s_file = os.path.join(paths.target("s"), "model.safetensors")
    before = os.stat(s_file).st_mtime_ns
    cli.main(argv + ["--stage", "targets", "--sizes", "s", "--overwrite"])
    assert os.stat(s_file).st_mtime_ns != before
    assert {s: _sha(os.path.join(paths.target(s), "model.safetensors")) for s in "ml"} == untouched
    report = json.load(open(os.path.join(paths.run_dir, "report-targets.json")))
    assert "target-s" in report and "target-m" not in report
