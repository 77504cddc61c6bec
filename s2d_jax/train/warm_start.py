"""A training run that survives a lost machine: with no checkpoint to resume (its
checkpoint.dir gone with the machine's disk), the draft starts from the last committed
draft weights (`model.init_from`: a draft pack such as models/smollm2-draft, or an HF
draft dir) instead of the target's first layers.

What the committed weights do not hold is lost, and the run says so: the optimizer's
moments (Adam m and v, restarted at zero), the step count (the learning-rate schedule
restarts with its warmup) and the data position (the data order restarts); a pack's int8
layers come back dequantized, not as the float32 weights that were trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError

LOST = ("the optimizer moments (Adam m, v: restarted at zero), the step count (the "
        "learning-rate schedule restarts with its warmup) and the data position")


def committed_weights(path: str) -> tuple[ModelConfig, dict, str]:
    """(cfg, {"layers": stacked [P, ...] arrays, "final_norm"}, how they are stored) of a
    draft pack or an HF / orbax draft dir: the draft's own weights, not the target's."""
    from s2d_jax.io import draft_pack
    from s2d_jax.io.checkpoint import checkpoint_kind, load_model
    if checkpoint_kind(path) == "draft-pack":
        cfg, _, sidecar = draft_pack.read_pack_config(path)
        own = draft_pack._pack_layers(path, cfg)
        return cfg, own, f"draft pack, {sidecar.get('weights', 'float')} weights"
    cfg, params, _ = load_model(path, dtype="float32")
    return cfg, {"layers": jax.device_get(params["layers"]),
                 "final_norm": jax.device_get(params["final_norm"])}, "float32 weights"


# What a committed draft must share with the draft it starts (its depth may differ).
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
         "head_dim")


def check_committed(path: str, cfg: ModelConfig, flag: str = "model.init_from") -> ModelConfig:
    """The committed draft at `path` (its config only, no weight read) fits a draft of
    shape `cfg`, else one S2DError naming `flag`: run before anything is written, so a bad
    path is refused before a run's dirs and plan exist (warm_start would find it only
    after them). Returns the committed draft's config."""
    from s2d_jax.io.checkpoint import stored_model_config
    saved = stored_model_config(path)
    _check_shape(saved, cfg, path, flag)
    return saved


def _check_shape(saved: ModelConfig, cfg: ModelConfig, path: str, flag: str) -> None:
    # the first shape key that differs (not its name or dtype, which may differ freely)
    diff = next((k for k in SHAPE if getattr(saved, k) != getattr(cfg, k)), None)
    if diff is not None:
        raise S2DError(f"{flag} {path} is a draft of another shape ({diff} "
                       f"{getattr(saved, diff)}, this draft has {getattr(cfg, diff)}); "
                       f"give a draft of this target, or drop {flag}")


# A layer's writes to the residual stream: zeroed, the layer is the identity.
RESIDUAL_OUTPUTS = ("wo", "w_down")


def warm_start(params: dict, cfg: ModelConfig, path: str, log=print, lost: str = LOST,
               why: str = "", deeper: str = "target") -> dict:
    """`params` (the draft initialised from its target) with its first layers and final
    norm replaced by the committed draft's at `path`; the deeper layers a deeper draft
    adds keep the target's weights, with `deeper="identity"` their residual outputs
    zeroed (each added layer starts as the identity, the deepest exit as the committed
    draft's deepest). Logs what is kept and what is `lost`."""
    saved_cfg, own, how = committed_weights(path)
    _check_shape(saved_cfg, cfg, path, "model.init_from")
    n = min(saved_cfg.num_layers, cfg.num_layers)
    layers = {}
    for name, w in params["layers"].items():
        new = np.asarray(own["layers"][name][:n], np.float32)
        added = jnp.zeros_like(w[n:]) if deeper == "identity" and name in RESIDUAL_OUTPUTS \
            else w[n:]
        merged = jnp.concatenate([jnp.asarray(new, w.dtype), added]) if n < w.shape[0] \
            else jnp.asarray(new, w.dtype)
        layers[name] = jax.device_put(merged, w.sharding)
    norm = params["final_norm"]
    out = {**params, "layers": layers,
           "final_norm": jax.device_put(jnp.asarray(own["final_norm"], norm.dtype),
                                        norm.sharding)}
    log(f"[warm start] no checkpoint to resume: layers 1-{n} and the final norm from the "
        f"committed draft {path} ({how}{', ' + why if why else ''})"
        + (f", layers {n + 1}-{cfg.num_layers} from the target"
           + (" with wo and w_down zeroed (each the identity)" if deeper == "identity" else "")
           if n < cfg.num_layers else "")
        + f"; lost: {lost}")
    return out
