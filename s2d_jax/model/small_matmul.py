"""A CPU matmul for the few rows of a decode step or verify window (small_matmul.cc).

At batch 1 a decode step is bound by reading the weights, and a verify window of k tokens
should cost about one step. XLA's CPU backend breaks that: one row goes through a
matrix-vector kernel at memory speed, two or more through a general matmul that packs
the weights on every call (SmolLM2-135M: a 2-token forward cost 1.33 one-token steps).
The C++ kernel streams each weight once for up to 8 rows at a time, on XLA's own thread
pool, through an XLA FFI custom call; it reads one layer of a stacked weight in place
(no per-layer slice copy in the layer scan), and computes every row the same way
whatever the row count, so a token's projections do not depend on how many tokens
share the call.

Weight-only quantized weights (quantize.QuantizedWeight) are read as stored: per-channel
int8 by this kernel (scaled after), 8- and 4-bit blocks with per-group scales (and Q4_1's
offsets, float32 or the GGUF's float16) by one of two kernels, chosen by
`activation_mode()`:
  "int8" (the default on AVX-512 VNNI CPUs): quant_dot8.cc rounds the activations to int8
    per block of 32 and sums the products in integers (vpdpbusd), as llama.cpp computes a
    GGUF's matmuls; a block's q / k / v and its gate / up take one call (`matmul_shared`).
  "float": quant_dot8's alternative, quant_matmul.cc, dequantizes each weight vector in
    registers exactly as QuantizedWeight.astype does and multiply-adds float32 rows: exact
    to the dequantized model, and compute-bound past one row.
Either way a step streams the quantized bytes, and a row's result does not depend on the
row count. `python -m infer.matmul_bench --formats Q4_1:int8,Q4_1:float,f32` times them.

It is built on first use with the system C++ compiler into `$S2D_JAX_CACHE/kernels`
(default ~/.cache/s2d-jax), keyed by the source, jaxlib and the CPU. Without a compiler
(or with S2D_SMALL_MATMUL=0, or on a backend other than a single CPU device) the model
keeps XLA's dots; `status()` says which path is in use and why.

By default the decode path takes the kernels only on a CPU with AVX-512: their register
tiles (64 columns x 4 rows, 16 accumulators of 16 lanes) were sized for its 32 vector
registers. On an AVX2 AMD EPYC (Zen 3, 16 registers of 8 lanes) the same build measured
slower than XLA's dots at every row count (SmolLM2 step 71.8 vs 40.9 ms at 1 row, 183 vs
54 at 2: `python -m infer.matmul_bench`, docs/results.md). The same holds for quantized
weights: built for AVX2 (x86-64-v3, on the Zen 4), the Q4_1 kernel's SmolLM2 step took
about as long as XLA's path, which dequantizes every weight each call (259 vs 265 ms at 1
row, 387 vs 315 at 4, interleaved under load; AVX-512: 19 ms). S2D_SMALL_MATMUL=1 forces the
kernels on any CPU; `forced()` does for one trace (tests, the matmul benchmark).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from flax import struct

_HERE = os.path.dirname(os.path.abspath(__file__))
# One library for the CPU decode path's kernels: the matmuls here (float and per-channel
# int8 weights; block-quantized ones, quant_matmul.cc) and the cached attention
# (cpu_attention.cc, called from model/attention.py), built and loaded together.
SOURCES = tuple(os.path.join(_HERE, f)
                for f in ("small_matmul.cc", "quant_matmul.cc", "quant_dot8.cc", "cpu_attention.cc"))
# included by them: part of the cache key
HEADERS = tuple(os.path.join(_HERE, f) for f in ("cpu_vector.h", "cpu_chunks.h", "quant_layer.h"))
# Rows served by the kernel (in passes of 8 over the weights); more rows (a prefill) go to
# XLA's general matmul, which is compute-efficient there.
MAX_ROWS = 32
# Rows a block-quantized weight with int8 activations takes on the kernel: every verify
# window of a batch (8 slots x 8 tokens, up to 32 x 8) rounds its activations as the AR
# steps do, so greedy speculative decoding stays equal to AR (XLA's dots, which a longer
# prefill takes, keep float32 activations: a few ulps are not the int8 rounding's ~1%).
MAX_QUANT_ROWS = 256
# -ffp-contract=off: the kernels fuse their multiply-adds explicitly (cpu_vector.h), the
# same way in every loop, instead of where the compiler's tuning for this CPU chooses
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w"]
_TARGETS = {"s2d_small_matmul_kn": "S2dSmallMatmulKN", "s2d_small_matmul_nk": "S2dSmallMatmulNK",
            "s2d_decode_attention": "S2dDecodeAttention", "s2d_quant_matmul": "S2dQuantMatmul",
            "s2d_quant_dot8": "S2dQuantDot8", "s2d_quant_dot8_shared": "S2dQuantDot8Shared"}
# How the block-quantized matmuls take their activations (quant_dot8.cc): "int8" quantizes
# them per block of 32 inputs and sums the products in integers, as llama.cpp computes a
# GGUF's matmuls (the default where the CPU has AVX-512 VNNI); "float" keeps them float32
# against the dequantized weights (quant_matmul.cc: exact to the dequantized model).
ACTIVATION_MODES = ("int8", "float")


@struct.dataclass
class StackedWeight:
    """Layer `index` of a stacked weight [L, ...]: the kernel reads it in place; other
    paths slice it (`value`)."""

    stack: jnp.ndarray
    index: jnp.ndarray

    @property
    def value(self) -> jnp.ndarray:
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)

    def astype(self, dtype) -> jnp.ndarray:
        return self.value.astype(dtype)


def _cache_dir() -> str:
    from s2d_jax.env import cache_root
    return os.path.join(cache_root(), "kernels")


def _cpu_key() -> str:
    """What the compiled code depends on besides the source: -march=native's CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


