"""A decode step's matmuls under XLA:GPU's two GEMM backends: Triton and cuBLAS (issue 70).

XLA:GPU emits most matmuls as Triton GEMM fusions (`xla_gpu_enable_triton_gemm`, on by
default); with the flag off it calls cuBLAS. On the lent H100 (docs/results.md) the Triton
GEMM read the 32 stacked `w_up` matrices of a 7B-shaped step at 0.83 TB/s and cuBLAS at
2.1 TB/s, once. Here the same jitted loop is compiled twice, the flag given per compile
(`lowered.compile({"xla_gpu_enable_triton_gemm": False})`: a compiler option, so one
process times both, no XLA_FLAGS child), for every distinct weight shape of a decode
step at a few row counts (1: an AR step; 5: a gamma-4 verify window; 8):
- a pass multiplies the rows by each layer's matrix of that shape in turn, L matrices
  (the model's layer count) each its own buffer, so a pass reads L matrices from memory,
  not one from L2, each layer's input depending on the last layer's output. Own buffers,
  not slices of an [L, K, N] stack as the model holds them: in a deviceless H100 compile
  (jax 0.10.2's CUDA plugin) a static slice of a stack was copied to a temporary before
  each cuBLAS call read it (Triton fused it into its operand), and a slice at a traced
  index before either backend's GEMM: that would time the copy, not the GEMM.
  `copies` counts weight-sized buffers a compiled pass writes besides (0 expected); the
  model-level comparison (device_check: the target's verify call compiled both ways)
  times what the model's own program does;
- a probe times n passes in one program, (median T(n) - median T(0)) / n
  (call_costs.CallProbe), the backends' probes sampled in turn.
On a CPU (or TPU) the flag does not apply: one compile, XLA's own, is timed and the
comparison is "n/a on cpu". The library's defaults are not changed here: `choose` only
says which backend the measurements favour and the flag a user would set.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

TRITON_FLAG = "xla_gpu_enable_triton_gemm"
# backend -> the compiler options of its compile (XLA:GPU only)
BACKENDS = {"triton": {TRITON_FLAG: True}, "cublas": {TRITON_FLAG: False}}
ROWS = (1, 5, 8)      # an AR step, a gamma-4 verify window, 8 rows
TIE = 0.03            # a winner by less than this fraction of the step's matmul time: none
PASS_BYTES = 2**33    # bytes a timed loop reads at least (calls = this / a pass's bytes)
MIN_CALLS, MAX_CALLS = 24, 1024


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One distinct weight shape [k, n] of a decode step: `per_layer` matrices of it in
    each of `layers` layers (the LM head: 1 and 1)."""

    name: str
    k: int
    n: int
    per_layer: int
    layers: int
    itemsize: int = 2

    def pass_bytes(self, rows: int) -> int:
        """Bytes one pass over the stack moves: its weights, each layer's rows in and out."""
        return self.layers * (self.k * self.n + rows * (self.k + self.n)) * self.itemsize


def decode_gemms(cfg) -> list[Gemm]:
    """The distinct [K, N] weight shapes of one decode step of `cfg` (model/block.py's
    projections, heads flattened as out_projection applies them, and the LM head), with
    how many matrices of each a layer has: Vicuna-7B -> wq/wk/wv/wo [4096, 4096] x 4,
    w_gate/w_up [4096, 11008] x 2, w_down [11008, 4096] x 1, lm_head [4096, 32000]."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, k, n in (("wq", d, q), ("wk", d, kv), ("wv", d, kv), ("wo", q, d),
                       ("w_gate", d, f), ("w_up", d, f), ("w_down", f, d)):
        shapes.setdefault((k, n), []).append(name)
    size = np.dtype(cfg.param_dtype).itemsize
    out = [Gemm("/".join(names), k, n, len(names), cfg.num_layers, size)
           for (k, n), names in shapes.items()]
    return out + [Gemm("lm_head", d, v, 1, 1, size)]


def _gemm_loop(ws, x, n):
    """n passes of rows x [R, K] through each layer's matrix [K, N] of `ws` in turn; a
    layer's input carries a vanishing part of the last layer's output (its sum), so no
    matmul can be skipped, hoisted or reordered."""
    def one_pass(i, carry):
        x, acc = carry
        for w in ws:
            s = jnp.sum(jnp.einsum("rk,kn->rn", x, w), dtype=jnp.float32)
            x, acc = x + (1e-30 * s).astype(x.dtype), acc + s
        return x, acc

    return jax.lax.fori_loop(0, n, one_pass, (x, jnp.float32(0)))[1]


def backends(platform: str) -> dict[str, dict]:
    """backend -> compiler options: Triton and cuBLAS on a GPU, XLA's only one elsewhere."""
    return dict(BACKENDS) if platform == "gpu" else {"xla": {}}


