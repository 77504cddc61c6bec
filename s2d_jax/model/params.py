"""The one table of a Llama-family model's parameters: path, logical axes, init, HF name.

Every other view of the params is read from `PARAMS`: the Flax modules create each
parameter from its row (`transformer.py`), `param_shapes` sizes it, the logical axes
become its sharding through `parallel/mesh.py`'s rules, and `io/hf.py` maps it to and
from its HF tensor. A row's shape is its logical axes' sizes, so the axes are also the
shape's documentation.

Decoder-block rows (`layers/...`) list the axes of ONE layer; the stack adds a leading
"layers" axis (and `{i}` in the HF name is the layer index).
"""

from __future__ import annotations

import dataclasses

from s2d_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # "/"-separated path in the params dict ("layers/wq")
    axes: tuple[str, ...]  # logical axis names (per layer for stacked params)
    init: str  # "normal" (normal(std)) or "ones"
    hf: str  # HF LlamaForCausalLM state-dict name
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


PARAMS = (
    Param("embed", ("vocab", "embed"), "normal", "model.embed_tokens.weight"),
    Param("layers/attn_norm", ("norm",), "ones", "model.layers.{i}.input_layernorm.weight"),
    Param("layers/wq", ("embed", "heads", "head_dim"), "normal",
          "model.layers.{i}.self_attn.q_proj.weight", 1),
    Param("layers/wk", ("embed", "kv_heads", "head_dim"), "normal",
          "model.layers.{i}.self_attn.k_proj.weight", 1),
    Param("layers/wv", ("embed", "kv_heads", "head_dim"), "normal",
          "model.layers.{i}.self_attn.v_proj.weight", 1),
    Param("layers/wo", ("heads", "head_dim", "embed"), "normal",
          "model.layers.{i}.self_attn.o_proj.weight", 2),
    Param("layers/mlp_norm", ("norm",), "ones",
          "model.layers.{i}.post_attention_layernorm.weight"),
    Param("layers/w_gate", ("embed", "mlp"), "normal", "model.layers.{i}.mlp.gate_proj.weight", 1),
    Param("layers/w_up", ("embed", "mlp"), "normal", "model.layers.{i}.mlp.up_proj.weight", 1),
    Param("layers/w_down", ("mlp", "embed"), "normal", "model.layers.{i}.mlp.down_proj.weight", 1),
    Param("final_norm", ("norm",), "ones", "model.norm.weight"),
    Param("lm_head", ("embed", "vocab"), "normal", "lm_head.weight", 1),
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
