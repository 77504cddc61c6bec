"""Polybasic chains in the benchmark: draft -> intermediate -> target next to AR and
two-level S2D, with the Lemma 3.1 prediction and the insertion verdict.

A chain is `NAME=MID[:int8|int4|w8a8]`: on target NAME, MID is either `int8` / `int4` /
`w8a8` (the target's own quantization, quantize.py) or a model dir (optionally quantized).
Its draft, exits, thresholds and gamma are those of the two-level baseline (s2d-cal when the target
is calibrated, else s2d-0.5); mu defaults to gamma. The chain's batch-1 runs are
interleaved with every other method by bench.run_target; this file adds what only chains
need (see `bench_chains`).

Costs (seconds per call), all measured the same way so that the two sides of the
insertion inequality are comparable: `forward_cost` times one jitted forward + verification
of a level on exactly the positions the engine feeds it (chain.py: a catch-up window of
n - k tokens plus its block), on a donated cache of the benchmark's length; the drafter's
step cost per exit is bench.phase_costs' (the engine's own draft phase), weighted by the
run's exit usage. Greedy and sampling are different programs (sampling.py), so every
cost is measured per temperature. Lemma 3.1 inputs come from measured counts
(theory.lemma_inputs), so predicted vs measured time per token tests the cost model, and
the insertion verdict (predicted helps/hurts) is checked against the measured chain vs
two-level tokens/s.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax import model, theory
from s2d_jax.bench import MethodSpec, PaddedDecoder, phase_costs
from s2d_jax.errors import S2DError
from s2d_jax.kvcache import init_cache
from s2d_jax.quantize import MODES, params_nbytes, quantize_params
from s2d_jax.sampling import SamplingParams, probs_from_logits, speculative_verify

BATCH_CHECK = 4  # the batch size of the greedy exactness check


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """One 3-level chain on one target: draft -> intermediate -> target."""

    target: str  # the target's name in --targets
    intermediate: str  # a model dir, or "" for the target itself
    quantize: str | None  # quantization of the intermediate (quantize.MODES)
    mu: int | None = None  # accumulation length; None = the baseline's gamma

    @property
    def label(self) -> str:
        if not self.intermediate:
            return f"chain-{self.quantize}"
        name = os.path.basename(os.path.normpath(self.intermediate))
        return f"chain-{name}" + (f"-{self.quantize}" if self.quantize else "")

    @property
    def describe(self) -> str:
        """Short name of the intermediate: the model dir's name or the target's, + quant."""
        mid = (os.path.basename(os.path.normpath(self.intermediate)) if self.intermediate
               else self.target)
        return mid + (f" {self.quantize}" if self.quantize else "")


def parse_chain(text: str, mu: int | None = None) -> ChainSpec:
    """`NAME=MODE` or `NAME=DIR[:MODE]` (MODE in quantize.MODES) -> ChainSpec."""
    name, sep, mid = text.partition("=")
    if not sep or not name or not mid:
        raise S2DError(f"--chain {text!r} is not NAME=MID; e.g. l=int8 or "
                       f"l=models/demo/target-m (NAME as in --targets)")
    if mid in MODES:
        return ChainSpec(name, "", mid, mu)
    path, colon, quant = mid.rpartition(":")
    if colon and quant in MODES and path:
        return ChainSpec(name, path, quant, mu)
    return ChainSpec(name, mid, None, mu)


def pick_baseline(specs: list[MethodSpec]) -> MethodSpec:
    """The two-level S2D run a chain is compared with: calibrated if present, else 0.5."""
    by_label = {s.label: s for s in specs}
    for label in ("s2d-cal", "s2d-0.5"):
        if label in by_label:
            return by_label[label]
    raise S2DError("--chain needs a two-level S2D run to compare with; include s2d (or "
                   "s2d-cal) in --methods")


def load_intermediate(chain: ChainSpec, target_cfg, target_params, *, dtype: str,
                      quant_group: int = 64) -> tuple:
    """(cfg, params, info) of the chain's intermediate level; info holds the memory of a
    quantized one next to its full-precision params."""
    from s2d_jax.checkpoint import load_model

    if chain.intermediate:
        cfg, params, _ = load_model(chain.intermediate, dtype=dtype)
    else:
        cfg, params = target_cfg, target_params
    info = {"intermediate": chain.intermediate or "target", "quantization": chain.quantize,
            "num_layers": cfg.num_layers,
            "num_params": int(sum(x.size for x in jax.tree.leaves(params)))}
    if chain.quantize:
        full = params_nbytes(params)
        params = quantize_params(params, chain.quantize, quant_group)
        q = params_nbytes(params)
        info["memory"] = {"params_bytes": q, "full_precision_params_bytes": full,
                          "full_precision_dtype": dtype, "bytes_saved": full - q,
                          "fraction_of_full": q / full}
    return cfg, params, info


def chain_method_spec(chain: ChainSpec, baseline: MethodSpec) -> MethodSpec:
    """The report entry of a chain (method "chain" keeps it apart from two-level S2D in the
    acceptance checks and the exit-usage plot)."""
    return MethodSpec(chain.label, "chain", baseline.exits, baseline.thresholds,
                      baseline.gamma)


def chain_mu(chain: ChainSpec, baseline: MethodSpec) -> int:
    return baseline.gamma if chain.mu is None else chain.mu


def build_chain_decoder(chain: ChainSpec, mid: tuple, baseline: MethodSpec, target_cfg,
                        target_params, draft_cfg, draft_params, *, prompt_width: int,
                        tokenizer=None) -> PaddedDecoder:
    mid_cfg, mid_params = mid[:2]
    return PaddedDecoder(
        target_cfg, target_params, method="s2d", draft_cfg=draft_cfg,
        draft_params=draft_params, exits=baseline.exits, gamma=baseline.gamma,
        thresholds=list(baseline.thresholds), target_tokenizer=tokenizer,
        intermediates=[(mid_cfg, mid_params)], mus=[chain_mu(chain, baseline)],
        prompt_width=prompt_width, name=chain.target)


# ---- per-call costs --------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def _verify_call(params, cache, toks, pos, q, key, sp, *, cfg, window):
    """One verification call of a level, as chain.verify_block does it: forward over the
    catch-up window + block, distributions, the accept rule (greedy is a static flag of
    sp, as in the engine)."""
    logits, cache = model.forward(params, cfg, toks, pos, cache)
    p = probs_from_logits(logits[:, window - 1:], sp)
    n, nxt = speculative_verify(key, toks[:, window:], q, p, greedy=sp.greedy)
    return n, nxt, cache


def forward_cost(params, cfg, *, window: int, block: int, start: int, max_len: int,
                 temperature: float = 0.0, reps: int = 4, trials: int = 3) -> float:
    """Seconds per verification call of a model scoring `block` proposed tokens after a
    catch-up window of `window` tokens (block 0, window 1: one autoregressive step).
    Attention runs over the whole cache buffer, so the cost does not depend on token
    values, only on greedy vs sampling (a different program); the best of `trials` means
    of `reps` calls (stable on a shared machine)."""
    width = window + block
    start = max(0, min(start, max_len - width))
    cache = init_cache(cfg, 1, max_len)
    pos = (start + jnp.arange(width, dtype=jnp.int32))[None, :]
    toks = jnp.ones((1, width), jnp.int32)
    q = jnp.full((1, block, cfg.vocab_size), 1.0 / cfg.vocab_size, jnp.float32)
    sp, key = SamplingParams.make(temperature), jax.random.key(0)
    call = functools.partial(_verify_call, cfg=cfg, window=window)
    *_, cache = jax.block_until_ready(call(params, cache, toks, pos, q, key, sp))  # compile
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            n, nxt, cache = call(params, cache, toks, pos, q, key, sp)
        jax.block_until_ready((n, nxt, cache))
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def chain_costs(chain_mus: dict, mids: dict, target_cfg, target_params, gamma: int, *,
                start: int, max_len: int, temperature: float = 0.0) -> dict:
    """Seconds per call: the target autoregressive (1 position), verifying the two-level
    block (gamma + 1 positions), verifying each chain's block (gamma + mu + 1), and each
    intermediate verifying the draft's block (its window of 2 + gamma positions)."""
    cost = functools.partial(forward_cost, start=start, max_len=max_len,
                             temperature=temperature)
    out = {"target_ar": cost(target_params, target_cfg, window=1, block=0),
           "target_verify_2level": cost(target_params, target_cfg, window=1, block=gamma),
           "target_verify_chain": {}, "intermediate": {}}
    by_block = {gamma: out["target_verify_2level"]}
    for label, mu in chain_mus.items():
        if gamma + mu not in by_block:
            by_block[gamma + mu] = cost(target_params, target_cfg, window=1, block=gamma + mu)
        out["target_verify_chain"][label] = by_block[gamma + mu]
        mid_cfg, mid_params = mids[label][:2]
        out["intermediate"][label] = cost(mid_params, mid_cfg, window=2, block=gamma)
    return out


