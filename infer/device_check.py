"""One command that turns a few minutes on an accelerator into the numbers that matter.

    python -m infer.device_check --out runs/device_check      (GPU / TPU; see docs/distributed.md)
    python -m infer.device_check --allow-cpu --out runs/dc    (CPU: tiny sizes, a smoke test)

On the first device JAX sees (it refuses a CPU unless --allow-cpu):
  (a) SmolLM2-135M-Instruct (python -m infer.fetch_smollm2) with the committed sorted draft:
      AR / SD at each exit / S2D 0.5-0 / S2D calibrated on 24 Spec-Bench questions (4 per
      task), greedy and T = 1, as infer.bench runs them (tok/s, speedup, MAT, exactness,
      in-loop round costs): OUT/smollm2/report.{json,md}.
  (b) Vicuna-7B- and 13B-shaped targets with random bfloat16 weights and a 12-layer draft of
      the 7B's shape (exits 6/9/12): the target's verify call for windows 1..8 (1 = an AR
      step) and each exit's whole draft step, timed in jitted loops (bench/call_costs.py),
      each beside its bandwidth bound (the bytes a call must read, weights + KV cache once,
      roofline.call_bytes, over the device's memory bandwidth: its roofline.DEVICE_BANDWIDTH
      preset found from the device's name, or --bandwidth) and measured / bound;
      Lemma 3.1's predicted speedup at gamma 4 with (i) the SmolLM2 S2D run's measured
      MAT and (ii) --paper-mat, the MAT the paper reports (not built in: pass it); and
      XLA:GPU's two GEMM backends, Triton (its default) against cuBLAS
      (xla_gpu_enable_triton_gemm=false), given per compile: the 7B shape's verify call
      at windows 1 and gamma + 1 (compiled as the engine does, one-pass GEMMs) compiled
      again with cuBLAS and with XLA's split-K GEMMs, and its decode matmuls
      (every distinct weight shape, rows 1/5/8, bench/gemm_costs.py) compiled both ways:
      ms, GB/s, the faster, and which backend (and XLA flag) the measurements favour; the
      library's defaults stay as they are. On a CPU that part is "n/a on cpu": XLA's
      own dots are timed at rows 1/5, no cuBLAS verify call.
Progress goes to stdout; OUT/results.json and OUT/report.md are rewritten after every
measurement, so a run cut short leaves what it measured. --allow-cpu on a CPU runs the
demo family (1 question, 16 tokens, greedy, AR / SD at the deepest exit / S2D, gamma 1)
and tiny shapes (windows 1..2, gamma 1) instead: a smoke test in well under a minute of
CPU time, most of it XLA compiles.
  (c) with --train-minutes N: SoFT of the SmolLM2 sorted draft for N minutes on the device,
      its exits' held-out agreement with the target logged as it goes (s2d_jax/bench/device_train.py;
      --allow-cpu on a CPU: the demo family's smallest target, short rows).
The paper's MAT for (ii) is not in this repository and could not be retrieved here (S2D,
arXiv 2407.01955, reports it per target in its Spec-Bench tables): pass --paper-mat with
the values read from the paper; without it report.md says (ii) was not computed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from s2d_jax.cli.args import ArgumentParser, parse_targets
from s2d_jax.cli.flags import add
from s2d_jax.env import smollm2_dir
from s2d_jax.decode.methods import CALIBRATED, DEFAULT_GAMMA, PAPER_METHODS, has, methods_where
from s2d_jax.errors import S2DError, cli_main

CMD = "device-check"  # its s2d subcommand: the name its shared flags are defined for
from s2d_jax.io.outputs import DIR
from s2d_jax.bench.gemm_report import gemm_md


SHAPES = {"vicuna-7b": "configs/models/vicuna-7b-v1.5.yaml",
          "vicuna-13b": "configs/models/vicuna-13b-v1.5.yaml"}
DRAFT_SHAPE, DRAFT_EXITS = "configs/models/vicuna-7b-v1.5.yaml", (6, 9, 12)
# gamma of (a)'s speculative runs and of the Lemma 3.1 prediction, and the verify windows
# timed (1 = an AR step); the CPU smoke run (tiny: True) uses fewer: each window is a
# compile, and XLA:CPU compiles a gamma-4 decode loop of the demo models in ~5-9 s
GAMMA, WINDOWS = {False: DEFAULT_GAMMA, True: 1}, {False: 8, True: 2}
# rows of (b)'s decode matmuls (bench/gemm_costs.py): an AR step, a gamma-4 verify window,
# 8; the CPU smoke run two (each row count x shape is a compile)
GEMM_ROWS = {False: (1, 5, 8), True: (1, 5)}


def _parse(argv):
    p = ArgumentParser(prog="python -m infer.device_check", description=__doc__)
    add(p, "--out", CMD, kind=DIR, required=True)
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on a CPU (tiny sizes: a smoke test, not a measurement)")
    p.add_argument("--paper-mat", default=None, metavar="vicuna-7b=L,vicuna-13b=L",
                   help="the paper's reported mean accepted tokens per target shape, for "
                        "prediction (ii)")
    p.add_argument("--samples", type=int, default=3, help="timed trials per probe")
    p.add_argument("--family", choices=("smollm2", "demo"), default="smollm2",
                   help="(a)'s models: SmolLM2 (fetched first) or the shipped demo family's "
                        "largest target and its draft, for a machine the SmolLM2 weights "
                        "cannot reach (no network, or a 64 MiB transfer); --allow-cpu on a CPU "
                        "always runs the demo family, tiny")
    p.add_argument("--parts", default="a,b", metavar="a,b",
                   help="which of (a) the benchmark and (b) the shaped call costs to run, in "
                        "the order given (b,a: the call costs first, for a short lease)")
    p.add_argument("--windows", type=int, default=None, metavar="N",
                   help=f"(b) times verify windows 1..N (default {WINDOWS[False]}; "
                        f"{WINDOWS[True]} with --allow-cpu on a CPU); at least gamma + 1")
    add(p, "--bandwidth", CMD)
    add(p, "--train-minutes", "device-check")
    return p.parse_args(argv)


class Results:
    """results.json + report.md under OUT, rewritten after every measurement."""

    def __init__(self, out: str, device: str, platform: str = "cpu", bandwidth=None):
        self.out, self.data = out, {"device": device, "platform": platform,
                                    "bandwidth": bandwidth or {"bytes_per_s": None,
                                                               "source": None},
                                    "smollm2": None, "shapes": {}, "gemm": None,
                                    "train": None}
        os.makedirs(out, exist_ok=True)

    def save(self) -> None:
        from s2d_jax.io.atomic import write_atomic
        write_atomic(os.path.join(self.out, "results.json"), json.dumps(self.data, indent=1))
        write_atomic(os.path.join(self.out, "report.md"), report_md(self.data))


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.3f}"


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _ratio(x):
    return "-" if x is None else f"{x:.2f}x"


# device_kind of a real GPU -> its roofline.DEVICE_BANDWIDTH preset, where the name says
# which part it is (topology.CHIPS first: the TPUs and the H100 SXM); an H100 PCIe / NVL
# or an A100 PCIe has other bandwidths than the presets: --bandwidth
GPU_PRESETS = (("H200", "h200-141gb"), ("H100 80GB HBM3", "h100-80gb"),
               ("A100-SXM4-80GB", "a100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
               ("NVIDIA L4", "l4-24gb"))


def device_bandwidth(device_kind: str, gbps: float | None) -> dict:
    """{"bytes_per_s", "source"} of the device: --bandwidth (GB/s), else the preset its
    name maps to; bytes_per_s None where neither (a CPU, an unlisted GPU)."""
    from s2d_jax.decode.roofline import DEVICE_BANDWIDTH
    from s2d_jax.parallel.topology import CHIPS
    if gbps is not None:
        return {"bytes_per_s": gbps * 1e9, "source": f"--bandwidth {gbps:g} GB/s"}
    preset = CHIPS.get(device_kind) or next(
        (p for mark, p in GPU_PRESETS if mark in device_kind), None)
    if preset in DEVICE_BANDWIDTH:
        return {"bytes_per_s": DEVICE_BANDWIDTH[preset],
                "source": f"the {preset} preset's datasheet figure (s2d_jax/decode/roofline.py)"}
    return {"bytes_per_s": None, "source": f"no bandwidth known for {device_kind!r}: pass "
                                           f"--bandwidth GB/s for the bounds"}


def _bandwidth_line(bw: dict) -> str:
    if bw["bytes_per_s"] is None:
        return f"Bounds: none ({bw['source']})."
    return (f"Bounds at {bw['bytes_per_s'] / 1e12:.3g} TB/s ({bw['source']}): the bytes a "
            f"call must read (every weight and the whole KV cache, once) over the bandwidth; "
            f"a LOWER BOUND on its time, measured / bound >= 1.")


def report_md(d: dict) -> str:
    lines = [f"# Device check\n\nDevice: **{d['device']}**\n"]
    s = d.get("smollm2")
    if s:
        lines += [f"## (a) {s['target']} on {s['prompts']} questions\n",
                  "| T | method | tok/s | speedup | MAT | exact vs AR |", "|---|---|---|---|---|---|"]
        for t, methods in s["results"].items():
            for label, m in methods.items():
                f = lambda k, fmt: "-" if m.get(k) is None else fmt.format(m[k])  # noqa: E731
                lines.append(f"| {t} | {label} | {f('tokens_per_second', '{:.1f}')} | "
                             f"{f('speedup_vs_ar', '{:.2f}x')} | "
                             f"{f('mean_accepted_tokens', '{:.2f}')} | "
                             f"{f('exact_match_vs_ar', '{:.2f}')} |")
        lines.append(f"\nFull report (round costs, per task): {s['report']}\n")
    bw = d.get("bandwidth") or {"bytes_per_s": None, "source": "-"}
    for name, r in d["shapes"].items():
        b = r.get("bound") or {}
        gb = (f"A verify call reads {_bytes(b['verify_bytes'])} (weights + KV cache). "
              if b.get("verify_bytes") else "")
        lines += [f"## (b) {name}-shaped target, random bf16 weights, 12-layer draft\n",
                  f"{gb}{_bandwidth_line(bw)}\n",
                  "| call | ms | bound ms | measured / bound |", "|---|---|---|---|"]
        vb, db = b.get("verify_s"), b.get("draft_step_s") or {}
        ratio = lambda c, lo: None if c is None or not lo else c / lo  # noqa: E731
        lines += [f"| target verify, window {w}{' (AR step)' if str(w) == '1' else ''} | "
                  f"{_ms(c)} | {_ms(vb)} | {_ratio(ratio(c, vb))} |"
                  for w, c in r["verify_s"].items()]
        lines += [f"| draft step, exit {e} | {_ms(c)} | {_ms(db.get(e))} | "
                  f"{_ratio(ratio(c, db.get(e)))} |" for e, c in r["draft_step_s"].items()]
        for p in r.get("predictions", []):
            lines.append(f"\nLemma 3.1, gamma {p['gamma']}, exit {p['exit']}, MAT {p['mat']:.2f} "
                         f"({p['source']}): predicted speedup **{p['speedup']:.2f}x**")
        if not any("paper" in p["source"] for p in r.get("predictions", [])):
            lines.append("\n(ii) with the paper's MAT not computed: pass --paper-mat (the "
                         "values of S2D's Spec-Bench tables, arXiv 2407.01955).")
        lines.append("")
    g = d.get("gemm")
    shape = d["shapes"].get(g["model"]) if g else None
    return "\n".join(lines + gemm_md(g, bw, shape) + train_md(d.get("train"))) + "\n"


def train_md(t: dict | None) -> list[str]:
    """(c)'s table: held-out agreement per exit as training went."""
    if not t:
        return []
    exits = [str(e) for e in t["exits"]]
    lines = [f"## (c) SoFT of the sorted draft, {t['steps']} steps in {t['seconds']:.0f} s "
             f"({t['tokens_per_s'] or 0:.0f} tokens/s)\n",
             "| step | s | loss | " + " | ".join(f"agreement exit {e}" for e in exits) + " |",
             "|---|---|---|" + "---|" * len(exits)]
    for r in t["log"]:
        loss = "-" if r["loss"] is None else f"{r['loss']:.3f}"
        lines.append(f"| {r['step']} | {r['seconds']:.0f} | {loss} | "
                     + " | ".join(f"{r['agreement'][e]:.3f}" for e in exits) + " |")
    return lines + [""]


