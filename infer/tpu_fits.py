"""The fits table: Vicuna-7B, Vicuna-13B and Llama-2-Chat-70B targets with the 12-layer
sorted draft (Vicuna-7B's first 12 layers, exits 6,9,12), AR / SD / S2D, on v5e, v5p and
v6e slices, compiled by the TPU compiler on this machine (libtpu, no TPU):

    python -m infer.tpu_fits --out-file runs/tpu_fits.md

Prints a markdown table (s2d_jax/decode/tpu_fits.py says what each column is) and writes it
to --out-file. ~50 compiles: about half an hour on 2 CPU cores.
"""

from __future__ import annotations

from s2d_jax.cli.args import ArgumentParser, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "tpu-fits"  # its s2d subcommand: the name its shared flags are defined for

TARGETS = {"vicuna-7b": "configs/models/vicuna-7b-v1.5.yaml",
           "vicuna-13b": "configs/models/vicuna-13b-v1.5.yaml",
           "llama2-70b": "configs/models/llama2-70b-chat.yaml"}
DRAFT = "configs/models/vicuna-7b-v1.5.yaml"


def _parse(argv):
    p = ArgumentParser(prog="python -m infer.tpu_fits", description=__doc__)
    add(p, "--out-file", CMD, required=True)
    # model presets by name, not model paths: not the shared --target
    p.add_argument("--models", default=",".join(TARGETS), metavar="NAMES",
                   help="the target presets, comma-separated, of " + ", ".join(TARGETS))
    p.add_argument("--chips", default="v5e,v5p,v6e", help="chip generations")
    for name in ("--methods", "--batch-sizes", "--context"):
        add(p, name, CMD)
    return p.parse_args(argv)


def _pick(text, known, flag):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise S2DError(f"{flag} {text!r}: choose from {', '.join(known)}")
    return items


@cli_main
def main(argv=None):
    args = _parse(argv)
    targets = _pick(args.models, TARGETS, "--models")
    chips = _pick(args.chips, ("v5e", "v5p", "v6e"), "--chips")
    methods = _pick(args.methods, ("ar", "sd", "s2d"), "--methods")
    batches = parse_ints(args.batch_sizes, "--batch-sizes", minimum=1)
    from s2d_jax.io.outputs import Output, check_outputs
    check_outputs([Output("--out-file", args.out_file)], {})
    import dataclasses

    from s2d_jax.parallel import topology
    topology.prepare()
    from s2d_jax.config import load_model_config
    from s2d_jax.decode.tpu_fits import SLICES, fits_row, markdown
    from s2d_jax.io.atomic import write_atomic
    from s2d_jax.parallel.mesh import MeshConfig
    from s2d_jax.parallel.multihost import build_mesh
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    draft = dataclasses.replace(load_model_config(DRAFT), num_layers=12, **bf16)
    rows = []
    for name in targets:
        target = dataclasses.replace(load_model_config(TARGETS[name]), **bf16)
        for chip, topo in SLICES["70b" if "70b" in name else "small"]:
            if chip not in chips:
                continue
            devs = topology.devices(topo)
            mesh = build_mesh(MeshConfig(tensor=len(devs)), {"target": target, "draft": draft},
                              devices=devs)
            for method in methods:
                for batch in batches:
                    row = fits_row(chip, topo, mesh, name, target, draft, method, batch,
                                   args.context, (6, 9, 12))
                    rows.append(row)
                    print(markdown([row])[-1], flush=True)
    table = markdown(rows)
    write_atomic(args.out_file, "\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    main()
