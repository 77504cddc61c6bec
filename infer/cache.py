"""The persistent compilation cache: where it is, how big, and emptying it.

    s2d cache            # its folder, programs and size, per machine folder
    s2d cache --clear    # remove every cached program (the next start compiles again)

Every command and the Python API keep the programs JAX compiles in this folder
(s2d_jax/compile_cache.py), so a second start reads them instead of compiling: by
default $S2D_JAX_CACHE/xla (~/.cache/s2d-jax/xla); S2D_COMPILE_CACHE=DIR moves it,
S2D_COMPILE_CACHE=0 turns it off. Programs are kept per machine and jaxlib version (one
subfolder each), so a cache shared between machines never hands one machine's programs
to another.
"""

from __future__ import annotations

from s2d_jax.cli.args import ArgumentParser
from s2d_jax.errors import cli_main


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.cache", description=__doc__)
    ap.add_argument("--clear", action="store_true",
                    help="remove every cached program, of every machine folder")
    return ap.parse_args(argv)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax import compile_cache
    root = compile_cache.cache_dir()
    if root is None:
        print(f"the compilation cache is off ({compile_cache.ENV}="
              f"{compile_cache.os.environ[compile_cache.ENV]!r}); unset it to turn it on")
        return 0
    files, size, folders = compile_cache.usage(root)
    if args.clear:
        compile_cache.clear(root)
        print(f"cleared {root}: {files} files, {_mib(size)}")
        return 0
    print(f"{root}: {files} files, {_mib(size)} (this machine's folder: "
          f"{compile_cache.machine_key()})")
    for folder in folders:
        n, b, _ = compile_cache.usage(f"{root}/{folder}")
        print(f"  {folder}: {n} programs, {_mib(b)}")
    return 0


if __name__ == "__main__":
    main()
