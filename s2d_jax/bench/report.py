"""Benchmark outputs: Markdown table, acceptance checks, Spec-Bench answer files, PNG plot.
Every file is written to a temporary path in the output dir and renamed into place."""

from __future__ import annotations

import json
import math
import statistics

from s2d_jax.decode.methods import has
from s2d_jax.io.atomic import write_atomic


def _fmt(x, digits=2, suffix=""):
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def markdown_table(report: dict) -> str:
    lines = ["| target | T | method | tok/s | speedup vs AR | predicted | measured/pred | MAT "
             "| exact match vs AR | exit usage |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, tgt in report["targets"].items():
        for temp, methods in tgt["results"].items():
            for label, m in methods.items():
                usage = "/".join(f"{u:.2f}" for u in m["exit_usage_fraction"]) or "-"
                lines.append(
                    f"| {name} | {temp} | {label} | {_fmt(m['tokens_per_second'], 1)} | "
                    f"{_fmt(m['speedup_vs_ar'], 2, 'x')} | {_fmt(m['predicted_speedup'], 2, 'x')} "
                    f"| {_fmt(m['measured_over_predicted'])} | {_fmt(m['mean_accepted_tokens'])} "
                    f"| {_fmt(m['exact_match_vs_ar'])} | {usage} |")
        hf = tgt.get("hf_baseline")
        if hf:
            for label, h in hf.items():
                if isinstance(h, dict) and "tokens_per_second" in h:
                    lines.append(f"| {name} | 0.0 | HF {label} | {_fmt(h['tokens_per_second'], 1)} "
                                 f"| - | - | - | - | {_fmt(h.get('exact_match_vs_ar'))} | - |")
    out = "\n".join(lines) + "\n"
    out += chain_tables(report)
    out += task_tables(report)
    out += rung_tables(report)
    out += step_breakdown_tables(report)
    if report.get("acceptance"):
        out += "\nAcceptance checks (greedy):\n\n" + "\n".join(
            f"- {'PASS' if c['pass'] else 'FAIL'}: {c['check']} ({c['value']})"
            for c in report["acceptance"]) + "\n"
    if report.get("notes"):
        out += "\nNotes:\n\n" + "\n".join(f"- {n}" for n in report["notes"]) + "\n"
    return out


def _ms(x):
    return _fmt(None if x is None else 1e3 * x, 3)


def task_tables(report: dict) -> str:
    """Per Spec-Bench task: speedup / MAT of every method; math_reasoning accuracy; our AR
    vs HF generate over the first tokens."""
    out = ""
    for name, tgt in report["targets"].items():
        for temp, methods in tgt["results"].items():
            tasks = list(next(iter(methods.values()))["per_category"]) if methods else []
            if not tasks:
                continue
            out += (f"\n{name}, T = {temp}: speedup vs AR / mean accepted tokens per task\n\n"
                    f"| method | " + " | ".join(tasks) + " |\n|---|" + "---|" * len(tasks) + "\n")
            for label, m in methods.items():
                cells = [f"{_fmt(c['speedup_vs_ar'], 2, 'x')} / {_fmt(c['mean_accepted_tokens'])}"
                         for c in (m["per_category"][t] for t in tasks)]
                out += f"| {label} | " + " | ".join(cells) + " |\n"
            acc = {label: m["math_accuracy"] for label, m in methods.items()
                   if m.get("math_accuracy")}
            if acc:
                out += "\nmath_reasoning final-answer accuracy: " + ", ".join(
                    f"{label} {a['correct']}/{a['total']}" for label, a in acc.items()) + "\n"
        first = (tgt.get("hf_baseline") or {}).get("plain", {}).get("first_tokens_vs_ar")
        if first:
            out += (f"\n{name}: our AR = HF generate greedy over the first {first['tokens']} "
                    f"tokens on {first['agree']:.0%} of prompts" + "".join(
                        f"; prompt {d['prompt']} parts at token {d['position']} (HF logit gap "
                        f"{_fmt(d['hf_logit_gap'], 4)})" for d in first["diverged"]) + "\n")
    return out


def step_breakdown_tables(report: dict) -> str:
    """Markdown for each target's draft step breakdown (infer.bench --step-breakdown)."""
    from s2d_jax.bench.step_costs import format_breakdown

    lines = []
    for name, tgt in report["targets"].items():
        if tgt.get("draft_step_breakdown"):
            lines += ["", f"Target {name}, its draft's step in parts:", ""]
            lines += format_breakdown(tgt["draft_step_breakdown"])
    return "\n".join(lines) + "\n" if lines else ""


def chain_tables(report: dict) -> str:
    """Markdown for the polybasic chains (targets.NAME.chains, see bench/chains.py): speed
    and the insertion verdict, per-level statistics, quantized intermediates."""
    chains = [(name, label, c) for name, tgt in report["targets"].items()
              for label, c in (tgt.get("chains") or {}).items()]
    if not chains:
        return ""
    main = ["", "Polybasic chains (draft -> intermediate -> target) vs two-level S2D. "
            "Lemma 3.1 time per token T/N = sum_i T_i/L_i + beta T_n/L_{n-1} (M_1 = target, "
            "L_i = N/F_i measured); verdict = predicted helps/hurts vs measured "
            "faster/slower than the two-level run.", "",
            "| target | T | chain | gamma | mu | tok/s | speedup vs AR | predicted | 2-level run "
            "| vs 2-level (measured) | predicted gain | s/token pred before -> after | verdict "
            "| exact b1 | exact b4 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    levels = ["", "Chain levels (T_i: measured seconds per call; L = N/F tokens per call):",
              "", "| target | T | chain | level | verifies | acceptance | out/call | L = N/F "
              "| T_i ms/call | calls |", "|---|---|---|---|---|---|---|---|---|---|"]
    quant = []
    for name, label, c in chains:
        for temp, e in c["by_temperature"].items():
            ins = e["insertion"]
            verdict = f"{ins['predicted']} / {ins['measured'] or '-'}"
            if ins["agrees"] is not None:
                verdict += " (agree)" if ins["agrees"] else " (DISAGREE)"
            b4 = c.get("batch4", {}).get("exact_match_vs_ar") if temp == "0.0" else None
            main.append(
                f"| {name} | {temp} | {label} | {c['gamma']} | {c['mu']} "
                f"| {_fmt(e['tokens_per_second'], 1)} "
                f"| {_fmt(e['speedup_vs_ar'], 2, 'x')} | {_fmt(e['predicted_speedup'], 2, 'x')} "
                f"| {c['baseline']} | {_fmt(e['speedup_vs_2level'], 2, 'x')} "
                f"| {_fmt(ins['predicted_gain'], 2, 'x')} "
                f"| {ins['before']['time_per_token_s']:.2e} -> "
                f"{ins['after']['time_per_token_s']:.2e} | {verdict} "
                f"| {_fmt(e['exact_match_vs_ar'])} | {_fmt(b4)} |")
            after = ins["after"]
            level_costs = after["costs"][-2::-1]  # verifiers in chain order (lowest first)
            levels.append(f"| {name} | {temp} | {label} | draft | - | - | - | - | "
                          f"{_ms(after['costs'][-1])} (step) | beta {after['beta']:.2f} |")
            for lv, cost in zip(e["levels"], level_costs):
                levels.append(
                    f"| {name} | {temp} | {label} | {lv['level']} | {lv['verifies']} "
                    f"| {_fmt(lv['acceptance_rate'])} | {_fmt(lv['accept_length_per_call'])} "
                    f"| {_fmt(lv['tokens_per_call'])} | {_ms(cost)} | {int(lv['calls'])} |")
        q = c.get("quantized")
        if q:
            quant.append(
                f"| {name} | {label} | {q['mode']} | {q['params_bytes'] / 1e6:.2f} / "
                f"{q['full_precision_params_bytes'] / 1e6:.2f} ({q['full_precision_dtype']}) "
                f"| {q['bytes_saved'] / 1e6:.2f} ({1 - q['fraction_of_full']:.0%}) "
                f"| {_fmt(q.get('identical_fraction'))} | {_fmt(q.get('mean_prefix_match'))} |")
    out = "\n".join(main + levels) + "\n"
    if quant:
        out += "\n".join(["", "Quantized intermediates (int8 / int4 weight-only, w8a8 int8 "
                          "weights and activations; greedy AR of the quantized target vs the "
                          "full-precision target on the bench prompts):", "",
                          "| target | chain | mode | params MB quantized / full | MB saved | "
                          "AR identical | mean prefix match |",
                          "|---|---|---|---|---|---|---|"] + quant) + "\n"
    return out


def chain_checks(report: dict) -> list[dict]:
    """Issue 7's acceptance numbers: greedy exactness of each chain at batch 4 (batch 1 is
    in the every-method check) and the insertion verdict agreeing with the measurement."""
    checks = []
    for name, tgt in report["targets"].items():
        for label, c in (tgt.get("chains") or {}).items():
            b4 = c.get("batch4") or {}
            if b4.get("exact_match_vs_ar") is not None:
                checks.append({"check": f"{name} {label}: greedy exact match vs AR at batch "
                                        f"{b4['batch_size']} = 1.0",
                               "value": f"{b4['exact_match_vs_ar']:.2f}",
                               "pass": b4["exact_match_vs_ar"] == 1.0})
            e = c["by_temperature"].get("0.0")
            if e and e["insertion"]["agrees"] is not None:
                ins = e["insertion"]
                checks.append({"check": f"{name} {label}: insertion predicted {ins['predicted']}"
                                        f" agrees with measured {ins['measured']}",
                               "value": f"predicted {ins['predicted_gain']:.2f}x, measured "
                                        f"{ins['measured_gain']:.2f}x vs {c['baseline']}",
                               "pass": ins["agrees"]})
    return checks


def paired_ratio(a: dict, b: dict) -> tuple[float, float] | None:
    """Mean and standard error over prompts of a's tokens/s over b's on the same prompt."""
    pairs = [x / y for x, y in zip(a.get("per_prompt_tokens_per_second") or [],
                                   b.get("per_prompt_tokens_per_second") or []) if x and y]
    if len(pairs) < 2:
        return None
    return statistics.mean(pairs), statistics.stdev(pairs) / math.sqrt(len(pairs))


def calibrated_vs_sd(name: str, cal: dict, sd: dict, sd_label: str) -> dict:
    """S2D calibrated >= the best single-exit SD. When calibration chose exactly that SD
    setting (one exit, threshold 0, the same gamma, no draft stop: vanilla SD is in its
    search space and escalating did not pay), both rows time the same program, so it holds
    by identity and the measured difference is run-to-run noise; the paired per-prompt
    ratio shows its size."""
    same = (list(cal["exits"]) == list(sd["exits"]) and cal["gamma"] == sd["gamma"]
            and all(t == 0.0 for t in cal["thresholds"] or [0.0])
            and not cal.get("stop_threshold"))
    value = f"{cal['speedup_vs_ar']:.2f}x vs {sd['speedup_vs_ar']:.2f}x ({sd_label})"
    pr = paired_ratio(cal, sd)
    if pr:
        value += f", paired per-prompt ratio {pr[0]:.3f} +- {pr[1]:.3f} (s.e.)"
    if same:
        value += (f"; calibration chose this very setting (exit {sd['exits'][0]}, gamma "
                  f"{sd['gamma']}): the same program, equal by identity")
    return {"check": f"{name}: S2D calibrated >= best single-exit SD", "value": value,
            "pass": same or cal["speedup_vs_ar"] >= sd["speedup_vs_ar"]}


def escalation_checks(name: str, g: dict, sd_label: str) -> list[dict]:
    """S2D's own claim: an S2D run with at least two exits in use >= 1.05x the best
    single-exit SD, as the paired per-prompt ratio (mean +- s.e.)."""
    out = []
    for k, m in g.items():
        used = [u for u in m.get("exit_usage") or [] if u]
        if not has(m["method"], escalates=True, lookup=False) or len(used) < 2:
            continue
        pr = paired_ratio(m, g[sd_label])
        if pr is None:
            continue
        out.append({"check": f"{name} {k}: S2D with {len(used)} exits in use >= 1.05x the "
                             f"best single-exit SD ({sd_label})",
                    "value": f"paired per-prompt ratio {pr[0]:.3f} +- {pr[1]:.3f} (s.e.), "
                             f"exit usage {_usage(m)}",
                    "pass": pr[0] >= 1.05})
    return out


def ladder_checks(name: str, g: dict, sd_label: str | None) -> list[dict]:
    """Issue 42's bars for each ladder run: >= 1.35x AR, and >= 1.05x the better of the
    lookup alone and the best single-exit SD (paired per-prompt ratio, mean +- s.e.)."""
    out = []
    rivals = ([k for k in g if has(g[k]["method"], lookup=True, exits=False)]
              + ([sd_label] if sd_label else []))
    rivals = [k for k in rivals if g[k]["speedup_vs_ar"]]
    for k, m in g.items():
        if not has(m["method"], lookup=True, exits=True) or not m["speedup_vs_ar"]:
            continue
        out.append({"check": f"{name} {k}: the ladder >= 1.35x AR",
                    "value": f"{m['speedup_vs_ar']:.2f}x", "pass": m["speedup_vs_ar"] >= 1.35})
        if not rivals:
            continue
        best = max(rivals, key=lambda r: g[r]["speedup_vs_ar"])
        pr = paired_ratio(m, g[best])
        if pr is not None:
            out.append({"check": f"{name} {k}: the ladder >= 1.05x the better of lookup alone "
                                 f"and the best single-exit SD ({best})",
                        "value": f"paired per-prompt ratio {pr[0]:.3f} +- {pr[1]:.3f} (s.e.)",
                        "pass": pr[0] >= 1.05})
    return out


def rung_tables(report: dict) -> str:
    """Per target and temperature, for the methods with a lookup rung or several exits:
    the share of the new tokens each rung proposed and the target accepted (lookup, exit
    e), and the target's own (a correction or bonus per round)."""
    out = ""
    for name, tgt in report["targets"].items():
        for temp, methods in tgt["results"].items():
            rows = {k: m for k, m in methods.items() if m.get("accepted_by_rung")
                    and (has(m["method"], lookup=True) or len(m["accepted_by_rung"]) > 2)}
            if not rows:
                continue
            rungs = list(dict.fromkeys(r for m in rows.values() for r in m["accepted_by_rung"]))
            out += (f"\n{name}, T = {temp}: where the new tokens came from (share of all; "
                    f"lookup acceptance = lookup tokens accepted / proposed)\n\n| method | "
                    + " | ".join(rungs) + " | target | lookup acceptance |\n|---|"
                    + "---|" * (len(rungs) + 2) + "\n")
            for k, m in rows.items():
                total = m["new_tokens"] or 1
                cells = [f"{m['accepted_by_rung'].get(r, 0) / total:.2f}" for r in rungs]
                cells.append(f"{m.get('target_tokens', 0) / total:.2f}")
                cells.append(_fmt(m.get("lookup_acceptance")))
                out += f"| {k} | " + " | ".join(cells) + " |\n"
    return out


def _usage(m: dict) -> str:
    return "/".join(f"{u:.2f}" for u in m.get("exit_usage_fraction") or [])


def acceptance_checks(report: dict) -> list[dict]:
    """The project's acceptance numbers, computed from the greedy results."""
    checks = []
    targets = report["targets"]
    by_size = sorted(targets, key=lambda n: targets[n]["num_params"])

    def best_s2d(g):
        vals = [(m["speedup_vs_ar"], k) for k, m in g.items()
                if has(m["method"], escalates=True, lookup=False) and m["speedup_vs_ar"]]
        return max(vals) if vals else (None, None)

    for name in by_size:
        g = targets[name]["results"].get("0.0")
        if not g:
            continue
        s2d, s2d_label = best_s2d(g)
        if name == by_size[-1] and len(by_size) > 1 and s2d is not None:
            checks.append({"check": f"largest target {name}: S2D speedup >= 2.0x",
                           "value": f"{s2d:.2f}x ({s2d_label})", "pass": s2d >= 2.0})
        if name == by_size[0] and s2d is not None:
            checks.append({"check": f"smallest target {name}: S2D speedup >= 1.3x",
                           "value": f"{s2d:.2f}x ({s2d_label})", "pass": s2d >= 1.3})
        sd = [(m["speedup_vs_ar"], k) for k, m in g.items()
              if has(m["method"], single_exit=True, self_draft=False) and m["speedup_vs_ar"]]
        if "s2d-cal" in g and sd:
            checks.append(calibrated_vs_sd(name, g["s2d-cal"], g[max(sd)[1]], max(sd)[1]))
        if sd:
            checks += escalation_checks(name, g, max(sd)[1])
        checks += ladder_checks(name, g, max(sd)[1] if sd else None)
        exact = {k: m["exact_match_vs_ar"] for k, m in g.items()}
        checks.append({"check": f"{name}: exact match vs AR = 1.0 for every method",
                       "value": ", ".join(f"{k} {v:.2f}" for k, v in exact.items()),
                       "pass": all(v == 1.0 for v in exact.values())})
        for k, m in g.items():
            if has(m["method"], escalates=True, lookup=False) and m["measured_over_predicted"] is not None:
                r = m["measured_over_predicted"]
                checks.append({"check": f"{name} {k}: measured/predicted speedup in [0.9, 1.1]",
                               "value": f"{r:.2f}", "pass": 0.9 <= r <= 1.1})
        hf = targets[name].get("hf_baseline") or {}
        if s2d is not None and hf.get("assisted", {}).get("tokens_per_second"):
            ours = g[s2d_label]["tokens_per_second"]
            ratio = ours / hf["assisted"]["tokens_per_second"]
            # the real-model issue's bar (the demo family's was 2x)
            checks.append({"check": f"{name}: our S2D tok/s >= 3x HF assisted generation",
                           "value": f"{ratio:.2f}x", "pass": ratio >= 3.0})
    return checks + chain_checks(report)


def answer_rows(questions: list[dict], items: list, rows: list[dict], texts: list[str],
                model_id: str) -> list[dict]:
    """Spec-Bench answer lines, one per question: `rows[k]` / `texts[k]` are turn
    items[k] = (question index, turn) and each list field holds one entry per turn.
    accept_lengths: the engine keeps per-round accepted counts only as totals, so each turn
    adds its mean over rounds (rounds times), all turns in one list as Spec-Bench does."""
    out = {}
    for (i, _), r, text in zip(items, rows, texts):
        q, s = questions[i], r["stats"]
        if i not in out:
            out[i] = {"question_id": q["question_id"], "category": q.get("category"),
                      "model_id": model_id,
                      "choices": [{"index": 0, "turns": [], "decoding_steps": [],
                                   "new_tokens": [], "wall_time": [], "accept_lengths": []}]}
        c = out[i]["choices"][0]
        c["turns"].append(text)
        c["decoding_steps"].append(s["rounds"])
        c["new_tokens"].append(len(r["token_ids"]))
        c["wall_time"].append(r["seconds"])
        c["accept_lengths"] += [s["mean_accepted_tokens"]] * s["rounds"]
    return list(out.values())


def write_answers(path: str, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


PLOT_EXTRA = "pip install -e '.[bench]'"


def plot(report: dict, path: str) -> bool:
    """Write the speedup and exit-usage plot; False (nothing written) without matplotlib,
    an optional extra (PLOT_EXTRA)."""
    import io

    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(report["targets"])
    greedy = {n: report["targets"][n]["results"].get("0.0", {}) for n in targets}
    labels = list(dict.fromkeys(k for g in greedy.values() for k in g))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        vals = [greedy[n].get(label, {}).get("speedup_vs_ar") or 0.0 for n in targets]
        ax1.bar([i + j * width for i in range(len(targets))], vals, width, label=label)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(targets))], targets)
    ax1.set_ylabel("speedup vs AR (greedy)")
    ax1.legend(fontsize=7)
    bars = [(n, k, m["exit_usage_fraction"], m["exits"]) for n in targets
            for k, m in greedy[n].items()
            if has(m["method"], escalates=True, lookup=False) and m["exit_usage_fraction"]]
    seen = set()
    for i, (n, k, frac, exits) in enumerate(bars):
        bottom = 0.0
        for f, e in zip(frac, exits):  # one colour per exit depth (layers)
            ax2.bar(i, f, bottom=bottom, color=f"C{e % 10}",
                    label=None if e in seen else f"exit at {e} layers")
            seen.add(e)
            bottom += f
    ax2.set_xticks(range(len(bars)), [f"{n}\n{k}" for n, k, _, _ in bars], fontsize=7)
    ax2.set_ylabel("share of drafted tokens")
    ax2.set_title("S2D exit usage")
    if bars:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return True