def run_bench(target: str, draft: str, questions: str, max_prompts: int, max_new_tokens: int,
              kinds: list[str], temps: list[float], template: str, cost_every: int,
              gamma: int | None = None, sd_exits: str = "each") -> dict:
    """The Spec-Bench-style run of infer.bench on one target, through the library
    (s2d_jax.bench.runner): every method interleaved per prompt, in-loop round costs
    sampled every `cost_every` prompts -> infer.bench's report entry of the target."""
    from s2d_jax.bench import runner
    from s2d_jax.data.prompts import read_questions, resolve_template
    from s2d_jax.decode.defaults import buffer_len, draft_exits, prompt_width
    from s2d_jax.decode.serving_config import load_serving_config
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.checkpoint import load_draft
    from s2d_jax.io.tokenizer import load_tokenizer

    qs = read_questions(questions, None, max_prompts)
    tok = load_tokenizer(target)
    turns = runner.Conversations(tok, resolve_template(tok, template)[0], qs,
                                 max_new_tokens)
    cfg, params, _ = load_model(target, dtype="float32")  # as infer.bench by default
    d_cfg, d_params, extra = load_draft(draft, target, dtype="float32")
    exits = draft_exits(extra, d_cfg)
    specs, notes = runner.method_specs(kinds, exits, None, gamma, load_serving_config(target))
    if sd_exits == "deepest":  # each method is a compile of its own decode loop
        specs = [s for s in specs if not has(s.method, single_exit=True, self_draft=False)
                 or s.exits == (exits[-1],)]
    width = prompt_width(turns.longest)
    g_max = max(s.gamma for s in specs)
    max_len = buffer_len(width, max_new_tokens, g_max + 1, min(cfg.max_position_embeddings,
                                                                d_cfg.max_position_embeddings))
    decoders = runner.build_decoders(specs, cfg, params, d_cfg, d_params, prompt_width=width,
                                     tokenizer=tok)
    probes = runner.cost_probes(decoders, specs, turns.first_prompts[0], temperatures=temps,
                                max_len=max_len)
    done = [0]

    def between():  # the first prompt always samples: costs exist
        done[0] += 1
        if (done[0] - 1) % cost_every == 0:
            runner.sample_probes(probes)
    runs = runner.run_target(decoders, turns.first_prompts, temperatures=temps,
                             max_new_tokens=max_new_tokens, max_len=max_len,
                             eos_id=turns.eos_id, between=between,
                             next_turn=turns.next_prompt(width))
    try:
        costs = runner.measure_costs(probes)
    except S2DError as e:  # a machine too noisy to time them: the runs stay valid
        costs = None
        notes.append(f"predicted speedups omitted, the round costs could not be timed ({e})")
    cats = [qs[i]["task"] for i, _ in runs["items"]]
    return {"results": runner.summarize_target(runs["runs"], cats, specs, costs),
            "costs": costs, "compile_seconds": runs["compile_seconds"], "notes": notes,
            "prompts": len(qs)}


