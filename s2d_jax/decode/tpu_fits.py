"""Which targets fit which TPU slices: the fits table of docs/distributed.md, compiled by
the TPU compiler for compile-only devices (parallel/topology.py).

Per (chip slice, target, method, batch): the whole generation compiled for the slice with
tensor parallelism over its chips, its per-device arguments and temporaries, whether the
peak fits the chip's HBM (the TPU compiler refuses a program that does not: the row says
so with the compiler's own figure), and the round's time two ways: the roofline bound (the
bytes any round must move, roofline.minimum_round_bytes: weights and caches once per call,
over the chip's datasheet bandwidth) and the bytes the compiled program's round loop moves
(hlo_traffic.round_traffic walking the TPU program) over the same bandwidth; S2D's spans
run never .. always escalating. Lemma 3.1's speedup against AR of the same slice and batch
is computed from the walk's round times at each acceptance given.

Each compiled row is a record (`compile_record`: plain numbers, JSON) with the program's
HLO kept beside it, so a table is rendered (`markdown`) from records alone and a long grid
resumes where it stopped (infer/tpu_fits.py).
"""

from __future__ import annotations

from s2d_jax.decode.aot import (GenerateSetup, compile_generate, device_cache_shapes,
                                device_memory_bytes, memory_report)
from s2d_jax.decode.roofline import (DEVICE_BANDWIDTH, expected_tokens, lemma_speedup,
                                     minimum_round_bytes)
from s2d_jax.decode.methods import BASELINE, proposer

GIB = 2**30
# The slices a user would rent for each target size: the smallest of each chip generation
# whose tensor axis splits every model (kv heads 8 for Llama-2-70B) and whose HBM could
# hold the weights. (v5e/v6e slices of 4 chips are one host; v5p:2x2x1 is a v5p-8.)
SLICES = {
    "small": (("v5e", "v5e:2x2"), ("v5p", "v5p:2x2x1"), ("v6e", "v6e:2x2")),
    "70b": (("v5e", "v5e:2x4"), ("v5p", "v5p:2x2x2"), ("v6e", "v6e:2x4")),
}
CHIP_MEMORY = {"v5e": "tpu-v5e-16gb", "v5p": "tpu-v5p-95gb", "v6e": "tpu-v6e-32gb"}


def row_key(topo: str, target: str, method: str, batch: int, context: int) -> str:
    return f"{topo}|{target}|{method}|{batch}|{context}"


def _refusal(err: Exception) -> str:
    """The TPU compiler's out-of-memory message, cut to its first line."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:160]


def compile_record(chip, topo, mesh, name, target, draft, method, batch, context,
                   exits) -> tuple[dict, str | None]:
    """(the row's record, the compiled program's HLO text or None where the compiler
    refused it)."""
    row = proposer(method)
    ex = (() if not row.exits else (exits[-1],) if row.single_exit else tuple(exits))
    gamma = row.default_gamma
    setup = GenerateSetup.make(target, draft if row.needs_draft else None, ex, batch, context,
                               None, gamma, method)
    rec = {"key": row_key(topo, name, method, batch, context), "chip": chip, "topology": topo,
           "target": name, "method": method, "batch": batch, "context": context,
           "gamma": gamma, "exits": list(ex), "minimum": list(minimum_round_bytes(setup, mesh)),
           "bandwidth": DEVICE_BANDWIDTH[CHIP_MEMORY[chip]],
           "limit": device_memory_bytes(CHIP_MEMORY[chip]),
           "cache_shapes": [list(s) for s in device_cache_shapes(
               [setup.target_cfg, setup.draft_cfg], batch, setup.spec.max_len, mesh)]}
    try:
        compiled, _, seconds = compile_generate(setup, mesh)
    except Exception as e:  # the TPU compiler refuses a program over the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
            raise  # not a refusal: nothing to keep as the row's answer
        return {**rec, "refusal": _refusal(e)}, None
    rep = memory_report(compiled, setup, mesh)
    rec.update(argument=rep["argument"], temp=rep["temp"], peak=rep["peak_estimate"],
               compile_s=round(seconds, 1))
    return rec, compiled.as_text()


def _span(lo: float, hi: float, fmt: str = "{:.2f}") -> str:
    a, b = fmt.format(lo), fmt.format(hi)
    return a if a == b else f"{a}..{b}"


def _fits(rec: dict) -> str:
    if "refusal" in rec:
        return f"NO (compiler: {rec['refusal']})"
    pct = 100 * rec["peak"] / rec["limit"]
    return f"yes ({pct:.0f}%)" if rec["peak"] <= rec["limit"] else "NO"


def _lemma(rec: dict, ar: dict | None, a: float) -> str:
    """S2D/SD's Lemma 3.1 speedup at acceptance `a` from the walk's round bytes (the same
    bandwidth divides both): slowest (AR's dearest over this round's lo) .. fastest."""
    if not proposer(rec["method"]).proposes or ar is None or "walk" not in rec or "walk" not in ar:
        return "-"
    if a is None:
        return "n/a"
    n = expected_tokens(a, rec["gamma"])
    lo, hi = rec["walk"]
    return _span(lemma_speedup(ar["walk"][1], hi, n), lemma_speedup(ar["walk"][0], lo, n),
                 "{:.2f}x")


def markdown(records: list[dict], acceptances: dict) -> list[str]:
    """The table; `records` with their "walk" [lo, hi] round bytes where compiled;
    `acceptances`: column label -> per-token acceptance (None: unknown, "n/a") for Lemma
    3.1's columns."""
    heads = [f"Lemma 3.1 speedup at {label}" for label in acceptances]
    out = ["| slice | target | method | batch | arguments GiB/device | temp GiB/device | "
           "fits (peak, % of HBM) | round >= ms (roofline) | round ms (HLO walk) | "
           + " | ".join(heads) + " |", "|" + " --- |" * (9 + len(heads))]
    ars = {(r["topology"], r["target"], r["batch"], r["context"]): r
           for r in records if r["method"] == BASELINE}
    num = lambda rec, k: "-" if k not in rec else f"{rec[k] / GIB:.2f}"  # noqa: E731
    for r in records:
        bw = r["bandwidth"]
        bound = _span(*(1e3 * b / bw for b in r["minimum"]))
        walk = _span(*(1e3 * b / bw for b in r["walk"])) if "walk" in r else "-"
        ar = ars.get((r["topology"], r["target"], r["batch"], r["context"]))
        lemmas = [_lemma(r, ar, a) for a in acceptances.values()]
        out.append(f"| {r['topology']} | {r['target']} | {r['method']} | {r['batch']} | "
                   f"{num(r, 'argument')} | {num(r, 'temp')} | {_fits(r)} | "
                   f"{bound if 'refusal' not in r else '-'} | {walk} | "
                   + " | ".join(lemmas) + " |")
    return out
