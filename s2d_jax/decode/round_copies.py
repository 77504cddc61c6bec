"""Every copy one decode round executes, classified by what it moves, read off the optimized
HLO of any backend (XLA:CPU, or the TPU compiler's program from a deviceless compile).

`hlo_copies.cache_traffic` lists cache-shaped instructions of the loop body; this counts
how often each `copy` / `copy-start` runs per round (loops times their trip count, a
conditional's dearest branch), and each transpose (a layout change: XLA:GPU's
`wrapped_transpose` fusions), and says what it moves:
- "cache": a whole K/V cache, a range of its layers or one layer (in any dimension order:
  the TPU compiler bitcasts a cache to [layers, slots, heads, dim] views), a hidden pass
  over the cache;
- "weight": a parameter's per-device shape or a range of its layers;
- "memory space": a `copy-start` of an array to another memory space (on TPU `S(1)` is
  the on-chip VMEM: an async prefetch or eviction, not a second copy in HBM); a plain
  `copy` between memory spaces still duplicates the array (a cache kept in VMEM and copied
  out to HBM every iteration is read and written whole), so it is judged by its shape;
- "activation": anything else (hidden states, scores, indices: small);
- "gathered weight": an all-gather whose result is a parameter's whole shape or some of
  its layers (a sharded weight rebuilt on every device inside the loop: an embedding table
  gathered whole for each token's row); collectives of activations are not copies.
Loops count times their trip count (hlo_traffic.loop_trips: XLA's, or read off the loop's
condition on TPU, or the attention's block loop over the whole cache).
"""

from __future__ import annotations

import dataclasses
import re

from s2d_jax.decode.hlo_copies import _callees, decode_loop_body
from s2d_jax.decode.hlo_module import Module, type_bytes
from s2d_jax.decode.hlo_traffic import loop_trips

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
KINDS = ("cache", "weight", "activation", "memory space", "gathered weight")


@dataclasses.dataclass
class Copy:
    """One copy instruction: what it moves, its bytes and how often a round runs it."""

    kind: str
    computation: str
    shape: tuple
    bytes: int
    per_round: int
    line: str


def _first_array(type_text: str):
    """(dims, layout text) of the first array of an HLO type (a copy-start's tuple: its
    destination)."""
    m = _ARRAY.search(type_text)
    if not m:
        return (), ""
    return tuple(int(d) for d in m.group(2).split(",") if d), m.group(3) or ""


def _space(layout: str) -> int:
    m = _SPACE.search(layout)
    return int(m.group(1)) if m else 0


def _squeeze(dims) -> tuple:
    return tuple(d for d in dims if d != 1)


def cache_like(dims, cache_shapes) -> bool:
    """Shaped like a whole cache (per-device (L, B, K, S, H)), a range of its layers or one
    layer, in any order of the dimensions (size-1 dimensions ignored)."""
    got = sorted(_squeeze(dims))
    if not got:
        return False
    for L, B, K, S, H in cache_shapes:
        rest = [d for d in (B, K, S, H) if d != 1]
        if got == sorted(rest):
            return True
        for n in range(2, L + 1):
            if got == sorted(rest + [n]):
                return True
    return False


def weight_like(dims, weight_shapes) -> bool:
    """A parameter's per-device shape, or a range of layers of a stacked one (the same
    trailing dimensions, in order)."""
    got = _squeeze(dims)
    if not got:
        return False  # a scalar: a loop counter or an index
    for shape in weight_shapes:
        layer = _squeeze(shape[1:])
        if got in (_squeeze(shape), layer) or (got[1:] == layer and got[:1]
                                                and got[0] <= shape[0]):
            return True
    return False


def classify(mod: Module, comp: str, ins, cache_shapes, weight_shapes) -> str:
    dims, layout = _first_array(ins.type)
    src = mod.types[comp].get(ins.operands[0], "") if ins.operands else ""
    _, src_layout = _first_array(src)
    if ins.opcode == "copy-start" and _space(layout) != _space(src_layout):
        return "memory space"  # an async prefetch / eviction; a plain copy duplicates
    if weight_like(dims, weight_shapes):  # first: a weight [L, N, H, D] may match the
        return "weight"                   # cache's dims when D equals its slots
    if cache_like(dims, cache_shapes):
        return "cache"
    return "activation"