def check_smollm2(args, res: Results, tiny: bool) -> None:
    """(a): the benchmark on SmolLM2 (or the demo family with --allow-cpu on a CPU)."""
    from s2d_jax.bench.report import markdown_table
    from s2d_jax.io.atomic import write_atomic
    out = os.path.join(args.out, "smollm2")
    if tiny or args.family == "demo":
        target, draft = "models/demo/target-s" if tiny else "models/demo/target-l", "models/demo/draft"
        # SD at the deepest exit only: the CPU compiles each method's decode loop in 3-9 s
        run = dict(questions="data/demo_questions.jsonl", max_prompts=1, max_new_tokens=16,
                   template="none", kinds=list(PAPER_METHODS), temps=[0.0], cost_every=1,
                   sd_exits="deepest")
        if not tiny:  # the demo family on an accelerator: every question, every method
            run.update(max_prompts=40, max_new_tokens=64, temps=[0.0, 1.0], cost_every=8,
                       sd_exits="each", kinds=[*PAPER_METHODS, PAPER_METHODS[-1] + CALIBRATED,
                                               *methods_where(lookup=True)])
    else:
        if not os.path.isdir(smollm2_dir()):
            raise S2DError(f"{smollm2_dir()} is missing; run python -m infer.fetch_smollm2 first")
        target, draft = smollm2_dir(), "models/smollm2-draft"
        run = dict(questions="data/spec_bench_question.jsonl", max_prompts=24,
                   max_new_tokens=128, template="auto",
                   kinds=[*PAPER_METHODS, PAPER_METHODS[-1] + CALIBRATED],
                   temps=[0.0, 1.0], cost_every=8)
    entry = run_bench(target, draft, **run, gamma=GAMMA[tiny])
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "report.json"), json.dumps(entry, indent=1))
    write_atomic(os.path.join(out, "report.md"), markdown_table(
        {"targets": {"t": entry}, "notes": entry["notes"]}))
    results = {t: {label: {k: m.get(k) for k in ("method", "tokens_per_second", "speedup_vs_ar",
                                                 "mean_accepted_tokens", "exact_match_vs_ar")}
                   for label, m in methods.items()}
               for t, methods in entry["results"].items()}
    res.data["smollm2"] = {"target": target, "prompts": entry["prompts"],
                           "results": results, "report": os.path.join(out, "report.md")}
    res.save()


