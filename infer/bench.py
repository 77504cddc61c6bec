"""Spec-Bench-style benchmark of AR / SD per exit / self-speculation / S2D on one or more
targets sharing one sorted draft.

    python -m infer.bench --targets s=models/demo/target-s l=models/demo/target-l \\
        --draft models/demo/draft --max-prompts 8 --max-new-tokens 128 --out runs/bench

Methods (--methods): ar, sd (one run per draft exit), self (the target's first k layers,
--self-exit, default the draft's depth), s2d (the paper's 0.5/.../0 thresholds), s2d-cal
(thresholds and gamma from TARGET_DIR/s2d_serving.json, see infer.calibrate; skipped with
a note when absent). Every prompt runs every method back to back after a warm-up;
compilation is excluded from tokens/s. Writes to --out: report.json, report.md (also
printed), answers/<target>/<method>-T<temperature>.jsonl (Spec-Bench format) and, with
matplotlib (pip install -e '.[bench]'), speedup.png. --hf-baseline also times HF
transformers generate (plain, assisted), greedy (needs torch: the same extra).
--step-breakdown times, per target after the warm-up, the parts of a draft step (each
exit's segment, the head, a confidence, the token draw, the CALM K/V fill, and the whole
step: the rest is control flow) against the target's decode step
(s2d_jax/bench/step_costs.py; report.json targets.NAME.draft_step_breakdown, report.md).

Prompts are rendered with --chat-template (auto: the target tokenizer's own template, else
none). Questions with several turns (MT-bench) run as Spec-Bench runs them: each later turn
is asked after the method's own previous answers, every turn is timed and counted, and the
answer files hold one output per turn.

Polybasic chains (--chain NAME=MID[:int8|int4|w8a8][,gamma=G][,mu=M], repeatable): draft
-> MID -> target NAME, where MID is int8 / int4 / w8a8 (the target's own quantization:
weight-only, or int8 weights and activations) or a model dir (optionally quantized), with
the two-level S2D run's exits and thresholds, its gamma unless gamma=G (then that
two-level setting also runs at G, as <baseline>-gG, to compare with) and accumulation
length mu=M (default --mu, else gamma). Each chain runs interleaved with the other
methods, its per-call costs are sampled between prompts, then: per-level acceptance and costs, Lemma 3.1 predicted vs measured, the
insertion verdict (predicted helps/hurts vs measured faster/slower than two-level S2D), a
greedy batch-4 exactness check, and for a quantized target its memory and its own greedy
agreement with the target. Written under targets.NAME.chains in report.json and as tables
in report.md; `python -m infer.insertion --report OUT/report.json` prints the inequality.

    python -m infer.bench --targets l=models/demo/target-l --draft models/demo/draft \\
        --methods ar,s2d,s2d-cal --chain l=int8 --chain l=models/demo/target-m
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

from infer.args import ArgumentParser, path_arg
from s2d_jax.errors import S2DError, cli_main


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.bench", description=__doc__)
    ap.add_argument("--targets", nargs="+", required=True, metavar="NAME=DIR",
                    help="the target models, named")
    ap.add_argument("--draft", default=None, type=path_arg,
                    help="sorted draft dir (exits from its config)")
    ap.add_argument("--questions", default="data/demo_questions.jsonl", type=path_arg,
                    help="prompts (Spec-Bench / MT-bench jsonl)")
    ap.add_argument("--max-prompts", type=int, default=None,
                    help="prompts to use at most, round-robin over tasks (default: all)")
    ap.add_argument("--categories", default=None, help="comma-separated, default all")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="new tokens per answer at most")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--methods", default="ar,sd,self,s2d,s2d-cal",
                    help="comma-separated methods to compare")
    ap.add_argument("--s2d-setting", action="append", default=[],
                    metavar="EXITS:THRESHOLDS:GAMMA",
                    help="also run S2D at this fixed setting, e.g. 2,4:0.3,0:1 (repeatable; "
                    "label s2d_e2-4_t0.3-0_g1)")
    ap.add_argument("--self-exit", type=int, default=None,
                    help="target layers drafting for self (default: the deepest draft exit)")
    ap.add_argument("--temperatures", default="0,1",
                    help="comma-separated sampling temperatures (0 = greedy)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes over all prompts and methods; per prompt and method "
                    "the median (a slow spell of the machine hits one pass)")
    ap.add_argument("--cost-every", type=int, default=1, metavar="K",
                    help="sample the in-loop round-cost probes after every K-th prompt "
                    "(default 1; a probe of a 4-exit draft runs 4 x 48 rounds, so on a real "
                    "model K > 1 keeps a long run short)")
    ap.add_argument("--chat-template", default="auto", choices=("auto", "none", "vicuna"),
                    help="auto: the tokenizer's own template, else none (default auto)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute and weight dtype")
    ap.add_argument("--hf-baseline", action="store_true",
                    help="also time HF transformers generate (plain and assisted)")
    ap.add_argument("--chain", action="append", default=[],
                    metavar="NAME=MID[:int8|int4|w8a8][,gamma=G][,mu=M]",
                    help="a 3-level chain on target NAME with intermediate MID: int8 / int4 / w8a8 "
                    "(the quantized target) or a model dir; gamma/mu of this chain (repeatable)")
    ap.add_argument("--mu", type=int, default=None,
                    help="the chains' accumulation length (default: gamma)")
    ap.add_argument("--quant-group", type=int, default=64, help="int4 group size (rows)")
    ap.add_argument("--step-breakdown", action="store_true",
                    help="per target, time the parts of a draft step (each exit's segment, "
                    "the head, the confidence, the CALM fill, the control flow) against "
                    "the target's decode step, once after the warm-up")
    ap.add_argument("--out", default="runs/bench", type=path_arg,
                    help="output directory (report, answers, plot)")
    return ap.parse_args(argv)


def _check_args(args):
    from infer.args import check_at_least, check_output_path, parse_targets
    from infer.args import parse_floats as _floats
    check_at_least(args, {"max_prompts": 1, "self_exit": 1})
    targets = parse_targets(args.targets)
    for name, path in list(targets.items()) + ([("draft", args.draft)] if args.draft else []):
        if not os.path.exists(path):  # a model dir or a .gguf file
            raise S2DError(f"model dir {path} ({name}) does not exist; pass an HF model dir "
                           f"or a .gguf file")
    temps = _floats(args.temperatures, "--temperatures")
    if not temps or any(t < 0 for t in temps):
        raise S2DError(f"--temperatures must be non-negative numbers, got {args.temperatures}")
    for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--gamma", args.gamma),
                    ("--repeats", args.repeats), ("--cost-every", args.cost_every)):
        if v < 1:
            raise S2DError(f"{flag} must be >= 1, got {v}")
    kinds = [k.strip() for k in args.methods.split(",") if k.strip()]
    from s2d_jax.bench.runner import METHOD_KINDS
    bad = [k for k in kinds if k not in METHOD_KINDS]
    if bad or not kinds:
        raise S2DError(f"unknown method {bad[0] if bad else args.methods!r}; use some of "
                       f"{', '.join(METHOD_KINDS)}")
    if args.draft is None and (args.s2d_setting
                               or any(k in ("sd", "s2d", "s2d-cal") for k in kinds)):
        raise S2DError("methods sd / s2d / s2d-cal and --s2d-setting need --draft")
    from s2d_jax.bench.runner import parse_s2d_setting
    for text in args.s2d_setting:  # the form now; the exits once the draft is loaded
        parse_s2d_setting(text)
    if args.step_breakdown and args.draft is None:
        raise S2DError("--step-breakdown times the draft's step; pass --draft")
    if args.hf_baseline:
        from s2d_jax.bench.hf_baseline import require_torch
        require_torch()
    chains = _check_chains(args, targets, temps, kinds)
    from s2d_jax.io.outputs import DIR, Output, check_outputs
    check_outputs([Output("--out", args.out, DIR)], {
        "--targets": list(targets.values()), "--draft": args.draft,
        "--questions": args.questions,
        "--chain": [c.intermediate for cs in chains.values() for c in cs if c.intermediate]})
    check_output_path(args.out, is_dir=True)
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # found before the run
        raise S2DError(f"--out {args.out} is a file; pass a directory for the report")
    return targets, temps, kinds, chains


def _check_chains(args, targets, temps, kinds) -> dict:
    """--chain values -> {target name: [ChainSpec]}, checked before any model is loaded."""
    from s2d_jax.bench.chains import parse_chain

    if args.mu is not None and args.mu < 1:
        raise S2DError(f"--mu must be >= 1, got {args.mu}")
    if args.quant_group < 2:
        raise S2DError(f"--quant-group must be >= 2, got {args.quant_group}")
    if not args.chain:
        if args.mu is not None:
            raise S2DError("--mu needs a chain; pass --chain NAME=MID")
        return {}
    chains = {}
    for text in args.chain:
        c = parse_chain(text, args.mu)
        if c.target not in targets:
            raise S2DError(f"--chain {text}: unknown target {c.target!r}; known targets: "
                           f"{', '.join(targets)}")
        if c.intermediate and not os.path.isdir(c.intermediate):
            raise S2DError(f"--chain {text}: model dir {c.intermediate} does not exist")
        if any(o.label == c.label for o in chains.get(c.target, [])):
            raise S2DError(f"--chain {text} repeats chain {c.label} on target {c.target}")
        chains.setdefault(c.target, []).append(c)
    if args.draft is None:
        raise S2DError("--chain needs --draft (the chain's lowest level)")
    if "ar" not in kinds or not {"s2d", "s2d-cal"} & set(kinds):
        raise S2DError("--chain compares with AR and two-level S2D; include ar and s2d (or "
                       "s2d-cal) in --methods")
    if 0.0 not in temps:
        raise S2DError("--chain checks greedy exactness; include 0 in --temperatures")
    return chains


@contextlib.contextmanager
def hf_draft_dir(draft: str | None, target: str):
    """The draft as a dir transformers loads: a draft pack is completed with the target's
    shared weights into a temporary HF dir (removed afterwards)."""
    from s2d_jax.io.checkpoint import unpack_draft
    from s2d_jax.io.draft_pack import is_draft_pack
    from s2d_jax.io.tokenizer import has_tokenizer

    if draft is None or not os.path.isdir(draft) or not is_draft_pack(draft):
        yield draft
        return
    with tempfile.TemporaryDirectory(prefix="s2d-hf-draft-") as tmp:
        out = os.path.join(tmp, "draft")
        unpack_draft(draft, target, out, tokenizer_dir=target if os.path.isdir(target) and
                     has_tokenizer(target) else None)
        yield out


def bench_target(name, path, args, *, kinds, temps, questions, prompts, tok, draft, log,
                 chains=(), turns=None):
    import jax
    from tqdm import tqdm

    from s2d_jax.bench import runner as bench
    from s2d_jax.bench import chains as bench_chain
    from s2d_jax.decode.defaults import buffer_len, prompt_width
    from s2d_jax.decode.serving_config import load_serving_config
    from s2d_jax.io.checkpoint import load_model

    cfg, params, _ = load_model(path, dtype=args.dtype)
    if tok.vocab_size > cfg.vocab_size:
        raise S2DError(f"tokenizer has {tok.vocab_size} tokens but target {name!r} only "
                       f"{cfg.vocab_size}; use the target's own tokenizer")
    draft_cfg, draft_params, exits = draft or (None, None, ())
    from infer.args import check_gamma
    for what, c in ((f"target {name!r}", cfg), ("the draft", draft_cfg)):
        if c is not None:
            check_gamma(args.gamma, c.max_position_embeddings, what)
    self_exit = args.self_exit or (min(max(exits), cfg.num_layers - 1) if exits
                                   else cfg.num_layers // 4)
    if self_exit < 1 or self_exit >= cfg.num_layers:
        self_exit = None
    served = load_serving_config(path, min(c.max_position_embeddings for c in (cfg, draft_cfg)
                                           if c is not None))
    specs, notes = bench.method_specs(kinds, exits, self_exit, args.gamma, served)
    specs += [bench.parse_s2d_setting(t, exits) for t in args.s2d_setting]
    notes = [f"{name}: {n}" for n in notes]
    chain_specs, mids, baseline = [], {}, None
    if chains:
        baseline = bench_chain.pick_baseline(specs)
        for c in chains:  # a chain at another gamma is compared with the baseline at it
            base = bench_chain.chain_baseline(c, baseline)
            if base.label not in {s.label for s in specs}:
                specs.append(base)
        for c in chains:
            log(f"[{name}] loading chain intermediate {c.describe}")
            mids[c.label] = bench_chain.load_intermediate(c, cfg, params, dtype=args.dtype,
                                                          quant_group=args.quant_group)
            chain_specs.append(bench_chain.chain_method_spec(c, baseline))
    width = prompt_width(turns.longest)
    # the longest block a round verifies: gamma, or gamma + mu for a chain
    g_max = max([s.gamma for s in specs] + [1]
                + [bench_chain.chain_baseline(c, baseline).gamma
                   + bench_chain.chain_mu(c, baseline) for c in chains])
    context = min([cfg.max_position_embeddings]
                  + ([draft_cfg.max_position_embeddings] if draft_cfg else [])
                  + [m[0].max_position_embeddings for m in mids.values()])
    if width + g_max + 2 > context:
        later = " with room for a later turn's earlier answers" if turns.multi_turn else ""
        raise S2DError(f"the longest prompt ({width} tokens padded{later}) does not fit the "
                       f"context of {context}; use --max-prompts / --categories with shorter "
                       f"prompts" + (" or lower --max-new-tokens" if later else ""))
    max_len = buffer_len(width, args.max_new_tokens, g_max + 1, context)
    decoders = bench.build_decoders(specs, cfg, params, draft_cfg, draft_params,
                                    prompt_width=width, tokenizer=tok)
    for c in chains:
        decoders[c.label] = bench_chain.build_chain_decoder(
            c, mids[c.label], baseline, cfg, params, draft_cfg, draft_params,
            prompt_width=width, tokenizer=tok)
    log(f"[{name}] {len(decoders)} methods x {len(prompts)} prompts x T={temps} "
        f"(compiling {len(decoders)} generations first)")
    eos = turns.eos_id
    every = args.cost_every
    log(f"[{name}] compiling the in-loop cost probes (sampled after "
        f"{'every prompt' if every == 1 else f'every {every} prompts'})")
    probes = bench.cost_probes(decoders, specs, prompts[0], temperatures=temps,
                               max_len=max_len)
    chain_probes = None
    if chains:
        chain_probes = bench_chain.ChainCostProbes(
            list(chains), mids, baseline, cfg, params, draft_cfg, draft_params,
            temperatures=temps, start=width, max_len=max_len)

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
        if args.step_breakdown and draft_cfg is not None:
            from s2d_jax.bench.step_costs import draft_step_breakdown, format_breakdown
            log(f"[{name}] timing the parts of a draft step (--step-breakdown)")
            breakdown.update(draft_step_breakdown(
                draft_cfg, draft_params, exits, target_cfg=cfg, target_params=params,
                max_len=max_len, steps=min(32, max_len - 1), temperature=float(temps[0])))
            log("\n".join([f"[{name}]"] + format_breakdown(breakdown)))
    runs = bench.run_target(decoders, prompts, temperatures=temps,
                            max_new_tokens=args.max_new_tokens, max_len=max_len, eos_id=eos,
                            repeats=args.repeats,
                            progress=lambda it: tqdm(it, desc=name, file=sys.stderr),
                            between=between, next_turn=turns.next_prompt(width),
                            after_warmup=after_warmup)
    costs = _measured_costs(probes, name, log, notes)
    cats = [questions[i]["task"] for i, _ in runs["items"]]  # Spec-Bench's tasks
    results = bench.summarize_target(runs["runs"], cats, specs + chain_specs, costs)
    from s2d_jax.bench.math_answers import math_accuracy
    for t, per_method in runs["runs"].items():  # GSM8K final answers, where references exist
        for label, rows in per_method.items():
            acc = math_accuracy(questions, runs["items"], rows, tok.decode)
            if acc is not None:
                results[str(t)][label]["math_accuracy"] = acc
    out = {"dir": os.path.abspath(path), "num_layers": cfg.num_layers,
           "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
           "self_exit": self_exit, "costs": costs, "compile_seconds": runs["compile_seconds"],
           "results": results, "items": [list(x) for x in runs["items"]]}
    if breakdown:
        out["draft_step_breakdown"] = breakdown
    if chains:
        out["chains"] = bench_chain.bench_chains(
            list(chains), mids, decoders, baseline, runs["runs"], results, chain_probes,
            prompts=[r["prompt"] for r in runs["runs"][0.0]["ar"]], prompt_width=width,
            max_len=max_len,
            max_new_tokens=args.max_new_tokens, eos_id=eos, log=log)
    return out, runs, notes


def _measured_costs(probes, name: str, log, notes: list) -> dict | None:
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


@cli_main
def main(argv=None):
    args = parse_args(argv)
    targets, temps, kinds, chains = _check_args(args)
    from s2d_jax.bench import report as bench_report
    from s2d_jax.bench import runner as bench_runner
    from s2d_jax.data.prompts import read_questions, resolve_template
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.io.tokenizer import load_tokenizer

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    questions = read_questions(args.questions, cats, args.max_prompts)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tok = load_tokenizer(next(iter(targets.values())))
    template, note = resolve_template(tok, args.chat_template, fallback="none")
    if note:
        log(note)
    turns = bench_runner.Conversations(tok, template, questions, args.max_new_tokens)
    prompts = turns.first_prompts
    draft = None
    if args.draft:
        from s2d_jax.io.checkpoint import load_draft
        # a draft pack takes its shared weights from the (first) target it was made for
        d_cfg, d_params, extra = load_draft(args.draft, next(iter(targets.values())),
                                            dtype=args.dtype)
        draft = (d_cfg, d_params, draft_exits(extra, d_cfg))
    report = {"settings": {k: v for k, v in vars(args).items()}, "targets": {}, "notes": []}
    report["settings"].update(prompts=len(prompts), temperatures=temps, methods=kinds,
                              chat_template=template,
                              turns=sum(len(q["turns"]) for q in questions))
    all_runs = {}
    for name, path in targets.items():
        tgt, runs, notes = bench_target(name, path, args, kinds=kinds, temps=temps,
                                        questions=questions, prompts=prompts, tok=tok,
                                        draft=draft, log=log, chains=chains.get(name, ()),
                                        turns=turns)
        report["targets"][name], all_runs[name] = tgt, runs
        report["notes"] += notes
        if args.hf_baseline:
            from s2d_jax.bench.hf_baseline import hf_baselines
            log(f"[{name}] HF transformers generate (plain, assisted)")
            ar = runs["runs"].get(0.0, {}).get("ar")  # its turns' prompts: AR's conversation
            with hf_draft_dir(args.draft, path) as hf_draft:
                tgt["hf_baseline"] = hf_baselines(
                    path, hf_draft, [r["prompt"] for r in ar] if ar else prompts,
                    max_new_tokens=args.max_new_tokens, eos_id=turns.eos_id,
                    ar_token_ids=[r["token_ids"] for r in ar] if ar else None)
        # Drop this target's executables: each holds JIT code pages, and a few hundred of
        # them (3 targets x methods x temperatures x cost probes) exhaust LLVM's section
        # memory ("Unable to allocate section memory") in one process.
        import gc
        import jax
        jax.clear_caches()
        gc.collect()
    report["acceptance"] = bench_report.acceptance_checks(report)
    report["notes"].append("tokens/s and speedups exclude compilation (compile_seconds); "
                           "answer files' accept_lengths repeat each prompt's mean accepted "
                           "length per round (per-round counts are not recorded)")
    out = args.out
    for name, runs in all_runs.items():
        for t, per_method in runs["runs"].items():
            for label, rows in per_method.items():
                texts = [tok.decode(r["token_ids"]) for r in rows]
                bench_report.write_answers(
                    os.path.join(out, "answers", name, f"{label}-T{t:g}.jsonl"),
                    bench_report.answer_rows(questions, runs["items"], rows, texts,
                                             f"{name}-{label}"))
    table = bench_report.markdown_table(report)
    bench_report.write_atomic(os.path.join(out, "report.json"), json.dumps(report, indent=2))
    bench_report.write_atomic(os.path.join(out, "report.md"), table)
    print(table)
    if not bench_report.plot(report, os.path.join(out, "speedup.png")):
        print(f"speedup.png skipped: matplotlib is not installed "
              f"({bench_report.PLOT_EXTRA})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
