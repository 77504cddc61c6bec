"""Memory traffic of one round of a compiled decode loop, summed over its optimized HLO.

`compiled.cost_analysis()["bytes accessed"]` is no per-round figure: XLA counts a while
loop's body once, not times its trip count (a 10-step scan over stacked weights reports one
layer's bytes), and the whole program holds the prefill too. So `round_traffic` walks the
round loop's body (hlo_copies.decode_loop_body) itself, per device (the HLO is the
partitioned per-device program), counting for every instruction what it reads and writes
as XLA's cost analysis does: operands + result; a dynamic-slice / gather reads only its
slice; a dynamic-update-slice / scatter (or a fusion rooted in one) writes only its update
in place; plumbing (parameter, tuple, bitcast, ...) and fusions that only slice (VIEW) are
free. Compile the program in float32 (see roofline.py): XLA:CPU widens bf16 weights to f32
inside the loop before every matmul, traffic an accelerator does not have. Loops multiply
their body by their trip count: XLA's `known_trip_count`, else, for a loop that reads a KV
cache block by block (the attention's), the cache's length over the block's - the round at
the end of the context, where attention reads the whole cache. A conditional
costs its cheapest live branch in `lo` and its dearest in `hi` (S2D: never / always
escalating; a branch that does next to nothing is the skip of finished rows, not live).
"""

from __future__ import annotations

import dataclasses
import math
import re

from s2d_jax.decode.hlo_copies import _callees, decode_loop_body, parse_computations

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CONST = re.compile(r"constant\((-?\d+)\)")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "optimization-barrier", "copy-start", "copy-done"}
SLICING = {"dynamic-slice", "slice", "gather"}
# Fusions of only these (and scalar index arithmetic) are views: a layer of stacked weights,
# a block of a cache. XLA:CPU materializes them (read + write) before a matmul; an
# accelerator's matmul reads the slice where it lies, and the consumer's read is counted.
VIEW = {"parameter", "constant", "bitcast", "reshape", "dynamic-slice", "slice"}
# A conditional's branch under this fraction of its dearest one's bytes is a skip (a draft
# step's zeros for rows that draft no more: ~1% of a step; S2D's escalation skip still
# fills the deeper layers' K/V, >= ~9% of the deeper branch).
SKIP_FRACTION = 0.05
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand index of the update


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(type_text)]


def type_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array `bf16[8,128]{1,0}` or a tuple of them."""
    return sum(DTYPE_BYTES.get(dt, 0) * math.prod(dims) for dt, dims in _arrays(type_text))


def _operands(rest: str) -> list[str]:
    """The %names inside the instruction's operand parentheses."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    line: str


class Module:
    """A parsed HLO module: computations -> instructions, with a name -> type table each."""

    def __init__(self, hlo: str):
        self.comps = parse_computations(hlo)
        self.instrs, self.types = {}, {}
        for comp, lines in self.comps.items():
            parsed = []
            for line in lines:
                m = _INSTR.match(line)
                if m:
                    parsed.append(Instr(m.group(1), m.group(2), m.group(3),
                                        _operands(m.group(4)), line))
            self.instrs[comp] = parsed
            self.types[comp] = {i.name: i.type for i in parsed}

    def operand_bytes(self, comp: str, ins: Instr, k: int) -> int:
        if k >= len(ins.operands):
            return 0
        return type_bytes(self.types[comp].get(ins.operands[k], ""))


ASYNC_DONE = {"all-reduce-done", "all-gather-done", "collective-permute-done", "async-done"}


def _users(instrs: list[Instr], name: str) -> list[tuple[Instr, int]]:
    """(user, operand index) of `name`, looking through bitcasts."""
    out = []
    for ins in instrs:
        for k, op in enumerate(ins.operands):
            if op == name:
                out += (_users(instrs, ins.name) if ins.opcode == "bitcast" else [(ins, k)])
    return out


def _written(mod: Module, comp: str, ins: Instr) -> int:
    """Bytes `ins` writes: its update when it updates a buffer in place, else its result."""
    if ins.opcode in IN_PLACE:
        return mod.operand_bytes(comp, ins, IN_PLACE[ins.opcode])
    if ins.opcode == "tuple":
        by_name = {i.name: i for i in mod.instrs[comp]}
        return sum(_written(mod, comp, by_name[o]) if o in by_name else 0 for o in ins.operands)
    return type_bytes(ins.type)


