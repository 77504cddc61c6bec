"""Question files (Spec-Bench / MT-bench jsonl: question_id, category, turns) -> prompts,
and the one place prompts are rendered in a chat template for every CLI.

Templates (`--chat-template`):
  - auto: the tokenizer's own template (tokenizer_config.json / GGUF metadata) through
    transformers' `apply_chat_template(..., add_generation_prompt=True)`; the text is then
    tokenized with special-token strings as their ids and nothing added (the template
    already holds BOS where the model wants it, as transformers' own tokenize=True does).
    Without a template: none (AUTO_FALLBACK, `resolve_template`), in every CLI and the API.
  - vicuna: Vicuna v1.1 with sentencepiece-exact ids (s2d_jax.data.chat).
  - none: the user text as is after BOS; later turns are joined with blank lines.
"""

from __future__ import annotations

import json
import os

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_text


TEMPLATES = ("auto", "vicuna", "none")
PROBE_TEXT = "\u2063reply\u2063"  # text no template rewrites, to find what follows a turn


# What `auto` renders when the tokenizer has no chat template, in every entry point and the
# API alike: the text as is (a Vicuna-family target takes --chat-template vicuna).
AUTO_FALLBACK = "none"


def resolve_template(tok, choice: str) -> tuple[str, str | None]:
    """The template to render with, and a note for stderr when `auto` had to fall back
    (the tokenizer has no chat template) to AUTO_FALLBACK."""
    fallback = AUTO_FALLBACK
    if choice not in TEMPLATES:
        raise S2DError(f"unknown chat template {choice!r}; use {', '.join(TEMPLATES)}")
    if choice != "auto" or tok.chat_template is not None:
        return choice, None
    return fallback, (f"note: tokenizer {tok.path} has no chat template; --chat-template "
                      f"auto renders prompts as {fallback}")


def render_chat(tok, user_turns, assistant_turns=()) -> str:
    """The tokenizer's own template rendered for [user 1, assistant 1, ..., user n] with the
    assistant's generation header at the end."""
    messages = []
    for k, q in enumerate(user_turns):
        messages.append({"role": "user", "content": q})
        if k < len(assistant_turns):
            messages.append({"role": "assistant", "content": assistant_turns[k]})
    return render_messages(tok, messages)


def render_messages(tok, messages: list[dict], generation_prompt: bool = True) -> str:
    """The tokenizer's own template rendered for chat messages ({"role", "content"}) with
    the assistant's generation header at the end (unless generation_prompt is False)."""
    if tok.chat_template is None:
        raise S2DError(f"tokenizer {tok.path} has no chat template; use --chat-template "
                       f"vicuna or none")
    try:
        return tok.hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                          tokenize=False)
    except Exception as e:  # Jinja raises assorted types (its own raise_exception included)
        raise S2DError(f"the chat template of {tok.path} fails to render ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); use --chat-template "
                       f"vicuna or none") from e


def split_messages(messages) -> tuple[str | None, list[str], list[str]]:
    """Chat messages -> (system text or None, user turns, assistant turns), refusing
    anything but an optional system message first, then user and assistant alternating,
    ending with a user turn (the one to answer)."""
    if isinstance(messages, str) or not isinstance(messages, (list, tuple)) or not messages:
        raise S2DError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                       "dicts, e.g. [{'role': 'user', 'content': 'Hi'}]")
    system, users, assistants = None, [], []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ("system", "user", "assistant")):
            raise S2DError(f"message {i} is not {{'role': 'system'|'user'|'assistant', "
                           f"'content': str}}; got {m!r:.80}")
        expected = "user" if len(users) == len(assistants) else "assistant"
        if m["role"] == "system" and i == 0:
            system = m["content"]
        elif m["role"] != expected:
            raise S2DError(f"message {i} has role {m['role']!r} where {expected!r} comes next; "
                           f"alternate user and assistant (a system message only first)")
        else:
            (users if expected == "user" else assistants).append(m["content"])
    if len(users) != len(assistants) + 1:
        raise S2DError("the last message must be the user's (the turn to answer)")
    return system, users, assistants


def messages_ids(tok, template: str, messages) -> list[int]:
    """Token ids of the generation prompt for chat messages in `template` (resolved: auto,
    vicuna or none); a system message needs the tokenizer's own template."""
    system, users, assistants = split_messages(messages)
    if template == "auto":
        return tok.encode_rendered(render_messages(tok, list(messages)))
    if system is not None:
        raise S2DError(f"the {template} template has no system message; drop it or use a "
                       f"tokenizer with its own chat template")
    return prompt_ids(tok, template, users, assistants)


def reply_text(tok, ids) -> str:
    """An answer's ids as the conversation holds it for the next turn (as Spec-Bench puts
    an answer into MT-bench's second turn): decoded, special tokens dropped, stripped."""
    return tok.decode(ids).strip()


