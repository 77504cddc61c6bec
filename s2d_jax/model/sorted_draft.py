"""A sorted draft: one stack of N layers with exits at increasing depths, and the SoFT loss.

Exit i is layers [0, e_i) + the shared final norm and LM head (S2D, arXiv 2407.01955: the
first 12 layers of Vicuna-7B with exits 6, 9, 12). `multi_exit_hidden` scans the stack
once, segment by segment ([0, e_1), [e_1, e_2), ...), each segment starting from the
previous exit's hidden state, so no layer is computed twice.

SoFT (sorted fine-tuning) loss = weighted mean over exits of each exit's masked token
cross-entropy (mixed with distillation on the target's distribution): `soft_objective`, the
one definition that training (s2d_jax/train/step.py) and evaluation use. Each exit's float32
logits are built, reduced and (under `jax.checkpoint`) recomputed in the backward pass one
exit and one piece of the rows at a time ([B, LOSS_CHUNK, V]), so training never holds
[E, B, T, V] (nor [B, T, V]) logits at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.exits import exits_problem


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Exit depths (layer counts) of a sorted draft; empty = one exit at the last layer.

    `exit_weights` weigh the exits in the SoFT loss (empty = equal weights).
    """

    exits: tuple[int, ...] = ()
    exit_weights: tuple[float, ...] = ()
    # JSON file with a list of token ids: the draft's head scores only these (a
    # sub-vocabulary head, transformer.sub_vocab_logits); "" = the full vocabulary.
    head_vocab: str = ""
    # Loss per exit = (1 - kd_weight) CE on the data's tokens + kd_weight CE on the target's
    # whole distribution (needs data.teacher: states from s2d_jax/data/teacher.py).
    kd_weight: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.kd_weight <= 1.0:
            raise S2DError(f"draft.kd_weight={self.kd_weight} must lie in [0, 1]")

    def resolved_exits(self, num_layers: int) -> tuple[int, ...]:
        exits = self.exits or (num_layers,)
        validate_exits(exits, num_layers)
        return exits

    def resolved_weights(self, num_exits: int) -> tuple[float, ...]:
        if not self.exit_weights:
            return (1.0,) * num_exits
        if len(self.exit_weights) != num_exits:
            raise S2DError(f"draft.exit_weights has {len(self.exit_weights)} entries but there "
                           f"are {num_exits} exits; give one weight per exit")
        if any(w < 0 for w in self.exit_weights) or sum(self.exit_weights) <= 0:
            raise S2DError(f"draft.exit_weights={list(self.exit_weights)} must be >= 0 with a "
                           f"positive sum")
        return tuple(float(w) for w in self.exit_weights)


def validate_exits(exits, num_layers: int) -> None:
    """Exits must be strictly increasing layer counts in (0, num_layers], ending at num_layers."""
    exits = tuple(exits)
    if exits_problem(exits, num_layers, to_depth=True):
        raise S2DError(
            f"draft exits {list(exits)} are invalid for a {num_layers}-layer draft; exits must be "
            f"strictly increasing layer counts > 0 ending at {num_layers} (e.g. [6, 9, 12] "
            f"for 12 layers)")


def stored_exits(extra: dict | None, cfg: ModelConfig) -> tuple[int, ...]:
    """A draft's exits as stored with it (`s2d_exits` in its config.json, read from a file:
    checked, not cast), else one exit at its full depth."""
    exits = (extra or {}).get("s2d_exits") or [cfg.num_layers]
    if not isinstance(exits, list) or exits_problem(exits, cfg.num_layers):
        raise S2DError(f"the draft's s2d_exits {exits!r} are not ascending layer counts in "
                       f"1..{cfg.num_layers}; fix s2d_exits in its config.json or re-export "
                       f"the draft")
    return tuple(exits)


