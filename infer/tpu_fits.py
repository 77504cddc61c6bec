"""The fits table: Vicuna-7B, Vicuna-13B and Llama-2-Chat-70B targets with the 12-layer
sorted draft (Vicuna-7B's first 12 layers, exits 6,9,12), AR / SD / S2D, on v5e, v5p and
v6e slices, compiled by the TPU compiler on this machine (libtpu, no TPU):

    python -m infer.tpu_fits --out-file runs/tpu_fits.md
    python -m infer.tpu_fits --out-file runs/tpu_fits.md --weights bfloat16,int8

(--weights int8: rows of each target with its decoder matrices and head int8 with
per-channel scales, named "NAME int8": the Llama-2-70B fits a v5e-8 only so.)

Prints a markdown table (s2d_jax/decode/tpu_fits.py says what each column is) and writes it
to --out-file. ~50 compiles: about half an hour on 2 free CPU cores. Every finished row is kept
in --state (rows.json and the row's compiled HLO), and a rerun compiles only the rows not
there yet: an interrupted grid resumes, and the table is re-rendered from what is kept
(`--kept-only`: render the rows kept so far, compile nothing).
"""

from __future__ import annotations

import gzip
import json
import os
import re

from s2d_jax.cli.args import ArgumentParser, add_output, parse_floats, parse_ints
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import CACHE

CMD = "tpu-fits"  # its s2d subcommand: the name its shared flags are defined for

TARGETS = {"vicuna-7b": "configs/models/vicuna-7b-v1.5.yaml",
           "vicuna-13b": "configs/models/vicuna-13b-v1.5.yaml",
           "llama2-70b": "configs/models/llama2-70b-chat.yaml"}
DRAFT = "configs/models/vicuna-7b-v1.5.yaml"


def _parse(argv):
    p = ArgumentParser(prog="python -m infer.tpu_fits", description=__doc__)
    add(p, "--out-file", CMD, required=True)
    add_output(p, "--state", kind=CACHE, default=None,
               help="dir keeping finished rows (rows.json, the HLO of each) so a rerun "
                    "resumes (default: --out-file's path without .md, plus .rows)")
    # model presets by name, not model paths: not the shared --target
    p.add_argument("--models", default=",".join(TARGETS), metavar="NAMES",
                   help="the target presets, comma-separated, of " + ", ".join(TARGETS))
    p.add_argument("--chips", default="v5e,v5p,v6e", help="chip generations")
    for name in ("--methods", "--batch-sizes", "--context", "--acceptance", "--paper-acceptance",
                 "--weights"):
        add(p, name, CMD)
    p.add_argument("--kept-only", action="store_true",
                   help="compile nothing: the table of the rows --state keeps so far (while "
                        "another run fills it)")
    return p.parse_args(argv)


def _pick(text, known, flag):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise S2DError(f"{flag} {text!r}: choose from {', '.join(known)}")
    return items


class RowStore:
    """Finished rows: `dir/rows.json` (key -> record) and `dir/<key>.hlo.gz`, each written
    atomically as its row finishes."""

    def __init__(self, path: str):
        self.dir = path  # created by the first add(): a run that compiles nothing writes nothing
        self.index = os.path.join(path, "rows.json")
        self.rows = {}
        if os.path.exists(self.index):
            from s2d_jax.readers import read_json
            try:
                rows = read_json(self.index, "--state rows file")
            except S2DError as e:
                raise S2DError(f"{e}; or move it away to start the grid afresh") from None
            # another file's JSON (a list, a number) read as "no rows" would compile the
            # whole grid again and then replace it
            if not isinstance(rows, dict) or not all(
                    isinstance(r, dict) and r.get("key") == k for k, r in rows.items()):
                raise S2DError(f"--state rows file {self.index} is not a JSON object of "
                               f"rows (key -> record with that key); move it away to start "
                               f"the grid afresh")
            self.rows = rows

    def hlo_path(self, key: str) -> str:
        return os.path.join(self.dir, re.sub(r"[^\w.-]+", "_", key) + ".hlo.gz")

    def add(self, rec: dict, hlo: str | None) -> None:
        from s2d_jax.io.atomic import write_atomic
        os.makedirs(self.dir, exist_ok=True)
        if hlo is not None:
            write_atomic(self.hlo_path(rec["key"]), gzip.compress(hlo.encode(), 6))
        self.rows[rec["key"]] = rec
        write_atomic(self.index, json.dumps(self.rows, indent=1) + "\n")

    def hlo(self, key: str) -> str | None:
        path = self.hlo_path(key)
        if not os.path.exists(path):
            return None
        with gzip.open(path, "rt") as f:
            return f.read()


