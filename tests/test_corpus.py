"""The committed corpus (s2d_jax/data/corpus.py): shards round-trip, a changed byte or
totals are one clear error, a run's plan is kept; training reads a corpus (data.format=
corpus) and records the slice it read; a run whose checkpoint dir is gone starts from the
committed draft weights and says what is lost."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from s2d_jax.data import corpus
from s2d_jax.env import smollm2_dir
from s2d_jax.errors import S2DError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "models", "demo", "target-s")
DEMO_DRAFT = os.path.join(ROOT, "models", "demo", "draft")
TARGET = {"name": "tiny", "fingerprint": "f" * 64, "vocab_size": 2048}


def rows_of(seed: int, n: int = 6) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, answer = int(rng.integers(3, 20)), int(rng.integers(5, 60))
        out.append({"input_ids": rng.integers(0, 2048, prompt + answer).tolist(),
                    "learn_from": prompt, "temperature": float(i % 2), "prompt_index": i // 2})
    return out


def make_corpus(path, shards: int = 3) -> list[list[dict]]:
    manifest = corpus.start_run(str(path), TARGET, "r0", {"seed": 0}, ["a", "b", "c"])
    written = [rows_of(k) for k in range(shards)]
    for k, rows in enumerate(written):
        corpus.add_shard(str(path), manifest, "r0", k, rows)
    return written


def test_round_trip_totals_and_same_bytes(tmp_path):
    written = make_corpus(tmp_path / "c")
    rows, records = corpus.read_rows(str(tmp_path / "c"))
    assert [(r["input_ids"], r["learn_from"], r["temperature"], r["prompt"]) for r in rows] \
        == [(r["input_ids"], r["learn_from"], r["temperature"], r["prompt_index"])
            for shard in written for r in shard]
    m = corpus.verify(str(tmp_path / "c"))
    flat = [r for s in written for r in s]
    assert m["totals"] == {
        "shards": 3, "rows": len(flat),
        "prompt_tokens": sum(r["learn_from"] for r in flat),
        "answer_tokens": sum(len(r["input_ids"]) - r["learn_from"] for r in flat),
        "bytes": sum(os.path.getsize(tmp_path / "c" / s["file"]) for s in m["shards"])}
    assert corpus.read_prompts(str(tmp_path / "c"), "r0") == ["a", "b", "c"]
    # the same rows make the same bytes (fixed zip timestamps), so a rerun changes nothing
    make_corpus(tmp_path / "d")
    for rec in records:
        assert (tmp_path / "c" / rec["file"]).read_bytes() == \
            (tmp_path / "d" / rec["file"]).read_bytes()
    # a slice is a prefix
    assert corpus.read_rows(str(tmp_path / "c"), 1)[0] == rows[:len(written[0])]
    with np.load(tmp_path / "c" / records[0]["file"]) as z:  # plain numpy reads a shard
        assert z["ids"].dtype == np.uint16


def test_changed_byte_missing_file_and_totals_are_clear_errors(tmp_path):
    make_corpus(tmp_path / "c")
    shard = tmp_path / "c" / corpus.shard_file("r0", 1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(S2DError, match=r"r0-00001.npz does not match its sha256.*git checkout"):
        corpus.read_rows(str(tmp_path / "c"))
    with pytest.raises(S2DError, match="does not match its sha256"):
        corpus.verify(str(tmp_path / "c"))
    # the first shard alone is still readable: a slice verifies only what it reads
    assert len(corpus.read_rows(str(tmp_path / "c"), 1)[0]) == 6
    shard.unlink()
    with pytest.raises(S2DError, match="r0-00001.npz is missing"):
        corpus.verify(str(tmp_path / "c"))
    make_corpus(tmp_path / "e")
    path = tmp_path / "e" / corpus.MANIFEST
    m = json.loads(path.read_text())
    m["totals"]["answer_tokens"] += 1
    path.write_text(json.dumps(m))
    with pytest.raises(S2DError, match="totals disagree"):
        corpus.verify(str(tmp_path / "e"))
    del m["shards"][0]["sha256"]
    path.write_text(json.dumps(m))
    with pytest.raises(S2DError, match=r"manifest.json: shards\[0\].sha256 is missing"):
        corpus.read_rows(str(tmp_path / "e"))
    with pytest.raises(S2DError, match="not a corpus"):
        corpus.verify(str(tmp_path / "nothing"))
    with pytest.raises(S2DError, match="has 3 shards, 4 asked"):
        corpus.read_rows(str(tmp_path / "c"), 4)


def test_a_run_keeps_its_plan_and_target(tmp_path):
    make_corpus(tmp_path / "c")
    corpus.start_run(str(tmp_path / "c"), TARGET, "r0", {"seed": 0}, ["a", "b", "c"])
    with pytest.raises(S2DError, match="run r0 .* another seed"):
        corpus.start_run(str(tmp_path / "c"), TARGET, "r0", {"seed": 1}, ["a", "b", "c"])
    with pytest.raises(S2DError, match="another prompts"):
        corpus.start_run(str(tmp_path / "c"), TARGET, "r0", {"seed": 0}, ["a", "b"])
    with pytest.raises(S2DError, match="target differs"):
        corpus.start_run(str(tmp_path / "c"), {**TARGET, "fingerprint": "0" * 64}, "r1",
                         {"seed": 0}, ["a"])
    with pytest.raises(S2DError, match="outside the vocabulary"):
        corpus.shard_bytes([{"input_ids": [2048], "learn_from": 0, "temperature": 0.0,
                             "prompt_index": 0}], 2048)


def train_config(tmp_path, corpus_dir, ckpt, **extra):
    from s2d_jax.train.config import load_train_config
    over = [f"model.path={DEMO_TARGET}", f"data.tokenizer={DEMO_TARGET}",
            f"data.paths=[{corpus_dir}]", "data.format=corpus", "data.seq_len=32",
            "data.batch_size=2", "optimizer.total_steps=2", "optimizer.warmup_steps=0",
            "optimizer.lr=1e-12",  # a step moves nothing measurable: params stay checkable
            "log_every=1", f"checkpoint.dir={ckpt}", f"export_dir={tmp_path / 'hf'}",
            "export_overwrite=true", *[f"{k}={v}" for k, v in extra.items()]]
    return load_train_config(os.path.join(ROOT, "configs", "train", "demo_draft.yaml"), over)


def test_the_pipeline_reads_a_corpus_slice_and_the_plan_records_it(tmp_path):
    from types import SimpleNamespace

    from s2d_jax.data.pipeline import DataConfig, make_iterator
    from s2d_jax.train.checkpoint import run_plan
    tok = SimpleNamespace(vocab_size=2048)  # token rows need only the vocabulary's size
    make_corpus(tmp_path / "c")
    cfg = DataConfig(paths=(str(tmp_path / "c"),), format="corpus", corpus_shards=2,
                     seq_len=32, batch_size=2, tokenizer=DEMO_TARGET)
    it = make_iterator(cfg, tok, 0, 1)
    batch = next(it)
    assert batch["inputs"].shape == (2, 32) and batch["loss_mask"].sum() > 0
    (slice_,) = it.stats["data_slice"]
    assert [s["file"] for s in slice_["shards"]] == ["r0-00000.npz", "r0-00001.npz"]
    assert slice_["rows"] == it.stats["rows"] == 12
    tc = train_config(tmp_path, tmp_path / "c", tmp_path / "ckpt")
    plan = run_plan(tc, it.stats["data_slice"])
    assert plan["data_slice"][0]["shards"] == 2 and len(plan["data_slice"][0][
        "shards_sha256"]) == 64
    # a vocabulary other than the corpus's is refused
    other = corpus.read_manifest(str(tmp_path / "c"))
    other["target"]["vocab_size"] = 49152
    corpus.write_manifest(str(tmp_path / "c"), other)
    with pytest.raises(S2DError, match="49152-token vocabulary, the tokenizer has 2048"):
        make_iterator(cfg, tok, 0, 1)


def test_warm_start_takes_the_committed_layers_and_says_what_is_lost():
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.train.warm_start import warm_start
    _, committed, _ = load_model(DEMO_DRAFT, dtype="float32")
    cfg, target, _ = load_model(DEMO_TARGET, dtype="float32")  # deeper than the draft
    said = []
    got = warm_start(target, cfg, DEMO_DRAFT, log=said.append)
    n = committed["layers"]["wq"].shape[0]
    assert n < cfg.num_layers
    np.testing.assert_array_equal(got["layers"]["wq"][:n], committed["layers"]["wq"])
    np.testing.assert_array_equal(got["layers"]["wq"][n:], target["layers"]["wq"][n:])
    np.testing.assert_array_equal(got["final_norm"], committed["final_norm"])
    assert not np.allclose(committed["layers"]["wq"], target["layers"]["wq"][:n])
    assert f"layers 1-{n} and the final norm from the committed draft" in said[0]
    assert f"layers {n + 1}-{cfg.num_layers} from the target" in said[0]
    assert "lost: the optimizer moments" in said[0]


def test_identity_deeper_layers_start_the_new_exit_at_the_committed_deepest():
    """init_deeper="identity": the added layers' residual outputs are zero, so the draft's
    deepest exit predicts exactly what the committed draft's deepest exit does; the
    target's own added layers change it."""
    import jax.numpy as jnp

    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.model.sorted_draft import multi_exit_logits
    from s2d_jax.train.warm_start import warm_start
    _, committed, _ = load_model(DEMO_DRAFT, dtype="float32")
    cfg, target, _ = load_model(DEMO_TARGET, dtype="float32")
    n = committed["layers"]["wq"].shape[0]
    said = []
    got = warm_start(target, cfg, DEMO_DRAFT, log=said.append, deeper="identity")
    for name in ("wo", "w_down"):
        assert float(jnp.abs(got["layers"][name][n:]).max()) == 0.0
    np.testing.assert_array_equal(got["layers"]["wq"][n:], target["layers"]["wq"][n:])
    assert "with wo and w_down zeroed (each the identity)" in said[0]
    toks = jnp.asarray([[1, 5, 9, 14, 3, 7]])
    shallow, deep = multi_exit_logits(got, cfg, (n, cfg.num_layers), toks)
    np.testing.assert_allclose(deep, shallow, rtol=1e-5, atol=1e-5)
    plain = warm_start(target, cfg, DEMO_DRAFT, log=said.append)
    _, deep_target = multi_exit_logits(plain, cfg, (n, cfg.num_layers), toks)
    assert float(jnp.abs(deep_target - shallow).max()) > 1e-2


