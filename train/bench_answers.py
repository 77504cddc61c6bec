"""Answer-generation throughput of a target against batch size: the data engine's default
batch (data-engine's --batch-size, s2d_jax/cli/flags.py) is the fastest measured here.

    python -m train.bench_answers --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \
        --batch-sizes 8,16,32 --max-new-tokens 32

Each batch size answers the same GSM8K-train prompts greedily, once to compile and once
timed; prints answer tokens/s per batch size.
"""

from __future__ import annotations

import time

from s2d_jax.cli.args import ArgumentParser, input_arg, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "bench-answers"  # its s2d subcommand: the name its shared flags are defined for


def throughput(decoder, tok, prompts, batch_size: int, max_new_tokens: int) -> float:
    """Answer tokens per second of one batch of `batch_size` prompts (after a compile run)."""
    from s2d_jax.data.distill import answer_rows
    batch = prompts[:batch_size]
    answer_rows(decoder, tok, batch, temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    rows = answer_rows(decoder, tok, batch, temperature=0.0, seed=0,
                       max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    return sum(len(r["input_ids"]) - r["learn_from"] for r in rows) / seconds


@cli_main
def main(argv=None):
    ap = ArgumentParser(prog="python -m train.bench_answers", description=__doc__)
    add(ap, "--target", CMD, required=True)
    add(ap, "--batch-sizes", CMD)
    add(ap, "--max-new-tokens", CMD)
    args = ap.parse_args(argv)
    sizes = parse_ints(args.batch_sizes, "--batch-sizes", minimum=1)
    if args.max_new_tokens < 1:
        raise S2DError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from s2d_jax.data.distill import prompts_from_file
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    cfg, params, _ = load_model(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    decoder = Decoder(cfg, params, method="ar", name="target")
    prompts = prompts_from_file(input_arg("data/gsm8k_train.jsonl"))[:max(sizes)]
    for b in sizes:
        print(f"batch {b}: {throughput(decoder, tok, prompts, b, args.max_new_tokens):.1f} "
              f"answer tokens/s", flush=True)


if __name__ == "__main__":
    main()
