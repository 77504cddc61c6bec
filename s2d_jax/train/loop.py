"""The SoFT training loop: `prepare` (build the draft, check the setup, build the step),
`restore_or_init` (the latest checkpoint, the run's committed progress or the initial
params), `run_steps` (the jitted step, metrics, checkpoints, then the hooks of
s2d_jax/train/hooks.py, until the last step or the time budget); `train` runs all three.

All user-input checks (model path, exits, mesh vs devices, divisibility, data files,
tokenizer vocabulary) happen before the checkpoint manager is created, so bad input never
touches an existing checkpoint directory. With `draft.exits = [N]` this is plain LM
training (the demo targets are trained with it from a random init).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import numpy as np

from s2d_jax.model import transformer as model
from s2d_jax.train import checkpoint as ckpt
from s2d_jax.train import continuation
from s2d_jax.config import ModelConfig, load_model_config, read_hf_config
from s2d_jax.parallel.multihost import maybe_initialize_distributed
from s2d_jax.errors import S2DError
from s2d_jax.parallel.mesh import check_divisible
from s2d_jax.model.sorted_draft import draft_hf_extra, read_head_vocab, validate_exits
from s2d_jax.train.config import OptimizerConfig, TrainConfig
from s2d_jax.train.data import batch_fingerprint, make_train_iterator
from s2d_jax.train.finite import FiniteWatch
from s2d_jax.train.hooks import MetricsLog, ProgressBar, close_all, crash_after
from s2d_jax.parallel.mesh import make_mesh
from s2d_jax.train.step import (BATCH_KEYS, TEACHER_KEY, abstract_state, batch_sharding,
                                frozen_paths, global_batch, make_init_fn, make_optimizer,
                                make_train_step, state_shardings)

def _with_dtypes(cfg: ModelConfig, tc: TrainConfig) -> ModelConfig:
    kw = {k: v for k, v in (("dtype", tc.model.dtype), ("param_dtype", tc.model.param_dtype)) if v}
    return dataclasses.replace(cfg, **kw) if kw else cfg


def resolve_draft(tc: TrainConfig):
    """(ModelConfig of the draft, exits, source) with no weights loaded.

    source is None for a random init (model YAML) or the checkpoint dir to load from.
    """
    path = tc.model.path
    if not os.path.exists(path):
        raise S2DError(f"model.path {path} does not exist; point it to a model YAML or an "
                       f"HF/orbax checkpoint dir")
    if os.path.isfile(path) and path.endswith((".yaml", ".yml")):
        cfg = _with_dtypes(load_model_config(path, tc.model.overrides), tc)
        return cfg, tc.draft.resolved_exits(cfg.num_layers), None
    from s2d_jax.io.checkpoint import stored_model_config
    # a dir is a params checkpoint or an HF dir; a file is an HF config.json
    full = stored_model_config(path) if os.path.isdir(path) else read_hf_config(path)
    cfg, exits = draft_of_target(full, tc)
    return cfg, exits, path


def draft_of_target(full: ModelConfig, tc: TrainConfig):
    """(draft ModelConfig, exits): the first draft.exits[-1] layers of the target `full`."""
    if not tc.draft.exits:
        raise S2DError(f"draft.exits is empty; to train a draft from a {full.num_layers}-layer "
                       f"target set the exits, e.g. draft.exits=[6,9,12]")
    exits = tuple(tc.draft.exits)
    validate_exits(exits, exits[-1])
    if exits[-1] > full.num_layers:
        raise S2DError(f"draft exits {list(exits)} go beyond the {full.num_layers} layers of "
                       f"the target model {tc.model.path}; use exits <= {full.num_layers}")
    return _with_dtypes(dataclasses.replace(full, num_layers=exits[-1]), tc), exits


@functools.lru_cache(maxsize=8)
def build_step(cfg: ModelConfig, exits, weights, opt: OptimizerConfig, total_steps: int, mesh,
               remat: str, head_ids: tuple[int, ...] | None = None, kd_weight: float = 0.0):
    """(optimizer, state shardings, jitted init, jitted step), cached on the (hashable) settings so that
    runs in one process (tests, benchmarks) reuse the compiled step."""
    tx, schedule = make_optimizer(opt, total_steps)
    shardings = state_shardings(cfg, mesh, tx)
    step_fn = make_train_step(cfg, exits, weights, tx, schedule, mesh, shardings,
                              opt.grad_accum_steps, remat, frozen_paths(opt), head_ids, kd_weight,
                              opt.frozen_layers)
    return tx, shardings, make_init_fn(tx, shardings), step_fn


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg: ModelConfig, mesh):
    # Cached per (cfg, mesh): compiling the random init costs seconds; runs in one process
    # (tests, benchmarks) reuse it.
    return jax.jit(functools.partial(model.init_params, cfg),
                   out_shardings=model.param_shardings(cfg, mesh))


def initial_params(cfg: ModelConfig, source, mesh, seed: int) -> dict:
    """Random init (source None) or the first cfg.num_layers layers of checkpoint `source`."""
    if source is None:
        return _jitted_init(cfg, mesh)(jax.random.key(seed))
    from s2d_jax.io.checkpoint import load_model
    _, params, _ = load_model(source, num_layers=cfg.num_layers, dtype=cfg.param_dtype,
                              shardings=model.param_shardings(cfg, mesh))
    return params


def check_frozen_layers(tc: TrainConfig, exits) -> None:
    """Frozen layers must leave an exit to train."""
    n = tc.optimizer.frozen_layers
    if n >= exits[-1]:
        raise S2DError(f"optimizer.frozen_layers={n} freezes every exit of {list(exits)}; "
                       f"freeze fewer layers than the deepest exit ({exits[-1]})")


def check_batch(tc: TrainConfig) -> None:
    rows = tc.mesh.data * tc.mesh.fsdp
    b, a = tc.data.batch_size, tc.optimizer.grad_accum_steps
    if b % a or (b // a) % rows:
        raise S2DError(f"data.batch_size={b} must split into grad_accum_steps={a} micro-batches "
                       f"whose size is a multiple of mesh data x fsdp = {rows}")


def check_teacher(tc: TrainConfig, cfg: ModelConfig, iterator) -> None:
    """Distillation on the target's distribution needs its states, of the draft's width."""
    teacher = getattr(iterator, "teacher", None)
    if tc.draft.kd_weight > 0 and teacher is None:
        raise S2DError(f"draft.kd_weight={tc.draft.kd_weight} needs data.teacher (the target's "
                       f"states, s2d_jax/data/teacher.py); set it or draft.kd_weight=0")
    if teacher is not None and teacher.dim != cfg.hidden_size:
        raise S2DError(f"data.teacher {tc.data.teacher} holds states of width {teacher.dim}, "
                       f"the draft's hidden size is {cfg.hidden_size}; compute them with the "
                       f"draft's own target")


def _total_steps(tc: TrainConfig, iterator) -> int:
    if tc.optimizer.total_steps:
        return tc.optimizer.total_steps
    n = getattr(iterator, "num_batches", None)
    if n is None and hasattr(iterator, "__len__"):
        n = len(iterator)
    if not n:
        raise S2DError("optimizer.total_steps=0 needs a dataset of known size with "
                       "data.num_epochs > 0; set optimizer.total_steps")
    if jax.process_count() > 1:  # packing may give hosts different counts: all stop together
        from jax.experimental import multihost_utils
        n = int(np.min(multihost_utils.process_allgather(np.asarray(n))))
    return int(n)


def metrics_record(step, m, dt, tokens, fingerprint, exits) -> dict:
    """One metrics line; tokens/s counts non-padding tokens since the previous line."""
    return {"step": step, "loss": float(m["loss"]),
            "exit_loss": {str(e): float(x) for e, x in zip(exits, m["exit_loss"])},
            "exit_acc": {str(e): float(x) for e, x in zip(exits, m["exit_acc"])},
            "exit_kd": {str(e): float(x) for e, x in zip(exits, m["exit_kd"])},
            "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
            "loss_tokens": float(m["tokens"]), "tokens_per_s": tokens / max(dt, 1e-9),
            "batch_fingerprint": fingerprint}


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A training run with all its input checked and its step built; nothing written yet."""

    tc: TrainConfig
    cfg: ModelConfig
    exits: tuple[int, ...]
    source: str | None  # checkpoint dir of the initial params; None = random init
    mesh: Any
    iterator: Any  # host batches with get_state / set_state
    total_steps: int
    head_ids: tuple[int, ...] | None
    tx: Any
    shardings: Any
    init_fn: Any
    step_fn: Any