def multi_exit_hidden(params: dict, cfg: ModelConfig, exits: tuple[int, ...], tokens,
                      positions=None, segment_ids=None, remat: str = "none",
                      frozen_layers: int = 0, hidden_sharding=None) -> list:
    """Hidden states [B, T, D] at every exit, from one pass over the layer stack.

    `frozen_layers` N: layers [0, N) run on their weights behind stop_gradient and the
    state at depth N is a constant, so the backward pass starts at layer N (training a
    deeper exit onto frozen shallower ones costs their forward only).
    `hidden_sharding` (training on a mesh): the sharding every segment's input and output
    state is pinned to, rows split like the batch. Unpinned, the embedding's output kept
    the table's split of D over fsdp and the partitioner carried it through the layers:
    every device then held the whole micro-batch's [B, T, F] MLP activations and partial
    sums (Vicuna-7B's 12 layers at 16 x 1024 on v5p:2x2x2: 59 GiB of temporaries a chip)
    instead of gathering each layer's weights."""
    validate_exits(exits, cfg.num_layers)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    pin = (lambda x: x) if hidden_sharding is None else (
        lambda x: jax.lax.with_sharding_constraint(x, hidden_sharding))
    h = pin(model.embed_tokens(params, cfg, tokens))
    hidden, start = [], 0
    # a few static segments, not a loop over layers: each is one scan
    for end in sorted(set(exits) | ({frozen_layers} if 0 < frozen_layers < exits[-1] else set())):
        layers = None
        if end <= frozen_layers:
            layers = jax.lax.stop_gradient(model.layer_slice(params, start, end))
        h, _ = model.run_layers(params, cfg, h, positions, start, end, None, segment_ids, remat,
                                layers=layers)
        h = pin(h)
        if end == frozen_layers:
            h = jax.lax.stop_gradient(h)
        if end in exits:
            hidden.append(h)
        start = end
    return hidden


def multi_exit_logits(params: dict, cfg: ModelConfig, exits, tokens, positions=None,
                      segment_ids=None) -> list:
    """Float32 logits [B, T, V] of every exit (shared final norm + head). For eval/tests."""
    return [model.lm_logits(params, cfg, h)
            for h in multi_exit_hidden(params, cfg, exits, tokens, positions, segment_ids)]


def read_head_vocab(path: str, vocab_size: int) -> tuple[int, ...]:
    """The sorted distinct token ids of a sub-vocabulary file (a JSON list of ids)."""
    from s2d_jax.readers import read_json
    ids = read_json(path, "draft.head_vocab file")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)):
        raise S2DError(f"draft.head_vocab file {path} must hold a non-empty JSON list of token "
                       f"ids in [0, {vocab_size}); rewrite it")
    return tuple(sorted(set(ids)))


def to_sub_vocab(targets, loss_mask, head_ids, vocab_size: int):
    """Targets as indices into head_ids; tokens outside it leave the loss (the draft cannot
    propose them, so there is nothing to learn there)."""
    lookup = jnp.full((vocab_size,), -1, jnp.int32).at[head_ids].set(
        jnp.arange(head_ids.shape[0], dtype=jnp.int32))
    sub = lookup[targets]
    return jnp.maximum(sub, 0), loss_mask * (sub >= 0)


def _exit_sums(params: dict, cfg: ModelConfig, h, targets, loss_mask, head_ids=None,
               teacher=None):
    """(sum of masked CE, number of masked correct argmax, sum of masked distillation CE)
    for one exit's hidden state; the last is 0 without `teacher` states [B, T, D]."""
    kd_mask = loss_mask
    if head_ids is None:
        logits = model.lm_logits(params, cfg, h)
    else:
        logits = model.sub_vocab_logits({**params, "head_ids": head_ids}, cfg, h)
        targets, loss_mask = to_sub_vocab(targets, loss_mask, head_ids, cfg.vocab_size)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    kd = jnp.zeros(())
    if teacher is not None:
        # The target's distribution over the same (sub-)vocabulary, from its final-normed
        # states and the shared frozen head: every token of the head is a target, so a
        # masked position teaches even when its sampled token lies outside the head.
        rows = jax.lax.stop_gradient(model.head_rows(
            params if head_ids is None else {**params, "head_ids": head_ids}))
        t_logits = jnp.einsum("...D,VD->...V", teacher.astype(jnp.float32),
                              rows.astype(jnp.float32))
        kd = jnp.sum(optax.softmax_cross_entropy(logits, jax.nn.softmax(t_logits)) * kd_mask)
    return jnp.sum(ce * loss_mask), jnp.sum(correct * loss_mask), kd


