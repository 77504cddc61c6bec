"""Training-step time with several exits vs one exit on the same model, side by side.

    python -m train.bench_step [--model configs/models/X.yaml] [--train-exits 6,9,12] ...

Both steps are compiled and warmed up first, then timed alternately (A, B, A, B, ...) so
machine noise hits both equally; the medians and their ratio are printed (the SoFT goal is
a ratio <= 1.15). The default model is a 12-layer proxy of the paper's draft (Vicuna-7B's
first 12 layers) scaled down for CPU with the same vocab / hidden ratio (32000 / 4096).
"""

from __future__ import annotations

import time

from s2d_jax.cli.args import ArgumentParser, add_input, check_at_least, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "bench-step"  # its s2d subcommand: the name its shared flags are defined for


def _parse(argv):
    p = ArgumentParser(prog="python -m train.bench_step", description=__doc__)
    add_input(p, "--model", default=None,
                   help="model YAML (default: 12-layer CPU proxy)")
    add(p, "--train-exits", CMD)
    add(p, "--batch-size", CMD)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--remat", default="full", help="activation rematerialisation policy")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--timed-steps", type=int, default=10, help="timed steps per variant")
    return p.parse_args(argv)


@cli_main
def main(argv=None):
    args = _parse(argv)
    check_at_least(args, {"batch_size": 1, "seq": 2, "warmup": 0, "timed_steps": 1})
    from s2d_jax.model.transformer import REMAT_POLICIES
    if args.remat not in REMAT_POLICIES:  # before anything is compiled
        raise S2DError(f"--remat {args.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
    import jax
    import numpy as np

    from s2d_jax.config import ModelConfig, load_model_config
    from s2d_jax.parallel.mesh import MeshConfig
    from s2d_jax.model.sorted_draft import validate_exits
    from s2d_jax.train.config import OptimizerConfig
    from s2d_jax.train.data import SyntheticIterator
    from s2d_jax.parallel.mesh import make_mesh
    from s2d_jax.train.step import (global_batch, make_init_fn, make_optimizer,
                                    make_train_step, state_shardings)
    from s2d_jax.train.loop import initial_params

    cfg = (load_model_config(args.model) if args.model else
           ModelConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_layers=12,
                       num_heads=4, num_kv_heads=4, name="bench-proxy"))
    exits = tuple(parse_ints(args.train_exits, "--train-exits"))
    validate_exits(exits, cfg.num_layers)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-4), 1000)
    sh = state_shardings(cfg, mesh, tx)
    params = initial_params(cfg, None, mesh, 0)
    init = make_init_fn(tx, sh)
    variants = {}
    for name, ex in ((f"{len(exits)} exits {list(exits)}", exits),
                     (f"1 exit [{cfg.num_layers}]", (cfg.num_layers,))):
        step = make_train_step(cfg, ex, (1.0,) * len(ex), tx, schedule, mesh, sh, 1, args.remat)
        state = init(jax.tree.map(lambda x: x.copy(), params))
        variants[name] = [step, state, []]
    it = SyntheticIterator(cfg.vocab_size, args.batch_size, args.seq, 0)
    batch = global_batch(next(it), mesh)
    print(f"model {cfg.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}; batch {args.batch_size} x seq {args.seq}; remat {args.remat}; "
          f"{jax.devices()[0].platform}")
    for i in range(args.warmup + args.timed_steps):
        for v in variants.values():
            t0 = time.perf_counter()
            v[1], m = v[0](v[1], batch)
            jax.block_until_ready(m)
            if i >= args.warmup:
                v[2].append(time.perf_counter() - t0)
    med = {}
    for name, (_, _, times) in variants.items():
        med[name] = float(np.median(times))
        print(f"{name:<24} median {med[name] * 1e3:8.1f} ms  (min {min(times) * 1e3:.1f}, "
              f"max {max(times) * 1e3:.1f}, n={len(times)})")
    a, b = med.values()
    print(f"ratio multi-exit / single-exit step time: {a / b:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
