"""Spec-Bench-style benchmark of AR / SD per exit / self-speculation / S2D on one or more
targets sharing one sorted draft.

    python -m infer.bench --target s=models/demo/target-s l=models/demo/target-l \\
        --draft models/demo/draft --max-prompts 8 --max-new-tokens 128 --out runs/bench

Methods (--methods): ar, sd (one run per draft exit), self (the target's first k layers,
--exit, default the draft's depth), s2d (the paper's 0.5/.../0 thresholds), s2d-cal
(thresholds and gamma from TARGET_DIR/s2d_serving.json, see infer.calibrate; skipped with
a note when absent), lookup (prompt lookup: tokens copied from the context, no draft),
ladder (the lookup, then S2D's exits after its tokens; lookup-cal / ladder-cal: their
calibrated sections). Every prompt runs every method back to back after a warm-up;
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

    python -m infer.bench --target l=models/demo/target-l --draft models/demo/draft \\
        --methods ar,s2d,s2d-cal --chain l=int8 --chain l=models/demo/target-m
"""

from __future__ import annotations

import json
import os
import sys

from s2d_jax.cli.args import ArgumentParser, parse_ints, target_paths
from s2d_jax.cli.flags import add
from s2d_jax.io.outputs import DIR
from s2d_jax.errors import S2DError, cli_main

CMD = "bench"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.bench", description=__doc__)
    # --targets, --self-exit: the old spellings, still accepted
    add(ap, "--target", CMD, aliases=("--targets",), dest="targets", required=True,
        paths=target_paths)
    for name in ("--draft", "--questions", "--max-prompts", "--categories", "--max-new-tokens",
                 "--gamma", "--methods"):
        add(ap, name, CMD)
    ap.add_argument("--s2d-setting", action="append", default=[],
                    metavar="EXITS:THRESHOLDS:GAMMA",
                    help="also run S2D at this fixed setting, e.g. 2,4:0.3,0:1 (repeatable; "
                    "label s2d_e2-4_t0.3-0_g1)")
    add(ap, "--exit", CMD, aliases=("--self-exit",), dest="self_exit")
    add(ap, "--temperatures", CMD)
    for name in ("--repeats", "--cost-every", "--chat-template", "--dtype"):
        add(ap, name, CMD)
    ap.add_argument("--hf-baseline", action="store_true",
                    help="also time HF transformers generate (plain and assisted)")
    ap.add_argument("--chain", action="append", default=[],
                    metavar="NAME=MID[:int8|int4|w8a8][,gamma=G][,mu=M]",
                    help="a 3-level chain on target NAME with intermediate MID: int8 / int4 / w8a8 "
                    "(the quantized target) or a model dir; gamma/mu of this chain (repeatable)")
    add(ap, "--mu", CMD)
    add(ap, "--quant-group", CMD)
    ap.add_argument("--step-breakdown", action="store_true",
                    help="per target, time the parts of a draft step (each exit's segment, "
                    "the head, the confidence, the CALM fill, the control flow) against "
                    "the target's decode step, once after the warm-up")
    add(ap, "--out", CMD, kind=DIR)
    args = ap.parse_args(argv)
    if args.mu is not None:  # generate's form (one per intermediate); a bench chain has one
        mu = parse_ints(args.mu, "--mu")  # its range: _check_chains
        if len(mu) != 1:
            raise S2DError(f"--mu {args.mu}: a bench chain has one intermediate; give one "
                           f"length, e.g. --mu 4")
        args.mu = mu[0]
    return args


def _check_args(args):
    from s2d_jax.cli.args import check_at_least, parse_targets
    from s2d_jax.cli.args import parse_floats as _floats
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
        if v is not None and v < 1:
            raise S2DError(f"{flag} must be >= 1, got {v}")
    kinds = [k.strip() for k in args.methods.split(",") if k.strip()]
    from s2d_jax.bench.runner import METHOD_KINDS, kind_method
    from s2d_jax.decode.methods import is_auto, proposer
    bad = [k for k in kinds if k not in METHOD_KINDS]
    if bad or not kinds:
        raise S2DError(f"unknown method {bad[0] if bad else args.methods!r}; use some of "
                       f"{', '.join(METHOD_KINDS)}")
    # auto needs a draft only where its choice does (without one it picks a method without)
    drafted = [k for k in METHOD_KINDS if not is_auto(k) and proposer(kind_method(k)).needs_draft]
    if args.draft is None and (args.s2d_setting or set(drafted) & set(kinds)):
        raise S2DError(f"methods {' / '.join(drafted)} and --s2d-setting need --draft")
    from s2d_jax.bench.runner import parse_s2d_setting
    for text in args.s2d_setting:  # the form now; the exits once the draft is loaded
        parse_s2d_setting(text)
    if args.step_breakdown and args.draft is None:
        raise S2DError("--step-breakdown times the draft's step; pass --draft")
    if args.hf_baseline:
        from s2d_jax.bench.hf_baseline import require_torch
        require_torch()
    chains = _check_chains(args, targets, temps, kinds)
    from s2d_jax.io.outputs import Output, check_outputs
    # the flags' paths were checked by the parser; the chains' models are known only now
    check_outputs([Output("--out", args.out, DIR)], {
        "--chain": [c.intermediate for cs in chains.values() for c in cs if c.intermediate]})
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
    from s2d_jax.bench.runner import kind_method
    from s2d_jax.decode.methods import BASELINE, has
    if BASELINE not in kinds or not any(has(kind_method(k), escalates=True, lookup=False)
                                        for k in kinds):
        raise S2DError("--chain compares with AR and two-level S2D; include ar and s2d (or "
                       "s2d-cal) in --methods")
    if 0.0 not in temps:
        raise S2DError("--chain checks greedy exactness; include 0 in --temperatures")
    return chains