def _shape_cfgs(tiny: bool):
    from s2d_jax.config import ModelConfig, load_model_config
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    if tiny:
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                          num_heads=4, num_kv_heads=2, max_position_embeddings=512, **bf16)
        return {"tiny": cfg}, dataclasses.replace(cfg, num_layers=3), (1, 2, 3)
    cfgs = {n: dataclasses.replace(load_model_config(p), **bf16) for n, p in SHAPES.items()}
    draft = dataclasses.replace(load_model_config(DRAFT_SHAPE), num_layers=DRAFT_EXITS[-1], **bf16)
    return cfgs, draft, DRAFT_EXITS


def _random_params(cfg, seed: int, tiny: bool) -> dict:
    """Random weights to time calls with (their values do not matter): init_params on the
    device, or for the tiny shapes numpy draws (XLA:CPU compiles init_params in ~7 s)."""
    import jax
    import numpy as np

    from s2d_jax.model import transformer as model
    if not tiny:
        return model.init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.02, a.shape).astype(a.dtype)),
                        model.abstract_params(cfg))


def _lemma_speedup(verify_s: dict, step_s: float, mat: float, gamma: int) -> float:
    """Lemma 3.1, n = 2: AR costs V(1) per token; a round of gamma draft steps and one
    verify of gamma + 1 tokens yields `mat` tokens."""
    from s2d_jax.bench import theory
    per_token = theory.chain_time_per_token([verify_s[gamma + 1], step_s], [mat], gamma)
    return verify_s[1] / per_token