def library_path() -> str:
    src = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + jax.ffi.include_dir().encode() + jax.lib.__version__.encode()
                         + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    return os.path.join(_cache_dir(), f"small_matmul-{key}.so")


def _checksum_path(lib: str) -> str:
    return lib + ".sha256"


def _intact(lib: str) -> bool:
    """The library holds the bytes its build recorded: a truncated or half-copied file
    (an interrupted copy of the cache) would otherwise crash the process with SIGBUS when
    it is loaded, with no message."""
    from s2d_jax.readers import sha256_of
    try:
        with open(_checksum_path(lib)) as f:
            want = f.read().strip()
        return sha256_of(lib) == want
    except OSError:
        return False


def build(verbose: bool = False) -> str:
    """Compile the kernel (once; later calls find it) -> the shared library's path.
    A cached library whose checksum does not match is rebuilt. Raises RuntimeError with the
    reason when it cannot be built."""
    out = library_path()
    if os.path.exists(out):
        if _intact(out):
            return out
        print(f"note: the cached CPU kernel library {out} does not match its checksum "
              f"(an interrupted copy?); rebuilding it", file=sys.stderr)
        for path in (out, _checksum_path(out)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}")
        from s2d_jax.readers import sha256_of
        digest = sha256_of(tmp)
        os.replace(tmp, out)  # atomic: a concurrent build finds a whole library or none
        # the checksum last: a library without one is rebuilt, never trusted
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(out), delete=False) as f:
            f.write(digest + "\n")
        os.replace(f.name, _checksum_path(out))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if verbose:
        print(f"built {out}", file=sys.stderr)
    return out


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """Build and register the FFI targets once; None when the kernel is available, else
    the reason it is not (also printed once, so a user knows which path runs)."""
    from s2d_jax.env import small_matmul_enabled
    if not small_matmul_enabled():
        return f"disabled by S2D_SMALL_MATMUL={os.environ['S2D_SMALL_MATMUL']}"
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        for name, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(name,
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        reason = f"not built ({e})"
        print(f"note: the small-matmul CPU kernel is {reason}; decoding uses XLA's dots "
              "(slower verification on CPU)", file=sys.stderr)
        return reason
    return None


def built() -> bool:
    """Whether the kernels are built and registered (whether or not the decode path takes
    them by default on this CPU)."""
    return jax.default_backend() == "cpu" and _load() is None


def status() -> str:
    """Which matmul a CPU decode step uses, in words."""
    if jax.default_backend() != "cpu":
        return f"XLA dots (backend {jax.default_backend()})"
    reason = _load()
    if reason is None and _choice[-1] is not True:
        reason = preferred()
    return "small-matmul kernel" if reason is None else f"XLA dots (kernel {reason})"


_activations: list[str | None] = [None]  # innermost `quant_activations` choice


@contextlib.contextmanager
def quant_activations(mode: str):
    """Block-quantized matmuls traced inside take their activations as `mode` ("int8" or
    "float"; tests and the matmul benchmark, on any CPU)."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activation mode {mode!r}: use one of {ACTIVATION_MODES}")
    # JAX's trace cache keys a jitted function by its arguments, not by this module's
    # state: a function traced under the other mode would be reused (compile_cache keys
    # executables by `_activations` too)
    jax.clear_caches()
    _activations.append(mode)
    try:
        yield
    finally:
        _activations.pop()
        jax.clear_caches()


def activation_mode() -> str:
    """How block-quantized matmuls take their activations in a trace now: the innermost
    `quant_activations`, else S2D_QUANT_ACTIVATIONS, else "int8" where the kernel has its
    VNNI tiles (elsewhere its int8 path is scalar: exact, but slower than float; a trace's
    choice is part of compile_cache's key, through `_activations` and the environment)."""
    if _activations[-1] is not None:
        return _activations[-1]
    from s2d_jax.env import quant_activations_setting
    chosen = quant_activations_setting()
    if chosen is not None:
        return chosen
    return "int8" if vnni() else "float"


def vnni() -> bool:
    """Whether this CPU has the AVX-512 VNNI instructions quant_dot8.cc's tiles are built
    from (-march=native); without them its columns take the scalar path."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


# The innermost choice of the traces under way: None = the default (`preferred()`),
# False = XLA's dots (`disabled()`), True = the kernels wherever they can run (`forced()`).
_choice: list[bool | None] = [None]


@contextlib.contextmanager
def _choose(value: bool):
    _choice.append(value)
    try:
        yield
    finally:
        _choice.pop()


def disabled():
    """Functions traced inside use XLA's dots (the benchmark's side-by-side baseline; the
    choice is made when a function is traced, so jit it anew inside)."""
    return _choose(False)


def forced():
    """Functions traced inside use the kernels wherever they can run, on any CPU (the
    kernels' tests, the matmul benchmark's kernel path)."""
    return _choose(True)


def for_mesh(mesh):
    """The context a decode function is traced in: XLA's dots when it runs sharded over
    several devices (the partitioner cannot split a custom call: it would gather the
    weights to every device) or on another platform's devices (a compile for a TPU
    topology, parallel/topology.py, while the default backend is the CPU), the kernel where
    it may otherwise."""
    off = mesh is not None and (mesh.devices.size > 1 or mesh.devices.flat[0].platform != "cpu")
    return disabled() if off else contextlib.nullcontext()


def usable(rows: int, weight=None) -> bool:
    """Whether a decode-path projection of `rows` rows runs on the kernel: the CPU backend,
    few rows (up to MAX_QUANT_ROWS where `weight`, one of the call's, is block-quantized
    with int8 activations), a built kernel, not traced under `disabled()` / a multi-device
    `for_mesh`, and a CPU it pays on (`preferred()`) unless forced."""
    choice = _choice[-1]
    limit = (MAX_QUANT_ROWS if weight is not None and _block_quantized(weight)
             and weight.group % 32 == 0 and activation_mode() == "int8" else MAX_ROWS)
    if choice is False or rows > limit or jax.default_backend() != "cpu":
        return False
    return _load() is None and (choice is True or preferred() is None)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


@functools.lru_cache(maxsize=1)
def preferred() -> str | None:
    """None when the decode path should take the kernels on this CPU by default, else why
    not: they pay where AVX-512 holds their tiles (see the module's docstring)."""
    from s2d_jax.env import small_matmul_forced
    if small_matmul_forced():
        return None
    if "avx512f" not in cpu_flags():
        return ("off: this CPU has no AVX-512, where the kernels measured slower than XLA's dots; "
                "S2D_SMALL_MATMUL=1 forces them")
    return None


def _per_channel_int8(w) -> bool:
    """A quantize.QuantizedWeight the kernel reads: int8 weight-only with one scale per
    output channel (the scale factors out of the sum over the input)."""
    return (getattr(w, "bits", None) == 8 and not w.act_bits
            and w.scale.shape[-3:-1] == (1, 1))


def _block_quantized(w) -> bool:
    """A quantize.QuantizedWeight quant_matmul.cc reads: weight-only, 8 bits (int8 q) or 4
    (packed nibbles, with or without offsets), scales per group of input rows (a group
    dividing the input dim; even for 4 bits)."""
    bits, group = getattr(w, "bits", None), getattr(w, "group", 0)
    if bits not in (4, 8) or w.act_bits or group <= 0:
        return False
    n_in = w.q.shape[-2] * (2 if bits == 4 else 1)
    return (n_in % group == 0 and (bits == 8 or group % 2 == 0)
            and (getattr(w, "offset", None) is None or bits == 4))


def serves(w) -> bool:
    """Whether a kernel reads this weight: float32 or bfloat16 arrays, or weight-only
    quantized ones (per-channel int8, or 8/4-bit blocks; w8a8 keeps XLA's path), plain or
    stacked."""
    arr = w.stack if isinstance(w, StackedWeight) else w
    if _per_channel_int8(arr) or _block_quantized(arr):
        return True
    return isinstance(arr, jax.Array | jax.core.Tracer) and arr.dtype in (jnp.float32, jnp.bfloat16)


def matmul(x: jnp.ndarray, w, layout: str, contract: int) -> jnp.ndarray:
    """x [..., K...] @ one layer's weight -> float32 [..., N...].

    w: a StackedWeight or a plain array of one layer's shape. layout "kn": the weight is
    [K..., N...] with `contract` leading axes contracted with x's trailing ones; "nk": it
    is [N, K] (x @ w.T, a tied embedding as the head)."""
    stack, index = (w.stack, w.index) if isinstance(w, StackedWeight) else (w, None)
    if _per_channel_int8(stack):  # stored [L?, in, out] int8, scale [L?, 1, 1, out]
        per_layer = tuple(stack.shape)
        q, scale = stack.q, stack.scale
        if index is None:
            q, scale, index = q[None], scale[None], 0
        k_dims, n_dims = per_layer[:contract], per_layer[contract:]
        K, N = math.prod(k_dims), math.prod(n_dims)
        out = _call(x, q.reshape(q.shape[0], K, N), index, "kn", len(k_dims), N)
        scale = jax.lax.dynamic_index_in_dim(scale, index, keepdims=False).reshape(N)
        return (out * scale).reshape(out.shape[:-1] + tuple(n_dims))
    if _block_quantized(stack):
        return _quant_call(x, stack, index, contract)
    if index is None:
        stack, index = stack[None], 0
    per_layer = stack.shape[1:]
    if layout == "kn":
        k_dims, n_dims = per_layer[:contract], per_layer[contract:]
    else:
        n_dims, k_dims = per_layer[:1], per_layer[1:]
    K, N = math.prod(k_dims), math.prod(n_dims)
    flat = stack.reshape((stack.shape[0], K, N) if layout == "kn" else (stack.shape[0], N, K))
    out = _call(x, flat, index, layout, len(k_dims), N)
    return out.reshape(out.shape[:-1] + tuple(n_dims))


def _quant_call(x, w, index, contract: int) -> jnp.ndarray:
    """x [..., K...] @ layer `index` (None: w is one layer) of a block-quantized weight,
    read as stored by quant_matmul.cc -> float32 [..., N...]."""
    q, scale, offset = w.q, w.scale, w.offset
    if index is None:
        q, scale, index = q[None], scale[None], 0
        offset = None if offset is None else offset[None]
    k_dims, n_dims = tuple(w.shape[:contract]), tuple(w.shape[contract:])
    K, N = math.prod(k_dims), math.prod(n_dims)
    lead = x.shape[:x.ndim - contract]
    rows = x.reshape((-1, K)).astype(jnp.float32)
    flat = lambda a: a.reshape(a.shape[0], -1, N)  # [L, K/G, 1, N] -> [L, K/G, N]
    no_offset = jnp.zeros((0,), scale.dtype)
    target = ("s2d_quant_dot8" if w.group % 32 == 0 and activation_mode() == "int8"
              else "s2d_quant_matmul")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], N), jnp.float32),
                            vmap_method="sequential")
    out = call(rows, flat(q), flat(scale), no_offset if offset is None else flat(offset),
               jnp.asarray(index, jnp.int32))
    return out.reshape(lead + n_dims)


