"""llama.cpp GGUF files -> s2d-jax params, ModelConfig and an HF tokenizer, one tensor at a time.

Read with `gguf.GGUFReader` (memory-mapped); each tensor is dequantized to float32
(`gguf_quants.py`), brought from llama.cpp's layout to HF's, then to ours with the same
`model/params.py` rows, and written into a preallocated stacked `[L, ...]` array, so only one
dequantized tensor exists at a time besides the output.

Layout differences from HF `LlamaForCausalLM`:
  - tensor names: the `gguf` column of `model/params.py`'s table;
  - GGUF dims are listed innermost first; the reader already returns numpy order, which for
    a linear weight is HF's `[out, in]`;
  - llama.cpp's convert_hf_to_gguf.py permutes the rows of attn_q / attn_k so that each
    head's rotary pairs are interleaved (GPT-J style rope) instead of HF's rotate-half
    halves; `unpermute_rope_rows` is its inverse (transformers' LlamaTensorProcessor does
    the same).
"""

from __future__ import annotations

import os
from typing import Iterator

import gguf  # the PyPI package (llama.cpp's gguf-py), not this module
import numpy as np
from tqdm.auto import tqdm

from s2d_jax.config import ModelConfig, RopeScaling, first_layers, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.gguf_quants import SUPPORTED_TYPES, dequantize
from s2d_jax.model.params import (BY_PATH, active_params, hf_shape, params_from_stream,
                                  shape_of, to_ours)

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 rope scaling, stored as per-frequency factors


def is_gguf(path) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py): HF rotate-half rows -> interleaved."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_rope_rows`: llama.cpp's interleaved rows -> HF rotate-half."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --- the file ----------------------------------------------------------------------------