def _with_walk(rec: dict, store: RowStore) -> dict:
    """The record with its round loop's bytes (hlo_traffic's walk of the kept HLO)."""
    hlo = store.hlo(rec["key"]) if "refusal" not in rec else None
    if hlo is None:
        return rec
    from s2d_jax.decode.hlo_traffic import round_traffic
    t = round_traffic(hlo, [tuple(s) for s in rec["cache_shapes"]])
    return {**rec, "walk": [t.lo, t.hi]}


@cli_main
def main(argv=None):
    args = _parse(argv)
    targets = _pick(args.models, TARGETS, "--models")
    chips = _pick(args.chips, ("v5e", "v5p", "v6e"), "--chips")
    from s2d_jax.decode.methods import methods_where
    methods = _pick(args.methods, methods_where(self_draft=False), "--methods")
    batches = parse_ints(args.batch_sizes, "--batch-sizes", minimum=1)
    formats = _pick(args.weights, ("bfloat16", "int8"), "--weights")
    # (row name, target preset, weights): an int8 row's target is "NAME int8"
    rows = [(name if w == "bfloat16" else f"{name} {w}", name, w)
            for name in targets for w in formats]
    acceptances = parse_floats(args.acceptance, "--acceptance", nonempty=True)
    paper = args.paper_acceptance
    if not all(0 <= a < 1 for a in acceptances + ([] if paper is None else [paper])):
        raise S2DError(f"--acceptance {args.acceptance!r} / --paper-acceptance {paper}: "
                       f"rates in [0, 1), e.g. 0.25")
    state = args.state or re.sub(r"\.md$", "", args.out_file) + ".rows"
    from s2d_jax.io.outputs import Output, check_outputs
    check_outputs([Output("--out-file", args.out_file), Output("--state", state, CACHE)], {})
    store = RowStore(state)
    import dataclasses

    from s2d_jax.parallel import topology  # devices() prepares libtpu where a row compiles
    from s2d_jax.config import load_model_config
    from s2d_jax.decode.tpu_fits import SLICES, compile_record, markdown, row_key
    missing = [topo for name, _, _ in rows for chip, topo in SLICES["70b" if "70b" in name
                                                                     else "small"]
               if chip in chips and any(row_key(topo, name, m, b, args.context) not in
                                        store.rows for m in methods for b in batches)]
    if missing and not args.kept_only:  # the TPU compiler is there before any row compiles
        topology.prepare(missing[0])
    from s2d_jax.io.atomic import write_atomic
    from s2d_jax.parallel.mesh import MeshConfig
    from s2d_jax.parallel.multihost import build_mesh
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    draft = dataclasses.replace(load_model_config(DRAFT), num_layers=12, **bf16)
    keys = []
    from s2d_jax.model.quantize import with_weights
    for name, preset, weights in rows:
        target = with_weights(dataclasses.replace(load_model_config(TARGETS[preset]), **bf16),
                              None if weights == "bfloat16" else weights)
        for chip, topo in SLICES["70b" if "70b" in name else "small"]:
            if chip not in chips:
                continue
            slice_keys = [row_key(topo, name, m, b, args.context)
                          for m in methods for b in batches]
            keys += slice_keys
            if args.kept_only or all(k in store.rows for k in slice_keys):
                continue  # every row of this slice is kept: no devices, no compile
            devs = topology.devices(topo)
            mesh = build_mesh(MeshConfig(tensor=len(devs)), {"target": target, "draft": draft},
                              devices=devs)
            for method, batch in ((m, b) for m in methods for b in batches):
                if row_key(topo, name, method, batch, args.context) in store.rows:
                    continue
                rec, hlo = compile_record(chip, topo, mesh, name, target, draft, method, batch,
                                          args.context, (6, 9, 12))
                store.add(rec, hlo)
                print(f"done {rec['key']}" + (" (refused)" if hlo is None else ""), flush=True)
    from s2d_jax.decode.tpu_report import acceptance_columns
    table = markdown([_with_walk(store.rows[k], store) for k in keys if k in store.rows],
                     acceptance_columns(acceptances, paper))
    write_atomic(args.out_file, "\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    main()
