"""One target of the Spec-Bench-style benchmark (python -m infer.bench): load it, expand the
methods into runs (runner.method_specs, chains.py), build their decoders at one buffer
length, run them interleaved with the in-loop cost probes sampled between prompts, and
summarize (runner.summarize_target): `bench_target`."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

from s2d_jax.errors import S2DError


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """The per-target settings of a benchmark run (infer.bench's flags, same names)."""
    max_new_tokens: int = 128
    gamma: int | None = None  # None: the methods' default (DEFAULT_GAMMA)
    self_exit: int | None = None  # None: the deepest draft exit (or a quarter of the target)
    s2d_setting: tuple[str, ...] = ()  # EXITS:THRESHOLDS:GAMMA runs (runner.parse_s2d_setting)
    repeats: int = 1
    cost_every: int = 1
    dtype: str = "float32"
    quant_group: int = 64
    step_breakdown: bool = False


@dataclasses.dataclass
class _Target:
    """What one target's benchmark builds up: models, runs, buffer sizes, decoders."""
    name: str
    path: str
    cfg: object
    params: object
    draft_cfg: object
    draft_params: object
    exits: tuple
    self_exit: int | None = None
    specs: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    chains: tuple = ()
    chain_specs: list = dataclasses.field(default_factory=list)
    mids: dict = dataclasses.field(default_factory=dict)
    baseline: object = None
    width: int = 0
    max_len: int = 0
    decoders: dict = dataclasses.field(default_factory=dict)


def bench_target(name: str, path: str, opts: BenchOptions, *, kinds, temps, questions, prompts,
                 tok, draft, log: Callable[[str], None], chains=(), turns=None):
    """-> (the target's report entry, run_target's runs, notes). draft: (cfg, params, exits)
    or None; turns: runner.Conversations of the questions."""
    t = _load(name, path, opts, tok, draft)
    _method_specs(t, opts, kinds)
    _add_chains(t, opts, chains, log)
    _fit_buffer(t, opts, turns)
    _build_decoders(t, tok)
    log(f"[{name}] {len(t.decoders)} methods x {len(prompts)} prompts x T={temps} "
        f"(compiling {len(t.decoders)} generations first)")
    runs, probes, chain_probes, breakdown = _run(t, opts, prompts, temps, turns, log)
    costs = measured_costs(probes, name, log, t.notes)
    out = _summarize(t, runs, costs, questions, tok)
    if breakdown:
        out["draft_step_breakdown"] = breakdown
    if t.chains:
        from s2d_jax.bench import chains as bench_chain
        out["chains"] = bench_chain.bench_chains(
            list(t.chains), t.mids, t.decoders, t.baseline, runs["runs"], out["results"],
            chain_probes, prompts=[r["prompt"] for r in runs["runs"][0.0]["ar"]],
            prompt_width=t.width, max_len=t.max_len, max_new_tokens=opts.max_new_tokens,
            eos_id=turns.eos_id, log=log)
    return out, runs, t.notes


def _load(name, path, opts: BenchOptions, tok, draft) -> _Target:
    """The target, checked against the tokenizer and gamma, with the draft beside it."""
    from s2d_jax.decode.defaults import check_gamma
    from s2d_jax.decode.methods import DEFAULT_GAMMA
    from s2d_jax.io.checkpoint import load_model

    cfg, params, _ = load_model(path, dtype=opts.dtype)
    if tok.vocab_size > cfg.vocab_size:
        raise S2DError(f"tokenizer has {tok.vocab_size} tokens but target {name!r} only "
                       f"{cfg.vocab_size}; use the target's own tokenizer")
    draft_cfg, draft_params, exits = draft or (None, None, ())
    for what, c in ((f"target {name!r}", cfg), ("the draft", draft_cfg)):
        if c is not None:
            check_gamma(opts.gamma or DEFAULT_GAMMA, c.max_position_embeddings, what,
                        given=opts.gamma is not None)
    t = _Target(name, path, cfg, params, draft_cfg, draft_params, tuple(exits))
    t.self_exit = opts.self_exit or (min(max(exits), cfg.num_layers - 1) if exits
                                     else cfg.num_layers // 4)
    if t.self_exit < 1 or t.self_exit >= cfg.num_layers:
        t.self_exit = None
    return t


def _method_specs(t: _Target, opts: BenchOptions, kinds) -> None:
    """The methods' runs (s2d-cal from the target's s2d_serving.json) and the fixed
    --s2d-setting ones."""
    from s2d_jax.bench import runner as bench
    from s2d_jax.decode.serving_config import load_serving_config

    context = min(c.max_position_embeddings for c in (t.cfg, t.draft_cfg) if c is not None)
    served = load_serving_config(t.path, context)
    t.specs, notes = bench.method_specs(kinds, t.exits, t.self_exit, opts.gamma, served,
                                        target=t.path)
    t.specs += [bench.parse_s2d_setting(s, t.exits) for s in opts.s2d_setting]
    t.notes = [f"{t.name}: {n}" for n in notes]


def _add_chains(t: _Target, opts: BenchOptions, chains, log) -> None:
    """Each chain's intermediate loaded, its run and its two-level baseline's runs."""
    from s2d_jax.bench import chains as bench_chain

    t.chains = tuple(chains)
    if not chains:
        return
    t.baseline = bench_chain.pick_baseline(t.specs)
    for c in chains:  # a chain at another gamma is compared with the baseline at it
        base = bench_chain.chain_baseline(c, t.baseline)
        if base.label not in {s.label for s in t.specs}:
            t.specs.append(base)
    for c in chains:
        log(f"[{t.name}] loading chain intermediate {c.describe}")
        t.mids[c.label] = bench_chain.load_intermediate(c, t.cfg, t.params, dtype=opts.dtype,
                                                        quant_group=opts.quant_group)
        t.chain_specs.append(bench_chain.chain_method_spec(c, t.baseline))


def _fit_buffer(t: _Target, opts: BenchOptions, turns) -> None:
    """The padded prompt width and the buffer every decoder shares, which the longest
    prompt and the longest verified block (gamma, or gamma + mu for a chain) must fit."""
    from s2d_jax.bench import chains as bench_chain
    from s2d_jax.decode.defaults import buffer_len, prompt_width

    t.width = prompt_width(turns.longest)
    g_max = max([s.gamma for s in t.specs] + [1]
                + [bench_chain.chain_baseline(c, t.baseline).gamma
                   + bench_chain.chain_mu(c, t.baseline) for c in t.chains])
    context = min([t.cfg.max_position_embeddings]
                  + ([t.draft_cfg.max_position_embeddings] if t.draft_cfg else [])
                  + [m[0].max_position_embeddings for m in t.mids.values()])
    if t.width + g_max + 2 > context:
        later = " with room for a later turn's earlier answers" if turns.multi_turn else ""
        raise S2DError(f"the longest prompt ({t.width} tokens padded{later}) does not fit the "
                       f"context of {context}; use --max-prompts / --categories with shorter "
                       f"prompts" + (" or lower --max-new-tokens" if later else ""))
    t.max_len = buffer_len(t.width, opts.max_new_tokens, g_max + 1, context)


def _build_decoders(t: _Target, tok) -> None:
    from s2d_jax.bench import chains as bench_chain
    from s2d_jax.bench import runner as bench

    t.decoders = bench.build_decoders(t.specs, t.cfg, t.params, t.draft_cfg, t.draft_params,
                                      prompt_width=t.width, tokenizer=tok)
    for c in t.chains:
        t.decoders[c.label] = bench_chain.build_chain_decoder(
            c, t.mids[c.label], t.baseline, t.cfg, t.params, t.draft_cfg, t.draft_params,
            prompt_width=t.width, tokenizer=tok)


def _run(t: _Target, opts: BenchOptions, prompts, temps, turns, log):
    """run_target with the cost probes sampled after every cost_every-th prompt (and the
    draft step's breakdown after the warm-up) -> (runs, probes, chain probes, breakdown)."""
    from tqdm import tqdm

    from s2d_jax.bench import chains as bench_chain
    from s2d_jax.bench import runner as bench

    every = opts.cost_every
    log(f"[{t.name}] compiling the in-loop cost probes (sampled after "
        f"{'every prompt' if every == 1 else f'every {every} prompts'})")
    probes = bench.cost_probes(t.decoders, t.specs, prompts[0], temperatures=temps,
                               max_len=t.max_len)
    chain_probes = None
    if t.chains:
        chain_probes = bench_chain.ChainCostProbes(
            list(t.chains), t.mids, t.baseline, t.cfg, t.params, t.draft_cfg, t.draft_params,
            temperatures=temps, start=t.width, max_len=t.max_len)
    done = [0]

    def between():
        done[0] += 1
        if (done[0] - 1) % every:  # the first prompt always samples: costs exist
            return
        bench.sample_probes(probes)
        if chain_probes is not None:
            chain_probes.sample()

    breakdown = {}

    def after_warmup():
        if opts.step_breakdown and t.draft_cfg is not None:
            breakdown.update(_step_breakdown(t, float(temps[0]), log))
    runs = bench.run_target(t.decoders, prompts, temperatures=temps,
                            max_new_tokens=opts.max_new_tokens, max_len=t.max_len,
                            eos_id=turns.eos_id, repeats=opts.repeats,
                            progress=lambda it: tqdm(it, desc=t.name, file=sys.stderr),
                            between=between, next_turn=turns.next_prompt(t.width),
                            after_warmup=after_warmup)
    return runs, probes, chain_probes, breakdown


def _step_breakdown(t: _Target, temperature: float, log) -> dict:
    """--step-breakdown: the parts of a draft step against the target's decode step."""
    from s2d_jax.bench.step_costs import draft_step_breakdown, format_breakdown

    log(f"[{t.name}] timing the parts of a draft step (--step-breakdown)")
    breakdown = draft_step_breakdown(
        t.draft_cfg, t.draft_params, t.exits, target_cfg=t.cfg, target_params=t.params,
        max_len=t.max_len, steps=min(32, t.max_len - 1), temperature=temperature)
    log("\n".join([f"[{t.name}]"] + format_breakdown(breakdown)))
    return breakdown


def _summarize(t: _Target, runs: dict, costs, questions, tok) -> dict:
    """The target's report entry: per temperature and method the summary (with GSM8K
    final-answer accuracy where references exist)."""
    import jax

    from s2d_jax.bench import runner as bench
    from s2d_jax.bench.math_answers import math_accuracy

    cats = [questions[i]["task"] for i, _ in runs["items"]]  # Spec-Bench's tasks
    results = bench.summarize_target(runs["runs"], cats, t.specs + t.chain_specs, costs)
    for temp, per_method in runs["runs"].items():
        for label, rows in per_method.items():
            acc = math_accuracy(questions, runs["items"], rows, tok.decode)
            if acc is not None:
                results[str(temp)][label]["math_accuracy"] = acc
    return {"dir": os.path.abspath(t.path), "num_layers": t.cfg.num_layers,
            "num_params": int(sum(x.size for x in jax.tree.leaves(t.params))),
            "self_exit": t.self_exit, "costs": costs,
            "compile_seconds": runs["compile_seconds"], "results": results,
            "items": [list(x) for x in runs["items"]]}


def measured_costs(probes, name: str, log, notes: list) -> dict | None:
    """The in-loop round costs, or None (no predicted speedups, with a note) when the
    machine was too noisy to time them: the measured runs stay valid and are reported."""
    from s2d_jax.bench.runner import measure_costs

    try:
        return measure_costs(probes)
    except S2DError as e:
        note = (f"{name}: predicted speedups omitted, the round costs could not be timed "
                f"({e})")
        log(note)
        notes.append(note)
        return None
