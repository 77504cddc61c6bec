"""One request, as the Python API, the CLIs and the server all hand it to the slot engine,
and what comes back: its tokens, text, why it ended and its speculation figures; a Job is
a submitted request inside the slot engine (server/slots.py).

A Request holds token ids (the caller renders and encodes the prompt: the server and the
API by the tokenizer's chat template, data/prompts.py) and the per-request settings the
slot engine decodes each slot with: max_new_tokens, temperature, top_p (traced per slot:
no recompilation) and stop strings (matched on the host between chunks). Every field is
checked on construction by the API's validators (s2d_jax/validate.py), so a bad value is
one clear S2DError wherever the request comes from.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from s2d_jax import validate
from s2d_jax.errors import S2DError
from s2d_jax.server.text import AnswerText

# OpenAI's two, then: the client left, the engine failed its chunk
FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_STOPS = 4  # OpenAI's limit on stop strings


@dataclasses.dataclass(frozen=True)
class Request:
    """prompt_ids: the prompt's token ids; max_new_tokens >= 1; temperature >= 0 (0 =
    greedy); top_p in (0, 1]; seed >= 0 (the first token's draw; later draws share the
    batch's key, so a sampled answer depends on its batch: greedy ones never do); stop: up
    to 4 non-empty strings that end the answer (not included in it)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        ids, = validate.token_prompts([self.prompt_ids], "prompt_ids")
        if not ids:
            raise S2DError("prompt_ids is empty; give at least one token (e.g. BOS)")
        object.__setattr__(self, "prompt_ids", tuple(ids))
        settings = validate.decode_settings(self.max_new_tokens, self.temperature, 0,
                                            self.top_p, self.seed)
        for name in ("max_new_tokens", "temperature", "top_p", "seed"):
            object.__setattr__(self, name, settings[name])
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        stop = validate.strings_list(stop, "stop")
        if len(stop) > MAX_STOPS or any(not s for s in stop):
            raise S2DError(f"stop must be at most {MAX_STOPS} non-empty strings, got "
                           f"{len(stop)} ({stop!r:.80})")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclasses.dataclass
class Result:
    """A finished request: token_ids (EOS included when it ended the answer, cut at a stop
    string), text (decoded, cut before the stop string), finish_reason (FINISH_REASONS)
    and stats: new_tokens, target_calls (rounds + the prefill's), tokens_per_target_call,
    drafted, accepted (draft tokens the target kept), draft_acceptance."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    prompt_tokens: int = 0


def speculation_stats(new_tokens: int, rounds: int, drafted: int, accepted: int) -> dict:
    """A request's speculation figures as vLLM reports them (tokens per target call,
    drafted / accepted); the prefill is the first target call."""
    calls = rounds + (new_tokens > 0)
    return {"new_tokens": new_tokens, "target_calls": calls,
            "tokens_per_target_call": new_tokens / calls if calls else None,
            "drafted": drafted, "accepted": accepted,
            "draft_acceptance": accepted / drafted if drafted else None}


@dataclasses.dataclass(eq=False)
class Job:
    """A submitted request while it waits, decodes and after it ends. `sink(event)` (from
    the engine's thread) gets {"type": "text", "text": piece} as the answer grows and
    {"type": "done", "result": Result} once; `cancel()` (any thread) frees its slot at the
    next chunk boundary."""

    request: Request
    sink: Callable[[dict], None] | None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    slot: int | None = None
    text: AnswerText | None = None
    result: Result | None = None
    first_token_at: float | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: dict) -> None:
        if self.sink is not None:
            self.sink(event)
