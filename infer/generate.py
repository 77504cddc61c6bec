"""Generate with S2D (or the ar / sd / self baselines) from the command line.

    s2d generate --target smollm2 --draft smollm2-draft --prompt "Why is the sky blue?"
    s2d generate --target smollm2 --draft smollm2-draft --method s2d --thresholds 0.6,0 \\
        --exits 2,4 --gamma 4 --prompt "Hello"
    s2d generate --target smollm2 --method ar --questions data/demo_questions.jsonl \\
        --out-file out.jsonl

Each line of --out-file (one JSON line per answered turn): question_id, category, target,
turn, token_ids, text and statistics. A --questions line with several turns is a
conversation: its turns are answered in order, each after the earlier turns and the
method's own earlier answers (as infer.bench runs MT-bench), one output line per turn. With a single --prompt the text is streamed: the round loop runs
as jitted chunks of a few rounds (state donated, identical tokens to the one-jit path) and
new text is printed in between. For a conversation in the terminal: python -m infer.chat.
"""

from __future__ import annotations

import json
import os
import sys

from s2d_jax.cli.args import (ArgumentParser, add_input, check_at_least, check_gamma,
                        check_sampling, finite_number, parse_floats, parse_ints, parse_targets,
                        target_paths)
from s2d_jax.decode.methods import DEFAULT_GAMMA, METHODS, proposer
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "generate"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.generate", description=__doc__)
    add(ap, "--target", CMD, required=True, paths=target_paths)
    ap.add_argument("--route", default=None, help="target name for prompts without a "
                    "'target' field (default: the first --target)")
    for name in ("--draft", "--method", "--exit", "--exits", "--thresholds"):
        add(ap, name, CMD)
    ap.add_argument("--confidence", default="max_prob", choices=("max_prob", "entropy"),
                    help="the draft's confidence a threshold compares")
    add(ap, "--gamma", CMD)
    ap.add_argument("--draft-stop", type=finite_number, default=None, help="stop drafting after a "
                    "token less confident than this, in [0,1] (default: the target's "
                    "s2d_serving.json for s2d, else 0 = always gamma tokens)")
    for name in ("--temperature", "--top-p", "--top-k", "--seed", "--max-new-tokens",
                 "--batch-size"):
        add(ap, name, CMD)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, help="one user turn, answer streamed")
    add(src, "--questions", CMD)
    for name in ("--chat-template", "--tokenizer", "--dtype", "--mesh"):
        add(ap, name, CMD)
    _add_chain_args(ap)
    ap.add_argument("--time-split", action="store_true",
                    help="also time the compiled prefill and round loop inside the decode "
                    "loop (extra compilations): each row's prefill vs rounds seconds and the "
                    "round cost per exit, in its stats")
    add(ap, "--out-file", CMD)
    return ap.parse_args(argv)


def _add_chain_args(ap) -> None:
    """The polybasic chain's flags (a model between draft and target)."""
    add_input(ap, "--intermediate", action="append", default=[], metavar="PATH",
                    help="polybasic chain: a model between draft and target (repeat for more "
                    "levels, lowest first); with --quantize-intermediate and no PATH, the "
                    "quantized target is the intermediate")
    ap.add_argument("--quantize-intermediate", default=None, choices=("int8", "int4", "w8a8"),
                    help="quantize the intermediate(s): int8 / int4 weight-only (int4: "
                    "--quant-group rows), w8a8 int8 weights and activations")
    add(ap, "--quant-group", CMD)
    add(ap, "--mu", CMD)


def check_args(args) -> None:
    """The checks that need no model, run before JAX starts: args.decoding is the method
    decoded with (auto: the targets' calibrated choice, decode/auto_method.py)."""
    from s2d_jax.decode.auto_method import cli_choice
    args.method, args.decoding, note = cli_choice(
        args.method, parse_targets(args.target).values(), args.draft is not None)
    if note:
        print(note, file=sys.stderr)
    if proposer(args.decoding).needs_draft and args.draft is None:
        raise S2DError(f"method {args.decoding} needs --draft PATH (a draft model); pass one, "
                       f"or use --method ar")
    if proposer(args.decoding).self_draft and args.exit is None:
        raise S2DError(f"method {args.decoding} needs --exit (how many target layers draft)")


