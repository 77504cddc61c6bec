"""s2d-jax: sorted speculative decoding (S2D) of Llama-family models in JAX.

The public API, imported on first use (PEP 562), so `import s2d_jax.errors` stays cheap:

    import s2d_jax
    out = s2d_jax.generate("ROMEO:", target="models/demo/target-l", draft="models/demo/draft")
    chat = s2d_jax.Chat("~/.cache/s2d-jax/SmolLM2-135M-Instruct", "models/smollm2-draft")
    chat.say("Why is the sky blue?")["text"]; chat.say("And at sunset?")["text"]
    cfg, params, extra = s2d_jax.load_model("models/demo/target-s")
    decoder = s2d_jax.Decoder(cfg, params, method="ar")          # one target
    engine = s2d_jax.Engine({"s": s2d_jax.TargetSpec(cfg, params)}, ...)  # several targets
    s2d_jax.train_soft("configs/train/cpu_soft.yaml", ["optimizer.lr=1e-4"])

`s2d_jax.train` is the training subpackage; `train_soft` is the function that trains.
"""

from __future__ import annotations

import importlib
import os

# transformers (tokenizers and chat templates only) prints "PyTorch was not found" as an
# advisory on every import without torch, which the core install does not need
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# every command and API call reads compiled programs from disk from its second start on
# (JAX's persistent compilation cache, $S2D_COMPILE_CACHE: s2d_jax/compile_cache.py)
from s2d_jax import compile_cache as _compile_cache  # noqa: E402

_compile_cache.enable()

# public name -> (module, attribute)
_LAZY = {
    "S2DError": ("s2d_jax.errors", "S2DError"),
    "ModelConfig": ("s2d_jax.config", "ModelConfig"),
    "load_model": ("s2d_jax.io.checkpoint", "load_model"),
    "load_tokenizer": ("s2d_jax.io.tokenizer", "load_tokenizer"),
    "Chat": ("s2d_jax.decode.chat", "Chat"),
    "Decoder": ("s2d_jax.decode.serving", "Decoder"),
    "Engine": ("s2d_jax.decode.serving", "Engine"),
    "TargetSpec": ("s2d_jax.decode.serving", "TargetSpec"),
    "load_train_config": ("s2d_jax.train.config", "load_train_config"),
}