def shares_input(ws) -> bool:
    """Whether `matmul_shared` takes these weights together: layers of block-quantized stacks
    at one index (a block's q, k, v; its gate and up), int8 activations, whole 32-blocks."""
    if not all(isinstance(w, StackedWeight) and _block_quantized(w.stack) for w in ws):
        return False
    return (all(w.index is ws[0].index and w.stack.group % 32 == 0 for w in ws)
            and activation_mode() == "int8")


def matmul_shared(x: jnp.ndarray, ws, contract: int) -> list[jnp.ndarray]:
    """[x @ w for w in ws] as one call of quant_dot8.cc (`shares_input(ws)`): x quantized
    once, every weight's columns shared out to the threads in one hand-off -> float32
    [..., N_i...] each."""
    K = math.prod(x.shape[x.ndim - contract:])
    lead = x.shape[:x.ndim - contract]
    rows = x.reshape((-1, K)).astype(jnp.float32)
    flat = lambda a, N: a.reshape(a.shape[0], -1, N)  # [L, K/G, 1, N] -> [L, K/G, N]
    args, outs, n_dims = [], [], []
    for w in ws:
        qw = w.stack
        dims = tuple(qw.shape[contract:])
        N = math.prod(dims)
        args += [flat(qw.q, N), flat(qw.scale, N),
                 jnp.zeros((0,), qw.scale.dtype) if qw.offset is None else flat(qw.offset, N)]
        outs.append(jax.ShapeDtypeStruct((rows.shape[0], N), jnp.float32))
        n_dims.append(dims)
    call = jax.ffi.ffi_call("s2d_quant_dot8_shared", outs, vmap_method="sequential")
    ys = call(rows, jnp.asarray(ws[0].index, jnp.int32), *args)
    return [y.reshape(lead + d) for y, d in zip(ys, n_dims)]


def _call(x, flat, index, layout: str, n_contract: int, N: int) -> jnp.ndarray:
    """The custom call on x's rows -> float32 [..., N] (x's leading axes kept)."""
    lead = x.shape[:x.ndim - n_contract]
    rows = x.reshape((-1, flat.shape[1] if layout == "kn" else flat.shape[2])).astype(jnp.float32)
    call = jax.ffi.ffi_call(f"s2d_small_matmul_{layout}",
                            jax.ShapeDtypeStruct((rows.shape[0], N), jnp.float32),
                            vmap_method="sequential")
    return call(rows, flat, jnp.asarray(index, jnp.int32)).reshape(lead + (N,))
