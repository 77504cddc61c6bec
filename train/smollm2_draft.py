"""The sorted draft of SmolLM2-135M-Instruct, end to end: self-distilled data, SoFT,
the committed draft pack, calibration.

    python -m infer.fetch_smollm2          # once: the target, ~/.cache/s2d-jax/...
    python -m train.smollm2_draft          # ~1.5 h on a 2-core CPU

1. distill: the target answers training prompts (GSM8K train, self-instruct, ShareGPT;
   never Spec-Bench / MT-bench / GSM8K test) greedily and at T = 1 -> WORK/distill.jsonl
   (token ids; resumes after the last complete batch).
2. teacher states (with --kd-weight > 0): the target's final-normed hidden state at every
   position of those rows -> WORK/teacher (s2d_jax/data/teacher.py), from which the train
   step recomputes the target's whole distribution over the draft's head.
3. head vocabulary: the --head-vocab most frequent answer tokens (filled up by lowest id)
   -> WORK/head_vocab.json; the draft's head scores only these.
4. SoFT (configs/train/smollm2_draft.yaml): the target's first exits[-1] layers, one loss
   per exit averaged (each (1 - w) CE on the answer tokens + w CE on the target's
   distribution, w = --kd-weight), the tied embedding frozen (shared with the target);
   resumes from WORK/ckpt. A run longer than a session: --train-minutes stops it (the
   checkpoint saved) and packs every trained exit into --progress, which is committed; a
   later session reruns the same command and continues from WORK/ckpt, or, on a new
   machine, from --progress at its step and data position (s2d_jax/train/continuation.py).
5. pack: the exits' teacher-forced agreement with the target on the calibration prompts
   (s2d_jax/bench/agreement.py, as python -m infer.agreement); from the first exit on,
   each deeper exit is kept while it agrees measurably more often than the one before it
   (--exit-choice auto), and the draft's layers up to its last kept exit and its norm
   (int8) + exits + head vocabulary are written to --out.
6. calibrate: thresholds and gamma on data/smollm2_calibration.jsonl (disjoint from
   Spec-Bench) -> the target's s2d_serving.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex

from s2d_jax.cli.args import ArgumentParser, add_input, add_output, finite_number, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import cli_main
from s2d_jax.io.outputs import DIR, DRAFT_PACK

CMD = "train-smollm2-draft"  # its s2d subcommand: the name its shared flags are defined for

# Distillation on the target's whole distribution: at this CPU budget (300 steps) it
# measured no better than the answer tokens alone (docs/results.md), so it stays off.
KD_WEIGHT = 0.0
# Spec-Bench-shaped prompts disjoint from Spec-Bench and from the distillation prompts: the
# exit choice and the calibration measure on these.
CALIBRATION_PROMPTS = "data/smollm2_calibration.jsonl"
TRAIN_CONFIG = "configs/train/smollm2_draft.yaml"
# How many prompts of each training file are answered (0 = all of it).
PROMPT_QUOTA = {"data/gsm8k_train.jsonl": 400, "data/self_instruct_seed_tasks.jsonl": 0,
                "data/self_instruct_user_oriented.jsonl": 0,
                "data/sharegpt_dummy_conversation.json": 0,
                "data/sharegpt_axolotl_conversation.json": 0}


def parse_args(argv):
    ap = ArgumentParser(prog="python -m train.smollm2_draft", description=__doc__)
    add(ap, "--target", CMD)  # fetched by python -m infer.fetch_smollm2
    add(ap, "--work", CMD, kind=DIR)
    add(ap, "--out", CMD, kind=DRAFT_PACK, overwrite="overwrite")
    for name in ("--overwrite", "--train-exits", "--head-vocab"):
        add(ap, name, CMD)
    ap.add_argument("--distill-batches", type=int, default=20,
                    help="answer this many batches of 32 prompts, each greedy and at T = 1, "
                    "in the seeded order (0 = all of PROMPT_QUOTA: 28 batches)")
    add(ap, "--max-new-tokens", CMD)
    ap.add_argument("--steps", type=int, default=0, help="SoFT steps (0 = the config's)")
    ap.add_argument("--lr", type=finite_number, default=0.0,
                    help="SoFT's peak learning rate (0 = the config's); a warm start from "
                    "trained layers (--init-from) over a long run wants less than the "
                    "config's 2e-3, which suits 300 steps from the target's layers")
    ap.add_argument("--kd-weight", type=finite_number, default=KD_WEIGHT,
                    help="share of the loss on the target's whole distribution rather than "
                    f"its sampled tokens, in [0, 1] (default {KD_WEIGHT})")
    ap.add_argument("--exit-choice", choices=("auto", "all"), default="auto",
                    help="auto: ship the exits up to the last one that is accepted measurably "
                    "more often than the one before it (the pack keeps only the layers they "
                    "read); all: every trained exit")
    ap.add_argument("--skip-calibration", action="store_true",
                    help="do not calibrate the new draft's S2D setting")
    add_input(ap, "--train-corpus", default=None, dest="corpus",
              help="train on a committed corpus (e.g. data/smollm2_corpus: its files "
              "verified, nothing generated) instead of distilling answers into --work")
    ap.add_argument("--corpus-shards", type=int, default=0,
                    help="with --train-corpus: its first N shards (0 = all)")
    add_input(ap, "--init-from", default=None,
              help="with no checkpoint in --work: start from these committed draft weights "
              "(e.g. models/smollm2-draft) rather than the target's first layers; the "
              "optimizer moments, step count and data position are lost")
    ap.add_argument("--frozen-layers", type=int, default=0, metavar="N",
                    help="keep the first N layers of --init-from, the final norm and so its "
                    "exits at depth <= N exactly as they are, and train only the deeper layers "
                    "(a deeper exit added to a trained draft; the frozen layers' backward pass "
                    "is skipped); the head vocabulary is then --init-from's (default: 0, off)")
    ap.add_argument("--init-deeper", choices=("target", "identity"), default="target",
                    help="the layers a deeper draft adds below --init-from's: the target's "
                    "own (target), or the target's with their residual outputs zeroed, so each "
                    "starts as the identity and the new deepest exit as --init-from's deepest "
                    "(identity: LLaMA Pro's block expansion)")
    add(ap, "--train-minutes", CMD)
    add_output(ap, "--progress", kind=DRAFT_PACK, overwrite=True, default=None, metavar="DIR",
               help="this run's committed progress: written (every trained exit, int8, "
               "with its recipe) when --train-minutes stops it; read when --work has no "
               "checkpoint, continuing at its step and data position (only the optimizer "
               "moments are lost). Commit it between sessions")
    return check_args(ap, ap.parse_args(argv))


def check_args(ap, args):
    """The checks argparse cannot make (ranges, combinations, the outputs against every
    file the pipeline reads); `ap.error` on the first that fails."""
    args.target = os.path.expanduser(args.target)
    args.exits = parse_ints(args.train_exits, "--train-exits", minimum=1)
    if not os.path.isdir(args.target):
        ap.error(f"target {args.target} does not exist; fetch it with "
                 f"python -m infer.fetch_smollm2 or pass --target DIR")
    if not 0.0 <= args.kd_weight <= 1.0:
        ap.error(f"--kd-weight must lie in [0, 1], got {args.kd_weight}")
    if args.corpus and args.kd_weight > 0:
        ap.error("--kd-weight > 0 needs the teacher states of a rows file; with "
                 "--train-corpus use --kd-weight 0 (the default)")
    if args.train_minutes is not None and args.train_minutes <= 0:
        ap.error(f"--train-minutes must be > 0 (leave it out for no limit), got "
                 f"{args.train_minutes}")
    if args.lr < 0:
        ap.error(f"--lr must be > 0 (0 = the config's), got {args.lr}")
    for name in ("distill_batches", "steps", "head_vocab", "corpus_shards", "frozen_layers"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.init_deeper != "target" and not args.init_from:
        ap.error(f"--init-deeper {args.init_deeper} sets the layers added below --init-from's; "
                 f"give --init-from (e.g. models/smollm2-draft8)")
    target = check_against_target(ap, args)
    args.init_head = None
    if args.frozen_layers:
        check_frozen_layers(ap, args)
    elif args.head_vocab > target.vocab_size:  # (frozen exits keep --init-from's head)
        ap.error(f"--head-vocab {args.head_vocab} is more than the target's "
                 f"{target.vocab_size}-token vocabulary; use at most {target.vocab_size} "
                 f"(0 = the full vocabulary)")
    if args.init_from:  # its shape now: SoFT reads it only after distilling into --work
        from s2d_jax.train.warm_start import check_committed
        check_committed(args.init_from, dataclasses.replace(target, num_layers=args.exits[-1]),
                        "--init-from")
    from s2d_jax.io.outputs import HF_DIR, Output, check_outputs
    check_outputs([Output("--work", args.work, DIR, owner=args.s2d_prog),
                   Output("--out", args.out, DRAFT_PACK, args.overwrite),
                   Output("--progress", args.progress, DRAFT_PACK, True, "this run"),
                   Output("--work's trained draft", draft_hf_dir(args), HF_DIR, True)],
                  {"--target": args.target, "training prompts": list(PROMPT_QUOTA),
                   "calibration prompts": CALIBRATION_PROMPTS, "config": TRAIN_CONFIG})
    return args


def check_against_target(ap, args):
    """The target's config (no weight read), with --train-exits checked against it: SoFT
    would find them (and --head-vocab, --init-from) wrong only after the distillation."""
    from s2d_jax.io.checkpoint import stored_model_config
    target = stored_model_config(args.target)
    if any(b <= a for a, b in zip(args.exits, args.exits[1:])):
        ap.error(f"--train-exits {args.train_exits} must be strictly increasing layer counts, "
                 f"e.g. 2,4,6,8")
    if args.exits[-1] > target.num_layers:
        ap.error(f"--train-exits {args.train_exits} go beyond the {target.num_layers} layers "
                 f"of the target {args.target}; use exits <= {target.num_layers}")
    return target


def check_frozen_layers(ap, args) -> None:
    """--frozen-layers keeps trained layers: they come from --init-from, below the deepest
    exit; the head vocabulary those exits were trained with goes into args.init_head."""
    n = args.frozen_layers
    if not args.init_from:
        ap.error(f"--frozen-layers {n} keeps trained layers; give the draft they come from "
                 f"with --init-from (e.g. models/smollm2-draft8)")
    if n >= args.exits[-1]:
        ap.error(f"--frozen-layers {n} freezes every exit of --train-exits "
                 f"{args.train_exits}; freeze fewer layers than the deepest exit")
    depth, head = committed_draft(args.init_from)
    if n > depth:
        ap.error(f"--frozen-layers {n} is deeper than --init-from {args.init_from} "
                 f"({depth} layers); freeze at most {depth}")
    args.init_head = head if head is not None else []


def committed_draft(path: str) -> tuple[int, list | None]:
    """(layer count, head vocabulary or None for the full head) of a committed draft."""
    from s2d_jax.io import draft_pack
    from s2d_jax.io.checkpoint import checkpoint_kind, load_model
    if checkpoint_kind(path) == "draft-pack":
        cfg, extra, _ = draft_pack.read_pack_config(path)
    else:
        cfg, _, extra = load_model(path, dtype="float32")
    return cfg.num_layers, (extra or {}).get("s2d_head_vocab")


def draft_hf_dir(args) -> str:
    """Where SoFT exports the trained draft (replaced by each run)."""
    return os.path.join(args.work, "draft_hf")


def distill(args, log) -> str:
    from s2d_jax.data.distill import generate_answers, training_prompts
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    path = os.path.join(args.work, "distill.jsonl")
    prompts = training_prompts(PROMPT_QUOTA, seed=0)
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    dec = Decoder(cfg, params, method="ar", name="target")
    stats = generate_answers(dec, tok, prompts, path, max_new_tokens=args.max_new_tokens,
                             batch_size=32, max_batches=args.distill_batches or None, log=log)
    log(f"[distill] {path}: {stats}")
    return path


def teacher_states(args, rows: str, log) -> str:
    from s2d_jax.data.teacher import write_teacher_states
    return write_teacher_states(args.target, rows, os.path.join(args.work, "teacher"), log=log)


def soft(args, rows: str | None, log, teacher: str | None = None) -> str:
    """SoFT on `rows` (a token-rows file), or on --corpus when rows is None."""
    from s2d_jax.data.distill import frequent_tokens
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import train

    data = ([f"data.paths=[{rows}]"] if rows else
            [f"data.paths=[{args.corpus}]", "data.format=corpus",
             f"data.corpus_shards={args.corpus_shards}"])
    over = [f"model.path={args.target}", f"data.tokenizer={args.target}", *data,
            f"draft.exits=[{','.join(map(str, args.exits))}]",
            f"checkpoint.dir={os.path.abspath(os.path.join(args.work, 'ckpt'))}",
            f"metrics_path={os.path.join(args.work, 'metrics.jsonl')}",
            f"export_dir={draft_hf_dir(args)}", "export_overwrite=true"]
    if args.init_head is not None:  # frozen exits keep the head they were trained with
        if args.init_head:
            head = os.path.join(args.work, "head_vocab.json")
            with open(head, "w") as f:
                json.dump(args.init_head, f)
            over.append(f"draft.head_vocab={head}")
        head = f"{len(args.init_head)} tokens" if args.init_head else "the full vocabulary"
        log(f"[soft] layers 1-{args.frozen_layers} and the final norm frozen as "
            f"{args.init_from} has them, with its head ({head})")
    elif args.head_vocab:
        from s2d_jax.config import read_hf_config
        vocab = read_hf_config(os.path.join(args.target, "config.json")).vocab_size
        head = os.path.join(args.work, "head_vocab.json")
        if rows is None:
            from s2d_jax.data import corpus
            source = corpus.read_rows(args.corpus, args.corpus_shards)[0]
        else:
            source = rows
        with open(head, "w") as f:
            json.dump(frequent_tokens(source, args.head_vocab, vocab), f)
        over.append(f"draft.head_vocab={head}")
    if args.steps:
        over.append(f"optimizer.total_steps={args.steps}")
    if args.lr:
        over.append(f"optimizer.lr={args.lr}")
    if teacher:
        over += [f"data.teacher={teacher}", f"draft.kd_weight={args.kd_weight}"]
    if args.init_from:
        over.append(f"model.init_from={args.init_from}")
    if args.init_deeper != "target":
        over.append(f"model.init_deeper={args.init_deeper}")
    if args.frozen_layers:
        over.append(f"optimizer.frozen_layers={args.frozen_layers}")
    if args.progress:
        over.append(f"model.continue_from={os.path.abspath(args.progress)}")
    if args.train_minutes:
        over.append(f"stop_after_minutes={args.train_minutes}")
    tc = load_train_config(TRAIN_CONFIG, over)
    out = train(tc)
    last = out["history"][-1] if out["history"] else None
    if last:
        log(f"[soft] step {last['step']}: exit accuracy " + ", ".join(
            f"{e}: {a:.3f}" for e, a in last["exit_acc"].items()))
    return tc.export_dir, out


def choose_exits(args, draft_hf: str, exits, log) -> list[int]:
    """The exits to ship: with --exit-choice auto, from the first exit on while each deeper
    one agrees with the target measurably more often than the one before it (paired gain
    >= 2 standard errors, as infer.agreement measures it on every calibration prompt); the draft is cut
    after the last kept exit, so a deeper exit that buys no acceptance costs nothing."""
    from s2d_jax.bench.agreement import measurable_exits, measure_agreement
    from s2d_jax.io.atomic import write_atomic
    report = os.path.join(args.work, "exit_choice.json")
    measured = measure_agreement(args.target, [draft_hf], CALIBRATION_PROMPTS, max_prompts=1000)
    write_atomic(report, json.dumps(measured, indent=1))
    rows = measured["drafts"][draft_hf]
    kept = measurable_exits(rows) if args.exit_choice == "auto" else list(exits)
    log(f"[pack] exits {kept} of {list(exits)} ({args.exit_choice}; agreement of the float32 "
        f"draft on {CALIBRATION_PROMPTS}: {report})")
    return kept


def write_pack(args, draft_hf: str, out: str, exits, log) -> None:
    """The draft's layers up to its last exit of `exits` and its norm (int8) + exits + head
    vocabulary, with the run's recipe (its settings, data slice, steps), to `out`."""
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.draft_pack import save_draft_pack
    from s2d_jax.model.sorted_draft import draft_prefix
    from s2d_jax.train.loop import RECIPE

    _, target, _ = load_model(args.target, dtype="float32")
    cfg, params, extra = load_model(draft_hf, dtype="float32")
    kept = exits if exits is not None else choose_exits(args, draft_hf, extra["s2d_exits"], log)
    cfg, params, extra = draft_prefix(cfg, params, extra, kept)
    # the recipe is read before the pack is replaced: draft_hf may be --progress's own copy
    recipe_path = os.path.join(draft_hf, RECIPE)
    recipe = open(recipe_path).read() if os.path.isfile(recipe_path) else None
    save_draft_pack(out, cfg, params, extra, target_embed=target["embed"],
                    target_name=os.path.basename(os.path.normpath(args.target)),
                    weights="int8", overwrite=True if out == args.progress else args.overwrite)
    if recipe is not None:  # the run's settings and data slice travel with the pack
        from s2d_jax.io.atomic import write_atomic
        write_atomic(os.path.join(out, RECIPE), recipe)
    log(f"[pack] wrote {out}: the first {cfg.num_layers} layers, exits {kept}")


