"""Ahead-of-time proof that a sharded S2D generation fits: lower and compile
`engine.generate` on abstract shapes (ShapeDtypeStructs carrying their shardings; no
weight is ever allocated) and read per-device memory from `compiled.memory_analysis()`.

The same compiled HLO also answers "is any weight gathered whole onto one device?":
`param_gathers` lists every all-gather whose result has the shape of a full sharded
parameter (or of one layer of it, as the layer scan would gather it).
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.model.transformer import param_shardings
from s2d_jax.decode.hlo_copies import cache_traffic
from s2d_jax.model.kvcache import cache_bytes, cache_shape, cache_sharding
from s2d_jax.parallel.memory import tree_bytes, tree_bytes_per_device
from s2d_jax.decode.methods import proposer
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.errors import S2DError

GIB = 2**30
# XLA:CPU has no bf16/f16 matmul: it converts the weights to f32 and hoists that convert out
# of the layer scan, i.e. a float32 copy of every stacked weight (2x the params) in temp.
# GPUs/TPUs multiply bf16 natively, so a CPU compile that models them keeps the convert
# inside the loop (one layer at a time) by disabling the hoisting passes.
CPU_NO_HOIST = {"xla_disable_hlo_passes":
                "while-loop-invariant-code-motion,while-loop-expensive-invariant-code-motion"}
# Usable accelerator memory per device, GiB (what the runtime reports, a bit under the label).
DEVICE_MEMORY_GIB = {
    "h100-80gb": 79.6, "h200-141gb": 139.8, "a100-80gb": 79.2, "a100-40gb": 39.4, "l4-24gb": 22.0,
    "tpu-v5e-16gb": 15.75, "tpu-v4-32gb": 32.0, "tpu-v5p-95gb": 95.0, "tpu-v6e-32gb": 31.25,
}


def device_memory_bytes(name: str) -> int:
    """A preset name (h100-80gb, tpu-v5e-16gb, ...) or a number of GiB -> bytes."""
    if name in DEVICE_MEMORY_GIB:
        return int(DEVICE_MEMORY_GIB[name] * GIB)
    try:
        gib = float(name)
    except ValueError:
        gib = -1.0
    if gib <= 0:
        raise S2DError(f"unknown --device-memory {name!r}; use a number of GiB or one of "
                       f"{', '.join(DEVICE_MEMORY_GIB)}")
    return int(gib * GIB)


def abstract_params(cfg: ModelConfig, mesh=None):
    """Params as ShapeDtypeStructs placed by the shared rules (no memory allocated); a
    quantize.QuantizedConfig's as its quantized weights (int8 q and scales)."""
    shapes = model.abstract_params(cfg)
    if mesh is not None:
        shapes = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              shapes, param_shardings(cfg, mesh))
    if getattr(cfg, "weights", None):
        from s2d_jax.model.quantize import abstract_quantized
        shapes = abstract_quantized(shapes, cfg.weights)
    return shapes


@dataclasses.dataclass(frozen=True)
class GenerateSetup:
    """Everything that fixes the compiled program of one S2D generation."""

    target_cfg: ModelConfig
    draft_cfg: ModelConfig | None
    spec: SpecConfig
    batch: int
    prompt_len: int

    @classmethod
    def make(cls, target_cfg, draft_cfg, exits, batch, context, prompt_len=None, gamma=None,
             method="s2d"):
        """`method` at `exits` (a single-exit method: the deepest) and `gamma` (None: the
        method's default), as serving_config.resolve works out the rest."""
        from s2d_jax.decode.serving_config import resolve
        single = proposer(method).single_exit
        setting = resolve(method, tuple(exits), exits=None if single else tuple(exits),
                          exit=exits[-1] if single and exits else None, gamma=gamma)
        return cls.of(target_cfg, draft_cfg, setting, batch, context, prompt_len)

    @classmethod
    def of(cls, target_cfg, draft_cfg, setting, batch, context, prompt_len=None):
        """The program of a DecodeSetting (serving_config.resolve's), taken as it is."""
        if setting.proposer.self_draft:  # its draft is the target's own first layers
            draft_cfg = target_cfg
        if context > target_cfg.max_position_embeddings:
            raise S2DError(f"context {context} exceeds the target's max_position_embeddings "
                           f"{target_cfg.max_position_embeddings}; use a smaller --context")
        prompt_len = context // 4 if prompt_len is None else prompt_len
        if not 1 <= prompt_len < context:  # room for one new token (round.py shrinks rounds)
            raise S2DError(f"prompt length {prompt_len} must lie in 1..{context - 1} "
                           f"for context {context}")
        spec = SpecConfig(method=setting.method, exits=setting.exits, gamma=setting.gamma,
                          max_len=context, ngram=setting.ngram, lookup_len=setting.lookup_len)
        chain = Chain(draft_cfg, (), target_cfg, spec)  # checks the exits, cuts the draft
        return cls(target_cfg, chain.draft, spec, batch, prompt_len)

    def chain(self, mesh=None) -> Chain:
        return Chain(self.draft_cfg, (), self.target_cfg, self.spec, mesh)


