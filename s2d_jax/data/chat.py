"""The Vicuna v1.1 chat template (FastChat `vicuna_v1.1`) and assistant-only loss masks.

Rendering, exactly as FastChat's SeparatorStyle.ADD_COLON_TWO with sep " " and sep2 "</s>":
    "{system} USER: {q1} ASSISTANT: {a1}</s>USER: {q2} ASSISTANT: {a2}</s>"
and a generation prompt ends with "ASSISTANT:".

Token ids follow how Vicuna was trained (FastChat + the slow, legacy Llama tokenizer):
the text is cut at each "</s>", every piece is encoded by sentencepiece on its own (so
"USER" after "</s>" is "▁USER") and the pieces are joined with the EOS id. BOS comes first.

Loss mask: 1 on every token of each assistant reply and on its EOS, 0 elsewhere. The
space after "ASSISTANT:" belongs to the reply's first token ("▁Hello"), because
sentencepiece merges a space into the piece that follows; the mask therefore starts at
the first token at or after that space, which is also where FastChat's mask starts.

Conversation rows are ShareGPT: a list of {"from": role, "value": text} (also accepted:
{"role", "content"}). Rules (`parse_conversation`), FastChat's where it has one:
  - roles human/user -> USER, gpt/assistant/chatgpt -> ASSISTANT; a "system" turn is
    allowed only first and replaces the system prompt; any other role is malformed;
  - leading ASSISTANT turns are dropped (FastChat does the same);
  - turns must then alternate USER, ASSISTANT; a trailing USER turn without a reply is
    dropped (nothing to learn from it);
  - every value must be a non-empty string, and at least one reply must remain.
"""

from __future__ import annotations

from typing import Any, Sequence

from s2d_jax.errors import S2DError

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's "
                 "questions.")
USER, ASSISTANT = "USER", "ASSISTANT"
SEP, SEP2 = " ", "</s>"
_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT,
          "chatgpt": ASSISTANT, "system": "system"}


class MalformedConversation(S2DError):
    """A ShareGPT row that cannot be rendered; the data pipeline counts and skips these."""


def parse_conversation(turns: Any, system: str = VICUNA_SYSTEM) -> tuple[str, list[tuple[str, str]]]:
    """Validate a ShareGPT turn list: (system prompt, [(user, assistant), ...])."""
    if not isinstance(turns, (list, tuple)) or not turns:
        raise MalformedConversation("empty or missing conversation")
    parsed = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedConversation(f"turn {i} is not an object")
        # `or`: rows read by `datasets` carry every key of the file's schema, unused ones None.
        role = turn.get("from") or turn.get("role")
        value = turn.get("value") or turn.get("content")
        if not isinstance(role, str) or role.lower() not in _ROLES:
            raise MalformedConversation(f"turn {i} has unknown role {role!r}")
        if not isinstance(value, str) or not value:
            raise MalformedConversation(f"turn {i} has an empty or non-text value")
        parsed.append((_ROLES[role.lower()], value))
    if parsed[0][0] == "system":
        system, parsed = parsed[0][1], parsed[1:]
    while parsed and parsed[0][0] == ASSISTANT:
        parsed = parsed[1:]
    if parsed and parsed[-1][0] == USER:
        parsed = parsed[:-1]
    if not parsed:
        raise MalformedConversation("no USER turn followed by an ASSISTANT reply")
    for i, (role, _) in enumerate(parsed):
        if role != (USER, ASSISTANT)[i % 2]:
            raise MalformedConversation(f"turns do not alternate user/assistant ({role} at {i})")
    pairs = [(parsed[i][1], parsed[i + 1][1]) for i in range(0, len(parsed), 2)]
    return system, pairs


def vicuna_prompt(user_turns: Sequence[str], assistant_turns: Sequence[str] = (),
                  system: str = VICUNA_SYSTEM) -> str:
    """The generation prompt: the dialogue so far, ending with "ASSISTANT:"."""
    if len(user_turns) != len(assistant_turns) + 1:
        raise S2DError(f"vicuna_prompt needs one more user turn than assistant turns, got "
                       f"{len(user_turns)} and {len(assistant_turns)}")
    text = system + SEP
    for q, a in zip(user_turns[:-1], assistant_turns):
        text += f"{USER}: {q}{SEP}{ASSISTANT}: {a}{SEP2}"
    return text + f"{USER}: {user_turns[-1]}{SEP}{ASSISTANT}:"


def vicuna_prompt_ids(tok, user_turns: Sequence[str], assistant_turns: Sequence[str] = (),
                      system: str = VICUNA_SYSTEM) -> list[int]:
    """Ids of `vicuna_prompt`, as Vicuna was trained (see the module docstring): BOS, then
    each finished turn encoded on its own and closed by the EOS id, then the open turn.
    One user turn gives exactly tok.encode(vicuna_prompt([q]), bos=True)."""
    if len(user_turns) != len(assistant_turns) + 1:
        raise S2DError(f"vicuna_prompt_ids needs one more user turn than assistant turns, "
                       f"got {len(user_turns)} and {len(assistant_turns)}")
    if assistant_turns and tok.eos_id is None:
        raise S2DError(f"tokenizer {tok.path} has no EOS token, which the Vicuna template needs")
    ids = [tok.bos_id] if tok.bos_id is not None else []
    for k, (q, a) in enumerate(zip(user_turns, assistant_turns)):
        head = (system + SEP if k == 0 else "") + f"{USER}: {q}{SEP}{ASSISTANT}: {a}"
        ids += tok.encode(head, bos=False) + [tok.eos_id]
    last = ((system + SEP if not assistant_turns else "")
            + f"{USER}: {user_turns[-1]}{SEP}{ASSISTANT}:")
    return ids + tok.encode(last, bos=False)


def render_conversation(pairs: Sequence[tuple[str, str]], system: str = VICUNA_SYSTEM) -> str:
    """A whole training conversation as text, every reply closed by "</s>"."""
    return system + SEP + "".join(f"{USER}: {q}{SEP}{ASSISTANT}: {a}{SEP2}" for q, a in pairs)


def tokenize_conversation(tok, conversation, system: str = VICUNA_SYSTEM
                          ) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a conversation: a ShareGPT turn list or [(user, assistant), ...]."""
    if tok.eos_id is None:
        raise S2DError(f"tokenizer {tok.path} has no EOS token, which the Vicuna template needs")
    if conversation and isinstance(conversation[0], (tuple, list)):
        pairs = [tuple(p) for p in conversation]
    else:
        system, pairs = parse_conversation(conversation, system)
    ids = [tok.bos_id] if tok.bos_id is not None else []
    mask = [0] * len(ids)
    for k, (q, a) in enumerate(pairs):
        # One "</s>"-free chunk per turn; the reply is its tail after "ASSISTANT:".
        head = (system + SEP if k == 0 else "") + f"{USER}: {q}{SEP}{ASSISTANT}:"
        chunk_ids, offsets = tok.encode_with_offsets(head + SEP + a)
        reply_start = len(head)  # index of the separator space
        ids += chunk_ids + [tok.eos_id]
        mask += [int(end > reply_start) for _, end in offsets] + [1]
    return ids, mask
