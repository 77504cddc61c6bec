"""Which targets fit which TPU slices: the fits table of docs/distributed.md, compiled by
the TPU compiler for compile-only devices (parallel/topology.py).

Per (chip slice, target, method, batch): the whole generation compiled for the slice with
tensor parallelism over its chips, its per-device arguments and temporaries, whether the
peak fits the chip's HBM (the TPU compiler refuses a program that does not: the row says
so with the compiler's own figure), and the round's roofline bound: the bytes any round
must move (roofline.minimum_round_bytes: weights and caches once per call) over the chip's
datasheet bandwidth (never .. always escalating for S2D). The HLO walk of hlo_traffic.py
was built on XLA:CPU's program and misreads the TPU's (tpu_report.py), so it is not used.
"""

from __future__ import annotations

import dataclasses

from s2d_jax.decode.aot import (GenerateSetup, compile_generate, device_memory_bytes,
                                memory_report)
from s2d_jax.decode.methods import proposer
from s2d_jax.decode.roofline import DEVICE_BANDWIDTH, minimum_round_bytes

GIB = 2**30
# The slices a user would rent for each target size: the smallest of each chip generation
# whose tensor axis splits every model (kv heads 8 for Llama-2-70B) and whose HBM could
# hold the weights. (v5e/v6e slices of 4 chips are one host; v5p:2x2x1 is a v5p-8.)
SLICES = {
    "small": (("v5e", "v5e:2x2"), ("v5p", "v5p:2x2x1"), ("v6e", "v6e:2x2")),
    "70b": (("v5e", "v5e:2x4"), ("v5p", "v5p:2x2x2"), ("v6e", "v6e:2x4")),
}
CHIP_MEMORY = {"v5e": "tpu-v5e-16gb", "v5p": "tpu-v5p-95gb", "v6e": "tpu-v6e-32gb"}


@dataclasses.dataclass
class Row:
    chip: str
    topology: str
    target: str
    method: str
    batch: int
    argument: float | None = None  # GiB per device
    temp: float | None = None
    fits: str = ""
    round_ms: str = ""


def _refusal(err: Exception) -> str:
    """The TPU compiler's out-of-memory message, cut to its first line."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:160]


def fits_row(chip, topo, mesh, name, target, draft, method, batch, context, exits) -> Row:
    setup = GenerateSetup.make(target, draft if proposer(method).needs_draft else None,
                               tuple(exits), batch, context, None, None, method)
    row = Row(chip, topo, name, method, batch)
    try:
        compiled = compile_generate(setup, mesh)[0]
    except Exception as e:  # the TPU compiler refuses a program over the chip's HBM
        row.fits = f"NO (compiler: {_refusal(e)})"
        return row
    rep = memory_report(compiled, setup, mesh)
    limit = device_memory_bytes(CHIP_MEMORY[chip])
    row.argument, row.temp = rep["argument"] / GIB, rep["temp"] / GIB
    row.fits = (f"yes ({100 * rep['peak_estimate'] / limit:.0f}%)"
                if rep["peak_estimate"] <= limit else "NO")
    lo_b, hi_b = minimum_round_bytes(setup, mesh)
    bw = DEVICE_BANDWIDTH[CHIP_MEMORY[chip]]
    lo, hi = 1e3 * lo_b / bw, 1e3 * hi_b / bw
    row.round_ms = f"{lo:.2f}" if abs(hi - lo) < 5e-3 else f"{lo:.2f}..{hi:.2f}"
    return row


def markdown(rows: list[Row]) -> list[str]:
    out = ["| slice | target | method | batch | arguments GiB/device | temp GiB/device | "
           "fits | round >= ms (roofline) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        num = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        out.append(f"| {r.topology} | {r.target} | {r.method} | {r.batch} | {num(r.argument)} | "
                   f"{num(r.temp)} | {r.fits} | {r.round_ms or '-'} |")
    return out