def _scalar(ins: Instr) -> bool:
    """A scalar result: index arithmetic (an attention block's start, min(c * C, S - C))."""
    arrays = _arrays(ins.type)
    return bool(arrays) and all(dims == () for _, dims in arrays)


def fusion_bytes(mod: Module, comp: str, ins: Instr) -> int:
    """A fusion reads each operand whole, or only the slices its body takes of it, or
    nothing of the buffer its root updates in place; it writes its result (or the update)."""
    fused = _callees(ins.line)[0]
    body = mod.instrs[fused]
    root = next((i for i in body if i.line.lstrip().startswith("ROOT")), body[-1])
    if all(i.opcode in VIEW or _scalar(i) for i in body) and root.opcode != "parameter":
        return 0  # a slice its consumer reads in place on a GPU/TPU (XLA:CPU copies it out)
    total = _written(mod, fused, root)
    for p in (i for i in body if i.opcode == "parameter"):
        k = int(re.search(r"parameter\((\d+)\)", p.line).group(1))
        users = _users(body, p.name)
        if users and all(u.opcode in SLICING | set(IN_PLACE) and j == 0 for u, j in users):
            # slices read, and the buffer updated in place (only the update is touched)
            total += sum(type_bytes(u.type) for u, _ in users if u.opcode in SLICING)
        else:
            total += mod.operand_bytes(comp, ins, k)
    return total


def instr_bytes(mod: Module, comp: str, ins: Instr) -> int:
    """Bytes a non-control instruction reads and writes (see the module doc)."""
    if ins.opcode in FREE or ins.opcode in ASYNC_DONE:
        return 0
    if ins.opcode == "fusion":
        return fusion_bytes(mod, comp, ins)
    if ins.opcode in SLICING:
        return 2 * type_bytes(ins.type)
    if ins.opcode in IN_PLACE:
        return 2 * _written(mod, comp, ins)
    return type_bytes(ins.type) + sum(mod.operand_bytes(comp, ins, k)
                                      for k in range(len(ins.operands)))


