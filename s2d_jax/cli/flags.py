"""One definition of every flag that two commands share (issue 44): its name, type,
default, help, choices, nargs and metavar are written once here, and each command adds it
with one call, `add(parser, "--gamma", "bench")` (the command: its `s2d` subcommand name,
s2d_jax/cli/main.py SUBCOMMANDS). The rule tests/test_shared_flags.py enforces: one name,
one definition. Where a command must differ (a default that suits it, a flag it repeats),
the difference is written here as a `Variant` of that command with the reason, so it is
declared, not drifted into; a command with no variant gets the definition as is.

Flags that only one command has stay in that command's parser. A name that two commands
used for different things was split (docs/cli.md "Shared flags"): a model is `--target` /
`--draft` everywhere, the shapes aot compiles from `--target-config` / `--draft-config`;
`--out` is always a directory, a single output file `--out-file`; Spec-Bench questions are
`--questions` everywhere.
"""

from __future__ import annotations

import dataclasses

from s2d_jax.cli import args as cli_args
from s2d_jax.config import DTYPES
from s2d_jax.data.prompt_pool import DOCUMENT_FILES, TRAINING_FILES
from s2d_jax.data.prompts import TEMPLATES
from s2d_jax.decode.defaults import DEFAULT_MAX_NEW_TOKENS
from s2d_jax.decode.methods import AUTO, CHOICES, METHODS

