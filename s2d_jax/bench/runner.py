"""Spec-Bench-style benchmark: every method on the same prompts, interleaved per prompt.

For each target: AR, SD with each single draft exit, self-speculation (the target's first
k layers), S2D with calibrated thresholds (from the target's s2d_serving.json) and S2D
with the paper's 0.5 / 0.5 / 0. Every prompt runs every method back to back (in an order
rotated per prompt) after one warm-up generation per method, so slow phases of a shared
machine hit all methods alike; compilation is excluded from tokens/s and reported apart.
Predicted speedups come from theory.loop_prediction with round costs timed inside the
engine's decode loop per forced exit (loop_costs.py), sampled after every prompt so that
costs and runs see the same machine.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from s2d_jax.bench import theory
from s2d_jax.errors import S2DError
from s2d_jax.decode.checks import check_thresholds
from s2d_jax.decode.defaults import round_up
from s2d_jax.decode.methods import (AUTO, BASELINE, CALIBRATED, DEFAULT_NGRAM, LOOKUP_RUNG, METHODS, has,
                                    is_auto, methods_where, proposer)
from s2d_jax.decode.serving import Decoder
from s2d_jax.decode.serving_config import DecodeSetting, resolve
from s2d_jax.model.exits import exits_problem

# The bench's method kinds: each method of the table, and CALIBRATED ("-cal") beside each
# calibrated one (its setting from the target's s2d_serving.json; the plain kind runs the
# defaults at --gamma)
METHOD_KINDS = (METHODS + tuple(m + CALIBRATED for m in methods_where(calibrated=True))
                + (AUTO,))  # auto: what --method auto decodes with (decode/auto_method.py)
CHAIN = "chain"  # a report entry's method for a polybasic chain (chains.py), not an engine's


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One run of the bench: its label and its engine setting's fields (`setting`: the
    DecodeSetting its decoder takes; method CHAIN marks a chain's report entry)."""
    label: str
    method: str  # a method of decode/methods.py's table, or CHAIN
    exits: tuple[int, ...] = ()
    thresholds: tuple[float, ...] | None = None
    gamma: int | None = None  # None: the method's default (DEFAULT_GAMMA; AR's 0)
    stop: float = 0.0  # dynamic draft length: stop drafting below this confidence (0 = off)
    ngram: tuple[int, int] = DEFAULT_NGRAM  # the lookup rung's n range (lookup, ladder)
    lookup_len: int = 0  # the lookup's most tokens (0 = gamma)

    def __post_init__(self):
        if self.gamma is None:
            object.__setattr__(self, "gamma", proposer(self.method).default_gamma)

    @classmethod
    def of(cls, label: str, setting: DecodeSetting) -> "MethodSpec":
        """The run of a resolved setting (serving_config.resolve), as it is."""
        return cls(label, setting.method, setting.exits, setting.thresholds, setting.gamma,
                   setting.stop_threshold, setting.ngram, setting.lookup_len)

    @property
    def setting(self) -> DecodeSetting:
        """The DecodeSetting of this run (checked by its constructor)."""
        return DecodeSetting(self.method, self.exits, self.thresholds, self.gamma, self.stop,
                             ngram=self.ngram, lookup_len=self.lookup_len)


def method_specs(kinds: Sequence[str], draft_exits: Sequence[int], self_exit: int | None,
                 gamma: int, calibrated: dict | None,
                 target: str = "the target") -> tuple[list[MethodSpec], list[str]]:
    """Expand method kinds into concrete runs -> (specs, notes about skipped ones). Each
    setting is serving_config.resolve's (s2d-cal: the calibrated one, `calibrated` being
    the target's load_serving_config)."""
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown:
        raise S2DError(f"unknown method {unknown[0]!r}; use some of {', '.join(METHOD_KINDS)}")
    specs, notes = [], []
    exits = tuple(int(e) for e in draft_exits)
    for kind in kinds:
        if is_auto(kind):
            spec_or_note = _auto_spec(kind, exits, calibrated, target)
            (specs if isinstance(spec_or_note, MethodSpec) else notes).append(spec_or_note)
            continue
        method = kind_method(kind)
        row = proposer(method)
        if kind != method:
            specs_or_note = _calibrated_spec(kind, method, exits, calibrated, target)
            (specs if isinstance(specs_or_note, MethodSpec) else notes).append(specs_or_note)
        elif not row.proposes:
            specs.append(MethodSpec.of(kind, resolve(method)))
        elif row.single_exit and row.self_draft:
            if self_exit is None:
                notes.append(f"{kind} skipped: the target is too shallow for an early exit")
            else:
                specs.append(MethodSpec.of(f"{kind}@{self_exit}",
                                           resolve(method, exit=self_exit, gamma=gamma)))
        elif row.single_exit:
            specs += [MethodSpec.of(f"{kind}@{e}", resolve(method, exits, exit=e, gamma=gamma))
                      for e in exits]
        else:  # the defaults at --gamma (escalating: the paper's 0.5 / ... / 0)
            label = f"{kind}-0.5" if row.calibrated and not row.lookup else kind
            specs.append(MethodSpec.of(label, resolve(method, exits, gamma=gamma)))
    return specs, notes