# ---- statistics -------------------------------------------------------------------------

def level_counts(rows: list[dict]) -> dict:
    """Totals over the per-prompt runs of one method: tokens the rounds produced (N), draft
    steps, and per verifier level in chain order (serving.summarize's order: 0 = the
    draft's verifier, last = the target) its calls, the tokens proposed to it and accepted.

    summarize gives per-row rates and calls; the counts follow exactly from how chain.py
    counts: the draft's proposals to level 1 are its drafted tokens (sum of exit usage),
    and each call of an intermediate passes up its accepted tokens plus its correction."""
    n_ver = len(rows[0]["stats"]["level_forwards"])
    calls, proposed, accepted = np.zeros(n_ver), np.zeros(n_ver), np.zeros(n_ver)
    tokens = steps = 0.0
    for r in rows:
        s = r["stats"]
        tokens += s["mean_accepted_tokens"] * s["rounds"]
        prop = float(sum(s["exit_usage"]))
        steps += prop
        for k, (rate, f) in enumerate(zip(s["level_acceptance_rate"], s["level_forwards"])):
            acc = round((rate or 0.0) * prop)
            calls[k] += f
            proposed[k] += prop
            accepted[k] += acc
            prop = float(acc + f)
    return {"tokens": tokens, "draft_steps": steps, "calls": calls.tolist(),
            "proposed": proposed.tolist(), "accepted": accepted.tolist()}


