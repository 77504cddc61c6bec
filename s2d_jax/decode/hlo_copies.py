"""Hidden cache traffic in a compiled decode loop, read off the optimized HLO text.

A round must update the KV caches in place: scatter / dynamic-update-slice into the
carried buffer. Anything else that produces a whole cache (or one layer of it) inside the
loop body is a hidden pass over the cache: a `copy` (XLA inserts one when a buffer cannot
be shared, e.g. a cache passed into both branches of a `lax.cond` and also live after
it), or a `convert` / elementwise fusion that rebuilds it (a bf16 scatter widened to f32
and back). `cache_traffic(hlo, shapes)` lists those instructions by kind; all empty means none.
"""

from __future__ import annotations

import re

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=(%?[\w.\-]+)|branch_computations=\{([%\w.\-, ]+)\}")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
# Ops that pass a buffer through, or write into it in place.
IN_PLACE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
            "call", "scatter", "dynamic-update-slice", "custom-call", "optimization-barrier",
            "copy-start", "copy-done", "all-reduce", "collective-permute"}
_ROOT_IN_PLACE = re.compile(r"ROOT\s+%?[\w.\-]+\s*=\s*\S+\s+(scatter|dynamic-update-slice)\(")


def parse_computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines; "__entry__" names the ENTRY one."""
    comps, name = {}, None
    for line in hlo.splitlines():
        if name is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                name = m.group(1)
                comps[name] = []
                if line.startswith("ENTRY"):
                    comps["__entry__"] = comps[name]
        elif line.strip() == "}":
            name = None
        else:
            comps[name].append(line)
    return comps


def _callees(line: str) -> list[str]:
    out = []
    for one, many in _CALLED.findall(line):
        out += [c.strip().lstrip("%") for c in (one or many).split(",") if c.strip()]
    return out


def reachable(comps: dict, root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += _callees(line)
    return seen


def decode_loop_body(comps: dict) -> str:
    """The body of the ENTRY while loop that calls the most computations: the round loop
    (the prefill's layer scans and key splits are smaller loops)."""
    bodies = []
    for line in comps["__entry__"]:
        m = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
        if m:
            bodies.append(m.group(1))
    if not bodies:
        raise ValueError("no while loop in the ENTRY computation")
    return max(bodies, key=lambda b: len(reachable(comps, b)))


def _fusion_in_place(comps: dict, line: str) -> bool:
    """A fusion whose root is a scatter / dynamic-update-slice writes into its operand."""
    for c in _callees(line):
        if any(_ROOT_IN_PLACE.search(l) for l in comps.get(c, [])):
            return True
    return False


def _kind(comps: dict, opcode: str, line: str) -> str:
    if opcode == "copy":
        return "copies"
    root = [l for c in _callees(line) for l in comps.get(c, []) if "ROOT" in l]
    if opcode == "convert" or (opcode == "fusion" and root and " convert(" in root[0]):
        return "converts"
    return "other"


def cache_traffic(hlo: str, cache_shapes) -> dict[str, list[str]]:
    """Instructions of the decode loop body (and everything it calls) that produce an
    array shaped like a whole cache (`cache_shapes`: per-device dims (L, B, K, S, H) of
    each cache) other than by passing it through or updating it in place, by kind:
    "copies" (also of one layer), "converts" (a whole cache widened or narrowed: XLA:CPU
    has no 16-bit float scatter and runs a bf16 cache's scatter in f32; GPU and TPU
    scatter bf16 natively) and "other". Fused computations are judged by their fusion
    instruction, not their insides. All empty: every cache is updated in place."""
    whole = {tuple(s) for s in cache_shapes}
    layer = {tuple(s[1:]) for s in cache_shapes} | {(1,) + tuple(s[1:]) for s in cache_shapes}
    comps = parse_computations(hlo)
    fused = set()
    for lines in comps.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(_callees(line))
    found = {"copies": [], "converts": [], "other": []}
    for c in sorted(reachable(comps, decode_loop_body(comps)) - fused):
        for line in comps[c]:
            m = _INSTR.match(line)
            if not m or m.group(3) in IN_PLACE:
                continue
            result, opcode = m.group(2), m.group(3)
            arrays = _ARRAY.findall(result) if result.startswith("(") else _ARRAY.findall(result)[:1]
            dims = [tuple(int(d) for d in x.split(",") if d) for x in arrays]
            # A copy of one layer is a hidden pass too; other ops of one layer's shape are
            # the attention reading it (on CPU widened to f32 for the bf16 matmul).
            if not any(d in (whole | layer if opcode == "copy" else whole) for d in dims):
                continue
            if opcode == "fusion" and _fusion_in_place(comps, line):
                continue
            found[_kind(comps, opcode, line)].append(f"{c}: {line.strip()[:200]}")
    return found
