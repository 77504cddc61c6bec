"""Every model format's loader follows the same `num_layers` and `dtype` rules
(`config.first_layers`, `config.with_dtype`): an HF dir, an orbax params checkpoint, a GGUF
file and a draft pack, all holding the same tiny model."""

import dataclasses

import jax
import numpy as np
import pytest

from s2d_jax.config import ModelConfig, first_layers, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.checkpoint import checkpoint_kind, load_draft, load_model
from s2d_jax.io.draft_pack import save_draft_pack
from s2d_jax.io.hf import export_hf
from s2d_jax.io.orbax_params import save_params
from tiny_gguf import L, hf_weights, write_gguf


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """{kind: (path, stored params dtype)}: the tiny GGUF model in each format."""
    tmp = tmp_path_factory.mktemp("formats")
    gguf_path = write_gguf(tmp / "m.gguf", hf_weights())
    cfg, params, _ = load_model(gguf_path)
    export_hf(params, cfg, str(tmp / "hf"))
    bf16 = jax.tree.map(lambda x: x.astype("bfloat16"), params)
    save_params(str(tmp / "ckpt"), bf16, cfg)
    _, first, _ = load_model(gguf_path, num_layers=1)
    save_draft_pack(str(tmp / "pack"), dataclasses.replace(cfg, num_layers=1,
                                                           param_dtype="bfloat16"),
                    first, {}, target_embed=params["embed"], weights="bfloat16")
    return {"gguf": (str(gguf_path), "float32"), "hf": (str(tmp / "hf"), "float32"),
            "params": (str(tmp / "ckpt"), "bfloat16"), "draft-pack": (str(tmp / "pack"),
                                                                       "bfloat16")}


def _load(formats, kind, **kw):
    path = formats[kind][0]
    assert checkpoint_kind(path) == kind
    if kind == "draft-pack":
        return load_draft(path, formats["gguf"][0], **kw)
    return load_model(path, **kw)


@pytest.mark.parametrize("kind", ["gguf", "hf", "params", "draft-pack"])
def test_dtype_none_keeps_the_stored_params_and_the_compute_dtype(formats, kind):
    cfg, params, _ = _load(formats, kind)
    stored = formats[kind][1]
    assert (cfg.dtype, cfg.param_dtype) == ("float32", stored)
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {stored}
    cfg, params, _ = _load(formats, kind, dtype="float16")
    assert (cfg.dtype, cfg.param_dtype) == ("float16", "float16")
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float16"}


@pytest.mark.parametrize("kind", ["gguf", "hf", "params"])
def test_num_layers_is_one_check_for_every_format(formats, kind):
    cfg, params, _ = _load(formats, kind, num_layers=1)
    assert cfg.num_layers == 1 and params["layers"]["wq"].shape[0] == 1
    for bad in (0, L + 1):
        with pytest.raises(S2DError, match=rf"num_layers={bad} is outside 1\.\.{L} \(the "
                                           rf"layers in .*\); pass a layer count"):
            _load(formats, kind, num_layers=bad)


def test_the_rules_themselves():
    cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=3,
                      num_heads=2, num_kv_heads=1)
    assert with_dtype(cfg, None, np.dtype("float16")).param_dtype == "float16"
    assert with_dtype(cfg, None, np.float64).param_dtype == "float32"  # not a model dtype
    assert with_dtype(cfg, None, np.float64).dtype == "float32"
    got = with_dtype(cfg, jax.numpy.bfloat16, None)
    assert (got.dtype, got.param_dtype) == ("bfloat16", "bfloat16")
    with pytest.raises(S2DError, match="dtype 'int8' is not supported"):
        with_dtype(cfg, "int8", None)
    assert first_layers(cfg, None, "x") is cfg and first_layers(cfg, 2, "x").num_layers == 2