def kind_method(kind: str) -> str:
    """The method of a bench kind (METHOD_KINDS): s2d-cal -> s2d."""
    return kind.removesuffix(CALIBRATED)


def _auto_spec(kind, exits, calibrated, target) -> MethodSpec | str:
    """The run of --method auto on this target (its calibration's ranked choice with the
    ranked setting, else S2D as resolve gives it; exits: the draft's, () without one), or
    the note why it is skipped."""
    from s2d_jax.decode.auto_method import auto_setting, choose
    choice = choose(calibrated, bool(exits), f"{target}'s serving config")
    if proposer(choice.method).needs_draft and not exits:
        return f"{kind} skipped: it decodes with {choice.method} here, which needs --draft"
    return MethodSpec.of(kind, auto_setting(choice, exits, calibrated, target=target))


def _calibrated_spec(kind, method, exits, calibrated, target) -> MethodSpec | str:
    """The run of a calibrated kind (s2d-cal, ...), or the note why it is skipped."""
    if calibrated is None:
        return (f"{kind} skipped: no s2d_serving.json in the target dir (run python -m "
                f"infer.calibrate)")
    setting = resolve(method, exits, calibrated, target=target)
    if setting.calibrated:
        return MethodSpec.of(kind, setting)
    if setting.note:
        return f"{kind} skipped: {setting.note.removeprefix('note: ')}"
    return (f"{kind} skipped: no fitting {method!r} section in the target's s2d_serving.json "
            f"(python -m infer.calibrate --lookup)")


def parse_s2d_setting(text: str, draft_exits: Sequence[int] | None = None) -> MethodSpec:
    """"EXITS:THRESHOLDS:GAMMA" (e.g. "2,4:0.3,0:1") -> an S2D run labelled
    s2d_e2-4_t0.3-0_g1: a fixed multi-exit setting measured beside the others (a
    calibration candidate, say), not only the paper's and the calibrated one. Without
    draft_exits only the form is checked (before any model is loaded)."""
    form = "EXITS:THRESHOLDS:GAMMA, e.g. 2,4:0.3,0:1"
    try:
        ex, th, g = text.split(":")
        exits = tuple(int(e) for e in ex.split(","))
        thresholds = tuple(float(t) for t in th.split(","))
        gamma = int(g)
    except ValueError:
        raise S2DError(f"--s2d-setting {text!r} is not {form}") from None
    allowed = set(exits) if draft_exits is None else set(int(e) for e in draft_exits)
    try:  # the rules every flag obeys (model/exits.py, decode/checks.py)
        check_thresholds(thresholds, exits)
        bad = exits_problem(exits) or not set(exits) <= allowed or gamma < 1
    except S2DError:
        bad = True
    if bad:
        raise S2DError(f"--s2d-setting {text!r}: give ascending exits of the draft "
                       f"{sorted(allowed)}, one threshold in [0, 1] per exit and gamma "
                       f">= 1 ({form})")
    label = "s2d_e{}_t{}_g{}".format("-".join(map(str, exits)),
                                     "-".join(f"{t:g}" for t in thresholds), gamma)
    return MethodSpec(label, "s2d", exits, thresholds, gamma)


class PaddedDecoder(Decoder):
    """A Decoder whose prompts are padded to a multiple of PREFILL_BUCKET tokens (at most
    the benchmark's widest prompt), so a few compilations serve every prompt: the buffer
    is the same for all, so the round loop is one program, and only the prefill is
    compiled per bucket. (Padding every prompt to the widest made a short prompt's prefill
    cost a long one's: over half of AR's time on Spec-Bench with SmolLM2.)"""

    PREFILL_BUCKET = 128

    def __init__(self, *args, prompt_width: int, **kw):
        super().__init__(*args, **kw)
        self.prompt_width = prompt_width

    def prepare(self, prompts, max_new_tokens, max_len=None, width=None):
        spec, arr, lens = super().prepare(prompts, max_new_tokens, max_len, width)
        width = min(self.prompt_width, round_up(arr.shape[1], self.PREFILL_BUCKET))
        pad = width - arr.shape[1]
        if pad > 0:
            arr = jnp.pad(arr, ((0, 0), (0, pad)))
        return spec, arr, lens


