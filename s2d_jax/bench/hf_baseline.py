"""The same prompts through HF `transformers` generate (PyTorch, CPU, float32, greedy), plain
and with `assistant_model` (the draft dir loaded as a full-depth Llama), for comparison.
One warm-up generation per mode; wall time per prompt; tokens/s over all prompts.
torch is an optional extra (TORCH_EXTRA); `require_torch` checks for it up front."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import time

from s2d_jax.errors import S2DError

TORCH_EXTRA = "pip install -e '.[bench]'"


def require_torch() -> None:
    """One-line S2DError when torch or transformers (the HF baseline's runtime) is missing."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise S2DError(f"--hf-baseline needs {' and '.join(missing)} (not installed); install "
                       f"the extra: {TORCH_EXTRA}")


def _load(path: str):
    import torch
    import transformers
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_generate(target_dir: str, prompts: list[list[int]], *, max_new_tokens: int,
                eos_id: int | None, assistant_dir: str | None = None, lm=None, assistant=None
                ) -> dict:
    """-> {"tokens_per_second", "new_tokens", "seconds", "token_ids": [...]} (greedy)."""
    import torch

    lm = lm if lm is not None else _load(target_dir)
    if assistant_dir is not None and assistant is None:
        assistant = _load(assistant_dir)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False,
              eos_token_id=eos_id if eos_id is not None and eos_id >= 0 else None,
              pad_token_id=eos_id if eos_id is not None and eos_id >= 0 else 0)
    if assistant is not None:
        kw["assistant_model"] = assistant

    def run(ids):
        x = torch.tensor([ids])
        with torch.no_grad():
            t = time.perf_counter()
            out = lm.generate(x, attention_mask=torch.ones_like(x), **kw)
            return out[0, x.shape[1]:].tolist(), time.perf_counter() - t

    run(prompts[0])  # warm-up
    ids_all, seconds = [], 0.0
    for p in prompts:
        ids, s = run(p)
        ids_all.append(ids)
        seconds += s
    n = sum(len(i) for i in ids_all)
    return {"tokens_per_second": n / seconds if seconds > 0 else None, "new_tokens": n,
            "seconds": seconds, "token_ids": ids_all}


FIRST_TOKENS = 64  # the prefix on which our AR and HF generate greedy must agree


def first_token_agreement(lm, prompts, hf_ids, ar_ids, n: int) -> dict:
    """Our AR vs HF greedy over the first `n` new tokens: the fraction of prompts that agree,
    and for each that does not, where they part and HF's own logit gap there (its logit
    of its token minus its logit of ours: a near-tie is a float-rounding divergence)."""
    import torch

    diverged = []
    for k, (p, h, a) in enumerate(zip(prompts, hf_ids, ar_ids)):
        h, a = h[:n], a[:n]
        if h == a:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(h, a)) if x != y), min(len(h), len(a)))
        gap = None
        if pos < min(len(h), len(a)):
            with torch.no_grad():
                logits = lm(torch.tensor([list(p) + h[:pos]])).logits[0, -1]
            gap = float(logits[h[pos]] - logits[a[pos]])
        diverged.append({"prompt": k, "position": pos, "hf_token": h[pos] if pos < len(h)
                         else None, "ar_token": a[pos] if pos < len(a) else None,
                         "hf_logit_gap": gap})
    return {"tokens": n, "agree": 1 - len(diverged) / max(len(prompts), 1),
            "diverged": diverged}


def hf_baselines(target_dir: str, draft_dir: str | None, prompts: list[list[int]], *,
                 max_new_tokens: int, eos_id: int | None, ar_token_ids: list[list[int]] | None
                 ) -> dict:
    """{"plain": {...}, "assisted": {...}} with tokens/s and exact match vs our AR."""
    lm = _load(target_dir)
    out = {"plain": hf_generate(target_dir, prompts, max_new_tokens=max_new_tokens,
                                eos_id=eos_id, lm=lm)}
    if draft_dir is not None:
        out["assisted"] = hf_generate(target_dir, prompts, max_new_tokens=max_new_tokens,
                                      eos_id=eos_id, lm=lm, assistant=_load(draft_dir))
    if ar_token_ids is not None:
        out["plain"]["first_tokens_vs_ar"] = first_token_agreement(
            lm, prompts, out["plain"]["token_ids"], ar_token_ids, FIRST_TOKENS)
    for res in out.values():
        if ar_token_ids is not None:
            res["exact_match_vs_ar"] = sum(
                a == b for a, b in zip(res["token_ids"], ar_token_ids)) / len(ar_token_ids)
        del res["token_ids"]
    return out


@contextlib.contextmanager
def hf_draft_dir(draft: str | None, target: str):
    """The draft as a dir transformers loads: a draft pack is completed with the target's
    shared weights into a temporary HF dir (removed afterwards)."""
    from s2d_jax.io.checkpoint import unpack_draft
    from s2d_jax.io.draft_pack import is_draft_pack
    from s2d_jax.io.tokenizer import has_tokenizer

    if draft is None or not os.path.isdir(draft) or not is_draft_pack(draft):
        yield draft
        return
    with tempfile.TemporaryDirectory(prefix="s2d-hf-draft-") as tmp:
        out = os.path.join(tmp, "draft")
        unpack_draft(draft, target, out, tokenizer_dir=target if os.path.isdir(target) and
                     has_tokenizer(target) else None)
        yield out
