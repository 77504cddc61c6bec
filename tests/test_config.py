"""Model configs: the shipped YAML files, `key=value` overrides, HF config.json both ways."""

import dataclasses
import json
import os

import pytest
from transformers import LlamaConfig

from s2d_jax.config import ModelConfig, RopeScaling, load_model_config
from s2d_jax.errors import S2DError

MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")


def model_yaml(name):
    return os.path.join(MODELS, f"{name}.yaml")


@pytest.mark.parametrize("name,layers,hidden,inter,heads,kv", [
    ("vicuna-7b-v1.5", 32, 4096, 11008, 32, 32),
    ("vicuna-13b-v1.5", 40, 5120, 13824, 40, 40),
    ("llama2-70b-chat", 80, 8192, 28672, 64, 8),
])
def test_shipped_target_configs(name, layers, hidden, inter, heads, kv):
    cfg = load_model_config(model_yaml(name))
    got = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads)
    assert got == (layers, hidden, inter, heads, kv)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps) == (32000, 4096, 1e-5)
    assert cfg.head_dim == 128 and not cfg.tie_word_embeddings and cfg.name == name


def test_every_shipped_config_loads():
    names = [f[:-5] for f in os.listdir(MODELS) if f.endswith(".yaml")]
    assert {"tiny", "vicuna-7b-v1.5", "vicuna-13b-v1.5", "llama2-70b-chat"} <= set(names)
    for name in names:
        assert load_model_config(model_yaml(name)).num_params() > 0


def test_overrides_apply_and_nest():
    cfg = load_model_config(model_yaml("tiny"), ["num_layers=2", "rope_scaling.rope_type=linear",
                                                 "rope_scaling.factor=4", "dtype=bfloat16"])
    base = load_model_config(model_yaml("tiny"))
    assert cfg.num_layers == 2 and base.num_layers != 2
    assert cfg.rope_scaling == RopeScaling("linear", 4.0) and cfg.dtype == "bfloat16"
    assert dataclasses.replace(cfg, num_layers=base.num_layers, rope_scaling=base.rope_scaling,
                               dtype=base.dtype) == base


@pytest.mark.parametrize("override,named", [
    ("num_layerz=2", "num_layerz"),
    ("rope_scaling.fctor=2", "rope_scaling.fctor"),
    ("num_layers=two", "num_layers"),
    ("hidden_size=1.5", "hidden_size"),
    ("num_layers=0", "num_layers"),
    ("dtype=int8", "dtype"),
    ("num_kv_heads=3", "num_kv_heads"),
    ("rope_scaling.rope_type=yarnish", "yarnish"),
    ("tie_word_embeddings=maybe", "tie_word_embeddings"),
    ("num_layers", "num_layers"),
])
def test_bad_overrides_name_the_key(override, named):
    with pytest.raises(S2DError, match=named.replace(".", r"\.")):
        load_model_config(model_yaml("tiny"), [override])


def test_missing_yaml_file():
    with pytest.raises(S2DError, match="not found"):
        load_model_config(model_yaml("no-such-model"))


ROPES = [RopeScaling(), RopeScaling("linear", 2.0), RopeScaling("dynamic", 3.0),
         RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r.rope_type)
def test_hf_config_round_trip_through_transformers(rope, tmp_path):
    cfg = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, rope_theta=5e5, rope_scaling=rope,
                      rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True,
                      bos_token_id=5, eos_token_id=7)
    hf = LlamaConfig(**cfg.to_hf_config())
    hf.save_pretrained(str(tmp_path))  # what transformers itself writes (rope_parameters, ...)
    back = load_model_config(str(tmp_path))
    assert back == cfg
    # and with overrides on an HF dir
    assert load_model_config(str(tmp_path), ["num_layers=1"]).num_layers == 1


def test_hf_config_errors(tmp_path):
    good = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=2).to_hf_config()
    bad = dict(good)
    del bad["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(S2DError, match="intermediate_size"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(
        {**good, "rope_scaling": {"rope_type": "yarnish", "factor": 2.0}}))
    with pytest.raises(S2DError, match="yarnish"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(S2DError, match="not valid JSON"):
        load_model_config(str(tmp_path))
