"""Target-generated training text for the demo draft, and the MAT comparison that picks
between the draft trained on the corpus and the draft trained on that text.

Speculative decoding accepts a drafted token when it is what the *target* would produce,
so a draft trained on the targets' own outputs (sequence-level distillation, as in
DistillSpec / Medusa-2 self-distillation) can match them better than one trained on the
corpus the targets learnt from. The paper (S2D) trains on ShareGPT only; here the text is a
mixture over all targets, so the one draft still serves every target.

  mixture_prompts: the opening of random *training* speeches (speaker tag + first line),
      the same shape as the benchmark's prompts but never from the held-out split.
  generate_mixture: each target continues every prompt greedily and at T = 1 (the two
      modes the benchmark measures), with this project's engine (method ar).
  compare_drafts: mean accepted tokens (MAT) of S2D with each candidate draft on each
      target, greedy, on held-in prompts (training speeches not used for the mixture), so
      choosing the winner never looks at the benchmark's held-out prompts.
"""

from __future__ import annotations

import numpy as np

from s2d_jax.errors import S2DError

def mixture_prompts(train_paragraphs: list[str], n: int, seed: int) -> list[str]:
    """n prompts "TAG:\\nfirst line\\n" from distinct random training speeches (seeded;
    callers split one draw when they need disjoint sets)."""
    from examples.demo_family.questions import speech

    speeches = [s for s in (speech(p) for p in train_paragraphs) if s]
    if len(speeches) < n:
        raise S2DError(f"the train split has {len(speeches)} speeches, need {n} prompts; "
                       f"use a larger corpus")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(speeches), size=n, replace=False)
    return [f"{speeches[i][0]}\n{speeches[i][1][0]}\n" for i in sorted(picks.tolist())]


def held_in_prompts(train_paragraphs: list[str], sizes: tuple[int, ...]) -> tuple[list, ...]:
    """Disjoint prompt sets of the given sizes (mixture, MAT, calibration) from one seeded
    draw of training speeches."""
    prompts = mixture_prompts(train_paragraphs, sum(sizes), seed=1)
    order = np.random.default_rng(2).permutation(len(prompts))
    cuts = np.cumsum((0,) + tuple(sizes))
    return tuple([prompts[i] for i in order[a:b]] for a, b in zip(cuts[:-1], cuts[1:]))


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def generate_mixture(target_dirs: dict[str, str], prompts: list[str], *,
                     max_new_tokens: int = 128, temperatures=(0.0, 1.0), batch_size: int = 16,
                     seed: int = 0, log=print) -> dict[str, list[str]]:
    """{target name: [prompt + continuation, ...]} for every prompt and temperature."""
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.decode.defaults import tokenizer_eos_id
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.tokenizer import load_tokenizer

    tok = load_tokenizer(next(iter(target_dirs.values())))
    ids = [tok.encode(p) for p in prompts]
    eos = tokenizer_eos_id(tok)
    out = {}
    for name, path in target_dirs.items():
        cfg, params, _ = load_model(path, dtype="float32")
        dec = Decoder(cfg, params, method="ar", name=name)
        texts = []
        for t in temperatures:
            for b, (batch_ids, batch_txt) in enumerate(zip(_batches(ids, batch_size),
                                                           _batches(prompts, batch_size))):
                rows = dec.generate(batch_ids, max_new_tokens=max_new_tokens, temperature=t,
                                    seed=seed + b, eos_id=eos)
                texts += [p + tok.decode(r["token_ids"]) for p, r in zip(batch_txt, rows)]
        log(f"[mixture] {name}: {len(texts)} continuations of up to {max_new_tokens} tokens "
            f"(T = {', '.join(f'{t:g}' for t in temperatures)})")
        out[name] = texts
    return out


def compare_drafts(target_dirs: dict[str, str], draft_dirs: dict[str, str],
                   prompts: list[str], *, max_new_tokens: int = 64, gamma: int = 4) -> dict:
    """{draft name: {target name: MAT of greedy S2D (0.5/0.5/0), "mean": mean over
    targets}}, one prompt at a time (batch 1, as the benchmark)."""
    from s2d_jax.bench.runner import PaddedDecoder
    from s2d_jax.decode.serving_config import paper_thresholds
    from s2d_jax.decode.defaults import draft_exits, prompt_width, tokenizer_eos_id
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer

    tok = load_tokenizer(next(iter(target_dirs.values())))
    ids = [tok.encode(p) for p in prompts]
    width = prompt_width(max(len(i) for i in ids))
    eos = tokenizer_eos_id(tok)
    drafts = {n: load_model(p, dtype="float32") for n, p in draft_dirs.items()}
    result = {n: {} for n in draft_dirs}
    for tname, tpath in target_dirs.items():
        cfg, params, _ = load_model(tpath, dtype="float32")
        for dname, (dcfg, dparams, extra) in drafts.items():
            exits = draft_exits(extra, dcfg)
            dec = PaddedDecoder(cfg, params, method="s2d", draft_cfg=dcfg, draft_params=dparams,
                                exits=exits, gamma=gamma, thresholds=paper_thresholds(len(exits)),
                                prompt_width=width)
            tokens = rounds = 0
            for p in ids:
                r = dec.generate([p], max_new_tokens=max_new_tokens, eos_id=eos)[0]["stats"]
                tokens += r["mean_accepted_tokens"] * r["rounds"]
                rounds += r["rounds"]
            result[dname][tname] = tokens / max(rounds, 1)
    for dname in result:
        result[dname]["mean"] = float(np.mean([result[dname][t] for t in target_dirs]))
    return result
