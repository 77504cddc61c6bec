"""A GGUF's own quantization kept: its Q8_0 / Q4_0 / Q4_1 matrices as `QuantizedWeight`s with
the same values (losslessly re-laid out, no re-quantization), and the "quantized model dir"
that stores them (written by `s2d fetch --quantized` / `s2d convert gguf-to-quantized`, read
by every loader through `checkpoint.load_model`).

The layout (`model/quantize.py`'s, contracted axes first: q [..., in, out]): a GGUF block covers
32 consecutive elements of a ggml row, which is the INPUT dim of a linear weight, so a block is
one group of 32 input rows of one output column:
    Q8_0 -> bits 8, group 32, q int8 [.., in, out], scale f16 [.., in/32, 1, out] (the file's
            d, kept in float16: half the bytes a step reads for scales), offset None; w = scale * q
    Q4_0 -> bits 4, group 32, q uint8 [.., in/2, out]: signed nibbles q - 8 in [-8, 7], row 2i
            in the low nibble, row 2i+1 in the high one (quantize._pack_int4), offset None
    Q4_1 -> bits 4, group 32, the same packing of UNSIGNED nibbles 0..15, offset = the f16 m
            (scale's shape); w = scale * q + offset, in float32 (float16 widens exactly)
The llama.cpp rope row order of attn_q / attn_k is undone by permuting output COLUMNS of q,
scale and offset (whole blocks move, none is split). Norms and tensors of other types (F16,
K-quants, ...) are dequantized to float32 as `io/gguf.py` does; a stacked matrix whose layers
mix types is float32 too.

The embedding stays a float32 table (the file's blocks dequantized: the same values as the
float32 path): a lookup reads one row per token, so a quantized table would save memory but
no time; a draft pack shares and fingerprints the target's float embedding and a draft's
sub-vocabulary head gathers its rows. A TIED head (SmolLM2) whose table is Q8_0/Q4_0/Q4_1 is
also kept as `params["lm_head"]`, a QuantizedWeight [D | V] of the same blocks, so the loaded
config is untied (`tie_word_embeddings=False`): the model is the same function (the head's
values are the table's), and the head, 21% of SmolLM2's weights and read in full every step,
is read quantized.

The quantized dir: config.json (HF keys, plus `s2d_quantization`: version, per-param GGML
type, whether the head is the tied table), `s2d_quantized.safetensors` (our "/"-path names:
`layers/wq.q`, `layers/wq.scale`, `layers/wq.offset`, `layers/attn_norm`, ...; a tied
table only once, as `lm_head.*`), the tokenizer files. transformers cannot load it (it finds
no model.safetensors, and says so) rather than loading random weights.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from s2d_jax.config import ModelConfig, first_layers, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.gguf import GGUFFile, _check_tensors, gguf_model_config, unpermute_rope_rows
from s2d_jax.model.params import BY_PATH, active_params, set_path, shape_of, to_ours

Q = GGMLQuantizationType
GROUP = 32  # elements of a Q8_0 / Q4_0 / Q4_1 block
SHIPPED_TYPES = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4}  # GGML type -> bits
QUANT_KEY = "s2d_quantization"  # config.json entry of a quantized dir
QUANT_FILE = "s2d_quantized.safetensors"
QUANT_VERSION = 1
FLOAT = "F32"  # the type name of a param stored as a float32 array


# --- blocks -> (q, scale, offset) --------------------------------------------------------

def block_parts(raw: np.ndarray, qtype: Q, shape: tuple[int, int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q, scale, offset) in our [in, out] layout of one GGUF linear weight of numpy shape
    `shape` = [out, in] stored as `qtype` blocks (`raw`: GGUFReader's bytes)."""
    n_out, n_in = shape
    if n_in % GROUP:
        raise ValueError(f"row of {n_in} elements is not whole {GROUP}-element blocks")
    blocks = np.asarray(raw).view(np.uint8).reshape(n_out, n_in // GROUP,
                                                    GGML_QUANT_SIZES[qtype][1])

    def f16(start):  # [out, in/32] -> [in/32, 1, out] float16, as stored
        d = blocks[..., start:start + 2].copy().view(np.float16)[..., 0]
        return np.ascontiguousarray(d.T[:, None, :])

    if qtype == Q.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(n_out, n_in)
        return np.ascontiguousarray(q.T), f16(0), None
    packed = blocks[..., 2:] if qtype == Q.Q4_0 else blocks[..., 4:]  # [out, in/32, 16]
    # byte j of a block: element j (low nibble), element j + 16 (high nibble)
    vals = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n_out, n_in)
    if qtype == Q.Q4_0:  # q - 8 as a 4-bit two's complement nibble
        vals = (vals.astype(np.int16) - 8).astype(np.uint8) & 0x0F
    vals = vals.T  # [in, out]
    q = np.ascontiguousarray(vals[0::2] | (vals[1::2] << 4))
    return q, f16(0), (f16(2) if qtype == Q.Q4_1 else None)


