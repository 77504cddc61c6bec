"""Grow the committed corpus (s2d_jax/data/corpus.py): the target answers prompts on-policy
(greedy and T = 1) with the engine's batched AR decoder, and every completed shard is
written into the corpus folder with the manifest updated atomically; with --commit each
shard is also committed to git at once, so a lost machine loses at most the shard in
progress. Rerun the same command (on any machine, from a clone) to continue the run.

    nice -n 19 python -m train.corpus_generate --corpus data/smollm2_corpus \\
        --work ~/.cache/s2d-jax/corpus --run magpie0 --magpie 256 --commit

A new run builds its prompts as the data engine's prompt stages do (train/data_engine.py:
--magpie user turns the target writes itself, plus the --prompts files, deduplicated and
without any 8-gram of Spec-Bench, GSM8K test, the calibration prompts or --heldout), draws
--answers of them in seeded batches of similar length and stores them in the corpus
(RUN.prompts.jsonl.xz), so continuing a run needs neither --work's cache nor Magpie again.
"""

from __future__ import annotations

import os
import subprocess
import time

from s2d_jax.cli.args import ArgumentParser, add_output, check_at_least, comma_paths
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import CACHE

CMD = "corpus-generate"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m train.corpus_generate", description=__doc__)
    add(ap, "--target", CMD)
    ap.add_argument("--name", default="SmolLM2-135M-Instruct",
                    help="the target's name, as the manifest records it")
    add_output(ap, "--corpus", kind=CACHE, required=True,
               help="the corpus folder (e.g. data/smollm2_corpus); created if missing")
    add(ap, "--work", CMD, required=True)  # a new run's Magpie and prompt stages
    ap.add_argument("--run", default="run0", help="the run's name in the corpus")
    add(ap, "--prompts", CMD, paths=comma_paths)  # of a new run
    add(ap, "--magpie", CMD)
    ap.add_argument("--magpie-batch-size", type=int, default=0,
                    help="user turns sampled per batch (0 = --batch-size)")
    for name in ("--answers", "--batch-size", "--max-new-tokens", "--heldout", "--seed"):
        add(ap, name, CMD)
    ap.add_argument("--max-shards", type=int, default=0,
                    help="stop after this many new shards (0 = run to the end)")
    ap.add_argument("--commit", action="store_true",
                    help="git add + commit each shard and the manifest as it completes")
    args = ap.parse_args(argv)
    args.prompts = comma_paths(args.prompts)
    check_at_least(args, {"magpie": 0, "magpie_batch_size": 0, "answers": 0, "batch_size": 1, "max_new_tokens": 1,
                          "seed": 0, "max_shards": 0})
    if not os.path.isdir(args.target):
        raise S2DError(f"target {args.target} does not exist; fetch it with "
                       f"python -m infer.fetch_smollm2 or pass --target DIR")
    for path in (*args.prompts, args.heldout):
        if not os.path.isfile(path):
            raise S2DError(f"{path} does not exist; check the path")
    if args.commit:
        # a clear error outside a repository (the corpus folder may not exist yet)
        where = os.path.abspath(args.corpus)
        while not os.path.isdir(where):
            where = os.path.dirname(where)
        git(where, "rev-parse", "--show-toplevel")
    return args


def git(cwd: str, *argv: str) -> str:
    """Run git in `cwd`; a failure is one error line."""
    try:
        out = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        raise S2DError(f"cannot run git ({e}); install git or drop --commit") from None
    if out.returncode:
        raise S2DError(f"git {' '.join(argv[:2])} failed in {cwd}: "
                       f"{' '.join((out.stderr or out.stdout).split())[:200]}; fix the "
                       f"repository or drop --commit")
    return out.stdout


def commit_files(corpus: str, files: list[str], message: str, tries: int = 20) -> None:
    """Commit exactly `files` (relative to the corpus), nothing else staged; retried while
    another git process holds the index lock."""
    if not git(corpus, "status", "--porcelain", "--", *files).strip():
        return  # nothing new (a resumed run's plan)
    for attempt in range(tries):
        try:
            git(corpus, "add", "--", *files)
            git(corpus, "commit", "--only", "-q", "-m", message, "--", *files)
            return
        except S2DError as e:
            if "index.lock" not in str(e) or attempt == tries - 1:
                raise
            time.sleep(3)


def target_record(args, fp: str, vocab_size: int) -> dict:
    return {"name": args.name, "fingerprint": fp, "vocab_size": vocab_size}


