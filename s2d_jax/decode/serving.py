"""Host side of decoding: input checks, padding to static buckets, the multi-target Engine,
and statistics summaries.

`Decoder` = one target with its draft, method, gamma and thresholds. `Engine` = one draft
shared by several named targets, each request routed to its target. Everything on the hot
path is in engine.py; this file only prepares arrays and reads results back.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.config import ModelConfig
from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.checks import check_stop_threshold, check_thresholds
from s2d_jax.decode.defaults import buffer_len, eos_id_or_default, prompt_width
from s2d_jax.decode.methods import LOOKUP_RUNG, METHODS
from s2d_jax.decode.serving_config import DecodeSetting, resolve
from s2d_jax.decode.state import DecodeParams, GenState, SpecConfig
from s2d_jax import compile_cache, validate
from s2d_jax.errors import S2DError


def _fingerprint(tok):
    return None if tok is None else tok.fingerprint()


def _check_tokenizers(draft_tokenizer, target_tokenizer, name: str) -> None:
    fp_d, fp_t = _fingerprint(draft_tokenizer), _fingerprint(target_tokenizer)
    if fp_d is not None and fp_t is not None and fp_d != fp_t:
        raise S2DError(f"draft tokenizer differs from target {name!r}'s tokenizer; "
                       f"use a draft trained with the target's tokenizer")


def build_chain(target_cfg: ModelConfig, setting: DecodeSetting, *,
                draft_cfg: ModelConfig | None, confidence: str, kv_fill: str, mid_cfgs=(),
                mus=None, mesh=None, name: str = "target") -> Chain:
    """The static Chain of one target under one setting (buffer length a placeholder:
    Decoder.prepare sizes it per batch); the chain's own rules are checked here, once."""
    row = setting.proposer
    if row.self_draft:
        draft_cfg = target_cfg
    if row.needs_draft and draft_cfg is None:
        raise S2DError(f"method {setting.method} needs a draft model; pass --draft")
    mid_cfgs = tuple(mid_cfgs)
    if mid_cfgs and not row.proposes:
        raise S2DError(f"method {setting.method} has no draft to chain; drop the intermediate "
                       f"models")
    mus = tuple(mus) if mus is not None else (setting.gamma,) * len(mid_cfgs)
    try:
        spec = SpecConfig(method=setting.method, exits=setting.exits, gamma=setting.gamma,
                          max_len=16, confidence=confidence, kv_fill=kv_fill, mus=mus,
                          ngram=setting.ngram, lookup_len=setting.lookup_len)
        return Chain(draft_cfg, mid_cfgs, target_cfg, spec, mesh)
    except S2DError as e:
        raise S2DError(f"target {name!r}: {e}") from None


def _check_decoder_args(target_cfg, draft_cfg, confidence, kv_fill, name, mus) -> None:
    """The Decoder's arguments by the API's one validator (s2d_jax/validate.py)."""
    from s2d_jax.decode.sampling import CONFIDENCE_KINDS
    from s2d_jax.decode.state import KV_FILL
    for what, cfg, optional in (("target_cfg", target_cfg, False),
                                ("draft_cfg", draft_cfg, True)):
        if not (cfg is None and optional) and not isinstance(cfg, ModelConfig):
            raise S2DError(f"{what} must be a ModelConfig (s2d_jax.load_model returns one), "
                           f"got {type(cfg).__name__}")
    validate.choice(confidence, "confidence", CONFIDENCE_KINDS)
    validate.choice(kv_fill, "kv_fill", KV_FILL)
    validate.text(name, "name")
    validate.integers_list(mus, "mus", 1, optional=True)