def dequantize_parts(q, scale, offset, bits: int) -> np.ndarray:
    """float32 [..., in, out] of (q, scale, offset) in numpy, the float arithmetic of ggml
    (and of `gguf_quants.dequantize`): scale * q (+ offset)."""
    if bits == 4:
        lo, hi = (q & 0x0F).astype(np.int8), (q >> 4).astype(np.int8)
        vals = np.stack([lo, hi], axis=-2).reshape(q.shape[:-2] + (2 * q.shape[-2], q.shape[-1]))
        if offset is None:
            vals = np.where(vals >= 8, vals - 16, vals).astype(np.int8)
    else:
        vals = q
    n_in, n_out = vals.shape[-2:]
    grouped = vals.reshape(vals.shape[:-2] + (n_in // GROUP, GROUP, n_out)).astype(np.float32)
    w = grouped * scale
    if offset is not None:
        w = w + offset
    return w.reshape(vals.shape[:-2] + (n_in, n_out))


# --- the GGUF file -> flat tensors --------------------------------------------------------

@dataclasses.dataclass
class Shipped:
    """A model's weights as the GGUF holds them: cfg (tied as in the file), the GGML type of
    each param ("Q4_1", ..., FLOAT), and flat host tensors by "/"-path name (+ ".q",
    ".scale", ".offset" for a quantized one). tied_head: params "lm_head" is the tied
    embedding table, stored once."""
    cfg: ModelConfig
    types: dict
    tensors: dict
    tied_head: bool = False


def _stack_type(f: GGUFFile, names: list[str]) -> Q | None:
    types = {f.tensors[n].tensor_type for n in names}
    return next(iter(types)) if len(types) == 1 and next(iter(types)) in SHIPPED_TYPES else None


def read_shipped(path: str, num_layers: int | None = None) -> Shipped:
    """The weights of a GGUF file with its Q8_0 / Q4_0 / Q4_1 matrices kept (block_parts),
    the rest dequantized to float32."""
    f = GGUFFile(path)
    cfg = gguf_model_config(f)
    _check_tensors(f, cfg)
    cfg = first_layers(cfg, num_layers, path)
    types, tensors = {}, {}
    tied_head = False
    for row in active_params(cfg):
        names = [row.gguf.format(i=i) for i in range(cfg.num_layers)] if row.stacked \
            else [row.gguf]
        qtype = _stack_type(f, names) if row.n_in else None
        if row.path == "embed" and cfg.tie_word_embeddings:
            qtype = _stack_type(f, names)
            if qtype is not None:  # the tied table, kept once as the (quantized) head
                tied_head, row = True, BY_PATH["lm_head"]
        if qtype is None:
            types[row.path] = FLOAT
            shape = shape_of(row, cfg)
            parts = [to_ours(_hf_layout(f, cfg, row.path, f.tensor(n)), shape, row.n_in)
                     for n in names]
            tensors[row.path] = np.stack(parts) if row.stacked else parts[0]
            continue
        types[row.path] = qtype.name
        per_layer = []
        for n in names:
            q, scale, offset = block_parts(f.tensors[n].data, qtype, f.shape(n))
            perm = _rope_columns(cfg, row.path, q.shape[-1])
            per_layer.append([None if x is None else x[..., perm] if perm is not None else x
                              for x in (q, scale, offset)])
        for part, k in zip(("q", "scale", "offset"), range(3)):
            if per_layer[0][k] is None:
                continue
            xs = [p[k] for p in per_layer]
            tensors[f"{row.path}.{part}"] = np.stack(xs) if row.stacked else xs[0]
    _check_finite(tensors, path)
    return Shipped(cfg, types, tensors, tied_head)


def _check_finite(tensors: dict, path: str) -> None:
    """Every float tensor (block scales and offsets, norms, float matrices) finite: a NaN or
    inf scale would turn its whole block's outputs, then every logit, into NaN."""
    for name, x in tensors.items():
        if np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)):
            raise S2DError(f"{path}: {name} holds NaN or inf values; the file is damaged, "
                           f"fetch or convert it again")


