"""Answer-generation throughput of a target beside its teacher-forced forward, in one
process: the batched decoder per batch size, the slot engine per slot count, then the data
engine's teacher pass (data/teacher.states_fn) over the same prompt + answer rows.

    python -m train.bench_answers --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \
        --batch-sizes 8,32 --slot-counts 32,64 --requests 64 --max-new-tokens 64

Every run answers GSM8K-train prompts at each of --temperatures (default 0,1: the corpus
answers every prompt greedily and at T = 1), once to compile and once timed. A batch size
answers that many prompts as one batch per temperature; a slot count answers --requests
prompts at every temperature through that many slots (a prompt's temperatures in a row,
as the corpus generator submits them). Printed per run: answer tokens/s, its ratio to the teacher-forced
rate (tokens/s of the states pass over the run's own rows), and the cost ratio on the same
rows (the teacher pass's seconds over generation's: a generation costing exactly a forward
over its rows would score 1; answer tok/s can then reach at most answers / row tokens).
"""

from __future__ import annotations

import time

from s2d_jax.cli.args import ArgumentParser, input_arg, parse_floats, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "bench-answers"  # its s2d subcommand: the name its shared flags are defined for


def timed(fn):
    """(fn()'s value, seconds) of a second call (the first compiles)."""
    fn()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def teacher_rate(cfg, params, rows: list[list[int]]) -> float:
    """Tokens/s of the teacher stage's states pass over `rows` (after a compile pass)."""
    from s2d_jax.data.teacher import rows_states, states_fn
    states = states_fn(cfg)
    _, seconds = timed(lambda: rows_states(states, params, rows, cfg.hidden_size))
    return sum(len(r) - 1 for r in rows) / seconds


def report(label: str, prompts_ids, answers, seconds: float, cfg, params) -> str:
    rows = [list(p) + list(a) for p, a in zip(prompts_ids, answers)]
    new = sum(len(a) for a in answers)
    rate, tf = new / seconds, teacher_rate(cfg, params, rows)
    row_tokens = sum(len(r) - 1 for r in rows)
    return (f"{label}: {rate:.1f} answer tokens/s ({len(rows)} answers, {new} tokens); "
            f"teacher-forced {tf:.1f} tokens/s on the same rows; answer rate / teacher-forced "
            f"{rate / tf:.2f} (at most {new / row_tokens:.2f} for these rows); cost ratio "
            f"{row_tokens / tf / seconds:.2f}")


@cli_main
def main(argv=None):
    ap = ArgumentParser(prog="python -m train.bench_answers", description=__doc__)
    add(ap, "--target", CMD, required=True)
    add(ap, "--batch-sizes", CMD)
    ap.add_argument("--slot-counts", default="64", metavar="S,S,...",
                    help="slot engine sizes to time, comma-separated ('' = none)")
    ap.add_argument("--requests", type=int, default=64,
                    help="prompts each slot engine answers (more than its slots: a finished "
                         "answer's slot goes to the next prompt)")
    add(ap, "--max-new-tokens", CMD)
    add(ap, "--temperatures", CMD)
    args = ap.parse_args(argv)
    temps = parse_floats(args.temperatures, "--temperatures", nonempty=True)
    if any(t < 0 for t in temps):
        raise S2DError(f"--temperatures must be >= 0 (0 = greedy), got {args.temperatures}")
    sizes = parse_ints(args.batch_sizes, "--batch-sizes") if args.batch_sizes.strip() else []
    slot_counts = parse_ints(args.slot_counts, "--slot-counts") \
        if args.slot_counts.strip() else []
    if min(sizes + slot_counts, default=1) < 1 or not sizes + slot_counts:
        raise S2DError("--batch-sizes and --slot-counts take counts >= 1, at least one in all")
    for flag in ("requests", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise S2DError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    from s2d_jax.data.distill import prompts_from_file
    from s2d_jax.data.prompts import end_of_turn_id, prompt_ids, resolve_template
    from s2d_jax.decode.defaults import BUFFER_BUCKET, round_up
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    from s2d_jax.server.request import Request
    from s2d_jax.server.slots import SlotEngine
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    decoder = Decoder(cfg, params, method="ar", name="target")
    template, _ = resolve_template(tok, "auto")
    eos = end_of_turn_id(tok, template)
    texts = prompts_from_file(input_arg("data/gsm8k_train.jsonl"))
    ids = [prompt_ids(tok, template, [p]) for p in texts[:max(sizes + [args.requests])]]
    new = args.max_new_tokens
    for b in sizes:
        out, seconds = timed(lambda: [o for k, t in enumerate(temps) for o in decoder.generate(
            ids[:b], max_new_tokens=new, eos_id=eos, temperature=t, seed=k)])
        print(report(f"batch {b}", ids[:b] * len(temps), [o["token_ids"] for o in out], seconds,
                     cfg, params), flush=True)
    asked = [tuple(i) for i in ids[:args.requests]]
    requests = [Request(i, max_new_tokens=new, temperature=t, seed=k)
                for k, i in enumerate(asked) for t in temps]
    for s in slot_counts:
        # slots hold the longest prompt and its answer (the data engine's choice)
        engine = SlotEngine(decoder, tok, slots=s, eos_id=eos, max_len=min(round_up(
            max(len(i) for i in asked) + new, BUFFER_BUCKET), decoder.context))
        out, seconds = timed(lambda: engine.run(requests))
        print(report(f"slots {s} ({len(requests)} requests)", [r.prompt_ids for r in requests],
                     [o.token_ids for o in out], seconds, cfg, params), flush=True)


if __name__ == "__main__":
    main()
