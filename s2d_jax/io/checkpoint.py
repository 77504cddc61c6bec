"""Which model format a path is, and the loaders every command calls: `load_model` for a
model, `load_draft` for a `--draft`. The formats themselves live one per file:

    .gguf file                      io/gguf.py          (llama.cpp, read only)
    dir with s2d_config.json        io/orbax_params.py  (this project's params checkpoint)
    dir with s2d_draft_pack.json    io/draft_pack.py    (a draft without its target's weights)
    dir with config.json            io/hf.py            (HF LlamaForCausalLM)

Every loader takes the same `num_layers` and `dtype` (`config.first_layers`,
`config.with_dtype`) and `shardings`, and returns (cfg, params, extra).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from s2d_jax.config import ModelConfig, read_hf_config
from s2d_jax.errors import S2DError
from s2d_jax.io import draft_pack, gguf, gguf_weights, hf, orbax_params
from s2d_jax.readers import expand_path


def checkpoint_kind(path: str) -> str:
    """'gguf' (a .gguf file), 'params' (orbax params checkpoint), 'draft-pack' (a draft
    without its target's shared weights, `io.draft_pack`) or 'hf' (HF model dir);
    S2DError for anything else. The one place that tells the model formats apart."""
    if gguf.is_gguf(path):
        return "gguf"
    if not os.path.isdir(path):
        raise S2DError(f"model path {path} is not a directory; pass an HF model dir, a "
                       f"checkpoint written by `python -m infer.convert hf-to-orbax` or a "
                       f".gguf file")
    if orbax_params.is_params_checkpoint(path):
        return "params"
    if draft_pack.is_draft_pack(path):
        return "draft-pack"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise S2DError(f"{path} holds neither {orbax_params.SIDECAR} (params checkpoint) nor "
                   f"config.json (HF model); pass a model directory")


def load_model(path: str, num_layers: int | None = None, dtype=None, shardings=None
               ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from an HF model dir, a params checkpoint dir or a GGUF file.

    num_layers: keep the first N decoder layers (draft init from a target). dtype: cast the
    params and use it as compute dtype too (cfg.dtype = cfg.param_dtype = dtype); default
    keeps the stored dtype. shardings: params-shaped tree of Shardings for the returned cfg
    (e.g. `model.transformer.param_shardings(cfg, mesh)`); default one local device.
    extra: non-ModelConfig settings such as a draft's `s2d_exits`.
    """
    from s2d_jax import validate
    from s2d_jax.env import resolve_model
    path = resolve_model(validate.path(path, "path"))  # a path, or a name (`smollm2`)
    validate.integer(num_layers, "num_layers", optional=True)  # its range: first_layers
    kind = checkpoint_kind(path)
    if kind == "gguf":
        return gguf.load_gguf(path, num_layers, dtype, shardings)
    if kind == "params":
        return orbax_params.restore_params(path, num_layers, dtype, shardings)
    if kind == "draft-pack":
        raise S2DError(f"{path} is a draft pack: it lacks the weights it shares with its "
                       f"target; pass it as --draft next to its target (load_draft), or "
                       f"make a full model with python -m infer.convert unpack-draft")
    if gguf_weights.is_quantized_dir(path):  # a GGUF's quantization kept (gguf_weights.py)
        return gguf_weights.load_quantized_dir(path, num_layers, dtype, shardings)
    return hf.load_hf(path, num_layers, dtype, shardings)


def stored_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a params checkpoint, HF dir, draft pack or GGUF file, reading no
    weight."""
    kind = checkpoint_kind(path)
    if kind == "gguf":
        return gguf.read_gguf_config(path)
    if kind == "params":
        return orbax_params.read_params_config(path)[0]
    if kind == "draft-pack":
        return draft_pack.read_pack_config(path)[0]
    return read_hf_config(path)


# --- drafts -----------------------------------------------------------------------------

def load_draft(path: str, target, dtype=None, shardings=None
               ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) of a `--draft`: a draft pack (completed with `target`: its
    params, or a model path whose shared weights are read) or any model `load_model` reads;
    either way a sub-vocabulary head stored as `s2d_head_vocab` becomes params["head_ids"].
    """
    path = expand_path(path)
    if os.path.isdir(path) and draft_pack.is_draft_pack(path):
        if isinstance(target, str):  # only the shared weights are needed: one layer
            target = load_model(target, num_layers=1)[1]
        target = _shared_of_quantized(target, draft_pack.read_pack_config(path)[0])
        cfg, params, extra = draft_pack.load_draft_pack(path, target, dtype, shardings)
    else:
        cfg, params, extra = load_model(path, dtype=dtype, shardings=shardings)
    return cfg, _with_head_ids(params, cfg, extra, path), extra


def _shared_of_quantized(target, cfg: ModelConfig):
    """A target whose head is kept quantized (gguf_weights: a tied table becomes a float
    embedding beside a QuantizedWeight head of the same values): a tied draft takes only
    the embedding, an untied one the head's float values."""
    from s2d_jax.model.quantize import QuantizedWeight
    head = target.get("lm_head") if isinstance(target, dict) else None
    if not isinstance(head, QuantizedWeight):
        return target
    if cfg.tie_word_embeddings:
        return {k: v for k, v in target.items() if k != "lm_head"}
    return {**target, "lm_head": head.astype(jnp.float32)}


def _with_head_ids(params: dict, cfg: ModelConfig, extra: dict, source: str) -> dict:
    """params plus "head_ids" when the draft has a sub-vocabulary head (`s2d_head_vocab`)."""
    ids = extra.get("s2d_head_vocab")
    if not ids:
        return params
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 \
            or arr.max() >= cfg.vocab_size or len(np.unique(arr)) != len(arr):
        raise S2DError(f"{source}: s2d_head_vocab must list distinct token ids in "
                       f"[0, {cfg.vocab_size}); re-export the draft")
    return {**params, "head_ids": jnp.asarray(arr, jnp.int32)}


def unpack_draft(path: str, target, out_dir: str, tokenizer_dir: str | None = None,
                 overwrite: bool = False) -> None:
    """A draft pack as a complete HF dir (full head: transformers has no sub-vocabulary
    head), e.g. as `assistant_model` of HF assisted generation."""
    cfg, params, extra = load_draft(path, target, dtype="float32")
    params = {k: v for k, v in params.items() if k != "head_ids"}
    hf.export_hf(params, cfg, out_dir, extra={k: v for k, v in extra.items()
                                              if k.startswith("s2d_")},
                 tokenizer_dir=tokenizer_dir, overwrite=overwrite)
