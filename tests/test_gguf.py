"""GGUF import: dequantization against the gguf package, tiny llama GGUF files written with
gguf.GGUFWriter loaded against their float weights and against transformers' own GGUF
loader, the llama.cpp Q/K row permutation, config fields, the tokenizer, the CLI, bad input,
and (slow, needs `python -m infer.fetch_smollm2`) SmolLM2-135M-Instruct parity."""

import contextlib
import io
import json
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
# the `bench` extra's torch (HF reference models); `.[test]` leaves it out: a CUDA wheel is GBs
torch = pytest.importorskip("torch")
from gguf import GGMLQuantizationType as Q

from s2d_jax.errors import S2DError
from s2d_jax.io import gguf as ggufio
from s2d_jax.io.checkpoint import load_model, stored_model_config
from s2d_jax.io.gguf_quants import dequantize
from s2d_jax.io.orbax_params import restore_params
from s2d_jax.model.params import PARAMS, to_ours
from s2d_jax.model.transformer import forward
from tiny_gguf import (CHATML, D, F, HD, K, L, N, TOKENS, gguf_name, hf_weights,
                       llama_cpp_permute, write_gguf)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
jit_forward = jax.jit(forward, static_argnums=1)

# Largest |error| of one element after quantizing, for a tensor whose values are x.
ERROR_BOUND = {Q.F32: lambda x: 0.0, Q.F16: lambda x: np.abs(x).max() * 2.0 ** -11,
               Q.BF16: lambda x: np.abs(x).max() * 2.0 ** -8,
               Q.Q8_0: lambda x: np.abs(x).max() / 127, Q.Q4_0: lambda x: np.abs(x).max() / 8,
               Q.Q4_1: lambda x: (x.max() - x.min()) / 15}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = hf_weights()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights), weights


