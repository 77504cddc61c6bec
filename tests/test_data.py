"""Data pipeline: intact packing, seeded order, exact resume, disjoint hosts, bad rows."""

import dataclasses
import json
import os
import warnings

import numpy as np
import pytest

from s2d_jax.data.pipeline import DataConfig, build_examples, make_dataset, make_iterator
from s2d_jax.errors import S2DError
from s2d_jax.io.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "assets", "llama2_tokenizer")
DUMMY = os.path.join(ROOT, "data", "sharegpt_dummy_conversation.json")
AXOLOTL = os.path.join(ROOT, "data", "sharegpt_axolotl_conversation.json")
KEYS = {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32,
        "segment_ids": np.int32, "positions": np.int32}
CFG = DataConfig(paths=(DUMMY, AXOLOTL), seq_len=256, batch_size=4, seed=3)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(LLAMA)


@pytest.fixture(scope="module")
def examples(tok):
    return build_examples(CFG, tok)


def key(inputs):
    return np.asarray(inputs, np.int32).tobytes()


def take(it, n):
    return [next(it) for _ in range(n)]


def segments(batch):
    """(row, segment id, slice) of every packed example in a batch."""
    for r, seg in enumerate(batch["segment_ids"]):
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1)), "segment not contiguous"
            yield r, s, slice(idx[0], idx[-1] + 1)


def test_examples_stats(examples):
    st = examples.stats
    assert st["rows"] == 501 and st["malformed"] == 0
    assert st["examples"] + st["no_learned_tokens"] == 501
    assert st["truncated"] >= 1  # the long axolotl conversation exceeds 256 tokens
    for e in examples.examples:
        assert len(e["inputs"]) <= CFG.seq_len
        assert np.array_equal(e["inputs"][1:], e["targets"][:-1])  # shifted once
        assert e["loss_mask"].sum() > 0


@pytest.mark.parametrize("packing", [True, False])
def test_batches_keep_examples_intact(examples, packing):
    cfg = dataclasses.replace(CFG, packing=packing)
    by_inputs = {key(e["inputs"]): e for e in examples.examples}
    it = iter(make_dataset(examples, cfg, 0, 1))
    n_segments = 0
    for batch in take(it, 6):
        assert set(batch) == set(KEYS)
        for k, dtype in KEYS.items():
            assert batch[k].dtype == dtype and batch[k].shape == (4, CFG.seq_len)
        pad = batch["segment_ids"] == 0
        assert not batch["loss_mask"][pad].any() and not batch["positions"][pad].any()
        for r, s, sl in segments(batch):
            n_segments += 1
            ex = by_inputs[key(batch["inputs"][r, sl])]  # an example, whole, not cut
            assert np.array_equal(batch["targets"][r, sl], ex["targets"])
            assert np.array_equal(batch["loss_mask"][r, sl], ex["loss_mask"])
            assert np.array_equal(batch["positions"][r, sl], np.arange(sl.stop - sl.start))
        if not packing:
            assert set(np.unique(batch["segment_ids"])) <= {0, 1}
    # 24 rows: packing fits several examples per row, padding exactly one.
    assert n_segments > 40 if packing else n_segments == 24


def test_padding_one_epoch_yields_every_example_once_in_order(examples):
    cfg = dataclasses.replace(CFG, packing=False, shuffle=False, num_epochs=1, batch_size=1)
    seen = [key(b["inputs"][0, b["segment_ids"][0] > 0]) for b in make_dataset(examples, cfg, 0, 1)]
    assert seen == [key(e["inputs"]) for e in examples.examples]


def order(examples, **kw):
    cfg = dataclasses.replace(CFG, **kw)
    return [b["inputs"].copy() for b in take(iter(make_dataset(examples, cfg, 0, 1)), 3)]


