"""An optimized HLO module's text parsed for the walks over it (hlo_traffic.py,
round_copies.py): computations, their instructions with types and operands, and the bytes
of HLO types, whole or only in HBM (the TPU compiler marks on-chip memory spaces in the
layout: `bf16[8,128]{1,0:T(8,128)(2,1)S(1)}` lies in VMEM)."""

from __future__ import annotations

import dataclasses
import math
import re

from s2d_jax.decode.hlo_copies import parse_computations

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}

def arrays_of(type_text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, dims, memory space) of each array of an HLO type, in order."""
    out = []
    for dt, dims, layout in _ARRAY.findall(type_text):
        space = _SPACE.search(layout)
        out.append((dt, tuple(int(d) for d in dims.split(",") if d),
                    int(space.group(1)) if space else 0))
    return out


def nbytes(dt: str, dims) -> int:
    return DTYPE_BYTES.get(dt, 0) * math.prod(dims)


def type_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array `bf16[8,128]{1,0}` or a tuple of them."""
    return sum(nbytes(dt, dims) for dt, dims, _ in arrays_of(type_text))


def hbm_bytes(type_text: str) -> int:
    """Bytes of the arrays of an HLO type that lie in device memory (HBM): memory space 0.
    The TPU compiler annotates the others in the layout: `S(1)` on-chip VMEM, `S(2)` /
    `S(6)` scalar and sync memories; traffic to them is no HBM traffic. XLA:CPU's arrays
    carry none (all count)."""
    return sum(nbytes(dt, dims) for dt, dims, space in arrays_of(type_text) if space == 0)


def in_hbm(type_text: str) -> bool:
    """The (first) array of a type lies in HBM."""
    arrays = arrays_of(type_text)
    return bool(arrays) and arrays[0][2] == 0


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
        self.hlo, self._any_space = hlo, None
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

    def any_space(self) -> "Module":
        """This module with the memory-space annotations dropped: every array counts as if
        in HBM (what an instruction touches anywhere, not only its HBM traffic)."""
        if self._any_space is None:
            self._any_space = Module(_SPACE.sub("", self.hlo)) if _SPACE.search(self.hlo) \
                else self
        return self._any_space

    def operand_type(self, comp: str, ins: Instr, k: int) -> str:
        return self.types[comp].get(ins.operands[k], "") if k < len(ins.operands) else ""

    def operand_bytes(self, comp: str, ins: Instr, k: int) -> int:
        return type_bytes(self.operand_type(comp, ins, k))


def root_of(body: list[Instr]) -> Instr:
    return next((i for i in body if i.line.lstrip().startswith("ROOT")), body[-1])


def users_of(instrs: list[Instr], name: str) -> list[tuple[Instr, int]]:
    """(user, operand index) of `name`, looking through bitcasts."""
    out = []
    for ins in instrs:
        for k, op in enumerate(ins.operands):
            if op == name:
                out += (users_of(instrs, ins.name) if ins.opcode == "bitcast" else [(ins, k)])
    return out
