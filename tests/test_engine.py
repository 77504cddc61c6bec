"""The jitted engine: greedy exactness of every method, escalation, statistics, no
recompilation for traced settings, streaming chunks, routing, and input errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.decode import engine
from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.decode.state import DecodeParams
from s2d_jax.errors import S2DError
from s2d_jax.decode.serving import Decoder, Engine, TargetSpec
from tiny_models import numpy_params as numpy_init

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=96)
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [9, 10], [11, 12, 13], [1]]
NEW = 20


@functools.lru_cache(maxsize=None)
def target_params(seed=0):
    # std 0.5 makes random logits peaked enough for partial, non-trivial acceptance.
    return numpy_init(CFG, seed, 0.5)


@functools.lru_cache(maxsize=None)
def draft():
    """A 3-layer sorted draft = the target's first 3 layers (a separate params dict)."""
    p = target_params()
    dp = dict(p, layers=jax.tree.map(lambda x: x[:3], p["layers"]))
    return dataclasses.replace(CFG, num_layers=3), dp


_full_forward = jax.jit(lambda p, t: model.forward(p, CFG, t)[0])


@functools.lru_cache(maxsize=None)
def reference(prompt, seed=0, n=NEW):
    """Greedy AR tokens by full recomputation (no KV cache) on a fixed-length buffer."""
    fwd = _full_forward
    buf = np.zeros((1, 48), np.int32)
    buf[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        buf[0, t] = int(jnp.argmax(fwd(target_params(seed), jnp.asarray(buf))[0, t - 1]))
    return buf[0, len(prompt):len(prompt) + n].tolist()


def make_decoder(method, exits, gamma, **kw):
    dcfg, dparams = draft()
    return Decoder(CFG, target_params(), method=method, draft_cfg=dcfg, draft_params=dparams,
                   exits=exits, gamma=gamma, **kw)


# Each case is one compilation (~10-25 s on a loaded 2-core CPU), so the fast set is small;
# thresholds are traced, so every case tries all threshold settings for free.
CASES = [  # (method, exits, gamma, batch)
    ("ar", (), 0, 4),
    ("s2d", (1, 2, 3), 3, 4),
    ("sd", (2,), 2, 1),
    ("self", (2,), 4, 4),
]
SLOW_CASES = [
    ("s2d", (1, 3), 1, 1),
    ("sd", (1,), 3, 4), ("sd", (3,), 5, 4), ("self", (1,), 2, 1), ("self", (3,), 3, 1),
    ("s2d", (2, 3), 5, 4), ("s2d", (1, 2, 3), 2, 1),
]


def _check_greedy(method, exits, gamma, batch):
    dec = make_decoder(method, exits, gamma)
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[0]]
    mats = []
    threshold_sets = [[0.0] * len(exits), [1.0] * len(exits), [0.3] * len(exits),
                      [0.9, 0.2, 0.5][:len(exits)]] if exits else [None]
    for th in threshold_sets:
        out = dec.generate(prompts, max_new_tokens=NEW, thresholds=th, eos_id=-1)
        for p, o in zip(prompts, out):
            assert o["token_ids"] == reference(tuple(p)), (method, exits, gamma, th, p)
            assert o["stats"]["new_tokens"] == NEW
            mats.append(o["stats"]["mean_accepted_tokens"])
    return mats


@pytest.mark.parametrize("method,exits,gamma,batch", CASES)
def test_greedy_matches_target_autoregressive(method, exits, gamma, batch):
    mats = _check_greedy(method, exits, gamma, batch)
    if method == "ar":
        assert all(m == 1.0 for m in mats)
    else:
        assert max(mats) > 1.05, mats  # acceptance actually happens
        assert all(1.0 <= m <= gamma + 1 for m in mats)


@pytest.mark.slow
@pytest.mark.parametrize("method,exits,gamma,batch", SLOW_CASES)
def test_greedy_matches_more_exits_and_gammas(method, exits, gamma, batch):
    _check_greedy(method, exits, gamma, batch)