def setting_of(setting: DecodeSetting | None, draft_cfg: ModelConfig | None,
               **overrides) -> DecodeSetting:
    """The setting a Decoder runs: `setting` as it is (from serving_config.resolve or
    target_setting), or, without one, resolve's for the keywords given (method default
    s2d; the draft's exits: its full depth, as a draft config alone knows no others)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if setting is not None:
        if not isinstance(setting, DecodeSetting):
            raise S2DError(f"setting must be a DecodeSetting (serving_config.resolve returns "
                           f"one), got {type(setting).__name__}")
        if given:
            raise S2DError(f"pass either setting or {', '.join(sorted(given))}: the setting "
                           f"already holds them")
        return setting
    method = given.pop("method", "s2d")
    validate.choice(method, "method", METHODS)
    validate.integer(given.get("gamma"), "gamma", 0, optional=True)  # 0: AR's, none drafted
    validate.numbers_list(given.get("thresholds"), "thresholds", 0.0, 1.0, optional=True)
    validate.integers_list(given.get("ngram"), "ngram", 1, optional=True)
    validate.integer(given.get("lookup_len"), "lookup_len", 0, optional=True)
    if isinstance(given.get("exits"), (tuple, list)) and not given["exits"]:
        given.pop("exits")  # () = none given (a method without exits takes none)
    validate.integers_list(given.get("exits"), "exits", 1, optional=True)
    depth = () if draft_cfg is None else (draft_cfg.num_layers,)
    return resolve(method, depth, None, draft_layers=draft_cfg and draft_cfg.num_layers,
                   **given)


class Decoder:
    """One target + its draft under one method. Params are used as given (already placed)."""

    def __init__(self, target_cfg: ModelConfig, target_params,
                 setting: DecodeSetting | None = None, *, method: str | None = None,
                 draft_cfg: ModelConfig | None = None, draft_params=None,
                 exits: Sequence[int] | None = None, gamma: int | None = None,
                 thresholds=None, confidence: str = "max_prob", kv_fill: str = "calm",
                 target_tokenizer=None, draft_tokenizer=None, name: str = "target",
                 mesh=None, intermediates: Sequence[tuple[ModelConfig, object]] = (),
                 mus: Sequence[int] | None = None, stop_threshold: float | None = None,
                 ngram: Sequence[int] | None = None, lookup_len: int | None = None):
        """`setting`: the DecodeSetting to run (serving_config.resolve / target_setting),
        taken as it is; without one, the keywords method (default s2d), exits, gamma,
        thresholds, stop_threshold, ngram and lookup_len are resolve's overrides, with
        resolve's defaults for the rest. `intermediates` = [(cfg, params), ...] between
        draft and target make a polybasic chain (round.py) with accumulation lengths `mus`
        (default: gamma per level)."""
        _check_decoder_args(target_cfg, draft_cfg, confidence, kv_fill, name, mus)
        setting = setting_of(setting, draft_cfg, method=method, exits=exits, gamma=gamma,
                             thresholds=thresholds, stop_threshold=stop_threshold,
                             ngram=ngram, lookup_len=lookup_len)
        row = setting.proposer
        if row.self_draft:
            draft_params, draft_tokenizer = target_params, None
        if row.needs_draft:
            if draft_params is None:
                raise S2DError(f"method {setting.method} needs a draft model; pass --draft")
            _check_tokenizers(draft_tokenizer, target_tokenizer, name)
        intermediates = tuple(intermediates)
        self.name = name
        self.setting = setting
        self.chain = build_chain(target_cfg, setting, draft_cfg=draft_cfg,
                                 confidence=confidence, kv_fill=kv_fill,
                                 mid_cfgs=[c for c, _ in intermediates], mus=mus, mesh=mesh,
                                 name=name)
        self.target_params = target_params
        self.draft_params = draft_params if self.chain.draft is not None else None
        self.mid_params = tuple(p for _, p in intermediates)
        self.thresholds = check_thresholds(setting.thresholds, self.chain.spec.exits)
        self.stop_threshold = setting.stop_threshold

    # The chain's parts under the names callers (bench, infer) read.
    target_cfg = property(lambda self: self.chain.target)
    draft_cfg = property(lambda self: self.chain.draft)
    mid_cfgs = property(lambda self: self.chain.mids)
    mesh = property(lambda self: self.chain.mesh)
    spec_base = property(lambda self: self.chain.spec)
    context = property(lambda self: self.chain.context)

    def prepare(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                max_len: int | None = None, width: int | None = None):
        """Check prompts and pad them to a static bucket (`width`, if given: a wider one,
        as a conversation's turns share: defaults.conversation_width) -> (spec, prompts
        [B,P], lens [B])."""
        if not prompts:
            raise S2DError("no prompts given; pass at least one prompt")
        V = self.target_cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise S2DError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
            if min(p) < 0 or max(p) >= V:
                raise S2DError(f"prompt {i} has token ids outside [0, {V}); wrong tokenizer?")
        longest = max(len(p) for p in prompts)
        # Near a full buffer the rounds shrink (round.py): any room for one token will do.
        if longest >= self.context:
            raise S2DError(f"a prompt of {longest} tokens does not fit the context of "
                           f"{self.context} tokens with a new token; shorten the prompt")
        P = prompt_width(longest, self.context)
        if width is not None:
            P = min(max(P, prompt_width(width)), self.context)
        if max_len is None:
            max_len = buffer_len(P, max_new_tokens, self.spec_base.round_span, self.context)
        elif max_len <= longest:
            raise S2DError(f"max_len {max_len} leaves no room for a new token after a prompt "
                           f"of {longest} tokens; pass max_len > {longest} (or none: the "
                           f"buffer is then sized from max_new_tokens)")
        P = min(P, max_len)  # an explicit buffer shorter than the padded prompt trims padding
        spec = dataclasses.replace(self.spec_base, max_len=max_len)
        arr = np.zeros((len(prompts), P), np.int32)
        for i, p in enumerate(prompts):
            arr[i, :len(p)] = p
        return spec, jnp.asarray(arr), jnp.asarray([len(p) for p in prompts], jnp.int32)

    def chain_for(self, spec: SpecConfig) -> Chain:
        """This decoder's chain with the buffer of `spec` (from prepare)."""
        return self.chain.with_max_len(spec.max_len)

    def decode_params(self, spec, thresholds=None, **kw) -> DecodeParams:
        return DecodeParams.make(spec, self.thresholds if thresholds is None else thresholds, **kw)

    def prefill_args(self, arr, lens, dp: DecodeParams, seed: int) -> tuple:
        """The positional arguments of engine.generate / engine.prefill."""
        return (self.draft_params, self.target_params, arr, lens, dp, jax.random.key(seed),
                self.mid_params)

    def loop_args(self, dp: DecodeParams, rounds: int) -> tuple:
        """engine.decode_chunk's arguments after the state."""
        return (self.draft_params, self.target_params, dp, jnp.int32(rounds), self.mid_params)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 thresholds=None, eos_id: int | None = None,
                 stop_threshold: float | None = None, max_len: int | None = None,
                 chunk_rounds: int = 0,
                 on_chunk: Callable[[GenState], None] | None = None,
                 width: int | None = None) -> list[dict]:
        """Generate for a batch of token-id prompts -> one dict per prompt (ids + stats).
        width: pad the prompts to at least this many positions (prepare).

        chunk_rounds > 0 runs prefill, then the round loop in jitted chunks of that many
        rounds (state donated), calling on_chunk(state) between chunks (streaming), and
        times the prefill on its own (stats["prefill_seconds"]). The result is identical to
        the single-jit path: keys depend only on the round index.
        """
        from s2d_jax import validate
        prompts = validate.token_prompts(prompts)
        settings = validate.decode_settings(max_new_tokens, temperature, top_k, top_p, seed)
        max_new_tokens, temperature, top_k, top_p, seed = settings.values()
        validate.integer(eos_id, "eos_id", -1, optional=True)
        validate.integer(max_len, "max_len", 1, optional=True)
        validate.integer(chunk_rounds, "chunk_rounds", 0)
        validate.callable_or_none(on_chunk, "on_chunk")
        validate.integer(width, "width", 1, optional=True)
        spec, arr, lens = self.prepare(prompts, max_new_tokens, max_len, width)
        stop = self.stop_threshold if stop_threshold is None else check_stop_threshold(
            stop_threshold)
        dp = self.decode_params(spec, thresholds, temperature=temperature, top_k=top_k,
                                top_p=top_p, max_new_tokens=max_new_tokens,
                                eos_id=eos_id_or_default(eos_id, self.target_cfg),
                                stop_threshold=stop)
        args = self.prefill_args(arr, lens, dp, seed)
        if chunk_rounds <= 0:
            timing = run_whole(self.chain_for(spec), args)
        else:
            timing = run_streamed(self.chain_for(spec), args,
                                  self.loop_args(dp, chunk_rounds), on_chunk)
        return summarize(timing.state, timing.seconds, spec, timing.compile_seconds,
                         timing.prefill_seconds)