def _bounds(cfg, draft_cfg, exits, max_len: int, bandwidth: float | None) -> dict:
    """Bytes a verify call of `cfg` and a draft step stopping at each exit must read
    (roofline.call_bytes: every weight, the embedding only where it is the head, and the
    whole cache of those layers, once) and, with a bandwidth, those bytes' time."""
    from s2d_jax.decode.roofline import call_bytes
    verify = call_bytes(cfg, 1, max_len)
    draft = {e: call_bytes(dataclasses.replace(draft_cfg, num_layers=e), 1, max_len)
             for e in exits}
    t = (lambda n: n / bandwidth) if bandwidth else (lambda n: None)
    return {"verify_bytes": verify, "draft_step_bytes": draft, "verify_s": t(verify),
            "draft_step_s": {e: t(n) for e, n in draft.items()}}


def _vs_bound(measured: float, bound: float | None) -> str:
    if bound is None:
        return "(no bound: no bandwidth)"
    return f"(bound {1e3 * bound:.3f} ms, measured/bound {measured / bound:.2f}x)"


def check_shapes(args, res: Results, tiny: bool, paper_mat: dict) -> None:
    """(b): per-call costs of 7B/13B-shaped targets and the 12-layer draft, random weights,
    beside their bandwidth bounds; then the first shape's decode matmuls under each GEMM
    backend (check_gemms)."""
    from s2d_jax.bench.call_costs import draft_step_probes, verify_probe

    from s2d_jax.decode.engine import GPU_COMPILER_OPTIONS
    cfgs, draft_cfg, exits = _shape_cfgs(tiny)
    # the verify calls as the engine compiles them: one-pass GEMMs on a GPU
    default_options = GPU_COMPILER_OPTIONS if res.data["platform"] == "gpu" else None
    max_len, start = (256, 64) if tiny else (2048, 512)
    bandwidth = res.data["bandwidth"]["bytes_per_s"]
    print(_bandwidth_line(res.data["bandwidth"]), flush=True)
    draft = _random_params(draft_cfg, 1, tiny)
    steps = draft_step_probes(draft, draft_cfg, exits, start=start, max_len=max_len)
    for p in steps:
        for _ in range(args.samples):
            p.sample()
    step_s = {e: p.result() for e, p in zip(exits, steps)}
    del draft, steps
    print(f"draft steps (ms): {[round(1e3 * c, 3) for c in step_s.values()]}", flush=True)
    for i, (name, cfg) in enumerate(cfgs.items()):
        bound = _bounds(cfg, draft_cfg, exits, max_len, bandwidth)
        if i == 0:
            for e, c in step_s.items():
                print(f"draft step, exit {e}: {1e3 * c:.3f} ms "
                      f"{_vs_bound(c, bound['draft_step_s'][e])}", flush=True)
        print(f"{name}: a verify call reads {_bytes(bound['verify_bytes'])} (weights + KV "
              f"cache of {max_len})", flush=True)
        params = _random_params(cfg, 0, tiny)
        entry = res.data["shapes"][name] = {"verify_s": {}, "draft_step_s": step_s,
                                            "bound": bound, "vs_bound": {}}
        for w in range(1, (args.windows or WINDOWS[tiny]) + 1):
            probe = verify_probe(params, cfg, window=1, block=w - 1, start=start,
                                 max_len=max_len, compiler_options=default_options)
            for _ in range(args.samples):
                probe.sample()
            c = entry["verify_s"][w] = probe.result()
            entry["vs_bound"][w] = c / bound["verify_s"] if bound["verify_s"] else None
            print(f"{name}: verify window {w}{' (AR step)' if w == 1 else ''}: {1e3 * c:.3f} "
                  f"ms {_vs_bound(c, bound['verify_s'])}", flush=True)
            res.save()
        if i == 0:
            _verify_cublas(args, res, entry, name, params, cfg, start, max_len, tiny)
        entry["predictions"] = _predictions(res, entry, name, exits, paper_mat, GAMMA[tiny])
        res.save()
        del params, probe
        if i == 0:  # the 7B shape's matmuls, its weights freed first
            check_gemms(args, res, name, cfg, tiny, entry.get("verify_by_backend"))