# the argparse keywords a definition fixes (what the test compares); the rest of a call,
# (required, an input's `paths`, an output's kind and overwrite switch), is the command's
DEFINED = ("type", "default", "help", "choices", "nargs", "metavar", "action")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A command's declared difference from a definition: `why` it differs, and the
    keywords it sets instead."""
    why: str
    kw: dict


def variant(why: str, **kw) -> Variant:
    assert why and set(kw) <= set(DEFINED), kw
    return Variant(why, kw)


@dataclasses.dataclass(frozen=True)
class Flag:
    kw: dict                  # argparse keywords of DEFINED
    role: str = ""            # "input" (add_input), "output" (add_output) or "" (a setting)
    variants: dict = dataclasses.field(default_factory=dict)  # command -> Variant

    def keywords(self, command: str) -> dict:
        v = self.variants.get(command)
        return {**self.kw, **(v.kw if v else {})}


def _flag(role="", variants=None, **kw) -> Flag:
    assert set(kw) <= set(DEFINED), kw
    return Flag(kw, role, dict(variants or {}))


def _each(commands: str, v: Variant) -> dict:
    return {c: v for c in commands.split()}


TARGET_NAME = "a path or a name (smollm2: found from any directory)"
_CAL = "the target's calibrated s2d_serving.json"
_SEVERAL_TARGETS = variant(
    "these commands take several targets: bench compares them, generate routes each prompt "
    "to the one its 'target' field names",
    type=str, nargs="+", metavar="[NAME=]MODEL",
    help=f"the target model(s): HF dirs, params checkpoints or .gguf files, each "
         f"{TARGET_NAME}; NAME= names one (default: the dir's name)")
_NAMED_TARGET = variant(
    "calibration reports and settings name the target (NAME=, default the dir's name)",
    type=str, metavar="[NAME=]MODEL",
    help=f"the target model: an HF dir, params checkpoint or .gguf, {TARGET_NAME}; NAME= names it")
_SMOLLM2_PIPELINE = variant("these pipelines train and study SmolLM2's draft",
                            default="smollm2")
_SHAPES_ONLY = ("aot compiles a model's shapes and reads none of its weights, so a model YAML "
                "or a config.json names a model as well as a dir does")

FLAGS: dict[str, Flag] = {
    # --- models ------------------------------------------------------------------------
    "--target": _flag(
        "input", type=cli_args.model_arg, metavar="MODEL", default=None,
        help=f"the target model: an HF dir, params checkpoint or .gguf, {TARGET_NAME}",
        variants={**_each("generate bench", _SEVERAL_TARGETS),
                  **_each("calibrate calibrate-lookup", _NAMED_TARGET),
                  **_each("train-smollm2-draft data-engine scaling-study corpus-generate", _SMOLLM2_PIPELINE),
                  "aot": variant(_SHAPES_ONLY, type=cli_args.model_or_input_arg, help=(
                      f"the target whose shapes are compiled: an HF dir, a model YAML "
                      f"(configs/models/*.yaml) or a config.json, {TARGET_NAME}; as "
                      f"--target-config"))}),
    "--draft": _flag(
        "input", type=cli_args.model_arg, metavar="MODEL", default=None,
        help="the sorted draft: a draft pack or model dir, a path or a name (smollm2-draft: "
             "found from any directory); sd, s2d and ladder need one",
        variants={"agreement": variant("agreement compares several drafts on the same answers",
                                       action="append",
                                       help="a sorted draft: a draft pack or model dir, a "
                                            "path or a name (smollm2-draft); repeat to "
                                            "compare drafts"),
                  "aot": variant(_SHAPES_ONLY, type=cli_args.model_or_input_arg, help=(
                      "the draft whose shapes are compiled (its first --draft-layers "
                      "layers): a draft pack or model dir, a model YAML or a config.json, a "
                      "path or a name (smollm2-draft); as --draft-config"))}),
    "--target-config": _flag(
        "input", default=None,
        help="the shapes to compile for: a model YAML (configs/models/*.yaml), an HF dir or a "
             "config.json (train-aot: default the training config's model.path)"),
    "--tokenizer": _flag(
        "input", default=None, metavar="DIR",
        help="the tokenizer's dir (default: the model's own; convert copies its files into "
             "--out)"),
    "--dtype": _flag(
        default=None, choices=DTYPES,
        help="cast the weights to this dtype (default: as stored); a command that decodes "
             "computes in it",
        variants={"fetch": variant("the HF dir fetch writes is what the other commands read "
                                   "'as stored'; float32 keeps the GGUF's weights exact",
                                   default="float32")}),
    "--weights": _flag(
        default=None, choices=("int8",),
        help="store the target's decoder matrices and LM head as int8 with one float32 "
             "scale per output channel (model/quantize.py; its embedding and norms, the "
             "draft and the activations keep --dtype) and compile for those bytes "
             "(default: every weight in --dtype)",
        variants={"convert": variant(
            "a draft pack stores its layer matrices int8 unless asked not to",
            choices=("int8", "bfloat16"), default="int8",
            help="storage of the draft's layer matrices (default int8, one scale per output "
                 "channel)"),
                  "tpu-fits": variant(
            "its table sets weight formats side by side", default="bfloat16", choices=None,
            metavar="W,W", help="the targets' weight formats, comma-separated: bfloat16 "
                                "and/or int8 (rows of target 'NAME int8': its decoder "
                                "matrices and head int8 with per-channel scales)")}),
    # --- what to decode, and how --------------------------------------------------------
    "--method": _flag(
        default=AUTO, choices=CHOICES,
        help="auto: the method the target's calibration chose among those it ran side by "
             "side (python -m infer.calibrate_lookup), else s2d; s2d: the sorted draft, escalating over its "
             "exits; sd: one draft exit (--exit); self: the target's first --exit layers "
             "draft; lookup: tokens copied from the context; ladder: lookup, then s2d; ar: "
             "no speculation",
        variants={"aot": variant("aot compiles one method's programs from shapes; it "
                                 "measures nothing to choose with", default="s2d",
                                 choices=METHODS, help="the method whose programs are "
                                 "compiled: s2d, sd, self, lookup, ladder or ar")}),
    "--exit": _flag(
        type=int, default=None, metavar="N",
        help="draft depth in layers: sd's draft exit (default: the draft's depth) and the "
             "target layers self drafts with (generate, chat: self needs it; bench: default "
             "the draft's deepest exit)"),
    "--exits": _flag(
        default=None, metavar="E,E,...",
        help=f"the draft exits s2d escalates over, e.g. 2,4 (default: {_CAL}'s where it fits "
             f"the draft, else the draft's s2d_exits, else its depth; generate with several "
             f"targets: the draft's)"),
    "--thresholds": _flag(
        default=None, metavar="T,T,...",
        help=f"one confidence threshold per exit in [0,1], e.g. 0.6,0.4,0 (default: {_CAL}'s "
             f"when the exits are its exits, else the paper's: 0.5 each, 0 at the last)"),
    "--gamma": _flag(
        type=int, default=None,
        help=f"draft tokens per round (default: {_CAL}'s for s2d, else 4)",
        variants={"bench": variant("bench measures the methods at one gamma; its -cal "
                                   "methods are the calibrated settings",
                                   help="draft tokens per round (default: 4; the -cal "
                                        "methods: calibrated)")}),
    "--mu": _flag(
        default=None, metavar="M[,M...]",
        help="polybasic chains: accumulation length per intermediate, e.g. 4 or 4,8 "
             "(default: gamma each)"),
    "--quant-group": _flag(type=int, default=64, help="int4 group size (rows)"),
    "--chat-template": _flag(
        default="auto", choices=TEMPLATES,
        help="auto: the tokenizer's own template, else the text as is (none), as in the "
             "Python API; vicuna: Vicuna v1.1's"),
    "--max-new-tokens": _flag(
        type=int, default=DEFAULT_MAX_NEW_TOKENS, help="new tokens per answer at most",
        variants={
            "agreement": variant("teacher-forced agreement needs a few answer tokens per "
                                 "prompt, not whole answers", default=64),
            **_each("train-smollm2-draft data-engine corpus-generate",
                    variant("training answers must be whole answers; SmolLM2's GSM8K "
                            "answers fit in 192 tokens", default=192)),
            "bench-answers": variant("it times batched generation; short answers keep a run "
                                     "short", default=32)}),
    "--temperature": _flag(type=float, default=0.0, help="sampling temperature (0 = greedy)"),
    "--top-p": _flag(type=float, default=1.0, help="nucleus sampling mass (1 = off)"),
    "--top-k": _flag(type=int, default=0, help="sample among the k likeliest (0 = off)"),
    "--seed": _flag(type=int, default=0,
                    help="random seed of sampling (data-engine: also of the prompt draw)"),
    "--batch-size": _flag(
        type=int, default=1,
        help="rows (prompts, or training sequences) per batch",
        # data-engine: SmolLM2-135M's answers on the shared 2-core CPU (python -m
        # train.bench_answers, answer tokens/s at batch 8 / 16 / 32): 62.5 / 60.1 / 76.4
        # with 64-token answers, 58.7 / 45.8 / 41.1 with 32-token ones (the larger batch
        # pays off on longer answers; answers run to 192). Rerun it on another machine (an
        # accelerator takes far larger batches).
        variants={"data-engine": variant("the engine answers thousands of prompts; 32 was "
                                         "the fastest batch measured (train.bench_answers)",
                                         default=32),
                  "bench-step": variant("it times a training step at a typical batch",
                                        default=4),
                  "corpus-generate": variant("a batch is a committed shard: as the data "
                                             "engine's batch (train.bench_answers)", default=32,
                                             help="prompts per shard (one generation batch "
                                                  "per temperature)")}),
    "--temperatures": _flag(
        default="0,1", metavar="T,T,...",
        help="comma-separated sampling temperatures (0 = greedy)"),
    "--batch-sizes": _flag(
        default="1", metavar="B,B,...", help="batch sizes, comma-separated, e.g. 1,8",
        variants={"tpu-fits": variant("its table compares single prompts with batches",
                                      default="1,8"),
                  "bench-answers": variant("it times the data engine's generation batches",
                                           default="8,16,32")}),
    "--mesh": _flag(
        default=None, metavar="AXIS=N,...",
        help="shard over devices, e.g. tensor=8 or data=2,tensor=4 (the product = the device "
             "count; default: one device)",
        variants={"aot": variant("aot plans for a multi-device slice (compile-only devices)",
                                 default="tensor=8",
                                 help="shard over devices, e.g. tensor=8 or data=2,tensor=4 "
                                      "(the product = the device count)")}),
    "--context": _flag(type=int, default=4096, help="cache length per row (tokens)"),
    "--topology": _flag(
        default=None, metavar="NAME",
        help="compile for this topology's compile-only devices: a TPU slice (e.g. v5p:2x2x2, "
             "v5e:2x4, v6e:2x4, v5p:4x4x4; needs libtpu, no TPU) or, in aot, N H100s "
             "(h100:N; needs the CUDA plugin, no GPU)"),
    "--fake-devices": _flag(type=int, default=0,
                            help="fake N CPU devices (sets XLA_FLAGS before JAX starts)"),
    # --- prompts and measurements ------------------------------------------------------
    "--questions": _flag(
        "input", default=None, metavar="FILE.jsonl",
        help="Spec-Bench / MT-bench questions, one JSON line each (question_id, category, "
             "turns); every turn is asked, in order",
        variants={
            "bench": variant("bench's demo questions", default="data/demo_questions.jsonl"),
            **_each("calibrate calibrate-lookup",
                    variant("calibration uses its own dev set, apart from bench's questions",
                            default="data/demo_calibration.jsonl")),
            "agreement": variant("agreement measures SmolLM2 drafts on their held-out "
                                 "questions", default="data/smollm2_calibration.jsonl"),
            **_each("serve-bench peer-bench",
                    variant("these benchmarks send Spec-Bench's prompts (their first turns)",
                            default="data/spec_bench_question.jsonl"))}),
    "--max-prompts": _flag(
        type=int, default=None,
        help="prompts to use at most, round-robin over tasks (default: all)",
        variants={
            **_each("calibrate calibrate-lookup",
                    variant("calibration times every candidate on every prompt: a subset "
                            "keeps it short", default=16,
                            help="prompts to use at most, round-robin over tasks")),
            "agreement": variant("a dozen prompts give the agreement within a percent or so",
                                 default=12,
                                 help="prompts to use at most, round-robin over tasks"),
            "peer-bench": variant("the side-by-side set of issue 71: 2 per Spec-Bench task",
                                  default=12,
                                  help="prompts to use at most, round-robin over tasks")}),
    "--categories": _flag(default=None,
                          help="comma-separated categories or tasks to keep (default: all)"),
    "--methods": _flag(
        default="ar,sd,self,s2d,s2d-cal", help="decode methods to compare, comma-separated",
        variants={"tpu-fits": variant("it compiles for model shapes without a trained draft "
                                      "or calibration (no self, no s2d-cal)",
                                      default="ar,sd,s2d"),
                  "serve-bench": variant("each method is a server compiled in turn (s2d "
                                         "serves the calibrated setting): AR against "
                                         "speculation is the comparison it is for",
                                         default="ar,s2d"),
                  "peer-bench": variant("it compares with llama.cpp's AR this project's AR "
                                        "and the methods that pay on a CPU (auto: the "
                                        "calibrated choice)", default="ar,lookup,auto,ladder")}),
    "--repeats": _flag(
        type=int, default=1,
        help="timed passes; each item's median is kept (a slow spell of the machine hits "
             "one pass)",
        variants={"calibrate": variant("candidates often differ by a few percent, about the "
                                       "noise of one run", default=3),
                  "matmul-bench": variant("one call takes microseconds: the median of many",
                                          default=15),
                  "peer-bench": variant("two runtimes side by side on a shared machine: two "
                                        "passes give each prompt a second chance",
                                        default=2)}),
    "--cost-samples": _flag(
        type=int, default=5, help="timed samples of every round-cost probe before ranking",
        variants={"calibrate-lookup": variant("its probes (no draft exits) are fewer and "
                                              "steadier; its settings were chosen with 3",
                                              default=3)}),
    "--cost-every": _flag(
        type=int, default=1, metavar="K",
        help="re-time the round-cost probes after every K-th prompt (a probe runs its rounds "
             "at every exit: on a real model K > 1 keeps a long run short)"),
    "--gammas": _flag(
        default="2,3,4,5,6", help="draft lengths (gamma) to try, comma-separated",
        variants={"calibrate-lookup": variant("lookup blocks longer than 5 are rarely "
                                              "accepted whole; its settings were chosen "
                                              "within 2-5", default="2,3,4,5")}),
    "--dry-run": _flag(action="store_true", help="print, do not write the config"),
    # --- outputs -----------------------------------------------------------------------
    "--out": _flag(
        "output", default=None, metavar="DIR",
        help="the directory to write (what it holds: the description above)",
        variants={"bench": variant("a benchmark's usual place", default="runs/bench"),
                  "train-smollm2-draft": variant("it rebuilds the shipped draft",
                                                 default="models/smollm2-draft"),
                  "scaling-study": variant(
                      "a study's dir follows its engine's",
                      help="the directory to write (default: $S2D_JAX_CACHE/scaling/NAME, "
                           "NAME the engine dir's name)")}),
    # --- Lemma 3.1's speedup columns (aot, tpu-fits) -------------------------------------
    "--acceptance": _flag(
        default="0.25", metavar="A[,A...]",
        help="per-token acceptance rates in [0, 1) for Lemma 3.1's speedup columns (default "
             "0.25: the SmolLM2 sorted draft's measured, docs/results.md)"),
    "--paper-acceptance": _flag(
        type=float, default=None, metavar="A",
        help="the S2D paper's per-token acceptance: one more Lemma 3.1 column (none is built "
             "in: the column says n/a)"),
    "--bandwidth": _flag(
        type=cli_args.finite_number, default=None, metavar="GB/s",
        help="memory bandwidth of one device (default: the --device-memory preset's "
             "datasheet figure, s2d_jax/decode/roofline.py)",
        variants={"device-check": variant(
            "it finds the preset from the device's name, not from --device-memory",
            help="memory bandwidth of the device, for (b)'s bounds (default: the datasheet "
                 "figure of the preset its name maps to, s2d_jax/decode/roofline.py; an "
                 "unknown device leaves the bounds out)")}),
    "--out-file": _flag(
        "output", default=None, metavar="FILE",
        help="also write the results to FILE (its format: the description above)"),
    "--overwrite": _flag(action="store_true",
                         help="replace an existing --out (only once the new output is complete)"),
    "--num-layers": _flag(type=int, default=None, metavar="N",
                          help="keep only the first N decoder layers (initialise a draft)"),
    "--max-shard-gb": _flag(type=float, default=5.0,
                            help="split model.safetensors into shards of at most this size"),
    "--src": _flag("input", default=None,
                   help="what to convert: the model dir, params checkpoint, GGUF file or "
                        "draft the subcommand names"),
    # --- training ----------------------------------------------------------------------
    "--config": _flag(
        "input", default=None, help="the training YAML (configs/train/*.yaml)",
        variants={"scaling-study": variant("the study's own recipe",
                                           default="configs/train/scaling_study.yaml")}),
    "--train-exits": _flag(
        default="2,4,6,8", metavar="E,E,...",
        help="exit depths (layers) the draft is trained with, ascending",
        variants={"bench-step": variant("it times the 12-layer CPU proxy", default="6,9,12")}),
    "--train-minutes": _flag(
        type=cli_args.finite_number, default=None, metavar="N",
        help="train the SmolLM2 sorted draft for at most N minutes",
        variants={"device-check": variant(
            "part (c) of the device's lease, off without it",
            help="also train the SmolLM2 sorted draft for N minutes, logging its held-out "
                 "agreement (c)"),
                  "train-smollm2-draft": variant(
            "a run spread over sessions",
            help="stop SoFT after the step that ends N minutes after it started (its "
                 "checkpoint in --work; with --progress, the draft so far packed there); "
                 "rerun the same command to continue (default: no limit)")}),
    "--head-vocab": _flag(type=int, default=4096,
                          help="the draft head's sub-vocabulary (0 = the full vocabulary)"),
    "--work": _flag(
        "output", default=None,
        help="the pipeline's working dir (data, checkpoints, logs)",
        variants={"train-smollm2-draft": variant("one pipeline, one usual place",
                                                 default="runs/smollm2_draft")}),
    "--documents": _flag(
        "input", type=str, default=",".join(DOCUMENT_FILES),
        help="comma-separated plain-text corpora, teacher-forced ('' = none)"),
    "--prompts": _flag(
        "input", type=str, default=",".join(TRAINING_FILES),
        help="comma-separated prompt files (GSM8K / self-instruct / ShareGPT)"),
    "--magpie": _flag(type=int, default=0, help="user turns the target writes (Magpie)"),
    "--answers": _flag(type=int, default=0,
                       help="prompts answered, greedy and at T = 1 (0 = all)"),
    "--heldout": _flag(
        "input", default="data/smollm2_calibration.jsonl",
        help="held-out questions (Spec-Bench format): kept out of training, scored"),
    "--heldout-prompts": _flag(type=int, default=40, help="held-out prompts scored"),
    # --- the server (serve; serve-bench serves each method the same way) ----------------
    "--slots": _flag(
        type=int, default=8, help="requests decoded together (decode slots)",
        variants={"serve-bench": variant("its loads go up to 16 concurrent clients, each "
                                         "kept in a slot", default=16),
                  "data-engine": variant("its answers stage decodes each batch as one "
                                         "unless given slots", default=0,
                                         help="answer each batch on the slot engine with "
                                              "this many slots, a finished answer's slot "
                                              "going to the next prompt (0 = the batch "
                                              "decoded as one)"),
                  "corpus-generate": variant("its shards stream through the slot engine; 32 "
                                             "slots measured fastest (train.bench_answers, "
                                             "2026-11-29: 16 / 32 / 64 slots 165 / 169 / "
                                             "139 answer tokens/s)", default=32,
                                             help="answer on the slot engine with this many "
                                                  "slots, shards streaming through it (0 = "
                                                  "each shard's batch decoded as one)")}),
    "--slot-len": _flag(type=int, default=None, metavar="TOKENS",
                        help="tokens per slot, prompt + answer (default: the models' context)",
                        variants={"serve": variant(
                            "a chat's prompt and answer fit in 2048 tokens, and each prompt "
                            "width up to the slot length is a program to compile: the "
                            "models' context (8192 for SmolLM2) took over 30 min to warm on "
                            "a 2-core CPU", default=2048,
                            help="tokens per slot, prompt + answer (at most the models' "
                                 "context)"),
                                  "corpus-generate": variant(
                            "a slot holds a typical prompt and its answer", default=None,
                            help="tokens per slot, prompt + answer (default: the 99.9th "
                                 "percentile prompt + --max-new-tokens; a longer prompt is "
                                 "answered by the batched decoder)")}),
    "--chunk-rounds": _flag(type=int, default=4,
                            help="rounds per jitted chunk: a finished request's slot is "
                                 "refilled between chunks"),
    "--levels": _flag(default="0.35,0.45",
                      help="agreement levels to predict the needed training tokens for"),
}


def add(container, name: str, command: str, *, aliases: tuple[str, ...] = (), **use):
    """Add the shared flag `name` as `command` (its s2d subcommand name) defines it, to a
    parser or group. `use`: what is the command's own, not the definition's: `required`,
    `dest`, an input's `paths`, an output's `kind` and `overwrite`. `aliases`: old spellings
    the command still accepts (its own: no shared flag's name)."""
    flag = FLAGS[name]
    clash = set(use) & set(DEFINED) or set(aliases) & set(FLAGS)
    if clash:
        raise TypeError(f"{name}: {sorted(clash)} belong to a definition in "
                        f"s2d_jax/cli/flags.py (a Variant of {command!r} if it must differ)")
    kw = {**flag.keywords(command), **use}
    names = (name, *aliases)
    if flag.role == "input":
        action = cli_args.add_input(container, *names, **kw)
    elif flag.role == "output":
        action = cli_args.add_output(container, *names, **kw)
    else:
        action = container.add_argument(*names, **kw)
    action.s2d_flag = (name, command)
    return action
