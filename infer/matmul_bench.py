"""Decode-path matmul micro-benchmark: each projection, the head and the whole cached
forward for M = 1..8 rows, with the small-matmul CPU kernel and with XLA's dots, in one
process and interleaved (s2d_jax/bench/matmul_costs.py).

    python -m infer.matmul_bench --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct [--rows 1,2,3,4,8]

--formats f32,Q8_0,Q4_1 times instead the whole cached forward per weight format on the
kernels (the quantized ones read as stored), interleaved in one process; a format's suffix
':int8' / ':float' picks how the block-quantized kernels take the activations (quant_dot8.cc,
the default on AVX-512 VNNI CPUs / quant_matmul.cc), ':xla' XLA's dots.
"""

from __future__ import annotations

import statistics

from s2d_jax.cli.args import ArgumentParser, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "matmul-bench"  # its s2d subcommand: the name its shared flags are defined for
FORMATS = ("f32", "Q8_0", "Q4_0", "Q4_1")
STATISTICS = {"median": statistics.median, "min": min}


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m infer.matmul_bench", description=__doc__)
    add(p, "--target", CMD, required=True)
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8", help="row counts M to time (first = the base)")
    add(p, "--repeats", CMD)
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="per probe over the repeats (min: on a CPU shared with other work, "
                        "the least disturbed call)")
    p.add_argument("--formats", default="",
                   help="comma-separated weight formats (f32, Q8_0, Q4_0, Q4_1; after one, "
                        "':xla': on XLA's dots, ':int8' / ':float': the kernels taking the "
                        "activations as int8 blocks or float32) whose cached forward to time, "
                        "instead of the per-matmul table")
    p.add_argument("--cache-position", type=int, default=400,
                   help="cache position of the step's first token (attention reads up to it)")
    p.add_argument("--max-len", type=int, default=1280, help="K/V cache slots")
    args = p.parse_args(argv)
    args.rows = parse_ints(args.rows, "--rows", minimum=1)
    args.formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in args.formats
           if f.partition(":")[0] not in FORMATS
           or f.partition(":")[2] not in ("", "xla", "int8", "float")]
    if bad:
        raise S2DError(f"--formats: unknown {', '.join(bad)}; use f32, Q8_0, Q4_0, Q4_1, each "
                       "optionally with ':xla' (XLA's dots instead of the kernels) or "
                       "':int8' / ':float' (how the kernels take the activations)")
    if args.repeats < 1:
        raise S2DError(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 <= args.cache_position <= args.max_len - max(args.rows):
        raise S2DError(f"--cache-position {args.cache_position} leaves no room for "
                       f"{max(args.rows)} tokens in --max-len {args.max_len}; lower "
                       f"--cache-position or raise --max-len")
    return args


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax.bench import matmul_costs
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.model import small_matmul

    cfg, params, _ = load_model(args.target)
    print(f"matmul path: {small_matmul.status()}; block-quantized weights' activations: "
          f"{small_matmul.activation_mode()} (unless a format names one)")
    if args.formats:
        compiled = matmul_costs.format_probes(params, cfg, args.formats, args.rows,
                                              args.max_len, args.cache_position)
        med = matmul_costs.measure(compiled, args.repeats, STATISTICS[args.statistic])
        print("\n".join(matmul_costs.format_table(med, args.formats, args.rows)))
        return 0
    compiled = matmul_costs.probes(params, cfg, args.rows, args.max_len, args.cache_position)
    med = matmul_costs.measure(compiled, args.repeats, STATISTICS[args.statistic])
    print("\n".join(matmul_costs.table(med, args.rows)))
    return 0


if __name__ == "__main__":
    main()