def _verify_cublas(args, res: Results, entry: dict, name: str, params, cfg, start: int,
                   max_len: int, tiny: bool) -> None:
    """The model-level GEMM comparison: the AR step and the gamma + 1 verify window
    compiled again with cuBLAS (xla_gpu_enable_triton_gemm=false) and with XLA's split-K
    (no engine.GPU_COMPILER_OPTIONS: few-row GEMMs split their contraction and write f32
    partial sums, ~15% more bytes, for more thread blocks) beside the default's times above
    (Triton, one pass over each weight, as the engine compiles decode programs): what each
    choice does to the model's own program. GPU only."""
    from s2d_jax.bench import gemm_costs
    from s2d_jax.bench.call_costs import verify_probe
    from s2d_jax.decode.engine import GPU_COMPILER_OPTIONS
    platform = res.data["platform"]
    if platform != "gpu":
        print(f"{name}: verify with cuBLAS ({gemm_costs.TRITON_FLAG}=false) and with split-K: "
              f"n/a on {platform}", flush=True)
        return
    variants = {"cublas": {**GPU_COMPILER_OPTIONS, **gemm_costs.BACKENDS["cublas"]},
                "split-k": {"xla_gpu_experimental_force_split_k": 0}}
    by = entry["verify_by_backend"] = {"triton": {}, **{v: {} for v in variants}}
    for w in sorted({1, GAMMA[tiny] + 1} & set(entry["verify_s"])):
        by["triton"][w] = entry["verify_s"][w]
        for variant, options in variants.items():
            probe = verify_probe(params, cfg, window=1, block=w - 1, start=start,
                                 max_len=max_len, compiler_options=options)
            for _ in range(args.samples):
                probe.sample()
            by[variant][w] = probe.result()
            del probe
        print(f"{name}: verify window {w}: cuBLAS ({gemm_costs.TRITON_FLAG}=false) "
              f"{1e3 * by['cublas'][w]:.3f} ms, Triton with split-K "
              f"{1e3 * by['split-k'][w]:.3f} ms (default, Triton in one pass: "
              f"{1e3 * by['triton'][w]:.3f} ms)", flush=True)
        res.save()


