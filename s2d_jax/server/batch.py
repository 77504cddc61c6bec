"""The Python API's many-prompt, stop-string and streaming generation (`s2d_jax.generate`
with a list of prompts, `stop=` or `stream=True`) on the slot engine, on the caller's
thread: the same Request, engine and stop handling as the server.

Results are `generate`'s dicts ("text", "token_ids", "prompt_ids", "stats", "summary")
plus "finish_reason" (stop: an EOS or a stop string; length: the budget). A stream yields
{"index": i, "text": piece} as prompt i's answer grows and {"index": i, "result": dict}
when it ends, answers interleaved as their slots run.
"""

from __future__ import annotations

import collections

from s2d_jax.errors import S2DError


def is_prompt_list(prompt) -> bool:
    """A list of prompts (strings or message lists), not one conversation's messages."""
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and all(isinstance(p, (str, list, tuple)) for p in prompt))


def _engine(prompts: list, target, draft, method, chat_template, max_new_tokens, load_kw,
            slots):
    from s2d_jax.data.prompts import end_of_turn_id, messages_ids, resolve_template
    from s2d_jax.decode.chat import as_messages, load_decoder
    from s2d_jax.decode.defaults import buffer_len, prompt_width
    from s2d_jax.server.slots import SlotEngine

    decoder, tok, _ = load_decoder(target, draft, method=method, **load_kw)
    template, _ = resolve_template(tok, chat_template)
    ids = [messages_ids(tok, template, as_messages(p)) for p in prompts]
    longest = max(len(i) for i in ids)
    if longest >= decoder.context:
        raise S2DError(f"a prompt of {longest} tokens does not fit the context of "
                       f"{decoder.context} tokens with a new token; shorten the prompt")
    max_len = min(buffer_len(prompt_width(longest), max_new_tokens, 0), decoder.context)
    slots = min(len(ids), slots)
    engine = SlotEngine(decoder, tok, slots=slots, max_len=max_len,
                        eos_id=end_of_turn_id(tok, template))
    return engine, ids


def summary_line(stats: dict, method: str) -> str:
    """A slot's figures as one readable line (decode/stats_line.py's wording)."""
    per_call = stats["tokens_per_target_call"]
    line = (f"{stats['new_tokens']} new tokens in {stats['target_calls']} target calls"
            + (f" ({per_call:.2f} tokens per call)" if per_call is not None else ""))
    from s2d_jax.decode.methods import proposer
    if not proposer(method).proposes:
        return line + "; no draft (ar)"
    acc = stats["draft_acceptance"]
    return line + f"; proposed {stats['drafted']} tokens" + (
        f", {acc:.2f} of them accepted" if acc is not None else "")


def _as_dict(result, prompt_ids: list[int], method: str) -> dict:
    return {"text": result.text, "token_ids": result.token_ids, "prompt_ids": prompt_ids,
            "reply": result.text.strip(), "finish_reason": result.finish_reason,
            "stats": {**result.stats, "method": method},
            "summary": summary_line(result.stats, method)}


def generate_batch(prompts: list, target, draft=None, *, method="s2d", chat_template="auto",
                   max_new_tokens=128, temperature=0.0, top_p=1.0, seed=0, stop=(),
                   stream=False, slots=8, **load_kw):
    """One result dict per prompt (see the module docstring), or with stream=True an
    iterator of events. load_kw: load_decoder's gamma, thresholds, exit, exits, dtype."""
    from s2d_jax import validate
    from s2d_jax.server.request import Request

    validate.switch(stream, "stream")
    validate.integer(slots, "slots", 1)
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    stop=[stop] if isinstance(stop, str) else stop)  # Request checks it
    Request((1,), seed=seed, **settings)  # every setting checked before anything loads
    engine, ids = _engine(prompts, target, draft, method, chat_template, max_new_tokens,
                          load_kw, slots)
    # as a lone prompt's generate: the answer ends where the buffer (the context) is full
    requests = [Request(tuple(i), seed=(seed + k) % 2**31, **{
        **settings, "max_new_tokens": min(max_new_tokens, engine.max_len - len(i))})
        for k, i in enumerate(ids)]
    method = engine.spec.method
    if not stream:
        return [_as_dict(res, i, method) for res, i in zip(engine.run(requests), ids)]
    return _stream(engine, requests, ids, method)


def _stream(engine, requests, ids, method):
    events: collections.deque = collections.deque()
    jobs = [engine.submit(r, lambda e, k=k: events.append((k, e)))
            for k, r in enumerate(requests)]
    while True:
        while events:
            k, e = events.popleft()
            if e["type"] == "text":
                yield {"index": k, "text": e["text"]}
            elif e["type"] == "done":
                yield {"index": k, "result": _as_dict(e["result"], ids[k], method)}
        if all(j.finished.is_set() for j in jobs):
            return
        engine.step()


class SlotDecoder:
    """Decoder.generate's interface (token-id prompts -> [{"token_ids", "stats"}]) on a
    slot engine of `slots` slots of `max_len` tokens: the prompts of a call share the
    slots, a finished answer's slot going to the next prompt (the data engine's answers
    stage: python -m train.data_engine --slots). Greedy answers equal Decoder.generate's;
    sampled ones are other draws of the same distribution. One engine per EOS id."""

    def __init__(self, decoder, tokenizer, *, slots: int, max_len: int,
                 chunk_rounds: int = 4):
        from s2d_jax import validate
        self.decoder, self.tok = decoder, tokenizer
        self.slots = validate.integer(slots, "slots", 1)
        self.max_len = min(validate.integer(max_len, "max_len", 2), decoder.context)
        self.chunk_rounds = chunk_rounds
        self.engines: dict = {}

    def generate(self, prompts, *, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
                 **unused) -> list[dict]:
        from s2d_jax import validate
        from s2d_jax.server.request import Request
        from s2d_jax.server.slots import SlotEngine

        if unused.get("top_k"):
            raise S2DError("the slot engine samples with temperature and top_p; top_k must be 0")
        prompts = validate.token_prompts(prompts)
        if eos_id not in self.engines:
            self.engines[eos_id] = SlotEngine(self.decoder, self.tok, slots=self.slots,
                                              max_len=self.max_len,
                                              chunk_rounds=self.chunk_rounds, eos_id=eos_id)
        engine = self.engines[eos_id]
        requests = [Request(tuple(p), max_new_tokens=min(max_new_tokens, self.max_len - len(p)),
                            temperature=temperature, top_p=top_p, seed=(seed + k) % 2**31)
                    for k, p in enumerate(prompts)]
        return [{"token_ids": r.token_ids, "stats": r.stats} for r in engine.run(requests)]
