"""Train state, optimizer, shardings and the one jitted SoFT training step.

The step is a single `jax.jit` with explicit in/out shardings from the mesh and the state
donated; its loss is sorted_draft.soft_objective. Gradient accumulation
(`accumulate_gradients`) is a `lax.scan` over micro-batches inside the step; the loss is
normalised by the token count of the whole global batch, so accumulating A micro-batches
gives the same update as one batch A times larger.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.parallel.mesh import partition_spec
from s2d_jax.model.sorted_draft import loss_tokens, soft_objective
from s2d_jax.train.config import OptimizerConfig

BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
TEACHER_KEY = "teacher_hidden"  # [B, T, D] target states, with data.teacher (logit KD)


@struct.dataclass
class TrainState:
    step: jnp.ndarray  # int32 scalar: optimizer updates done
    params: dict
    opt_state: Any


class MomentRampState(NamedTuple):
    age: jnp.ndarray  # int32: updates made with these Adam moments, counted up to `steps`
    steps: jnp.ndarray  # int32: the ramp's length (the schedule's warmup)


def _ramp_scale(state: MomentRampState):
    return jnp.minimum(1.0, (state.age + 1) / state.steps)


def moment_ramp(steps: int) -> optax.GradientTransformation:
    """Scales the updates by (age + 1) / steps until `age` reaches `steps`. A run's own
    start never ramps here (init sets age = steps: the schedule's warmup does that job);
    a run continued from committed weights at step S (train/continuation.py) restarts
    Adam's moments at zero with the schedule at S, and sets age = 0, so its first updates
    are not the full learning rate times sign(g) that fresh moments give."""
    def init(params):
        del params
        return MomentRampState(age=jnp.asarray(steps, jnp.int32),
                               steps=jnp.asarray(steps, jnp.int32))

    def update(updates, state, params=None):
        del params
        scale = _ramp_scale(state)
        return (jax.tree.map(lambda u: u * scale.astype(u.dtype), updates),
                state._replace(age=jnp.minimum(state.age + 1, state.steps)))

    return optax.GradientTransformation(init, update)


def applied_lr(opt_state, schedule, step):
    """The learning rate the next update applies: the schedule at its own count in the
    optimizer state (a continued run moves it, continuation.at_step), times the moment
    ramp; `schedule(step)` for an optimizer without a schedule state."""
    def kind(x):
        return isinstance(x, (optax.ScaleByScheduleState, MomentRampState))
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=kind) if kind(x)]
    counts = [x.count for x in found if isinstance(x, optax.ScaleByScheduleState)]
    lr = schedule(counts[0] if counts else step)
    for ramp in (x for x in found if isinstance(x, MomentRampState)):
        lr = lr * _ramp_scale(ramp)
    return lr


def make_optimizer(o: OptimizerConfig, total_steps: int):
    """AdamW with linear warmup + cosine decay, global-norm clipping; no decay on norms;
    with a warmup, the ramp a continued run's fresh moments need (`moment_ramp`)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if o.warmup_steps else o.lr, peak_value=o.lr,
        warmup_steps=o.warmup_steps, decay_steps=max(total_steps, o.warmup_steps + 1),
        end_value=o.lr * o.end_lr_ratio)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "norm" not in jax.tree_util.keystr(path), params)

    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    if o.warmup_steps:
        parts.append(moment_ramp(o.warmup_steps))
    tx = optax.chain(*parts)
    frozen = frozen_paths(o)
    if frozen:
        # Frozen params get zero updates (their gradients are already zero through
        # stop_frozen_gradients; this also cancels weight decay). A stateless mask keeps
        # the optimizer state shaped like the params, so its shardings follow them.
        tx = optax.chain(tx, optax.masked(optax.set_to_zero(),
                                          lambda params: frozen_mask(params, frozen)))
    if o.frozen_layers:
        tx = optax.chain(tx, zero_layer_rows(o.frozen_layers))
    return tx, schedule


def frozen_paths(o: OptimizerConfig) -> tuple[str, ...]:
    """The param paths kept at their initial values: `optimizer.frozen`, and with frozen
    layers the final norm every exit shares (else the frozen exits would move)."""
    extra = ("final_norm",) if o.frozen_layers and "final_norm" not in o.frozen else ()
    return tuple(o.frozen) + extra


def zero_layer_rows(n: int) -> optax.GradientTransformation:
    """Zero updates for the first `n` rows of every stacked layer param (the frozen
    layers: their gradients are zero already; this also cancels weight decay there)."""
    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u.at[:n].set(0) if _is_frozen(path, ("layers",)) else u,
            updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _is_frozen(path, frozen) -> bool:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return any(name == f or name.startswith(f + "/") for f in frozen)


def frozen_mask(params, frozen):
    """True per frozen leaf: its "/"-path is, or lies under, one of `frozen` ("embed",
    "layers/wq", "layers")."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_frozen(path, frozen), params)


def stop_frozen_gradients(params, frozen):
    """params with frozen leaves behind stop_gradient: XLA then drops their weight
    gradients (for a frozen embedding/head, the largest matmul of the backward pass)."""
    if not frozen:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.lax.stop_gradient(x) if _is_frozen(path, frozen) else x, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, seq] arrays: rows split over the "batch" rule (data x fsdp)."""
    return NamedSharding(mesh, partition_spec(("batch", "seq")))