def run_plan(args, prompt_counts: dict) -> dict:
    """The run's settings as the manifest keeps them (a resume with others is refused)."""
    from s2d_jax.data.engine import ANSWER_TEMPERATURES
    return {"engine": "s2d_jax.decode.serving.Decoder(method='ar'), float32, batched",
            "temperatures": list(ANSWER_TEMPERATURES), "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "chat_template": "the target's own",
            "prompt_source": {"files": list(args.prompts), "magpie_turns_asked": args.magpie,
                              "magpie_batch_size": args.magpie_batch_size or args.batch_size,
                              "answers": args.answers, "heldout": args.heldout,
                              "filter": "deduplicated; no 8-gram of Spec-Bench, GSM8K test, "
                              "the calibration prompts or the held-out set",
                              **prompt_counts}}


def new_run_prompts(args, fp: str, decoder, tok, log) -> tuple[list[str], dict]:
    """(a new run's prompts in shard order, their counts): the data engine's stages."""
    from s2d_jax.data import engine
    from s2d_jax.data.overlap import EVAL_FILES
    from s2d_jax.data.prompt_pool import prompt_pool
    from s2d_jax.io.atomic import files_dir
    eval_files = tuple(dict.fromkeys((*EVAL_FILES, args.heldout)))
    with files_dir(args.work, args.s2d_prog):
        turns = (engine.magpie_stage(args.work, fp, decoder, tok, args.magpie,
                                     args.magpie_batch_size or args.batch_size, args.seed, log)
                 if args.magpie else [])
        pool = engine.prompts_stage(args.work, fp, args.prompts, turns, eval_files, log)
    counts = prompt_pool(args.prompts, turns, eval_files)[1]
    chosen = engine.chosen_prompts(pool, args.answers, args.batch_size, args.seed)
    return chosen, {"magpie_turns_kept": len(turns), "pool": counts, "chosen": len(chosen)}


def generate(args, log) -> dict:
    from s2d_jax.data import corpus, engine
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    fp = engine.target_fingerprint(args.target)
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    decoder = Decoder(cfg, params, method="ar", name="target")
    target = target_record(args, fp, cfg.vocab_size)
    path = os.path.join(args.corpus, corpus.MANIFEST)
    manifest = corpus.read_manifest(args.corpus) if os.path.isfile(path) else None
    if manifest is not None and args.run in manifest["runs"]:
        prompts = corpus.read_prompts(args.corpus, args.run)  # resumes from the repo alone
        plan = {k: v for k, v in manifest["runs"][args.run].items() if k != "prompts"}
        mine = run_plan(args, plan["prompt_source"])
        mine["prompt_source"] = plan["prompt_source"]  # counts come from the stored run
        log(f"[corpus] resuming run {args.run}: {len(prompts)} prompts from the corpus")
    else:
        prompts, counts = new_run_prompts(args, fp, decoder, tok, log)
        mine = run_plan(args, counts)
    manifest = corpus.start_run(args.corpus, target, args.run, mine, prompts)
    if args.commit:
        commit_files(args.corpus, [corpus.MANIFEST, corpus.prompts_file(args.run)],
                     f"corpus: run {args.run} planned ({len(prompts)} prompts)")
    size = args.batch_size
    todo = [k for k in range(-(-len(prompts) // size))
            if k not in corpus.done_shards(manifest, args.run)]
    if args.max_shards:
        todo = todo[:args.max_shards]
    log(f"[corpus] run {args.run}: {len(corpus.done_shards(manifest, args.run))} shards done, "
        f"{len(todo)} to write")
    tokens, start = 0, time.perf_counter()
    for k in todo:
        t0 = time.perf_counter()
        batch = prompts[k * size:(k + 1) * size]
        rows = engine.answer_shard(decoder, tok, batch, k, args.seed, args.max_new_tokens)
        for row in rows:
            row["prompt_index"] = k * size + batch.index(row["prompt"])
        rec = corpus.add_shard(args.corpus, manifest, args.run, k, rows)
        dt = time.perf_counter() - t0
        tokens += rec["answer_tokens"]
        total = manifest["totals"]
        msg = (f"shard {rec['file']}: {rec['rows']} rows, {rec['answer_tokens']} answer "
               f"tokens in {dt:.0f} s ({rec['answer_tokens'] / dt:.1f} tokens/s; run so far "
               f"{tokens / (time.perf_counter() - start):.1f} tokens/s); corpus "
               f"{total['answer_tokens']} answer tokens, {total['bytes'] / 1e6:.2f} MB")
        if args.commit:
            commit_files(args.corpus, [rec["file"], corpus.MANIFEST], f"corpus: {msg}")
        log(f"[corpus] {msg}" + (" (committed)" if args.commit else ""))
    return manifest["totals"]


@cli_main
def main(argv=None):
    args = parse_args(argv)

    def log(msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    log(f"[corpus] totals {generate(args, log)}")


if __name__ == "__main__":
    main()
