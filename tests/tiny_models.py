"""Shared helpers for tests: random params of tiny models drawn on the host, CLI errors."""

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.model import transformer as model


def numpy_params(cfg, seed=0, std=0.05, norm_jitter=0.0, host=False):
    """Random params shaped like model.init_params, drawn with numpy (compiling the jitted
    threefry init takes seconds on this CPU; numpy takes milliseconds): weights
    N(0, std^2), norm weights uniform in [1 - norm_jitter, 1 + norm_jitter] (ones by
    default). host=True returns numpy arrays (to place with explicit shardings later)."""
    rng = np.random.default_rng(seed)
    to_array = np.asarray if host else jnp.asarray

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            # no draw without jitter, so the other leaves' values do not depend on it
            value = (1.0 + rng.uniform(-norm_jitter, norm_jitter, x.shape) if norm_jitter
                     else np.ones(x.shape))
        else:
            value = std * rng.standard_normal(x.shape)
        return to_array(value.astype(x.dtype))

    return jax.tree_util.tree_map_with_path(leaf, model.abstract_params(cfg))


def cli_error(main, capsys, argv) -> str:
    """Run a CLI `main(argv)` that must fail on bad input: exit 2 and exactly one
    `error: ...` line on stderr, which is returned."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def tiny_target(out_dir: str, seed: int = 3) -> str:
    """A tiny random 3-layer Llama target with the demo tokenizer (no chat template),
    exported as an HF dir at out_dir: generation and training tests in seconds."""
    import os

    import jax

    from s2d_jax.io.hf import export_hf
    from s2d_jax.model import transformer as model
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = model.ModelConfig(vocab_size=2048, hidden_size=32, intermediate_size=64,
                            num_layers=3, num_heads=4, num_kv_heads=2,
                            max_position_embeddings=256)
    export_hf(jax.device_get(model.init_params(cfg, jax.random.key(seed), std=0.3)), cfg,
              out_dir, tokenizer_dir=os.path.join(root, "models", "demo", "target-l"))
    return out_dir
