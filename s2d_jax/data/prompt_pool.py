"""The training prompts of the data engine: local files plus the target's own user turns,
deduplicated, with every prompt that overlaps an evaluation set removed.

Files (`TRAINING_FILES`, read by distill.prompts_from_file): GSM8K train, the two
self-instruct files and the ShareGPT samples. Magpie turns (magpie.sample_user_turns)
come in as texts. Documents (TinyStories, Shakespeare) are teacher-forced text, not
prompts: `documents` reads and filters them the same way.
"""

from __future__ import annotations

from s2d_jax.data.overlap import EVAL_FILES, dedupe, eval_ngrams, without_overlap

TRAINING_FILES = ("data/gsm8k_train.jsonl", "data/self_instruct_seed_tasks.jsonl",
                  "data/self_instruct_user_oriented.jsonl",
                  "data/sharegpt_axolotl_conversation.json",
                  "data/sharegpt_dummy_conversation.json")
DOCUMENT_FILES = ("data/tinyshakespeare.txt",)


def clean(named: list[tuple[str, str]], banned: set[str]) -> tuple[list[dict], dict]:
    """[(source, text)] -> ([{"prompt", "source"}] deduplicated (first kept) and without
    the texts sharing an n-gram with `banned`, counts {"read", "duplicates", "overlapping",
    "kept"})."""
    texts = [t for _, t in named]
    unique, duplicates = dedupe(texts)
    kept, overlapping = without_overlap(unique, banned)
    source = {}
    for s, t in named:
        source.setdefault(t, s)
    return ([{"prompt": t, "source": source[t]} for t in kept],
            {"read": len(texts), "duplicates": duplicates, "overlapping": overlapping,
             "kept": len(kept)})


def prompt_pool(files=TRAINING_FILES, generated=(), eval_files=EVAL_FILES,
                generated_source: str = "magpie") -> tuple[list[dict], dict]:
    """Every prompt of `files` and the `generated` user turns, cleaned (see `clean`)."""
    from s2d_jax.data.distill import prompts_from_file
    named = [(path, p) for path in files for p in prompts_from_file(path)]
    named += [(generated_source, p) for p in generated]
    return clean(named, eval_ngrams(eval_files))


def documents(files=DOCUMENT_FILES, eval_files=EVAL_FILES) -> tuple[list[dict], dict]:
    """The documents of plain-text corpora (sources.load_text_documents), cleaned."""
    from s2d_jax.data.sources import load_text_documents
    named = [(path, d) for path in files for d in load_text_documents(path)]
    rows, counts = clean(named, eval_ngrams(eval_files))
    return [{"text": r["prompt"], "source": r["source"]} for r in rows], counts