def sweep_trips(mod: Module, body: str, cache_shapes) -> int | None:
    """Trip count of a loop that reads a KV cache block by block (the attention's block
    loop): the cache's length over the block's, i.e. the whole cache, as at the end of the
    context. `cache_shapes`: per-device (L, B, K, S, H) of each cache. None: no such read."""
    whole = {tuple(c) for c in cache_shapes}
    layer = {tuple(c[1:]) for c in cache_shapes} | {(1,) + tuple(c[1:]) for c in cache_shapes}
    comps = [body] + [c for i in mod.instrs[body] if i.opcode == "fusion" for c in _callees(i.line)]
    trips = None
    for c in comps:
        for ins in mod.instrs[c]:
            if ins.opcode != "dynamic-slice" or not ins.operands:
                continue
            src = _arrays(mod.types[c].get(ins.operands[0], ""))
            out = _arrays(ins.type)
            if not src or not out or src[0][1] not in whole | layer:
                continue
            length, block = src[0][1][-2], out[0][1][-2]  # the slots axis (S)
            if block > 1:  # a block, not one slot (a new token's K/V patched into a block)
                trips = max(trips or 0, -(-length // block))
    return trips


def _constant(mod: Module, comp: str, name: str) -> int | None:
    line = next((i.line for i in mod.instrs[comp] if i.name == name), "")
    m = _CONST.search(line) if " constant(" in line else None
    return int(m.group(1)) if m else None


def loop_trips(mod: Module, comp: str, ins, cache_shapes) -> int | None:
    """Iterations of while instruction `ins` in `comp`: XLA:CPU's `known_trip_count`; else
    (the TPU compiler's HLO has none) its condition's bound, a compare of the counter with a
    constant or with a tuple element initialised to one; else `sweep_trips` (the
    attention's block loop). None: unknown."""
    m = _TRIPS.search(ins.line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", ins.line).group(1)
    body = re.search(r"body=%?([\w.\-]+)", ins.line).group(1)
    instrs = {i.name: i for i in mod.instrs.get(cond, [])}
    root = next((i for i in mod.instrs.get(cond, []) if i.line.lstrip().startswith("ROOT")),
                None)
    if root is not None and root.opcode == "compare" and "direction=LT" in root.line:
        bound = instrs.get(root.operands[1]) if len(root.operands) > 1 else None
        if bound is not None and bound.opcode == "constant":
            return _constant(mod, cond, bound.name)
        if bound is not None and bound.opcode == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", bound.line).group(1))
            init = next((i for i in mod.instrs[comp] if i.name == ins.operands[0]), None)
            if init is not None and init.opcode == "tuple" and index < len(init.operands):
                n = _constant(mod, comp, init.operands[index])
                if n is not None:
                    return n
    return sweep_trips(mod, body, cache_shapes)


@dataclasses.dataclass
class Traffic:
    """Bytes of one round per device: `lo` (every conditional's cheapest branch) .. `hi`
    (its dearest), `ops` the hi path's bytes by JAX op (op_name), `guessed_loops` the loops
    counted once for want of a trip count."""

    lo: int = 0
    hi: int = 0
    ops: dict = dataclasses.field(default_factory=dict)
    guessed_loops: int = 0

    def add(self, other: "Traffic", times: int = 1) -> None:
        self.lo += times * other.lo
        self.hi += times * other.hi
        for k, v in other.ops.items():
            self.ops[k] = self.ops.get(k, 0) + times * v
        self.guessed_loops += other.guessed_loops

    def top_ops(self, n: int = 5) -> list[tuple[str, int]]:
        return sorted(self.ops.items(), key=lambda kv: -kv[1])[:n]


def _op_label(mod: Module, ins: Instr) -> str:
    """The JAX op behind an instruction: its op_name without the jit/while/body plumbing;
    a fusion without one (XLA:CPU's matmul fusions) by its root's: "fusion dot"."""
    m = _OP_NAME.search(ins.line)
    if not m and ins.opcode == "fusion":
        body = mod.instrs.get(next(iter(_callees(ins.line)), ""), [])
        root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
        return f"fusion {_op_label(mod, root)}" if root else ins.opcode
    if not m:
        return ins.opcode
    parts = [p for p in m.group(1).split("/") if p and not p.startswith(("jit(", "branch_"))
             and p not in ("while", "body", "cond", "closed_call", "checkpoint")]
    return f"{ins.opcode} {'/'.join(parts[-3:])}"


def computation_traffic(mod: Module, comp: str, caches) -> Traffic:
    out = Traffic()
    for ins in mod.instrs[comp]:
        called = _callees(ins.line)
        if ins.opcode == "while":
            inner = Traffic()
            for c in called:
                inner.add(computation_traffic(mod, c, caches))
            trips = loop_trips(mod, comp, ins, caches)
            if trips is None:
                out.guessed_loops += 1
            out.add(inner, trips or 1)
        elif ins.opcode == "conditional":
            branches = [computation_traffic(mod, c, caches) for c in called]
            dear = max(branches, key=lambda t: t.hi)
            # a branch that does next to nothing skips rows that are done (a draft step
            # when no row drafts): a live round takes the other one
            live = [t.lo for t in branches if t.hi >= SKIP_FRACTION * dear.hi] or [dear.lo]
            out.add(Traffic(min(live), dear.hi, dear.ops, dear.guessed_loops))
        elif ins.opcode == "call":
            for c in called:
                out.add(computation_traffic(mod, c, caches))
        else:
            b = instr_bytes(mod, comp, ins)
            if b:
                label = _op_label(mod, ins)
                out.add(Traffic(b, b, {label: b}))
    return out


def round_traffic(hlo: str, cache_shapes) -> Traffic:
    """Per-device bytes one round of the compiled generation's decode loop moves;
    `cache_shapes`: the per-device (L, B, K, S, H) of each model's K/V cache."""
    mod = Module(hlo)
    return computation_traffic(mod, decode_loop_body(mod.comps), cache_shapes)
