"""Calibration of the lookup rung (issue 42, item 4): per target, the lookup's n range,
its length and gamma (`lookup`), and for the ladder also the draft exit it climbs to and
how many of the block's slots the lookup may take (`lookup_len` < gamma: the draft always
drafts the tail), chosen as the exits are (calibration_search.py): predicted by Lemma 3.1
from measured acceptance and round costs, the best predicted measured against AR, the
fastest measured written (the serving config's "lookup" and "ladder" sections).

Acceptance: the rounds are replayed on the target's greedy trajectories (`replay`), with
the engine's own lookup (decode/lookup.lookup_block, all positions of a trajectory in one
call) and the draft's per-position agreement (calibrate.exit_stats). Greedy, that replay is
exact: a lookup token is accepted iff it is the trajectory's next token, and the draft's
tokens after accepted ones are predicted from the trajectory itself
(tests/test_lookup_calibration.py checks it against the engine's rounds).

Costs, timed inside the decode loop (loop_costs.LoopProbe): AR's step, a lookup round at
each gamma (a target forward over gamma + 1 positions; the lookup itself is integer
compares), and SD at each (exit, gamma). A ladder round that runs s draft steps costs
lookup(gamma) + s * (SD(exit, gamma) - lookup(gamma)) / gamma: the SD round is the same
verification plus gamma draft steps (the ladder's first step feeds a window lookup_len
tokens wider, which this leaves out). The prefill is the same for every method and left
out of the prediction; the measured speedups include it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.decode.methods import methods_where, proposer
from s2d_jax.errors import S2DError

# the two lookup methods of the table: the lookup alone, and the ladder (exits above it)
ALONE = methods_where(lookup=True, exits=False)[0]
LADDER = methods_where(lookup=True, exits=True)[0]
NGRAMS = ((1, 2), (1, 3), (2, 3), (2, 4), (3, 5))  # n ranges tried


@dataclasses.dataclass(frozen=True)
class LookupSetting:
    method: str  # ALONE / LADDER
    ngram: tuple[int, int]
    gamma: int
    lookup_len: int = 0  # 0 = gamma
    exit: int | None = None  # ladder: the draft exit it climbs to

    @property
    def label(self) -> str:
        base = f"{self.method}_n{self.ngram[0]}-{self.ngram[1]}_g{self.gamma}"
        if not proposer(self.method).exits:
            return base
        return base + f"_l{self.lookup_len or self.gamma}_e{self.exit}"


def lookup_proposals(seq: list[int], start: int, length: int, ngram) -> tuple:
    """The engine's lookup (decode/lookup.lookup_block) at every end E in [start, len(seq))
    of one trajectory, in one call -> (tokens [N, length], count [N]), row i for E =
    start + i."""
    n = len(seq) - start
    if n <= 0:
        return np.zeros((0, length), np.int32), np.zeros((0,), np.int32)
    work = jnp.broadcast_to(jnp.asarray(seq, jnp.int32), (n, len(seq)))
    ends = jnp.arange(start, len(seq), dtype=jnp.int32)
    toks, count, _ = _lookup(work, ends, length, tuple(ngram))
    return np.asarray(toks), np.asarray(count)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _lookup(work, ends, length, ngram):
    from s2d_jax.decode.lookup import lookup_block
    return lookup_block(work, ends, length, *ngram)


def replay(seq: list[int], prompt_len: int, setting: LookupSetting, proposals=None,
           draft_correct=None) -> dict:
    """Greedy rounds of `setting` over the trajectory seq = prompt + the target's greedy
    continuation (its first token from the prefill) -> {"rounds", "tokens" (what the
    rounds add), "lookup_accepted", "draft_accepted", "draft_steps"}. proposals:
    lookup_proposals(seq, prompt_len + 1, L, ngram); draft_correct (ladder): bool [T], the
    draft exit's guess for continuation token t + 1 equals it (calibrate.exit_stats)."""
    g = setting.gamma
    L = setting.lookup_len or g
    if proposals is None:
        proposals = lookup_proposals(seq, prompt_len + 1, L, setting.ngram)
    toks, count = proposals
    out = dict(rounds=0, tokens=0, lookup_accepted=0, draft_accepted=0, draft_steps=0)
    E, end = prompt_len + 1, len(seq)
    while E < end:
        i = E - (prompt_len + 1)
        k = int(count[i])
        a = 0
        while a < k and E + a < end and toks[i, a] == seq[E + a]:
            a += 1
        acc = a
        if proposer(setting.method).exits:
            out["draft_steps"] += max(1, g - k)
            if a == k:  # every lookup token accepted: the draft's follow the trajectory
                d = 0
                while (d < g - k and E + k + d < end
                       and bool(draft_correct[E + k + d - prompt_len - 1])):
                    d += 1
                acc += d
                out["draft_accepted"] += d
        out["lookup_accepted"] += a
        added = min(acc + 1, end - E)
        out["rounds"] += 1
        out["tokens"] += added
        E += added
    return out


