"""The TPU program's per-round report (`infer.aot --topology ... --roofline`): for AR, SD
(deepest exit) and S2D, compiled by the TPU compiler for compile-only devices, the copies a
round runs by what they move (round_copies.py), the TPU compiler's own estimate of one round
(round_cost.py) beside the roofline bound and Lemma 3.1's speedup from both.

The bound is the bytes any round must move (roofline.minimum_round_bytes: every weight and
the whole cache once per call) over the chip's datasheet bandwidth. hlo_traffic.py's walk
is not used on the TPU program: built on XLA:CPU's HLO, it misreads the TPU's (its fusions
take whole weight stacks and cache buffers as operands; it summed 1198 GiB for an SD round
of the 70B target whose minimum is 18.9 GiB), so the TPU's own bytes here are the
compiler's cost analysis of the one-round program."""

from __future__ import annotations

from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_copy_list
from s2d_jax.decode.methods import BASELINE, PAPER_METHODS, proposer
from s2d_jax.decode.roofline import expected_tokens, lemma_speedup, minimum_round_bytes
from s2d_jax.decode.round_copies import summary
from s2d_jax.decode.round_cost import compile_round, round_cost

ROOFLINE_METHODS = PAPER_METHODS  # what the per-round reports compare (SD: its deepest exit)

GIB = 2**30


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
    copies, costs = {}, {}
    for method, setup in setups.items():
        if compiled_first and compiled_first[0] == method:
            compiled = compiled_first[1]
        else:
            compiled = compile_generate(setup, mesh)[0]
        cfgs = [setup.target_cfg, setup.draft_cfg]
        copies[method] = round_copy_list(compiled.as_text(), cfgs, setup.batch,
                                         setup.spec.max_len, mesh)
        del compiled
        if mesh.devices.flat[0].platform == "tpu":
            one, seconds = compile_round(setup, mesh)
            cost = {**round_cost(one), "compile": seconds}
        else:  # XLA:GPU's cost analysis has no time estimate: skip the one-round compile
            cost = {"seconds": None, "bytes": None, "flops": None, "compile": 0.0}
        costs[method] = {**cost, "minimum": minimum_round_bytes(setup, mesh)}
    lines = ["  copies per round of the decode loop, by what they move (the accelerator's "
             "program; memory-space moves are prefetches to on-chip memory, not copies in HBM):"]
    lines += [copy_line(m, copies[m]) for m in setups]
    lines.append(f"  one round: the TPU compiler's estimate (cost analysis of a one-round "
                 f"program, layers unrolled, the whole cache read) beside the roofline bound "
                 f"(minimum bytes / {bandwidth / 1e12:.3g} TB/s, {device}; a LOWER BOUND):")
    for method, c in costs.items():
        est = "n/a" if c["seconds"] is None else f"{1e3 * c['seconds']:.3f} ms"
        lo, hi = (1e3 * b / bandwidth for b in c["minimum"])
        bound = f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}..{hi:.3f}"
        lines.append(f"    {method:<6} compiler {est:>10}   bound {bound} ms   (compiler's bytes "
                     f"{(c['bytes'] or 0) / GIB:.3f} GiB, minimum "
                     f"{c['minimum'][1] / GIB:.3f} GiB; flops {(c['flops'] or 0) / 1e9:.1f} G; "
                     f"one-round compile {c['compile']:.1f} s)")
    ar = costs.get(BASELINE, {}).get("seconds")
    for a in acceptances if ar else ():
        parts = []
        for method, c in costs.items():
            g = setups[method].spec.gamma
            if proposer(method).proposes and c["seconds"]:
                n = expected_tokens(a, g)
                bound = lemma_speedup(costs[BASELINE]["minimum"][1], c["minimum"][1], n)
                parts.append(f"{method} {lemma_speedup(ar, c['seconds'], n):.2f}x "
                             f"(bound's {bound:.2f}x)")
        lines.append(f"    Lemma 3.1 speedup at acceptance {a:g} from the compiler's round "
                     f"times (and from the bounds, deepest exit): {', '.join(parts) or 'n/a'}")
    return lines


def method_setups(target, draft, exits, batch, context, prompt_len, gamma,
                  methods=ROOFLINE_METHODS) -> dict:
    """Each of `methods` (a single-exit one at the deepest exit, the others at `exits`)
    that the models allow (without a draft: those that need none)."""
    return {m: GenerateSetup.make(target, draft if proposer(m).needs_draft else None,
                                  tuple(exits) if proposer(m).exits else (), batch, context,
                                  prompt_len, gamma, m)
            for m in methods if draft is not None or not proposer(m).needs_draft}