def lower_generate(setup: GenerateSetup, mesh=None):
    """engine.generate lowered on abstract params and prompts -> jax Lowered."""
    s = setup
    draft = abstract_params(s.draft_cfg, mesh) if s.draft_cfg is not None else None
    target = abstract_params(s.target_cfg, mesh)
    prompts = jax.ShapeDtypeStruct((s.batch, s.prompt_len), jnp.int32)
    lens = jax.ShapeDtypeStruct((s.batch,), jnp.int32)
    dp = jax.eval_shape(lambda: DecodeParams.make(s.spec))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return engine.generate.lower(draft, target, prompts, lens, dp, key, chain=s.chain(mesh))


def accelerator_like_options(cfgs) -> dict:
    """Compiler options that make a CPU compile's memory model a GPU/TPU's (see CPU_NO_HOIST)."""
    low = any(c is not None and c.param_dtype in ("bfloat16", "float16") for c in cfgs)
    return dict(CPU_NO_HOIST) if low and jax.default_backend() == "cpu" else {}


def quantized_options(cfgs, mesh=None) -> dict:
    """Compiler options an int8 model's program needs on a GPU: XLA:GPU's slice sinker turns
    the converts of a stack's unrolled layer slices (decode_scope) into one convert of the
    whole stack, a bf16 copy of every int8 weight written each round (8 layers of the 70B on
    h100:8: 4.9x the round's int8 floor; without the pass 1.01x). A GPU run of int8 weights
    must compile with them too (jax.jit's compiler_options)."""
    gpu = mesh is not None and mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")
    quantized = any(getattr(c, "weights", None) for c in cfgs if c is not None)
    return {"xla_disable_hlo_passes": "slice-sinker"} if gpu and quantized else {}


def compile_generate(setup: GenerateSetup, mesh=None, compiler_options=None):
    """(compiled, lower seconds, compile seconds)."""
    t0 = time.perf_counter()
    lowered = lower_generate(setup, mesh)
    t1 = time.perf_counter()
    options = {**quantized_options([setup.target_cfg, setup.draft_cfg], mesh),
               **(compiler_options or {})}
    compiled = lowered.compile(options)
    return compiled, t1 - t0, time.perf_counter() - t1


def memory_report(compiled, setup: GenerateSetup, mesh=None) -> dict:
    """Per-device bytes from XLA next to what the params and caches alone should take."""
    m = compiled.memory_analysis()
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    rep = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
           "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
           "generated_code": m.generated_code_size_in_bytes, "peak_estimate": peak,
           "num_devices": mesh.devices.size if mesh is not None else 1}
    for role, cfg in (("target", setup.target_cfg), ("draft", setup.draft_cfg)):
        if cfg is None:
            continue
        params = abstract_params(cfg, mesh)
        total, per_dev = cache_bytes(cfg, setup.batch, setup.spec.max_len, mesh)
        rep[f"{role}_params_total"] = tree_bytes(params)
        rep[f"{role}_params_per_device"] = tree_bytes_per_device(params)
        rep[f"{role}_cache_total"] = total
        rep[f"{role}_cache_per_device"] = per_dev
    return rep


