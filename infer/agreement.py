"""How often each exit of one or more sorted drafts agrees with its target, teacher-forced.

    python -m infer.agreement --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --draft runs/smollm2_draft/pack \\
        --questions data/smollm2_calibration.jsonl --max-prompts 12

The target answers the questions' first turns greedily (one batch); every draft then reads
the same answers in one forward pass and predicts each next token at each of its exits.
Printed per draft and exit: the fraction of answer tokens whose greedy prediction is the
target's (greedy SD at gamma 1 accepts 1 + that many tokens per round, Lemma 3.1), the mean
chance that speculative sampling at T = 1 accepts the exit's draft there (sum_v min(p, q),
on the same greedy contexts), how often the exit's confidence reaches 0.5, and each deeper
exit's agreement gain over the one before it, paired on the same tokens with its standard
error. Minutes, against a benchmark's hour: for comparing drafts and exits, not for speed.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from infer.args import ArgumentParser, check_at_least, check_output_path, path_arg
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import Output, check_outputs


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.agreement", description=__doc__)
    ap.add_argument("--target", required=True, type=path_arg,
                    help="the target (HF dir, checkpoint, .gguf)")
    ap.add_argument("--draft", action="append", required=True, type=path_arg,
                    help="a sorted draft (pack or model dir); repeat to compare drafts")
    ap.add_argument("--questions", default="data/smollm2_calibration.jsonl", type=path_arg,
                    help="prompts (Spec-Bench jsonl)")
    ap.add_argument("--max-prompts", type=int, default=12, help="prompts to use at most")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="new tokens per answer at most")
    ap.add_argument("--chat-template", default="auto", choices=("auto", "vicuna", "none"),
                    help="auto: the tokenizer's own template")
    ap.add_argument("--out", default=None, type=path_arg,
                    help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    check_at_least(args, {"max_prompts": 1, "max_new_tokens": 2})
    check_outputs([Output("--out", args.out)], {"--target": args.target, "--draft": args.draft,
                                                "--questions": args.questions})
    if args.out is not None:
        check_output_path(args.out)
    return args


@functools.partial(jax.jit, static_argnames=("cfg", "rows"))
def _target_probs(params, tokens, start, *, cfg, rows):
    """The target's next-token distributions at positions start .. start + rows - 1."""
    from s2d_jax.model import transformer as model
    logits = jax.lax.dynamic_slice_in_dim(model.forward(params, cfg, tokens)[0][0], start, rows)
    return jax.nn.softmax(logits, -1)


@functools.partial(jax.jit, static_argnames=("d_cfg", "exits"))
def _overlap(d_params, tokens, start, p, *, d_cfg, exits):
    """sum_v min(p_v, q_v) per answer position and exit [rows, m]: the chance that
    speculative sampling at T = 1 accepts a token the exit drafts there (p: the target's
    distributions at those positions)."""
    from s2d_jax.model.sorted_draft import multi_exit_logits
    return jnp.stack([jnp.sum(jnp.minimum(p, jax.nn.softmax(
        jax.lax.dynamic_slice_in_dim(lg[0], start, p.shape[0]), -1)), -1)
        for lg in multi_exit_logits(d_params, d_cfg, exits, tokens)], -1)


def _padded(seq, rows):
    """seq padded to a multiple of 64 with room for `rows` positions after the prompt
    (causal: padding changes no earlier position), not to the decode buffer: the
    full-vocabulary softmaxes are most of the cost."""
    from s2d_jax.decode.defaults import round_up
    arr = np.zeros((1, round_up(len(seq) + rows, 64)), np.int32)
    arr[0, :len(seq)] = seq
    return jnp.asarray(arr)


def target_distributions(cfg, params, prompts, answers, rows: int) -> list[np.ndarray]:
    """Per prompt: the target's distributions over the answer positions [rows, V] (rows >=
    the longest answer; computed once and shared by every draft compared)."""
    return [np.asarray(_target_probs(params, _padded(list(p) + list(a), rows),
                                     len(p), cfg=cfg, rows=rows))
            for p, a in zip(prompts, answers)]


def sampling_acceptance(d_cfg, d_params, exits, prompts, answers, target_p) -> np.ndarray:
    """Per exit: the mean T = 1 acceptance chance over the answer tokens (as exit_stats,
    the draft predicting answer token k + 1 from the target's context)."""
    d_cfg = dataclasses.replace(d_cfg, num_layers=exits[-1])
    out = []
    for p, a, tp in zip(prompts, answers, target_p):
        ov = np.asarray(_overlap(d_params, _padded(list(p) + list(a), tp.shape[0]), len(p),
                                 jnp.asarray(tp), d_cfg=d_cfg, exits=tuple(exits)))
        out.append(ov[:len(a) - 1])
    return np.concatenate(out).mean(0)


