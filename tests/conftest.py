"""Test setup: 8 faked CPU devices (set before JAX is imported) and exact float32 matmuls."""

import atexit
import os
import shutil
import tempfile

# LLVM's optimisation off for XLA's CPU programs: a test runs each program a few times, so
# compiling fast beats running fast (the whole fast set 1018 s -> 897 s on a Zen 4). XLA's HLO
# passes, and so the programs the copy and fusion tests read, are the same; the product's own
# processes (CLIs, bench) keep XLA's defaults. Subprocesses of the tests inherit the flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the persistent compilation cache (s2d_jax/compile_cache.py) in a folder of this run's own:
# no test reads programs an earlier run or the user's commands left (a test's compile
# counts and timings do not depend on what ran before); the CLIs the tests start share it
_CACHE = tempfile.mkdtemp(prefix="s2d-test-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["S2D_COMPILE_CACHE"] = _CACHE

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# JAX keeps every program compiled in this process, and tests in different modules reuse them
# (the serve modules warm the same slot engine). Dropping them after each module
# (jax.clear_caches) measured slower: the whole fast set 1110 s with it against 1018 s without,
# back to back on one idle Zen 4 (the four serve modules 195 s against 90 s).