def check_gemms(args, res: Results, name: str, cfg, tiny: bool,
                verify: dict | None = None) -> None:
    """(b), GEMM backends: `cfg`'s decode matmuls compiled with XLA:GPU's Triton GEMM and
    with cuBLAS (bench/gemm_costs.py); on a CPU XLA's own dots alone ("n/a on cpu")."""
    from s2d_jax.bench import gemm_costs

    def saved(entry):
        res.data["gemm"] = {"model": name, **entry}
        res.save()
    platform = res.data["platform"]
    if platform != "gpu":
        print(f"gemm: triton vs cublas n/a on {platform} ({gemm_costs.TRITON_FLAG} is an "
              f"XLA:GPU flag); timing XLA's own dots", flush=True)
    entry = gemm_costs.time_gemms(cfg, platform, args.samples, GEMM_ROWS[tiny], on_host=tiny,
                                  progress=lambda m: print(m, flush=True), saved=saved,
                                  verify=verify)
    c = entry["choice"]
    print(f"gemm default for the decode shapes: {c['default'] or '-'}: {c['why']}"
          + (f"; set XLA_FLAGS={c['xla_flags']}" if c["xla_flags"] else ""), flush=True)


def _predictions(res: Results, entry: dict, name: str, exits, paper_mat: dict,
                 gamma: int) -> list:
    mats = []
    s = res.data.get("smollm2")
    greedy = s["results"].get("0.0", {}) if s else {}
    # the paper-setting S2D run's measured MAT (greedy): the draft's acceptance on a real target
    m = [r["mean_accepted_tokens"] for label, r in greedy.items()
         if has(r["method"], escalates=True, lookup=False) and not label.endswith(CALIBRATED)
         and r["mean_accepted_tokens"]]
    if m:
        mats.append((m[0], f"measured on {s['target']}, S2D 0.5-0 greedy"))
    if name in paper_mat:
        mats.append((paper_mat[name], "the paper's reported MAT (--paper-mat)"))
    return [{"exit": e, "mat": mat, "source": src, "gamma": gamma,
             "speedup": _lemma_speedup(entry["verify_s"], entry["draft_step_s"][e], mat, gamma)}
            for mat, src in mats for e in exits]


