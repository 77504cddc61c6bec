"""The training-throughput estimate's flop formula (s2d_jax/train/throughput.py) against
XLA's compiled cost analysis of the real SoFT step. XLA counts a loop's body once, so the
checked draft has one layer and one exit (the formula is linear in both)."""

import jax
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.train.config import load_train_config
from s2d_jax.train.loop import compile_step_aot
from s2d_jax.train.throughput import throughput_lines, train_flops_per_token


@pytest.mark.parametrize("tied", [True, False])
def test_the_formula_matches_the_compiled_steps_flops(tied):
    cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=1,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
    tc = load_train_config(None, ["model.path=unused", "draft.exits=[1]", "data.batch_size=8",
                                  "data.seq_len=128", "optimizer.frozen=[embed]"])
    compiled, _, _ = compile_step_aot(tc, cfg, (1,), jax.devices()[:1])
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"] / (8 * 128)
    # tied: the head is the frozen embedding (no weight gradient); untied: it trains
    want = train_flops_per_token(cfg, (1,), 128, frozen_head=tied).total
    assert 0.99 < xla / want < 1.05, (xla, want)  # the rest: softmax, norms, Adam (1%)


def test_the_estimate_scales_with_peak_and_utilisation():
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=12,
                      num_heads=9, num_kv_heads=3)
    f = train_flops_per_token(cfg, (2, 4, 6, 8, 12), 1024, kd=True)
    assert f.kd == pytest.approx(5 * 4 * 576 * 49152) and f.heads == pytest.approx(5 * 6 * 576 * 49152)
    half = throughput_lines(f, 65536, "h100", 0.5, cache_tokens=10 ** 7)
    quarter = throughput_lines(f, 65536, "h100", 0.25)
    per_min = [float(x[1].split(", ")[-1].split("M")[0]) for x in (half, quarter)]
    assert per_min[0] == pytest.approx(2 * per_min[1], rel=0.01)
    assert half[2].startswith("one pass over 10M tokens:")
