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
escalating; a branch that touches next to nothing is the skip of finished rows, not live).

The TPU compiler's program is read as HBM traffic: arrays whose layout names an on-chip
memory space (`S(1)` VMEM, `S(2)`/`S(6)` scalar and sync memory) cost nothing (on XLA:CPU
none does); a parameter its fusion reads only through slices, also in nested fusions (the
TPU slices a layer off a weight stack in a kLoop fusion inside the matmul's, an int8 one
through a nested re-tiling copy), costs its slices; `copy-start` / `slice-start`
(prefetches into VMEM, evictions out of it) cost their HBM side; `ConcatBitcast` joins
buffers in place. `Traffic.on_chip` says what the round loop keeps in VMEM from round to
round (its reads there are not in `lo`/`hi`).
"""

from __future__ import annotations

import dataclasses
import re

from s2d_jax.decode.hlo_copies import _callees, decode_loop_body
from s2d_jax.decode.hlo_module import (Instr, Module, arrays_of, hbm_bytes, in_hbm, nbytes,
                                       root_of, type_bytes, users_of)

_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CONST = re.compile(r"constant\((-?\d+)\)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "optimization-barrier", "copy-done", "slice-done",
        "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done"}
# Custom calls of the TPU compiler that move nothing: a concatenation of buffers already
# adjacent (its async slices' destinations), an allocation, an index-range assertion.
FREE_CALLS = {"ConcatBitcast", "AllocateBuffer", "AssumeGatherIndicesInBound"}
# Kernels handed a whole layer stack ([L, ...]) and the layer to read as operands (a layer's
# slice would be copied out for the call): each reads one layer of each stack, at most
# (gpu_attention.py's cached attention: slots up to the row's position of one cache layer).
ONE_LAYER_CALLS = ("cache_attention_kernel",)
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


def _outputs(mod: Module, comp: str, ins: Instr) -> list[int]:
    """Bytes `ins` writes per output (a tuple root: each element): its update when it
    updates a buffer in place (also inside a nested fusion), else the output whole."""
    if ins.opcode in IN_PLACE:
        return [mod.operand_bytes(comp, ins, IN_PLACE[ins.opcode])]
    if ins.opcode == "tuple":
        by_name = {i.name: i for i in mod.instrs[comp]}
        return [sum(_outputs(mod, comp, by_name[o])) if o in by_name else 0
                for o in ins.operands]
    if ins.opcode == "fusion":
        nested = _callees(ins.line)[0]
        return _outputs(mod, nested, root_of(mod.instrs[nested]))
    return [type_bytes(ins.type)]


def _written(mod: Module, comp: str, ins: Instr) -> int:
    return sum(_outputs(mod, comp, ins))


def _scalar(ins: Instr) -> bool:
    """A scalar result: index arithmetic (an attention block's start, min(c * C, S - C))."""
    arrays = arrays_of(ins.type)
    return bool(arrays) and all(dims == () for _, dims, _ in arrays)


def _param(body: list[Instr], k: int) -> Instr | None:
    return next((i for i in body if i.opcode == "parameter"
                 and re.search(rf"parameter\({k}\)", i.line)), None)


def _relayout(body: list[Instr]) -> bool:
    """A nested fusion that only re-tiles its one operand: the TPU compiler's copy_fusion
    turning an int8 weight stack's (32,128) tiles into the (8,128) ones of the bf16 it is
    converted to, inside the kLoop fusion that slices a layer off the stack."""
    return (sum(i.opcode == "parameter" for i in body) == 1
            and all(i.opcode in ("parameter", "copy", "bitcast") for i in body))


def _sliced_read(mod: Module, comp: str, name: str) -> int | None:
    """Bytes a fusion body reads of its parameter `name` when it reads only slices of it
    (dynamic-slice / gather, also inside nested fusions: the TPU compiler nests a kLoop
    fusion that slices one layer off a weight stack inside the matmul's kOutput fusion) or
    only updates it in place; None: read whole."""
    users = users_of(mod.instrs[comp], name)
    if not users:
        return None
    total = 0
    for user, k in users:
        if user.opcode in SLICING and k == 0:
            total += type_bytes(user.type)
        elif user.opcode in IN_PLACE and k == 0:
            continue  # the buffer updated in place: only the update is touched
        elif user.opcode == "fusion" and _relayout(mod.instrs[_callees(user.line)[0]]):
            # fused into this body, a re-tiling computes only the elements its users read
            part = _sliced_read(mod, comp, user.name)
            if part is None:
                return None
            total += part
        elif user.opcode == "fusion":
            nested = _callees(user.line)[0]
            p = _param(mod.instrs[nested], k)
            part = _sliced_read(mod, nested, p.name) if p is not None else None
            if part is None:
                return None
            total += part
        else:
            return None
    return total


def fusion_bytes(mod: Module, comp: str, ins: Instr) -> int:
    """A fusion reads each operand in HBM whole, or only the slices its body takes of it,
    or nothing of the buffer its root updates in place; it writes its outputs that lie in
    HBM (whole, or the update)."""
    fused = _callees(ins.line)[0]
    body = mod.instrs[fused]
    if (all(i.opcode in VIEW or _scalar(i) for i in body)
            and root_of(body).opcode != "parameter" and in_hbm(ins.type)):
        return 0  # a slice its consumer reads in place on a GPU/TPU (XLA:CPU copies it out)
    outs = _outputs(mod, fused, root_of(body))
    arrays = arrays_of(ins.type)
    if len(outs) == len(arrays):
        total = sum(b for b, (_, _, space) in zip(outs, arrays) if space == 0)
    else:  # outputs nested deeper than one tuple: in HBM as the whole type lies
        total = sum(outs) if hbm_bytes(ins.type) else 0
    for p in (i for i in body if i.opcode == "parameter"):
        k = int(re.search(r"parameter\((\d+)\)", p.line).group(1))
        operand = mod.operand_type(comp, ins, k)
        if not hbm_bytes(operand):
            continue  # on-chip (VMEM): no HBM traffic
        sliced = _sliced_read(mod, fused, p.name)
        total += hbm_bytes(operand) if sliced is None else sliced
    return total


def _async_start(mod: Module, comp: str, ins: Instr) -> int:
    """copy-start (result: destination, source, context) and slice-start (result: (source),
    destination, sync flag): the source's bytes (the slice's) read where the source lies in
    HBM, the destination's written where it does (a prefetch into VMEM: the read only)."""
    arrays = arrays_of(ins.type)
    if len(arrays) < 2:
        return 0
    dt, dims, space = arrays[1] if ins.opcode == "slice-start" else arrays[0]
    size = nbytes(dt, dims)
    return (size if in_hbm(mod.operand_type(comp, ins, 0)) else 0) + (size if space == 0 else 0)


def instr_bytes(mod: Module, comp: str, ins: Instr) -> int:
    """Bytes of HBM a non-control instruction reads and writes (see the module doc)."""
    if ins.opcode in FREE:
        return 0
    if ins.opcode == "custom-call":
        m = _TARGET.search(ins.line)
        if m and m.group(1) in FREE_CALLS:
            return 0
    if ins.opcode == "fusion":
        return fusion_bytes(mod, comp, ins)
    if ins.opcode in ("copy-start", "slice-start"):
        return _async_start(mod, comp, ins)
    if ins.opcode in SLICING:
        read = type_bytes(ins.type) if in_hbm(mod.operand_type(comp, ins, 0)) else 0
        return read + hbm_bytes(ins.type)
    if ins.opcode in IN_PLACE:
        update = mod.operand_type(comp, ins, IN_PLACE[ins.opcode])
        return hbm_bytes(update) + (type_bytes(update) if in_hbm(ins.type) else 0)
    operands = [mod.operand_type(comp, ins, k) for k in range(len(ins.operands))]
    result = hbm_bytes(ins.type)
    if ins.opcode == "custom-call" and any(k in ins.line for k in ONE_LAYER_CALLS):
        return result + sum(_one_layer(t) for t in operands)
    if ins.opcode.endswith("-start"):  # an async collective: a result tuple repeats its
        dt, dims, space = arrays_of(ins.type)[-1]  # operands; the last array is its own
        result = nbytes(dt, dims) if space == 0 else 0
    return result + sum(hbm_bytes(t) for t in operands)


def _one_layer(type_text: str) -> int:
    """HBM bytes of one layer of an operand of a ONE_LAYER_CALLS kernel: a rank-5 stack
    ([L, B, K, S, H], a KV cache) read one layer; anything else whole."""
    arrays = arrays_of(type_text)
    if len(arrays) == 1 and len(arrays[0][1]) == 5 and arrays[0][2] == 0:
        return hbm_bytes(type_text) // arrays[0][1][0]
    return hbm_bytes(type_text)


def sweep_trips(mod: Module, body: str, cache_shapes) -> int | None:
    """Trip count of a loop that reads a KV cache block by block (the attention's block
    loop): the cache's length over the block's, i.e. the whole cache, as at the end of the
    context. `cache_shapes`: per-device (L, B, K, S, H) of each cache. None: no such read."""
    whole = {tuple(c) for c in cache_shapes}
    layer = {tuple(c[1:]) for c in cache_shapes} | {(1,) + tuple(c[1:]) for c in cache_shapes}
    comps, todo = [], [body]
    while todo:  # the body and its fusions, nested ones too (the TPU compiler's)
        c = todo.pop()
        comps.append(c)
        todo += [f for i in mod.instrs[c] if i.opcode == "fusion" for f in _callees(i.line)]
    trips = None
    for c in comps:
        for ins in mod.instrs[c]:
            if ins.opcode != "dynamic-slice" or not ins.operands:
                continue
            src = arrays_of(mod.types[c].get(ins.operands[0], ""))
            out = arrays_of(ins.type)
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
    counted once for want of a trip count, `on_chip` the bytes the round loop keeps in
    on-chip memory from round to round (the TPU compiler holds a small model's caches or
    weights in VMEM: read there, they cost no HBM traffic; 0 on XLA:CPU)."""

    lo: int = 0
    hi: int = 0
    ops: dict = dataclasses.field(default_factory=dict)
    guessed_loops: int = 0
    on_chip: int = 0

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
            # a branch that touches next to nothing skips rows that are done (a draft step
            # when no row drafts): a live round takes the other one. Judged by the bytes it
            # touches in any memory: on TPU S2D's no-escalation branch moves little HBM (the
            # deeper wk/wv it reads for the K/V fill are prefetched into VMEM before the
            # conditional) but is live.
            touched = [computation_traffic(mod.any_space(), c, caches).hi for c in called]
            live = [t.lo for t, b in zip(branches, touched)
                    if b >= SKIP_FRACTION * max(touched)] or [dear.lo]
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
    body = decode_loop_body(mod.comps)
    out = computation_traffic(mod, body, cache_shapes)
    carried = next((i.type for i in mod.instrs[body] if i.opcode == "parameter"), "")
    out.on_chip = sum(nbytes(dt, dims) for dt, dims, space in arrays_of(carried)
                      if space != 0 and dims)
    return out


def program_traffic(hlo: str, cache_shapes) -> Traffic:
    """Per-device bytes a whole compiled program moves: its ENTRY computation walked as
    `round_traffic` walks the round loop's body (round_cost.py's one-round program, set
    beside the loop's round). No `on_chip`: a program's inputs and outputs lie in HBM."""
    mod = Module(hlo)
    return computation_traffic(mod, "__entry__", cache_shapes)
