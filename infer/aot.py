"""Prove ahead of time that a sharded S2D generation fits: lower and compile it on abstract
shapes (no weights read or allocated) and print per-device memory and compile time.

    python -m infer.aot --fake-devices 8 --target-config configs/models/llama2-70b-chat.yaml \\
        --draft-config configs/models/vicuna-7b-v1.5.yaml --draft-layers 12 --exits 6,9,12 \\
        --mesh tensor=8 --batch-sizes 1,8 --context 4096 --dtype bfloat16 \\
        --device-memory h100-80gb

--target-config / --draft-config: model YAML, HF dir or config.json (only the shapes are
read); --target / --draft, the model flags of every command, take the same or a model's name. --topology also compiles for the TPU compiler's compile-only devices of a slice, or
with XLA:GPU for N H100s (h100:N): memory, copies and (TPU) the compiler's round time.
--device-memory: h100-80gb, h200-141gb, a100-80gb, a100-40gb, tpu-v5e-16gb, tpu-v4-32gb, ...
or GiB.
--roofline: also compile AR and SD beside S2D and print, per batch, each round's bytes per
device (summed over the compiled HLO, s2d_jax/decode/hlo_traffic.py) beside the minimum
(weights + caches once per call), a lower bound on its time at the device's memory bandwidth
and Lemma 3.1's speedup bound at --acceptance: a bound, not a measurement.
--weights int8: the target's decoder matrices and LM head int8 with per-output-channel
scales (the draft, embedding, norms and activations in --dtype): the Llama-2-70B then fits
a v5e-8 (`--topology v5e:2x4`), and the floor counts the int8 bytes and scales.
--train-config: also compile the SoFT training step of that training YAML for the draft on
the same mesh (as `python -m train.aot --config ... --target-config <draft> mesh.*=...`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from s2d_jax.cli.args import (ArgumentParser, add_input, check_at_least,
                        check_gamma, fake_cpu_devices, parse_floats, parse_ints)
from s2d_jax.cli.flags import add
from s2d_jax.decode.methods import DEFAULT_GAMMA, METHODS, method_order, proposer
from s2d_jax.errors import S2DError, cli_main

CMD = "aot"  # its s2d subcommand: the name its shared flags are defined for


def _parse(argv):
    p = ArgumentParser(prog="python -m infer.aot", description=__doc__)
    # the shapes: --target-config / --draft-config, or the models every command names with
    # --target / --draft (only their shapes are read); one of each pair
    target = p.add_mutually_exclusive_group(required=True)
    add(target, "--target-config", CMD, dest="target")
    add(target, "--target", CMD, dest="target")
    draft = p.add_mutually_exclusive_group()
    add_input(draft, "--draft-config", default=None, dest="draft",
              help="the draft's shapes, like --target-config (its first --draft-layers layers)")
    add(draft, "--draft", CMD, dest="draft")
    p.add_argument("--draft-layers", type=int, default=None, help="draft depth (default: exits[-1])")
    for name in ("--exits", "--method", "--gamma", "--mesh", "--batch-sizes", "--context"):
        add(p, name, CMD)
    p.add_argument("--prompt-len", type=int, default=None, help="padded prompt length "
                   "(default: context / 4)")
    add(p, "--dtype", CMD)
    add(p, "--weights", CMD)
    p.add_argument("--device-memory", default=None,
                   help="memory of one device to check the plan against (default: the "
                        "--topology's chip, else h100-80gb)")
    add(p, "--fake-devices", CMD)
    add(p, "--topology", CMD)
    p.add_argument("--check-gathers", action="store_true",
                   help="also list all-gathers of whole parameters in the compiled HLO")
    p.add_argument("--check-copies", action="store_true",
                   help="also list cache-shaped copies / out-of-place cache updates inside the "
                        "compiled decode loop (a round must update the caches in place)")
    p.add_argument("--raw-cpu-passes", action="store_true",
                   help="on CPU, keep XLA's hoisting of bf16->f32 weight converts out of the "
                        "layer loop (a CPU-only f32 copy of all weights in temp)")
    p.add_argument("--roofline", action="store_true",
                   help="also compile AR and SD (deepest exit) beside S2D and print each round's "
                        "HLO bytes per device, its minimum and the time bound at the device's "
                        "memory bandwidth, with Lemma 3.1's speedup bound (see --acceptance)")
    for name in ("--acceptance", "--paper-acceptance"):
        add(p, name, CMD)
    add(p, "--bandwidth", CMD)
    add_input(p, "--train-config", default=None,
                   help="also AOT-compile the SoFT step of this training YAML for the draft")
    return p.parse_args(argv)


def _model_cfg(path: str, dtype: str | None):
    from s2d_jax.config import load_model_config
    if not os.path.exists(path):
        raise S2DError(f"model config {path} does not exist; pass a model YAML "
                       f"(configs/models/*.yaml), an HF dir or a config.json")
    from s2d_jax.io.checkpoint import stored_model_config
    # a model YAML or config.json is shapes alone; anything else a stored model of any format
    cfg = (load_model_config(path) if path.endswith((".yaml", ".yml", ".json"))
           else stored_model_config(path))
    return dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype) if dtype else cfg


def _stored_extra(path: str) -> dict:
    """A model dir's or draft pack's `s2d_*` settings (a draft's s2d_exits); none for a
    YAML or a file."""
    if not os.path.isdir(path):
        return {}
    from s2d_jax.io.draft_pack import is_draft_pack, read_pack_config
    if is_draft_pack(path):
        return read_pack_config(path)[1]
    from s2d_jax.io.hf import read_hf_model_config
    return read_hf_model_config(path)[1]


def _models(args, exits):
    """(target, draft or None, the draft's exits) from the flags, the draft cut to its
    deepest exit; its exits are --exits, else --draft-layers, else those stored with it
    (s2d_exits), else its depth. --weights int8: the target's matrices int8
    (quantize.QuantizedConfig); the draft stays in --dtype (a twentieth of the bytes, and
    its CALM K/V fill slices its wk/wv per layer)."""
    from s2d_jax.model.quantize import with_weights
    target = with_weights(_model_cfg(args.target, args.dtype), args.weights)
    row = proposer(args.method)
    if not row.needs_draft and not args.roofline:
        return target, None, exits or ()
    if args.draft is None:
        raise S2DError(f"method {args.method} needs --draft-config (or --draft)"
                       if row.needs_draft else
                       "--roofline compares AR with SD and S2D; pass --draft-config (or --draft)")
    draft = _model_cfg(args.draft, args.dtype)
    from s2d_jax.decode.defaults import draft_exits
    stored = draft_exits(_stored_extra(args.draft), draft)
    layers = args.draft_layers or (exits[-1] if exits else stored[-1])
    if not 1 <= layers <= draft.num_layers:
        raise S2DError(f"--draft-layers {layers} is outside 1..{draft.num_layers}")
    draft = dataclasses.replace(draft, num_layers=layers)
    return target, draft, tuple(exits or ([layers] if args.draft_layers else stored))


def _setting(args, target, draft, exits, given_exits):
    """The DecodeSetting compiled: serving_config.resolve's for the flags, the draft's
    exits and the target's s2d_serving.json (a model dir's), as the API and infer.generate
    decode the same models."""
    from s2d_jax.decode.serving_config import load_serving_config, resolve
    row = proposer(args.method)
    served = None
    if row.calibrated and os.path.isdir(args.target):
        served = load_serving_config(args.target, args.context)
    setting = resolve(args.method, exits if row.needs_draft else (), served,
                      exits=given_exits, gamma=args.gamma, target=args.target,
                      draft_layers=draft.num_layers if row.needs_draft else None)
    if setting.note:
        print(setting.note, file=sys.stderr)
    if row.proposes and args.gamma is None:
        check_gamma(setting.gamma, args.context, "the cache", source="--context", given=False)
    return setting


def _print_models(mesh_cfg, mesh, target, draft, exits, setting):
    devices = list(mesh.devices.flat)
    print(f"devices: {len(devices)} x {devices[0].platform}; mesh data={mesh_cfg.data} "
          f"fsdp={mesh_cfg.fsdp} tensor={mesh_cfg.tensor}")
    weights = getattr(target, "weights", None)
    print(f"target: {target.name} {target.num_layers} layers ({target.num_params() / 1e9:.1f}B "
          f"params, {target.param_dtype}" + (f"; matrices and head {weights}, per-channel "
                                             f"scales" if weights else "") + ")")
    if draft is not None:
        print(f"draft: {draft.name} {draft.num_layers} layers ({draft.num_params() / 1e9:.2f}B "
              f"params), exits {list(setting.exits or exits)}, gamma "
              f"{setting.gamma or DEFAULT_GAMMA}")


def _check_hlo(args, compiled, cfgs, batch, mesh):
    """--check-gathers / --check-copies on one compiled generation."""
    from s2d_jax.decode.aot import loop_cache_traffic, param_gathers
    if args.check_gathers:
        gathers = param_gathers(compiled.as_text(), cfgs, mesh)
        print(f"  whole-parameter all-gathers: {len(gathers)}")
        for g in gathers[:10]:
            print(f"    {g}")
    if args.check_copies:
        from s2d_jax.decode.aot import round_copy_list
        from s2d_jax.decode.tpu_report import copy_line
        print("  copies per round, by what they move:")
        print(copy_line(args.method, round_copy_list(compiled.as_text(), cfgs, batch,
                                                     args.context, mesh)))
        low = any(c is not None and c.dtype in ("bfloat16", "float16") for c in cfgs)
        if low and mesh.devices.flat[0].platform == "cpu":
            print("    (XLA:CPU only: it scatters a 16-bit cache through f32 and copies it back "
                  "into the loop's buffer every layer; the TPU compiler's program of the same "
                  "setting copies no cache, --topology v5p:2x2x2, docs/distributed.md)")
        found = loop_cache_traffic(compiled.as_text(), cfgs, batch, args.context, mesh)
        print(f"  decode loop: cache copies {len(found['copies'])}, out-of-place cache "
              f"updates {len(found['other'])}, whole-cache converts "
              f"{len(found['converts'])} (XLA:CPU's f32 round trip of a bf16 scatter; "
              f"GPU/TPU scatter bf16 in place)")
        for line in (found["copies"] + found["other"])[:10]:
            print(f"    {line}")


def _roofline_settings(setting, exits) -> list:
    """The settings the roofline compares: AR, SD at the deepest exit and S2D at `exits`
    (tpu_report.ROOFLINE_METHODS) at the compiled setting's gamma, with the compiled
    setting itself (a lookup / ladder one beside them) first: its program is reused."""
    from s2d_jax.decode.serving_config import resolve
    from s2d_jax.decode.tpu_report import ROOFLINE_METHODS
    return [setting] + [resolve(m, exits, draft_layers=exits[-1], gamma=setting.gamma or None)
                        for m in ROOFLINE_METHODS if m != setting.method]


def _roofline(args, batch, target, draft, exits, mesh, compiled, bandwidth, setting):
    """Per-round traffic of AR, SD, S2D (and the compiled --method) at `batch`, bounded at
    the device's bandwidth (a bf16 model's traffic from its float32 twin's program,
    roofline.float32_twin)."""
    from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_bytes
    from s2d_jax.decode.roofline import (RoundBound, float32_twin, format_roofline,
                                         minimum_round_bytes, scaled)
    (target32, factor), (draft32, _) = float32_twin(target), float32_twin(draft)
    rounds = []
    for s in _roofline_settings(setting, exits):
        d, d32 = (draft, draft32) if s.proposer.needs_draft else (None, None)
        setup = GenerateSetup.of(target, d, s, batch, args.context, args.prompt_len)
        twin = GenerateSetup.of(target32, d32, s, batch, args.context, args.prompt_len)
        if compiled is None or factor != 1.0:
            compiled = compile_generate(twin, mesh)[0]
        rounds.append(RoundBound(s.method, scaled(round_bytes(compiled, twin, mesh), factor),
                                 minimum_round_bytes(setup, mesh), s.gamma))
        compiled = None
    rounds.sort(key=lambda r: method_order(r.method))
    if factor != 1.0:
        print(f"  (round bytes from the float32 program x {factor:g}: XLA:CPU widens 16-bit "
              f"weights to f32 before each matmul, which accelerators do not)")
    for line in format_roofline(rounds, bandwidth, args.device_memory, args.acceptance):
        print(line)


def _train_step(args, mesh_cfg):
    from s2d_jax.train.aot import train_step_report
    print(f"SoFT training step ({args.train_config}):")
    for line in train_step_report(args.train_config, args.draft or args.target,
                                  [f"mesh.data={mesh_cfg.data}", f"mesh.fsdp={mesh_cfg.fsdp}",
                                   f"mesh.tensor={mesh_cfg.tensor}"]):
        print(line)


def _topology(args):
    """--topology: its compile-only devices (and the chip's --device-memory preset when
    none was given); None without it."""
    if args.topology is None:
        args.device_memory = args.device_memory or "h100-80gb"
        return None
    if args.fake_devices:
        raise S2DError("--topology compiles for its own devices; drop --fake-devices")
    from s2d_jax.parallel import topology
    devs = topology.devices(args.topology)
    args.device_memory = args.device_memory or topology.memory_preset(devs) or "h100-80gb"
    print(topology.describe(args.topology, devs))
    return devs


def _acceptances(text: str) -> list[float]:
    values = parse_floats(text, "--acceptance", nonempty=True)
    if not all(0.0 <= a < 1.0 for a in values):
        raise S2DError(f"--acceptance {text!r}: give per-token acceptance rates in [0, 1), "
                       f"e.g. 0.25,0.6")
    return values


@cli_main
def main(argv=None):
    args = _parse(argv)
    check_at_least(args, {"gamma": 1, "context": 4, "prompt_len": 1, "draft_layers": 1})
    if args.gamma is not None:  # before JAX starts (a calibrated one: _setting)
        check_gamma(args.gamma, args.context, "the cache", source="--context")
    if args.weights and args.roofline and not args.topology:
        raise S2DError(f"--weights {args.weights} --roofline needs --topology (e.g. v5e:2x4, "
                       f"h100:8): the CPU roofline scales a float32 twin's bytes by half, "
                       f"which int8 weights are not")
    from s2d_jax.parallel.multihost import parse_mesh
    mesh_cfg = parse_mesh(args.mesh)  # bad flags fail before JAX starts
    batches = parse_ints(args.batch_sizes, "--batch-sizes", minimum=1)
    exits = parse_ints(args.exits, "--exits", minimum=1) if args.exits else None
    args.acceptance = _acceptances(args.acceptance)
    if args.paper_acceptance is not None and not 0 <= args.paper_acceptance < 1:
        raise S2DError(f"--paper-acceptance {args.paper_acceptance}: a per-token acceptance "
                       f"rate in [0, 1)")
    from s2d_jax.decode.aot import (GenerateSetup, accelerator_like_options, compile_generate,
                                    device_memory_bytes, format_report, memory_report)
    from s2d_jax.decode.roofline import device_bandwidth
    tpu = _topology(args)  # compile-only TPU devices, before JAX starts a backend
    device_bytes = device_memory_bytes(args.device_memory)
    bandwidth = device_bandwidth(args.device_memory, args.bandwidth and args.bandwidth * 1e9)
    if args.roofline and bandwidth is None:
        raise S2DError(f"no memory bandwidth known for --device-memory {args.device_memory}; "
                       f"pass --bandwidth GB/s or a preset name")
    fake_cpu_devices(args.fake_devices)
    from s2d_jax.parallel.multihost import build_mesh
    target, draft, draft_exits = _models(args, exits)
    setting = _setting(args, target, draft, draft_exits, exits)
    cfgs = {"target": target} if draft is None else {"target": target, "draft": draft}
    mesh = build_mesh(mesh_cfg, cfgs, devices=tpu)
    _print_models(mesh_cfg, mesh, target, draft, draft_exits, setting)
    run_draft = draft if setting.proposer.needs_draft else None
    options = {} if args.raw_cpu_passes or tpu else accelerator_like_options([target, draft])
    if options:
        print("note: CPU compile with the bf16->f32 weight-convert hoisting disabled, so temp "
              "models a GPU/TPU (bf16 matmuls); --raw-cpu-passes shows the CPU's own")
    for batch in batches:
        setup = GenerateSetup.of(target, run_draft, setting, batch, args.context,
                                 args.prompt_len)
        compiled, t_lower, t_compile = compile_generate(setup, mesh, options)
        print(f"batch {batch}, context {args.context}, prompt {setup.prompt_len}: lower "
              f"{t_lower:.1f} s, compile {t_compile:.1f} s; per-device memory:")
        for line in format_report(memory_report(compiled, setup, mesh), device_bytes):
            print(line)
        _check_hlo(args, compiled, list(cfgs.values()), batch, mesh)
        if args.roofline and tpu:
            from s2d_jax.decode.tpu_report import method_setups, tpu_round_lines
            setups = {**method_setups(target, draft, draft_exits, batch, args.context,
                                      args.prompt_len, setting.gamma or None),
                      setting.method: setup}  # the compiled setting's own
            setups = dict(sorted(setups.items(), key=lambda kv: method_order(kv[0])))
            for line in tpu_round_lines(setups, mesh, (setting.method, compiled), bandwidth,
                                        args.device_memory, args.acceptance,
                                        args.paper_acceptance):
                print(line)
        elif args.roofline:
            _roofline(args, batch, target, draft, draft_exits, mesh, compiled, bandwidth,
                      setting)
        del compiled
    if args.train_config:
        _train_step(args, mesh_cfg)
    return 0


if __name__ == "__main__":
    main()
