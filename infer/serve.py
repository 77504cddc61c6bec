"""Serve a target over HTTP, OpenAI-compatible, with continuous batching and speculation
per request (s2d_jax/server/).

    python -m infer.serve --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --method s2d --slots 8 --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: /v1/chat/completions and /v1/completions (streamed with "stream": true, SSE),
/v1/models, /health. Each request decodes in one of --slots slots of --max-len tokens
(prompt + answer); up to --max-queue more wait for a slot, beyond that the server answers
429 with Retry-After. Before it listens it compiles every program a request can need
(prefill per prompt-width bucket, the slot writes, the greedy and sampling chunks), so no
request waits for a compilation. Usage in every answer carries the request's speculation
figures (tokens per target call, draft tokens proposed / accepted).
"""

from __future__ import annotations

import sys

from s2d_jax.cli.args import ArgumentParser, add_input, parse_floats, parse_ints
from s2d_jax.decode.defaults import METHODS, needs_draft
from s2d_jax.errors import S2DError, cli_main


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.serve", description=__doc__)
    add_input(ap, "--target", required=True, metavar="[NAME=]PATH", type=str,
              paths=lambda spec: [spec.partition("=")[2] or spec],
              help="target model: HF dir, params checkpoint or .gguf; NAME is the model "
              "name clients send (default: the directory's name)")
    add_input(ap, "--draft", default=None, help="draft model (needed by sd, s2d and ladder)")
    ap.add_argument("--method", default="s2d", choices=METHODS,
                    help="s2d: sorted draft, escalating over exits; sd: one draft exit; "
                    "self: the target's first --exit layers draft; lookup / ladder: tokens "
                    "copied from the context (then S2D); ar: no speculation")
    ap.add_argument("--exit", type=int, default=None, help="draft depth for sd / self")
    ap.add_argument("--exits", default=None, help="s2d exits, e.g. 2,4 (default: the target's "
                    "calibrated s2d_serving.json, else the draft's s2d_exits)")
    ap.add_argument("--thresholds", default=None, help="one confidence threshold per exit in "
                    "[0,1] (default: calibrated, else 0.5 each, 0 at the last)")
    ap.add_argument("--gamma", type=int, default=None,
                    help="draft tokens per round (default: calibrated, else 4)")
    ap.add_argument("--chat-template", default="auto", choices=("auto", "vicuna", "none"),
                    help="how chat messages become a prompt; auto: the tokenizer's own "
                    "template, else the text as is")
    ap.add_argument("--max-new-tokens", type=int, default=256,
                    help="new tokens of a request that sends no max_tokens")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together")
    ap.add_argument("--max-len", type=int, default=None, help="tokens per slot, prompt + "
                    "answer (default: the models' context)")
    ap.add_argument("--chunk-rounds", type=int, default=4, help="rounds per jitted chunk: "
                    "a finished request's slot is refilled between chunks")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot before new ones get 429")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the batch's sampling")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="compute and weight dtype (default: as stored)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on "
                    "(0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on")
    return ap.parse_args(argv)


def check_args(args) -> None:
    """The checks that need no model, before JAX starts."""
    if needs_draft(args.method) and args.draft is None:
        raise S2DError(f"method {args.method} needs --draft PATH (a draft model); pass one, "
                       f"or use --method ar")
    if args.method == "self" and args.exit is None:
        raise S2DError("method self needs --exit (how many target layers draft)")
    for flag, lo in (("slots", 1), ("chunk_rounds", 1), ("max_queue", 1),
                     ("max_new_tokens", 1), ("port", 0)):
        if getattr(args, flag) < lo:
            raise S2DError(f"--{flag.replace('_', '-')} must be >= {lo}, got "
                           f"{getattr(args, flag)}")
    if args.port > 65535:
        raise S2DError(f"--port must be <= 65535, got {args.port}")
    if args.max_len is not None and args.max_len < 2:
        raise S2DError(f"--max-len must be >= 2 (a prompt token and a new one), got "
                       f"{args.max_len}")


@cli_main
def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    from s2d_jax.env import resolve_model
    from s2d_jax.server.launch import build_server

    name, sep, path = args.target.partition("=")
    if not sep:
        name, path = None, args.target
    print(f"loading {path} and compiling ...", file=sys.stderr, flush=True)
    server = build_server(
        resolve_model(path), args.draft, method=args.method, name=name, gamma=args.gamma,
        thresholds=parse_floats(args.thresholds, "--thresholds") if args.thresholds else None,
        exit=args.exit, exits=parse_ints(args.exits, "--exits", 1) if args.exits else None,
        dtype=args.dtype, chat_template=args.chat_template, slots=args.slots,
        max_len=args.max_len, chunk_rounds=args.chunk_rounds, max_queue=args.max_queue,
        default_max_tokens=args.max_new_tokens, host=args.host, port=args.port,
        seed=args.seed, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"serving {server.model} ({args.method}) on {server.url}/v1", file=sys.stderr,
          flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    main()
