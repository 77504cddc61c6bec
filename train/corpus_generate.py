"""Grow the committed corpus (s2d_jax/data/corpus.py): the target answers prompts on-policy
(greedy and T = 1) on the slot engine (--slots; 0: the engine's batched AR decoder, a
batch per shard), and every completed shard is
written into the corpus folder with the manifest updated atomically; with --commit each
shard is also committed to git at once, so a lost machine loses at most the shard in
progress. Rerun the same command (on any machine, from a clone) to continue the run.

    nice -n 19 python -m train.corpus_generate --corpus data/smollm2_corpus \\
        --work ~/.cache/s2d-jax/corpus --run magpie0 --magpie 256 --commit

A new run builds its prompts as the data engine's prompt stages do (train/data_engine.py:
--magpie user turns the target writes itself, plus the --prompts files, deduplicated and
without any 8-gram of Spec-Bench, GSM8K test, the calibration prompts or --heldout), drops
the prompts of the corpus's earlier runs (a next run: other Magpie turns, --seed), draws
--answers of them in seeded batches of similar length and stores them in the corpus
(RUN.prompts.jsonl.xz), so continuing a run needs neither --work's cache nor Magpie again.
"""

from __future__ import annotations

import os
import subprocess
import time

from s2d_jax.cli.args import (ArgumentParser, add_output, check_at_least, comma_paths,
                              input_arg)
from s2d_jax.cli.flags import add
from s2d_jax.data.shard_checks import check_run_name
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import CACHE, DIR

CMD = "corpus-generate"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m train.corpus_generate", description=__doc__)
    add(ap, "--target", CMD)
    ap.add_argument("--name", default="SmolLM2-135M-Instruct",
                    help="the target's name, as the manifest records it")
    add_output(ap, "--corpus", kind=CACHE, required=True,
               help="the corpus folder (e.g. data/smollm2_corpus); created if missing")
    add(ap, "--work", CMD, kind=DIR, required=True)  # a new run's Magpie and prompt stages
    ap.add_argument("--run", default="run0", help="the run's name in the corpus")
    add(ap, "--prompts", CMD, paths=comma_paths)  # of a new run
    add(ap, "--magpie", CMD)
    ap.add_argument("--magpie-batch-size", type=int, default=0,
                    help="user turns sampled per batch (0 = --batch-size)")
    for name in ("--answers", "--batch-size", "--max-new-tokens", "--heldout", "--seed",
                 "--slots", "--slot-len"):
        add(ap, name, CMD)
    ap.add_argument("--max-shards", type=int, default=0,
                    help="stop after this many new shards (0 = run to the end)")
    ap.add_argument("--commit", action="store_true",
                    help="git add + commit the shards and the manifest as they complete")
    ap.add_argument("--commit-every", type=int, default=1, metavar="SHARDS",
                    help="with --commit: one commit per this many completed shards (and one "
                         "for the rest at the end, or when the run stops on an error)")
    args = ap.parse_args(argv)
    check_run_name(args.run)  # it names files: refused before anything is read or written
    args.prompts = comma_paths(args.prompts)
    check_at_least(args, {"magpie": 0, "magpie_batch_size": 0, "answers": 0, "batch_size": 1, "max_new_tokens": 1,
                          "seed": 0, "max_shards": 0, "slots": 0,
                          "commit_every": 1})
    if args.slot_len is not None and args.slot_len <= args.max_new_tokens:
        raise S2DError(f"--slot-len {args.slot_len} leaves no room for a prompt before "
                       f"--max-new-tokens {args.max_new_tokens}; pass a larger --slot-len")
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
    return {"engine": "the target's AR decode, float32 (each shard's record names its engine)",
            "temperatures": list(ANSWER_TEMPERATURES), "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "chat_template": "the target's own",
            "prompt_source": {"files": list(args.prompts), "magpie_turns_asked": args.magpie,
                              "magpie_batch_size": args.magpie_batch_size or args.batch_size,
                              "answers": args.answers, "heldout": args.heldout,
                              "filter": "deduplicated; no 8-gram of Spec-Bench, GSM8K test, "
                              "the calibration prompts or the held-out set",
                              **prompt_counts}}