@dataclasses.dataclass
class Timed:
    """A finished generation and where its time went (compilation excluded from seconds)."""

    state: GenState
    seconds: float
    compile_seconds: float
    prefill_seconds: float | None = None  # of seconds; None: not split


def run_whole(chain: Chain, args: tuple) -> Timed:
    """engine.generate compiled ahead (jax caches it per chain and shapes), so the reported
    time and tokens/s exclude compilation, then run."""
    t0 = time.perf_counter()
    run = compile_cache.compiled(engine.generate, *args, chain=chain)
    compile_s = time.perf_counter() - t0
    start = time.perf_counter()
    state = jax.block_until_ready(run(*args))
    return Timed(state, time.perf_counter() - start, compile_s)


def run_streamed(chain: Chain, args: tuple, loop_args: tuple,
                 on_chunk: Callable[[GenState], None] | None) -> Timed:
    """engine.prefill, then engine.decode_chunk (state donated) until every row is done,
    calling on_chunk(state) between chunks; the prefill timed on its own."""
    t0 = time.perf_counter()
    first = compile_cache.compiled(engine.prefill, *args, chain=chain)
    split = compile_cache.compiled(engine.split_draft, loop_args[0], chain=chain)
    loop_args = (split(loop_args[0]),) + tuple(loop_args[1:])
    chunk = compile_cache.compiled(engine.decode_chunk, first.out_info, *loop_args,
                                   chain=chain)
    compile_s = time.perf_counter() - t0
    start = time.perf_counter()
    state = jax.block_until_ready(first(*args))
    prefill_s = time.perf_counter() - start
    while True:
        if on_chunk is not None:
            on_chunk(state)
        if bool(jnp.all(state.done)):
            break
        state = chunk(state, *loop_args)
    state = jax.block_until_ready(state)
    return Timed(state, time.perf_counter() - start, compile_s, prefill_s)