def test_escalation_is_real_and_counted():
    dec = make_decoder("s2d", (1, 2, 3), 3)
    for th, used in [([0.0] * 3, 0), ([1.0] * 3, 2)]:
        out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=th, eos_id=-1)
        for o in out:
            usage = o["stats"]["exit_usage"]
            assert usage[used] > 0 and sum(usage) == usage[used], (th, usage)
            assert sum(usage) >= o["stats"]["rounds"]  # >= one drafted token per round
    mid = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.3, 0.3, 0.3], eos_id=-1)
    usage = np.sum([o["stats"]["exit_usage"] for o in mid], axis=0)
    assert (usage > 0).sum() >= 2, usage  # a middle threshold mixes exits


@pytest.mark.slow
def test_kv_fill_full_reference_is_exact_too():
    dec = make_decoder("s2d", (1, 2, 3), 3, kv_fill="full")
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.3] * 3, eos_id=-1)
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p))


def test_traced_settings_do_not_recompile():
    """Thresholds, temperature, top-k/p and lengths are traced; greedy vs sampling is the
    one static switch (SamplingParams.greedy): exactly one program per mode."""
    dec = make_decoder("s2d", (1, 2, 3), 3)
    spec, prompts, lens = dec.prepare(PROMPTS, NEW)
    run = functools.partial(engine.generate, dec.draft_params, dec.target_params, prompts, lens,
                            chain=dec.chain_for(spec))
    jax.block_until_ready(run(DecodeParams.make(spec, [0.5] * 3), jax.random.key(0)))
    size = engine.generate._cache_size()
    for th, temp, top_p, top_k, new, programs in [([0.1, 0.2, 0.3], 0.0, 1.0, 0, 10, 0),
                                                  ([1.0, 0.0, 0.4], 0.7, 0.9, 0, 20, 1),
                                                  ([0.0, 0.0, 0.0], 1.3, 1.0, 5, 30, 1),
                                                  ([0.2, 0.2, 0.2], 0.0, 0.8, 3, 12, 1)]:
        dp = DecodeParams.make(spec, th, temperature=temp, top_p=top_p, top_k=top_k,
                               max_new_tokens=new)
        state = run(dp, jax.random.key(1))
        assert int(jnp.max(state.length - state.prompt_len)) == new
        assert engine.generate._cache_size() == size + programs


@pytest.mark.slow  # two extra compilations (prefill, decode_chunk): ~30 s on a loaded CPU
def test_streaming_chunks_equal_single_jit():
    dec = make_decoder("s2d", (1, 2, 3), 3)
    kw = dict(max_new_tokens=NEW, thresholds=[0.4] * 3, temperature=1.0, top_p=0.9, seed=3,
              eos_id=-1)
    whole = dec.generate(PROMPTS, **kw)
    seen = []
    chunked = dec.generate(PROMPTS, chunk_rounds=2, on_chunk=lambda s: seen.append(1), **kw)
    assert [o["token_ids"] for o in whole] == [o["token_ids"] for o in chunked]
    assert len(seen) >= 3


def test_generation_stops_after_eos():
    dec = make_decoder("s2d", (1, 2, 3), 3)
    ref = reference(tuple(PROMPTS[1]))
    eos = ref[5]
    stop = ref.index(eos) + 1
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.4] * 3, eos_id=eos)
    assert out[1]["token_ids"] == ref[:stop]
    for p, o in zip(PROMPTS, out):  # every row stops at its own first EOS
        r = reference(tuple(p))
        assert o["token_ids"] == (r[:r.index(eos) + 1] if eos in r else r)


def test_dynamic_draft_length_stays_exact():
    dec = make_decoder("s2d", (1, 2, 3), 3)
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.3] * 3, eos_id=-1,
                       stop_threshold=1.0)  # every row stops after its first draft token
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p))
        rates = o["stats"]["acceptance_rate_per_position"]
        assert rates[0] is not None and rates[1] is None and rates[2] is None


def test_decoder_default_draft_stop_and_its_validation():
    dcfg, dparams = draft()
    # Same gamma and batch as the s2d case: no new compilation (the stop is traced).
    eng = Engine({"a": TargetSpec(CFG, target_params(), gamma=3, thresholds=[0.3] * 3,
                                  stop_threshold=1.0)},
                 draft_cfg=dcfg, draft_params=dparams, exits=(1, 2, 3))
    for p, o in zip(PROMPTS, eng.generate("a", PROMPTS, max_new_tokens=NEW, eos_id=-1)):
        assert o["token_ids"] == reference(tuple(p))
        assert o["stats"]["acceptance_rate_per_position"][1] is None  # one draft token
    with pytest.raises(S2DError, match="stop threshold must lie in"):
        make_decoder("s2d", (1, 2, 3), 3, stop_threshold=1.5)


