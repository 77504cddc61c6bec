"""Serve a target over HTTP, OpenAI-compatible, with continuous batching and speculation
per request (s2d_jax/server/).

    python -m infer.serve --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --method s2d --slots 8 --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: /v1/chat/completions and /v1/completions (streamed with "stream": true, SSE),
/v1/models, /health. Each request decodes in one of --slots slots of --slot-len tokens
(prompt + answer); up to --max-queue more wait for a slot, beyond that the server answers
429 with Retry-After; a body past --max-body-mb gets 413. It binds its port first (a port in
use is an error at once), then compiles every program a request can need (prefill per
prompt-width bucket, the slot writes, the greedy and sampling chunks) before it answers,
so no request waits for a compilation. SIGTERM or Ctrl-C stops it within seconds, during
the warm-up too. Usage in every answer carries the request's speculation figures (tokens
per target call, draft tokens proposed / accepted).
"""

from __future__ import annotations

import os
import sys

from s2d_jax.cli.args import ArgumentParser, parse_floats, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.decode.methods import proposer
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.server.body import DEFAULT_MAX_BODY_BYTES

MIB = 1 << 20


CMD = "serve"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.serve", description=__doc__)
    add(ap, "--target", CMD, required=True)
    add(ap, "--draft", CMD)
    for name in ("--method", "--exit", "--exits", "--thresholds", "--gamma", "--chat-template",
                 "--max-new-tokens", "--slots", "--slot-len", "--chunk-rounds", "--seed",
                 "--dtype"):
        add(ap, name, CMD)
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name clients send (default: the target dir's name)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot before new ones get 429")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on "
                    "(0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free "
                    "port)")
    ap.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / MIB,
                    metavar="MIB", help="largest request body accepted, in MiB (larger ones "
                    "get 413 before they are read)")
    return ap.parse_args(argv)


def check_args(args) -> None:
    """The checks that need no model, before JAX starts."""
    if proposer(args.method).needs_draft and args.draft is None:
        raise S2DError(f"method {args.method} needs --draft PATH (a draft model); pass one, "
                       f"or use --method ar")
    if proposer(args.method).self_draft and args.exit is None:
        raise S2DError("method self needs --exit (how many target layers draft)")
    for flag, lo in (("slots", 1), ("chunk_rounds", 1), ("max_queue", 1),
                     ("max_new_tokens", 1), ("port", 0)):
        if getattr(args, flag) < lo:
            raise S2DError(f"--{flag.replace('_', '-')} must be >= {lo}, got "
                           f"{getattr(args, flag)}")
    if args.port > 65535:
        raise S2DError(f"--port must be <= 65535, got {args.port}")
    if not 1 <= args.max_body_mb * MIB < 1 << 62:  # (NaN too)
        raise S2DError(f"--max-body-mb must be > 0 (MiB: at least one byte), got "
                       f"{args.max_body_mb}")
    if args.slot_len is not None and args.slot_len < 2:
        raise S2DError(f"--slot-len must be >= 2 (a prompt token and a new one), got "
                       f"{args.slot_len}")


@cli_main
def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    from s2d_jax.server.launch import build_interruptibly
    from s2d_jax.server.listen import bind

    building = True
    try:  # SIGTERM is a KeyboardInterrupt here (cli_main): a stop asked for, no error
        sock = bind(args.host, args.port)  # a port in use: error: before minutes of compiling
        print(f"loading {args.target} and compiling ...", file=sys.stderr, flush=True)
        server = build_interruptibly(
            args.target, args.draft, method=args.method, name=args.served_model_name,
            gamma=args.gamma,
            thresholds=parse_floats(args.thresholds, "--thresholds") if args.thresholds
            else None,
            exit=args.exit, exits=parse_ints(args.exits, "--exits", 1) if args.exits else None,
            dtype=args.dtype, chat_template=args.chat_template, slots=args.slots,
            max_len=args.slot_len, chunk_rounds=args.chunk_rounds, max_queue=args.max_queue,
            default_max_tokens=args.max_new_tokens, host=args.host, seed=args.seed,
            max_body_bytes=int(args.max_body_mb * MIB), sock=sock,
            progress=lambda line: print(line, file=sys.stderr, flush=True))
        building = False
        print(f"serving {server.model} ({args.method}) on {server.url}/v1", file=sys.stderr,
              flush=True)
        server.run()
    except KeyboardInterrupt:
        print("stopped" + (" during the warm-up" if building else ""), file=sys.stderr,
              flush=True)
        if building:  # the build thread may be inside XLA for seconds more: don't wait
            sys.stdout.flush()
            os._exit(0)
    return 0


if __name__ == "__main__":
    main()
