"""s2d-jax: sorted speculative decoding (S2D) of Llama-family models in JAX.

The public API, imported on first use (PEP 562), so `import s2d_jax.errors` stays cheap:

    import s2d_jax
    out = s2d_jax.generate("ROMEO:", target="models/demo/target-l", draft="models/demo/draft")
    cfg, params, extra = s2d_jax.load_model("models/demo/target-s")
    decoder = s2d_jax.Decoder(cfg, params, method="ar")          # one target
    engine = s2d_jax.Engine({"s": s2d_jax.TargetSpec(cfg, params)}, ...)  # several targets
    s2d_jax.train_soft("configs/train/cpu_soft.yaml", ["optimizer.lr=1e-4"])

`s2d_jax.train` is the training subpackage; `train_soft` is the function that trains.
"""

from __future__ import annotations

import importlib

# public name -> (module, attribute)
_LAZY = {
    "S2DError": ("s2d_jax.errors", "S2DError"),
    "ModelConfig": ("s2d_jax.config", "ModelConfig"),
    "load_model": ("s2d_jax.io.checkpoint", "load_model"),
    "load_tokenizer": ("s2d_jax.io.tokenizer", "load_tokenizer"),
    "Decoder": ("s2d_jax.decode.serving", "Decoder"),
    "Engine": ("s2d_jax.decode.serving", "Engine"),
    "TargetSpec": ("s2d_jax.decode.serving", "TargetSpec"),
    "load_train_config": ("s2d_jax.train.config", "load_train_config"),
}

__all__ = sorted([*_LAZY, "generate", "train_soft"])


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later look-ups skip __getattr__
        return value
    raise AttributeError(f"module 's2d_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def generate(prompt: str, target: str, draft: str | None = None, *, method: str = "s2d",
             max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             gamma: int | None = None, thresholds=None, exit: int | None = None,
             dtype: str | None = None) -> dict:
    """Generate from one text prompt (no chat template) -> {"text", "token_ids", "stats"}.

    target / draft: HF dirs or params checkpoints. method: "s2d" (escalating over the
    draft's `s2d_exits`), "sd" (the draft cut at `exit`, default its depth), "self" (the
    target's first `exit` layers) or "ar". For s2d, gamma and thresholds default to the
    target's calibrated `s2d_serving.json` when it matches the draft's exits, else gamma 4
    and 0.5 per exit (0 at the last). Builds and compiles a Decoder on every call: keep a
    `Decoder` for repeated use.
    """
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.decode.serving_config import load_serving_config
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.errors import S2DError
    from s2d_jax.io.checkpoint import has_tokenizer, load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    cfg, params, _ = load_model(target, dtype=dtype)
    tok = load_tokenizer(target)
    draft_cfg = draft_params = draft_tok = None
    exits, stop = None, 0.0
    if method in ("sd", "s2d"):
        if draft is None:
            raise S2DError(f"method {method} needs a draft model; pass draft=PATH")
        from s2d_jax.io.draft_pack import load_draft
        draft_cfg, draft_params, extra = load_draft(draft, params, dtype=dtype)
        draft_tok = load_tokenizer(draft) if has_tokenizer(draft) else None
        if method == "sd":
            exits = [exit or draft_cfg.num_layers]
        else:
            exits = list(draft_exits(extra, draft_cfg))
            served = load_serving_config(target, min(cfg.max_position_embeddings,
                                                     draft_cfg.max_position_embeddings))
            if served is not None and served.get("exits"):
                exits = list(served["exits"])
            if served is not None and thresholds is None:
                thresholds = served["thresholds"]
                gamma = served["gamma"] if gamma is None else gamma
                stop = served["stop_threshold"]
    elif method == "self":
        exits = [exit] if exit else None
    if exits is not None and thresholds is None:
        thresholds = [0.5] * (len(exits) - 1) + [0.0]
    decoder = Decoder(cfg, params, method=method, draft_cfg=draft_cfg,
                      draft_params=draft_params, exits=exits,
                      gamma=4 if gamma is None else gamma, thresholds=thresholds,
                      target_tokenizer=tok, draft_tokenizer=draft_tok, stop_threshold=stop)
    out, = decoder.generate([tok.encode(prompt, bos=True)], max_new_tokens=max_new_tokens,
                            temperature=temperature, seed=seed,
                            eos_id=tok.eos_id if tok.eos_id is not None else -1)
    return {"text": tok.decode(out["token_ids"]), "token_ids": out["token_ids"],
            "stats": out["stats"]}


def train_soft(config, overrides=(), *, devices=None, progress: bool = False) -> dict:
    """Train a sorted draft with SoFT (or a plain LM with one exit), as `python -m train.soft`.

    config: a training YAML path or a TrainConfig; overrides: `key=value` strings (with a
    YAML path). devices: those of the mesh (default all; their count = the mesh's size).
    Returns the loop's summary (e.g. "history": per-step metrics).
    """
    from s2d_jax.errors import S2DError
    from s2d_jax.train.config import TrainConfig, load_train_config
    from s2d_jax.train.loop import train

    if isinstance(config, TrainConfig):
        if overrides:
            raise S2DError("overrides apply to a YAML path; pass the TrainConfig already "
                           "changed (dataclasses.replace) or a path")
        tc = config
    else:
        tc = load_train_config(config, overrides)
    return train(tc, devices=devices, progress=progress)