_OP = re.compile(r"=\s*(.*?)\s+(all-gather(?:-start)?)\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def param_gathers(hlo_text: str, cfgs: list[ModelConfig], mesh) -> list[str]:
    """HLO all-gathers whose result is shaped like a whole sharded parameter, or like one
    layer of a stacked one: a weight rebuilt whole on every device (empty = none)."""
    whole = set()
    for cfg in cfgs:
        shapes = model.param_shapes(cfg)
        shard = param_shardings(cfg, mesh)
        for path, shape in jax.tree_util.tree_flatten_with_path(
                shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
            sh = shard
            for k in path:
                sh = sh[k.key]
            if sh.shard_shape(shape) == tuple(shape):
                continue  # replicated anyway (norms)
            whole.add(tuple(shape))
            if jax.tree_util.keystr(path).startswith("['layers']"):
                whole.add(tuple(shape[1:]))
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        for dims in _SHAPE.findall(m.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape in whole:
                found.append(line.strip()[:160])
                break
    return found


def device_cache_shapes(cfgs, batch: int, max_len: int, mesh=None) -> list[tuple]:
    """Per-device shape of each model's K (or V) cache: rows over data/fsdp, kv heads over
    tensor (None models skipped)."""
    shapes = []
    for cfg in cfgs:
        if cfg is None:
            continue
        shape = cache_shape(cfg, batch, max_len)
        shapes.append(cache_sharding(mesh).shard_shape(shape) if mesh is not None else shape)
    return shapes


def device_param_shapes(cfgs, mesh=None) -> list[tuple]:
    """Per-device shape of every parameter of the models `cfgs` (None models skipped)."""
    shapes = []
    for cfg in cfgs:
        if cfg is None:
            continue
        for a in jax.tree.leaves(abstract_params(cfg, mesh)):
            shapes.append(a.sharding.shard_shape(a.shape) if mesh is not None else a.shape)
    return shapes


def sharded_param_shapes(cfgs, mesh=None) -> list[tuple]:
    """The whole shape of every parameter of `cfgs` that `mesh` splits (what an all-gather
    of it would rebuild on each device)."""
    if mesh is None:
        return []
    return [a.shape for cfg in cfgs if cfg is not None
            for a in jax.tree.leaves(abstract_params(cfg, mesh))
            if a.sharding.shard_shape(a.shape) != a.shape]


def round_copy_list(hlo_text: str, cfgs, batch: int, max_len: int, mesh=None):
    """`round_copies.round_copies` of a compiled generation whose models are `cfgs`."""
    from s2d_jax.decode.round_copies import round_copies
    return round_copies(hlo_text, device_cache_shapes(cfgs, batch, max_len, mesh),
                        device_param_shapes(cfgs, mesh), sharded_param_shapes(cfgs, mesh))


def loop_cache_traffic(hlo_text: str, cfgs, batch: int, max_len: int, mesh=None) -> dict:
    """`hlo_copies.cache_traffic` of a compiled generation whose models are `cfgs`."""
    return cache_traffic(hlo_text, device_cache_shapes(cfgs, batch, max_len, mesh))


def round_bytes(compiled, setup: GenerateSetup, mesh=None):
    """`hlo_traffic.round_traffic` of a compiled generation: one round's bytes per device."""
    from s2d_jax.decode.hlo_traffic import round_traffic
    shapes = device_cache_shapes([setup.target_cfg, setup.draft_cfg], setup.batch,
                                 setup.spec.max_len, mesh)
    return round_traffic(compiled.as_text(), shapes)


def format_report(rep: dict, device_bytes: int | None = None) -> list[str]:
    """Printable lines (GiB per device) for one compiled generation."""
    gib = lambda b: f"{b / GIB:9.3f} GiB"  # noqa: E731
    lines = [f"  {'argument':<22}{gib(rep['argument'])}",
             f"    {'target params':<20}{gib(rep['target_params_per_device'])}"
             f"  (of {rep['target_params_total'] / GIB:.2f} GiB total)"]
    if "draft_params_per_device" in rep:
        lines.append(f"    {'draft params':<20}{gib(rep['draft_params_per_device'])}"
                     f"  (of {rep['draft_params_total'] / GIB:.2f} GiB total)")
    lines.append(f"  {'output':<22}{gib(rep['output'])}")
    lines.append(f"    {'target KV cache':<20}{gib(rep['target_cache_per_device'])}")
    if "draft_cache_per_device" in rep:
        lines.append(f"    {'draft KV cache':<20}{gib(rep['draft_cache_per_device'])}")
    lines += [f"  {'temp':<22}{gib(rep['temp'])}",
              f"  {'alias (donated)':<22}{gib(rep['alias'])}",
              f"  {'generated code':<22}{gib(rep['generated_code'])}",
              f"  {'peak estimate':<22}{gib(rep['peak_estimate'])}"]
    if device_bytes is not None:
        fits = rep["peak_estimate"] <= device_bytes
        lines.append(f"  fits {device_bytes / GIB:.2f} GiB per device: "
                     f"{'yes' if fits else 'NO'} "
                     f"({100 * rep['peak_estimate'] / device_bytes:.0f}% used)")
    return lines


def serving_report(targets: dict, batch: int, max_len: int, mesh=None, draft=None) -> dict:
    """Per model placed on a shared mesh: bytes of params and of a `batch` x `max_len` KV
    cache on one device. `targets`/`draft`: name -> (cfg, params) with params on the mesh
    (actual arrays: the byte counts come from their shardings)."""
    models = dict(targets)
    if draft is not None:
        models["(draft)"] = draft
    out = {}
    for name, (cfg, params) in models.items():
        cache_total, cache_dev = cache_bytes(cfg, batch, max_len, mesh)
        out[name] = {"params_per_device": tree_bytes_per_device(params),
                     "params_total": tree_bytes(params),
                     "cache_per_device": cache_dev, "cache_total": cache_total}
    return out