def read_requests(args) -> list[dict]:
    if args.prompt is not None:
        return [{"question_id": 0, "category": None, "text": args.prompt,
                 "turns": [args.prompt]}]
    from s2d_jax.data.prompts import read_questions

    return read_questions(args.questions)


def _has_tokenizer(path: str) -> bool:
    return path.lower().endswith(".gguf") or any(  # a .gguf file carries its tokenizer
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.model", "tokenizer.json"))


def build_engine(args, targets: dict[str, str]):
    from s2d_jax.decode.serving import Engine
    from s2d_jax.io.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer or next(iter(targets.values())))
    mesh, shardings = _mesh_and_shardings(args, targets)
    specs = _load_targets(args, targets, tok, shardings)
    draft_cfg = draft_params = draft_tok = extra = None
    if proposer(args.decoding).needs_draft:  # check_args: a draft was given
        draft_cfg, draft_params, extra, draft_tok = _load_draft(args, specs, shardings)
    _resolve_settings(args, targets, specs, draft_cfg, extra)
    intermediates = _load_intermediates(args, specs)
    mus = parse_ints(args.mu, "--mu") if args.mu else None
    engine = Engine(specs, draft_cfg=draft_cfg, draft_params=draft_params,
                    intermediates=intermediates, mus=mus, draft_tokenizer=draft_tok,
                    confidence=args.confidence, mesh=mesh)
    return engine, tok


def _load_targets(args, targets: dict[str, str], tok, shardings) -> dict:
    """name -> TargetSpec (settings filled in by _resolve_settings)."""
    from s2d_jax.decode.serving import TargetSpec
    from s2d_jax.io.checkpoint import load_model

    specs = {}
    for name, path in targets.items():
        cfg, params, _ = load_model(path, dtype=args.dtype,
                                    shardings=shardings(f"target[{name}]"))
        if tok.vocab_size > cfg.vocab_size:
            raise S2DError(f"tokenizer has {tok.vocab_size} tokens but target {name!r} only "
                           f"{cfg.vocab_size}; pass the target's tokenizer with --tokenizer")
        if proposer(args.decoding).proposes:  # ar drafts nothing
            check_gamma(DEFAULT_GAMMA if args.gamma is None else args.gamma, cfg.max_position_embeddings,
                        f"target {name!r}", given=args.gamma is not None)
        specs[name] = TargetSpec(cfg, params, tokenizer=tok)
    return specs


def _load_draft(args, specs: dict, shardings):
    """(cfg, params, extra, tokenizer or None) of --draft."""
    from s2d_jax.io.checkpoint import load_draft
    from s2d_jax.io.tokenizer import load_tokenizer

    # a draft pack takes its shared weights from the (first) target it was made for
    draft_cfg, draft_params, extra = load_draft(
        args.draft, next(iter(specs.values())).params, dtype=args.dtype,
        shardings=shardings("draft"))
    draft_tok = load_tokenizer(args.draft) if _has_tokenizer(args.draft) else None
    if args.gamma is not None:
        check_gamma(args.gamma, draft_cfg.max_position_embeddings, "the draft")
    return draft_cfg, draft_params, extra, draft_tok


def _resolve_settings(args, targets: dict[str, str], specs: dict, draft_cfg, extra):
    """Each target's setting (serving_config.target_setting; auto: its calibrated choice)
    into its TargetSpec. The targets share the draft's exits: with several targets and no
    --exits, the draft's, so a target's calibration is used only where it is for those
    exits."""
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.decode.auto_method import auto_target_setting
    from s2d_jax.decode.methods import is_auto
    from s2d_jax.decode.serving_config import target_setting

    exits = parse_ints(args.exits, "--exits") if args.exits else None
    if exits is None and len(targets) > 1 and draft_cfg is not None:
        exits = draft_exits(extra, draft_cfg)
    overrides = dict(exit=args.exit, thresholds=parse_floats(args.thresholds, "--thresholds")
                     if args.thresholds else None, gamma=args.gamma,
                     stop_threshold=args.draft_stop)
    settings = {}
    for name, s in specs.items():
        if is_auto(args.method):  # each target's calibrated choice
            settings[name] = auto_target_setting(targets[name], s.cfg, draft_cfg, extra,
                                                 exits=exits, **overrides)
        else:
            settings[name] = target_setting(args.method, targets[name], s.cfg, draft_cfg,
                                            extra, exits=exits, **overrides)
        if settings[name].note:
            print(settings[name].note, file=sys.stderr)
        s.setting = settings[name]


