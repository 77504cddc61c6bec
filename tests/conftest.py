"""Test setup: 8 faked CPU devices (set before JAX is imported) and exact float32 matmuls."""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs_after_each_module():
    """JAX keeps every program a test compiled (and its traces) for the process's life; a
    module's tests later in the run measured 20-50% slower than the same module alone. The
    next module starts from an empty cache (helpers that cache decoders recompile once)."""
    yield
    jax.clear_caches()
    gc.collect()
