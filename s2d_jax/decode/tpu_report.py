"""The TPU program's per-round report (`infer.aot --topology ... --roofline`): for AR, SD
(deepest exit) and S2D, compiled by the TPU compiler for compile-only devices, the copies a
round runs by what they move (round_copies.py), the round's HBM bytes per device
(hlo_traffic.py on the TPU HLO itself: no float32 twin, the TPU runs bf16), the roofline
bound at the chip's bandwidth, the compiler's own estimate of the round (round_cost.py) and
Lemma 3.1's speedup from both."""

from __future__ import annotations

from s2d_jax.decode.aot import (GenerateSetup, compile_generate, device_cache_shapes,
                                round_copy_list)
from s2d_jax.decode.hlo_traffic import round_traffic
from s2d_jax.decode.roofline import (RoundBound, expected_tokens, format_roofline,
                                     lemma_speedup, minimum_round_bytes)
from s2d_jax.decode.round_copies import summary
from s2d_jax.decode.round_cost import compile_round, round_cost

GIB = 2**30
METHODS = ("ar", "sd", "s2d")


def copy_line(method: str, copies) -> str:
    s = summary(copies)
    return (f"    {method:<6} cache {s['cache'][0]} ({s['cache'][1] / GIB:.3f} GiB), weight "
            f"{s['weight'][0]} ({s['weight'][1] / GIB:.3f} GiB), activation "
            f"{s['activation'][0]} ({s['activation'][1] / 2**20:.2f} MiB), memory-space "
            f"moves {s['memory space'][0]} ({s['memory space'][1] / GIB:.3f} GiB)")


def tpu_round_lines(setups: dict, mesh, compiled_first, bandwidth: float, device: str,
                    acceptances) -> list[str]:
    """`setups`: method -> GenerateSetup (bf16 as the TPU runs it); `compiled_first`:
    (method, its already compiled generation) to reuse."""
    copies, rounds, costs = {}, [], {}
    for method, setup in setups.items():
        if compiled_first and compiled_first[0] == method:
            compiled = compiled_first[1]
        else:
            compiled = compile_generate(setup, mesh)[0]
        hlo = compiled.as_text()
        cfgs = [setup.target_cfg, setup.draft_cfg]
        copies[method] = round_copy_list(hlo, cfgs, setup.batch, setup.spec.max_len, mesh)
        traffic = round_traffic(hlo, device_cache_shapes(cfgs, setup.batch, setup.spec.max_len,
                                                         mesh))
        rounds.append(RoundBound(method, traffic, minimum_round_bytes(setup, mesh),
                                 setup.spec.gamma))
        del compiled, hlo
        one, seconds = compile_round(setup, mesh)
        costs[method] = round_cost(one)
        costs[method]["compile"] = seconds
    lines = ["  copies per round of the decode loop, by what they move (TPU program; "
             "memory-space moves are prefetches to on-chip memory, not copies in HBM):"]
    lines += [copy_line(m, copies[m]) for m in setups]
    lines += format_roofline(rounds, bandwidth, device, acceptances)
    lines.append("  the TPU compiler's estimate of one round (cost_analysis of a one-round "
                 "program, layers unrolled, the whole cache read) beside the roofline bound:")
    for r in rounds:
        c = costs[r.method]
        est = "n/a" if c["seconds"] is None else f"{1e3 * c['seconds']:.3f} ms"
        lines.append(f"    {r.method:<6} compiler {est:>10}   bound {1e3 * r.traffic.lo / bandwidth:.3f}"
                     f"..{1e3 * r.traffic.hi / bandwidth:.3f} ms   compiler's bytes "
                     f"{(c['bytes'] or 0) / GIB:.3f} GiB, flops {(c['flops'] or 0) / 1e9:.1f} G "
                     f"(one-round compile {c['compile']:.1f} s)")
    ar = costs.get("ar", {}).get("seconds")
    for a in acceptances if ar else ():
        parts = []
        for r in rounds:
            s = costs[r.method]["seconds"]
            if r.method != "ar" and s:
                parts.append(f"{r.method} {lemma_speedup(ar, s, expected_tokens(a, r.gamma)):.2f}x")
        lines.append(f"    Lemma 3.1 speedup from the compiler's round times at acceptance "
                     f"{a:g}: {', '.join(parts) or 'n/a'}")
    return lines


def method_setups(target, draft, exits, batch, context, prompt_len, gamma) -> dict:
    """AR, SD at the deepest exit and S2D at `exits` (those a draft allows)."""
    out = {"ar": GenerateSetup.make(target, None, (), batch, context, prompt_len, gamma, "ar")}
    if draft is not None:
        out["sd"] = GenerateSetup.make(target, draft, (exits[-1],), batch, context, prompt_len,
                                       gamma, "sd")
        out["s2d"] = GenerateSetup.make(target, draft, tuple(exits), batch, context,
                                        prompt_len, gamma, "s2d")
    return out
