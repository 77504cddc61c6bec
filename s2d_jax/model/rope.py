"""Rotary position embeddings in HF's rotate-half layout, with HF's `rope_scaling` types."""

from __future__ import annotations

import math

import jax.numpy as jnp

from s2d_jax.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, max_position=None) -> jnp.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), after the configured scaling.

    `max_position` (traced scalar, the largest position in this call) is used only by
    `dynamic` NTK scaling, which, like HF, enlarges the base once a sequence outgrows
    `max_position_embeddings`.
    """
    dim = cfg.head_dim
    exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    rs = cfg.rope_scaling
    base = jnp.float32(cfg.rope_theta)
    if rs.rope_type == "dynamic" and max_position is not None:
        seq_len = jnp.maximum(max_position + 1, cfg.max_position_embeddings).astype(jnp.float32)
        base = base * ((rs.factor * seq_len / cfg.max_position_embeddings) - (rs.factor - 1)) ** (
            dim / (dim - 2))
    inv = 1.0 / (base ** exponent)
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def cos_sin(cfg: ModelConfig, positions: jnp.ndarray):
    """cos, sin of shape [B, T, head_dim] (float32) for integer positions [B, T]."""
    inv = inv_frequencies(cfg, jnp.max(positions))
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, T, dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [B, T, heads, head_dim]; cos/sin: [B, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = cos[:, :, None, :].astype(x.dtype)
    s = sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s
