"""The one table of a Llama-family model's parameters: path, logical axes, init, HF and
GGUF names; and the layout helpers that read it (HF's `[out, in]` <-> ours, "/"-paths, the
params dict of a streaming loader).

Every other view of the params is read from `PARAMS`: `param_init.py` creates each
parameter from its row, `param_shapes` sizes it, the logical axes
become its sharding through `parallel/mesh.py`'s rules, `io/hf.py` maps it to and from
its HF tensor and `io/gguf.py` reads it from its GGUF tensor. A row's shape is its
logical axes' sizes, so the axes are also the shape's documentation.

Decoder-block rows (`layers/...`) list the axes of ONE layer; the stack adds a leading
"layers" axis (and `{i}` in the HF and GGUF names is the layer index).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from s2d_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # "/"-separated path in the params dict ("layers/wq")
    axes: tuple[str, ...]  # logical axis names (per layer for stacked params)
    init: str  # "normal" (normal(std)) or "ones"
    hf: str  # HF LlamaForCausalLM state-dict name
    gguf: str  # llama.cpp GGUF tensor name (same layout as HF's up to the rope row order)
    # Linear weight: number of leading input (contracted) axes in our layout. HF stores a
    # linear weight as [out, in]; we store [in..., out...] with heads split out. None: the
    # tensor has the same layout in both.
    n_in: int | None = None

    @property
    def stacked(self) -> bool:
        return self.path.startswith("layers/")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


_HF = "model.layers.{i}."  # HF name prefix of a decoder layer's tensors
_GG = "blk.{i}."  # GGUF name prefix of a decoder layer's tensors
PARAMS = (
    Param("embed", ("vocab", "embed"), "normal", "model.embed_tokens.weight", "token_embd.weight"),
    Param("layers/attn_norm", ("norm",), "ones", _HF + "input_layernorm.weight",
          _GG + "attn_norm.weight"),
    Param("layers/wq", ("embed", "heads", "head_dim"), "normal", _HF + "self_attn.q_proj.weight",
          _GG + "attn_q.weight", 1),
    Param("layers/wk", ("embed", "kv_heads", "head_dim"), "normal",
          _HF + "self_attn.k_proj.weight", _GG + "attn_k.weight", 1),
    Param("layers/wv", ("embed", "kv_heads", "head_dim"), "normal",
          _HF + "self_attn.v_proj.weight", _GG + "attn_v.weight", 1),
    Param("layers/wo", ("heads", "head_dim", "embed"), "normal", _HF + "self_attn.o_proj.weight",
          _GG + "attn_output.weight", 2),
    Param("layers/mlp_norm", ("norm",), "ones", _HF + "post_attention_layernorm.weight",
          _GG + "ffn_norm.weight"),
    Param("layers/w_gate", ("embed", "mlp"), "normal", _HF + "mlp.gate_proj.weight",
          _GG + "ffn_gate.weight", 1),
    Param("layers/w_up", ("embed", "mlp"), "normal", _HF + "mlp.up_proj.weight",
          _GG + "ffn_up.weight", 1),
    Param("layers/w_down", ("mlp", "embed"), "normal", _HF + "mlp.down_proj.weight",
          _GG + "ffn_down.weight", 1),
    Param("final_norm", ("norm",), "ones", "model.norm.weight", "output_norm.weight"),
    Param("lm_head", ("embed", "vocab"), "normal", "lm_head.weight", "output.weight", 1),
)
BY_PATH = {p.path: p for p in PARAMS}
LAYER_PARAMS = tuple(p for p in PARAMS if p.stacked)


def active_params(cfg: ModelConfig) -> tuple[Param, ...]:
    """The rows this config has (a tied-embedding model has no lm_head)."""
    return tuple(p for p in PARAMS if not (p.path == "lm_head" and cfg.tie_word_embeddings))


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"layers": cfg.num_layers, "vocab": cfg.vocab_size, "embed": cfg.hidden_size,
            "norm": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}


def shape_of(p: Param, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of ONE layer's slice (stacked rows) or of the whole tensor."""
    sizes = axis_sizes(cfg)
    return tuple(sizes[a] for a in p.axes)


def stored_shape(p: Param, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape as held in the params dict (stacked rows get the leading layer axis)."""
    return ((cfg.num_layers,) if p.stacked else ()) + shape_of(p, cfg)


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, as the same nested dict as the params."""
    shapes: dict = {}
    for p in active_params(cfg):
        if p.stacked:
            shapes.setdefault("layers", {})[p.name] = stored_shape(p, cfg)
        else:
            shapes[p.path] = stored_shape(p, cfg)
    return shapes


# --- layouts: HF's linear weight [out, in] <-> ours [in..., out...] -------------------------

def hf_shape(our_shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    """The HF (and GGUF) shape of a tensor that has `our_shape` here (a row's `n_in`)."""
    if n_in is None:
        return our_shape
    return (math.prod(our_shape[n_in:]), math.prod(our_shape[:n_in]))


def to_ours(x, our_shape, n_in):
    return x if n_in is None else x.T.reshape(our_shape)


def to_hf(y, n_in):
    return y if n_in is None else y.reshape(math.prod(y.shape[:n_in]), -1).T


# --- "/"-paths ("layers/wq") into a params dict ----------------------------------------------

def set_path(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def get_path(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def params_from_stream(stream, shardings=None, host: bool = False) -> dict:
    """The params dict of a stream of ("/"-path, host array) pairs (a streaming loader's),
    each put on its devices as soon as it arrives (`shardings`: a params-shaped tree of
    Shardings or ShapeDtypeStructs; None: the default device), or kept on host if `host`."""
    params: dict = {}
    for path, arr in stream:
        if not host:
            sharding = get_path(shardings, path) if shardings is not None else None
            arr = jax.device_put(arr, getattr(sharding, "sharding", sharding))
        set_path(params, path, arr)
    return params