def _level_table(counts: dict, names: list[str]) -> list[dict]:
    """names: the chain's models lowest first (draft, ..., target)."""
    out = []
    for k, (f, p, a) in enumerate(zip(counts["calls"], counts["proposed"], counts["accepted"])):
        out.append({"level": names[k + 1], "verifies": names[k], "calls": f, "proposed": p,
                    "accepted": a, "acceptance_rate": a / p if p else None,
                    # tokens one call outputs (accepted + its correction/bonus)
                    "accept_length_per_call": (a + f) / f if f else None,
                    # Lemma 3.1's L: committed tokens per call of this level
                    "tokens_per_call": counts["tokens"] / f if f else None})
    return out


def _lemma(costs_by_level: list[float], counts: dict, exit_costs, exit_usage) -> dict:
    """Lemma 3.1 (target first) from verifier costs [T_1, ..., T_{n-1}] and measured counts."""
    draft_step = theory.draft_step_cost(exit_costs, exit_usage)
    L, beta = theory.lemma_inputs(counts["tokens"], counts["calls"][::-1], counts["draft_steps"])
    costs = list(costs_by_level) + [draft_step]
    return {"costs": costs, "accept_lengths": L, "beta": beta,
            "time_per_token_s": theory.chain_time_per_token(costs, L, beta)}