def grid(gammas, exits) -> list[LookupSetting]:
    """Every lookup setting (n range x gamma) and every ladder one (n range x gamma x
    lookup length 1..gamma x single exit)."""
    out = [LookupSetting(ALONE, n, g) for n, g in itertools.product(NGRAMS, gammas)]
    out += [LookupSetting(LADDER, n, g, l, e)
            for n, g, e in itertools.product(NGRAMS, gammas, exits)
            for l in range(1, g + 1)]
    return out


def predicted_speedup(setting: LookupSetting, sims: list[dict], costs: dict) -> float | None:
    """Lemma 3.1 on this run's replayed rounds: AR's tokens at AR's step cost over the
    setting's rounds at their measured costs (the prefill left out: the same for all)."""
    g = setting.gamma
    look = costs.get(("lookup", g))
    if look is None:
        return None
    rounds = sum(s["rounds"] for s in sims)
    tokens = sum(s["tokens"] for s in sims)
    t = rounds * look
    if proposer(setting.method).exits:
        sd = costs.get(("sd", setting.exit, g))
        if sd is None:
            return None
        t += sum(s["draft_steps"] for s in sims) * max(sd - look, 0.0) / g
    return tokens * costs["ar"] / t if t > 0 else None


def rank(settings, trajectories, prompt_lens, stats, exits, costs) -> list[dict]:
    """Every setting replayed and predicted -> rows sorted by predicted speedup."""
    rows, cache = [], {}
    for s in settings:
        L = s.lookup_len or s.gamma
        sims = []
        for j, (seq, p) in enumerate(zip(trajectories, prompt_lens)):
            key = (j, L, s.ngram)
            if key not in cache:
                cache[key] = lookup_proposals(seq, p + 1, L, s.ngram)
            corr = (stats.correct[j][:, exits.index(s.exit)] if proposer(s.method).exits
                    else None)
            sims.append(replay(seq, p, s, cache[key], corr))
        rounds = sum(x["rounds"] for x in sims)
        rows.append({"setting": s, "mat": sum(x["tokens"] for x in sims) / max(rounds, 1),
                     "lookup_accepted": sum(x["lookup_accepted"] for x in sims),
                     "draft_accepted": sum(x["draft_accepted"] for x in sims),
                     "predicted_speedup": predicted_speedup(s, sims, costs)})
    rows.sort(key=lambda r: -(r["predicted_speedup"] or 0.0))
    return rows


def method_spec(s: LookupSetting):
    """The run of a setting: the ladder's single exit always drafts (threshold 0)."""
    from s2d_jax.bench.runner import MethodSpec
    from s2d_jax.decode.serving_config import resolve
    exits = (s.exit,) if proposer(s.method).exits else ()
    return MethodSpec.of(s.label, resolve(
        s.method, exits, exits=exits or None, thresholds=(0.0,) * len(exits) or None,
        gamma=s.gamma, stop_threshold=0.0, ngram=s.ngram, lookup_len=s.lookup_len))


