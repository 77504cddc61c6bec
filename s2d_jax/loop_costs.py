"""Per-round costs measured inside the engine's own decode loop.

Timing the draft and verify phases as separately jitted calls (serving.measure_time_split)
adds what the loop never pays: a dispatch per call and copies of the undonated state. On
the demo targets (a decode step of 0.5-6 ms) that inflates costs by up to half and the
speedup prediction goes wrong. Here the compiled prefill and round loop
(engine.prefill / engine.decode_chunk, the very programs a generation runs) are timed:

  prefill_s  one prefill (target and draft over the prompt, first token)
  round_s    (min T(2K rounds) - min T(K rounds)) / K from the same post-prefill state
             (K = 24), so the loop's setup and the call's dispatch cancel out.

Thresholds are traced, so forcing every drafted token to stop at exit j (threshold 0 at j,
1 before it) reuses one compilation per method; a round costs the same whatever is
accepted (shapes are static), so K rounds of any text give the per-round cost.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from s2d_jax import engine
from s2d_jax.errors import S2DError

ROUNDS = 24


def forced_exit_thresholds(num_exits: int, j: int) -> list[float]:
    """Thresholds that make every drafted token stop at exit j (1 = never stop here)."""
    return [1.0] * j + [0.0] * (num_exits - j)


def loop_costs(decoder, prompt: list[int], *, temperature: float = 0.0, rounds: int = ROUNDS,
               trials: int = 3) -> dict:
    """{"prefill_s", "round_s": [per forced exit (one entry for ar)]}, best of `trials`."""
    spec0 = decoder.spec_base
    span = spec0.round_span
    new = 2 * rounds * span + 2  # the prefill adds 1 token: no row finishes in 2K rounds
    _, arr, _ = decoder.prepare([prompt], new, None)
    max_len = -(-(arr.shape[1] + new + span) // 64) * 64  # the padded prompt + 2K rounds
    spec, arr, lens = decoder.prepare([prompt], new, max_len)
    m = max(spec.num_exits, 1)
    kw = dict(draft_cfg=decoder.draft_cfg, target_cfg=decoder.target_cfg, spec=spec,
              mesh=decoder.mesh, mid_cfgs=decoder.mid_cfgs)
    out = {"prefill_s": None, "round_s": []}
    compiled = None
    for j in range(m):
        th = forced_exit_thresholds(spec.num_exits, j) if spec.num_exits else None
        dp = decoder.decode_params(spec, th, temperature=temperature, max_new_tokens=new,
                                   eos_id=-1)
        args = (decoder.draft_params, decoder.target_params, arr, lens, dp, jax.random.key(0),
                decoder.mid_params)
        if compiled is None:
            first = engine.prefill.lower(*args, **kw).compile()
            state_shape = jax.eval_shape(lambda: first(*args))
            loop_args = (decoder.draft_params, decoder.target_params, dp, jnp.int32(rounds),
                         decoder.mid_params)
            chunk = engine.decode_chunk.lower(state_shape, *loop_args, **kw).compile()
            compiled = (first, chunk)
        first, chunk = compiled
        state = jax.block_until_ready(first(*args))
        prefill, times = [], {rounds: [], 2 * rounds: []}
        for _ in range(trials):
            t0 = time.perf_counter()
            jax.block_until_ready(first(*args))
            prefill.append(time.perf_counter() - t0)
            for k in times:
                s = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # chunk donates it
                t0 = time.perf_counter()
                s = jax.block_until_ready(chunk(s, decoder.draft_params, decoder.target_params,
                                                dp, jnp.int32(k), decoder.mid_params))
                times[k].append(time.perf_counter() - t0)
                if bool(s.done[0]) or int(s.round) != k:
                    raise S2DError(f"cost measurement ended after {int(s.round)} of {k} "
                                   f"rounds; the buffer of {spec.max_len} is too short")
        # Minimum of each, then the difference: the stable statistic on a shared machine.
        per_round = (min(times[2 * rounds]) - min(times[rounds])) / rounds
        out["round_s"].append(max(per_round, 1e-9))
        out["prefill_s"] = min(prefill) if out["prefill_s"] is None else min(out["prefill_s"],
                                                                              min(prefill))
    return out