def chain_temperature(chain_rows, base_rows, chain_res: dict, base_res: dict, costs: dict,
                      label: str, exit_costs, names: list[str]) -> dict:
    """One chain at one temperature: measured speed and levels, Lemma 3.1 on both sides of
    the insertion, the verdict."""
    cc, bc = level_counts(chain_rows), level_counts(base_rows)
    before = _lemma([costs["target_verify_2level"]], bc, exit_costs,
                    base_res["exit_usage"])
    after = _lemma([costs["target_verify_chain"][label], costs["intermediate"][label]], cc,
                   exit_costs, chain_res["exit_usage"])
    gain = theory.insertion_gain(before["costs"], before["accept_lengths"], before["beta"], 1,
                                 after["costs"][1], after["accept_lengths"], after["beta"],
                                 new_costs=[after["costs"][0], after["costs"][2]])
    t_ar = costs["target_ar"]
    measured_gain = (chain_res["tokens_per_second"] / base_res["tokens_per_second"]
                     if chain_res["tokens_per_second"] and base_res["tokens_per_second"]
                     else None)
    # measured: wall time per new token, prefill included (the lemma counts rounds only)
    tpt = chain_res["seconds"] / chain_res["new_tokens"] if chain_res["new_tokens"] else None
    return {
        "tokens_per_second": chain_res["tokens_per_second"],
        "speedup_vs_ar": chain_res["speedup_vs_ar"],
        "speedup_vs_2level": measured_gain,
        "exact_match_vs_ar": chain_res["exact_match_vs_ar"],
        "mean_accepted_tokens": chain_res["mean_accepted_tokens"],
        "levels": _level_table(cc, names),
        "baseline_levels": _level_table(bc, [names[0], names[-1]]),
        "measured_time_per_token_s": tpt,
        "predicted_time_per_token_s": after["time_per_token_s"],
        "predicted_speedup": t_ar / after["time_per_token_s"],
        "measured_over_predicted": (chain_res["speedup_vs_ar"] * after["time_per_token_s"]
                                    / t_ar if chain_res["speedup_vs_ar"] else None),
        "baseline_predicted_speedup": t_ar / before["time_per_token_s"],
        "insertion": {
            "position": 1, "before": before, "after": after,
            "target_ar_cost_s": t_ar,
            "predicted_gain": gain["gain"],
            "predicted": "helps" if gain["helps"] else "hurts",
            "measured_gain": measured_gain,
            "measured": (None if measured_gain is None
                         else "faster" if measured_gain > 1 else "slower"),
            "agrees": (None if measured_gain is None
                       else bool(gain["helps"]) == (measured_gain > 1))},
    }


def per_prompt_exact(rows, ar_rows) -> list[bool]:
    return [r["token_ids"] == a["token_ids"] for r, a in zip(rows, ar_rows)]


def batch_exact(decoder, prompts, reference: list[list[int]], *, batch: int = BATCH_CHECK,
                **gen_kw) -> dict:
    """Greedy generation of all prompts in groups of `batch` (the last group padded with
    copies of its last prompt, dropped after), each row compared with its batch-1 AR."""
    same = []
    for i in range(0, len(prompts), batch):
        group = list(prompts[i:i + batch])
        padded = group + [group[-1]] * (batch - len(group))
        out = decoder.generate(padded, temperature=0.0, **gen_kw)
        same += [o["token_ids"] == ref for o, ref in zip(out, reference[i:i + batch])]
    return {"batch_size": batch, "prompts": len(same),
            "exact_match_vs_ar": float(np.mean(same)) if same else None,
            "exact_match_per_prompt": same}


def _prefix_fraction(a: list[int], ref: list[int]) -> float:
    n = 0
    for x, y in zip(a, ref):
        if x != y:
            break
        n += 1
    return n / len(ref) if ref else 1.0


def quantized_agreement(ar_decoder, prompts, reference: list[list[int]], **gen_kw) -> dict:
    """The quantized model's own greedy AR output vs the full-precision target's, per
    prompt at batch 1: identical or not, and the share of the reference's tokens matched
    before the first divergence."""
    outs = [ar_decoder.generate([p], temperature=0.0, **gen_kw)[0]["token_ids"]
            for p in prompts]
    identical = [o == r for o, r in zip(outs, reference)]
    prefix = [_prefix_fraction(o, r) for o, r in zip(outs, reference)]
    return {"prompts": len(outs), "identical_fraction": float(np.mean(identical)),
            "mean_prefix_match": float(np.mean(prefix)), "prefix_match_per_prompt": prefix}