def _hf_layout(f: GGUFFile, cfg: ModelConfig, path: str, x: np.ndarray) -> np.ndarray:
    if path == "layers/wq":
        return unpermute_rope_rows(x, cfg.num_heads)
    if path == "layers/wk":
        return unpermute_rope_rows(x, cfg.num_kv_heads)
    return x


def _rope_columns(cfg: ModelConfig, path: str, n_out: int) -> np.ndarray | None:
    """The output-column order that undoes llama.cpp's rope row permutation (io/gguf.py's
    unpermute_rope_rows, as a gather index), or None for a weight without one."""
    heads = {"layers/wq": cfg.num_heads, "layers/wk": cfg.num_kv_heads}.get(path)
    return None if heads is None else unpermute_rope_rows(np.arange(n_out), heads)


# --- flat tensors -> params ----------------------------------------------------------------

def params_of(s: Shipped, dtype=None, host: bool = False) -> tuple[ModelConfig, dict]:
    """(cfg, params): QuantizedWeights for the quantized params, float arrays (cast to
    `dtype`, default float32) for the rest, a float32 embedding beside a tied quantized head
    (then the returned cfg is untied). On the default device unless `host`."""
    import jax
    import jax.numpy as jnp

    from s2d_jax.model.quantize import QuantizedWeight

    cfg = with_dtype(s.cfg, dtype, np.float32)
    ft = jnp.dtype(cfg.param_dtype)
    params: dict = {}
    rows = list(active_params(cfg))
    if s.tied_head:
        rows = [r for r in rows if r.path != "embed"] + [BY_PATH["lm_head"]]
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    for row in rows:
        kind = s.types[row.path]
        if kind == FLOAT:
            set_path(params, row.path, s.tensors[row.path].astype(ft))
            continue
        bits = SHIPPED_TYPES[Q[kind]]
        q, scale = s.tensors[f"{row.path}.q"], s.tensors[f"{row.path}.scale"]
        offset = s.tensors.get(f"{row.path}.offset")
        set_path(params, row.path, QuantizedWeight(
            q=q, scale=scale, shape=shape_of(row, cfg), group=GROUP, bits=bits, offset=offset))
        if s.tied_head and row.path == "lm_head":
            embed = dequantize_parts(q, scale, offset, bits).T  # [D, V] -> [V, D]
            params["embed"] = np.ascontiguousarray(embed).astype(ft)
    if not host:
        params = jax.tree.map(jnp.asarray, params)
    return cfg, params