def build_decoders(specs, target_cfg, target_params, draft_cfg, draft_params, *,
                   prompt_width: int, tokenizer=None, draft_tokenizer=None) -> dict:
    out = {}
    for s in specs:
        out[s.label] = PaddedDecoder(
            target_cfg, target_params, s.setting, draft_cfg=draft_cfg,
            draft_params=draft_params, target_tokenizer=tokenizer,
            draft_tokenizer=draft_tokenizer, prompt_width=prompt_width)
    return out


class Conversations:
    """The questions' turns as prompt ids in one chat template: the first turns up front,
    a later turn built from the method's own answers (run_target's next_turn)."""

    SLACK = 8  # tokens an answer may gain when its decoded text is tokenized again

    def __init__(self, tok, template: str, questions: list[dict], max_new_tokens: int):
        from s2d_jax.data.prompts import end_of_turn_id, prompt_ids

        self.tok, self.template, self.questions = tok, template, questions
        self.eos_id = end_of_turn_id(tok, template)
        self.first_prompts = [prompt_ids(tok, template, [q["text"]]) for q in questions]
        self.multi_turn = any(len(q["turns"]) > 1 for q in questions)
        # the longest prompt any turn can have: each earlier answer at most max_new_tokens
        self.longest = max(
            [len(p) for p in self.first_prompts]
            + [len(prompt_ids(tok, template, q["turns"][:j + 1], [""] * j))
               + j * (max_new_tokens + self.SLACK)
               for q in questions for j in range(1, len(q["turns"]))])

    def answer_text(self, ids) -> str:
        from s2d_jax.data.prompts import reply_text
        return reply_text(self.tok, ids)

    def next_prompt(self, width: int):
        """next_turn for run_target, refusing a prompt wider than the decoders' `width`."""
        from s2d_jax.data.prompts import prompt_ids

        def next_turn(i: int, answers: list[list[int]]) -> list[int] | None:
            turns = self.questions[i]["turns"]
            if len(answers) >= len(turns):
                return None
            ids = prompt_ids(self.tok, self.template, turns[:len(answers) + 1],
                             [self.answer_text(a) for a in answers])
            if len(ids) > width:
                raise S2DError(f"turn {len(answers) + 1} of question "
                               f"{self.questions[i]['question_id']} has {len(ids)} tokens, "
                               f"more than the {width} reserved (its earlier answers grew "
                               f"when tokenized again); lower --max-new-tokens")
            return ids
        return next_turn


def run_target(decoders: dict, prompts: list[list[int]], *, temperatures: Sequence[float],
               max_new_tokens: int, max_len: int, eos_id: int, repeats: int = 1,
               progress: Callable | None = None, between: Callable | None = None,
               next_turn: Callable | None = None,
               after_warmup: Callable | None = None) -> dict:
    """-> {"runs": {temperature: {label: [per-turn result]}}, "items": [(question, turn)],
    "compile_seconds": {label: s}}. `between()` runs after each prompt's runs (the cost
    probes' samples, cost_probes); `after_warmup()` once after the warm-up, before the
    timed runs.

    `prompts` are the questions' first turns. A multi-turn question continues as Spec-Bench
    runs MT-bench: `next_turn(i, answers)` gets question i and the method's own answers so
    far (token ids, one per turn) and returns the next turn's prompt ids, or None when the
    conversation is over; each turn is a result of its own (timed and counted), in the order
    of `items`. At T = 0 every lossless method gives AR's answers, hence AR's prompts.

    Per turn result: token_ids, prompt, seconds (median over repeats), stats of the last
    repeat. Repeats are whole passes over the prompts (every method of every prompt, then
    again), not runs back to back: the machine has slow spells of several seconds (a greedy
    AR run of target-l once took 2.1 s instead of 0.62 s on both of two back-to-back
    repeats, and one prompt's S2D run 2x its twin's on two of three repeats taken round the
    methods), and minutes apart a spell hits one pass of a prompt, which the median drops.
    """
    labels = list(decoders)
    # One chunk holds every round (each adds >= 1 token); chunking splits the prefill off,
    # so each turn's prefill is timed on its own: it depends on the prompt's length, which
    # one probe prompt cannot stand for (theory.loop_speedup).
    kw = dict(max_new_tokens=max_new_tokens, max_len=max_len, eos_id=eos_id,
              chunk_rounds=max_new_tokens + 1)
    compile_s = {}
    for label in labels:  # warm-up: compiles, and first-run effects stay out of the timings
        out = decoders[label].generate([prompts[0]], temperature=float(temperatures[0]), **kw)
        compile_s[label] = out[0]["stats"]["compile_seconds"]
    if after_warmup is not None:
        after_warmup()
    n = len(prompts)
    secs, pre, outs = {}, {}, {}
    it = range(n * repeats) if progress is None else progress(range(n * repeats))
    for k in it:
        i = k % n
        order = labels[k % len(labels):] + labels[:k % len(labels)]
        for t in temperatures:
            for label in order:
                prompt, answers = prompts[i], []
                while prompt is not None:
                    j = len(answers)  # turn j of question i: its own seed (turn 0: i)
                    out = decoders[label].generate([prompt], temperature=float(t),
                                                   seed=i + j * n, **kw)[0]
                    key = (float(t), label, i, j)
                    secs.setdefault(key, []).append(out["stats"]["batch_seconds"])
                    pre.setdefault(key, []).append(out["stats"].get("prefill_seconds"))
                    outs[key] = dict(out, prompt=list(prompt))
                    answers.append(out["token_ids"])
                    prompt = next_turn(i, answers) if next_turn is not None else None
        if between is not None:
            between()
    items, runs = _turn_results(outs, secs, pre, labels, temperatures)
    return {"runs": runs, "items": items, "compile_seconds": compile_s}