# Saves only the exit's hidden state for the backward pass; the logits are recomputed.
_exit_sums_remat = jax.checkpoint(_exit_sums, static_argnums=(1,))

# Tokens of a row scored at once by the exit losses: a piece's float32 logits, their
# softmax, the KD term's target logits and the logits' gradient are what the loss holds
# (4 x [B, 256, V] instead of 4 x [B, T, V]: at 16 x 1024 rows and Vicuna's 32000 rows
# split over 8 chips, 0.25 GiB a chip instead of 1 GiB; that step's peak lies in the
# layers' backward pass, so it drops 0.05 GiB, more with a larger vocabulary or more rows
# a chip).
LOSS_CHUNK = 256


def loss_pieces(seq_len: int, chunk: int | None = None) -> int:
    """How many equal pieces a row of `seq_len` tokens is scored in: the fewest that are
    each at most `chunk` (default LOSS_CHUNK) long (a divisor of seq_len, so no padding
    is scored)."""
    chunk = chunk or LOSS_CHUNK
    return next(n for n in range(-(-seq_len // chunk), seq_len + 1) if seq_len % n == 0)


# The exit and piece loops as loops; train/aot.py's compiler step estimate unrolls them
# (XLA's cost analysis counts a loop body once: 5 exits x 4 pieces would count as one).
LOSS_UNROLL = 1


def _map(f, xs):
    """lax.map(f, xs), unrolled LOSS_UNROLL iterations at a time."""
    return jax.lax.scan(lambda c, x: (c, f(x)), None, xs, unroll=LOSS_UNROLL)[1]


def _pieces(x, n: int):
    """[B, T, ...] -> [n, B, T / n, ...]: piece i is tokens [i T/n, (i + 1) T/n) of every row."""
    B, T = x.shape[:2]
    return x.reshape(B, n, T // n, *x.shape[2:]).swapaxes(0, 1)


def soft_sums(params: dict, cfg: ModelConfig, exits, batch: dict, remat: str = "none",
              head_ids=None, frozen_layers: int = 0, hidden_sharding=None):
    """Per-exit (CE sums [E], correct counts [E], distillation CE sums [E]) over the masked
    tokens of `batch`.

    `batch` holds `inputs`, `targets` int32 [B, T], `loss_mask` float [B, T] and optionally
    `positions`, `segment_ids` [B, T] and `teacher_hidden` [B, T, D] (the target's
    final-normed states, s2d_jax/data/teacher.py: distillation on its whole distribution).
    Sums (not means) so micro-batches add up exactly.
    `head_ids` [V']: score a sub-vocabulary head (tokens outside it leave the hard CE).
    `frozen_layers` N: the exits at depth <= N are measured as constants (no backward pass
    through them); the caller keeps the final norm and head frozen with them.
    """
    hidden = multi_exit_hidden(params, cfg, exits, batch["inputs"], batch.get("positions"),
                               batch.get("segment_ids"), remat, frozen_layers, hidden_sharding)
    mask = batch["loss_mask"].astype(jnp.float32)
    teacher = batch.get("teacher_hidden")

    # A scan over the exits and, inside it, over pieces of the rows (loss_pieces; not
    # Python loops): one piece's logits live at a time, recomputed piece by piece in the
    # backward pass (fn is _exit_sums_remat), and the LM head's gradient accumulates in the
    # loop's carry instead of being materialised once per exit.
    n = loss_pieces(mask.shape[1])
    rows = (_pieces(batch["targets"], n), _pieces(mask, n),
            None if teacher is None else _pieces(teacher, n))

    def sums(fn, hs):
        def exit_sums(h):
            per_piece = _map(lambda p: fn(params, cfg, p[0], p[1], p[2], head_ids, p[3]),
                             (_pieces(h, n), *rows))
            return tuple(jnp.sum(x, axis=0) for x in per_piece)
        return _map(exit_sums, jnp.stack(hs))

    n_frozen = sum(e <= frozen_layers for e in exits)
    if not n_frozen:
        return sums(_exit_sums_remat, hidden)
    fixed = jax.lax.stop_gradient(sums(_exit_sums, hidden[:n_frozen]))
    if n_frozen == len(exits):
        return fixed
    trained = sums(_exit_sums_remat, hidden[n_frozen:])
    return tuple(jnp.concatenate([a, b]) for a, b in zip(fixed, trained))


def loss_tokens(batch: dict):
    """The number of masked tokens of `batch` (at least 1): what the SoFT loss is a mean over."""
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)


def soft_objective(params: dict, cfg: ModelConfig, exits, batch: dict, weights, total_tokens,
                   remat: str = "none", head_ids=None, kd_weight: float = 0.0,
                   frozen_layers: int = 0, hidden_sharding=None):
    """THE SoFT objective (training and evaluation both use it): the `weights`-weighted mean
    over exits of each exit's (1 - kd_weight) hard CE + kd_weight distillation CE, summed
    over the masked tokens of `batch` and divided by `total_tokens`.

    `total_tokens` is the token count of the whole global batch, so the losses of the
    micro-batches of an accumulated step add up to the whole batch's loss. With
    `frozen_layers` N the mean is over the exits deeper than N (the others train nothing).
    Returns (loss, (CE sums [E], correct counts [E], distillation CE sums [E])): see soft_sums.
    """
    w = jnp.asarray([wi if e > frozen_layers else 0.0 for e, wi in zip(exits, weights)],
                    jnp.float32)
    ce, correct, kd = soft_sums(params, cfg, exits, batch, remat, head_ids, frozen_layers,
                                hidden_sharding)
    per_exit = (1.0 - kd_weight) * ce + kd_weight * kd
    loss = jnp.sum(w * per_exit) / total_tokens / jnp.sum(w)
    return loss, (ce, correct, kd)


def soft_loss(params: dict, cfg: ModelConfig, exits, batch: dict, weights=None,
              remat: str = "none", head_ids=None, kd_weight: float = 0.0):
    """The SoFT objective of one whole batch (soft_objective over its own tokens); plus
    per-exit means.

    Returns (loss, {"loss", "exit_loss" [E], "exit_acc" [E], "exit_kd" [E], "tokens"}).
    """
    weights = weights if weights is not None else (1.0,) * len(exits)
    tokens = loss_tokens(batch)
    loss, (ce, correct, kd) = soft_objective(params, cfg, exits, batch, weights, tokens, remat,
                                             head_ids, kd_weight)
    return loss, {"loss": loss, "exit_loss": ce / tokens, "exit_acc": correct / tokens,
                  "exit_kd": kd / tokens, "tokens": tokens}


def draft_hf_extra(exits, head_ids=None) -> dict:
    """Extra config.json fields recording the exits (and sub-vocabulary head) of an
    exported draft."""
    extra = {"s2d_exits": [int(e) for e in exits]}
    if head_ids is not None:
        extra["s2d_head_vocab"] = [int(i) for i in head_ids]
    return extra


def draft_prefix(cfg: ModelConfig, params: dict, extra: dict, exits) -> tuple:
    """(cfg, params, extra) of the sorted draft cut after its exit exits[-1], keeping the
    given exits: every exit of a sorted draft reads only the layers below it and the shared
    norm and head, so a prefix is itself a sorted draft with the same predictions there."""
    exits = [int(e) for e in exits]
    have = list(stored_exits(extra, cfg))
    if not exits or not set(exits) <= set(have) or exits != sorted(set(exits)):
        raise S2DError(f"exits {exits} are not ascending exits of the draft {have}; "
                       f"keep some of its own exits")
    depth = exits[-1]
    params = dict(params, layers={k: v[:depth] for k, v in params["layers"].items()})
    return (dataclasses.replace(cfg, num_layers=depth), params,
            dict(extra or {}, s2d_exits=exits))