class GGUFFile:
    """An opened, checked GGUF file: metadata by key and tensors by name."""

    def __init__(self, path: str):
        self.path = path = os.fspath(path)
        if not os.path.isfile(path):
            raise S2DError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != _MAGIC:
            raise S2DError(f"{path} is not a GGUF file (no GGUF magic); pass a llama.cpp "
                           f".gguf model file")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError/IndexError/... on short data
            raise S2DError(f"cannot read GGUF file {path} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'damaged header'}); the "
                           f"file is truncated or damaged, download it again") from e
        size = os.path.getsize(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise S2DError(f"GGUF file {path} is truncated (tensor {t.name} ends past the "
                               f"end of the file); download it again")

    def get(self, key: str, default=None):
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape (GGUF lists dims innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return dequantize(t.data, t.tensor_type, self.shape(name))


def _required(f: GGUFFile, key: str):
    value = f.get(key)
    if value is None:
        raise S2DError(f"{f.path} has no metadata key {key}; it is not a complete llama GGUF, "
                       f"re-convert it with llama.cpp's convert_hf_to_gguf.py")
    return value


def _rope_scaling(f: GGUFFile, arch: str, head_dim: int, theta: float) -> RopeScaling:
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    factor = f.get(f"{arch}.rope.scaling.factor", f.get(f"{arch}.rope.scale_linear"))
    if ROPE_FREQS in f.tensors:
        return _llama3_scaling(f, head_dim, theta)
    if kind in ("none", "linear"):  # old files give only rope.scale_linear, no type
        if factor is None or float(factor) == 1.0:
            return RopeScaling()
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise S2DError(f"{f.path}: rope scaling type {kind!r} is not supported (only linear and "
                   f"Llama 3.1 scaling); use a model without it")


def _llama3_scaling(f: GGUFFile, head_dim: int, theta: float) -> RopeScaling:
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors; find the
    (factor, low, high, original length) that produce them (Meta's released settings)."""
    got = f.tensor(ROPE_FREQS).astype(np.float64)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    factor = float(got.max())
    for low, high, old in ((1.0, 4.0, 8192),):
        smooth = (old / wavelen - low) / (high - low)
        want = np.where(wavelen < old / high, 1.0, np.where(
            wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if got.shape == want.shape and np.allclose(got, want, rtol=1e-4):
            return RopeScaling(rope_type="llama3", factor=factor, low_freq_factor=low,
                               high_freq_factor=high, original_max_position_embeddings=old)
    raise S2DError(f"{f.path}: its {ROPE_FREQS} rope factors match no Llama 3 rope scaling "
                   f"setting; convert the original HF model instead")


def gguf_model_config(f: GGUFFile) -> ModelConfig:
    """ModelConfig from the metadata (llama architecture only); float32 params."""
    arch = f.get("general.architecture")
    if arch != "llama":
        raise S2DError(f"{f.path} has architecture {arch!r}; only 'llama' GGUF files (Llama, "
                       f"Mistral-style, SmolLM2, TinyLlama, ...) are supported")
    heads = int(_required(f, "llama.attention.head_count"))
    hidden = int(_required(f, "llama.embedding_length"))
    head_dim = int(f.get("llama.attention.key_length") or hidden // heads)
    rope_dim = f.get("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise S2DError(f"{f.path}: rope covers {rope_dim} of {head_dim} head dims (partial "
                       f"rotary); only full-head rope is supported")
    embed = BY_PATH["embed"].gguf
    if embed not in f.tensors:
        raise S2DError(f"{f.path} has no {embed}; it is not a llama model file")
    theta = float(f.get("llama.rope.freq_base", 10000.0))
    return ModelConfig(
        vocab_size=f.shape(embed)[0],
        hidden_size=hidden,
        intermediate_size=int(_required(f, "llama.feed_forward_length")),
        num_layers=int(_required(f, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(f.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(f.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(f, "llama", head_dim, theta),
        max_position_embeddings=int(f.get("llama.context_length", 4096)),
        tie_word_embeddings=BY_PATH["lm_head"].gguf not in f.tensors,
        bos_token_id=int(f.get("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(f.get("tokenizer.ggml.eos_token_id", 2)),
    )


def _check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Fail before reading any data: missing, unknown, misshapen or undecodable tensors."""
    expected = {}
    for row in active_params(cfg):
        for i in range(cfg.num_layers) if row.stacked else [None]:
            expected[row.gguf.format(i=i)] = hf_shape(shape_of(row, cfg), row.n_in)
    missing = [n for n in expected if n not in f.tensors]
    if missing:
        raise S2DError(f"{f.path} has no tensor {missing[0]} (of {len(missing)} missing); "
                       f"the file is not a complete llama model")
    unknown = sorted(set(f.tensors) - set(expected) - {ROPE_FREQS})
    if unknown:
        raise S2DError(f"{f.path} has tensor {unknown[0]}, which a bias-free Llama does not "
                       f"use; only plain llama-architecture models are supported")
    for name, want in expected.items():
        if f.shape(name) != want:
            raise S2DError(f"{f.path}: {name} has shape {f.shape(name)} but the metadata "
                           f"implies {want}; the file's metadata and tensors disagree")
        qtype = f.tensors[name].tensor_type
        if qtype not in SUPPORTED_TYPES:
            raise S2DError(f"{f.path}: tensor {name} has type {qtype.name}, which cannot be "
                           f"dequantized here (supported: "
                           f"{', '.join(t.name for t in SUPPORTED_TYPES)}); re-quantize it with "
                           f"llama-quantize, e.g. to Q8_0 or Q4_K_M")


def read_gguf_config(path: str) -> ModelConfig:
    """The ModelConfig of a GGUF file, checked against its tensors; reads no weights."""
    f = GGUFFile(path)
    cfg = gguf_model_config(f)
    _check_tensors(f, cfg)
    return cfg


# --- params ------------------------------------------------------------------------------

def _hf_layout(f: GGUFFile, cfg: ModelConfig, path: str, name: str) -> np.ndarray:
    x = f.tensor(name)
    if path == "layers/wq":
        return unpermute_rope_rows(x, cfg.num_heads)
    if path == "layers/wk":
        return unpermute_rope_rows(x, cfg.num_kv_heads)
    return x


def iter_gguf_params(path: str, num_layers: int | None = None, dtype=None
                     ) -> tuple[ModelConfig, dict, Iterator[tuple[str, np.ndarray]]]:
    """(cfg, extra, iterator of (our "/"-path, host array)), like `hf.iter_hf_params`.

    `num_layers` and `dtype` as `config.first_layers` and `config.with_dtype` (the stored
    dtype: float32, what every tensor type dequantizes to).
    """
    f = GGUFFile(path)
    cfg = gguf_model_config(f)
    _check_tensors(f, cfg)
    cfg = with_dtype(first_layers(cfg, num_layers, path), dtype, np.float32)
    dtype = cfg.param_dtype

    def generate():
        rows = active_params(cfg)
        total = sum(cfg.num_layers if r.stacked else 1 for r in rows)
        with tqdm(total=total, desc=f"dequantize {os.path.basename(path)}", unit="tensor",
                  leave=False, disable=None) as bar:
            for row in rows:
                shape = shape_of(row, cfg)
                out = np.empty(((cfg.num_layers,) if row.stacked else ()) + shape, dtype)
                for i in range(cfg.num_layers) if row.stacked else [None]:
                    x = to_ours(_hf_layout(f, cfg, row.path, row.gguf.format(i=i)),
                                shape, row.n_in)
                    if i is None:
                        out[...] = x
                    else:
                        out[i] = x
                    del x
                    bar.update()
                yield row.path, out
                del out

    return cfg, {}, generate()


def load_gguf(path: str, num_layers: int | None = None, dtype=None, shardings=None,
              host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from a GGUF file; each param goes to its devices when read
    (`shardings`: params-shaped tree of Shardings), or stays numpy if `host`."""
    cfg, extra, stream = iter_gguf_params(path, num_layers, dtype)
    return cfg, params_from_stream(stream, shardings, host), extra


# --- tokenizer ---------------------------------------------------------------------------

def gguf_tokenizer(path: str):
    """The HF fast tokenizer described by the GGUF metadata (transformers' conversion)."""
    from transformers import AutoTokenizer

    f = GGUFFile(path)  # one clear error for a bad file before transformers sees it
    if f.reader.get_field("tokenizer.ggml.tokens") is None:
        raise S2DError(f"{path} has no tokenizer (no tokenizer.ggml.tokens); pass --tokenizer "
                       f"DIR with the model's tokenizer files")
    path = os.path.abspath(path)
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path),
                                             local_files_only=True)
    except ImportError as e:  # transformers' GGUF reader imports torch, not in the core install
        try:
            return _tokenizer_from_metadata(f)
        except ImportError:
            raise S2DError(f"cannot build a tokenizer from {path}: this transformers version "
                           f"needs torch for it ({e}); pip install torch, or pass --tokenizer "
                           f"DIR") from None
    except Exception as e:  # transformers raises assorted types for tokenizers it lacks
        raise S2DError(f"cannot build a tokenizer from {path} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); pass --tokenizer DIR")


def _tokenizer_from_metadata(f: GGUFFile):
    """transformers' own GGUF tokenizer conversion (transformers >= 5), fed with metadata
    read by the gguf package instead of transformers' reader, which needs torch."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS, convert_gguf_tokenizer)

    grouped = {group: {name: f.get(f"tokenizer.{key}") for key, name in renames.items()
                       if f.get(f"tokenizer.{key}") is not None}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokens.get("tokenizer_type") == "llama":  # as transformers' get_gguf_tokenizer
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = f.get(f"tokenizer.ggml.{key}")
        config[name] = tokens["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(f.get("general.architecture"), tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def save_gguf_tokenizer(path: str, out_dir: str) -> None:
    """tokenizer.json + tokenizer_config.json (chat template included) in `out_dir`."""
    gguf_tokenizer(path).save_pretrained(out_dir, save_jinja_files=False)