def _train_iterator(tc: TrainConfig, cfg: ModelConfig):
    """This host's batches (synthetic or tokenized files), checked against the draft."""
    tokenizer = None
    if not tc.synthetic_data:
        from s2d_jax.io.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(tc.data.tokenizer)
        if tokenizer.vocab_size != cfg.vocab_size:
            raise S2DError(f"tokenizer {tc.data.tokenizer} has {tokenizer.vocab_size} tokens but "
                           f"the model's vocab_size is {cfg.vocab_size}; use the model's tokenizer")
    iterator = make_train_iterator(tc.data, cfg.vocab_size, tc.synthetic_data,
                                   jax.process_index(), jax.process_count(), tokenizer)
    check_teacher(tc, cfg, iterator)
    return iterator


def prepare(tc: TrainConfig, devices=None) -> PreparedRun:
    """Check every input (model path, exits, mesh vs devices, divisibility, data files,
    tokenizer vocabulary) and build the step; touches no checkpoint or output."""
    maybe_initialize_distributed()
    cfg, exits, source = resolve_draft(tc)
    check_frozen_layers(tc, exits)
    if tc.model.init_from:  # its config now: train() creates the checkpoint dir and plan
        from s2d_jax.train.warm_start import check_committed
        check_committed(tc.model.init_from, cfg)
    weights = tc.draft.resolved_weights(len(exits))
    mesh = make_mesh(tc.mesh, devices)
    check_divisible(cfg, tc.mesh, "model")
    check_batch(tc)
    if tc.export_dir and os.path.exists(tc.export_dir) and not tc.export_overwrite:
        raise S2DError(f"export_dir {tc.export_dir} already exists; remove it, choose another "
                       f"or set export_overwrite=true")
    iterator = _train_iterator(tc, cfg)
    total_steps = _total_steps(tc, iterator)
    head_ids = (read_head_vocab(tc.draft.head_vocab, cfg.vocab_size) if tc.draft.head_vocab
                else None)
    built = build_step(cfg, exits, weights, tc.optimizer, total_steps, mesh, tc.remat, head_ids,
                       tc.draft.kd_weight)
    return PreparedRun(tc, cfg, exits, source, mesh, iterator, total_steps, head_ids, *built)


