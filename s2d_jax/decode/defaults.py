"""The buffer sizes and checks every decoding entry point shares (serving, benchmarks,
calibration, CLIs), so that one decision is made in one place (the methods and their
defaults: decode/methods.py).

Buffer sizes are static shapes of the compiled generation: rounding them to buckets lets
one compilation serve every prompt / budget that lands in the same bucket.
"""

from __future__ import annotations

from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError

# new tokens per answer unless asked otherwise: one default for generate, chat, serve,
# bench and the Python API (s2d_jax.generate, Chat, the server's requests)
DEFAULT_MAX_NEW_TOKENS = 128
PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this
BUFFER_BUCKET = 64  # the token / KV-cache buffer per row is a multiple of this


def max_gamma(context: int) -> int:
    """The most draft tokens a round fits in `context` positions: after a prompt of >= 1
    token it needs gamma draft slots, one bonus slot and one verify slot."""
    return context - 3


def check_gamma(gamma: int, context: int, model: str, flag: str = "--gamma",
                source: str = "max_position_embeddings", given: bool = True) -> None:
    """`gamma` draft tokens must fit the context (max_gamma; `source` says where
    its length comes from; `given`: the user passed it, else it is the default)."""
    if gamma > max_gamma(context):
        what = f"{flag} {gamma}" if given else f"the default gamma {gamma}"
        fix = (f"use {flag} <= {max_gamma(context)}" if max_gamma(context) >= 1 else
               "it is too short to draft a token; use --method ar")
        raise S2DError(f"{what} does not fit the context of {model} ({context} positions, "
                       f"{source}); {fix}")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def prompt_width(longest: int, context: int | None = None) -> int:
    """Padded prompt width for prompts of at most `longest` tokens (at most `context`)."""
    width = round_up(longest, PROMPT_BUCKET)
    return width if context is None else min(width, context)


# A conversation's prompt is padded to a power of two of at least this width: each turn's
# prompt grows by the answer before it, and a new width is a new program to compile, so
# the first turn's width must hold the second turn (a prompt and a full-length answer).
CONVERSATION_WIDTH = 512


def conversation_width(longest: int, context: int) -> int:
    """Padded prompt width of a conversation turn of `longest` tokens (at most `context`)."""
    width = CONVERSATION_WIDTH
    while width < longest:
        width *= 2
    return min(width, context)


def buffer_len(prompt_width: int, max_new_tokens: int, round_span: int,
               context: int | None = None) -> int:
    """Token / cache slots per row: the padded prompt, the new tokens and one round's span
    (so the rounds up to max_new_tokens keep whole blocks; only a full buffer shrinks them,
    round.py), rounded up to BUFFER_BUCKET and capped at `context` (the smallest
    max_position_embeddings of the models involved)."""
    slots = round_up(prompt_width + max_new_tokens + round_span, BUFFER_BUCKET)
    return slots if context is None else min(slots, context)


def draft_exits(extra: dict, draft_cfg: ModelConfig) -> tuple[int, ...]:
    """A sorted draft's exits as stored with it (`s2d_exits` in its config.json), else one
    exit at its full depth."""
    from s2d_jax.model.sorted_draft import stored_exits  # jax: only once a draft is loaded
    return stored_exits(extra, draft_cfg)


def tokenizer_eos_id(tok) -> int:
    """The tokenizer's EOS id as a decode setting (-1 = no EOS: stop on the budget only)."""
    return tok.eos_id if tok.eos_id is not None else -1


def eos_id_or_default(eos_id: int | None, target_cfg: ModelConfig) -> int:
    """An explicit EOS id, or the target config's `eos_token_id` when none is given."""
    return target_cfg.eos_token_id if eos_id is None else eos_id
