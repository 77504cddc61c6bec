"""Convert model checkpoints: HF <-> s2d-jax params (orbax), and HF draft truncation.

    python -m infer.convert hf-to-orbax --src HF_DIR --out CKPT [--num-layers N] [--dtype bfloat16]
    python -m infer.convert orbax-to-hf --src CKPT --out HF_DIR [--tokenizer DIR]
    python -m infer.convert hf-to-hf    --src HF_DIR --out HF_DIR --num-layers N [--dtype D]
    python -m infer.convert gguf-to-hf  --src FILE.gguf --out HF_DIR [--dtype bfloat16]
    python -m infer.convert gguf-to-orbax --src FILE.gguf --out CKPT [--dtype bfloat16]
    python -m infer.convert gguf-to-quantized --src FILE.gguf --out DIR
    python -m infer.convert pack-draft  --src DRAFT --target TARGET --out PACK [--weights int8]
    python -m infer.convert unpack-draft --src PACK --target TARGET --out HF_DIR

A draft pack (s2d_jax/io/draft_pack.py) stores a draft made of its target's first layers
without the embedding and head it shares with the target; unpack-draft completes it into an
HF dir (e.g. for transformers' assisted generation).

GGUF (llama.cpp) weights are dequantized to float32 (then cast to --dtype) and the tokenizer
and chat template are taken from the GGUF metadata unless --tokenizer is given;
gguf-to-quantized keeps the file's Q8_0/Q4_0/Q4_1 matrices as they are instead (a quantized
model dir, s2d_jax/io/gguf_weights.py, that every s2d command loads as the quantized model:
`--target DIR`).
Tensors stream one at a time on the host (no accelerator needed). Output is written to a
temp dir next to --out and renamed when complete; an existing --out needs --overwrite.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from s2d_jax.cli.args import ArgumentParser
from s2d_jax.cli.flags import add
from s2d_jax.io.orbax_params import restore_params, save_params
from s2d_jax.io.tokenizer import has_tokenizer
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.hf import export_hf, load_hf
from s2d_jax.io.outputs import CHECKPOINT, DRAFT_PACK, HF_DIR

CMD = "convert"  # its s2d subcommand: the name its shared flags are defined for
# what each command writes at --out (--overwrite replaces only an earlier output of its kind)
OUTPUT_KIND = {"hf-to-orbax": CHECKPOINT, "gguf-to-orbax": CHECKPOINT, "orbax-to-hf": HF_DIR,
               "hf-to-hf": HF_DIR, "gguf-to-hf": HF_DIR, "unpack-draft": HF_DIR,
               "gguf-to-quantized": HF_DIR,
               "pack-draft": DRAFT_PACK}


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m infer.convert", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp):
        add(sp, "--src", CMD, required=True)
        add(sp, "--out", CMD, kind=OUTPUT_KIND[sp.prog.split()[-1]], overwrite="overwrite",
            required=True)
        for name in ("--num-layers", "--dtype", "--overwrite", "--tokenizer"):
            add(sp, name, CMD)

    def shards(sp):
        add(sp, "--max-shard-gb", CMD)

    common(sub.add_parser("hf-to-orbax", help="HF model dir -> s2d-jax params checkpoint",
                          description="HF LlamaForCausalLM dir (config.json + safetensors or "
                                      "pytorch_model.bin, sharded or not) -> params checkpoint "
                                      "(orbax + s2d_config.json)."))
    sp = sub.add_parser("orbax-to-hf", help="s2d-jax params checkpoint -> HF model dir",
                        description="params checkpoint -> HF dir loadable by "
                                    "transformers.LlamaForCausalLM.from_pretrained; extra "
                                    "settings such as s2d_exits go into config.json.")
    common(sp)
    shards(sp)
    sp = sub.add_parser("hf-to-hf", help="HF dir -> HF dir (truncate layers / cast dtype)",
                        description="Re-export an HF dir, e.g. its first N layers as a draft.")
    common(sp)
    shards(sp)
    for target, what in (("hf", "HF model directory"), ("orbax", "params checkpoint")):
        sp = sub.add_parser(f"gguf-to-{target}", help=f"llama.cpp GGUF file -> {what}",
                            description=f"GGUF file (llama architecture; F32/F16/BF16/Q8_0/"
                                        f"Q4_0/Q4_1 and K-quant tensors) -> {what}, with the "
                                        f"tokenizer and chat template from its metadata.")
        common(sp)
        if target == "hf":
            shards(sp)
    sp = sub.add_parser("gguf-to-quantized", help="llama.cpp GGUF file -> quantized model dir",
                        description="GGUF file -> a model dir with the file's Q8_0/Q4_0/Q4_1 "
                                    "matrices as they are (s2d_jax/io/gguf_weights.py; other "
                                    "tensors float32), which every s2d command loads as the "
                                    "quantized model (--target DIR), transformers does not.")
    add(sp, "--src", CMD, required=True)
    add(sp, "--out", CMD, kind=OUTPUT_KIND["gguf-to-quantized"], overwrite="overwrite",
        required=True)
    for name in ("--num-layers", "--overwrite", "--tokenizer"):
        add(sp, name, CMD)
    for name, what in (("pack-draft", "draft model (HF dir / checkpoint) -> draft pack"),
                       ("unpack-draft", "draft pack -> complete HF model dir")):
        sp = sub.add_parser(name, help=what, description=what + "; --target is the model "
                            "whose embedding (and head) the draft shares.")
        add(sp, "--src", CMD, required=True)
        add(sp, "--target", CMD, required=True)
        add(sp, "--out", CMD, kind=OUTPUT_KIND[name], overwrite="overwrite", required=True)
        add(sp, "--overwrite", CMD)
        if name == "pack-draft":
            add(sp, "--weights", CMD)
    return p


@cli_main
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from_gguf = args.command.startswith("gguf-")
    if from_gguf and not os.path.isfile(args.src):
        raise S2DError(f"--src {args.src!r} is not a file; pass a .gguf model file")
    if not from_gguf and not os.path.isdir(args.src):
        raise S2DError(f"--src {args.src!r} is not a directory; pass the model directory to "
                       f"convert")
    if args.command.endswith("pack-draft") and not os.path.exists(args.target):
        raise S2DError(f"--target {args.target!r} does not exist; pass the draft's target "
                       f"(model dir or .gguf file)")
    tokenizer_dir = getattr(args, "tokenizer", None)
    if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
        raise S2DError(f"--tokenizer {tokenizer_dir} is not a directory")
    if tokenizer_dir is None and not from_gguf and has_tokenizer(args.src):
        tokenizer_dir = args.src  # carry the source's tokenizer along
    if getattr(args, "num_layers", None) is not None and args.num_layers < 1:
        raise S2DError(f"--num-layers must be >= 1, got {args.num_layers}")
    if getattr(args, "max_shard_gb", 1.0) <= 0:
        raise S2DError("--max-shard-gb must be > 0")

    try:
        cfg = _convert(args, tokenizer_dir)
        _carry_serving_config(args)
    except OSError as e:  # disk full, permissions: still one line, nothing left at --out
        raise S2DError(f"{e.strerror or e} ({e.filename or args.out})")
    stored = ("quantized as shipped" if args.command == "gguf-to-quantized"
              else cfg.param_dtype)
    print(f"wrote {args.out}: {cfg.num_layers} layers, {cfg.num_params() / 1e6:.1f}M params, "
          f"{stored}", file=sys.stderr)
    return 0


def _carry_serving_config(args) -> None:
    """A whole model converted keeps its calibrated S2D setting (s2d_serving.json; beside a
    .gguf, FILE.gguf.s2d_serving.json): the same weights in another format must decode with
    the same setting (serving_config.resolve), not silently fall back to the defaults."""
    from s2d_jax.decode.serving_config import serving_config_path
    from s2d_jax.io.atomic import write_atomic

    src = serving_config_path(args.src)
    if (args.command.endswith("pack-draft") or getattr(args, "num_layers", None) is not None
            or not os.path.isfile(src)):
        return
    with open(src) as f:
        write_atomic(serving_config_path(args.out), f.read())


def _convert(args, tokenizer_dir):
    if args.command.endswith("pack-draft"):
        return _convert_pack(args)
    if args.command.startswith("gguf-"):
        return _convert_gguf(args, tokenizer_dir)
    if args.command == "hf-to-orbax":
        cfg, params, extra = load_hf(args.src, args.num_layers, args.dtype, host=True)
        save_params(args.out, params, cfg, extra, overwrite=args.overwrite,
                    tokenizer_dir=tokenizer_dir)
    else:
        if args.command == "orbax-to-hf":
            cfg, params, extra = restore_params(args.src, args.num_layers, args.dtype, host=True)
        else:
            cfg, params, extra = load_hf(args.src, args.num_layers, args.dtype, host=True)
        export_hf(params, cfg, args.out, extra, tokenizer_dir=tokenizer_dir,
                  max_shard_bytes=int(args.max_shard_gb * 2**30), overwrite=args.overwrite)
    return cfg


def _convert_pack(args):
    from s2d_jax.io.checkpoint import load_draft, load_model, unpack_draft
    from s2d_jax.io.draft_pack import save_draft_pack

    if args.command == "unpack-draft":
        tok = args.target if os.path.isdir(args.target) and has_tokenizer(args.target) else None
        unpack_draft(args.src, args.target, args.out, tokenizer_dir=tok,
                     overwrite=args.overwrite)
        return load_draft(args.out, None)[0]
    cfg, params, extra = load_model(args.src, dtype="float32")
    target = load_model(args.target, num_layers=1, dtype="float32")[1]
    save_draft_pack(args.out, cfg, params, extra, target_embed=target["embed"],
                    target_name=os.path.basename(os.path.normpath(args.target)),
                    weights=args.weights, overwrite=args.overwrite)
    return cfg


def _convert_gguf(args, tokenizer_dir):
    """Checks the whole file (metadata, tensor names, shapes, types) before writing."""
    from s2d_jax.io.gguf import load_gguf, read_gguf_config, save_gguf_tokenizer

    read_gguf_config(args.src)
    shipped = args.command == "gguf-to-quantized"
    with tempfile.TemporaryDirectory() as tok_tmp:
        if tokenizer_dir is None:
            save_gguf_tokenizer(args.src, tok_tmp)
            tokenizer_dir = tok_tmp
        if shipped:
            from s2d_jax.io.gguf_weights import read_shipped, save_quantized_dir
            weights = read_shipped(args.src, args.num_layers)
            save_quantized_dir(weights, args.out, tokenizer_dir, args.overwrite, args.src)
            return weights.cfg
        cfg, params, extra = load_gguf(args.src, args.num_layers, args.dtype, host=True)
        if args.command == "gguf-to-orbax":
            save_params(args.out, params, cfg, extra, overwrite=args.overwrite,
                        tokenizer_dir=tokenizer_dir)
        else:
            export_hf(params, cfg, args.out, extra, tokenizer_dir=tokenizer_dir,
                      max_shard_bytes=int(args.max_shard_gb * 2**30), overwrite=args.overwrite)
    return cfg


if __name__ == "__main__":
    sys.exit(main())