def restore_or_init(run: PreparedRun, manager, plan: dict | None = None):
    """(state, start step, the run's legs, the last one this session's): the latest
    checkpoint of `manager` (the data iterator put back where it was); else this run's
    committed progress (`model.continue_from`, train/continuation.py: its step and data
    position, new moments); else the initial params (from `model.init_from`'s committed
    draft, if set)."""
    restored = (ckpt.restore_latest(manager, abstract_state(run.cfg, run.tx, run.shardings),
                                    getattr(run.iterator, "state_per_process", True))
                if manager else None)
    if restored is not None:
        state, data_state, start = restored
        run.iterator.set_state(data_state)
        return state, start, continuation.then(
            continuation.checkpoint_legs(run.tc.checkpoint.dir),
            continuation.leg(f"resumed from its checkpoint at step {start}", start))
    params = initial_params(run.cfg, run.source, run.mesh, run.tc.seed)
    model_tc = run.tc.model
    step = (continuation.committed_progress(model_tc.continue_from,
                                            plan if plan is not None else ckpt.run_plan(run.tc))
            if model_tc.continue_from else None)
    if step is not None:  # the checkpoint is gone: this run's committed progress
        from s2d_jax.train.warm_start import warm_start
        params = warm_start(params, run.cfg, model_tc.continue_from, lost=continuation.LOST,
                            why=f"this run's progress at step {step}")
        continuation.skip_batches(run.iterator, step)
        return continuation.at_step(run.init_fn(params), step), step, continuation.then(
            continuation.committed_legs(model_tc.continue_from), continuation.leg(
                f"continued at step {step} from its committed progress "
                f"{model_tc.continue_from}", step, lost=continuation.LOST))
    if model_tc.init_from:  # the checkpoint is gone: the last committed draft
        from s2d_jax.train.warm_start import warm_start
        params = warm_start(params, run.cfg, model_tc.init_from, deeper=model_tc.init_deeper)
        return run.init_fn(params), 0, [continuation.leg(f"warm start from {model_tc.init_from}",
                                                         0)]
    return run.init_fn(params), 0, [continuation.leg(f"initialised from {model_tc.path}", 0)]


