"""The corpus's answers on the slot engine (server/slots.py): the prompts of many shards
stream through one engine, every prompt at every temperature, so the slots stay full across
shard boundaries, and each shard is handed over as soon as its last answer ends.

A shard's rows are data/engine.answer_shard's (temperature-major, then prompt order); each
request's seed depends only on (seed, shard, temperature, prompt), so a shard depends only
on its prompts and index. Greedy rows equal the batched decoder's; sampled ones are other
draws of the same distribution. A prompt the slots cannot hold with its answer (longer than
`max_len - max_new_tokens`) is answered by the batched decoder instead, alone.
"""

from __future__ import annotations

import collections
from typing import Callable

from s2d_jax.data.engine import ANSWER_TEMPERATURES


def request_seed(seed: int, shard: int, temperature_index: int, prompt_index: int) -> int:
    batch = seed + len(ANSWER_TEMPERATURES) * shard + temperature_index  # answer_shard's
    return (batch * 100_003 + prompt_index) % 2**31


def stream_shards(engine, decoder, tok, shards: list[tuple[int, list[str]]], *, seed: int,
                  max_new_tokens: int, on_shard: Callable[[int, list[dict]], None],
                  ahead: int | None = None) -> None:
    """Answer every (k, prompts) of `shards` on `engine` (a SlotEngine of the target with
    its end-of-turn EOS); on_shard(k, rows) as each shard completes, in completion order.
    `ahead` (default: the slot count) requests wait beside the busy slots, so a slot that
    frees is refilled at once while shards still complete nearly in order."""
    from s2d_jax.data.distill import answer_rows
    from s2d_jax.data.prompts import prompt_ids, resolve_template
    from s2d_jax.server.request import Request

    template, _ = resolve_template(tok, "auto")
    ahead = engine.slots if ahead is None else ahead
    # a prompt's temperatures in a row: the slot engine prefills it once for all of them
    todo = collections.deque(
        (k, j, i, t, p) for k, prompts in shards for i, p in enumerate(prompts)
        for j, t in enumerate(ANSWER_TEMPERATURES))
    open_shards: dict[int, dict] = {}  # k -> {"prompts", "rows": {(j, i): row}, "jobs"}
    sizes = {k: len(prompts) * len(ANSWER_TEMPERATURES) for k, prompts in shards}

    def submit_more():
        while todo and engine.pending() < ahead:
            k, j, i, t, p = todo.popleft()
            shard = open_shards.setdefault(k, {"rows": {}, "jobs": {}})
            ids = prompt_ids(tok, template, [p])
            if len(ids) + max_new_tokens > engine.max_len:  # too long for the slots
                row = answer_rows(decoder, tok, [p], temperature=t, max_new_tokens=max_new_tokens,
                                  seed=request_seed(seed, k, j, i))[0]
                shard["rows"][(j, i)] = row
                continue
            request = Request(tuple(ids), max_new_tokens=max_new_tokens, temperature=t,
                              seed=request_seed(seed, k, j, i))
            shard["jobs"][(j, i)] = (engine.submit(request), ids, t, p)

    def collect():
        for k in list(open_shards):
            shard = open_shards[k]
            for key, (job, ids, t, p) in list(shard["jobs"].items()):
                if job.finished.is_set():
                    if job.result.finish_reason == "error":
                        raise RuntimeError(f"shard {k}: the slot engine failed a request")
                    shard["rows"][key] = {"input_ids": ids + list(job.result.token_ids),
                                          "learn_from": len(ids), "temperature": t,
                                          "prompt": p}
                    del shard["jobs"][key]
            if len(shard["rows"]) == sizes[k]:
                del open_shards[k]
                on_shard(k, [shard["rows"][key] for key in sorted(shard["rows"])])

    submit_more()
    while todo or open_shards:
        if engine.busy():
            engine.step()
        collect()
        submit_more()
