"""Load benchmark of the server: N concurrent clients send Spec-Bench prompts through the
real HTTP interface (streamed /v1/completions), AR and speculation side by side in one
run, each method served in turn by a fresh in-process server of the same settings.

    python -m infer.serve_bench --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --methods ar,s2d --clients 1,4,16 \\
        --requests-per-client 4 --max-new-tokens 64 --out runs/serve_bench

Per method and client count: requests/s, output tokens/s, time to first token and time
per output token (p50 / p99), and tokens/s against AR's at the same client count. Writes
OUT/serve_bench.json, OUT/serve_bench.md (the table) and OUT/serve_bench.png (with
matplotlib). Prompts are the first turns of --questions, rendered in the chat template
(--chat-template) and sent as token ids.
"""

from __future__ import annotations

import json
import os
import sys

from s2d_jax.cli.args import ArgumentParser, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.decode.methods import METHODS, proposer
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR


CMD = "serve-bench"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.serve_bench", description=__doc__)
    add(ap, "--target", CMD, required=True)
    for name in ("--draft", "--methods", "--exit", "--gamma", "--questions", "--categories",
                 "--max-prompts",
                 "--chat-template", "--max-new-tokens", "--slots", "--slot-len",
                 "--chunk-rounds", "--dtype"):
        add(ap, name, CMD)
    ap.add_argument("--clients", default="1,4,16", help="concurrent client counts, e.g. 1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="requests each client sends, one at a time")
    add(ap, "--out", CMD, kind=DIR, required=True)
    return ap.parse_args(argv)


def check_args(args) -> tuple[list[str], list[int]]:
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise S2DError(f"--methods {args.methods!r}: give methods among {', '.join(METHODS)}")
    if any(proposer(m).needs_draft for m in methods) and args.draft is None:
        raise S2DError("a method in --methods needs --draft PATH; pass one or use ar")
    if any(proposer(m).self_draft for m in methods) and args.exit is None:
        raise S2DError("method self needs --exit (how many target layers draft)")
    from s2d_jax.cli.args import check_models_exist
    check_models_exist([("--target", args.target), ("--draft", args.draft)])
    clients = parse_ints(args.clients, "--clients", 1)
    for flag in ("max_prompts", "requests_per_client", "max_new_tokens", "slots",
                 "chunk_rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise S2DError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return methods, clients


def prompts_of(args, tok) -> list[list[int]]:
    """The questions' first turns as a chat turn's token ids (sent as the completion's
    prompt: OpenAI's token-id prompt, so the server reads exactly these ids)."""
    from s2d_jax.data.prompts import messages_ids, read_questions, resolve_template
    template, _ = resolve_template(tok, args.chat_template)
    categories = [c for c in args.categories.split(",") if c] if args.categories else None
    questions = read_questions(args.questions, categories, max_prompts=args.max_prompts)
    return [messages_ids(tok, template, [{"role": "user", "content": q["text"]}])
            for q in questions]


@cli_main
def main(argv=None):
    args = parse_args(argv)
    methods, clients = check_args(args)
    from s2d_jax.bench import serve_load
    from s2d_jax.io.atomic import files_dir, write_atomic
    from s2d_jax.io.tokenizer import load_tokenizer
    from s2d_jax.server.launch import build_server

    prompts = prompts_of(args, load_tokenizer(args.target))

    def start(method):
        print(f"serving {method}: compiling ...", file=sys.stderr, flush=True)
        return build_server(args.target, args.draft if proposer(method).needs_draft else None,
                            method=method, exit=args.exit, gamma=args.gamma,
                            dtype=args.dtype, chat_template="none", slots=args.slots,
                            max_len=args.slot_len, chunk_rounds=args.chunk_rounds,
                            max_queue=max(clients) * 2, port=0,
                            progress=lambda line: print(line, file=sys.stderr)).start()

    rows = serve_load.run_methods(start, methods, prompts, clients, args.requests_per_client,
                                  args.max_new_tokens,
                                  progress=lambda line: print(line, file=sys.stderr))
    table = serve_load.table(rows)
    with files_dir(args.out, args.s2d_prog):
        write_atomic(os.path.join(args.out, "serve_bench.json"),
                     json.dumps({"settings": {k: v for k, v in vars(args).items()
                                              if not k.startswith("s2d_")}, "loads": rows},
                                indent=1))
        write_atomic(os.path.join(args.out, "serve_bench.md"), table)
        if not serve_load.plot(rows, os.path.join(args.out, "serve_bench.png")):
            print("serve_bench.png skipped: matplotlib is not installed", file=sys.stderr)
    print(table, end="")
    return 0


if __name__ == "__main__":
    main()