__all__ = sorted([*_LAZY, "generate", "serve", "train_soft"])


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later look-ups skip __getattr__
        return value
    raise AttributeError(f"module 's2d_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def generate(prompt, target: str, draft: str | None = None, *, method: str = "auto",
             chat_template: str = "auto", max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, gamma: int | None = None,
             thresholds=None, exit: int | None = None, exits=None,
             dtype: str | None = None, stop=None, stream: bool = False):
    """Answer a prompt -> {"text", "token_ids", "prompt_ids", "reply", "stats", "summary"}.

    prompt: a string (one user turn) or chat messages ([{"role": "user", "content": ...},
    {"role": "assistant", ...}, ...], optionally a "system" one first; the last turn is
    answered in the context of the others). chat_template "auto" renders them in the
    tokenizer's own template when it has one (else the text as is after BOS), "vicuna" or
    "none". target / draft: HF dirs, params checkpoints or GGUF files; `~` and `$VARS` are
    expanded. method: "auto" (the method the target's calibration chose, else "s2d":
    s2d_jax/decode/auto_method.py), "s2d" (escalating over the draft's exits), "sd" (the draft cut at
    `exit`), "self" (the target's first `exit` layers), "lookup" (tokens copied from the
    context, no draft), "ladder" (the lookup, then the draft's exits) or "ar"; s2d's gamma and thresholds
    default to the target's calibrated `s2d_serving.json` (s2d_jax.decode.chat.load_decoder).
    "summary" is the statistics as one readable line; "finish_reason" is "stop" (an EOS or
    a stop string) or "length" (max_new_tokens). Loads and compiles on every call: keep a
    `Chat` for a conversation or repeated use.

    A list of prompts (strings or message lists) -> one result each, decoded together on
    the slot engine (s2d_jax/server/). stop: a string or up to 4, each ending the answer
    (left out of it). stream=True -> an iterator of {"index": i, "text": piece} as answer
    i grows and {"index": i, "result": dict} when it ends. These three run on the slot
    engine (no top_k there); a greedy answer is the same either way.
    """
    from s2d_jax.decode.chat import Chat
    from s2d_jax.errors import S2DError

    from s2d_jax.server.batch import generate_batch, is_prompt_list

    if not isinstance(prompt, (str, list, tuple)):
        raise S2DError(f"prompt must be a string, a list of chat messages or a list of "
                       f"prompts, got {type(prompt).__name__}")
    from s2d_jax import validate
    validate.switch(stream, "stream")
    many = is_prompt_list(prompt)
    if many or stop is not None or stream:
        if top_k:
            raise S2DError("top_k is not available with a list of prompts, stop or stream "
                           "(the slot engine samples with temperature and top_p); use 0")
        out = generate_batch(list(prompt) if many else [prompt], target, draft,
                             method=method, chat_template=chat_template,
                             max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, seed=seed, stop=() if stop is None else stop, stream=stream,
                             gamma=gamma, thresholds=thresholds, exit=exit, exits=exits,
                             dtype=dtype)
        return out if many or stream else out[0]
    chat = Chat(target, draft, method=method, chat_template=chat_template, gamma=gamma,
                thresholds=thresholds, exit=exit, exits=exits, dtype=dtype,
                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, seed=seed)
    out = chat.answer(prompt)
    ended = bool(out["token_ids"]) and out["token_ids"][-1] == chat.eos_id
    return {**out, "finish_reason": "stop" if ended else "length"}


def train_soft(config, overrides=(), *, devices=None, progress: bool = False) -> dict:
    """Train a sorted draft with SoFT (or a plain LM with one exit), as `python -m train.soft`.

    config: a training YAML path or a TrainConfig; overrides: `key=value` strings (with a
    YAML path). devices: those of the mesh (default all; their count = the mesh's size).
    Returns the loop's summary (e.g. "history": per-step metrics).
    """
    from s2d_jax import validate
    from s2d_jax.errors import S2DError
    from s2d_jax.train.config import TrainConfig, load_train_config
    from s2d_jax.train.loop import train

    overrides = validate.strings_list(overrides, "overrides")
    validate.switch(progress, "progress")
    if devices is not None and (isinstance(devices, (str, bytes))
                                or not hasattr(devices, "__iter__")):
        raise S2DError(f"devices must be a list of jax devices (or None), got "
                       f"{type(devices).__name__}")
    if not isinstance(config, TrainConfig):
        config = validate.path(config, "config")
    if isinstance(config, TrainConfig):
        if overrides:
            raise S2DError("overrides apply to a YAML path; pass the TrainConfig already "
                           "changed (dataclasses.replace) or a path")
        tc = config
    else:
        tc = load_train_config(config, overrides)
    return train(tc, devices=devices, progress=progress)


def serve(target: str, draft: str | None = None, *, method: str = "auto",
          host: str = "127.0.0.1", port: int = 8000, block: bool = True, **settings):
    """Serve `target` (with `draft`) over HTTP, OpenAI-compatible, as `python -m infer.serve`:
    /v1/chat/completions, /v1/completions, /v1/models, /health, continuous batching over
    `slots` decode slots (s2d_jax/server/). settings: name, gamma, thresholds, exit, exits,
    dtype, chat_template, slots, max_len, chunk_rounds, max_queue, default_max_tokens,
    max_body_bytes (a larger request body is a 413; default 4 MiB), seed. The port is
    bound before anything loads. block=False returns the started Server (its .url; .stop() ends it)."""
    from s2d_jax import validate
    from s2d_jax.server.launch import build_server

    validate.switch(block, "block")
    server = build_server(target, draft, method=method, host=host, port=port, **settings)
    if not block:
        return server.start()
    server.run()
    return server