def test_dequantize_is_bit_exact_with_the_gguf_package(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    types = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for t in types:
        if t in ERROR_BOUND:
            data = gguf.quants.quantize(x, t)
        else:  # the package cannot quantize K-quants: random blocks (decoded by the package)
            data = rng.integers(0, 255, (8, gguf.quants.quant_shape_to_byte_shape((256,), t)[0]),
                                dtype=np.uint8)
        w.add_tensor(t.name, data, raw_dtype=None if t in (Q.F32, Q.F16) else t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for t in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors:
        ours = dequantize(t.data, t.tensor_type, x.shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref, err_msg=t.name)
        if t.tensor_type in ERROR_BOUND:  # and close to what was quantized
            assert np.abs(ours - x).max() <= ERROR_BOUND[t.tensor_type](x) * 1.01, t.name
        assert np.abs(ours - x).max() > 0 or t.tensor_type == Q.F32


def test_rope_row_permutation_round_trip():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    x = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (8, 2):
        permuted = llama_cpp_permute(x, 8, heads)
        np.testing.assert_array_equal(ggufio.permute_rope_rows(x, heads), permuted)
        np.testing.assert_array_equal(ggufio.unpermute_rope_rows(permuted, heads), x)
        ref = LlamaTensorProcessor()._reverse_permute_weights(permuted, 8, heads)
        np.testing.assert_array_equal(ggufio.unpermute_rope_rows(permuted, heads), ref)
        assert not np.array_equal(permuted, x)


def test_config_from_metadata(tiny, tmp_path):
    path, _ = tiny
    cfg = stored_model_config(path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        len(TOKENS), D, F, L)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (N, K, HD)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling.rope_type == "default"
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.max_position_embeddings == 256
    assert cfg.tie_word_embeddings and (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    untied = write_gguf(tmp_path / "untied.gguf", hf_weights(tied=False),
                        rope_scaling=("linear", 4.0))
    cfg = stored_model_config(untied)
    assert not cfg.tie_word_embeddings
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)


def llama_cpp_rope_factors(factor, low, high, old, head_dim, theta):
    """convert_hf_to_gguf.py's Llama 3 `rope_freqs` tensor, loop for loop."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def test_rope_scaling_from_metadata(tmp_path):
    freqs = llama_cpp_rope_factors(8.0, 1.0, 4.0, 8192, HD, 50000.0)
    path = write_gguf(tmp_path / "l3.gguf", hf_weights(), extra=[("rope_freqs.weight", freqs,
                                                                   None)])
    rs = stored_model_config(path).rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
            rs.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 8192)
    odd = write_gguf(tmp_path / "odd.gguf", hf_weights(), extra=[("rope_freqs.weight",
                                                                   freqs[::-1].copy(), None)])
    with pytest.raises(S2DError, match="rope factors match no Llama 3"):
        stored_model_config(odd)
    yarn = write_gguf(tmp_path / "yarn.gguf", hf_weights(), rope_scaling=("yarn", 4.0))
    with pytest.raises(S2DError, match="rope scaling type 'yarn' is not supported"):
        stored_model_config(yarn)


@pytest.mark.parametrize("tied", [True, False])
def test_params_match_weights_and_reference_dequantization(tied, tmp_path):
    weights = hf_weights(tied=tied, seed=2)
    path = write_gguf(tmp_path / "m.gguf", weights)
    cfg, params, _ = load_model(path)
    assert cfg.param_dtype == "float32" and cfg.tie_word_embeddings == tied
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for row in PARAMS:
        if row.path == "lm_head" and tied:
            assert "lm_head" not in params
            continue
        leaf = params["layers"][row.name] if row.stacked else params[row.path]
        leaf = np.asarray(leaf)
        for i in range(L) if row.stacked else [None]:
            got = leaf if i is None else leaf[i]
            hf_name = row.hf.format(i=i)
            t = reader[gguf_name(hf_name)]
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights[hf_name].shape)
            if ".attn_q." in t.name or ".attn_k." in t.name:
                heads = N if ".attn_q." in t.name else K
                ref = ref.reshape(heads, HD // 2, 2, -1).swapaxes(1, 2).reshape(ref.shape)
            np.testing.assert_array_equal(got, to_ours(ref, got.shape, row.n_in), t.name)
            orig = to_ours(weights[hf_name], got.shape, row.n_in)
            bound = ERROR_BOUND[t.tensor_type](weights[hf_name])
            assert np.abs(got - orig).max() <= bound * 1.01, (t.name, t.tensor_type.name)


def test_logits_match_transformers_gguf_loader(tiny):
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    cfg, params, _ = load_model(path)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    tokens = np.random.default_rng(3).integers(0, len(TOKENS), (2, 12))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(jit_forward(params, cfg, jnp.asarray(tokens))[0])
    assert np.abs(ours - ref).max() <= 1e-4


def test_tokenizer_and_chat_template(tiny, tmp_path):
    from s2d_jax.io.tokenizer import load_tokenizer

    path, _ = tiny
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, len(TOKENS))
    ids = tok.encode(" the is", bos=False)
    assert ids == [TOKENS.index("Ġthe"), TOKENS.index("Ġ"), TOKENS.index("is")]
    assert tok.decode(ids) == " the is"
    text = tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def run_cli(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


@pytest.mark.slow
def test_cli_gguf_to_hf_and_orbax(tiny, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    path, _ = tiny
    cfg, params, _ = load_model(path)
    rc, err = run_cli("infer.convert", "gguf-to-hf", "--src", path, "--out", tmp_path / "hf")
    assert rc == 0, err
    with open(tmp_path / "hf" / "tokenizer_config.json") as f:
        assert json.load(f)["chat_template"] == CHATML
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = np.arange(10)[None] % len(TOKENS)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(jit_forward(params, cfg, jnp.asarray(tokens))[0])
    assert np.abs(ours - ref).max() <= 1e-4
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("is")["input_ids"] == [TOKENS.index("is")]

    rc, err = run_cli("infer.convert", "gguf-to-orbax", "--src", path, "--out",
                      tmp_path / "ckpt", "--dtype", "bfloat16")
    assert rc == 0, err
    cfg2, params2, _ = restore_params(str(tmp_path / "ckpt"), host=True)
    assert cfg2.param_dtype == "bfloat16" and os.path.isfile(tmp_path / "ckpt" /
                                                                "tokenizer.json")
    np.testing.assert_array_equal(np.asarray(params2["layers"]["wq"], np.float32),
                                  np.asarray(params["layers"]["wq"].astype(jnp.bfloat16),
                                             np.float32))


def _bad_inputs(tmp_path, tiny_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, I am a text file\n")
    weights = hf_weights()  # one weight as IQ4_NL blocks (random bytes: never decoded)
    del weights["model.layers.0.mlp.up_proj.weight"]
    iq4 = np.random.default_rng(0).integers(0, 255, (F, D // 32 * 18), dtype=np.uint8)
    unsupported = write_gguf(tmp_path / "iq4.gguf", weights,
                             extra=[("blk.0.ffn_up.weight", iq4, Q.IQ4_NL)])
    other_arch = write_gguf(tmp_path / "qwen.gguf", hf_weights(), arch="qwen2")
    truncated = tmp_path / "cut.gguf"
    data = open(tiny_path, "rb").read()
    truncated.write_bytes(data[: len(data) - 1000])
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(data[:200])
    return {"not a GGUF": (not_gguf, "not a GGUF file"),
            "unsupported type": (unsupported, "IQ4_NL"),
            "non-llama arch": (other_arch, "architecture 'qwen2'"),
            "truncated data": (truncated, "truncated"),
            "truncated header": (header_cut, "truncated")}


def test_bad_input_one_error_line_nothing_written(tiny, tmp_path):
    path, _ = tiny
    for case, (bad, words) in _bad_inputs(tmp_path, path).items():
        with pytest.raises(S2DError, match=words):
            load_model(str(bad))
        out = tmp_path / f"out-{case.replace(' ', '_')}"
        rc, err = run_cli("infer.convert", "gguf-to-hf", "--src", bad, "--out", out)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), (case, err)
        assert words in lines[0], (case, lines[0])
        assert not os.path.exists(out)
        assert not [p for p in os.listdir(tmp_path) if p.startswith(f".{out.name}")]


# --- the real model (slow; run `python -m infer.fetch_smollm2` first) -------------------

PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence why the sky is blue.")


@pytest.fixture(scope="module")
def smollm2():
    from infer.fetch_smollm2 import GGUF_SHA256, model_paths, sha256_of

    gguf_path, hf_dir = model_paths()
    if not os.path.isdir(hf_dir) or not os.path.isfile(gguf_path) \
            or sha256_of(gguf_path) != GGUF_SHA256:
        pytest.skip(f"SmolLM2-135M-Instruct not fetched ({gguf_path}, {hf_dir}); run "
                    f"`python -m infer.fetch_smollm2` first")
    return gguf_path, hf_dir


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from s2d_jax.io.tokenizer import load_tokenizer

    gguf_path, hf_dir = smollm2
    tok = load_tokenizer(hf_dir)
    cfg, params, _ = load_model(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                 gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32).eval()
    model64 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    diffs, errs64 = [], []
    for prompt in PROMPTS:
        text = tok.hf.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=False)
        ids = tok.hf(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits.numpy()
            ref64 = model64(torch.tensor([ids])).logits.numpy()
        ours = np.asarray(jit_forward(params, cfg, jnp.asarray([ids]))[0])
        diffs.append(float(np.abs(ours - ref).max()))
        errs64.append(float(np.abs(ours - ref64).max()))
        print(f"\n{prompt!r}: {len(ids)} tokens, logits up to {np.abs(ref).max():.1f}; max "
              f"|ours - transformers f32| {diffs[-1]:.3g}; vs float64: ours "
              f"{errs64[-1]:.3g}, transformers f32 {np.abs(ref - ref64).max():.3g}")
    # Two float32 evaluations of the same weights: through 30 layers with activations up to
    # ~2.5e4, transformers itself is ~6e-5 from float64 and ours 1e-4..1.8e-4, so they can be
    # ~2e-4 apart. A wrong permutation, layout or dequantization differs by O(1).
    assert max(diffs) <= 2e-4
    assert max(errs64) <= 2e-4


@pytest.mark.slow
def test_smollm2_greedy_answer(smollm2):
    from examples.smollm2_chat import main

    for model in smollm2:  # the .gguf file and the HF dir it was converted to
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["--model", model, "--max-new-tokens", "24"]) == 0
        assert out.getvalue().strip() == "The capital of France is Paris."