def kernels(hlo_text: str) -> list[str]:
    """Which GEMM kernels a compiled program calls: 'triton' (a __triton_gemm fusion),
    'cublas' (a __cublas$gemm / cuBLASLt custom call), else 'xla' (XLA's own emitter: a CPU
    dot, or a GPU matrix-vector product it lowers as a reduction)."""
    found = [k for k, mark in (("triton", "__triton"), ("cublas", "__cublas")) if mark in hlo_text]
    return found or ["xla"]


def copies(hlo_text: str, k: int, n: int) -> int:
    """Weight-sized [k, n] buffers the compiled program writes: fusions whose output is a
    matrix (a slice or copy of one, which the GEMM then reads instead of the weight in
    place; in a loop, counted once per loop body)."""
    return len(re.findall(rf"= bf16\[(?:1,)?{k},{n}\]\{{[0-9,]*\}} fusion\(", hlo_text))


def compile_loop(ws, x, options: dict):
    """The jitted loop compiled for `ws` and `x` with `options` (per-compile XLA flags)."""
    return jax.jit(_gemm_loop).lower(ws, x, jnp.int32(1)).compile(options or None)


def calls_for(g: Gemm, rows: int) -> int:
    return int(min(MAX_CALLS, max(MIN_CALLS, math.ceil(PASS_BYTES / g.pass_bytes(rows)))))


def random_weights(g: Gemm, seed: int, on_host: bool, dtype) -> tuple:
    """`layers` random [k, n] matrices (values do not matter): drawn on the device, or with
    numpy for tiny shapes (no compile)."""
    if on_host:
        rng = np.random.default_rng(seed)
        return tuple(jax.device_put(rng.normal(0, 0.02, (g.k, g.n)).astype(dtype))
                     for _ in range(g.layers))
    draw = jax.jit(lambda key: 0.02 * jax.random.normal(key, (g.k, g.n), dtype))
    return tuple(draw(jax.random.key(seed * 1000 + i)) for i in range(g.layers))


def time_gemms(cfg, platform: str, samples: int, rows=ROWS, on_host: bool = False,
               progress=print, saved=lambda entry: None, verify: dict | None = None) -> dict:
    """Every decode_gemms shape of `cfg` at each row count under each backend: seconds
    per pass, GB/s, the compiled kernels and weight copies, the faster backend; then
    `choose` (with `verify`, the model's verify calls under each backend, if measured).
    `saved(entry)` after each shape (the caller rewrites its report)."""
    from s2d_jax.bench.call_costs import CallProbe
    opts = backends(platform)
    dtype = jnp.dtype(cfg.param_dtype)
    entry = {"platform": platform, "rows": list(rows), "backends": list(opts),
             "flag": TRITON_FLAG, "shapes": [], "step_s": None, "choice": None}
    for i, g in enumerate(decode_gemms(cfg)):
        ws = random_weights(g, 10 + i, on_host, dtype)
        shape = {**dataclasses.asdict(g), "by_rows": {}}
        entry["shapes"].append(shape)
        for r in rows:
            x = jnp.full((r, g.k), 0.01, dtype)
            probes = {}
            for b, o in opts.items():
                compiled = compile_loop(ws, x, o)
                hlo = compiled.as_text()
                probes[b] = (CallProbe(compiled, (ws, x), calls_for(g, r)),
                             {"kernels": kernels(hlo), "copies": copies(hlo, g.k, g.n)})
            for _ in range(samples):  # the backends in turn: the same machine state
                for p, _k in probes.values():
                    p.sample()
            times = {}
            for b, (p, k) in probes.items():
                t = _result(p, samples)
                times[b] = {"s": t, "gbps": t and g.pass_bytes(r) / t / 1e9, **k}
            row = {"backends": times, **dict(zip(("faster", "ratio"), faster(times, platform)))}
            shape["by_rows"][r] = row
            progress(gemm_line(g, r, row, platform))
        del ws, probes
        saved(entry)
    entry["step_s"] = {b: {r: _step(entry["shapes"], r, b) for r in rows} for b in opts}
    entry["choice"] = choose(entry["step_s"], platform, verify)
    saved(entry)
    return entry


def _result(probe, samples: int) -> float | None:
    """The probe's seconds per pass; a machine too noisy to time it (a tiny CPU shape under
    load) gets as many samples again, then None rather than ending the check."""
    from s2d_jax.errors import S2DError
    for retry in (True, False):
        try:
            return probe.result()
        except S2DError:
            if not retry:
                return None
            for _ in range(samples):
                probe.sample()


