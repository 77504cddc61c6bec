"""User turns written by the target itself (Magpie, Xu et al. 2024): prompts without a hub.

An instruction-tuned model's chat template, rendered up to where a user's text begins
(SmolLM2: its default system turn, then "<|im_start|>user\\n"), makes the model write a
plausible user message: sampled at T = 1 by this project's engine until the template's
end of a user turn, it yields prompts in the target's own distribution of requests. Turns
the budget cut off before their end are dropped (half a question is not one a user asks).
The decoder is passed in (decode ranks above data): an AR `Decoder` of the target.
"""

from __future__ import annotations

from s2d_jax.data.prompts import PROBE_TEXT, first_special_after, render_messages
from s2d_jax.errors import S2DError


def user_turn_prefix(tok) -> tuple[list[int], int]:
    """(ids of the chat template rendered up to a user message's text, the token that ends a
    user turn). Needs the tokenizer's own template."""
    if tok.chat_template is None:
        raise S2DError(f"tokenizer {tok.path} has no chat template; Magpie prompts need the "
                       f"target's own template")
    text = render_messages(tok, [{"role": "user", "content": PROBE_TEXT}],
                           generation_prompt=False)
    if PROBE_TEXT not in text:
        raise S2DError(f"the chat template of {tok.path} does not write the user's text; "
                       f"Magpie prompts need a template that does")
    end = first_special_after(tok, text, tok.eos_id if tok.eos_id is not None else -1)
    if end < 0:
        raise S2DError(f"the chat template of {tok.path} ends a user turn with no special "
                       f"token and the tokenizer has no EOS; Magpie prompts cannot stop")
    return tok.encode_rendered(text[:text.index(PROBE_TEXT)]), end


def sample_user_turns(decoder, tok, count: int, *, max_new_tokens: int = 96,
                      batch_size: int = 16, seed: int = 0, temperature: float = 1.0,
                      log=print) -> list[str]:
    """Up to `count` user turns sampled by `decoder` (batches of `batch_size` copies of the
    prefix, seed + batch index), each finished by the end-of-turn token; those the budget
    cut off, and empty ones, are dropped, so fewer may come back."""
    prefix, end = user_turn_prefix(tok)
    out = []
    for b in range(-(-count // batch_size)):
        rows = min(batch_size, count - b * batch_size)
        res = decoder.generate([prefix] * rows, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed + b, eos_id=end)
        for r in res:
            ids = r["token_ids"]
            if ids and ids[-1] == end:
                text = tok.decode(ids[:-1]).strip()
                if text:
                    out.append(text)
        log(f"[magpie] batch {b + 1}/{-(-count // batch_size)}: {len(out)} user turns")
    return out