def load_gguf_shipped(path: str, num_layers: int | None = None, dtype=None,
                      shardings=None, host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) of a GGUF file with its quantization kept (`load_gguf`'s
    counterpart; extra is empty)."""
    _no_shardings(shardings, path)
    return (*params_of(read_shipped(path, num_layers), dtype, host), {})


def _no_shardings(shardings, path) -> None:
    if shardings is not None:
        raise S2DError(f"{path}: weights kept quantized load on one device only (not yet "
                       f"sharded over a mesh); run it on one device, or use the float32 model")


# --- the quantized dir ---------------------------------------------------------------------

def is_quantized_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, QUANT_FILE))


def save_quantized_dir(s: Shipped, out_dir: str, tokenizer_dir: str | None = None,
                       overwrite: bool = False, source: str = "") -> None:
    """config.json (+ s2d_quantization) and s2d_quantized.safetensors, atomically."""
    from s2d_jax.io.atomic import atomic_output_dir
    from s2d_jax.io.hf_files import write_safetensors
    from s2d_jax.io.outputs import HF_DIR
    from s2d_jax.io.tokenizer import tokenizer_files
    import shutil

    tok_files = tokenizer_files(tokenizer_dir, required=True)
    meta = {"version": QUANT_VERSION, "group": GROUP, "types": s.types,
            "tied_head": s.tied_head, "source": os.path.basename(source)}
    hf_config = {**s.cfg.to_hf_config(), "torch_dtype": "float32", QUANT_KEY: meta}
    with atomic_output_dir(out_dir, overwrite, HF_DIR) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_config, fh, indent=2)
        write_safetensors({k: np.ascontiguousarray(v) for k, v in s.tensors.items()},
                          os.path.join(tmp, QUANT_FILE))
        for p in tok_files:
            shutil.copy2(p, tmp)


def read_quantized_dir(path: str, num_layers: int | None = None) -> Shipped:
    from safetensors.numpy import load_file

    from s2d_jax.io.hf import read_hf_model_config

    cfg, extra = read_hf_model_config(path)
    meta = extra.get(QUANT_KEY)
    if not isinstance(meta, dict) or meta.get("version") != QUANT_VERSION \
            or meta.get("group") != GROUP or not isinstance(meta.get("types"), dict):
        raise S2DError(f"{path}: config.json's {QUANT_KEY} is missing or not version "
                       f"{QUANT_VERSION}; re-create the dir with s2d convert "
                       f"gguf-to-quantized")
    try:
        tensors = load_file(os.path.join(path, QUANT_FILE))
    except Exception as e:  # safetensors raises its own types for damaged files
        raise S2DError(f"cannot read {path}/{QUANT_FILE} ({type(e).__name__}: {e}); "
                       f"re-create the dir") from None
    cfg = first_layers(cfg, num_layers, path)
    types = dict(meta["types"])
    if num_layers is not None:
        tensors = {k: (v[:num_layers] if k.startswith("layers/") else v)
                   for k, v in tensors.items()}
    _check_shapes(cfg, types, tensors, bool(meta.get("tied_head")), path)
    _check_finite(tensors, path)
    return Shipped(cfg, types, tensors, bool(meta.get("tied_head")))


def _check_shapes(cfg, types, tensors, tied_head, path) -> None:
    rows = list(active_params(cfg))
    if tied_head:
        rows = [r for r in rows if r.path != "embed"] + [BY_PATH["lm_head"]]
    for row in rows:
        lead = (cfg.num_layers,) if row.stacked else ()
        shape = shape_of(row, cfg)
        kind = types.get(row.path)
        if kind != FLOAT and kind not in {t.name for t in SHIPPED_TYPES}:
            raise S2DError(f"{path}: {QUANT_KEY} gives {row.path} the type {kind!r}; "
                           f"re-create the dir")
        if kind == FLOAT:
            want = {row.path: lead + shape}
        else:
            n_in = int(np.prod(shape[:row.n_in]))
            n_out = int(np.prod(shape[row.n_in:]))
            bits = SHIPPED_TYPES[Q[types[row.path]]]
            want = {f"{row.path}.q": lead + ((n_in if bits == 8 else n_in // 2), n_out),
                    f"{row.path}.scale": lead + (n_in // GROUP, 1, n_out)}
            if types[row.path] == "Q4_1":
                want[f"{row.path}.offset"] = lead + (n_in // GROUP, 1, n_out)
        for k, shp in want.items():
            if k not in tensors or tuple(tensors[k].shape) != shp:
                got = None if k not in tensors else tuple(tensors[k].shape)
                raise S2DError(f"{path}/{QUANT_FILE}: {k} is {got or 'missing'}, config.json "
                               f"implies {shp}; re-create the dir")


def load_quantized_dir(path: str, num_layers: int | None = None, dtype=None, shardings=None,
                       host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) of a quantized dir (`load_model`'s reader for one)."""
    from s2d_jax.io.hf import read_hf_model_config

    _no_shardings(shardings, path)
    extra = {k: v for k, v in read_hf_model_config(path)[1].items() if k != QUANT_KEY}
    return (*params_of(read_quantized_dir(path, num_layers), dtype, host), extra)