def run_steps(run: PreparedRun, state, start: int, manager=None, hooks=()):
    """Steps start+1 .. total_steps (or until the data ends): log, checkpoint, then call
    `hooks` (s2d_jax/train/hooks.py) after each; the last state is saved. Returns
    (state, history of metrics records, whether stop_after_minutes ended it)."""
    tc, watch, history = run.tc, FiniteWatch(), []  # watch: checked before any log or save
    t_last, tokens_since = time.perf_counter(), 0
    deadline = t_last + 60 * tc.stop_after_minutes if tc.stop_after_minutes else None
    stopped = False
    for step in range(start + 1, run.total_steps + 1):
        try:
            host_batch = next(run.iterator)
        except StopIteration:
            break
        state, metrics = run.step_fn(state, global_batch(host_batch, run.mesh))
        watch.observe(step, metrics)
        tokens_since += int(np.sum(host_batch["segment_ids"] > 0)) * jax.process_count()
        record = None
        if step % tc.log_every == 0 or step == run.total_steps:
            watch.check(manager)
            metrics = jax.device_get(metrics)  # waits for the step: the timing is real
            now = time.perf_counter()
            record = metrics_record(step, metrics, now - t_last, tokens_since,
                                    batch_fingerprint(host_batch), run.exits)
            t_last, tokens_since = now, 0
            history.append(record)
        if manager and (step % tc.checkpoint.save_every == 0 or step == run.total_steps):
            watch.check(manager)
            ckpt.save(manager, step, state, run.iterator.get_state())
        for hook in hooks:
            hook(step, state, record)
        if deadline is not None and step < run.total_steps and _past(deadline):
            stopped = True  # the time budget: the state is saved below
            break
    watch.check(manager)  # the data may end between boundaries: never save or export NaN
    if manager:
        if manager.latest_step() != int(state.step):
            ckpt.save(manager, int(state.step), state, run.iterator.get_state())
        manager.wait_until_finished()
    return state, history, stopped


def _past(deadline: float) -> bool:
    """Whether the time budget is spent; every process stops at the same step."""
    past = time.perf_counter() >= deadline
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        past = bool(np.max(multihost_utils.process_allgather(np.asarray(past))))
    return past


def train(tc: TrainConfig, devices=None, progress: bool = True, hooks=()) -> dict:
    """Run (or resume) training. Returns {"state", "history", "cfg", "exits", "start_step",
    "total_steps", "stopped_early"} (stopped_early: at stop_after_minutes, before
    total_steps).

    `hooks`: more callables run after each step (s2d_jax/train/hooks.py)."""
    run = prepare(tc, devices)
    # Only now (all input checked) touch the checkpoint dir.
    manager = ckpt.make_manager(tc.checkpoint.dir, tc.checkpoint.keep_last,
                                tc.checkpoint.async_save) if tc.checkpoint.dir else None
    data_slice = getattr(run.iterator, "stats", {}).get("data_slice")
    plan = ckpt.run_plan(tc, data_slice)
    resuming = manager is not None and manager.latest_step() is not None
    if resuming:  # another plan is refused before its checkpoint is read
        ckpt.check_run_plan(tc.checkpoint.dir, plan, True)
    state, start, legs = restore_or_init(run, manager, plan)
    if manager:
        # a new run's plan only once it has started: a plan left by a start that failed
        # (e.g. a wrong model.continue_from) would refuse the corrected rerun as another run
        if not resuming:
            ckpt.check_run_plan(tc.checkpoint.dir, plan, False)
        continuation.keep_legs(tc.checkpoint.dir, legs)
    bar = [ProgressBar(run.total_steps, start)] if progress and jax.process_index() == 0 else []
    hooks = [MetricsLog(tc.metrics_path), *bar, *hooks]
    if tc.stop_after_step:  # debug: simulate a crash right after this step
        hooks.append(crash_after(tc.stop_after_step, manager))
    try:
        state, history, stopped = run_steps(run, state, start, manager, hooks)
    finally:
        close_all(hooks)
    if tc.export_dir:
        export_draft(tc, run.cfg, run.exits, state.params, run.head_ids)
        if jax.process_index() == 0:
            write_recipe(tc.export_dir, plan, data_slice, legs, int(state.step),
                         run.total_steps)
    return {"state": state, "history": history, "cfg": run.cfg, "exits": run.exits,
            "start_step": start, "total_steps": run.total_steps,
            "stopped_early": stopped}