def state_shardings(cfg: ModelConfig, mesh: Mesh, tx) -> TrainState:
    """Shardings of the whole state: the params' from the shared rules, and every copy of
    the params inside the optimizer state (Adam's moments) sharded like the params, found
    by the structure `tx.init` builds (`optax.tree_map_params`); other leaves replicated."""
    param_sh = model.param_shardings(cfg, mesh)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, model.abstract_params(cfg))
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract_opt, param_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh)


def abstract_state(cfg: ModelConfig, tx, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the state: no memory allocated."""
    params = model.abstract_params(cfg)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=jax.eval_shape(tx.init, params))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)


def make_init_fn(tx, shardings: TrainState):
    """Jitted (params) -> TrainState placed on the mesh (optimizer state built in place)."""

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)


def accumulate_gradients(grad_fn, params, batch: dict, total_tokens, steps: int,
                         micro_sharding: NamedSharding, grad_shardings):
    """The ((loss, metric sums), grads) of `grad_fn(params, micro_batch, total_tokens)` (a
    value_and_grad with aux) summed over `steps` micro-batches of `batch`: a `lax.scan`, one
    micro-batch live at a time. Every micro-batch loss is already divided by the whole
    batch's `total_tokens`, so the sums equal one pass over the whole batch. The gradients accumulate in float32,
    sharded like the params (`grad_shardings`), and come back in the params' dtypes."""
    if steps == 1:
        return grad_fn(params, batch, total_tokens)

    # Row r*A + a goes to micro-batch a: each micro-batch keeps an even share of every
    # device's rows, so splitting needs no communication.
    def split(x):
        B = x.shape[0]
        x = x.reshape(B // steps, steps, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sharding)

    micro = {k: split(v) for k, v in batch.items()}
    # Float32 zeros shaped like grad_fn's ((loss, metric sums), grads): the sums' carry.
    one = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), total_tokens)
    init = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), one)

    def body(acc, mb):
        out = grad_fn(params, mb, total_tokens)
        (loss, sums), g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, out)
        # Keep the float32 accumulator sharded like the params (not gathered).
        g_acc = jax.lax.with_sharding_constraint(g_acc, grad_shardings)
        return ((loss, sums), g_acc), None

    (value, grads), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return value, grads


def make_train_step(cfg: ModelConfig, exits: tuple[int, ...], weights: tuple[float, ...], tx,
                    schedule, mesh: Mesh, shardings: TrainState, grad_accum_steps: int = 1,
                    remat: str = "none", frozen: tuple[str, ...] = (),
                    head_ids: tuple[int, ...] | None = None, kd_weight: float = 0.0,
                    frozen_layers: int = 0):
    """The jitted step: (state, batch of global [B, T] arrays) -> (state, metrics); its loss
    is sorted_draft.soft_objective.

    `frozen`: param paths whose gradients are not computed (see make_optimizer);
    `frozen_layers` N: the first N layers too, and the exits at depth <= N leave the loss;
    `head_ids`: train a sub-vocabulary head (sorted_draft.soft_sums); `kd_weight`: the
    share of distillation on the target's distribution (batches then carry TEACHER_KEY)."""
    micro_sharding = NamedSharding(mesh, partition_spec((None, "batch", "seq")))
    # the layers' states split by rows like the batch (sorted_draft.multi_exit_hidden)
    hidden_sharding = NamedSharding(mesh, partition_spec(("batch", "seq", None)))
    head = None if head_ids is None else np.asarray(head_ids, np.int32)

    def loss_fn(params, micro, total_tokens):
        return soft_objective(stop_frozen_gradients(params, frozen), cfg, exits, micro, weights,
                              total_tokens, remat, None if head is None else jnp.asarray(head),
                              kd_weight, frozen_layers, hidden_sharding)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: dict):
        total_tokens = loss_tokens(batch)
        (loss, (ce, correct, kd)), grads = accumulate_gradients(
            grad_fn, state.params, batch, total_tokens, grad_accum_steps, micro_sharding,
            shardings.params)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "exit_loss": ce / total_tokens, "exit_acc": correct / total_tokens,
                   "exit_kd": kd / total_tokens,
                   "grad_norm": grad_norm, "lr": applied_lr(state.opt_state, schedule, state.step),
                   "tokens": total_tokens}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, replicated), donate_argnums=(0,))


def global_batch(batch: dict, mesh: Mesh) -> dict:
    """Per-host numpy rows -> global jax arrays sharded on the batch axis."""
    sh = batch_sharding(mesh)
    keys = BATCH_KEYS + ((TEACHER_KEY,) if TEACHER_KEY in batch else ())
    return {k: jax.make_array_from_process_local_data(sh, batch[k]) for k in keys}
