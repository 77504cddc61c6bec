"""Per-round costs measured inside the engine's own decode loop.

Timing the draft and verify phases as separately jitted calls adds what the loop never
pays: a dispatch per call and copies of the undonated state. On the demo targets (a
decode step of 0.5-6 ms) that inflated costs by up to half and the speedup prediction
went wrong. Here the compiled prefill and round loop
(engine.prefill / engine.decode_chunk, the very programs a generation runs) are timed:

  prefill_s  one prefill (target and draft over the prompt, first token)
  round_s    (median T(K rounds) - median T(0 rounds)) / K from the same post-prefill
             state, K as many rounds as the generation's buffer holds (<= 48): the empty
             call takes out the dispatch and the loop's setup.

Three things made earlier versions of this probe miss by up to 40%, each measured here:
  - The buffer length sets the cost of every step (attention and cache updates run over
    the whole static buffer): a 128-slot probe timed target-s's AR step at 0.45 ms where
    the benchmark's 256-slot generations pay 0.73 ms. Probes use the generation's max_len.
  - A difference of two minima, (min T(2K) - min T(K)) / K, is noisy on a shared 2-core
    machine (it once put an exit-1, gamma-2 round of target-s below an AR step).
  - Timing after the benchmark instead of during it: machine speed drifts. bench.py calls
    `sample()` of every probe after each prompt's runs, so probes and runs see the same
    machine, and medians compare with the runs' averages.

Thresholds are traced, so forcing every drafted token to stop at exit j (threshold 0 at j,
1 before it) reuses one compilation per method; a two-level round costs the same whatever
is accepted (shapes are static), so K rounds of any text give the per-round cost.

With a dynamic draft length (the decoder's stop_threshold > 0) a round runs between 1 and
gamma draft steps (a step no row needs is skipped). Such a decoder is also timed with one
draft step per round (a stop threshold no confidence reaches): `one_step_round_s`, per
forced exit; a round of beta steps costs R1 + (beta - 1) / (gamma - 1) * (R - R1).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from s2d_jax.decode import engine
from s2d_jax.decode.defaults import buffer_len
from s2d_jax.errors import S2DError

MAX_ROUNDS = 48
ONE_STEP = 1.5  # a draft stop threshold above any confidence: one draft step per round


def forced_exit_thresholds(num_exits: int, j: int) -> list[float]:
    """Thresholds that make every drafted token stop at exit j (1 = never stop here)."""
    return [1.0] * j + [0.0] * (num_exits - j)


class LoopProbe:
    """The compiled prefill and round loop of one decoder, timed per forced exit.

    Construct (compiles), call `sample()` any number of times (one timed trial of each
    forced exit: prefill, 0 rounds, K rounds), then `result()`.
    """

    def __init__(self, decoder, prompt: list[int], *, max_len: int | None = None,
                 temperature: float = 0.0, rounds: int = MAX_ROUNDS):
        self.decoder = decoder
        span = decoder.spec_base.round_span
        _, arr, _ = decoder.prepare([prompt], 1, None)
        width = arr.shape[1]
        if max_len is None:  # room for `rounds` rounds that each add a whole block
            max_len = buffer_len(width, rounds * span + 2, span)
        rounds = min(rounds, (max_len - width - span - 2) // span)
        if rounds < 2:
            raise S2DError(f"a buffer of {max_len} tokens leaves no room to time rounds of "
                           f"{span} tokens after a {width}-token prompt; raise max_len")
        self.rounds = rounds
        new = max_len - width - 1  # no row runs out of budget before the buffer
        spec, self.arr, self.lens = decoder.prepare([prompt], new, max_len)
        self.spec, self.chain = spec, decoder.chain_for(spec)
        stops = [0.0] + ([ONE_STEP] if decoder.stop_threshold > 0 else [])
        self.dps = [decoder.decode_params(
            spec, forced_exit_thresholds(spec.num_exits, j) if spec.num_exits else None,
            temperature=temperature, max_new_tokens=new, eos_id=-1, stop_threshold=stop)
            for stop in stops for j in range(max(spec.num_exits, 1))]
        args = self._prefill_args(self.dps[0])
        self.first = engine.prefill.lower(*args, chain=self.chain).compile()
        state_shape = jax.eval_shape(lambda: self.first(*args))
        self.chunk = engine.decode_chunk.lower(state_shape, *self._loop_args(self.dps[0], rounds),
                                               chain=self.chain).compile()
        self.prefill_s = []
        self.times = [{0: [], rounds: []} for _ in self.dps]

    def _prefill_args(self, dp):
        return self.decoder.prefill_args(self.arr, self.lens, dp, seed=0)

    def _loop_args(self, dp, k):
        return self.decoder.loop_args(dp, k)

    def reset(self) -> None:
        """Drop the samples taken so far (to time the probe afresh beside other runs)."""
        self.prefill_s = []
        self.times = [{k: [] for k in t} for t in self.times]

    def sample(self) -> None:
        for dp, times in zip(self.dps, self.times):
            args = self._prefill_args(dp)
            t0 = time.perf_counter()
            state = jax.block_until_ready(self.first(*args))
            self.prefill_s.append(time.perf_counter() - t0)
            for k in times:
                s = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # chunk donates it
                t0 = time.perf_counter()
                s = jax.block_until_ready(self.chunk(s, *self._loop_args(dp, k)))
                times[k].append(time.perf_counter() - t0)
                if k and (bool(s.done[0]) or int(s.round) != k):
                    raise S2DError(f"cost measurement ended after {int(s.round)} of {k} "
                                   f"rounds; the buffer of {self.spec.max_len} is too short")

    def result(self) -> dict:
        """{"prefill_s", "round_s": [per forced exit], ...}: medians over the samples."""
        if not self.prefill_s:
            raise S2DError("LoopProbe.result() before any sample(); call sample() first")
        k, med = self.rounds, statistics.median
        per_round = [(med(t[k]) - med(t[0])) / k for t in self.times]
        if min(per_round) <= 0:
            raise S2DError(f"the round probe measured no time for {k} rounds over an empty "
                           f"call ({len(self.prefill_s) // len(self.dps)} samples): the machine "
                           f"was too noisy; sample() more often or give it a longer buffer "
                           f"(max_len) so each timing runs more rounds")
        m = max(self.spec.num_exits, 1)
        out = {"prefill_s": med(self.prefill_s), "round_s": per_round[:m], "rounds": k,
               "max_len": self.spec.max_len, "trials": len(self.prefill_s) // len(self.dps)}
        if len(per_round) > m:
            out["one_step_round_s"] = per_round[m:]
        return out


def generation_split(costs: dict, stats: dict) -> dict:
    """One generation's time split into its prefill and its rounds, from a probe's
    `result()` and the generation's stats (rounds, exit usage): the round cost is the
    probe's per forced exit weighted by the exit usage (with a dynamic draft length, at
    the generation's draft steps per round)."""
    from s2d_jax.bench import theory

    round_s, usage, rounds = costs["round_s"], stats["exit_usage"], stats["rounds"]
    if "one_step_round_s" in costs and rounds:
        round_s = theory.round_costs_at_steps(round_s, costs["one_step_round_s"],
                                              sum(usage) / rounds, stats["gamma"])
    per_round = theory.draft_step_cost(round_s, usage) if any(usage) else round_s[0]
    rounds_s = rounds * per_round
    return {"prefill_s": costs["prefill_s"], "round_s": per_round, "rounds_s": rounds_s,
            "prefill_fraction": costs["prefill_s"] / (costs["prefill_s"] + rounds_s),
            "round_s_per_exit": list(costs["round_s"])}


def loop_probe_costs(decoder, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                     samples: int = 5, min_rounds: int = 16) -> dict:
    """`result()` of a LoopProbe on the first prompt, sampled `samples` times back to back,
    at the buffer length a generation of `prompts` uses, lengthened (within the context)
    to hold `min_rounds` rounds: a short generation's few rounds time below the noise."""
    spec, arr, _ = decoder.prepare(prompts, max_new_tokens)
    span = spec.round_span
    room = -(-(arr.shape[1] + (min_rounds + 1) * span + 2) // 64) * 64
    probe = LoopProbe(decoder, prompts[0], max_len=min(max(spec.max_len, room), decoder.context),
                      temperature=temperature)
    for _ in range(samples):
        probe.sample()
    return probe.result()