def _paper_mat(text: str) -> dict[str, float]:
    """"vicuna-7b=3.1,vicuna-13b=3.2" -> {shape: MAT >= 1}; unknown shapes and bad
    numbers (NaN and inf included) are errors."""
    out = {}
    for name, value in parse_targets(text.split(","), "--paper-mat").items():
        try:
            mat = float(value)
        except ValueError:
            mat = float("nan")
        if name not in SHAPES or not 1.0 <= mat < float("inf"):
            raise S2DError(f"--paper-mat {name}={value}: need one of {', '.join(SHAPES)} "
                           f"= a mean accepted token count >= 1")
        out[name] = mat
    return out


@cli_main
def main(argv=None):
    args = _parse(argv)
    paper_mat = _paper_mat(args.paper_mat) if args.paper_mat else {}
    if args.samples < 1:
        raise S2DError(f"--samples must be >= 1, got {args.samples}")
    args.parts = [x.strip() for x in args.parts.split(",")]
    if not args.parts or any(x not in ("a", "b") for x in args.parts) \
            or len(set(args.parts)) != len(args.parts):
        raise S2DError(f"--parts must list a and/or b once each (e.g. a,b or b,a), got "
                       f"{','.join(args.parts)!r}")
    if args.windows is not None and args.windows < max(GAMMA.values()) + 1:
        raise S2DError(f"--windows must be >= {max(GAMMA.values()) + 1} (gamma + 1: the "
                       f"prediction's verify window), got {args.windows}")
    if args.train_minutes is not None and not args.train_minutes > 0:
        raise S2DError(f"--train-minutes must be > 0, got {args.train_minutes}")
    if args.bandwidth is not None and not args.bandwidth > 0:
        raise S2DError(f"--bandwidth must be a positive number of GB/s, got {args.bandwidth}")
    import jax
    dev = jax.devices()[0]
    tiny = dev.platform == "cpu"
    if tiny and not args.allow_cpu:
        raise S2DError("no accelerator: jax.devices() shows only a CPU; install "
                       "'.[cuda]' or '.[tpu]' on a GPU/TPU machine, or pass --allow-cpu for "
                       "the tiny smoke test")
    device = f"{dev.device_kind} ({dev.platform}, {len(jax.devices())} device(s))"
    print(f"device: {device}", flush=True)
    bandwidth = device_bandwidth(dev.device_kind, args.bandwidth)
    from s2d_jax.io.atomic import files_dir
    with files_dir(args.out, args.s2d_prog):  # marked as this tool's; no empty dir on failure
        # XLA:GPU's devices say "gpu" (a CUDA or ROCm plugin's backend name: cuda / rocm)
        platform = "gpu" if dev.platform in ("gpu", "cuda", "rocm") else dev.platform
        return _run(args, device, tiny, paper_mat, platform, bandwidth)


def _run(args, device: str, tiny: bool, paper_mat: dict, platform: str = "cpu",
         bandwidth: dict | None = None) -> int:
    res = Results(args.out, device, platform, bandwidth)
    res.save()
    t0 = time.perf_counter()
    for part in args.parts:
        if part == "a":
            check_smollm2(args, res, tiny)
        else:
            check_shapes(args, res, tiny, paper_mat)
        print(f"({part}) done after {time.perf_counter() - t0:.0f} s", flush=True)
    if args.train_minutes:
        check_training(args, res, tiny)
        print(f"(c) done after {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"report: {args.out}/report.md", flush=True)
    return 0


def check_training(args, res: Results, tiny: bool) -> None:
    """(c): the draft's SoFT for --train-minutes on the device (s2d_jax/bench/device_train.py)."""
    from s2d_jax.bench.device_train import train_for
    target, heldout = (("models/demo/target-s", "data/demo_questions.jsonl") if tiny else
                       (smollm2_dir(), "data/smollm2_calibration.jsonl"))
    res.data["train"] = train_for(target, args.train_minutes, heldout, tiny,
                                  lambda m: print(m, flush=True))
    res.save()


if __name__ == "__main__":
    main()