def pack(args, draft_hf: str, log) -> None:
    write_pack(args, draft_hf, args.out, None, log)


# the calibration's settings (python -m infer.calibrate's flags of the same names)
CALIBRATION = dict(max_prompts=12, max_new_tokens=64, gammas=(1, 2), repeats=1,
                   cost_samples=2, probe_rounds=12, cost_every=3, check=2, finalists=3,
                   stops=())


def calibration_command(args) -> str:
    """The python -m infer.calibrate command that reruns this calibration."""
    argv = ["--target", f"smollm2={args.target}", "--draft", args.out,
            "--questions", CALIBRATION_PROMPTS]
    for key, value in CALIBRATION.items():
        argv += [f"--{key.replace('_', '-')}",
                 ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return "python -m infer.calibrate " + shlex.join(argv)


def pack_serving_record(args, record: dict) -> str:
    """The target's calibrated setting as the pack keeps it (python -m infer.fetch_smollm2
    installs it): paths as the repository names them (the target's own copy has them
    relative to the target dir) and the command that made it."""
    record = json.loads(json.dumps(record))  # a copy: the target's record stays as it is
    record["draft"] = args.out
    record["calibrated_on"].update(questions=CALIBRATION_PROMPTS, command=calibration_command(
        args).replace(os.path.expanduser("~"), "$HOME"))
    return json.dumps(record, indent=2) + "\n"


def calibrate(args, log) -> None:
    from s2d_jax.calibration.calibration import CalibrateOptions
    from s2d_jax.calibration.calibration_search import calibrate_target
    from s2d_jax.calibration.method_ranking import describe, rank_methods
    from s2d_jax.decode.auto_method import SECTION
    from s2d_jax.decode.serving_config import SERVING_CONFIG, write_serving_config
    from s2d_jax.io.atomic import write_atomic

    opts = CalibrateOptions(draft=args.out, questions=CALIBRATION_PROMPTS, **CALIBRATION)
    result = calibrate_target(opts, "smollm2", args.target, log=log)
    best = result.best
    log(f"[calibrate] exits {best['exits']} thresholds {best['thresholds']} gamma "
        f"{best['gamma']}: {best['measured_speedup']:.2f}x vs AR, "
        f"{result.gain_over_paper:.2f}x the speedup of 0.5/.../0")
    # the methods ranked at their settings, as infer.calibrate does: --method auto's
    # choice (the "default" section), in the target's config and the pack's copy
    record = {**result.record, SECTION: rank_methods(result.calibration, result.record)}
    log(f"[calibrate] {describe(record[SECTION])}")
    log(f"[calibrate] {write_serving_config(args.target, record)}")
    # the pack carries its target's calibration: python -m infer.fetch_smollm2 installs it
    write_atomic(os.path.join(args.out, SERVING_CONFIG), pack_serving_record(args, record))
    log(f"[calibrate] {args.out}/{SERVING_CONFIG}")


@cli_main
def main(argv=None):
    from s2d_jax.io.atomic import files_dir
    args = parse_args(argv)
    with files_dir(args.work, args.s2d_prog):
        _run(args)


def _run(args) -> None:
    def log(msg):
        print(msg, flush=True)

    rows = None if args.corpus else distill(args, log)
    teacher = teacher_states(args, rows, log) if args.kd_weight > 0 else None
    draft_hf, out = soft(args, rows, log, teacher)
    if out["stopped_early"]:
        step, total = int(out["state"].step), out["total_steps"]
        if args.progress:  # every trained exit: the exit choice waits for the whole run
            write_pack(args, draft_hf, args.progress, list(args.exits), log)
        log(f"[soft] stopped at step {step} of {total} (--train-minutes "
            f"{args.train_minutes:g}): checkpoint in {os.path.join(args.work, 'ckpt')}"
            + (f", progress in {args.progress} (commit it)" if args.progress else "")
            + "; rerun the same command to continue")
        return
    pack(args, draft_hf, log)
    if not args.skip_calibration:
        calibrate(args, log)


if __name__ == "__main__":
    main()