def section(s: LookupSetting, measured: float, predicted: float | None) -> dict:
    """The serving config's section for a chosen setting (serving_config.resolve reads it)."""
    out = {"gamma": s.gamma, "ngram": list(s.ngram), "lookup_len": s.lookup_len,
           "measured_speedup": measured, "predicted_speedup": predicted}
    if proposer(s.method).exits:
        out.update(exits=[s.exit], thresholds=[0.0], stop_threshold=0.0)
    return out


def calibrate_lookup(cal, top: int = 3, log=print) -> dict:
    """cal: a calibration.Calibration (target, draft, prompts loaded). -> {"lookup":
    section, "ladder": section, "rows": every measured setting}. Costs are probed, the
    grid replayed on AR's greedy trajectories, the `top` best predicted settings of each
    method measured against AR in one interleaved run, the fastest exact one kept."""
    from s2d_jax.calibration import calibrate
    from s2d_jax.bench import runner as bench

    exits = list(cal.exits)
    ar = cal.build([cal.ar_spec])
    log(f"[{cal.name}] greedy AR trajectories on {len(cal.prompts)} prompts")
    ar_runs = cal.run(ar, repeats=1)["ar"]
    conts = [r["token_ids"] for r in ar_runs]
    trajectories = [list(p) + list(c) for p, c in zip(cal.prompts, conts)]
    prompt_lens = [len(p) for p in cal.prompts]
    stats = calibrate.exit_stats(cal.d_cfg, cal.d_params, exits, cal.prompts, conts,
                                 cal.max_len)
    specs = ([bench.MethodSpec(f"lookup_g{g}", ALONE, gamma=g) for g in cal.gammas]
             + [bench.MethodSpec(f"sd_e{e}_g{g}", "sd", (e,), (0.0,), g)
                for e in exits for g in cal.gammas])
    log(f"[{cal.name}] timing rounds inside the decode loop: AR, lookup at gammas "
        f"{cal.gammas}, SD at every exit and gamma")
    probes = {"ar": cal.probe(ar["ar"])}
    probes.update({s.label: cal.probe(d) for s, d in zip(specs, cal.build(specs).values())})
    for _ in range(cal.opts.cost_samples):
        for p in probes.values():
            p.sample()
    res = {k: p.result()["round_s"][0] for k, p in probes.items()}
    costs = {"ar": res["ar"], **{("lookup", g): res[f"lookup_g{g}"] for g in cal.gammas},
             **{("sd", e, g): res[f"sd_e{e}_g{g}"] for e in exits for g in cal.gammas}}
    rows = rank(grid(cal.gammas, exits), trajectories, prompt_lens, stats, exits, costs)
    picked = [r for m in methods_where(lookup=True)
              for r in [r for r in rows if r["setting"].method == m][:top]]
    if not picked:
        raise S2DError("no lookup setting could be predicted; check the calibration prompts")
    log(f"[{cal.name}] measuring the {len(picked)} best predicted lookup / ladder settings "
        f"against AR")
    decs = {"ar": ar["ar"], **cal.build([method_spec(r["setting"]) for r in picked])}
    per = cal.run(decs)
    from s2d_jax.calibration.calibration import _speedups
    speed = _speedups(per)
    out = {"rows": []}
    for r in picked:
        m = speed[r["setting"].label]
        r.update(measured_speedup=m["speedup"], exact=m["exact"], measured_mat=m["mat"])
        out["rows"].append({**r, "setting": r["setting"].label})
    for method in methods_where(lookup=True):
        ok = [r for r in picked if r["setting"].method == method and r["exact"]]
        if ok:
            best = max(ok, key=lambda r: r["measured_speedup"])
            out[method] = section(best["setting"], best["measured_speedup"],
                                  best["predicted_speedup"])
    return out
