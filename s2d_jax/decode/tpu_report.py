"""The TPU program's per-round report (`infer.aot --topology ... --roofline`): for AR, SD
(deepest exit) and S2D, compiled by the TPU compiler for compile-only devices, the copies a
round runs by what they move (round_copies.py), and one round's time three ways: the TPU
compiler's own estimate (round_cost.py), the HBM bytes the compiled round loop moves
(hlo_traffic.py's walk of the TPU program: arrays in on-chip memory cost none, the bytes
the loop keeps in VMEM are shown beside) over the chip's datasheet bandwidth, and the
roofline bound (roofline.minimum_round_bytes: every weight and the whole cache once per
call, over the same bandwidth); Lemma 3.1's speedup from each, at the measured acceptance
and at the S2D paper's (`--paper-acceptance`: the paper's figure could not be retrieved
here, so none is built in)."""

from __future__ import annotations

from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_bytes, round_copy_list
from s2d_jax.decode.methods import BASELINE, PAPER_METHODS, methods_where, proposer
from s2d_jax.decode.roofline import expected_tokens, lemma_speedup, minimum_round_bytes
from s2d_jax.decode.round_copies import summary
from s2d_jax.decode.round_cost import compile_round, one_round_bytes, round_cost, walk_ratio

# what the per-round reports compare: the paper's methods (SD at its deepest exit) and those
# that copy from the context (lookup, the ladder), each a program of its own
ROOFLINE_METHODS = PAPER_METHODS + methods_where(lookup=True)

GIB = 2**30


def copy_line(method: str, copies) -> str:
    s = summary(copies)
    return (f"    {method:<6} cache {s['cache'][0]} ({s['cache'][1] / GIB:.3f} GiB), weight "
            f"{s['weight'][0]} ({s['weight'][1] / GIB:.3f} GiB), activation "
            f"{s['activation'][0]} ({s['activation'][1] / 2**20:.2f} MiB), memory-space "
            f"moves {s['memory space'][0]} ({s['memory space'][1] / GIB:.3f} GiB), gathered "
            f"weights {s['gathered weight'][0]} ({s['gathered weight'][1] / GIB:.3f} GiB)")


def acceptance_columns(measured, paper: float | None) -> dict:
    """Column label -> acceptance (None: not known) for Lemma 3.1's columns."""
    cols = {f"acceptance {a:g}": a for a in measured}
    cols["paper's" + ("" if paper is None else f" {paper:g}")] = paper
    return cols


def _lemma_cell(costs, setups, method, a) -> str:
    """Speedup over AR at acceptance `a`: from the compiler's times / the walk's bytes /
    the bounds (S2D: its dearest round, every step escalating)."""
    if a is None:
        return "n/a"
    n = expected_tokens(a, setups[method].spec.gamma)
    ar, c = costs[BASELINE], costs[method]
    parts = [f"{lemma_speedup(ar['seconds'], c['seconds'], n):.2f}x"
             if ar["seconds"] and c["seconds"] else "n/a",
             f"{lemma_speedup(ar['walk'].hi, c['walk'].hi, n):.2f}x",
             f"{lemma_speedup(ar['minimum'][1], c['minimum'][1], n):.2f}x"]
    return " / ".join(parts)


def _one_round_walk(one, loop) -> str:
    """The one-round program's walk (GiB) and its ratio to the loop's dearest round ("" without)."""
    if one is None:
        return ""
    return (f", one-round program's walk {one.hi / GIB:.3f} GiB ({walk_ratio(one, loop):.3f}x the "
            f"loop's{' dearest' if loop.hi != loop.lo else ''} round)")


