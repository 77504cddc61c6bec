"""The self-distillation data engine: prompts -> the target's answers -> teacher-forced
supervision shards -> (with --train) SoFT from that cache, with held-out agreement logged
while it trains. Every stage resumes after Ctrl-C or kill -9 and skips once complete:
rerun the same command to continue.

    python -m train.data_engine --work ~/.cache/s2d-jax/engine/smollm2 \\
        --train configs/train/engine_h100.yaml

Stages, under --work (s2d_jax/data/engine.py; each a dir of shards + manifest.json with
the plan, the target's fingerprint, rows and tokens per shard):
  magpie/   --magpie N user turns the target writes itself (default 0: none)
  prompts/  --prompts files + Magpie turns, deduplicated, without any 8-gram of Spec-Bench,
            GSM8K test, the calibration prompts or --heldout
  answers/  the target's answers to --answers of them (0 = all), greedy and T = 1,
            --batch-size prompts per generation batch
  teacher/  token rows of the answers, --references GSM8K-train reference solutions and
            --documents, with the target's final-normed state at every position
  train/    rows.jsonl + teacher/ (what the trainer reads); with --train CONFIG: ckpt/
            (resumes), metrics.jsonl, heldout.jsonl (agreement and T = 1 acceptance per
            exit on --heldout every --heldout-every steps), draft_hf/ (the trained draft)
"""

from __future__ import annotations

import json
import os

from s2d_jax.cli.args import ArgumentParser, add_input, check_at_least, comma_paths
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR

CMD = "data-engine"  # its s2d subcommand: the name its shared flags are defined for
# what the engine sets in the --train config: its cache and outputs under --work
ENGINE_KEYS = ("model.path", "data.tokenizer", "data.paths", "data.format", "data.teacher",
               "checkpoint.dir", "metrics_path", "export_dir", "export_overwrite")


def parse_args(argv):
    ap = ArgumentParser(prog="python -m train.data_engine", description=__doc__)
    add(ap, "--target", CMD)
    add(ap, "--work", CMD, kind=DIR, required=True)
    add(ap, "--prompts", CMD, paths=comma_paths)
    for name in ("--magpie", "--answers"):
        add(ap, name, CMD)
    add(ap, "--batch-size", CMD)
    add(ap, "--max-new-tokens", CMD)
    add(ap, "--slots", CMD)
    ap.add_argument("--references", type=int, default=1000,
                    help="GSM8K-train reference solutions teacher-forced (0 = none)")
    add(ap, "--documents", CMD, paths=comma_paths)
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="tokens per supervision row (documents are cut into windows)")
    ap.add_argument("--teacher-shard", type=int, default=64,
                    help="supervision items per teacher shard (the unit a rerun resumes at)")
    add(ap, "--heldout", CMD)
    add(ap, "--heldout-prompts", CMD)
    ap.add_argument("--heldout-every", type=int, default=100,
                    help="training steps between held-out measurements")
    add_input(ap, "--train", default=None,
                    help="a SoFT config (configs/train/engine_*.yaml): train from the cache")
    add(ap, "--seed", CMD)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the --train config")
    args = ap.parse_args(argv)
    args.prompts, args.documents = comma_paths(args.prompts), comma_paths(args.documents)
    check_at_least(args, {"magpie": 0, "answers": 0, "slots": 0, "batch_size": 1,
                          "max_new_tokens": 1,
                          "references": 0, "max_tokens": 2, "teacher_shard": 1, "heldout_prompts": 1,
                          "heldout_every": 1, "seed": 0})
    if args.overrides and not args.train:
        raise S2DError("key=value overrides need --train CONFIG; add it or drop them")
    fixed = [o for o in args.overrides if o.split("=")[0].strip() in ENGINE_KEYS]
    if fixed:
        raise S2DError(f"{fixed[0]}: the engine sets {', '.join(ENGINE_KEYS)} (its cache and "
                       f"outputs under --work); drop the override")
    if not os.path.isdir(args.target):
        raise S2DError(f"target {args.target} does not exist; fetch it with "
                       f"python -m infer.fetch_smollm2 or pass --target DIR")
    for path in (*args.prompts, *args.documents, args.heldout, *([args.train] * bool(
            args.train))):
        if not os.path.isfile(path):
            raise S2DError(f"{path} does not exist; check the path")
    return args


def _answerer(args, decoder, tok, prompts):
    """The answers stage's decoder: each batch decoded as one, or (--slots N) on the slot
    engine, whose slots hold the longest chosen prompt and its answer."""
    if not args.slots or not prompts:
        return decoder
    from s2d_jax.data.prompts import prompt_ids
    from s2d_jax.decode.defaults import BUFFER_BUCKET, round_up
    from s2d_jax.server.batch import SlotDecoder
    longest = max(len(prompt_ids(tok, "auto", [p])) for p in prompts)
    return SlotDecoder(decoder, tok, slots=args.slots,
                       max_len=round_up(longest + args.max_new_tokens, BUFFER_BUCKET))