# The arguments a run's rows depend on, where its plan keeps them: a resume is compared on
# each (the prompt source's too: a resume reads its prompts from the corpus, so other
# values would otherwise be recorded nowhere and silently ignored).
PLAN_FLAGS = (("--batch-size", ("batch_size",)), ("--max-new-tokens", ("max_new_tokens",)),
              ("--seed", ("seed",)), ("--prompts", ("prompt_source", "files")),
              ("--magpie", ("prompt_source", "magpie_turns_asked")),
              ("--magpie-batch-size", ("prompt_source", "magpie_batch_size")),
              ("--answers", ("prompt_source", "answers")),
              ("--heldout", ("prompt_source", "heldout")))
PATH_FLAGS = ("--prompts", "--heldout")
# what the prompt stages counted when the run was planned: kept from the stored plan
COUNT_KEYS = ("magpie_turns_kept", "pool", "chosen")


def _at(plan: dict, keys: tuple):
    for key in keys:
        plan = plan.get(key) if isinstance(plan, dict) else None
    return plan


def _same_path(a, b) -> bool:
    """The same file however it was written (a shipped file's relative name, absolute)."""
    return a == b or (isinstance(a, str) and isinstance(b, str) and
                      os.path.realpath(input_arg(a)) == os.path.realpath(input_arg(b)))


def _shown(flag: str, value) -> str:
    return f"{flag} {','.join(value) if isinstance(value, list) else value}"[:120]


def resumed_plan(args, stored: dict) -> dict:
    """This command's plan for run args.run, planned before as `stored`; a resume with
    another value of any argument that changes the rows is refused, naming each."""
    source = stored.get("prompt_source")
    source = source if isinstance(source, dict) else {}
    mine = run_plan(args, {k: source[k] for k in COUNT_KEYS if k in source})
    differ = []
    for flag, keys in PLAN_FLAGS:
        was, now = _at(stored, keys), _at(mine, keys)
        if flag in PATH_FLAGS:
            same = (len(was) == len(now) and all(map(_same_path, was, now))
                    if isinstance(was, list) and isinstance(now, list) else _same_path(was, now))
            if same:  # as the plan wrote them: the same files
                mine[keys[0]][keys[1]] = was
        else:
            same = was == now
        if not same:
            differ.append((flag, was, now))
    if differ:
        raise S2DError(
            f"run {args.run} of {args.corpus} was planned with "
            f"{', '.join(_shown(f, was) for f, was, _ in differ)} (this command: "
            f"{', '.join(_shown(f, now) for f, _, now in differ)}); rerun with the run's own "
            f"arguments to resume it, or name a new run (--run)")
    return mine


def new_run_prompts(args, fp: str, decoder, tok, log, earlier: set[str] = frozenset()
                    ) -> tuple[list[str], dict]:
    """(a new run's prompts in shard order, their counts): the data engine's stages, less
    the prompts of the corpus's `earlier` runs (a second run with the same files would
    answer them again: its greedy rows the same rows)."""
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
    fresh = [p for p in pool if p not in earlier]
    if not fresh:
        raise S2DError(f"every prompt of run {args.run} is in an earlier run of "
                       f"{args.corpus}; ask for new Magpie turns (--magpie N with another "
                       f"--seed) or pass other --prompts")
    chosen = engine.chosen_prompts(fresh, args.answers, args.batch_size, args.seed)
    return chosen, {"magpie_turns_kept": len(turns),
                    "pool": {**counts, "in_earlier_runs": len(pool) - len(fresh)},
                    "chosen": len(chosen)}


# prompt widths at most 25% apart (server/slots.py width_buckets): a prefill pays for its
# padding, and the engine's compiles are paid once for hours of answers
WIDTH_GROWTH = 0.25


def answer_engine(args, decoder, tok, prompts: list[str]):
    """(the slot engine answering `prompts`, its description): slots of --slot-len tokens,
    or by default the 99.9th-percentile prompt and its answer (longer ones go to the
    batched decoder: server/corpus_answers.py)."""
    import numpy as np
    from s2d_jax.data.prompts import end_of_turn_id, prompt_ids, resolve_template
    from s2d_jax.decode.defaults import BUFFER_BUCKET, round_up
    from s2d_jax.server.slots import SlotEngine
    template, _ = resolve_template(tok, "auto")
    max_len = args.slot_len
    if max_len is None:
        long = float(np.percentile([len(prompt_ids(tok, template, [p])) for p in prompts], 99.9))
        max_len = round_up(int(long) + args.max_new_tokens, BUFFER_BUCKET)
    max_len = min(max_len, decoder.context)
    engine = SlotEngine(decoder, tok, slots=args.slots, max_len=max_len,
                        eos_id=end_of_turn_id(tok, template), width_growth=WIDTH_GROWTH)
    return engine, f"slot engine, {args.slots} slots of {max_len} tokens"