def test_a_bad_init_deeper_is_refused(tmp_path):
    from s2d_jax.train.config import load_train_config
    with pytest.raises(S2DError, match="model.init_deeper='copy' is not one of target, identity"):
        load_train_config(None, [f"model.path={DEMO_TARGET}", "model.init_deeper=copy"])


@pytest.mark.slow  # two short SoFT runs (~70 s on the loaded 2-core CPU)
def test_training_reads_the_corpus_records_its_slice_and_warm_starts(tmp_path, capsys):
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.train.loop import RECIPE, train
    make_corpus(tmp_path / "c")
    ckpt = tmp_path / "ckpt"
    out = train(train_config(tmp_path, tmp_path / "c", ckpt, **{"data.corpus_shards": 2}),
                progress=False, devices=jax.devices()[:1])
    assert len(out["history"]) == 2 and np.isfinite(out["history"][-1]["loss"])
    plan = json.loads((ckpt / "run_plan.json").read_text())
    (slice_,) = plan["data_slice"]
    assert slice_["shards"] == 2 and slice_["rows"] == 12
    recipe = json.loads((tmp_path / "hf" / RECIPE).read_text())
    assert [s["file"] for s in recipe["data_slice"][0]["shards"]] == ["r0-00000.npz",
                                                                     "r0-00001.npz"]
    assert recipe["start"].startswith("initialised from") and recipe["steps"] == 2
    # the machine is lost: no checkpoint dir; the run starts from the committed draft
    shutil.rmtree(ckpt)
    capsys.readouterr()
    tc = train_config(tmp_path, tmp_path / "c", ckpt, **{"model.init_from": DEMO_DRAFT})
    out = train(tc, progress=False, devices=jax.devices()[:1])
    said = capsys.readouterr().out
    assert "[warm start] no checkpoint to resume: layers 1-3" in said
    assert "lost: the optimizer moments" in said
    _, committed, _ = load_model(DEMO_DRAFT, dtype="float32")
    _, target, _ = load_model(DEMO_TARGET, num_layers=3, dtype="float32")
    got = np.asarray(out["state"].params["layers"]["wq"])
    # two steps at lr 1e-12 move nothing measurable: the params are the committed draft's
    np.testing.assert_allclose(got, np.asarray(committed["layers"]["wq"]), atol=1e-6)
    assert not np.allclose(got, np.asarray(target["layers"]["wq"]), atol=1e-3)
    assert "warm start from" in json.loads((tmp_path / "hf" / RECIPE).read_text())["start"]
    # a grown corpus is other data: the checkpoint's run refuses it
    m = corpus.read_manifest(str(tmp_path / "c"))
    corpus.add_shard(str(tmp_path / "c"), m, "r0", 3, rows_of(3))
    with pytest.raises(S2DError, match="data_slice"):
        train(tc, progress=False, devices=jax.devices()[:1])


