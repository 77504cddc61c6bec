"""The LM head of a CPU decode call of 2..16 rows (transformer.REDUCED_HEAD_ROWS) runs as
products summed over the hidden size, not XLA:CPU's general matmul (which packed the whole
head on every call: SmolLM2's 2-token verification cost 1.55 one-token steps, 1.10 after):
the same logits as the matmul, tied and sub-vocabulary heads, and one row keeps the dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model import transformer as model

CFG = ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=12, tie_word_embeddings=True)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
def test_decode_head_matches_the_matmul(rows):
    params = model.init_params(CFG, jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (1, rows, CFG.hidden_size))
    with small_matmul.disabled():  # XLA's path, whatever this CPU's default
        f = jax.jit(lambda p, h: model.lm_logits(p, CFG, h, decode=True))
        got, hlo = f(params, h), f.lower(params, h).compile().as_text()
    want = model.lm_logits(params, CFG, h, decode=False)  # training's einsum
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    reduced = model.REDUCED_HEAD_ROWS[0] <= rows <= model.REDUCED_HEAD_ROWS[1]
    assert (" dot(" not in hlo) == reduced, rows