def _load_intermediates(args, specs) -> list:
    """[(cfg, params)] of the chain's intermediate levels (lowest first), maybe quantized."""
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.model.quantize import quantize_params

    if not args.intermediate and not args.quantize_intermediate:
        if args.mu:
            raise S2DError("--mu needs a chain: pass --intermediate and/or --quantize-intermediate")
        return []
    if not proposer(args.decoding).proposes:
        raise S2DError(f"method {args.decoding} has no draft to chain; use --method s2d")
    n_levels = len(args.intermediate) or 1
    n_mus = len(parse_ints(args.mu, "--mu")) if args.mu else n_levels
    if n_mus != n_levels:
        raise S2DError(f"--mu has {n_mus} value(s) for {n_levels} intermediate "
                       f"level(s); pass one mu per intermediate")
    if args.mesh and args.quantize_intermediate:
        raise S2DError("--quantize-intermediate does not support --mesh yet; drop one of them")
    if args.intermediate:
        levels = [load_model(path, dtype=args.dtype)[:2] for path in args.intermediate]
    else:
        if len(specs) != 1:
            raise S2DError("a quantized-target intermediate needs exactly one --target; pass "
                           "--intermediate PATH for several targets")
        t = next(iter(specs.values()))
        levels = [(t.cfg, t.params)]
    if args.quantize_intermediate:
        levels = [(cfg, quantize_params(params, args.quantize_intermediate, args.quant_group))
                  for cfg, params in levels]
    return levels


def _mesh_and_shardings(args, targets: dict[str, str]):
    """(mesh or None, "target[NAME]" / "draft" -> params shardings or None). Each checkpoint shard is then
    restored straight onto its devices; sizes are checked before any weight is read."""
    if not args.mesh:
        return None, lambda name: None
    from s2d_jax.io.checkpoint import stored_model_config
    from s2d_jax.model.transformer import param_shardings
    from s2d_jax.parallel.multihost import build_mesh, parse_mesh
    paths = {f"target[{name}]": path for name, path in targets.items()}
    if proposer(args.decoding).needs_draft and args.draft:
        paths["draft"] = args.draft
    cfgs = {key: stored_model_config(path) for key, path in paths.items()}
    mesh = build_mesh(parse_mesh(args.mesh), cfgs)
    return mesh, lambda key: param_shardings(cfgs[key], mesh)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    from s2d_jax.parallel.multihost import maybe_initialize_distributed
    maybe_initialize_distributed()  # before any device query; no-op on one host
    check_sampling(args.temperature, args.top_p, args.top_k)
    if args.draft_stop is not None and not 0 <= args.draft_stop <= 1:
        raise S2DError(f"--draft-stop must lie in [0, 1] (0 = off), got {args.draft_stop}")
    check_at_least(args, {"max_new_tokens": 1, "batch_size": 1, "gamma": 1, "exit": 1,
                          "quant_group": 2})
    targets = parse_targets(args.target)
    from s2d_jax.cli.args import check_models_exist
    check_models_exist([("--target", t) for t in targets.values()] + [("--draft", args.draft)])
    route = args.route or next(iter(targets))
    reqs = read_requests(args)
    for r in reqs:
        r["target"] = r.get("target") or route
        if r["target"] not in targets:
            raise S2DError(f"unknown target {r['target']!r}; known targets: "
                           f"{', '.join(targets)}")
    engine, tok = build_engine(args, targets)
    from s2d_jax.data.prompts import end_of_turn_id, resolve_template

    template, note = resolve_template(tok, args.chat_template)
    if note:
        print(note, file=sys.stderr)
    decode_kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p,
                     eos_id=end_of_turn_id(tok, template))
    stream = args.prompt is not None and args.out_file is None
    rows = answer_turns(engine, tok, template, reqs, args, decode_kw, stream)
    show_compile = [row.pop("_first_of_batch") for row in rows]  # once per compiled batch
    if args.time_split:
        _add_time_split(engine, rows, reqs, args)
    if args.out_file:
        from s2d_jax.io.atomic import write_atomic
        write_atomic(args.out_file, "".join(json.dumps(row) + "\n" for row in rows))
    from s2d_jax.decode.stats_line import stats_line
    multi_turn = any(len(r["turns"]) > 1 for r in reqs)
    for row, compiled in zip(rows, show_compile):  # on stderr (streamed text is on stdout)
        turn = f" turn {row['turn']}" if multi_turn else ""
        print(f"[{row['target']} #{row['question_id']}{turn}] "
              f"{stats_line(row['stats'], show_compile=compiled)}"
              + ("" if stream else f": {row['text'][:200]!r}"), file=sys.stderr)
    if _PRINTER.first_at is not None:
        print(f"time to first token: {_PRINTER.first_at:.1f} s after the process started",
              file=sys.stderr)
    return 0