def paired_gain(stats, j: int) -> tuple[float, float]:
    """Exit j's greedy agreement minus exit j - 1's on the same tokens, and its standard
    error clustered by prompt (tokens of one answer are not independent)."""
    d = [c[:, j].astype(np.float64) - c[:, j - 1] for c in stats.correct]
    n = sum(len(x) for x in d)
    mean = sum(x.sum() for x in d) / n
    return float(mean), float(np.sqrt(sum((x - mean).sum() ** 2 for x in d)) / n)


def measurable_exits(rows: list[dict], z: float = 2.0) -> list[int]:
    """The exits from the first up to (not past) the first one whose paired agreement gain
    over the exit before it is not at least z standard errors above zero: each kept exit
    is accepted measurably more often than the cheaper one before it."""
    kept = [rows[0]["exit"]]
    for r in rows[1:]:
        if not r["gain_over_previous"] > z * r["gain_se"]:
            break
        kept.append(r["exit"])
    return kept


def exit_agreement(stats, accept_t1=None) -> list[dict]:
    """Per exit of calibrate.ExitStats: greedy agreement and confidence over answer tokens
    (and the T = 1 acceptance chance, when given)."""
    correct = np.concatenate(stats.correct)
    conf = np.concatenate(stats.conf)
    return [{"exit": int(e), "tokens": int(correct.shape[0]),
             "agreement": float(correct[:, j].mean()),
             "accept_t1": None if accept_t1 is None else float(accept_t1[j]),
             "confident": float((conf[:, j] >= 0.5).mean()),
             "agreement_when_confident": (float(correct[conf[:, j] >= 0.5, j].mean())
                                          if (conf[:, j] >= 0.5).any() else None)}
            for j, e in enumerate(stats.exits)]


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax.bench.calibrate import exit_stats
    from s2d_jax.data.prompts import (encode_questions, end_of_turn_id, read_questions,
                                      resolve_template)
    from s2d_jax.decode.defaults import buffer_len, draft_exits, prompt_width
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.checkpoint import load_draft
    from s2d_jax.io.tokenizer import load_tokenizer

    tok = load_tokenizer(args.target)
    template, _ = resolve_template(tok, args.chat_template, fallback="none")
    prompts = encode_questions(tok, read_questions(args.questions, None, args.max_prompts),
                               template)
    cfg, params, _ = load_model(args.target, dtype="float32")
    width = prompt_width(max(len(p) for p in prompts))
    max_len = buffer_len(width, args.max_new_tokens, 1, cfg.max_position_embeddings)
    answers = Decoder(cfg, params, method="ar").generate(
        prompts, max_new_tokens=args.max_new_tokens, eos_id=end_of_turn_id(tok, template),
        max_len=max_len)
    ids = [a["token_ids"] for a in answers]
    target_p = target_distributions(cfg, params, prompts, ids, args.max_new_tokens)
    report = {"questions": args.questions, "prompts": len(prompts), "drafts": {}}
    for path in args.draft:
        d_cfg, d_params, extra = load_draft(path, params, dtype="float32")
        if d_cfg.vocab_size != cfg.vocab_size:
            raise S2DError(f"draft {path} has vocab_size {d_cfg.vocab_size}, the target "
                           f"{cfg.vocab_size}; use a draft of this target")
        exits = draft_exits(extra, d_cfg)
        stats = exit_stats(d_cfg, d_params, exits, prompts, ids, max_len)
        rows = exit_agreement(stats, sampling_acceptance(d_cfg, d_params, exits, prompts, ids,
                                                         target_p))
        for j in range(1, len(rows)):
            rows[j]["gain_over_previous"], rows[j]["gain_se"] = paired_gain(stats, j)
        report["drafts"][path] = rows
        print(f"{path}: " + ", ".join(
            f"exit {r['exit']} {r['agreement']:.3f} (T = 1: {r['accept_t1']:.3f}; "
            f"conf >= 0.5 on {r['confident']:.2f})" for r in rows)
            + f"  [{rows[0]['tokens']} answer tokens]", flush=True)
        if len(rows) > 1:
            print("  deeper exit minus the one before, paired (s.e. by prompt): " + ", ".join(
                f"{r['exit']} - {q['exit']}: {r['gain_over_previous']:+.3f} "
                f"({r['gain_se']:.3f})" for q, r in zip(rows, rows[1:])), flush=True)
    if args.out:
        from s2d_jax.io.atomic import write_atomic
        write_atomic(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
