"""Insertion rule of polybasic speculative decoding (Lemma 3.1 / Theorem 3.2 form): does
inserting a candidate model into a chain lower the expected time per token?

Numbering (s2d_jax/theory.py): M_1 is the TARGET, M_n the last drafter; T_i seconds per
forward call of M_i, L_i tokens per verification call of M_i, beta drafter calls per call
of M_{n-1}. Lemma 3.1: T/N = sum_{i<n} T_i/L_i + beta T_n/L_{n-1}. A candidate inserted
between M_k and M_{k+1} helps iff the new chain's T'/N is below the old one's.

From measured numbers (one candidate; lists target first):

    python -m infer.insertion --costs 0.012,0.001 --accept 2.5 --beta 4 \\
        --candidate-cost 0.004 --new-accept 3.1,2.2 [--new-beta 4] [--new-costs 0.013,0.001]

From a benchmark report (`python -m infer.bench ... --chain ...`): every chain of every
target, the two-level S2D run as "before", each 3-level chain as "after", with the
measured chain vs two-level speed and whether it agrees in direction:

    python -m infer.insertion --bench-report runs/bench/report.json [--only-target l] \\
        [--only-temperature 0]
"""

from __future__ import annotations

import json
import math
import os

from s2d_jax.cli.args import ArgumentParser, add_input, parse_floats
from s2d_jax.bench import theory
from s2d_jax.config import finite_float
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.readers import read_text


def _numbers(flag: str, text: str | None) -> list[float] | None:
    """Costs and accept lengths: comma-separated, all > 0."""
    vals = None if text is None else parse_floats(text, flag, nonempty=True)
    if vals is not None and not all(v > 0 for v in vals):
        raise S2DError(f"{flag} {text!r} has a value <= 0; costs (seconds per call) and "
                       f"accept lengths (tokens per call) must be positive")
    return vals


def _number(flag: str, text: str | None) -> float | None:
    """One number (argparse's own type errors would print a usage block, not one line)."""
    if text is None:
        return None
    try:
        return finite_float(float(text), flag)
    except ValueError:
        raise S2DError(f"{flag} {text!r} is not a number")


NUMBER_FLAGS = ("only_temperature", "beta", "position", "candidate_cost", "new_beta",
                "measured_gain")
# a ratio or a call count: 0 or below means nothing
POSITIVE_FLAGS = ("beta", "new_beta", "measured_gain")


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.insertion", description=__doc__)
    # filters of an input report, not a model, a sampling temperature or an output:
    # named apart from the shared --target / --temperature / calibrate's --report
    add_input(ap, "--bench-report", default=None,
                    help="report.json of infer.bench with --chain")
    ap.add_argument("--only-target", default=None, metavar="NAME",
                    help="only this target of the report (its name in it)")
    ap.add_argument("--only-temperature", default=None,
                    help="only this temperature of the report (default: all)")
    ap.add_argument("--costs", help="T_1 (target), ..., T_n (drafter): seconds per call")
    ap.add_argument("--accept", help="L_1, ..., L_{n-1}: tokens per verification call")
    ap.add_argument("--beta", help="drafter calls per call of M_{n-1}")
    ap.add_argument("--position", default="1",
                    help="insert between M_k and M_{k+1} (default 1: after the target)")
    ap.add_argument("--candidate-cost", help="T_c: the candidate's seconds per call")
    ap.add_argument("--new-accept", help="L_1', ..., L_n' of the new chain (the candidate's "
                    "own at index k+1)")
    ap.add_argument("--new-beta", default=None, help="default --beta")
    ap.add_argument("--new-costs", default=None, help="the n old models' costs in the new "
                    "chain (default --costs; a verifier of a longer block costs more)")
    ap.add_argument("--measured-gain", default=None,
                    help="measured tokens/s of the new chain over the old one, to compare")
    args = ap.parse_args(argv)
    for name in NUMBER_FLAGS:
        setattr(args, name, _number("--" + name.replace("_", "-"), getattr(args, name)))
    for name in POSITIVE_FLAGS:
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise S2DError(f"--{name.replace('_', '-')} must be positive, got {v:g}")
    if not args.position.is_integer():
        raise S2DError(f"--position must be an integer, got {args.position:g}")
    args.position = int(args.position)
    return args


