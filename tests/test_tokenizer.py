"""Tokenizer: Llama ids equal sentencepiece's; plain tokenizer.json loads; bad dirs -> S2DError."""

import json
import os
import shutil

import pytest
import sentencepiece as spm

from s2d_jax.errors import S2DError
from s2d_jax.io.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "assets", "llama2_tokenizer")
SHAREGPT = [os.path.join(ROOT, "data", f) for f in
            ("sharegpt_dummy_conversation.json", "sharegpt_axolotl_conversation.json")]

TRICKY = [
    "a  b", " x", "hello\n\nworld", "  leading", "trailing  ", " ", "   ", "",
    "def f(x):\n    if x:\n        return 1\n\treturn 2\n",
    "h\u00e9llo \u4e16\u754c \U0001F916 na\u00efve caf\u00e9 \u00a0nbsp \u200bzw",
    "x" + " " * 19 + "y" + " " * 40,  # whitespace runs longer than the longest "▁" piece
    "ASSISTANT: hi", "a ASSISTANT: b", "12  345 3.14159",
    "literal </s> and <s> and <unk> stay text",
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions. USER: Hi there  "
    "ASSISTANT: Hello!</s>USER:   spaced\n\nout ASSISTANT:",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(LLAMA)


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=os.path.join(LLAMA, "tokenizer.model"))


@pytest.mark.parametrize("text", TRICKY)
def test_ids_equal_sentencepiece_on_tricky_strings(tok, sp, text):
    assert tok.encode(text, bos=False) == sp.encode(text)
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


def test_ids_equal_sentencepiece_on_shipped_sharegpt(tok, sp):
    texts = []
    for path in SHAREGPT:
        with open(path) as f:
            rows = json.load(f)
        for row in rows if isinstance(rows, list) else [rows]:
            texts += [t["value"] for t in row["conversations"]]
    assert len(texts) == 2012
    got = tok.encode_batch(texts, bos=False)
    want = sp.encode(texts)
    mismatched = [t[:60] for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatched
    assert all(tok.decode(w) == sp.decode(w) for w in want)


def test_llama_special_ids_and_sizes(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    assert tok.pad_id == tok.eos_id  # Llama-2 has no pad token
    assert tok.path == LLAMA
    assert tok.decode([1, 15043, 2]) == "Hello"  # special tokens skipped


def test_offsets_cover_the_text(tok):
    text = "ASSISTANT:  two spaces\nand a line"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text, bos=False)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))  # contiguous, no gaps


def _save_bpe(path, corpus, vocab_size=300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    return bpe


def test_plain_tokenizer_json_loads(tmp_path):
    corpus = ["the cat sat on the mat", "a dog and a cat", "def f():\n    return 1"] * 20
    bpe = _save_bpe(str(tmp_path / "bpe"), corpus)
    tok = load_tokenizer(str(tmp_path / "bpe"))
    text = "the  cat\n  sat </s>"
    bpe.encode_special_tokens = True  # encode() never parses special-token text
    assert tok.encode(text) == [tok.bos_id] + bpe.encode(text, add_special_tokens=False).ids
    assert tok.eos_id not in tok.encode(text)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    assert tok.vocab_size == bpe.get_vocab_size()
    assert tok.decode(tok.encode(text)) == text  # byte-level BPE is lossless


def test_fingerprint_stable_and_distinguishing(tmp_path, tok):
    corpus = ["one two three four five six"] * 10
    _save_bpe(str(tmp_path / "a"), corpus)
    _save_bpe(str(tmp_path / "b"), corpus)
    _save_bpe(str(tmp_path / "c"), ["completely different words here"] * 10, vocab_size=280)
    a, b, c = (load_tokenizer(str(tmp_path / n)) for n in "abc")
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != c.fingerprint()
    assert tok.fingerprint() == load_tokenizer(LLAMA).fingerprint()
    assert tok.fingerprint() not in (a.fingerprint(), c.fingerprint())


def test_bad_tokenizer_dirs_raise(tmp_path):
    with pytest.raises(S2DError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(S2DError, match="neither tokenizer.model nor tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(S2DError, match="cannot load the tokenizer"):
        load_tokenizer(str(tmp_path / "broken"))
    bad_sp = tmp_path / "bad_sp"
    shutil.copytree(LLAMA, bad_sp)
    (bad_sp / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(S2DError):
        load_tokenizer(str(bad_sp))


def test_a_plain_tokenizer_json_loads_without_autotokenizer_as_autotokenizer_would():
    # io/tokenizer.py loads a TokenizersBackend dir without AutoTokenizer (its import costs
    # ~2.5 s of a warm start) or transformers (~1 s): it must be the tokenizer AutoTokenizer builds
    from transformers import AutoTokenizer

    from s2d_jax.io.tokenizer import _plain_fast, load_tokenizer
    d = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "models", "demo", "draft")
    assert _plain_fast(d)
    ours = load_tokenizer(d).hf
    auto = AutoTokenizer.from_pretrained(d, local_files_only=True, use_fast=True)
    assert type(ours).__name__ == "_LightFast"  # tokenizers alone (test_tokenizer_light.py)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "chat_template", "all_special_ids"):
        assert getattr(ours, attr) == getattr(auto, attr), attr