def faster(times: dict, platform: str) -> tuple[str, float | None]:
    """(the faster backend, slower / faster time) of {backend: {"s": ...}}, or
    ('n/a on cpu', None) off a GPU."""
    if platform != "gpu":
        return f"n/a on {platform}", None
    if any(times[b]["s"] is None for b in BACKENDS):
        return "- (not timed)", None
    fast, slow = sorted(BACKENDS, key=lambda b: times[b]["s"])
    return fast, times[slow]["s"] / times[fast]["s"]


def gemm_line(g: Gemm, rows: int, row: dict, platform: str) -> str:
    parts = ", ".join(f"{b} {1e3 * t['s']:.3f} ms {t['gbps']:.0f} GB/s ({'+'.join(t['kernels'])}"
                      f"{', %d weight copies' % t['copies'] if t['copies'] else ''})"
                      if t["s"] else f"{b} not timed (too noisy)"
                      for b, t in row["backends"].items())
    verdict = (f"{row['faster']} faster by {row['ratio']:.2f}x" if row["ratio"] else
               f"triton vs cublas: {row['faster']}")
    return f"gemm {g.name} [{rows}, {g.k}] x {g.layers} x [{g.k}, {g.n}]: {parts}; {verdict}"


def _step(shapes: list, rows: int, backend: str) -> float | None:
    """A step's matmul time at `rows`: each shape's pass times its matrices per layer."""
    t = [s["per_layer"] * s["by_rows"][rows]["backends"][backend]["s"] for s in shapes
         if s["by_rows"][rows]["backends"][backend]["s"] is not None]
    return sum(t) if len(t) == len(shapes) else None


def _verdict(total: dict) -> tuple[str, str, float]:
    """(faster, slower, slower / faster) of {backend: seconds}."""
    fast, slow = sorted(total, key=total.get)
    return fast, slow, total[slow] / total[fast]


NAMES = {"triton": "Triton", "cublas": "cuBLAS"}


def choose(step_s: dict, platform: str, verify: dict | None = None) -> dict:
    """The GEMM backend the measurements favour for the decode shapes. The kernels: the one
    with less matmul time over a step (each shape's pass times its matrices per layer),
    summed over the row counts. The default: with `verify` ({backend: {window: s}}, the
    model's verify calls compiled under each backend) the faster model, else the faster
    kernels; within TIE of each other, XLA's own (Triton). Only a recommendation: the
    flag a user would set, not a library default."""
    if platform != "gpu":
        return {"default": None, "why": f"n/a on {platform}: {TRITON_FLAG} is an XLA:GPU "
                                        f"flag", "xla_flags": None}
    if any(t is None for v in step_s.values() for t in v.values()):
        return {"default": None, "why": "not chosen: some matmuls could not be timed (too "
                                        "noisy)", "xla_flags": None}
    rows = sorted(next(iter(step_s.values())))
    over = "/".join(map(str, rows))
    k_fast, k_slow, k_gain = _verdict({b: sum(v.values()) for b, v in step_s.items()})
    kernels_said = (f"the kernels: {NAMES[k_fast]} {k_gain:.2f}x less matmul time a step "
                    f"over rows {over}")
    basis, fast, gain = "kernels", k_fast, k_gain
    if verify and all(verify.get(b) for b in BACKENDS):
        windows = sorted(set(verify["triton"]) & set(verify["cublas"]))
        fast, _, gain = _verdict({b: sum(verify[b][w] for w in windows) for b in BACKENDS})
        basis = "model"
        kernels_said = (f"the model's verify calls (windows {'/'.join(map(str, windows))}): "
                        f"{NAMES[fast]} {gain:.2f}x faster; {kernels_said}")
        if fast != k_fast:
            kernels_said += (" (they disagree: the model's program adds what the kernels "
                             "alone do not, e.g. copies of its stacked weights' slices)")
    default = fast if gain >= 1 + TIE else "triton"
    if gain < 1 + TIE:
        kernels_said = f"no clear winner (under {1 + TIE:.2f}x): keep XLA's default; " \
                       + kernels_said
    per_rows = {r: min(step_s, key=lambda b: step_s[b][r]) for r in rows}
    return {"default": default, "basis": basis, "speedup": gain, "per_rows": per_rows,
            "why": kernels_said, "kernel_speedup": k_gain, "kernel_winner": k_fast,
            "xla_flags": f"--{TRITON_FLAG}=false" if default == "cublas" else None}