def bench_chains(chains: list[ChainSpec], mids: dict, decoders: dict, baseline: MethodSpec,
                 runs: dict, results: dict, exit_costs, *, prompts, target_cfg,
                 target_params, prompt_width: int, max_len: int, max_new_tokens: int,
                 eos_id: int, log=lambda msg: None) -> dict:
    """The `chains` section of a target's report (see module docstring); also fills the
    chain rows' predicted_speedup in `results` (in place).

    runs/results: bench.run_target / summarize_target output with every chain label and
    the baseline and "ar" in it; mids: label -> load_intermediate output; exit_costs: the
    baseline's greedy draft step cost per exit (bench.measure_costs), re-measured here for
    the other temperatures."""
    mus = {c.label: chain_mu(c, baseline) for c in chains}
    costs, step_costs = {}, {}
    for t in runs:  # greedy and sampling are different programs with different costs
        log(f"[{chains[0].target}] chain costs per call at T={t:g}")
        costs[t] = chain_costs(mus, mids, target_cfg, target_params, baseline.gamma,
                               start=prompt_width, max_len=max_len, temperature=t)
        step_costs[t] = (list(exit_costs) if t == 0.0 else phase_costs(
            decoders[baseline.label], prompts[0], max_new_tokens=max_new_tokens,
            temperature=t)[0])
    greedy_ar = runs[0.0]["ar"]
    reference = [r["token_ids"] for r in greedy_ar]
    gen_kw = dict(max_new_tokens=max_new_tokens, max_len=max_len, eos_id=eos_id)
    out = {}
    for c in chains:
        label, mid_info = c.label, mids[c.label][2]
        names = ["draft", c.describe, "target"]
        entry = {"intermediate": mid_info["intermediate"], "quantization": c.quantize,
                 "mu": mus[label], "baseline": baseline.label, "gamma": baseline.gamma,
                 "exits": list(baseline.exits), "thresholds": list(baseline.thresholds),
                 "models": names, "intermediate_num_params": mid_info["num_params"],
                 "by_temperature": {}}
        for t, per_method in runs.items():
            key = str(t)
            res = results[key]
            e = chain_temperature(per_method[label], per_method[baseline.label], res[label],
                                  res[baseline.label], costs[t], label, step_costs[t], names)
            e["costs_s"] = {"target_ar": costs[t]["target_ar"],
                            "target_verify_2level": costs[t]["target_verify_2level"],
                            "target_verify_chain": costs[t]["target_verify_chain"][label],
                            "intermediate": costs[t]["intermediate"][label],
                            "draft_step_per_exit": step_costs[t]}
            if t == 0.0:
                e["exact_match_per_prompt"] = per_prompt_exact(per_method[label], greedy_ar)
            entry["by_temperature"][key] = e
            res[label]["predicted_speedup"] = e["predicted_speedup"]
            res[label]["measured_over_predicted"] = e["measured_over_predicted"]
        log(f"[{c.target}] {label}: greedy batch {BATCH_CHECK} exactness")
        entry["batch4"] = batch_exact(decoders[label], prompts, reference, **gen_kw)
        if c.quantize:
            entry["quantized"] = {"mode": c.quantize, **mid_info["memory"]}
            if not c.intermediate:  # the quantized target: compare with the target's AR
                log(f"[{c.target}] {label}: the quantized target's own greedy AR")
                mid_cfg, mid_params = mids[label][:2]
                ar_q = PaddedDecoder(mid_cfg, mid_params, method="ar",
                                     prompt_width=prompt_width)
                entry["quantized"].update(quantized_agreement(ar_q, prompts, reference,
                                                              **gen_kw))
        out[label] = entry
    return out