def build_data(args, log) -> tuple[str, str]:
    """Every data stage in order; -> (rows.jsonl, teacher-states dir) for training."""
    from s2d_jax.data import engine
    from s2d_jax.data.overlap import EVAL_FILES, eval_ngrams
    from s2d_jax.data.prompt_pool import documents
    from s2d_jax.data.prompts import resolve_template
    from s2d_jax.data.teacher import rows_states, states_fn
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    fp = engine.target_fingerprint(args.target)
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    decoder = Decoder(cfg, params, method="ar", name="target")
    eval_files = tuple(dict.fromkeys((*EVAL_FILES, args.heldout)))
    turns = (engine.magpie_stage(args.work, fp, decoder, tok, args.magpie, args.batch_size,
                                 args.seed, log) if args.magpie else [])
    pool = engine.prompts_stage(args.work, fp, args.prompts, turns, eval_files, log)
    chosen = engine.chosen_prompts(pool, args.answers, args.batch_size, args.seed)
    answers = engine.answers_stage(args.work, fp, _answerer(args, decoder, tok, chosen), tok,
                                   chosen, args.batch_size, args.max_new_tokens, args.seed, log)
    refs = (engine.reference_items(engine.REFERENCES, pool, args.references,
                                   eval_ngrams(eval_files)) if args.references else [])
    docs = documents(args.documents, eval_files)[0] if args.documents else []
    items = engine.supervision_items(answers, refs, docs)
    template, _ = resolve_template(tok, "auto")
    fn = states_fn(cfg)
    teacher = engine.teacher_stage(
        args.work, fp, items, tok, template,
        lambda rows: rows_states(fn, params, rows, cfg.hidden_size), args.max_tokens,
        args.teacher_shard, log)
    return engine.training_set(args.work, fp, teacher, log)


def train_from_cache(args, rows: str, teacher: str, log) -> dict:
    """SoFT of --train on the cache, resumable from WORK/train/ckpt, held-out agreement
    logged to WORK/train/heldout.jsonl."""
    import jax.numpy as jnp

    from s2d_jax.bench.heldout import HeldoutAgreement
    from s2d_jax.model.sorted_draft import read_head_vocab
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import resolve_draft, train

    out = os.path.join(args.work, "train")
    over = [f"model.path={args.target}", f"data.tokenizer={args.target}",
            f"data.paths=[{rows}]", "data.format=tokens", f"data.teacher={teacher}",
            f"checkpoint.dir={os.path.abspath(os.path.join(out, 'ckpt'))}",
            f"metrics_path={os.path.join(out, 'metrics.jsonl')}",
            f"export_dir={os.path.join(out, 'draft_hf')}", "export_overwrite=true",
            *args.overrides]
    tc = load_train_config(args.train, over)  # every output under --work (checked)
    cfg, exits, _ = resolve_draft(tc)
    head = (jnp.asarray(read_head_vocab(tc.draft.head_vocab, cfg.vocab_size), jnp.int32)
            if tc.draft.head_vocab else None)
    hook = HeldoutAgreement(args.target, args.heldout, cfg, exits,
                            os.path.join(out, "heldout.jsonl"), args.heldout_every,
                            tc.optimizer.total_steps, args.heldout_prompts, head_ids=head)
    result = train(tc, progress=False, hooks=[hook])
    log(f"[train] steps {result['start_step']} -> "
        f"{result['history'][-1]['step'] if result['history'] else result['start_step']}; "
        f"draft {tc.export_dir}")
    return result


def summary(work: str) -> dict:
    """Rows and tokens per stage, from the manifests."""
    from s2d_jax.data.shards import MANIFEST
    out = {}
    for stage in ("magpie", "prompts", "answers", "teacher"):
        path = os.path.join(work, stage, MANIFEST)
        if os.path.isfile(path):
            with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM is no content
                m = json.load(f)
            out[stage] = {"rows": sum(r["rows"] for r in m["done"].values()),
                          "tokens": sum(r["tokens"] for r in m["done"].values()),
                          "target": m["plan"]["target"][:12]}
    return out


@cli_main
def main(argv=None):
    from s2d_jax.io.atomic import files_dir
    args = parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    with files_dir(args.work, args.s2d_prog):
        rows, teacher = build_data(args, log)
    log(f"[engine] {json.dumps(summary(args.work))}")
    if args.train:
        train_from_cache(args, rows, teacher, log)


if __name__ == "__main__":
    main()