def _turn_results(outs: dict, secs: dict, pre: dict, labels, temperatures) -> tuple:
    """(items, {T: {label: [per-turn result]}}) from the runs keyed (T, label, question,
    turn): the median seconds over repeats, the last repeat's tokens and stats."""
    # every (T, method) ran the same turns: a question's turn count is the file's
    items = sorted({(i, j) for (_, _, i, j) in outs})

    def result(key):
        return {"token_ids": outs[key]["token_ids"], "prompt": outs[key]["prompt"],
                "seconds": statistics.median(secs[key]),
                "prefill_seconds": _median_or_none(pre[key]), "stats": outs[key]["stats"]}
    runs = {float(t): {label: [result((float(t), label, i, j)) for i, j in items]
                       for label in labels} for t in temperatures}
    return items, runs


def _median_or_none(values: list):
    return None if None in values else statistics.median(values)


def _aggregate(rows: list[dict]) -> dict:
    tokens = sum(len(r["token_ids"]) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    rounds = sum(r["stats"]["rounds"] for r in rows)
    round_tokens = sum(r["stats"]["mean_accepted_tokens"] * r["stats"]["rounds"] for r in rows)
    usage = np.sum([r["stats"]["exit_usage"] for r in rows], axis=0) if rows else np.zeros(0)
    usage = usage.tolist() if np.ndim(usage) else []
    prefill = [r.get("prefill_seconds") for r in rows]
    rungs: dict = {}  # accepted tokens by the rung that proposed them (lookup, exit e)
    for r in rows:
        for rung, n in r["stats"].get("accepted_by_rung", {}).items():
            rungs[rung] = rungs.get(rung, 0) + n
    lookup_proposed = sum(r["stats"].get("lookup_proposed", 0) for r in rows)
    return {"new_tokens": tokens, "seconds": seconds,
            "prefill_seconds": (sum(prefill) if rows and None not in prefill else None),
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "rounds": rounds,
            "mean_accepted_tokens": round_tokens / rounds if rounds else None,
            "exit_usage": usage,
            "exit_usage_fraction": ([u / sum(usage) for u in usage] if usage and sum(usage)
                                    else []),
            "draft_steps_per_round": sum(usage) / rounds if rounds and usage else 0.0,
            "accepted_by_rung": rungs,
            # tokens the target made itself (a correction or bonus per round): the rest
            "target_tokens": rounds,
            "lookup_acceptance": (rungs.get(LOOKUP_RUNG, 0) / lookup_proposed
                                  if lookup_proposed else None)}


def summarize_target(runs: dict, categories: list, specs: list[MethodSpec],
                     costs: dict | None) -> dict:
    """Per temperature and method: the report fields (see infer/bench.py)."""
    by_label = {s.label: s for s in specs}
    out = {}
    for t, per_method in runs.items():
        ar = per_method.get(BASELINE)
        ar_agg = _aggregate(ar) if ar else None
        res = {}
        for label, rows in per_method.items():
            agg = _aggregate(rows)
            speed = (agg["tokens_per_second"] / ar_agg["tokens_per_second"]
                     if ar_agg and agg["tokens_per_second"] else None)
            exact = None
            if t == 0.0 and ar:
                exact = float(np.mean([r["token_ids"] == a["token_ids"]
                                       for r, a in zip(rows, ar)]))
            per_cat = {}
            for cat in dict.fromkeys(categories):
                idx = [i for i, c in enumerate(categories) if c == cat]
                c_agg = _aggregate([rows[i] for i in idx])
                c_ar = _aggregate([ar[i] for i in idx]) if ar else None
                per_cat[str(cat)] = {
                    "prompts": len(idx), "tokens_per_second": c_agg["tokens_per_second"],
                    "speedup_vs_ar": (c_agg["tokens_per_second"] / c_ar["tokens_per_second"]
                                      if c_ar and c_agg["tokens_per_second"] else None),
                    "mean_accepted_tokens": c_agg["mean_accepted_tokens"],
                    "accepted_by_rung": c_agg["accepted_by_rung"]}
            entry = {**agg, "speedup_vs_ar": speed, "exact_match_vs_ar": exact,
                     "per_category": per_cat, "method": by_label[label].method,
                     # per prompt, for paired comparisons of two methods (same prompts)
                     "per_prompt_tokens_per_second": [
                         len(r["token_ids"]) / r["seconds"] if r["seconds"] > 0 else None
                         for r in rows],
                     "exits": list(by_label[label].exits), "gamma": by_label[label].gamma,
                     "thresholds": (list(by_label[label].thresholds)
                                    if by_label[label].thresholds else None),
                     "stop_threshold": by_label[label].stop,
                     **({"ngram": list(by_label[label].ngram),
                         "lookup_len": by_label[label].lookup_len or by_label[label].gamma}
                        if has(by_label[label].method, lookup=True) else {})}
            entry.update(predict(entry, costs, label, str(t), len(rows),
                                 ar_agg["prefill_seconds"] if ar_agg else None))
            res[label] = entry
        out[str(t)] = res
    return out


def predict(entry: dict, costs: dict | None, label: str, temperature: str = "0.0",
            prompts: int = 1, ar_prefill_s: float | None = None) -> dict:
    """predicted_speedup from the time model (theory.loop_prediction) on in-loop round costs
    of the method and of AR (costs["loop"], loop_costs.py) with this run's rounds and exit
    usage; None where a side was not probed (no ar run, a chain: chains.py fills those)."""
    if label == BASELINE:
        return {"predicted_speedup": 1.0, "measured_over_predicted": 1.0}
    loop = (costs or {}).get("loop", {}).get(temperature, {})
    if label not in loop or BASELINE not in loop or not entry["rounds"]:
        return {"predicted_speedup": None, "measured_over_predicted": None}
    pred = theory.loop_prediction(loop[BASELINE], loop[label], entry["exit_usage"],
                                  entry["draft_steps_per_round"], entry["gamma"],
                                  prompts=prompts, tokens=entry["new_tokens"],
                                  rounds=entry["rounds"], prefill_s=entry.get("prefill_seconds"),
                                  ar_prefill_s=ar_prefill_s)
    ratio = (entry["speedup_vs_ar"] / pred["predicted_speedup"]
             if entry["speedup_vs_ar"] else None)
    return {"predicted_speedup": pred["predicted_speedup"], "measured_over_predicted": ratio,
            "predicted_round_s": pred["round_s"]}


def cost_probes(decoders: dict, specs: list[MethodSpec], prompt: list[int], *,
                temperatures: Sequence[float], max_len: int) -> dict:
    """{str(T): {label: LoopProbe}}, compiled, for every method: sample them between the
    benchmark's prompts (run_target's `between`) so that costs and runs are timed side by
    side, then pass them to measure_costs."""
    from s2d_jax.bench.loop_costs import LoopProbe

    return {str(float(t)): {s.label: LoopProbe(decoders[s.label], prompt, max_len=max_len,
                                               temperature=float(t)) for s in specs}
            for t in temperatures}


def sample_probes(probes: dict) -> None:
    for per_label in probes.values():
        for probe in per_label.values():
            probe.sample()


def measure_costs(probes: dict) -> dict:
    """{"loop": {temperature: {label: {"prefill_s", "round_s": [per forced exit], ...}}}}
    from `probes` (cost_probes, timed inside the decode loop at the generation's buffer
    length and sampled during the runs; greedy and sampling are different programs)."""
    return {"loop": {t: {label: p.result() for label, p in per_label.items()}
                     for t, per_label in probes.items()}}
