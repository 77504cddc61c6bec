"""HF `LlamaForCausalLM` checkpoints <-> s2d-jax params, both ways, one tensor at a time.

The rows of `model/params.py`'s `PARAMS` are the whole correspondence: one row per
parameter, naming the HF tensor and saying whether it is a linear weight (HF stores
`[out, in]`; we store `[in..., out...]` with heads split out: `params.to_ours/to_hf`).
Loading fills each preallocated stacked `[L, ...]` host array layer by layer from
memory-mapped files (`hf_files.py`), so a 70B conversion never holds two copies;
exporting walks the same rows backwards, writing one shard at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Iterator

import numpy as np
from tqdm.auto import tqdm

from s2d_jax.config import ModelConfig, first_layers, read_hf_config, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.hf_files import WeightSource, write_safetensors
from s2d_jax.io.outputs import HF_DIR
from s2d_jax.io.tokenizer import tokenizer_files
from s2d_jax.model.params import (BY_PATH, PARAMS, Param, active_params, get_path, hf_shape,
                                  params_from_stream, shape_of, to_hf, to_ours)
from s2d_jax.readers import read_json

# HF tensors that carry no weights we need (old checkpoints stored the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
EXTRA_PREFIX = "s2d_"  # config.json keys returned as `extra` (e.g. a draft's s2d_exits)


# --- HF dir -> params -------------------------------------------------------------------

def read_hf_model_config(model_dir: str) -> tuple[ModelConfig, dict]:
    """(ModelConfig, extra) from an HF dir; extra = the `s2d_*` keys of config.json."""
    if not os.path.isdir(model_dir):
        raise S2DError(f"model directory {model_dir} does not exist; pass an HF model directory")
    cfg = read_hf_config(model_dir)
    raw = read_json(os.path.join(model_dir, "config.json"), "HF config")
    if raw.get("hidden_act", "silu") != "silu":
        raise S2DError(f"{model_dir}: hidden_act={raw['hidden_act']!r} is not supported; "
                       f"only Llama-family models with silu MLPs")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise S2DError(f"{model_dir}: {key}=true is not supported; only bias-free Llama models")
    return cfg, {k: v for k, v in raw.items() if k.startswith(EXTRA_PREFIX)}


def _check_tensors(source: WeightSource, cfg: ModelConfig, full_layers: int, model_dir: str):
    """Fail before reading any data if a tensor is absent, unknown or of the wrong shape."""
    needed = {r.hf.format(i=i) for r in active_params(cfg) for i in range(cfg.num_layers)}
    missing = sorted(needed - set(source.names()))
    if missing:
        raise S2DError(f"{model_dir} has no tensor {missing[0]} (of {len(missing)} missing); "
                       f"the weights do not match config.json")
    for row in active_params(cfg):
        want = hf_shape(shape_of(row, cfg), row.n_in)
        for i in range(cfg.num_layers) if row.stacked else [None]:
            name = row.hf.format(i=i)
            if source.shape(name) != want:
                raise S2DError(f"{model_dir}: {name} has shape {source.shape(name)} but "
                               f"config.json implies {want}; config and weights disagree")
    known = {r.hf.format(i=i) for r in PARAMS for i in range(full_layers)}
    unknown = sorted(n for n in source.names()
                     if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise S2DError(f"{model_dir} has weights a bias-free Llama cannot use (e.g. {unknown[0]}); "
                       f"only LlamaForCausalLM checkpoints are supported")


def iter_hf_params(model_dir: str, num_layers: int | None = None, dtype=None
                   ) -> tuple[ModelConfig, dict, Iterator[tuple[str, np.ndarray]]]:
    """(cfg, extra, iterator of (our "/"-path, host array)): one stacked param at a time.

    `num_layers` and `dtype` as `config.first_layers` and `config.with_dtype` (the stored
    dtype: the embedding's). The returned cfg reflects both.
    """
    cfg, extra = read_hf_model_config(model_dir)
    full_layers = cfg.num_layers
    cfg = first_layers(cfg, num_layers, model_dir)
    source = WeightSource(model_dir)
    _check_tensors(source, cfg, full_layers, model_dir)
    stored = source.get(BY_PATH["embed"].hf).dtype if dtype is None else None
    cfg = with_dtype(cfg, dtype, stored)
    dtype = cfg.param_dtype

    def generate():
        rows = active_params(cfg)
        total = sum(cfg.num_layers if r.stacked else 1 for r in rows)
        with tqdm(total=total, desc=f"load {os.path.basename(model_dir.rstrip('/'))}",
                  unit="tensor", leave=False, disable=None) as bar:
            for row in rows:
                shape = shape_of(row, cfg)
                layers = range(cfg.num_layers) if row.stacked else [None]
                out = np.empty(((cfg.num_layers,) if row.stacked else ()) + shape, dtype)
                for i in layers:
                    name = row.hf.format(i=i)
                    x = source.get(name)  # shape checked in _check_tensors
                    if i is None:
                        out[...] = to_ours(x, shape, row.n_in)
                    else:
                        out[i] = to_ours(x, shape, row.n_in)
                    del x
                    bar.update()
                yield row.path, out
                del out  # the consumer owns it now (on device, or kept on host)

    return cfg, extra, generate()


def load_hf(model_dir: str, num_layers: int | None = None, dtype=None, shardings=None,
            host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from an HF dir. Each param goes to its devices as soon as it
    is read (`shardings`: a params-shaped tree of Shardings), or stays numpy if `host`."""
    cfg, extra, stream = iter_hf_params(model_dir, num_layers, dtype)
    return cfg, params_from_stream(stream, shardings, host), extra


# --- params -> HF dir -------------------------------------------------------------------

def _hf_order(cfg: ModelConfig) -> Iterator[tuple[str, Param, int | None]]:
    """(HF name, row, layer) in HF's usual order: embedding, layer by layer, norm, head."""
    rows = active_params(cfg)
    yield from ((r.hf, r, None) for r in rows if r.path == "embed")
    for i in range(cfg.num_layers):
        yield from ((r.hf.format(i=i), r, i) for r in rows if r.stacked)
    yield from ((r.hf, r, None) for r in rows if r.path in ("final_norm", "lm_head"))


def hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) one tensor at a time (a layer slice of a stacked param)."""
    for name, row, i in _hf_order(cfg):
        leaf = get_path(params, row.path)
        yield name, to_hf(np.asarray(leaf if i is None else leaf[i]), row.n_in)


def _plan_shards(params: dict, cfg: ModelConfig, max_shard_bytes: int) -> list[list[str]]:
    """Consecutive HF names in shards of at most max_shard_bytes (one tensor may exceed)."""
    shards, size = [[]], 0
    for name, row, i in _hf_order(cfg):
        leaf = get_path(params, row.path)
        nbytes = math.prod(leaf.shape[1:] if row.stacked else leaf.shape) * leaf.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _check_params(params: dict, cfg: ModelConfig) -> None:
    for row in active_params(cfg):
        try:
            shape = tuple(get_path(params, row.path).shape)
        except (KeyError, TypeError):
            raise S2DError(f"params have no {row.path!r}; they do not match the model config")
        want = ((cfg.num_layers,) if row.stacked else ()) + shape_of(row, cfg)
        if shape != want:
            raise S2DError(f"param {row.path} has shape {shape}, config implies {want}")


def export_hf(params: dict, cfg: ModelConfig, out_dir: str, extra: dict | None = None,
              tokenizer_dir: str | None = None, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> None:
    """Write an HF dir that `LlamaForCausalLM.from_pretrained` loads.

    Tensors keep the params' dtype; `extra` keys (each must start with `s2d_`) are added
    to config.json; tokenizer files are copied from `tokenizer_dir`. Everything is written
    to a temp dir next to `out_dir` and renamed at the end.
    """
    _check_params(params, cfg)
    extra = dict(extra or {})
    bad = [k for k in extra if not k.startswith(EXTRA_PREFIX)]
    if bad:
        raise S2DError(f"extra config key {bad[0]!r} does not start with {EXTRA_PREFIX!r}, so a "
                       f"loader could not tell it from HF's keys; rename it")
    tok_files = tokenizer_files(tokenizer_dir, required=True)
    dtype = np.dtype(get_path(params, "embed").dtype).name
    hf_config = {**cfg.to_hf_config(), "torch_dtype": dtype, **extra}
    shards = _plan_shards(params, cfg, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    shard_of = {n: k for k, shard in enumerate(shards) for n in shard}

    with atomic_output_dir(out_dir, overwrite, HF_DIR) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        pending: dict[str, np.ndarray] = {}
        weight_map, total = {}, 0
        bar = tqdm(total=len(shard_of), desc="export", unit="tensor", leave=False, disable=None)
        for name, x in hf_tensors(params, cfg):
            pending[name] = np.ascontiguousarray(x)
            weight_map[name] = names[shard_of[name]]
            total += x.nbytes
            bar.update()
            if len(pending) == len(shards[shard_of[name]]):  # shard complete: write it
                write_safetensors(pending, os.path.join(tmp, names[shard_of[name]]))
                pending = {}
        bar.close()
        if len(shards) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        for path in tok_files:
            shutil.copy2(path, tmp)
