"""Greedy chat with a model that uses its own chat template (e.g. SmolLM2's ChatML).

    python -m examples.smollm2_chat [--model DIR_OR_GGUF] [--prompt TEXT] [--method ar]

The same as `python -m infer.generate --chat-template auto` (its default for a tokenizer
with a template), spelled out: the messages are rendered with the tokenizer's own template
(s2d_jax.data.prompts, special tokens as their ids) and decoded with the Engine
`infer.generate` uses until the template's end of turn. --model defaults to the HF dir
written by `python -m infer.fetch_smollm2`.
"""

from __future__ import annotations

import argparse
import sys

from s2d_jax.errors import cli_main


def chat_ids(tok, prompt: str) -> list[int]:
    """Token ids of one user turn plus the assistant header, from the tokenizer's template."""
    from s2d_jax.data.prompts import prompt_ids
    return prompt_ids(tok, "auto", [prompt])


@cli_main
def main(argv=None) -> int:
    from infer.fetch_smollm2 import model_paths

    ap = argparse.ArgumentParser(prog="python -m examples.smollm2_chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model_paths()[1], help="HF dir, checkpoint or .gguf")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--method", default="ar", choices=("ar", "self"))
    ap.add_argument("--exit", type=int, default=None, help="draft depth for --method self")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from s2d_jax.data.prompts import end_of_turn_id
    from s2d_jax.decode.serving import Engine, TargetSpec
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    cfg, params, _ = load_model(args.model)
    exits = [args.exit] if args.method == "self" else None
    engine = Engine({"model": TargetSpec(cfg, params, tokenizer=tok)}, method=args.method,
                    exits=exits)
    out, = engine.generate("model", [chat_ids(tok, args.prompt)],
                           max_new_tokens=args.max_new_tokens, temperature=0.0,
                           eos_id=end_of_turn_id(tok, "auto"))
    print(tok.decode(out["token_ids"]))
    print(f"{out['stats']['new_tokens']} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
