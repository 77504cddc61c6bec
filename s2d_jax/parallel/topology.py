"""Compile-only TPU devices for a named topology (`--topology v5p:2x2x2`): the real TPU
compiler's program, memory and cost analysis on a machine without a TPU, the way MaxText's
`train_compile.py` does (`jax.experimental.topologies.get_topology_desc`).

libtpu (`pip install -e '.[tpu]'`) holds the compiler. On a machine without a TPU it must
not look for one: `prepare()` sets, before JAX starts a backend, TPU_SKIP_MDS_QUERY (no
GCE metadata queries), TPU_WORKER_HOSTNAMES / TPU_HOST_BOUNDS (this host alone, quiet) and
JAX_PLATFORMS=cpu (ordinary arrays and `jax.devices()` stay on
the CPU; the topology's devices exist only to compile for) and ALLOW_MULTIPLE_LIBTPU_LOAD
(no exclusive lock on chips it does not drive), unless already set.
"""

from __future__ import annotations

import importlib.util
import os
import re

from s2d_jax.errors import S2DError

# device_kind of a compile-only device -> its --device-memory preset
CHIPS = {
    "TPU v4": "tpu-v4-32gb", "TPU v5 lite": "tpu-v5e-16gb", "TPU v5": "tpu-v5p-95gb",
    "TPU v5p": "tpu-v5p-95gb", "TPU v6 lite": "tpu-v6e-32gb", "TPU v6e": "tpu-v6e-32gb",
    "NVIDIA H100 80GB HBM3": "h100-80gb",
}


# GPUs described by an XLA GpuTargetConfig (configs/gpu/): `--topology h100:8`. The CUDA
# plugin (jax-cuda12-plugin, jax-cuda12-pjrt) compiles for them on a machine without a GPU.
GPU_CONFIGS = {"h100": "configs/gpu/h100_sxm.txtpb"}
_GPU = re.compile(r"^(h100):(\d+)$")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prepare(name: str = "") -> None:
    """Environment for a deviceless TPU (or `h100:N` GPU) compile; call before anything
    queries devices."""
    if _GPU.match(name):
        if not _installed("jax_plugins.xla_cuda12"):
            raise S2DError(f"--topology {name} needs JAX's CUDA plugin: pip install -e "
                           f"'.[cuda]' (jax[cuda12]; no GPU is needed to compile)")
        _cpu_backend()
        return
    # libtpu kept out of the environment (.ci/run's S2D_LIBTPU_PATH) is libtpu all the same
    kept_apart = os.environ.get("S2D_LIBTPU_PATH")
    if kept_apart and not os.environ.get("TPU_LIBRARY_PATH"):
        if not os.path.isfile(kept_apart):
            raise S2DError(f"S2D_LIBTPU_PATH={kept_apart} is no file; point it at a libtpu.so "
                           f"(pip install --no-deps --target DIR libtpu: DIR/libtpu/libtpu.so)")
        os.environ["TPU_LIBRARY_PATH"] = kept_apart
    if not _installed("libtpu") and not os.environ.get("TPU_LIBRARY_PATH"):
        # named by the slice, not a flag: infer.tpu_fits compiles slices it has no flag for
        raise S2DError(f"compiling for the TPU slice{' ' + name if name else 's'} needs the "
                       f"TPU compiler: pip install -e '.[tpu]' (libtpu; no TPU is needed to "
                       f"compile), or S2D_LIBTPU_PATH naming a libtpu.so kept out of the "
                       f"environment")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # This host as a one-host slice without chips: libtpu otherwise prints several lines
    # (no accelerator type, no worker hostnames) on loading; the compile-only topology is
    # the name's either way (v5p:4x4x4 stays 64 chips on 16 hosts).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    _cpu_backend()
    # libtpu takes /tmp/libtpu_lockfile for the chips it drives; a compile-only process
    # drives none, so two of them (a test beside a report) may share the machine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it: find_spec of a dotted name
    raises ModuleNotFoundError (not None) when its parent package (jax_plugins) is absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _cpu_backend() -> None:
    """JAX's own backend is the CPU: the env var for a JAX not yet imported, its config for
    one already imported (read when the first backend starts; the CUDA plugin checks for
    CUDA libraries then unless the platforms exclude it)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def devices(name: str) -> list:
    """The compile-only devices of topology `name` (e.g. v5p:2x2x2, v5e:4x4, v6e:2x4, or
    h100:8 for 8 H100s)."""
    prepare(name)
    import jax
    from jax.experimental import topologies
    # compile-only programs cannot be read back without the devices' client (JAX warns on
    # every read of the persistent cache): none is written or read for them
    jax.config.update("jax_enable_compilation_cache", False)
    gpu = _GPU.match(name)
    try:
        if gpu:
            with open(os.path.join(ROOT, GPU_CONFIGS[gpu.group(1)])) as f:
                config = f.read()
            return list(topologies.get_topology_desc(
                platform="cuda", target_config=config, topology=f"1x1x{gpu.group(2)}").devices)
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except Exception as e:  # libtpu's own message says what is wrong with the name
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise S2DError(f"--topology {name}: {first}; use e.g. v5p:2x2x2, v5e:2x4, v6e:2x4")


def hosts(devs) -> int:
    return len({d.process_index for d in devs})


def memory_preset(devs) -> str | None:
    """The --device-memory preset of the topology's chip (None: unknown chip)."""
    return CHIPS.get(devs[0].device_kind)


def describe(name: str, devs) -> str:
    return (f"topology {name}: {len(devs)} x {devs[0].device_kind} (compile-only) on "
            f"{hosts(devs)} host(s)")
