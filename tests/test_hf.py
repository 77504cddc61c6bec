"""HF LlamaForCausalLM <-> s2d-jax: logits parity (full and cached), file layouts, round trips."""

import inspect
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
# the `bench` extra's torch (HF reference models); `.[test]` leaves it out: a CUDA wheel is GBs
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from s2d_jax.io import hf
from s2d_jax.io.checkpoint import load_model
from s2d_jax.io.orbax_params import restore_params, save_params
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import init_cache
from s2d_jax.model.transformer import forward
from s2d_jax.model.transformer import param_shardings
from s2d_jax.parallel.mesh import MeshConfig, make_mesh

TOL = 1e-4
MAX_POS = 16
VARIANTS = {
    # name: (num_kv_heads, rope_scaling, tied, sequence length)
    "mha_default_untied": (4, None, False, 12),
    "gqa_linear_tied": (2, {"rope_type": "linear", "factor": 2.0}, True, 12),
    "gqa_llama3_untied": (1, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}, False, 12),
    # longer than max_position_embeddings, so the NTK base actually grows
    "gqa_dynamic_untied": (2, {"rope_type": "dynamic", "factor": 4.0}, False, 24),
}
TOKENIZER_DIR = "/work/shared/data/llama2_tokenizer"
jit_forward = jax.jit(forward, static_argnums=1)  # eager scan would re-trace every call