def _formula(n: int, prime: str) -> str:
    terms = [f"T_{i}{prime}/L_{i}{prime}" for i in range(1, n)]
    return " + ".join(terms + [f"beta{prime} T_{n}{prime}/L_{n - 1}{prime}"])


def _numeric(costs, accept, beta) -> str:
    n = len(costs)
    terms = [f"{t:.3e}/{L:.3f}" for t, L in zip(costs[:-1], accept)]
    return " + ".join(terms + [f"{beta:.3f} x {costs[-1]:.3e}/{accept[-1]:.3f}"]) if n else ""


def side_lines(tag: str, costs, accept, beta, prime: str) -> list[str]:
    """The lemma for one chain: symbols, numbers, terms, total (seconds per token)."""
    terms = theory.time_terms(costs, accept, beta)
    head = f"  {tag:<7}T{prime}/N = "
    pad = " " * (len(head) - 2)
    return [head + _formula(len(costs), prime),
            pad + "= " + _numeric(costs, accept, beta),
            pad + "= " + " + ".join(f"{t:.3e}" for t in terms)
            + f" = {sum(terms):.4e} s/token"]


def verdict_lines(title: str, position: int, before: dict, after: dict, *,
                  measured_gain: float | None = None, measured_vs: str = "the old chain",
                  models: list[str] | None = None) -> tuple[list[str], dict]:
    """Both sides of the insertion inequality, the predicted gain and verdict, and (given a
    measured gain) whether the measurement agrees in direction."""
    _check_chain_numbers(before, after, measured_gain)
    n = len(before["costs"])
    kept = after.get("kept_costs") or before["costs"]
    cand = after["candidate_cost"]
    res = theory.insertion_gain(before["costs"], before["accept_lengths"], before["beta"],
                                position, cand, after["accept_lengths"], after.get("beta"),
                                new_costs=after.get("kept_costs"))
    new_costs = list(kept[:position]) + [cand] + list(kept[position:])
    new_beta = before["beta"] if after.get("beta") is None else after["beta"]
    names = models or (["target"] + ["intermediate"] * (n - 2) + ["drafter"])
    lines = [title,
             f"  insert the candidate between M_{position} ({names[position - 1]}) and "
             f"M_{position + 1} ({names[position]}); it becomes M_{position + 1}'"]
    lines += side_lines("before", before["costs"], before["accept_lengths"], before["beta"], "")
    lines += side_lines("after", new_costs, after["accept_lengths"], new_beta, "'")
    word = "helps" if res["helps"] else "hurts"
    lines.append(f"  predicted: T'/N {'<' if res['helps'] else '>='} T/N -> inserting "
                 f"{word} (gain T/N / T'/N = {res['gain']:.3f}x)")
    agrees = None
    if measured_gain is not None:
        faster = measured_gain > 1
        agrees = faster == res["helps"]
        lines.append(f"  measured: {measured_gain:.3f}x tokens/s vs {measured_vs} -> "
                     f"{'faster' if faster else 'slower'}: "
                     f"{'agrees' if agrees else 'DISAGREES'} with the prediction")
    return lines, {**res, "agrees": agrees}


def _check_chain_numbers(before: dict, after: dict, measured_gain) -> None:
    """Costs, accept lengths, beta and the measured gain (flags or a report's fields) must
    be finite and positive: an inf cost or a NaN gain would print 'inf s/token', 'nanx'."""
    numbers = [*before["costs"], *before["accept_lengths"], before["beta"],
               after["candidate_cost"], *after["accept_lengths"], *(after.get("kept_costs") or
                                                                    ())]
    numbers += [v for v in (after.get("beta"), measured_gain) if v is not None]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in numbers):
        raise S2DError(f"costs, accept lengths, beta and the measured gain must be finite "
                       f"positive numbers, got {numbers}; fix the inputs")


