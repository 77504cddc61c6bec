"""device_check (b)'s markdown for the GEMM backends (gemm_costs.py's measurements): each
decode matmul shape under Triton and cuBLAS, the step totals, and the default they favour."""

from __future__ import annotations


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.3f}"


def _int(x):
    try:
        return int(x)
    except ValueError:
        return x


def gemm_md(g: dict | None, bw: dict, shape: dict | None = None) -> list[str]:
    """(b)'s GEMM table: each decode matmul shape and row count under each backend, and
    the backend the measurements favour with the XLA flag that selects it; `shape`: the
    model's (b) entry (its measured verify calls, with cuBLAS too where timed)."""
    if not g:
        return []
    peak = bw.get("bytes_per_s")
    names = g["backends"]
    gpu = g["platform"] == "gpu"
    vs = "Triton vs cuBLAS" if gpu else f"Triton vs cuBLAS n/a on {g['platform']}"
    lines = [f"## (b) GEMM backends: {g['model']}'s decode matmuls, {vs}\n",
             f"Each row: a pass of `rows` x K through L matrices [K, N] (each its own "
             f"buffer), "
             + (f"compiled once per backend ({g['flag']}=true: XLA's Triton GEMM, the "
                f"default; =false: cuBLAS)" if gpu else
                f"compiled once ({g['flag']} is an XLA:GPU flag: XLA's own dots)")
             + "; GB/s: the weights' bytes over the time"
             + (" (% of the bandwidth)" if peak else "")
             + "; kernels: what the compiled program calls (and weight-sized copies it "
               "makes, if any).\n",
             "| matrices | rows | " + " | ".join(f"{b} ms | {b} GB/s" for b in names)
             + " | kernels | faster |",
             "|---|---|" + "---|---|" * len(names) + "---|---|"]
    for s in g["shapes"]:
        for r, row in s["by_rows"].items():
            t = row["backends"]
            pct = lambda b: f" ({t[b]['gbps'] * 1e9 / peak:.0%})" if peak else ""  # noqa: E731
            verdict = (f"{row['faster']} {row['ratio']:.2f}x" if row.get("ratio")
                       else row["faster"])
            kern = ", ".join("+".join(t[b]["kernels"])
                             + (f" ({t[b]['copies']} copies)" if t[b].get("copies") else "")
                             for b in names)
            lines.append(f"| {s['name']} {s['layers']} x [{s['k']}, {s['n']}] | {r} | "
                         + " | ".join(f"{_ms(t[b]['s'])} | {t[b]['gbps']:.0f}{pct(b)}"
                                      if t[b]["s"] else "- | -" for b in names)
                         + f" | {kern} | {verdict} |")
    return lines + _verdict_md(g, shape or {}) + [""]


def _verdict_md(g: dict, shape: dict) -> list[str]:
    """The step totals, the model's verify calls per backend and the chosen default."""
    names, lines = g["backends"], []
    verify_s = shape.get("verify_s") or {}
    if g.get("step_s"):
        lines.append("")
        step = g["step_s"]
        for r in step[names[0]]:  # int keys here, str keys in results.json
            call = verify_s.get(r, verify_s.get(str(r), verify_s.get(_int(r))))
            lines.append(f"- a step's matmuls at {r} row(s) (each shape x its matrices a "
                         f"layer): " + ", ".join(f"{b} {_ms(step[b][r])} ms" for b in names)
                         + (f"; the measured verify call of {r} token(s): {_ms(call)} ms"
                            if call else ""))
    by = shape.get("verify_by_backend")
    if by:
        lines += [f"- the model's verify call of {w} token(s): Triton in one pass (default) "
                  f"{_ms(by['triton'][w])} ms, cuBLAS {_ms(c)} ms"
                  + (f", Triton with split-K {_ms(by['split-k'][w])} ms" if w in by.get("split-k", {})
                     else "") for w, c in by["cublas"].items()]
    c = g.get("choice")
    if c:
        if c["default"] is None:
            lines.append(f"\nGEMM default for the decode shapes: {c['why']}.")
        else:
            how = (f"set `XLA_FLAGS={c['xla_flags']}` (or compile with "
                   f"`compiler_options={{'{g['flag']}': False}}`)" if c["xla_flags"] else
                   f"nothing to set (XLA's default, `{g['flag']}=true`)")
            split = ", ".join(f"{r}: {b}" for r, b in c["per_rows"].items())
            lines.append(f"\n**GEMM default for the decode shapes: {c['default']}** - "
                         f"{c['why']} (kernels faster per row count: {split}); {how}. The "
                         f"library's defaults are unchanged.")
    return lines
