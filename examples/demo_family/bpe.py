"""Train a small byte-level BPE tokenizer for the demo model family, saved as an HF tokenizer.

The demo family runs on a CPU, where a 32k-entry LM head would dominate every decode
step; a few thousand pieces trained on the demo corpus keep the head cheap. The special
tokens mirror Llama's: <unk>=0, <s>=1 (BOS), </s>=2 (EOS).
"""

from __future__ import annotations

import os

from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def train_bpe(corpus_paths: list[str], vocab_size: int, out_dir: str,
              overwrite: bool = False) -> str:
    """Train on text files and save `tokenizer.json` + config to `out_dir`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    for p in corpus_paths:
        if not os.path.isfile(p):
            raise S2DError(f"corpus file {p} not found; pass existing .txt files")
    if vocab_size < 260:
        raise S2DError(f"vocab size {vocab_size} is below the 256 byte symbols + specials; "
                       "use at least 260")
    if os.path.exists(out_dir) and not overwrite:
        raise S2DError(f"{out_dir} already exists; pass --overwrite to replace it")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(list(corpus_paths), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>")
    with atomic_output_dir(out_dir, overwrite=True) as tmp:  # existence checked above
        hf.save_pretrained(tmp)
    return out_dir
