"""How often each exit of one or more sorted drafts agrees with its target, teacher-forced.

    python -m infer.agreement --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --draft runs/smollm2_draft/pack \\
        --questions data/smollm2_calibration.jsonl --max-prompts 12

The target answers the questions' first turns greedily; every draft then reads the same
answers and predicts each next token at each of its exits (s2d_jax/bench/agreement.py).
Printed per draft and exit: the fraction of answer tokens whose greedy prediction is the
target's (greedy SD at gamma 1 accepts 1 + that many tokens per round, Lemma 3.1), the mean
chance that speculative sampling at T = 1 accepts the exit's draft there (sum_v min(p, q),
on the same greedy contexts), how often the exit's confidence reaches 0.5, and each deeper
exit's agreement gain over the one before it, paired on the same tokens with its standard
error; then each exit's greedy MAT at gamma 1-4 replayed along the answers, and escalation's
ceiling: the share of tokens some exit is right on and the speedup over the first exit alone
that an oracle escalating for free would reach at each gamma; --out-file FILE also writes them as JSON. Memory does not grow with --max-prompts
(48 Spec-Bench first turns fit in a few GB).
"""

from __future__ import annotations

import json

from s2d_jax.cli.args import ArgumentParser, check_at_least
from s2d_jax.cli.flags import add
from s2d_jax.bench.agreement import measurable_exits  # noqa: F401 (train.smollm2_draft, tests)
from s2d_jax.errors import cli_main

CMD = "agreement"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.agreement", description=__doc__)
    add(ap, "--target", CMD, required=True)
    add(ap, "--draft", CMD, required=True)
    for name in ("--questions", "--max-prompts", "--max-new-tokens", "--chat-template",
                 "--out-file"):
        add(ap, name, CMD)
    args = ap.parse_args(argv)
    check_at_least(args, {"max_prompts": 1, "max_new_tokens": 2})
    return args


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax.bench.agreement import measure_agreement, summary_lines
    report = measure_agreement(args.target, args.draft, args.questions, args.max_prompts,
                               args.max_new_tokens, args.chat_template)
    for path in args.draft:
        print("\n".join(summary_lines(path, report["drafts"][path])), flush=True)
    if args.out_file:
        from s2d_jax.io.atomic import write_atomic
        write_atomic(args.out_file, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