def summarize(state: GenState, seconds: float, spec: SpecConfig,
              compile_seconds: float = 0.0, prefill_seconds: float | None = None) -> list[dict]:
    """Per-row results: generated token ids and statistics (MAT counts the target's token)."""
    s = jax.device_get(state)
    st = s.stats
    total_new = int(np.sum(s.length - s.prompt_len))
    out = []
    for b in range(s.tokens.shape[0]):
        lo, hi = int(s.prompt_len[b]), int(s.length[b])
        rounds = int(st.rounds[b])
        proposed = st.proposed_at[b]
        calls = rounds + (hi > lo)  # each round's verify forward and the prefill's
        drafted = int(np.sum(proposed))
        out.append({
            "token_ids": s.tokens[b, lo:hi].tolist(),
            "stats": {
                "method": spec.method, "gamma": spec.gamma, "exits": list(spec.exits),
                "new_tokens": hi - lo,
                "rounds": rounds,
                # Spec-Bench MAT: tokens per target forward; the prefill's token is excluded.
                "mean_accepted_tokens": float(st.round_tokens[b]) / max(rounds, 1),
                "acceptance_rate_per_position": [
                    float(a) / float(p) if p else None for a, p in zip(st.accepted_at[b], proposed)],
                "exit_usage": st.exit_counts[b].tolist(),
                # the rung each accepted token came from (lookup, ladder: the report's split)
                "accepted_by_rung": {LOOKUP_RUNG: int(st.lookup_accepted[b]),
                                     **{f"exit {e}": int(n) for e, n in
                                        zip(spec.exits, st.exit_accepted[b])}},
                "lookup_proposed": int(st.lookup_proposed[b]),
                "ngram": list(spec.ngram) if spec.lookup else None,
                "lookup_len": spec.lookup_tokens if spec.lookup else None,
                # the readable statistics (decode/stats_line.py): what one target forward
                # bought, and which exit drafted how many tokens, how many of them kept
                "target_calls": calls,
                "tokens_per_target_call": (hi - lo) / calls if calls else None,
                "drafted_by_exit": {str(e): int(n) for e, n in zip(spec.exits,
                                                                   st.exit_counts[b])},
                "draft_acceptance": (float(np.sum(st.accepted_at[b])) / drafted
                                     if drafted else None),
                # Chain levels k = 1 .. n-1 (n = 2: the target): acceptance of level k-1's
                # tokens by level k, and level k's forwards.
                "mus": list(spec.mus),
                "level_acceptance_rate": [
                    float(a) / float(p) if p else None
                    for a, p in zip(st.level_accepted[b], st.level_proposed[b])],
                "level_forwards": st.level_calls[b].tolist(),
                "batch_seconds": seconds,  # generation only, compilation excluded
                "compile_seconds": compile_seconds,
                "prefill_seconds": prefill_seconds,  # of batch_seconds; None: not split
                "batch_tokens_per_s": total_new / seconds if seconds > 0 else None,
            }})
    return out


