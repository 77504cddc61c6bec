"""Conversations for the API (`s2d_jax.generate`, `s2d_jax.Chat`) and `python -m infer.chat`.

A `Chat` loads its target (and draft) once and keeps the messages of a conversation. Each
turn re-encodes the whole conversation in the chat template and decodes it from a fresh
prefill: the engine's K/V caches live inside one jitted generation (engine.py) and are not
kept between calls, so the K/V of earlier turns is recomputed, not reused. The prompt of a
turn is exactly what `prompt_ids` builds for Spec-Bench's MT-bench turns (earlier answers
as `reply_text`), so greedy answers of any method equal AR's in every turn.
"""

from __future__ import annotations

from typing import Callable

from s2d_jax.decode.methods import AUTO
from s2d_jax.errors import S2DError


def load_decoder(target: str, draft: str | None = None, *, method: str = AUTO,
                 gamma: int | None = None, thresholds=None, exit: int | None = None,
                 exits=None, dtype: str | None = None):
    """(Decoder, tokenizer, notes) for one target: `method` "auto" (the default) decodes with
    the method the target's calibration chose, else as "s2d" (decode/auto_method.py);
    "s2d" escalates over `exits`
    (default: the target's calibrated `s2d_serving.json` when it has one, else the draft's
    `s2d_exits`), "sd" drafts with the draft cut at `exit` (default its depth), "self" with
    the target's first `exit` layers, "lookup" from the context alone (no draft), "ladder"
    the lookup then S2D's exits, "ar" not at all (decode/methods.py). gamma and thresholds
    default to the calibrated setting when it matches the exits, else DEFAULT_GAMMA and
    0.5 per exit (0 at the last): serving_config.resolve decides (decoder.setting). notes: lines for the user (a calibrated setting
    measured slower than AR, or not fitting the draft)."""
    from s2d_jax.decode.methods import CHOICES, is_auto, proposer
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.decode.auto_method import auto_target_setting
    from s2d_jax.decode.serving_config import target_setting
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import has_tokenizer, load_tokenizer
    from s2d_jax.readers import expand_path

    from s2d_jax import validate
    from s2d_jax.config import DTYPES
    from s2d_jax.env import resolve_model
    target = resolve_model(validate.path(target, "target"))  # a path, or `smollm2`
    draft = validate.path(draft, "draft", optional=True)
    draft = draft if draft is None else resolve_model(draft)
    validate.model_setting(method, CHOICES, gamma, thresholds, exit, exits, dtype, DTYPES)
    asked = method
    if is_auto(method):  # the calibration's choice: whether it needs the draft, before loading
        from s2d_jax.decode.auto_method import target_choice
        method = target_choice(expand_path(target), draft is not None).method
    row = proposer(method)
    if row.needs_draft and draft is None:
        raise S2DError(f"method {method} needs a draft model; pass draft=PATH (--draft)")
    if row.self_draft and not exit:
        raise S2DError(f"method {method} needs exit=N (--exit): how many target layers draft")
    target = expand_path(target)
    cfg, params, _ = load_model(target, dtype=dtype)
    tok = load_tokenizer(target)
    draft_cfg = draft_params = draft_tok = extra = None
    if row.needs_draft:
        from s2d_jax.io.checkpoint import load_draft
        draft = expand_path(draft)
        draft_cfg, draft_params, extra = load_draft(draft, params, dtype=dtype)
        draft_tok = load_tokenizer(draft) if has_tokenizer(draft) else None
    if is_auto(asked):
        setting = auto_target_setting(target, cfg, draft_cfg, extra, exits=exits, exit=exit,
                                      thresholds=thresholds, gamma=gamma)
    else:
        setting = target_setting(method, target, cfg, draft_cfg, extra, exits=exits, exit=exit,
                                 thresholds=thresholds, gamma=gamma)
    decoder = Decoder(cfg, params, setting, draft_cfg=draft_cfg, draft_params=draft_params,
                      target_tokenizer=tok, draft_tokenizer=draft_tok)
    return decoder, tok, [setting.note] if setting.note else []