RECIPE = continuation.RECIPE


def write_recipe(export_dir: str, plan: dict, data_slice, legs: list[dict], step: int,
                  total_steps: int) -> None:
    """The exported draft's recipe beside its weights: the run's settings, the data it
    read (a corpus's shard files and sha256s, token counts), how this session's leg began
    ("start"), the step it reached of its total (a run continued from it reads plan and
    steps back, train/continuation.py) and every leg of the run, the last ending here."""
    import json

    from s2d_jax.io.atomic import write_atomic
    legs = [*legs[:-1], dict(legs[-1], to_step=step)]
    write_atomic(os.path.join(export_dir, RECIPE), json.dumps(
        {"plan": plan, "data_slice": data_slice, "start": legs[-1]["start"], "steps": step,
         "total_steps": total_steps, "legs": ckpt.portable(legs)}, indent=1) + "\n")


def export_draft(tc: TrainConfig, cfg: ModelConfig, exits, params, head_ids=None) -> None:
    """The trained draft as an HF Llama dir of N layers; exits in config.json `s2d_exits`."""
    from jax.experimental import multihost_utils

    from s2d_jax.io.hf import export_hf
    host = (multihost_utils.process_allgather(params, tiled=True) if jax.process_count() > 1
            else jax.device_get(params))
    if jax.process_index() == 0:
        tok_dir = None if tc.synthetic_data else tc.data.tokenizer
        export_hf(host, cfg, tc.export_dir, extra=draft_hf_extra(exits, head_ids), tokenizer_dir=tok_dir,
                  overwrite=tc.export_overwrite)


def compile_step_aot(tc: TrainConfig, cfg: ModelConfig, exits, devices=None, total_steps=1000):
    """Lower and compile the training step on abstract shapes (nothing allocated).

    The step `prepare` builds for `tc`: with draft.kd_weight > 0 its batches carry the
    target's float16 states [B, T, D] (data/pipeline.py) and its loss the KD term, with
    draft.head_vocab its head is that sub-vocabulary.
    Returns (compiled, lower_seconds, compile_seconds); `compiled.memory_analysis()` gives
    per-device argument/output/temp/code bytes.
    """
    mesh = make_mesh(tc.mesh, devices)
    check_divisible(cfg, tc.mesh, "model")
    check_batch(tc)
    weights = tc.draft.resolved_weights(len(exits))
    head_ids = (read_head_vocab(tc.draft.head_vocab, cfg.vocab_size) if tc.draft.head_vocab
                else None)
    tx, shardings, _, step_fn = build_step(cfg, exits, weights, tc.optimizer,
                                           tc.optimizer.total_steps or total_steps, mesh, tc.remat,
                                           head_ids, tc.draft.kd_weight)
    bsh = batch_sharding(mesh)
    shape = (tc.data.batch_size, tc.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, "float32" if k == "loss_mask" else "int32",
                                     sharding=bsh) for k in BATCH_KEYS}
    if tc.draft.kd_weight > 0:
        batch[TEACHER_KEY] = jax.ShapeDtypeStruct(shape + (cfg.hidden_size,), "float16",
                                                  sharding=bsh)
    t0 = time.perf_counter()
    lowered = step_fn.lower(abstract_state(cfg, tx, shardings), batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, t1 - t0, time.perf_counter() - t1