@dataclasses.dataclass
class TargetSpec:
    """A named target with its own decode settings: a DecodeSetting, or resolve's overrides
    (None: resolve's default; the method and exits are the Engine's)."""

    cfg: ModelConfig
    params: object
    gamma: int | None = None
    thresholds: Sequence[float] | None = None
    tokenizer: object = None
    stop_threshold: float | None = None  # dynamic draft length (Decoder), 0 = off
    ngram: tuple[int, int] | None = None  # the lookup rung's n range (lookup, ladder)
    lookup_len: int | None = None  # its most tokens (0 = gamma)
    setting: DecodeSetting | None = None


class Engine:
    """One draft, several targets: requests are routed to the named target's Decoder."""

    def __init__(self, targets: dict[str, TargetSpec], *, draft_cfg: ModelConfig | None = None,
                 draft_params=None, exits: Sequence[int] | None = None,
                 method: str | None = None,
                 draft_tokenizer=None, confidence: str = "max_prob", kv_fill: str = "calm",
                 mesh=None, intermediates=(), mus=None):
        if not isinstance(targets, dict) or not targets:
            raise S2DError("targets must be a non-empty dict {name: TargetSpec}; pass at least "
                           "one target")
        for name, t in targets.items():
            if not isinstance(name, str) or not isinstance(t, TargetSpec):
                raise S2DError(f"targets[{name!r}] must be a TargetSpec under a str name, got "
                               f"{type(t).__name__}")
        self.decoders = {
            name: Decoder(t.cfg, t.params, t.setting, method=method, draft_cfg=draft_cfg,
                          draft_params=draft_params, exits=exits, gamma=t.gamma,
                          thresholds=t.thresholds, confidence=confidence, kv_fill=kv_fill,
                          target_tokenizer=t.tokenizer, draft_tokenizer=draft_tokenizer,
                          name=name, mesh=mesh, intermediates=intermediates, mus=mus,
                          stop_threshold=t.stop_threshold, ngram=t.ngram,
                          lookup_len=t.lookup_len)
            for name, t in targets.items()}

    @property
    def target_names(self) -> list[str]:
        return list(self.decoders)

    def decoder(self, target: str) -> Decoder:
        if target not in self.decoders:
            raise S2DError(f"unknown target {target!r}; known targets: "
                           f"{', '.join(self.decoders)}")
        return self.decoders[target]

    def generate(self, target: str, prompts, **kw) -> list[dict]:
        return self.decoder(target).generate(prompts, **kw)