def answer_turns(engine, tok, template, reqs, args, decode_kw, stream) -> list[dict]:
    """One row per answered turn, ordered by request then turn. Turn k of every request
    is asked after its earlier turns and the method's own earlier answers, batched by
    target (--batch-size)."""
    from s2d_jax.data.prompts import prompt_ids, reply_text
    from s2d_jax.decode.chat import TextStream

    rows = []
    for r in reqs:
        r["answers"] = []
    for k in range(max(len(r["turns"]) for r in reqs)):
        live = [r for r in reqs if len(r["turns"]) > k]
        for r in live:
            r["ids"] = prompt_ids(tok, template, r["turns"][:k + 1],
                                  [reply_text(tok, a) for a in r["answers"]])
            if k == 0:
                r["first_ids"] = r["ids"]
        for name in dict.fromkeys(r["target"] for r in live):
            mine = [r for r in live if r["target"] == name]
            for i in range(0, len(mine), args.batch_size):
                batch = mine[i:i + args.batch_size]
                on_chunk = TextStream(tok, _PRINTER) if stream else None
                outs = engine.generate(name, [r["ids"] for r in batch], seed=args.seed + i + k,
                                       chunk_rounds=4 if stream else 0, on_chunk=on_chunk,
                                       **decode_kw)
                for b, (r, o) in enumerate(zip(batch, outs)):
                    r["answers"].append(o["token_ids"])
                    rows.append({"question_id": r["question_id"], "category": r["category"],
                                 "target": name, "turn": k + 1, "token_ids": o["token_ids"],
                                 "text": tok.decode(o["token_ids"]), "stats": o["stats"],
                                 "_first_of_batch": b == 0, "_order": (reqs.index(r), k)})
                if stream:
                    on_chunk.show(rows[-1]["text"])
                    print(flush=True)
    rows.sort(key=lambda row: row.pop("_order"))
    return rows


class _Printer:
    """Prints the streamed pieces; `first_at`: seconds from the process's start to the first
    piece (the time to first token a user waits, imports and loading included)."""

    first_at: float | None = None

    def __call__(self, text: str) -> None:
        if self.first_at is None:
            from s2d_jax.cli.clock import since_start
            self.first_at = since_start()
        print(text, end="", flush=True)


_PRINTER = _Printer()


def _add_time_split(engine, rows, reqs, args) -> None:
    """--time-split: prefill vs rounds, probed on each target's first turns."""
    from s2d_jax.bench.loop_costs import generation_split, loop_probe_costs
    for name in dict.fromkeys(r["target"] for r in reqs):
        costs = loop_probe_costs(engine.decoder(name),
                                 [r["first_ids"] for r in reqs if r["target"] == name],
                                 max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature)
        for row in rows:
            if row["target"] == name:
                row["stats"]["time_split"] = generation_split(costs, row["stats"])


if __name__ == "__main__":
    main()
