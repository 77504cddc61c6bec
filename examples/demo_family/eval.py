"""Sanity numbers for the demo family on the held-out split (the `eval` stage).

Per model: mean next-token NLL and perplexity over every held-out token (packed batches,
the training data pipeline without shuffling). Per draft exit: its own NLL, and how often
its greedy next token equals each target's greedy next token (what greedy speculative
decoding accepts, position by position, given the true prefix). Plus a few greedy
samples from `transformers` (which also checks the exported dirs load there).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from s2d_jax.decode.defaults import draft_exits
from s2d_jax.io.checkpoint import load_model
from s2d_jax.model.sorted_draft import multi_exit_logits


@functools.partial(jax.jit, static_argnums=(1, 2))
def _exit_stats(params, cfg, exits, batch):
    """Per exit: (sum of masked CE, greedy ids [B, T])."""
    logits = multi_exit_logits(params, cfg, exits, batch["inputs"], batch["positions"],
                               batch["segment_ids"])
    ce = [jnp.sum(optax.softmax_cross_entropy_with_integer_labels(lg, batch["targets"])
                  * batch["loss_mask"]) for lg in logits]
    return jnp.stack(ce), jnp.stack([jnp.argmax(lg, -1) for lg in logits])


def heldout_batches(heldout_path: str, tokenizer_dir: str, seq_len: int = 256,
                    batch_size: int = 8) -> list[dict]:
    from s2d_jax.data.pipeline import DataConfig, load_iterator
    cfg = DataConfig(paths=(heldout_path,), format="text", tokenizer=tokenizer_dir,
                     seq_len=seq_len, batch_size=batch_size, packing=True, shuffle=False,
                     num_epochs=1)
    return list(load_iterator(cfg, 0, 1))


def evaluate(model_dirs: dict[str, str], draft_dir: str | None, heldout_path: str,
             seq_len: int = 256, batch_size: int = 8) -> dict:
    """{"tokens", "models": {name: {nll, ppl}}, "draft": {exit: {nll, ppl, agree: {t: acc}}}}."""
    loaded = {}
    for name, path in {**model_dirs, **({"draft": draft_dir} if draft_dir else {})}.items():
        cfg, params, extra = load_model(path, dtype="float32")
        exits = draft_exits(extra, cfg)
        loaded[name] = (cfg, params, exits)
    tok_dir = next(iter(model_dirs.values())) if model_dirs else draft_dir
    batches = heldout_batches(heldout_path, tok_dir, seq_len, batch_size)
    ce = {n: np.zeros(len(e)) for n, (_, _, e) in loaded.items()}
    agree = {t: np.zeros(len(loaded["draft"][2])) for t in model_dirs} if draft_dir else {}
    n_tokens = 0.0
    for b in batches:
        mask = b["loss_mask"]
        n_tokens += float(mask.sum())
        greedy = {}
        for name, (cfg, params, exits) in loaded.items():
            s, ids = jax.device_get(_exit_stats(params, cfg, exits, b))
            ce[name] += s
            greedy[name] = ids
        for t in agree:
            agree[t] += ((greedy["draft"] == greedy[t][-1]) * mask).sum(axis=(1, 2))
    out = {"tokens": int(n_tokens), "models": {}, "draft": {}}
    for name, (_, _, exits) in loaded.items():
        nll = ce[name] / max(n_tokens, 1.0)
        if name != "draft":
            out["models"][name] = {"nll": float(nll[-1]), "ppl": float(math.exp(nll[-1]))}
            continue
        for k, e in enumerate(exits):
            out["draft"][str(e)] = {"nll": float(nll[k]), "ppl": float(math.exp(nll[k])),
                                    "agree": {t: float(a[k] / max(n_tokens, 1.0))
                                              for t, a in agree.items()}}
    return out


def greedy_samples(model_dir: str, prompts: list[str], max_new_tokens: int = 40) -> list[str]:
    """Greedy continuations with `transformers` (float32) of the exported HF dir."""
    import torch
    import transformers

    from s2d_jax.io.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    lm = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            gen = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
        out.append(tok.decode(gen[0, ids.shape[1]:].tolist()))
    return out
