"""How decode layer ranges are traced, decided per program (a trace-time scope, like the
small-matmul kernel's choice): on a GPU every decode range runs unrolled over static slices
of the weight stacks, and single-row projections are given a few rows.

In a loop a layer's weights are a slice at a traced index, which XLA:GPU materializes (a
dynamic-slice fusion that copies each matrix to a temporary) before the GEMM reads it: a 7B
AR step walked 2.7x its weights' bytes on the H100 compiler. A static slice is fused into
the GEMM's operand (read in place): 1.02x. XLA:TPU folds the traced slice into the matmul
itself, and XLA:CPU's loop was faster, so they keep the loop.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

_static_decode: list[bool | None] = [None]
_tensor: list[int] = [1]  # the tensor-parallel degree of the program's mesh
_fused: list[tuple[bool | None, object]] = [(None, None)]  # (the attention kernel on, its mesh)


@contextlib.contextmanager
def decode_unrolled(on: bool | None):
    """Trace decode layer ranges fully unrolled (True), looped by size (False), or as the
    default backend wants (None)."""
    _static_decode.append(on)
    try:
        yield
    finally:
        _static_decode.pop()


def for_platform(mesh):
    """The scope of programs for `mesh`'s devices (None: a scope around the call, else the
    default backend, decides)."""
    if mesh is None:
        return contextlib.nullcontext()
    platform = mesh.devices.flat[0].platform
    gpu = platform in ("gpu", "cuda", "rocm")
    return _scope(gpu, dict(zip(mesh.axis_names, mesh.devices.shape)).get("tensor", 1), mesh,
                  "gpu" if gpu else "tpu" if platform == "tpu" else False)


@contextlib.contextmanager
def _scope(unrolled: bool, tensor: int, mesh, kernel):
    _tensor.append(tensor)
    try:
        with decode_unrolled(unrolled), fused_attention(kernel, mesh):
            yield
    finally:
        _tensor.pop()


@contextlib.contextmanager
def fused_attention(on: bool | str | None, mesh=None):
    """Cached attention traced now runs as one kernel on `mesh`'s devices: "gpu" (Triton,
    gpu_attention.py; True says the same) or "tpu" (Mosaic, tpu_attention.py), on a CPU
    in Pallas's interpreter (tests); in XLA ops (False); or as the default backend wants
    (None: its kernel on a GPU or TPU, XLA ops elsewhere)."""
    _fused.append(("gpu" if on is True else on, mesh))
    try:
        yield
    finally:
        _fused.pop()


def fused_attention_mesh() -> tuple[str | None, object]:
    """(the attention kernel traced now: "gpu", "tpu" or None for XLA ops, its mesh)."""
    on, mesh = _fused[-1]
    if on is None:
        on = jax.default_backend() if jax.default_backend() in ("gpu", "tpu") else False
    return (on or None), mesh


def static_decode_slices() -> bool:
    """Whether decode layer ranges traced now run unrolled over static weight slices."""
    on = _static_decode[-1]
    return jax.default_backend() == "gpu" if on is None else on


# Projections of at most this many rows (decode steps, verify windows, draft steps) are padded
# in GPU decode programs (gemm_rows); a prefill's are left alone.
FEW_ROWS = 64
# XLA:GPU strength-reduces a matrix-vector product whose weight has fewer elements than this
# (dot_strength_reduction.cc); larger ones stay GEMMs unpadded.
SMALL_MATRIX = 10_000_000


def gemm_rows(eq: str, x: jnp.ndarray, w: jnp.ndarray, extra: int) -> jnp.ndarray:
    """einsum(eq, x, w) of a few-row x, computed with `extra` copies of x's first batch entry
    appended (and dropped from the result). Two XLA:GPU rewrites of small per-device
    matrices (every matrix of a 7B draft split 8 ways) cost 3x the weight's bytes a step:
    a matrix-vector product of under 10M weight elements becomes a multiply written whole
    and a reduce reading it back (DotStrengthReduction), and projections of one input with
    equal shapes become one GEMM over their weights concatenated anew every step
    (DotMerger). The padded x is never a vector, and projections of one input get different
    `extra`, so no two have equal shapes."""
    padded = jnp.concatenate([x] + [x[:1]] * extra, axis=0)
    return jnp.einsum(eq, padded, w)[:x.shape[0]]


def few_rows(x: jnp.ndarray, w, n_contract: int = 1) -> bool:
    """A projection of a few rows (`FEW_ROWS`) by a small matrix (`SMALL_MATRIX` elements on
    each device, the weight split over the mesh's tensor axis) in a GPU decode program."""
    rows = x.size // max(1, math.prod(x.shape[x.ndim - n_contract:]))
    return (x.ndim > n_contract and rows <= FEW_ROWS and w.size // _tensor[-1] < SMALL_MATRIX
            and static_decode_slices())