def tpu_round_lines(setups: dict, mesh, compiled_first, bandwidth: float, device: str,
                    acceptances, paper_acceptance: float | None = None) -> list[str]:
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
        walk = round_bytes(compiled, setup, mesh)
        del compiled
        if mesh.devices.flat[0].platform == "tpu":
            one, seconds = compile_round(setup, mesh)
            cost = {**round_cost(one), "compile": seconds,
                    "one walk": one_round_bytes(one, setup, mesh)}
        else:  # XLA:GPU's cost analysis has no time estimate: skip the one-round compile
            cost = {"seconds": None, "bytes": None, "flops": None, "compile": 0.0,
                    "one walk": None}
        costs[method] = {**cost, "minimum": minimum_round_bytes(setup, mesh), "walk": walk}
    lines = ["  copies per round of the decode loop, by what they move (the accelerator's "
             "program; memory-space moves are prefetches to on-chip memory, not copies in HBM):"]
    lines += [copy_line(m, copies[m]) for m in setups]
    tpu = mesh.devices.flat[0].platform == "tpu"
    lines.append(_round_header(tpu, bandwidth, device))
    for method, c in costs.items():
        lines.append(_round_line(method, c, bandwidth, tpu))
    if BASELINE in costs and len(costs) > 1:
        cols = acceptance_columns(acceptances, paper_acceptance)
        lines.append("  Lemma 3.1 speedup over AR, from the compiler's round times / the walk's "
                     "bytes / the bounds (S2D: every step escalating):")
        lines.append("    " + " " * 8 + "".join(f"{label:<30}" for label in cols))
        for method in (m for m in costs if m != BASELINE):
            lines.append(f"    {method:<8}" + "".join(
                f"{_lemma_cell(costs, setups, method, a):<30}" for a in cols.values()))
        if paper_acceptance is None:
            lines.append("    (the paper's acceptance: not in this repository; pass "
                         "--paper-acceptance A)")
    return lines


def _round_header(tpu: bool, bandwidth: float, device: str) -> str:
    over = f"over {bandwidth / 1e12:.3g} TB/s ({device}; the bound is a LOWER BOUND)"
    if tpu:
        return ("  one round: the TPU compiler's estimate (cost analysis of a one-round program, "
                "layers unrolled, the whole cache read; its own HLO walk beside the loop's, "
                "VMEM counted), the HBM bytes of the compiled round loop (HLO walk) and the "
                f"roofline bound (minimum bytes), both {over}:")
    return ("  one round: the HBM bytes of the compiled round loop (HLO walk) beside the floor "
            f"(weights and caches once a draft step and once a verify), both {over} "
            "(XLA:GPU has no time estimate):")


def _round_line(method: str, c: dict, bandwidth: float, tpu: bool) -> str:
    """One method's round: walk and bound in ms, the bytes and walk / floor (S2D: its
    span, from a round with no escalation to one escalating every step)."""
    w, (flo, fhi) = c["walk"], c["minimum"]
    bound = _ms_span(flo, fhi, bandwidth)
    walk = _ms_span(w.lo, w.hi, bandwidth)
    ratio = f"{w.hi / fhi:.3f}x" if abs(w.lo / flo - w.hi / fhi) < 5e-4 else \
        f"{w.lo / flo:.3f}..{w.hi / fhi:.3f}x"
    if not tpu:
        return (f"    {method:<6} walk {walk} ms   bound {bound} ms   (bytes: walk's "
                f"{w.hi / GIB:.3f} GiB, floor {fhi / GIB:.3f} GiB; walk / floor {ratio})")
    est = "n/a" if c["seconds"] is None else f"{1e3 * c['seconds']:.3f} ms"
    return (f"    {method:<6} compiler {est:>10}   walk {walk} ms   bound {bound} ms   "
            f"(bytes: compiler's {(c['bytes'] or 0) / GIB:.3f} GiB, walk's "
            f"{w.hi / GIB:.3f} GiB + {w.on_chip / GIB:.3f} GiB kept in VMEM"
            f"{_one_round_walk(c['one walk'], w)}, minimum {fhi / GIB:.3f} GiB, walk / "
            f"floor {ratio}; flops {(c['flops'] or 0) / 1e9:.1f} G; one-round compile "
            f"{c['compile']:.1f} s)")


def _ms_span(lo: float, hi: float, bandwidth: float) -> str:
    lo, hi = 1e3 * lo / bandwidth, 1e3 * hi / bandwidth
    return f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}..{hi:.3f}"


def method_setups(target, draft, exits, batch, context, prompt_len, gamma,
                  methods=ROOFLINE_METHODS) -> dict:
    """Each of `methods` (a single-exit one at the deepest exit, the others at `exits`)
    that the models allow (without a draft: those that need none)."""
    return {m: GenerateSetup.make(target, draft if proposer(m).needs_draft else None,
                                  tuple(exits) if proposer(m).exits else (), batch, context,
                                  prompt_len, gamma, m)
            for m in methods if draft is not None or not proposer(m).needs_draft}