def _options(args):
    """The per-target flags as the library's BenchOptions (same names)."""
    import dataclasses

    from s2d_jax.bench.target_bench import BenchOptions
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)}
    return BenchOptions(**{**same, "s2d_setting": tuple(args.s2d_setting)})


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _inputs(args, targets, temps, kinds) -> dict:
    """What every target shares: questions, tokenizer, chat template, conversations,
    prompts and the draft (cfg, params, exits); and the report's settings."""
    from s2d_jax.bench import runner as bench_runner
    from s2d_jax.data.prompts import read_questions, resolve_template
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.io.tokenizer import load_tokenizer

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    questions = read_questions(args.questions, cats, args.max_prompts)
    tok = load_tokenizer(next(iter(targets.values())))
    template, note = resolve_template(tok, args.chat_template)
    if note:
        log(note)
    turns = bench_runner.Conversations(tok, template, questions, args.max_new_tokens)
    draft = None
    if args.draft:
        from s2d_jax.io.checkpoint import load_draft
        # a draft pack takes its shared weights from the (first) target it was made for
        d_cfg, d_params, extra = load_draft(args.draft, next(iter(targets.values())),
                                            dtype=args.dtype)
        draft = (d_cfg, d_params, draft_exits(extra, d_cfg))
    settings = {**vars(args), "prompts": len(turns.first_prompts), "temperatures": temps,
                "methods": kinds, "chat_template": template,
                "turns": sum(len(q["turns"]) for q in questions)}
    return dict(kinds=kinds, temps=temps, questions=questions, prompts=turns.first_prompts,
                tok=tok, draft=draft, turns=turns, settings=settings)


def _bench_all(args, targets, chains, shared) -> tuple[dict, dict]:
    """(report, {target: runs}): every target benchmarked in turn."""
    import gc

    import jax
    from s2d_jax.bench.target_bench import bench_target

    settings = shared.pop("settings")
    report = {"settings": settings, "targets": {}, "notes": []}
    all_runs = {}
    for name, path in targets.items():
        tgt, runs, notes = bench_target(name, path, _options(args), log=log,
                                        chains=chains.get(name, ()), **shared)
        report["targets"][name], all_runs[name] = tgt, runs
        report["notes"] += notes
        if args.hf_baseline:
            tgt["hf_baseline"] = _hf_baseline(args, name, path, runs, shared)
        # Drop this target's executables: each holds JIT code pages, and a few hundred of
        # them (3 targets x methods x temperatures x cost probes) exhaust LLVM's section
        # memory ("Unable to allocate section memory") in one process.
        jax.clear_caches()
        gc.collect()
    return report, all_runs


def _hf_baseline(args, name, path, runs, shared) -> dict:
    from s2d_jax.bench.hf_baseline import hf_baselines, hf_draft_dir

    log(f"[{name}] HF transformers generate (plain, assisted)")
    ar = runs["runs"].get(0.0, {}).get("ar")  # its turns' prompts: AR's conversation
    with hf_draft_dir(args.draft, path) as hf_draft:
        return hf_baselines(path, hf_draft,
                            [r["prompt"] for r in ar] if ar else shared["prompts"],
                            max_new_tokens=args.max_new_tokens, eos_id=shared["turns"].eos_id,
                            ar_token_ids=[r["token_ids"] for r in ar] if ar else None)


def _write(out: str, report: dict, all_runs: dict, questions, tok) -> str:
    """The answer files, report.json and report.md -> the markdown table."""
    from s2d_jax.bench import report as bench_report

    report["acceptance"] = bench_report.acceptance_checks(report)
    report["notes"].append("tokens/s and speedups exclude compilation (compile_seconds); "
                           "answer files' accept_lengths repeat each prompt's mean accepted "
                           "length per round (per-round counts are not recorded)")
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
    return table


@cli_main
def main(argv=None):
    args = parse_args(argv)
    targets, temps, kinds, chains = _check_args(args)
    from s2d_jax.bench import report as bench_report

    from s2d_jax.io.atomic import files_dir
    shared = _inputs(args, targets, temps, kinds)
    report, all_runs = _bench_all(args, targets, chains, shared)
    with files_dir(args.out, args.s2d_prog):
        print(_write(args.out, report, all_runs, shared["questions"], shared["tok"]))
        if not bench_report.plot(report, os.path.join(args.out, "speedup.png")):
            print(f"speedup.png skipped: matplotlib is not installed "
                  f"({bench_report.PLOT_EXTRA})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