def _gathered(ins, whole_shapes):
    """(dims, dtype) of an all-gather's result when it is shaped like a whole parameter or
    some of its layers, else None (an all-gather-start's type is (operand, result))."""
    if ins.opcode not in ("all-gather", "all-gather-start"):
        return None
    arrays = _ARRAY.findall(ins.type)
    if not arrays:
        return None
    dtype, dims = arrays[-1][0], tuple(int(d) for d in arrays[-1][1].split(",") if d)
    return (dims, dtype) if weight_like(dims, whole_shapes) else None


def _walk(mod: Module, comp: str, times: int, cache_shapes, weight_shapes, out: list,
          whole_shapes=()):
    for ins in mod.instrs[comp]:
        called = _callees(ins.line)
        gathered = _gathered(ins, whole_shapes)
        if ins.opcode == "while":
            n = loop_trips(mod, comp, ins, cache_shapes) or 1
            for c in called:
                _walk(mod, c, times * n, cache_shapes, weight_shapes, out, whole_shapes)
        elif gathered:
            dims, dtype = gathered
            out.append(Copy("gathered weight", comp, dims,
                            type_bytes(f"{dtype}[{','.join(map(str, dims))}]"), times,
                            ins.line.strip()[:200]))
        elif ins.opcode == "conditional":
            branches = []
            for c in called:
                found = []
                _walk(mod, c, times, cache_shapes, weight_shapes, found, whole_shapes)
                branches.append(found)
            # the dearest branch by cache copies, then by bytes: a round's worst case
            out += max(branches, key=lambda f: (sum(x.per_round for x in f if x.kind == "cache"),
                                                sum(x.bytes * x.per_round for x in f)))
        elif ins.opcode == "call":
            for c in called:
                _walk(mod, c, times, cache_shapes, weight_shapes, out, whole_shapes)
        elif ins.opcode in ("copy", "copy-start") or relayout(mod, ins):
            dims, _ = _first_array(ins.type)
            kind = classify(mod, comp, ins, cache_shapes, weight_shapes)
            dtype = _ARRAY.search(ins.type).group(1) if _ARRAY.search(ins.type) else ""
            out.append(Copy(kind, comp, dims, type_bytes(f"{dtype}[{','.join(map(str, dims))}]"),
                            times, ins.line.strip()[:200]))


def relayout(mod: Module, ins) -> bool:
    """A transpose, or a fusion whose result is one (XLA:GPU wraps a layout change in a
    `wrapped_transpose` fusion): it writes its operand anew in another order, a copy by
    another name (a whole cache transposed in every layer made the H100's AR step of a
    Vicuna-7B-shaped target 2.3x dearer, model/attention.py)."""
    if ins.opcode == "transpose":
        return True
    if ins.opcode != "fusion":
        return False
    return any(i.opcode in ("transpose", "copy") and i.line.lstrip().startswith("ROOT")
               for c in _callees(ins.line) for i in mod.instrs.get(c, []))


def round_copies(hlo: str, cache_shapes, weight_shapes=(), whole_shapes=()) -> list[Copy]:
    """Every copy / copy-start one round of the compiled generation's decode loop runs
    (outside fusions: a copy inside a fusion is part of that kernel's output), and every
    all-gather of a parameter, classified; `cache_shapes`: per-device (L, B, K, S, H) of
    each cache, `weight_shapes`: per-device shapes of every parameter, `whole_shapes`: their
    unsharded shapes (only those that are sharded: a replicated one is never gathered)."""
    mod = Module(hlo)
    out: list[Copy] = []
    _walk(mod, decode_loop_body(mod.comps), 1, [tuple(s) for s in cache_shapes],
          [tuple(s) for s in weight_shapes], out, [tuple(s) for s in whole_shapes])
    return out


def summary(copies: list[Copy]) -> dict[str, tuple[int, int]]:
    """kind -> (copies per round, bytes per round)."""
    out = {k: (0, 0) for k in KINDS}
    for c in copies:
        n, b = out[c.kind]
        out[c.kind] = (n + c.per_round, b + c.per_round * c.bytes)
    return out