def as_messages(prompt) -> list[dict]:
    """A prompt string as one user message; a list of messages as it is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


class Chat:
    """A conversation with one target (see the module docstring: each turn re-encodes the
    whole conversation). `say(text)` answers a user turn and keeps both in `messages`;
    `answer(messages)` answers a given conversation and keeps nothing; `reset()` forgets.

    chat_template: "auto" (the tokenizer's own template; without one, the text as is after
    BOS, as "none"), "vicuna" or "none". Decoding settings (max_new_tokens, temperature,
    top_k, top_p, seed) are the defaults of every turn; `say` / `answer` take overrides.
    """

    def __init__(self, target: str, draft: str | None = None, *, method: str = AUTO,
                 chat_template: str = "auto", system: str | None = None,
                 gamma: int | None = None, thresholds=None, exit: int | None = None,
                 exits=None, dtype: str | None = None, **decode):
        from s2d_jax import validate
        from s2d_jax.data.prompts import end_of_turn_id, resolve_template

        validate.choice(chat_template, "chat_template", ("auto", "vicuna", "none"))
        validate.text(system, "system", optional=True, nonempty=False)
        from s2d_jax.decode.defaults import DEFAULT_MAX_NEW_TOKENS
        self.decode = self._settings(dict(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=0.0, top_k=0,
                                          top_p=1.0, seed=0), decode)
        self.decoder, self.tokenizer, self.notes = load_decoder(
            target, draft, method=method, gamma=gamma, thresholds=thresholds, exit=exit,
            exits=exits, dtype=dtype)
        self.template, note = resolve_template(self.tokenizer, chat_template)
        self.notes += [note] if note else []
        self.eos_id = end_of_turn_id(self.tokenizer, self.template)
        self.system = system
        self.messages: list[dict] = []
        self.turns: list[dict] = []  # stats of each answered turn since the last reset

    @staticmethod
    def _settings(defaults: dict, overrides: dict) -> dict:
        from s2d_jax.validate import decode_settings
        unknown = set(overrides) - set(defaults)
        if unknown:
            raise S2DError(f"unknown decoding setting(s) {', '.join(sorted(unknown))}; use "
                           f"{', '.join(defaults)}")
        return decode_settings(**{**defaults, **overrides})

    def reset(self) -> None:
        self.messages, self.turns = [], []

    def keep(self, text: str, reply: str) -> None:
        """Keep a user turn whose answer was stopped, with the part of it shown (the
        conversation goes on from there, as it reads on the screen)."""
        from s2d_jax import validate  # checked like say's text: not an AttributeError
        validate.text(text, "text")
        validate.text(reply, "reply", nonempty=False)  # nothing shown yet is a reply too
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": reply.strip()}]

    def say(self, text: str, on_text: Callable[[str], None] | None = None, **decode) -> dict:
        """Answer the user's `text` after the conversation so far and keep both turns."""
        if not isinstance(text, str) or not text.strip():
            raise S2DError("a user turn must be non-empty text")
        from s2d_jax.validate import callable_or_none
        callable_or_none(on_text, "on_text")
        out = self.answer(self.messages + [{"role": "user", "content": text}], on_text,
                          **decode)
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": out["reply"]}]
        self.turns.append(out["stats"])
        return out

    def answer(self, messages, on_text: Callable[[str], None] | None = None,
               **decode) -> dict:
        """-> {"text", "token_ids", "prompt_ids", "reply" (the text the conversation keeps),
        "stats", "summary" (stats_line)}. on_text(piece) streams the answer round by round."""
        from s2d_jax.data.prompts import messages_ids, reply_text, split_messages
        from s2d_jax.decode.stats_line import stats_line
        from s2d_jax.validate import callable_or_none

        callable_or_none(on_text, "on_text")
        messages = as_messages(messages)
        split_messages(messages)  # one clear error for a malformed list, before the system's
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}] + list(messages)
        ids = messages_ids(self.tokenizer, self.template, messages)
        settings = self._settings(self.decode, decode)
        # a different seed per turn, so sampled turns do not repeat each other's draws
        settings["seed"] = (settings["seed"] + len(messages) // 2) % 2**31  # stays int32
        stream = TextStream(self.tokenizer, on_text) if on_text is not None else None
        from s2d_jax.decode.defaults import conversation_width
        # one padded width for the turns of a conversation: turn 2 runs turn 1's programs
        out, = self.decoder.generate([ids], eos_id=self.eos_id, **settings,
                                     chunk_rounds=1 if stream else 0, on_chunk=stream,
                                     width=conversation_width(len(ids), self.decoder.context))
        text = self.tokenizer.decode(out["token_ids"])
        if stream is not None:
            stream.show(text)
        return {"text": text, "token_ids": out["token_ids"], "prompt_ids": ids,
                "reply": reply_text(self.tokenizer, out["token_ids"]), "stats": out["stats"],
                "summary": stats_line(out["stats"])}

    def summary(self) -> str:
        """The conversation's totals since the last reset, as one readable line."""
        from s2d_jax.decode.stats_line import stats_line

        if not self.turns:
            return "no turns yet"
        return f"{len(self.turns)} turn(s): " + stats_line(total_stats(self.turns))


def total_stats(turns: list[dict]) -> dict:
    """Per-turn stats summed into one stats dict of the fields stats_line reads."""
    first = turns[0]
    new = sum(s["new_tokens"] for s in turns)
    calls = sum(s["target_calls"] for s in turns)
    seconds = sum(s["batch_seconds"] for s in turns)
    by_exit: dict = {}
    for s in turns:
        for e, n in s["drafted_by_exit"].items():
            by_exit[e] = by_exit.get(e, 0) + n
    drafted = sum(by_exit.values())
    kept = sum((s["draft_acceptance"] or 0.0) * sum(s["drafted_by_exit"].values())
               for s in turns)
    return {"method": first["method"], "new_tokens": new, "target_calls": calls,
            "tokens_per_target_call": new / calls if calls else None,
            "drafted_by_exit": by_exit,
            "draft_acceptance": kept / drafted if drafted else None,
            "batch_tokens_per_s": new / seconds if seconds > 0 else None,
            "compile_seconds": sum(s["compile_seconds"] for s in turns)}


class TextStream:
    """on_chunk for Decoder.generate: hands each newly decoded piece of row 0 to `emit`
    (`show(text)` hands on the rest of a finished text)."""

    def __init__(self, tok, emit: Callable[[str], None]):
        self.tok, self.emit, self.printed = tok, emit, ""

    def __call__(self, state) -> None:
        import jax  # this module loads before JAX starts (the CLIs' checks)
        # one transfer of row 0, sliced on the host: slicing the device array at [lo:hi]
        # compiled a new slice program for every new length (every chunk)
        tokens, lo, hi = jax.device_get((state.tokens[0], state.prompt_len[0], state.length[0]))
        self.show(self.tok.decode(tokens[int(lo):int(hi)].tolist()))

    def show(self, text: str) -> None:
        # a piece ending inside a multi-byte character decodes differently once complete:
        # emit only text that extends what is already out
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.emit(text[len(self.printed):])
            self.printed = text