def explicit(args) -> list[str]:
    need = {"--costs": args.costs, "--accept": args.accept, "--beta": args.beta,
            "--candidate-cost": args.candidate_cost, "--new-accept": args.new_accept}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise S2DError(f"missing {', '.join(missing)}; give measured numbers "
                       f"(--costs --accept --beta --candidate-cost --new-accept) or "
                       f"--bench-report")
    if not args.candidate_cost > 0:
        raise S2DError(f"--candidate-cost must be positive (seconds per call), got "
                       f"{args.candidate_cost:g}")
    costs = _numbers("--costs", args.costs)
    accept = _numbers("--accept", args.accept)
    new_accept = _numbers("--new-accept", args.new_accept)
    kept = _numbers("--new-costs", args.new_costs)
    if len(new_accept) != len(costs):
        raise S2DError(f"--new-accept needs {len(costs)} values (L_1' .. L_{len(costs)}' of "
                       f"the {len(costs) + 1}-model chain), got {len(new_accept)}")
    lines, _ = verdict_lines(
        f"candidate (T_c = {args.candidate_cost:g} s/call) into a {len(costs)}-model chain",
        args.position, {"costs": costs, "accept_lengths": accept, "beta": args.beta},
        {"candidate_cost": args.candidate_cost, "accept_lengths": new_accept,
         "beta": args.new_beta, "kept_costs": kept}, measured_gain=args.measured_gain)
    return lines


def _load_report(path: str) -> dict:
    if not os.path.exists(path):  # a directory or /dev/null: read_text says what it is
        raise S2DError(f"report {path} does not exist; run python -m infer.bench --chain ...")
    text = read_text(path, "report")
    try:
        report = json.loads(text)
        report["targets"].items()
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise S2DError(f"{path} is not a report.json written by python -m infer.bench; "
                       f"pass the report.json of a python -m infer.bench --chain run")
    return report


def _chain_lines(name: str, label: str, c: dict, temp: str, e: dict) -> list[str]:
    """One chain of a report: the two-level run (before) vs the chain (after), position 1."""
    ins = e["insertion"]
    b, a = ins["before"], ins["after"]
    title = (f"target {name}, {label}: draft -> {c['models'][1]} -> target, mu {c['mu']}, "
             f"T={temp} (before: {c['baseline']})")
    out, _ = verdict_lines(
        title, ins["position"], b,
        {"candidate_cost": a["costs"][1], "accept_lengths": a["accept_lengths"],
         "beta": a["beta"], "kept_costs": [a["costs"][0], a["costs"][2]]},
        measured_gain=ins.get("measured_gain"), measured_vs=f"two-level {c['baseline']}")
    return out


def from_report(args) -> list[str]:
    report = _load_report(args.bench_report)
    targets = report["targets"]
    if args.only_target is not None and args.only_target not in targets:
        raise S2DError(f"target {args.only_target!r} is not in {args.bench_report}; it "
                       f"has {', '.join(targets) or 'no targets'}")
    names = [args.only_target] if args.only_target is not None else list(targets)
    lines, found = [], 0
    for name in names:
        for label, c in (targets[name].get("chains") or {}).items():
            for temp, e in c["by_temperature"].items():
                if args.only_temperature is not None and float(temp) != args.only_temperature:
                    continue
                found += 1
                try:
                    lines += _chain_lines(name, label, c, temp, e) + [""]
                except (KeyError, IndexError, TypeError):
                    raise S2DError(f"{args.bench_report}: chain {label} of target {name} "
                                   f"lacks the insertion fields; rerun python -m infer.bench "
                                   f"--chain")
    if not found:
        what = f" at T={args.only_temperature:g}" if args.only_temperature is not None else ""
        raise S2DError(f"{args.bench_report} has no chain results{what}; run python -m "
                       f"infer.bench with --chain NAME=MID")
    return lines[:-1]


@cli_main
def main(argv=None):
    args = parse_args(argv)
    explicit_flags = [args.costs, args.accept, args.beta, args.candidate_cost, args.new_accept,
                      args.new_costs, args.new_beta, args.measured_gain]
    if args.bench_report is not None:
        if any(v is not None for v in explicit_flags):
            raise S2DError("give either --bench-report or measured numbers (--costs ...), not both")
        lines = from_report(args)
    else:
        if args.only_target is not None or args.only_temperature is not None:
            raise S2DError("--only-target / --only-temperature select results of a --bench-report")
        lines = explicit(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    main()
