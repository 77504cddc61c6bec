"""Serve a target over HTTP, OpenAI-compatible, with continuous batching and speculation
per request (s2d_jax/server/).

    s2d serve --target smollm2 --draft smollm2-draft --port 8000
    curl localhost:8000/health     # from the first second: loading / warming, then ready
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Start-up with the defaults on an idle 2-core AMD EPYC (Zen 4): /health answers within 1 s;
ready after 25.8 s at a fresh machine's first start (building the CPU kernels, loading, then
the programs the first requests need: prompts up to 512 tokens, one row; the longer prompts
and larger batches compile in the background while idle, a request first; 15.3 s with the
kernels built), and after 6.0-6.4 s at the second, which reads the compiled programs and the
warm-up's measured round costs from the compilation cache (`s2d cache`). /health answers
503 with the stage until ready, then 200 with "state": "ready".

Endpoints: /v1/chat/completions and /v1/completions (streamed with "stream": true, SSE),
/v1/models, /health. Each request decodes in one of --slots slots of --slot-len tokens
(prompt + answer); up to --max-queue more wait for a slot, beyond that the server answers
429 with Retry-After; a body past --max-body-mb gets 413. It binds its port first (a port in
use is an error at once) and answers /health at once; it compiles the programs a request
can need (prefill per prompt-width bucket, the slot writes, the greedy and sampling chunks)
as above. SIGTERM or Ctrl-C stops it within seconds, during the warm-up too. Usage in every answer carries the request's speculation figures (tokens
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
    from s2d_jax.decode.auto_method import cli_choice  # auto: the calibrated choice
    args.method, args.decoding, _ = cli_choice(args.method, [args.target],
                                               args.draft is not None)
    if proposer(args.decoding).needs_draft and args.draft is None:
        raise S2DError(f"method {args.decoding} needs --draft PATH (a draft model); pass one, "
                       f"or use --method ar")
    if proposer(args.decoding).self_draft and args.exit is None:
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


def _given(flag: str, argv) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


@cli_main(hard_stop=False)  # its own shutdown: requests in flight finish, no error line
def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    from s2d_jax.server.launch import serve_early
    from s2d_jax.server.listen import bind

    sock = bind(args.host, args.port)  # a port in use: error: before minutes of compiling
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    print(f"loading {args.target} and compiling ({url}/health says how far) ...",
          file=sys.stderr, flush=True)
    ready, busy = False, True
    try:  # SIGTERM is a KeyboardInterrupt here (cli_main): a stop asked for, no error
        ready, busy = serve_early(
            sock, args.served_model_name or os.path.basename(os.path.normpath(args.target)),
            lambda line: print(line, file=sys.stderr, flush=True),
            target=args.target, draft=args.draft, method=args.method,
            name=args.served_model_name, gamma=args.gamma,
            thresholds=parse_floats(args.thresholds, "--thresholds") if args.thresholds
            else None,
            exit=args.exit, exits=parse_ints(args.exits, "--exits", 1) if args.exits else None,
            dtype=args.dtype, chat_template=args.chat_template, slots=args.slots,
            max_len=args.slot_len, chunk_rounds=args.chunk_rounds, max_queue=args.max_queue,
            default_max_tokens=args.max_new_tokens, host=args.host, seed=args.seed,
            max_body_bytes=int(args.max_body_mb * MIB), fit_context=not _given(
                "--slot-len", sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # (a second signal while uvicorn stopped)
        pass
    print("stopped" + ("" if ready else " during the warm-up"), file=sys.stderr, flush=True)
    if busy:  # a warm-up thread may be inside XLA for seconds more: don't wait for it
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    main()
