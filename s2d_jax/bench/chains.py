"""Polybasic chains in the benchmark: draft -> intermediate -> target next to AR and
two-level S2D, with the Lemma 3.1 prediction and the insertion verdict.

A chain is `NAME=MID[:int8|int4|w8a8][,gamma=G][,mu=M]`: on target NAME, MID is either
`int8` / `int4` / `w8a8` (the target's own quantization, quantize.py) or a model dir
(optionally quantized). Its draft, exits, thresholds and draft stop are those of the
two-level baseline (s2d-cal when the target is calibrated, else s2d-0.5); gamma defaults to the
baseline's, mu to gamma. A chain with another gamma is compared with the same two-level
setting at that gamma (run as `<baseline>-g<G>`): the insertion is the only difference.
The chain's batch-1 runs are interleaved with every other method by bench.run_target;
this file adds what only chains need (see `bench_chains`).

Costs (seconds per call), all measured the same way so that the two sides of the
insertion inequality are comparable: call_costs.py times each call inside one jitted loop
(a level's forward + verification on exactly the positions the engine feeds it, decode/round.py:
a catch-up window of n - k tokens plus its block; a draft step forced to each exit) on a
cache of the benchmark's length, sampled between the benchmark's prompts. Greedy and
sampling are different programs (sampling.py), so every cost is measured per temperature.
Lemma 3.1 inputs come from measured counts (theory.lemma_inputs), so predicted vs measured
time per token tests the cost model, and the insertion verdict (predicted helps/hurts) is
checked against the measured chain vs two-level tokens/s.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from s2d_jax.bench import theory
from s2d_jax.bench.runner import MethodSpec, PaddedDecoder
from s2d_jax.bench.call_costs import draft_step_probes, verify_probe
from s2d_jax.errors import S2DError
from s2d_jax.model.quantize import MODES, params_nbytes, quantize_params

BATCH_CHECK = 4  # the batch size of the greedy exactness check


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """One 3-level chain on one target: draft -> intermediate -> target."""

    target: str  # the target's name in --target NAME=...
    intermediate: str  # a model dir, or "" for the target itself
    quantize: str | None  # quantization of the intermediate (quantize.MODES)
    mu: int | None = None  # accumulation length; None = the chain's gamma
    gamma: int | None = None  # the draft's block; None = the baseline's gamma

    @property
    def label(self) -> str:
        if not self.intermediate:
            base = f"chain-{self.quantize}"
        else:
            name = os.path.basename(os.path.normpath(self.intermediate))
            base = f"chain-{name}" + (f"-{self.quantize}" if self.quantize else "")
        return (base + (f"-g{self.gamma}" if self.gamma is not None else "")
                + (f"-mu{self.mu}" if self.mu is not None else ""))

    @property
    def describe(self) -> str:
        """Short name of the intermediate: the model dir's name or the target's, + quant."""
        mid = (os.path.basename(os.path.normpath(self.intermediate)) if self.intermediate
               else self.target)
        return mid + (f" {self.quantize}" if self.quantize else "")


def parse_chain(text: str, mu: int | None = None) -> ChainSpec:
    """`NAME=MODE` or `NAME=DIR[:MODE]` (MODE in quantize.MODES), then optional
    `,gamma=G` / `,mu=M` (mu: this chain's, else the `mu` given) -> ChainSpec."""
    head, *opts = text.split(",")
    name, sep, mid = head.partition("=")
    if not sep or not name or not mid:
        raise S2DError(f"--chain {text!r} is not NAME=MID[,gamma=G][,mu=M]; e.g. l=int8 or "
                       f"l=models/demo/target-m,mu=8 (NAME as in --target NAME=PATH)")
    values = {}
    for opt in opts:
        key, eq, val = opt.partition("=")
        if key not in ("gamma", "mu") or not eq or not val.isdigit() or int(val) < 1:
            raise S2DError(f"--chain option {opt!r} in {text!r} is not gamma=G or mu=M with "
                           f"a positive integer; e.g. l=w8a8,gamma=1,mu=16")
        values[key] = int(val)
    gamma, mu = values.get("gamma"), values.get("mu", mu)
    if mid in MODES:
        return ChainSpec(name, "", mid, mu, gamma)
    path, colon, quant = mid.rpartition(":")
    if colon and quant in MODES and path:
        return ChainSpec(name, path, quant, mu, gamma)
    return ChainSpec(name, mid, None, mu, gamma)


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
    from s2d_jax.io.checkpoint import load_model

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


def chain_baseline(chain: ChainSpec, baseline: MethodSpec) -> MethodSpec:
    """The two-level run a chain is compared with: `baseline`, or the same setting at the
    chain's gamma (the insertion is then the only difference between the two runs)."""
    if chain.gamma is None or chain.gamma == baseline.gamma:
        return baseline
    return dataclasses.replace(baseline, label=f"{baseline.label}-g{chain.gamma}",
                               gamma=chain.gamma)


def chain_method_spec(chain: ChainSpec, baseline: MethodSpec) -> MethodSpec:
    """The report entry of a chain (method "chain" keeps it apart from two-level S2D in the
    acceptance checks and the exit-usage plot)."""
    base = chain_baseline(chain, baseline)
    return MethodSpec(chain.label, "chain", base.exits, base.thresholds, base.gamma, base.stop)


def chain_mu(chain: ChainSpec, baseline: MethodSpec) -> int:
    return chain_baseline(chain, baseline).gamma if chain.mu is None else chain.mu


def build_chain_decoder(chain: ChainSpec, mid: tuple, baseline: MethodSpec, target_cfg,
                        target_params, draft_cfg, draft_params, *, prompt_width: int,
                        tokenizer=None) -> PaddedDecoder:
    mid_cfg, mid_params = mid[:2]
    base = chain_baseline(chain, baseline)
    return PaddedDecoder(
        target_cfg, target_params, method="s2d", draft_cfg=draft_cfg,
        draft_params=draft_params, exits=base.exits, gamma=base.gamma,
        thresholds=list(base.thresholds), target_tokenizer=tokenizer,
        intermediates=[(mid_cfg, mid_params)], mus=[chain_mu(chain, baseline)],
        prompt_width=prompt_width, name=chain.target, stop_threshold=base.stop)


# ---- per-call costs --------------------------------------------------------------------

class ChainCostProbes:
    """Every per-call cost the chains' Lemma 3.1 needs, as call_costs probes (compiled
    here, `sample()`d between the benchmark's prompts): per temperature, the target's AR
    step, its verification of each two-level block (gamma + 1 positions) and of each
    chain's block (gamma + mu + 1), each intermediate verifying the draft's block (its
    window of 2 + gamma positions), and a draft step at each exit."""

    def __init__(self, chains: list[ChainSpec], mids: dict, baseline: MethodSpec, target_cfg,
                 target_params, draft_cfg, draft_params, *, temperatures, start: int,
                 max_len: int, confidence: str = "max_prob", kv_fill: str = "calm"):
        self.chains, self.baseline = chains, baseline
        self.probes = {}
        for t in temperatures:
            t = float(t)
            at = dict(start=start, max_len=max_len, temperature=t)
            probes = {("target", 1, 0): verify_probe(target_params, target_cfg, window=1,
                                                     block=0, **at)}
            for c in chains:
                g, mu = chain_baseline(c, baseline).gamma, chain_mu(c, baseline)
                for block in (g, g + mu):
                    if ("target", 1, block) not in probes:
                        probes[("target", 1, block)] = verify_probe(
                            target_params, target_cfg, window=1, block=block, **at)
                mid_cfg, mid_params = mids[c.label][:2]
                probes[(c.label, 2, g)] = verify_probe(mid_params, mid_cfg, window=2, block=g,
                                                       **at)
            probes["draft"] = draft_step_probes(draft_params, draft_cfg, baseline.exits,
                                                conf_kind=confidence, kv_fill=kv_fill, **at)
            self.probes[t] = probes

    def _all(self):
        for probes in self.probes.values():
            for key, p in probes.items():
                yield from (p if key == "draft" else [p])

    def sample(self) -> None:
        for p in self._all():
            p.sample()

    def result(self, temperature: float, chain: ChainSpec) -> dict:
        """Seconds per call for one chain at one temperature (the fields chain_temperature
        reads)."""
        probes = self.probes[float(temperature)]
        g, mu = chain_baseline(chain, self.baseline).gamma, chain_mu(chain, self.baseline)
        return {"target_ar": probes[("target", 1, 0)].result(),
                "target_verify_2level": probes[("target", 1, g)].result(),
                "target_verify_chain": probes[("target", 1, g + mu)].result(),
                "intermediate": probes[(chain.label, 2, g)].result(),
                "draft_step_per_exit": [p.result() for p in probes["draft"]]}


# ---- statistics -------------------------------------------------------------------------

def level_counts(rows: list[dict]) -> dict:
    """Totals over the per-prompt runs of one method: tokens the rounds produced (N), draft
    steps, and per verifier level in chain order (serving.summarize's order: 0 = the
    draft's verifier, last = the target) its calls, the tokens proposed to it and accepted.

    summarize gives per-row rates and calls; the counts follow exactly from how decode/round.py
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
                      names: list[str]) -> dict:
    """One chain at one temperature: measured speed and levels, Lemma 3.1 on both sides of
    the insertion (costs: ChainCostProbes.result), the verdict."""
    cc, bc = level_counts(chain_rows), level_counts(base_rows)
    exit_costs = costs["draft_step_per_exit"]
    before = _lemma([costs["target_verify_2level"]], bc, exit_costs,
                    base_res["exit_usage"])
    after = _lemma([costs["target_verify_chain"], costs["intermediate"]], cc,
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
                 runs: dict, results: dict, cost_probes: ChainCostProbes, *, prompts,
                 prompt_width: int, max_len: int, max_new_tokens: int, eos_id: int,
                 log=lambda msg: None) -> dict:
    """The `chains` section of a target's report (see module docstring); also fills the
    chain rows' predicted_speedup in `results` (in place).

    runs/results: bench.run_target / summarize_target output with every chain label, its
    two-level baseline (chain_baseline) and "ar" in it; mids: label -> load_intermediate
    output; cost_probes: sampled during the runs."""
    greedy_ar = runs[0.0]["ar"]
    reference = [r["token_ids"] for r in greedy_ar]
    gen_kw = dict(max_new_tokens=max_new_tokens, max_len=max_len, eos_id=eos_id)
    out = {}
    for c in chains:
        label, mid_info = c.label, mids[c.label][2]
        base = chain_baseline(c, baseline)
        names = ["draft", c.describe, "target"]
        entry = {"intermediate": mid_info["intermediate"], "quantization": c.quantize,
                 "mu": chain_mu(c, baseline), "baseline": base.label, "gamma": base.gamma,
                 "exits": list(base.exits), "thresholds": list(base.thresholds),
                 "models": names, "intermediate_num_params": mid_info["num_params"],
                 "by_temperature": {}}
        for t, per_method in runs.items():
            key = str(t)
            res = results[key]
            costs = cost_probes.result(t, c)
            e = chain_temperature(per_method[label], per_method[base.label], res[label],
                                  res[base.label], costs, names)
            e["costs_s"] = costs
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