class ShardWriter:
    """Writes each completed shard into the corpus (and, with --commit, into git every
    --commit-every shards), logging the run's rate."""

    def __init__(self, args, manifest: dict, prompts: list[str], log):
        self.args, self.manifest, self.prompts, self.log = args, manifest, prompts, log
        self.tokens, self.start = 0, time.perf_counter()
        self.last = self.start
        self.uncommitted: list[str] = []

    def write(self, k: int, rows: list[dict], engine_name: str) -> None:
        from s2d_jax.data import corpus
        size, args = self.args.batch_size, self.args
        batch = self.prompts[k * size:(k + 1) * size]
        for row in rows:
            row["prompt_index"] = k * size + batch.index(row["prompt"])
        rec = corpus.add_shard(args.corpus, self.manifest, args.run, k, rows, engine=engine_name)
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        self.tokens += rec["answer_tokens"]
        total = self.manifest["totals"]
        msg = (f"shard {rec['file']}: {rec['rows']} rows, {rec['answer_tokens']} answer "
               f"tokens in {dt:.0f} s (run so far {self.tokens / (now - self.start):.1f} "
               f"tokens/s); corpus {total['answer_tokens']} answer tokens, "
               f"{total['bytes'] / 1e6:.2f} MB")
        self.uncommitted.append(rec["file"])
        if args.commit and len(self.uncommitted) >= args.commit_every:
            self.commit(msg)
        self.log(f"[corpus] {msg}" + ("" if self.uncommitted else " (committed)"))

    def commit(self, msg: str) -> None:
        from s2d_jax.data import corpus
        if self.args.commit and self.uncommitted:
            n = len(self.uncommitted)
            commit_files(self.args.corpus, self.uncommitted + [corpus.MANIFEST],
                         f"corpus: {msg}" if n == 1 else f"corpus: {n} shards, last {msg}")
        self.uncommitted.clear()


def generate(args, log) -> dict:
    from s2d_jax.data import corpus, engine
    from s2d_jax.server.corpus_answers import stream_shards
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    # a resume is checked against its stored plan before the model loads
    path = os.path.join(args.corpus, corpus.MANIFEST)
    manifest = corpus.read_manifest(args.corpus) if os.path.isfile(path) else None
    resumed = manifest is not None and args.run in manifest["runs"]
    if resumed:
        mine = resumed_plan(args, manifest["runs"][args.run])
        prompts = corpus.read_prompts(args.corpus, args.run)  # resumes from the repo alone
    fp = engine.target_fingerprint(args.target)
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    decoder = Decoder(cfg, params, method="ar", name="target")
    target = target_record(args, fp, cfg.vocab_size)
    if manifest is not None:  # before a new run's prompt stages write into --work
        corpus.check_target(args.corpus, manifest, target)
    if resumed:
        log(f"[corpus] resuming run {args.run}: {len(prompts)} prompts from the corpus")
    else:
        earlier = {p for run in (manifest or {}).get("runs", {})
                   for p in corpus.read_prompts(args.corpus, run)}
        prompts, counts = new_run_prompts(args, fp, decoder, tok, log, earlier)
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
    writer = ShardWriter(args, manifest, prompts, log)
    batches = [(k, prompts[k * size:(k + 1) * size]) for k in todo]
    try:
        if args.slots and batches:
            slots_engine, name = answer_engine(args, decoder, tok,
                                               [p for _, b in batches for p in b])
            log(f"[corpus] answering on the {name}")
            stream_shards(slots_engine, decoder, tok, batches, seed=args.seed,
                          max_new_tokens=args.max_new_tokens,
                          on_shard=lambda k, rows: writer.write(k, rows, name))
        for k, batch in ([] if args.slots else batches):
            rows = engine.answer_shard(decoder, tok, batch, k, args.seed, args.max_new_tokens)
            writer.write(k, rows, f"batched Decoder, {len(batch)} prompts a batch")
    finally:  # whole shards already written are kept in git even when the run stops
        writer.commit(f"{manifest['totals']['answer_tokens']} answer tokens in the corpus")
    return manifest["totals"]


@cli_main
def main(argv=None):
    args = parse_args(argv)

    def log(msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    log(f"[corpus] totals {generate(args, log)}")


if __name__ == "__main__":
    main()
