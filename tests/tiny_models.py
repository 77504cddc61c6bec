"""Shared helpers for tests: random params of tiny models drawn on the host, CLI errors."""

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.model import transformer as model


def numpy_params(cfg, seed=0, std=0.05):
    """Random params like model.init_params, drawn with numpy (compiling the jitted
    threefry init takes seconds on this CPU; numpy takes milliseconds). Norms are ones."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(std * rng.standard_normal(x.shape), x.dtype)

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