def test_engine_routes_to_named_targets():
    dcfg, dparams = draft()
    other = target_params(1)
    # Same gamma and batch as other tests, so no new compilation; params are arguments.
    eng = Engine({"a": TargetSpec(CFG, target_params(), gamma=3, thresholds=[0.3] * 3),
                  "b": TargetSpec(CFG, other, gamma=3, thresholds=[1.0] * 3)},
                 draft_cfg=dcfg, draft_params=dparams, exits=(1, 2, 3))
    out_a = eng.generate("a", PROMPTS, max_new_tokens=NEW, eos_id=-1)
    out_b = eng.generate("b", PROMPTS, max_new_tokens=NEW, eos_id=-1)
    for p, a, b in zip(PROMPTS, out_a, out_b):
        assert a["token_ids"] == reference(tuple(p), 0)
        assert b["token_ids"] == reference(tuple(p), 1)
        assert sum(b["stats"]["exit_usage"]) == b["stats"]["exit_usage"][2]  # b's thresholds
    with pytest.raises(S2DError, match="unknown target"):
        eng.generate("c", [PROMPTS[0]])


class _Tok:
    def __init__(self, fp):
        self.fp = fp

    def fingerprint(self):
        return self.fp


def test_bad_input_raises_clear_errors():
    dcfg, dparams = draft()
    dec = make_decoder("s2d", (1, 2, 3), 3)
    with pytest.raises(S2DError, match="does not fit the context"):
        dec.generate([list(range(1, 60)) * 2], max_new_tokens=4)
    with pytest.raises(S2DError, match="empty"):
        dec.generate([[1, 2], []], max_new_tokens=4)
    with pytest.raises(S2DError, match="threshold"):
        dec.generate([[1, 2]], thresholds=[0.5, 0.5])
    with pytest.raises(S2DError, match=r"\[0, 1\]"):
        dec.generate([[1, 2]], thresholds=[0.5, 1.5, 0.2])
    with pytest.raises(S2DError, match="gamma"):
        make_decoder("s2d", (1, 2, 3), 0)
    with pytest.raises(S2DError, match="vocab_size"):
        Decoder(dataclasses.replace(CFG, vocab_size=65), target_params(), method="s2d",
                draft_cfg=dcfg, draft_params=dparams, exits=(1, 2, 3))
    with pytest.raises(S2DError, match="tokenizer"):
        make_decoder("s2d", (1, 2, 3), 3, target_tokenizer=_Tok("a"), draft_tokenizer=_Tok("b"))
    with pytest.raises(S2DError, match="deeper than the draft"):
        make_decoder("sd", (4,), 3)


@pytest.mark.slow  # its own buffer size, so its own compilation
def test_generation_stops_when_cache_is_full():
    dec = make_decoder("s2d", (1, 2, 3), 3)
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.4] * 3, eos_id=-1,
                       max_len=20)
    for p, o in zip(PROMPTS, out):
        n = len(o["token_ids"])
        # Every row fills the 20 slots, as AR would: the last rounds shrink their blocks.
        assert len(p) + n == 20, (len(p), n)
        assert o["token_ids"] == reference(tuple(p))[:n]


@pytest.mark.slow  # sharded compilation over 8 fake devices
def test_sharded_generation_matches_reference():
    from s2d_jax.parallel.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    dcfg, dparams = draft()
    place = lambda cfg, p: jax.device_put(p, model.param_shardings(cfg, mesh))
    dec = Decoder(CFG, place(CFG, target_params()), method="s2d", draft_cfg=dcfg,
                  draft_params=place(dcfg, dparams), exits=(1, 2, 3), gamma=3, mesh=mesh)
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.4] * 3, eos_id=-1)
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p))
    assert dec.target_params["layers"]["wq"].sharding.spec[2] == "tensor"  # really split
