"""Batches for the trainer: the real grain pipeline (s2d_jax.data.pipeline) or deterministic synthetic ones.

Both yield dicts of numpy arrays [per_host_batch, seq_len] (`inputs`, `targets`,
`loss_mask`, `segment_ids`, `positions`) and have `get_state()` / `set_state()` with
JSON-serialisable states, which the trainer stores in its orbax checkpoint.
"""

from __future__ import annotations

import numpy as np

from s2d_jax.data.pipeline import DataConfig, make_iterator  # noqa: F401  (DataConfig re-exported)
from s2d_jax.errors import S2DError

SYNTHETIC_VOCAB = 32  # synthetic rows use token ids < min(this, vocab_size)


class SyntheticIterator:
    """Rows of two packed segments, each an arithmetic progression mod a small vocabulary.

    Batch b is a pure function of (seed, b), so the iterator state is just b. Each host
    takes its own rows of the global batch.
    """

    state_per_process = False  # the global batch index: any process count resumes it

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if batch_size % process_count:
            raise S2DError(f"data.batch_size={batch_size} is not divisible by the "
                           f"{process_count} processes; use a multiple of it")
        self.vocab = min(SYNTHETIC_VOCAB, vocab_size)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        per_host = batch_size // process_count
        self.rows = slice(process_index * per_host, (process_index + 1) * per_host)
        self.batch_index = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rng = np.random.default_rng((self.seed, self.batch_index))
        B, T = self.batch_size, self.seq_len
        half = T // 2
        seg = np.where(np.arange(T) < half, 1, 2).astype(np.int32)
        pos = np.where(seg == 1, np.arange(T), np.arange(T) - half).astype(np.int32)
        start = rng.integers(0, self.vocab, (B, 2, 1))
        stride = rng.integers(1, 4, (B, 2, 1))
        # T + 1 tokens per segment: inputs are [0, T), targets are [1, T].
        seq = (start + stride * np.arange(T + 1)[None, None, :]) % self.vocab  # [B, 2, T+1]
        inputs = np.where(seg == 1, seq[:, 0, pos], seq[:, 1, pos])
        targets = np.where(seg == 1, seq[:, 0, pos + 1], seq[:, 1, pos + 1])
        # The first token of each segment has no context to infer the stride from.
        mask = (pos > 0).astype(np.float32)
        batch = {
            "inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
            "loss_mask": np.broadcast_to(mask, (B, T)).copy(),
            "segment_ids": np.broadcast_to(seg, (B, T)).copy(),
            "positions": np.broadcast_to(pos, (B, T)).copy(),
        }
        self.batch_index += 1
        return {k: v[self.rows] for k, v in batch.items()}

    def get_state(self) -> dict:
        return {"batch_index": self.batch_index}

    def set_state(self, state: dict) -> None:
        self.batch_index = int(state["batch_index"])


def make_train_iterator(data_cfg: DataConfig, vocab_size: int, synthetic: bool,
                        process_index: int, process_count: int, tokenizer=None):
    """The trainer's batch iterator; the real pipeline needs the loaded `tokenizer`."""
    if synthetic:
        return SyntheticIterator(vocab_size, data_cfg.batch_size, data_cfg.seq_len, data_cfg.seed,
                                 process_index, process_count)
    return make_iterator(data_cfg, tokenizer, process_index=process_index,
                         process_count=process_count)


def batch_fingerprint(batch: dict) -> str:
    """Short stable hash of a batch's tokens, logged so resumed runs show no repeat/skip."""
    import hashlib
    return hashlib.sha1(np.ascontiguousarray(batch["inputs"]).tobytes()).hexdigest()[:12]
