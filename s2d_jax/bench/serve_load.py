"""The server's load benchmark: N concurrent clients send prompts through the real HTTP
interface (streamed /v1/completions, as vLLM's benchmark_serving does) and each request's
timing is read off its stream.

Per request: time to first token (TTFT: from sending to the first text piece), time per
output token after the first (TPOT: (end - first piece) / (tokens - 1)) and its output
tokens (from the usage the stream ends with). Per load (one client count): requests/s and
output tokens/s over the wall time of the whole load, TTFT and TPOT p50 / p99. Methods
are compared at equal client counts in one run, each served in turn by a fresh server of
the same settings (`run_methods`).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import numpy as np

from s2d_jax.decode.methods import BASELINE


def one_request(http, model: str, prompt, max_tokens: int) -> dict:
    """One streamed completion of `prompt` (text or token ids) -> {"ttft", "tpot",
    "tokens", "seconds"}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = tokens = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
    end = time.perf_counter()
    first = end if first is None else first
    tokens = tokens or 0
    return {"ttft": first - start, "seconds": end - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


def run_load(url: str, model: str, prompts: list, clients: int, requests: int,
             max_tokens: int) -> dict:
    """`clients` concurrent clients send `requests` prompts in all (prompt i to client
    i mod clients, each client one request at a time) -> the load's figures."""
    import httpx

    def client(c: int) -> list[dict]:
        with httpx.Client(base_url=url, timeout=600) as http:
            return [one_request(http, model, prompts[i % len(prompts)], max_tokens)
                    for i in range(c, requests, clients)]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rows in pool.map(client, range(clients)) for r in rows]
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in done]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else None
    return {"clients": clients, "requests": len(done), "seconds": wall,
            "requests_per_s": len(done) / wall,
            "output_tokens_per_s": sum(r["tokens"] for r in done) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99)}


def alone_rate(engine, prompts: list, max_tokens: int) -> float:
    """Output tokens/s of the server's own decoder on each prompt alone (Decoder.generate
    at batch 1, no server, no other request): the single-request rate the 1-client load
    is compared with. One untimed pass compiles."""
    dec, rate = engine.decoder, 0.0
    for timed in (False, True):
        tokens, start = 0, time.perf_counter()
        for p in prompts:
            out = dec.generate([list(p)], max_new_tokens=max_tokens, eos_id=engine.eos_id)
            tokens += len(out[0]["token_ids"])
        rate = tokens / (time.perf_counter() - start)
    return rate


def run_methods(start_server, methods, prompts, client_counts, requests_per_client: int,
                max_tokens: int, progress=print) -> list[dict]:
    """For each method: `start_server(method)` -> a started server.launch.Server; one warm
    request, then a load per client count (clients x requests_per_client requests).
    Token-id prompts that do not fit a slot with max_tokens are left out."""
    from s2d_jax.errors import S2DError
    rows = []
    for method in methods:
        server = start_server(method)
        try:
            room = server.engine.max_len - max_tokens
            fitting = [p for p in prompts if isinstance(p, str) or len(p) <= room]
            if not fitting:
                raise S2DError(f"no prompt fits a slot of {server.engine.max_len} tokens with "
                               f"{max_tokens} new ones; raise --slot-len or lower --max-new-tokens")
            if len(fitting) < len(prompts):
                progress(f"{len(prompts) - len(fitting)} prompt(s) longer than {room} tokens "
                         f"left out")
            prompts = fitting
            run_load(server.url, server.model, prompts[:1], 1, 1, 4)  # first-request costs
            alone = alone_rate(server.engine, prompts[:requests_per_client], max_tokens)
            for clients in client_counts:
                before = dict(server.engine.chunks)
                row = {"method": method, **run_load(server.url, server.model, prompts,
                                                    clients, clients * requests_per_client,
                                                    max_tokens)}
                ran = {k: v - before.get(k, 0) for k, v in server.engine.chunks.items()}
                row["speculative_chunks"] = ran.get("speculative", 0) / max(sum(ran.values()), 1)
                row["alone_tokens_per_s"] = alone
                progress(format_row(row))
                rows.append(row)
        finally:
            server.stop()
    return rows


COLUMNS = [("method", "method", "{}"), ("clients", "clients", "{}"),
           ("requests", "requests", "{}"), ("requests_per_s", "req/s", "{:.2f}"),
           ("output_tokens_per_s", "out tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 ms", "ms"),
           ("ttft_p99_s", "TTFT p99 ms", "ms"), ("tpot_p50_s", "TPOT p50 ms", "ms"),
           ("tpot_p99_s", "TPOT p99 ms", "ms"), ("speculative_chunks", "spec. chunks", "{:.2f}"),
           ("alone_tokens_per_s", "alone tok/s", "{:.1f}")]


def _cell(value, fmt):
    if value is None:
        return "-"
    return f"{value * 1000:.1f}" if fmt == "ms" else fmt.format(value)


def format_row(row: dict) -> str:
    return "  ".join(f"{head} {_cell(row.get(key), fmt)}" for key, head, fmt in COLUMNS)


def table(rows: list[dict]) -> str:
    """A markdown table of the loads, with each method's tokens/s over AR's at the same
    client count where AR ran."""
    ar = {r["clients"]: r for r in rows if r["method"] == BASELINE}
    heads = [h for _, h, _ in COLUMNS] + ["vs AR", "alone vs AR alone"]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for r in rows:
        base = ar.get(r["clients"])
        ratios = [f"{r[k] / base[k]:.2f}x" if base and r.get(k) and base.get(k) else "-"
                  for k in ("output_tokens_per_s", "alone_tokens_per_s")]
        lines.append("| " + " | ".join(_cell(r.get(k), f) for k, _, f in COLUMNS)
                     + f" | {' | '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> bool:
    """Output tokens/s against clients, one line per method; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ax.plot([r["clients"] for r in mine], [r["output_tokens_per_s"] for r in mine],
                marker="o", label=method)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
