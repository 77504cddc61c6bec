"""Dequantization of GGML tensor types to float32 numpy arrays, one tensor at a time.

Block layouts (ggml-common.h), every block covers 32 consecutive elements of a row:
    Q8_0  34 bytes: f16 scale d, 32 x int8 q                 x = d * q
    Q4_0  18 bytes: f16 scale d, 16 bytes of nibbles          x = d * (q - 8)
    Q4_1  20 bytes: f16 scale d, f16 min m, 16 bytes nibbles  x = d * q + m
In Q4_* byte j of a block holds element j in its low nibble and element j + 16 in its high
nibble. The float arithmetic is ggml's (float32, same order), so results are bit-exact.
Other block types that the `gguf` package can dequantize (the K-quants) go through it.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType
_CHUNK_ELEMENTS = 1 << 22  # rows are dequantized in chunks of about this many elements


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 stored at byte `start` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n_blocks, 16] bytes -> [n_blocks, 32] values 0..15 in element order."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _q8_0(blocks):
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(blocks):
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)).astype(
        np.float32)


def _q4_1(blocks):
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).astype(np.float32) + _f16(blocks, 2)


_BLOCK_DECODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1}
_FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}
# K-quants: no hand-written decoder here; the gguf package's numpy code is the reference.
_LIBRARY_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1)
SUPPORTED_TYPES = tuple(_FLOAT_TYPES) + (Q.BF16,) + tuple(_BLOCK_DECODERS) + _LIBRARY_TYPES


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
               ) -> np.ndarray:
    """float32 array of `shape` (numpy order, rows last) from a GGUF tensor's stored data.

    `raw` is `GGUFReader`'s view of the tensor: typed for F32/F16, bytes otherwise. Rows
    are decoded a chunk at a time, so a large tensor needs no block-sized temporaries.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"no dequantizer for GGML type {qtype.name}")
    if qtype in _FLOAT_TYPES:
        return np.asarray(raw, dtype=_FLOAT_TYPES[qtype]).reshape(shape).astype(np.float32)
    row = shape[-1]
    n_rows = math.prod(shape[:-1])
    rows = np.asarray(raw).view(np.uint8).reshape(n_rows, -1)
    out = np.empty((n_rows, row), np.float32)
    step = max(1, _CHUNK_ELEMENTS // row)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    for lo in range(0, n_rows, step):
        chunk = rows[lo:lo + step]
        if qtype == Q.BF16:  # the top half of a float32
            out[lo:lo + step] = (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif qtype in _BLOCK_DECODERS:
            blocks = chunk.reshape(-1, block_bytes)
            out[lo:lo + step] = _BLOCK_DECODERS[qtype](blocks).reshape(len(chunk), row)
        else:
            out[lo:lo + step] = gguf_dequantize(chunk, qtype)
    return out.reshape(shape)