def prompt_ids(tok, template: str, user_turns, assistant_turns=()) -> list[int]:
    """Token ids of the generation prompt for a conversation (`template`: auto, vicuna or
    none, already resolved), assistant_turns being the replies given so far."""
    user_turns, assistant_turns = list(user_turns), list(assistant_turns)
    if len(user_turns) != len(assistant_turns) + 1:
        raise S2DError(f"a prompt needs one more user turn than assistant turns, got "
                       f"{len(user_turns)} and {len(assistant_turns)}")
    if template == "auto":
        return tok.encode_rendered(render_chat(tok, user_turns, assistant_turns))
    if template == "vicuna":
        from s2d_jax.data.chat import vicuna_prompt_ids
        return vicuna_prompt_ids(tok, user_turns, assistant_turns)
    if template == "none":
        turns = [t for pair in zip(user_turns, assistant_turns) for t in pair]
        return tok.encode("\n\n".join(turns + user_turns[-1:]), bos=True)
    raise S2DError(f"unknown chat template {template!r}; use {', '.join(TEMPLATES)}")


def end_of_turn_id(tok, template: str) -> int:
    """The token ending the assistant's turn, where generation stops (-1: none, stop on the
    budget). For auto, the first special token the template puts after a reply (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>); the tokenizer's EOS otherwise."""
    eos = tok.eos_id if tok.eos_id is not None else -1
    if template != "auto":
        return eos
    return first_special_after(tok, render_chat(tok, ["q", "q"], [PROBE_TEXT]), eos)


def first_special_after(tok, text: str, default: int) -> int:
    """The first special token the rendered `text` holds after PROBE_TEXT (what a template
    closes a turn with), else `default`."""
    tail = text[text.index(PROBE_TEXT) + len(PROBE_TEXT):] if PROBE_TEXT in text else ""
    special = set(tok.hf.all_special_ids) | {int(i) for i in tok.hf.added_tokens_decoder}
    return next((i for i in tok.encode_rendered(tail) if i in special), default)


# Spec-Bench's six tasks: its MT-bench questions (8 categories) are one task, "mt_bench".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities")


def task_of(category) -> str:
    """The Spec-Bench task of a question category (MT-bench's categories -> mt_bench)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else str(category)


def read_questions(path: str, categories=None, max_prompts: int | None = None) -> list[dict]:
    """[{question_id, category, task, target, text (first turn), turns (all)}], filtered by
    category or task; with max_prompts, the first N taken round-robin over the tasks
    (`task_of`; within MT-bench, over its categories). `target` is an optional per-line
    field naming the target a multi-target engine routes the prompt to."""
    if not os.path.exists(path):  # a directory or /dev/null: read_text says what it is
        raise S2DError(f"questions file {path} does not exist; check the path")
    out = []
    for n, line in enumerate(read_text(path, "questions file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row["turns"], list):  # a bare string would give its 1st char
                raise TypeError
            text = row["turns"][0]
            if not all(isinstance(t, str) and t for t in row["turns"]):
                raise TypeError
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise S2DError(f"{path}:{n} is not a JSON line with a non-empty 'turns' list; "
                           f"write one {{\"turns\": [\"...\"]}} object per line (Spec-Bench / "
                           f"MT-bench format)")
        out.append({"question_id": row.get("question_id", n), "category":
                    row.get("category"), "task": task_of(row.get("category")),
                    "target": row.get("target"), "text": text, "turns": list(row["turns"]),
                    "reference": row.get("reference")})
    if not out:
        raise S2DError(f"questions file {path} holds no prompts; write one JSON line with a "
                       f"'turns' list per prompt")
    if categories:
        known = sorted({str(q["category"]) for q in out} | {q["task"] for q in out})
        missing = [c for c in categories if c not in known]
        if missing:
            raise S2DError(f"category {missing[0]!r} is not in {path}; known: {', '.join(known)}")
        out = [q for q in out if q["category"] in categories or q["task"] in categories]
    if max_prompts is not None:
        if max_prompts < 1:
            raise S2DError(f"--max-prompts must be >= 1, got {max_prompts}")
        # Spec-Bench files are grouped by category: take the first prompts of every
        # category in turn, so a short run still covers every task
        out = _round_robin(out, "task", lambda g: _round_robin(g, "category"))[:max_prompts]
    if not out:
        raise S2DError(f"questions file {path} holds no prompts; write one JSON line with a "
                       f"'turns' list per prompt")
    return out


def _round_robin(items: list[dict], key: str, order_group=lambda g: g) -> list[dict]:
    """items interleaved over their `key` groups (first of each group, then second, ...),
    each group first ordered by order_group."""
    groups: dict = {}
    for q in items:
        groups.setdefault(q[key], []).append(q)
    groups = [order_group(g) for g in groups.values()]
    return [g[i] for i in range(max(len(g) for g in groups)) for g in groups if i < len(g)]


def encode_questions(tok, questions: list[dict], chat_template: str = "none") -> list[list[int]]:
    """First-turn prompt ids per question in `chat_template` (resolved: auto, vicuna, none)."""
    return [prompt_ids(tok, chat_template, [q["text"]]) for q in questions]