def test_warm_start_refuses_another_shape():
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.train.warm_start import warm_start
    cfg, target, _ = load_model(DEMO_TARGET, dtype="float32")
    with pytest.raises(S2DError, match="model.init_from .* another shape .*vocab_size 49152"):
        warm_start(target, cfg, os.path.join(ROOT, "models", "smollm2-draft"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target (demo tokenizer) and five prompts."""
    from tiny_models import tiny_target
    d = tmp_path_factory.mktemp("gen")
    tiny_target(str(d / "target"))
    qs = ["Name a prime number.", "Write a haiku about snow.", "What is two plus two?",
          "Tell me about rivers.", "Count to three."]
    (d / "prompts.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in qs))
    return d


def git(cwd, *argv):
    import subprocess
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow  # ~2 min on the loaded 2-core CPU (generation and training compile)
def test_generation_commits_whole_shards_and_a_clone_trains_from_them(tiny, tmp_path):
    from train import corpus_generate
    from s2d_jax.train.loop import train
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.name", "t")
    git(repo, "config", "user.email", "t@t")
    argv = ["--target", str(tiny / "target"), "--name", "tiny", "--corpus",
            str(repo / "data" / "c"), "--work", str(tmp_path / "work"), "--run", "r0",
            "--prompts", str(tiny / "prompts.jsonl"), "--batch-size", "2",
            "--max-new-tokens", "5", "--heldout",
            os.path.join(ROOT, "data", "demo_calibration.jsonl"), "--commit"]
    corpus_generate.main(argv + ["--max-shards", "2", "--slots", "0"])  # batched, then slots
    log = git(repo, "log", "--format=%s").splitlines()
    assert len(log) == 3 and log[-1].startswith("corpus: run r0 planned (5 prompts)")
    assert all(line.startswith("corpus: shard r0-0000") for line in log[:2])
    assert not git(repo, "status", "--porcelain")  # every written file is committed
    m = corpus.verify(str(repo / "data" / "c"))
    assert m["totals"]["shards"] == 2 and m["totals"]["rows"] == 8  # 2 prompts x 2 temps
    # the run resumes from the repository alone: its last shard, nothing rewritten
    shutil.rmtree(tmp_path / "work")
    corpus_generate.main(argv)
    assert len(git(repo, "log", "--format=%s").splitlines()) == 4
    m = corpus.verify(str(repo / "data" / "c"))
    assert [s["rows"] for s in m["shards"]] == [4, 4, 2]
    assert [s["engine"].split(",")[0] for s in m["shards"]] == \
        ["batched Decoder", "batched Decoder", "slot engine"]
    # a fresh clone verifies the checksums and trains without generating
    git(tmp_path, "clone", "-q", str(repo), "clone")
    clone = tmp_path / "clone" / "data" / "c"
    assert corpus.verify(str(clone))["totals"] == m["totals"]
    tc = train_config(tmp_path, clone, tmp_path / "ckpt",
                      **{"model.path": str(tiny / "target"),
                         "data.tokenizer": str(tiny / "target")})
    out = train(tc, progress=False, devices=jax.devices()[:1])
    assert len(out["history"]) == 2 and np.isfinite(out["history"][-1]["loss"])


def test_generation_refuses_bad_input(tmp_path, capsys):
    from tiny_models import cli_error
    from train import corpus_generate
    (tmp_path / "target").mkdir()  # the flags are checked before the target is read
    base = ["--target", str(tmp_path / "target"), "--work", str(tmp_path / "w")]
    assert "--batch-size must be >= 1" in cli_error(corpus_generate.main, capsys, base + [
        "--corpus", str(tmp_path / "c"), "--batch-size", "0"])
    assert "not a git repository" in cli_error(corpus_generate.main, capsys, base + [
        "--corpus", str(tmp_path / "c"), "--commit"])


def test_a_new_run_leaves_out_the_prompts_of_earlier_runs(tiny, tmp_path, capsys):
    """A second run over the same files would answer every prompt again (greedy: the same
    rows): it is refused with the fix; with one new prompt it plans that one alone and
    records how many it left out."""
    from tiny_models import cli_error
    from train import corpus_generate
    c = tmp_path / "c"
    argv = ["--target", str(tiny / "target"), "--name", "tiny", "--corpus", str(c),
            "--batch-size", "2", "--max-new-tokens", "3", "--slots", "0", "--max-shards", "1",
            "--heldout", os.path.join(ROOT, "data", "demo_calibration.jsonl")]
    corpus_generate.main(argv + ["--work", str(tmp_path / "w0"), "--run", "r0",
                                 "--prompts", str(tiny / "prompts.jsonl")])
    again = argv + ["--work", str(tmp_path / "w1"), "--run", "r1",
                    "--prompts", str(tiny / "prompts.jsonl")]
    assert "every prompt of run r1 is in an earlier run" in cli_error(
        corpus_generate.main, capsys, again)
    assert set(corpus.read_manifest(str(c))["runs"]) == {"r0"}  # nothing planned
    more = tmp_path / "more.jsonl"
    more.write_text((tiny / "prompts.jsonl").read_text()
                    + json.dumps({"question": "Name a river."}) + "\n")
    corpus_generate.main(argv + ["--work", str(tmp_path / "w2"), "--run", "r1",
                                 "--prompts", str(more)])
    assert corpus.read_prompts(str(c), "r1") == ["Name a river."]
    pool = corpus.read_manifest(str(c))["runs"]["r1"]["prompt_source"]["pool"]
    assert pool["in_earlier_runs"] == 5 and pool["kept"] == 6


def test_a_run_of_another_target_is_refused_before_its_prompt_stages_run(tiny, tmp_path,
                                                                           capsys):
    """The corpus's target is compared once the target is read, before a new run's Magpie
    and prompt stages write into --work (issue 68)."""
    from test_cli_fuzz import snapshot
    from tiny_models import cli_error
    from train import corpus_generate
    make_corpus(tmp_path / "c")  # TARGET: another fingerprint than the tiny target's
    before = snapshot(tmp_path)
    err = cli_error(corpus_generate.main, capsys, [
        "--target", str(tiny / "target"), "--name", "tiny", "--corpus", str(tmp_path / "c"),
        "--work", str(tmp_path / "w"), "--run", "r1", "--prompts",
        str(tiny / "prompts.jsonl"), "--heldout",
        os.path.join(ROOT, "data", "demo_calibration.jsonl")])
    assert "this run's target differs; use another corpus folder" in err
    assert snapshot(tmp_path) == before  # no --work, no prompts, nothing planned


SMOLLM2 = smollm2_dir()
COMMITTED = os.path.join("data", "smollm2_corpus")


@pytest.mark.slow  # a shallow clone of the repository and two SoFT steps of SmolLM2
@pytest.mark.skipif(not os.path.isdir(SMOLLM2), reason="needs python -m infer.fetch_smollm2")
def test_a_fresh_clone_verifies_the_committed_corpus_and_trains_from_it(tmp_path):
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import train
    branch = git(ROOT, "rev-parse", "--abbrev-ref", "HEAD").strip()
    git(tmp_path, "clone", "-q", "--depth", "1", "--branch", branch, f"file://{ROOT}", "clone")
    clone = tmp_path / "clone" / COMMITTED
    m = corpus.verify(str(clone))  # every committed file against its sha256
    assert m["totals"]["answer_tokens"] > 0 and m["target"]["vocab_size"] == 49152
    tc = load_train_config(os.path.join(ROOT, "configs", "train", "smollm2_draft.yaml"), [
        f"model.path={SMOLLM2}", f"data.tokenizer={SMOLLM2}", f"data.paths=[{clone}]",
        "data.format=corpus", "data.corpus_shards=1", "draft.exits=[1,2]", "data.seq_len=256",
        "data.batch_size=2", "optimizer.total_steps=2", "log_every=1"])
    out = train(tc, progress=False, devices=jax.devices()[:1])
    assert len(out["history"]) == 2 and np.isfinite(out["history"][-1]["loss"])


def test_prompts_with_line_separators_round_trip(tmp_path):
    # real Magpie turns hold U+2028, form feeds and the like: a prompt is one JSON line
    prompts = ["a\u2028b", "c\x0cd\x1ce", "f\u0085g\nh", "\r\n"]
    corpus.start_run(str(tmp_path / "c"), TARGET, "r0", {"seed": 0}, prompts)
    assert corpus.read_prompts(str(tmp_path / "c"), "r0") == prompts


@pytest.mark.slow
def test_shards_streamed_on_slots_are_the_batched_shards_greedy(tiny):
    """The slot engine's shards hold the batched decoder's greedy rows, row for row, a
    prompt too long for the slots is answered by the batched decoder, and the shards of a
    stream complete whole."""
    from s2d_jax.data.distill import prompts_from_file
    from s2d_jax.data.engine import answer_shard
    from s2d_jax.data.prompts import end_of_turn_id, prompt_ids, resolve_template
    from s2d_jax.server.corpus_answers import stream_shards
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    from s2d_jax.server.slots import SlotEngine

    cfg, params, _ = load_model(str(tiny / "target"))
    tok = load_tokenizer(str(tiny / "target"))
    decoder = Decoder(cfg, params, method="ar")
    prompts = prompts_from_file(str(tiny / "prompts.jsonl"))
    template, _ = resolve_template(tok, "auto")
    lengths = sorted(len(prompt_ids(tok, template, [p])) for p in prompts)
    new = 6
    assert lengths[-1] > lengths[-2]  # so the longest prompt takes the batched path
    # slots that hold all but the longest prompt with its answer
    engine = SlotEngine(decoder, tok, slots=3, max_len=lengths[-2] + new,
                        eos_id=end_of_turn_id(tok, template))
    shards = [(0, prompts[:2]), (1, prompts[2:])]
    got = {}
    stream_shards(engine, decoder, tok, shards, seed=0, max_new_tokens=new,
                  on_shard=lambda k, rows: got.setdefault(k, rows))
    assert sorted(got) == [0, 1]
    for k, batch in shards:
        want = answer_shard(decoder, tok, batch, k, 0, new)
        assert [(r["prompt"], r["temperature"]) for r in got[k]] == \
            [(r["prompt"], r["temperature"]) for r in want]
        greedy = [(a["input_ids"], b["input_ids"]) for a, b in zip(got[k], want)
                  if a["temperature"] == 0.0]
        assert len(greedy) == len(batch) and all(a == b for a, b in greedy)
        assert all(len(r["input_ids"]) > r["learn_from"] for r in got[k])
