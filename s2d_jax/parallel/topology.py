"""Compile-only TPU devices for a named topology (`--topology v5p:2x2x2`): the real TPU
compiler's program, memory and cost analysis on a machine without a TPU, the way MaxText's
`train_compile.py` does (`jax.experimental.topologies.get_topology_desc`).

libtpu (`pip install -e '.[tpu]'`) holds the compiler. On a machine without a TPU it must
not look for one: `prepare()` sets, before JAX starts a backend, TPU_SKIP_MDS_QUERY (no
GCE metadata queries) and JAX_PLATFORMS=cpu (ordinary arrays and `jax.devices()` stay on
the CPU; the topology's devices exist only to compile for), unless already set.
"""

from __future__ import annotations

import importlib.util
import os

from s2d_jax.errors import S2DError

# device_kind of a compile-only device -> (--device-memory preset, chip name in reports)
CHIPS = {
    "TPU v4": "tpu-v4-32gb", "TPU v5 lite": "tpu-v5e-16gb", "TPU v5": "tpu-v5p-95gb",
    "TPU v5p": "tpu-v5p-95gb", "TPU v6 lite": "tpu-v6e-32gb", "TPU v6e": "tpu-v6e-32gb",
}


def prepare() -> None:
    """Environment for a deviceless TPU compile; call before anything queries devices."""
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        raise S2DError("--topology needs the TPU compiler: pip install -e '.[tpu]' "
                       "(libtpu; no TPU is needed to compile)")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def devices(name: str) -> list:
    """The compile-only devices of topology `name` (e.g. v5p:2x2x2, v5e:4x4, v6e:2x4)."""
    prepare()
    from jax.experimental import topologies
    try:
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
