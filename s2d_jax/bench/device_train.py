"""(c) of infer.device_check (--train-minutes N): SoFT of the SmolLM2 sorted draft on the
accelerator for N minutes, its exits' held-out agreement with the target logged as it goes.

The library's training step (s2d_jax.train.loop.build_step, as train.soft runs it) on
configs/train/smollm2_draft.yaml: the target's first exits[-1] layers, the tied embedding
frozen, one loss per exit. Its data is ShareGPT text in the target's tokenizer, not the
pipeline's distilled answers (train.smollm2_draft makes those with the target in ~1 h on a
CPU: no part of a minutes-long check), so the numbers are the step's speed on this device
and whether agreement moves, not a draft to keep. The loop is our own so it stops on the
clock (train.loop.train runs to a step count); the learning rate stays at its peak after
warm-up. Held-out agreement: the fraction of next tokens of held-out questions (never
trained on) where an exit's greedy prediction is the target's, teacher-forced on the text.
"""

from __future__ import annotations

import functools
import os
import time

# the repository's config and shipped data (the device check runs from a checkout)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_CONFIG = os.path.join(_REPO, "configs/train/smollm2_draft.yaml")
TINY_DATA = os.path.join(_REPO, "data/tinyshakespeare.txt")
TRAIN_DATA = [os.path.join(_REPO, "data", name) for name in
              ("sharegpt_axolotl_conversation.json", "sharegpt_dummy_conversation.json")]


def train_config(target: str, tiny: bool):
    """The SmolLM2 draft's SoFT config for `target` (--allow-cpu on a CPU: the demo family's
    smallest target and short rows)."""
    from s2d_jax.train.config import load_train_config
    over = [f"model.path={target}", f"data.tokenizer={target}", "optimizer.end_lr_ratio=1.0",
            "checkpoint.dir=", "metrics_path=", "export_dir="]
    if tiny:  # the demo tokenizer has no chat template: plain text
        return load_train_config(TRAIN_CONFIG, over + [
            "data.format=text", f"data.paths=[{TINY_DATA}]", "draft.exits=[1,2]",
            "data.seq_len=64", "data.batch_size=4", "optimizer.warmup_steps=2"])
    return load_train_config(TRAIN_CONFIG, over + [
        "data.format=sharegpt", f"data.paths=[{','.join(TRAIN_DATA)}]"])


def heldout_rows(tok, path: str, count: int, length: int):
    """[count, length] token ids of the first `count` questions of `path` (zero padded) and
    the mask of the positions whose next token is real."""
    import numpy as np

    from s2d_jax.data.prompts import read_questions
    rows = np.zeros((count, length), np.int32)
    mask = np.zeros((count, length - 1), bool)
    for i, q in enumerate(read_questions(path, None, count)):
        ids = tok.encode(q["text"])[:length]
        rows[i, :len(ids)] = ids
        mask[i, :len(ids) - 1] = True
    return rows, mask


def agreement(d_params, d_cfg, exits, t_params, t_cfg, rows, mask) -> list[float]:
    """Per exit: the fraction of masked next tokens its argmax shares with the target's."""
    import numpy as np
    want, per_exit = _greedy_tokens(d_params, d_cfg, tuple(exits), t_params, t_cfg, rows)
    want = np.asarray(want)[:, :-1]
    return [float(np.mean(np.asarray(got)[:, :-1][mask] == want[mask])) for got in per_exit]


def _greedy_tokens(d_params, d_cfg, exits, t_params, t_cfg, rows):
    """(the target's argmax tokens, each exit's) over rows, in one jitted program (eagerly,
    the forwards' layer scans compiled one by one took ~9 s of a tiny CPU check)."""
    import jax.numpy as jnp
    return _greedy_program()(d_params, t_params, jnp.asarray(rows), d_cfg=d_cfg, exits=exits,
                             t_cfg=t_cfg)


@functools.cache
def _greedy_program():
    import jax
    import jax.numpy as jnp

    from s2d_jax.model import transformer as model
    from s2d_jax.model.sorted_draft import multi_exit_logits

    @functools.partial(jax.jit, static_argnames=("d_cfg", "exits", "t_cfg"))
    def greedy(d_params, t_params, tokens, *, d_cfg, exits, t_cfg):
        want = jnp.argmax(model.forward(t_params, t_cfg, tokens)[0], -1)
        return want, [jnp.argmax(lg, -1)
                      for lg in multi_exit_logits(d_params, d_cfg, exits, tokens)]
    return greedy


def train_for(target: str, minutes: float, heldout: str, tiny: bool, log) -> dict:
    """Train for `minutes` (after compiling; the agreement checks not counted), logging
    held-out agreement every fifth of the time and at the end -> {"exits", "steps",
    "seconds", "tokens_per_s", "log": [{"step", "seconds", "loss", "agreement"}]}."""
    import jax

    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    from s2d_jax.parallel.mesh import make_mesh
    from s2d_jax.train.data import make_train_iterator
    from s2d_jax.train.loop import build_step, initial_params, resolve_draft
    from s2d_jax.train.step import global_batch

    tc = train_config(target, tiny)
    cfg, exits, source = resolve_draft(tc)
    mesh = make_mesh(tc.mesh, jax.devices()[:1])  # the first device, as (a) and (b) run
    tok = load_tokenizer(target)
    it = make_train_iterator(tc.data, cfg.vocab_size, False, 0, 1, tok)
    _, _, init_fn, step_fn = build_step(cfg, exits, tc.draft.resolved_weights(len(exits)),
                                        tc.optimizer, 10**6, mesh, tc.remat)
    state = init_fn(initial_params(cfg, source, mesh, tc.seed))
    t_cfg, t_params, _ = load_model(target, dtype=cfg.param_dtype)
    rows, mask = heldout_rows(tok, heldout, 4 if tiny else 16, 64 if tiny else 256)
    record = _recorder(lambda: agreement(state.params, cfg, exits, t_params, t_cfg, rows,
                                         mask), exits, log)
    record(0, 0.0, None)
    state, _ = step_fn(state, global_batch(next(it), mesh))  # compiles
    jax.block_until_ready(state)
    steps, tokens, t0, budget = 1, 0, time.perf_counter(), 60.0 * minutes
    next_log = budget / 5
    while (elapsed := time.perf_counter() - t0) < budget:
        batch = next(it)
        state, metrics = step_fn(state, global_batch(batch, mesh))
        steps, tokens = steps + 1, tokens + int((batch["segment_ids"] > 0).sum())
        if elapsed >= next_log:
            jax.block_until_ready(state)  # steps run ahead of the host: wait for them
            paused = time.perf_counter()
            while next_log <= paused - t0:
                next_log += budget / 5
            record(steps, paused - t0, float(metrics["loss"]))
            t0 += time.perf_counter() - paused  # measuring is not training time
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    if record.rows[-1]["step"] != steps:
        record(steps, seconds, float(metrics["loss"]) if steps > 1 else None)
    return {"exits": list(exits), "steps": steps, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "log": record.rows}


def _recorder(measure, exits, log):
    """record(step, seconds, loss): held-out agreement now, appended to record.rows."""
    def record(step, seconds, loss):
        agree = measure()
        record.rows.append({"step": step, "seconds": seconds, "loss": loss,
                            "agreement": dict(zip(map(str, exits), agree))})
        log(f"train step {step}, {seconds:.0f} s: held-out agreement "
            + ", ".join(f"exit {e} {a:.3f}" for e, a in zip(exits, agree)))
    record.rows = []
    return record
