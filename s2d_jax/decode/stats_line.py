"""One generation's statistics as a sentence people can read (CLIs and the API), e.g.

    112 new tokens in 92 target calls (1.22 tokens per call); drafted 91 tokens by exit 2,
    0.24 of them accepted; 4.63 tok/s after a 19.1 s compile

The numbers are those of serving.summarize (the same fields land in `--out` JSON): a
target call is one forward of the target (the prefill's and one per round), exits are
named by their layer count, and compile time is left out where nothing was compiled.
"""

from __future__ import annotations

from s2d_jax.decode.methods import LOOKUP_RUNG, has

# below this, the "compile" was a cache hit (lowering a jitted function costs ~1 ms)
COMPILED_S = 0.05


def stats_line(stats: dict, show_compile: bool = True) -> str:
    calls = stats.get("target_calls") or 0
    per_call = stats.get("tokens_per_target_call")
    parts = [f"{stats['new_tokens']} new tokens in {calls} target calls"
             + (f" ({per_call:.2f} tokens per call)" if per_call is not None else "")]
    parts.append(_draft_part(stats))
    speed = stats.get("batch_tokens_per_s")
    timing = f"{speed:.2f} tok/s" if speed else ""
    compile_s = stats.get("compile_seconds") or 0.0
    if show_compile and compile_s >= COMPILED_S:
        timing += f" after a {compile_s:.1f} s compile"
    if timing:
        parts.append(timing.strip())
    return "; ".join(parts)


def _draft_part(stats: dict) -> str:
    method = stats.get("method")
    if has(method, proposes=False):
        return f"no draft ({method})"
    if has(method, lookup=True):  # the lookup rung, then the exits' part
        looked = stats.get("lookup_proposed") or 0
        part = (f"looked up {looked} tokens in the context, "
                f"{(stats.get('accepted_by_rung') or {}).get(LOOKUP_RUNG, 0)} of them accepted")
        if not has(method, exits=True):
            return part
        drafted = {k: n for k, n in (stats.get("accepted_by_rung") or {}).items()
                   if k != LOOKUP_RUNG}
        return part + "; the draft's accepted: " + (", ".join(
            f"{n} by {k}" for k, n in drafted.items()) or "none")
    by_exit = {e: n for e, n in (stats.get("drafted_by_exit") or {}).items() if n}
    if not by_exit:
        return "nothing drafted"
    name = ("the target's first {} layers" if has(method, self_draft=True) else "exit {}").format
    total = sum(by_exit.values())
    if len(by_exit) == 1:
        text = f"drafted {total} tokens by {name(next(iter(by_exit)))}"
    else:
        text = (f"drafted {total} tokens ("
                + ", ".join(f"{n} by {name(e)}" for e, n in by_exit.items()) + ")")
    acc = stats.get("draft_acceptance")
    return text + (f", {acc:.2f} of them accepted" if acc is not None else "")