def test_same_seed_same_order_other_seed_other_order(examples):
    a, b, c = order(examples, seed=1), order(examples, seed=1), order(examples, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    unshuffled = order(examples, shuffle=False)
    first = examples.examples[0]["inputs"]
    assert np.array_equal(unshuffled[0][0, :len(first)], first)


@pytest.mark.parametrize("packing", [True, False])
def test_restored_state_continues_exactly(examples, packing):
    cfg = dataclasses.replace(CFG, packing=packing)
    run = iter(make_dataset(examples, cfg, 0, 1))
    take(run, 13)  # the 6 batches after this cross a flush of grain's 64 packing bins
    state = json.loads(json.dumps(run.get_state()))  # what a checkpoint stores
    reference = take(run, 6)
    resumed = iter(make_dataset(examples, cfg, 0, 1))
    resumed.set_state(state)
    for want, got in zip(reference, take(resumed, 6)):
        for k in KEYS:
            assert np.array_equal(want[k], got[k])


def test_iterator_wrapper_state_and_epoch_count(tok):
    cfg = DataConfig(paths=(AXOLOTL,), seq_len=64, batch_size=2, num_epochs=2, packing=False)
    it = make_iterator(cfg, tok, process_index=0, process_count=1)
    assert it.num_batches == 2 * 1 // 2  # one example (truncated), two epochs, batch 2
    start = json.loads(json.dumps(it.get_state()))
    first = next(it)
    it.set_state(start)
    assert np.array_equal(next(it)["inputs"], first["inputs"])


def test_two_processes_get_disjoint_data(examples):
    cfg = dataclasses.replace(CFG, num_epochs=1)
    seen = []
    for p in (0, 1):
        keys = set()
        for batch in make_dataset(examples, cfg, p, 2):
            assert batch["inputs"].shape == (2, CFG.seq_len)  # per-host batch = 4 // 2
            keys |= {key(batch["inputs"][r, sl]) for r, _, sl in segments(batch)}
        seen.append(keys)
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert seen[0] | seen[1] <= {key(e["inputs"]) for e in examples.examples}
    with pytest.raises(S2DError, match="not divisible"):
        make_dataset(examples, dataclasses.replace(CFG, batch_size=3), 0, 2)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def good(i):
    return {"id": f"ok{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]}


def test_malformed_rows_counted_and_warned_once(tmp_path, tok):
    rows = [good(0), {"id": "bad_role", "conversations": [{"from": "human", "value": "q"},
                                                         {"from": "robot", "value": "a"}]},
            good(1), {"id": "bad_empty", "conversations": []},
            {"id": "bad_order", "conversations": [{"from": "human", "value": "q"},
                                                  {"from": "human", "value": "q"},
                                                  {"from": "gpt", "value": "a"}]},
            {"id": "bad_nokey"}, good(2),
            {"id": "too_long", "conversations": [{"from": "human", "value": "word " * 200},
                                                 {"from": "gpt", "value": "a"}]}]
    cfg = DataConfig(paths=(write_jsonl(tmp_path / "mixed.jsonl", rows),), seq_len=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = build_examples(cfg, tok)
    msgs = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(msgs) == 1
    assert "skipped 5 of 8 rows: 4 malformed" in msgs[0] and "1 with no assistant" in msgs[0]
    assert all(
        i in msgs[0] for i in ("bad_role", "bad_empty", "bad_order", "bad_nokey"))
    assert (ex.stats["rows"], ex.stats["malformed"], ex.stats["examples"]) == (8, 4, 3)
    assert ex.stats["truncated"] == ex.stats["no_learned_tokens"] == 1
    # Learned tokens are exactly "answer i" plus its </s> (no prompt token leaks in).
    for i, e in enumerate(ex.examples):
        learned = e["targets"][e["loss_mask"] > 0]
        assert learned[-1] == tok.eos_id and tok.decode(learned) == f"answer {i}"


def test_unusable_or_missing_inputs_raise(tmp_path, tok):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "gpt", "value": "a"}]}])
    with pytest.raises(S2DError, match="no usable training examples"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_examples(DataConfig(paths=(bad,)), tok)
    with pytest.raises(S2DError, match="nope.json"):
        build_examples(DataConfig(paths=(str(tmp_path / "nope.json"),)), tok)
    broken = tmp_path / "broken.json"
    broken.write_text('{"conversations": [')
    with pytest.raises(S2DError, match="broken.json"):
        build_examples(DataConfig(paths=(str(broken),)), tok)
    broken_lines = tmp_path / "broken.jsonl"
    broken_lines.write_text('{"conversations": []}\n{oops\n')
    with pytest.raises(S2DError, match="broken.jsonl"):
        build_examples(DataConfig(paths=(str(broken_lines),)), tok)
    with pytest.raises(S2DError, match="data.format"):
        DataConfig(format="csv")
    with pytest.raises(S2DError, match="paths is empty"):
        build_examples(DataConfig(), tok)


def test_parquet_and_single_object_json(tmp_path, tok):
    import datasets
    pq = str(tmp_path / "rows.parquet")
    datasets.Dataset.from_list([good(i) for i in range(3)]).to_parquet(pq)
    ex = build_examples(DataConfig(paths=(pq, AXOLOTL), seq_len=4096), tok)
    assert (ex.stats["rows"], ex.stats["examples"], ex.stats["truncated"]) == (4, 4, 0)
    assert ex.examples[3]["loss_mask"].sum() > 1000  # axolotl: six long replies learned


def test_text_corpus_learns_every_token(tmp_path, tok):
    docs = ["First story.\nIt has two lines.", "Second  story, spaced.", "x " * 100]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs[:2]) + "\n<|endoftext|>\n" + docs[2])
    ex = build_examples(DataConfig(paths=(str(path),), seq_len=64), tok)
    assert ex.stats["rows"] == 3
    for e, doc in zip(ex.examples[:2], docs[:2]):
        full = np.concatenate([e["inputs"], e["targets"][-1:]])
        assert full.tolist() == tok.encode(doc) + [tok.eos_id]
        assert e["loss_mask"].all()
    # The long document is cut into windows that overlap by one token: no transition lost.
    windows = ex.examples[2:]
    assert len(windows) > 1 and all(len(w["inputs"]) <= 64 for w in windows)
    joined = np.concatenate([w["inputs"] for w in windows] + [windows[-1]["targets"][-1:]])
    assert joined.tolist() == tok.encode(docs[2].strip("\n")) + [tok.eos_id]


@pytest.mark.slow
def test_worker_processes_resume_exactly(examples):
    cfg = dataclasses.replace(CFG, worker_count=2)
    run = iter(make_dataset(examples, cfg, 0, 1))
    reference = [b["inputs"].copy() for b in take(run, 10)]
    first = iter(make_dataset(examples, cfg, 0, 1))
    take(first, 4)
    state = json.loads(json.dumps(first.get_state()))
    resumed = iter(make_dataset(examples, cfg, 0, 1))
    resumed.set_state(state)
    got = [b["inputs"] for b in take(resumed, 6)]
    for it in (run, first, resumed):
        it.close()
    assert all(np.array_equal(a, b) for a, b in zip(reference[4:], got))