def make_hf(kv, rope, tied, seed=0, layers=3, vocab=96):
    hc = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv,
                     rope_scaling=rope, tie_word_embeddings=tied, max_position_embeddings=MAX_POS,
                     rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hc).eval()
    with torch.no_grad():  # norms start at 1.0; randomise so a mixed-up norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def hf_cached_logits(model, tokens, prefill):
    """HF's own prefill + token-by-token decoding (dynamic rope depends on this history).
    transformers 5.x names the cache `cache` (`past_key_values`, deprecated, goes in 5.40)."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    t = torch.tensor(tokens)
    with torch.no_grad():
        out = model(t[:, :prefill], use_cache=True)
        logits, past = [out.logits], getattr(out, key)
        for i in range(prefill, t.shape[1]):
            out = model(t[:, i:i + 1], use_cache=True, **{key: past})
            logits.append(out.logits)
            past = getattr(out, key)
    return torch.cat(logits, 1).numpy()


def ours_cached_logits(params, cfg, tokens, prefill):
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    logits, cache = jit_forward(params, cfg, jnp.asarray(tokens[:, :prefill]), cache=cache)
    cache = cache.with_lengths(cache.lengths + prefill)
    outs = [logits]
    for i in range(prefill, tokens.shape[1]):
        logits, cache = jit_forward(params, cfg, jnp.asarray(tokens[:, i:i + 1]), cache=cache)
        cache = cache.with_lengths(cache.lengths + 1)
        outs.append(logits)
    return np.asarray(jnp.concatenate(outs, axis=1))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved_variant(request, tmp_path_factory):
    kv, rope, tied, seq = VARIANTS[request.param]
    model = make_hf(kv, rope, tied)
    path = str(tmp_path_factory.mktemp(request.param) / "hf")
    model.save_pretrained(path)
    tokens = np.random.RandomState(1).randint(0, 96, (2, seq))
    return request.param, model, path, tokens


def test_logits_parity_full_and_cached(saved_variant):
    name, model, path, tokens = saved_variant
    cfg, params, extra = load_model(path)
    assert extra == {}
    assert cfg.tie_word_embeddings == VARIANTS[name][2]
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    ref = hf_logits(model, tokens)
    out, _ = jit_forward(params, cfg, jnp.asarray(tokens))
    assert np.abs(np.asarray(out) - ref).max() <= TOL

    prefill = 5
    ours = ours_cached_logits(params, cfg, tokens, prefill)
    if cfg.rope_scaling.rope_type == "dynamic":
        ref_cached = hf_cached_logits(model, tokens, prefill)
        # the history dependence is real: cached decoding differs from one full pass
        assert np.abs(ref_cached - ref).max() > 10 * TOL
    else:
        ref_cached = ref
    assert np.abs(ours - ref_cached).max() <= TOL


def _tree_equal(a, b):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    model = make_hf(2, {"rope_type": "linear", "factor": 2.0}, False, seed=3)
    root = tmp_path_factory.mktemp("gqa")
    model.save_pretrained(str(root / "single"))
    return model, root


def test_sharded_safetensors_and_pytorch_bin_load_identically(gqa_model):
    model, root = gqa_model
    _, ref, _ = load_model(str(root / "single"))
    model.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    assert os.path.isfile(root / "sharded" / "model.safetensors.index.json")
    _, sharded, _ = load_model(str(root / "sharded"))
    _tree_equal(ref, sharded)

    sd = model.state_dict()
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text((root / "single" / "config.json").read_text())
    torch.save(sd, root / "bin" / "pytorch_model.bin")
    _, from_bin, _ = load_model(str(root / "bin"))
    _tree_equal(ref, from_bin)

    (root / "bin2").mkdir()
    (root / "bin2" / "config.json").write_text((root / "single" / "config.json").read_text())
    names = list(sd)
    half = {n: sd[n] for n in names[: len(names) // 2]}, {n: sd[n] for n in names[len(names) // 2:]}
    weight_map = {}
    for k, part in enumerate(half):
        fname = f"pytorch_model-0000{k + 1}-of-00002.bin"
        torch.save(part, root / "bin2" / fname)
        weight_map.update({n: fname for n in part})
    (root / "bin2" / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, from_bin2, _ = load_model(str(root / "bin2"))
    _tree_equal(ref, from_bin2)


def test_bfloat16_weights_load_exactly(gqa_model, tmp_path):
    model, _ = gqa_model
    bf = make_hf(2, None, False, seed=4).to(torch.bfloat16)
    bf.save_pretrained(str(tmp_path / "st"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(bf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    want = bf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [N*H, D]
    for sub in ("st", "bin"):
        cfg, params, _ = load_model(str(tmp_path / sub))
        assert cfg.param_dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
        got = np.asarray(params["layers"]["wq"][1]).astype(np.float32)  # [D, N, H]
        np.testing.assert_array_equal(got.reshape(64, -1).T, want)
    cfg32, p32, _ = load_model(str(tmp_path / "st"), dtype="float32")
    assert cfg32.dtype == cfg32.param_dtype == "float32" and p32["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p32["embed"]),
                                  bf.model.embed_tokens.weight.detach().float().numpy())


def test_num_layers_truncation_is_a_prefix(gqa_model):
    _, root = gqa_model
    cfg, full, _ = load_model(str(root / "single"))
    cfg2, two, _ = load_model(str(root / "single"), num_layers=2)
    assert cfg2.num_layers == 2 and cfg.num_layers == 3
    _tree_equal(jax.tree.map(lambda x: x[:2], full["layers"]), two["layers"])
    _tree_equal(full["embed"], two["embed"])
    with pytest.raises(S2DError, match="num_layers=4"):
        load_model(str(root / "single"), num_layers=4)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_hf_ours_hf_is_identical(tmp_path, tied):
    model = make_hf(2, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                    tied, seed=5)
    model.save_pretrained(str(tmp_path / "src"))
    cfg, params, _ = load_model(str(tmp_path / "src"))
    hf.export_hf(params, cfg, str(tmp_path / "out"), extra={"s2d_exits": [1, 2]},
                 tokenizer_dir=TOKENIZER_DIR, max_shard_bytes=40_000)
    out = tmp_path / "out"
    assert os.path.isfile(out / "model.safetensors.index.json")  # sharded above the limit
    assert os.path.isfile(out / "tokenizer.model")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dir left
    src_sd = model.state_dict()
    with open(out / "model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    exported = {}
    for fname in files:
        exported.update(load_file(str(out / fname)))
    expect = {k for k in src_sd if not (tied and k == "lm_head.weight")}
    assert set(exported) == expect
    for k in expect:
        assert torch.equal(exported[k], src_sd[k]), k
    back = LlamaForCausalLM.from_pretrained(str(out)).eval()
    tokens = np.random.RandomState(2).randint(0, 96, (2, 10))
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(model, tokens))
    cfg2, _, extra = load_model(str(out))
    assert cfg2 == cfg and extra == {"s2d_exits": [1, 2]}
    with pytest.raises(S2DError, match="already exists"):
        hf.export_hf(params, cfg, str(out))


def test_orbax_round_trip_truncation_cast_and_sharding(gqa_model, tmp_path):
    _, root = gqa_model
    cfg, params, _ = load_model(str(root / "single"))
    ckpt = str(tmp_path / "ckpt")
    save_params(ckpt, params, cfg, extra={"s2d_exits": [1, 2]})
    cfg2, back, extra = load_model(ckpt)
    assert cfg2 == cfg and extra == {"s2d_exits": [1, 2]}
    _tree_equal(params, back)

    cfg3, two_bf16, _ = restore_params(ckpt, num_layers=2, dtype="bfloat16", host=True)
    assert cfg3.num_layers == 2 and cfg3.dtype == cfg3.param_dtype == "bfloat16"
    assert isinstance(two_bf16["embed"], np.ndarray)
    want = jax.tree.map(lambda x: np.asarray(x[:2]).astype(ml_dtypes.bfloat16), params["layers"])
    _tree_equal(want, two_bf16["layers"])

    sidecar = json.loads((tmp_path / "ckpt" / "s2d_config.json").read_text())
    sidecar["model"]["intermediate_size"] = 128
    (tmp_path / "ckpt" / "s2d_config.json").write_text(json.dumps(sidecar))
    with pytest.raises(S2DError, match="do not match"):
        load_model(ckpt)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "s2d_config.json").write_text(json.dumps(sidecar))
    with pytest.raises(S2DError, match="cannot read the params"):
        load_model(str(tmp_path / "empty"))

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shardings = param_shardings(cfg, mesh)
    save_params(ckpt, params, cfg, overwrite=True)
    for path in (ckpt, str(root / "single")):
        _, placed, _ = load_model(path, shardings=shardings)
        _tree_equal(params, placed)
        wq = placed["layers"]["wq"]
        assert wq.sharding == shardings["layers"]["wq"]
        assert wq.addressable_shards[0].data.shape == (3, 32, 2, 16)  # D/fsdp, N/tensor


def _corrupt_variants(src, tmp_path):
    """(name, model dir, expected message) for loader failures."""
    cases = []

    def copy(name):
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(src):
            (d / f).write_bytes((src / f).read_bytes())
        return d

    d = copy("truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((d, "truncated"))
    d = copy("garbage")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    cases.append((d, "not a safetensors file"))
    d = copy("shape")
    c = json.loads((d / "config.json").read_text())
    c["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(c))
    cases.append((d, "config and weights disagree"))
    d = copy("deeper")
    c["intermediate_size"], c["num_hidden_layers"] = 96, 5
    (d / "config.json").write_text(json.dumps(c))
    cases.append((d, "model.layers.3"))
    d = copy("bias")
    c = json.loads((src / "config.json").read_text())
    c["attention_bias"] = True
    (d / "config.json").write_text(json.dumps(c))
    cases.append((d, "attention_bias"))
    d = copy("extra_tensor")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cases.append((d, "q_proj.bias"))
    return cases


def test_bad_weights_raise_clear_errors(gqa_model, tmp_path):
    _, root = gqa_model
    for path, message in _corrupt_variants(root / "single", tmp_path):
        with pytest.raises(S2DError, match=message):
            load_model(str(path))
    with pytest.raises(S2DError, match="neither"):
        load_model(str(tmp_path))
    with pytest.raises(S2DError, match="not a directory"):
        load_model(str(tmp_path / "missing"))
