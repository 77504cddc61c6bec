"""Side by side with llama.cpp on the same GGUF (issue 71): llama.cpp's AR (llama-cpp-python,
the optional `peer` extra) and this project's methods on the file's own quantization
(s2d_jax/io/gguf_weights.py), the same prompt token ids, greedy, interleaved prompt by prompt.

    pip install -e '.[peer]'
    python -m infer.peer_bench --gguf ~/.cache/s2d-jax/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft smollm2-draft        # (12 Spec-Bench questions, 128 tokens, ar,lookup,auto,ladder,
                                     #  llama.cpp on 2 threads, 2 passes: the defaults)

Each pass runs every prompt through llama.cpp AR, then each of this project's methods (their
order rotated from prompt to prompt), so a load change on a shared machine hits them alike.
Decode tok/s = (new tokens - 1) / (seconds after the first token), for both runtimes: the
prompt's prefill (which yields the first token) and compilation are left out. Ratios are
paired per prompt (each run over llama.cpp AR on the same prompt in the same pass), then the
median over prompts and passes. Every method's ids are checked against this project's AR
(greedy on the quantized target: they must be equal); llama.cpp's ids are compared too, for
information (its dot products quantize the activations to 8 bits, so they may differ).

llama.cpp's threads (OpenMP) wait for each other at every operation: on a machine other jobs
load, two threads on two cores collapse (3.7 tok/s against 41 with --threads 1, SmolLM2 Q4_1,
load average 7-10), so compare on an idle machine, or report --threads 1 beside it.

--target DIR decodes a model dir instead of the GGUF (e.g. the float32 HF dir, to compare);
the calibrated methods read the target's s2d_serving.json (beside a .gguf:
FILE.gguf.s2d_serving.json). Only the first turn of each question is asked. --out DIR writes
report.json there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from s2d_jax.cli.args import ArgumentParser, add_input
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR

PEER_EXTRA = "pip install -e '.[peer]'"


CMD = "peer-bench"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.peer_bench", description=__doc__)
    add_input(ap, "--gguf", required=True, metavar="FILE.gguf",
              help="the GGUF file both runtimes decode (llama.cpp reads it as it is; this "
                   "project keeps its quantization, s2d_jax/io/gguf_weights.py)")
    add(ap, "--target", CMD)
    add(ap, "--draft", CMD)
    for name in ("--questions", "--max-prompts", "--max-new-tokens", "--methods", "--repeats"):
        add(ap, name, CMD)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    add(ap, "--out", CMD, kind=DIR)
    return ap.parse_args(argv)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise S2DError(f"llama-cpp-python is not installed; {PEER_EXTRA} (builds llama.cpp, "
                       f"several minutes) to time llama.cpp beside this project") from None
    return llama_cpp


class LlamaCpp:
    """llama.cpp AR on the GGUF: greedy from the given token ids, stopping at `eos`."""

    def __init__(self, llama_cpp, path: str, threads: int, n_ctx: int):
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, verbose=False,
                                   seed=0)
        self.version = getattr(llama_cpp, "__version__", "?")

    def generate(self, ids: list[int], max_new: int, eos: int) -> dict:
        llm = self.llm
        llm.reset()
        out, first = [], None
        start = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if tok == eos or len(out) >= max_new:
                break
        end = time.perf_counter()
        return {"token_ids": out, "prefill_s": first - start, "decode_s": end - first}


def _ours(decoder, ids, max_new: int, eos: int) -> dict:
    o = decoder.generate([ids], max_new_tokens=max_new, eos_id=eos, chunk_rounds=max_new + 8)
    b = o[0]["stats"]
    total, prefill = b["batch_seconds"], b["prefill_seconds"]
    return {"token_ids": o[0]["token_ids"], "prefill_s": prefill, "decode_s": total - prefill,
            "mat": b["mean_accepted_tokens"]}


def _rate(run) -> float | None:
    n = len(run["token_ids"]) - 1
    return n / run["decode_s"] if n > 0 and run["decode_s"] > 0 else None


def _load(args):
    """(target path for its settings, cfg, params, draft (cfg, params, extra) or None)."""
    from s2d_jax.env import resolve_model
    from s2d_jax.io.checkpoint import load_draft, load_model
    from s2d_jax.io.gguf_weights import load_gguf_shipped

    if args.target is None:
        target = args.gguf
        cfg, params, _ = load_gguf_shipped(target)
    else:
        target = resolve_model(args.target)
        cfg, params, _ = load_model(target)
    draft = None
    if args.draft:
        draft = load_draft(resolve_model(args.draft), params)
    return target, cfg, params, draft


def _decoders(methods, target, cfg, params, draft) -> dict:
    from s2d_jax.decode.auto_method import auto_target_setting
    from s2d_jax.decode.methods import is_auto, proposer
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.decode.serving_config import target_setting

    dcfg, dparams, extra = draft if draft is not None else (None, None, None)
    out = {}
    for m in methods:
        if is_auto(m):
            s = auto_target_setting(target, cfg, dcfg, extra)
        else:
            if proposer(m).needs_draft and draft is None:
                raise S2DError(f"method {m} needs a draft; pass --draft")
            s = target_setting(m, target, cfg, dcfg, extra)
        label = m if not is_auto(m) else f"{m} ({s.method})"
        out[label] = Decoder(cfg, params, s, draft_cfg=dcfg, draft_params=dparams)
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@cli_main
def main(argv=None) -> int:
    args = parse_args(argv)
    llama_cpp = _llama_cpp()  # first: without the extra, one line and nothing loaded
    if not os.path.isfile(os.path.expanduser(args.gguf)):
        raise S2DError(f"--gguf {args.gguf} is not a file; pass the .gguf both runtimes decode "
                       f"(python -m infer.fetch_smollm2 puts SmolLM2's in ~/.cache/s2d-jax)")
    args.gguf = os.path.expanduser(args.gguf)
    if args.max_new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        raise S2DError("--max-new-tokens must be >= 2, --repeats and --threads >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from s2d_jax.data.prompts import (end_of_turn_id, prompt_ids, read_questions,
                                      resolve_template)
    from s2d_jax.decode.methods import BASELINE
    from s2d_jax.io.tokenizer import load_tokenizer

    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # exactness is checked against it
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    target, cfg, params, draft = _load(args)
    tok = load_tokenizer(target)
    template, note = resolve_template(tok, "auto")
    if note:
        print(note, file=sys.stderr)
    eos = end_of_turn_id(tok, template)
    questions = read_questions(args.questions, None, args.max_prompts)
    prompts = [prompt_ids(tok, template, [q["text"]]) for q in questions]
    decoders = _decoders(methods, target, cfg, params, draft)
    ours_ar = next(iter(decoders))
    peer = LlamaCpp(llama_cpp, args.gguf, args.threads,
                    n_ctx=max(len(p) for p in prompts) + args.max_new_tokens + 16)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; warming up (compiling) ...",
          file=sys.stderr)
    for dec in decoders.values():  # compilation is timed apart anyway (serving.run_streamed)
        _ours(dec, prompts[0], args.max_new_tokens, eos)
    peer.generate(prompts[0], args.max_new_tokens, eos)

    labels = ["llama.cpp ar"] + list(decoders)
    runs = {label: [] for label in labels}  # [(pass, prompt, run)]
    for r in range(args.repeats):
        for i, p in enumerate(prompts):
            order = list(decoders)
            k = (i + r) % len(order)
            order = order[k:] + order[:k]
            runs["llama.cpp ar"].append((r, i, peer.generate(p, args.max_new_tokens, eos)))
            for label in order:
                runs[label].append((r, i, _ours(decoders[label], p, args.max_new_tokens, eos)))
            print(f"pass {r + 1}/{args.repeats} prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{label} {_rate(runs[label][-1][2]) or 0:.1f}" for label in labels) + " tok/s",
                file=sys.stderr)
    report = _report(args, labels, runs, ours_ar, load0, len(prompts), peer.version, template)
    print(report["table"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump({k: v for k, v in report.items() if k != "table"}, f, indent=2)
    return 0


def _report(args, labels, runs, ours_ar, load0, n_prompts, version, template) -> dict:
    base = {(r, i): run for r, i, run in runs["llama.cpp ar"]}
    ar = {(r, i): run for r, i, run in runs[ours_ar]}
    rows = {}
    for label in labels:
        rates = [_rate(run) for _, _, run in runs[label]]
        paired = [(_rate(run) / _rate(base[(r, i)])) if _rate(run) and _rate(base[(r, i)])
                  else None for r, i, run in runs[label]]
        exact = [run["token_ids"] == ar[(r, i)]["token_ids"] for r, i, run in runs[label]]
        tokens = sum(len(run["token_ids"]) - 1 for _, _, run in runs[label])
        seconds = sum(run["decode_s"] for _, _, run in runs[label])
        rows[label] = {"median_tok_s": _median(rates),
                       "pooled_tok_s": tokens / seconds if seconds > 0 else None,
                       "median_ratio_vs_llama_cpp_ar": _median(paired),
                       "exact_vs_ar": sum(exact), "runs": len(exact),
                       "mean_prefix_with_ar": statistics.mean(
                           _common_prefix(run["token_ids"], ar[(r, i)]["token_ids"])
                           for r, i, run in runs[label]),
                       "mat": _median([run.get("mat") for _, _, run in runs[label]])}
    load1 = os.getloadavg()
    lines = [f"{n_prompts} prompts x {args.repeats} passes, {args.max_new_tokens} new tokens "
             f"at most, greedy, chat template {template}; llama-cpp-python {version}, "
             f"{args.threads} threads; load average {load0[0]:.2f} at the start, "
             f"{load1[0]:.2f} at the end",
             "",
             "| runtime, method | decode tok/s (median) | pooled tok/s | vs llama.cpp AR "
             "(paired median) | ids equal to our AR | MAT |",
             "| --- | --- | --- | --- | --- | --- |"]
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for label, row in rows.items():
        lines.append(f"| {label} | {num(row['median_tok_s'], '.1f')} | "
                     f"{num(row['pooled_tok_s'], '.1f')} | "
                     f"{num(row['median_ratio_vs_llama_cpp_ar'], '.2f')} | {row['exact_vs_ar']}/"
                     f"{row['runs']} (prefix {row['mean_prefix_with_ar']:.0f}) | "
                     f"{num(row['mat'], '.2f')} |")
    return {"settings": {**vars(args), "load_average": [load0, load1]}, "rows": rows,
            "table": "\n".join(lines)}


if __name__ == "__main__":
    sys.exit(main())
