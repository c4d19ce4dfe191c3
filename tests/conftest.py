import atexit
import os
import shutil
import tempfile

# XLA's CPU compiler, set for the tests: compiling is most of the suite's time, and the classic fusion emitters
# at LLVM -O1 take 0.56x the defaults' CPU time on the compile-heavy test files. The tests compare autopp's
# programs with plain jax.jit compiled the same way (the benchmarks keep the defaults). Settings change rounding:
# at -O0 or -O2 a few AdamW comparisons miss atol=1e-7 by ~1e-7 on a bias whose exact gradient is near zero;
# XLA's defaults and these pass.
# A flag already in $XLA_FLAGS wins; the multi-process tests' workers inherit these.
_TEST_XLA_FLAGS = {"--xla_force_host_platform_device_count": "8", "--xla_cpu_use_fusion_emitters": "false",
                   "--xla_backend_optimization_level": "1"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"{k}={v}" for k, v in _TEST_XLA_FLAGS.items() if k not in _flags]).strip()
# Measured profiles are cached under $XDG_CACHE_HOME/autopp: keep the tests' out of the user's cache.
# Removed when the session ends (the multi-process tests' workers inherit it while they run).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autopp-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# JAX's persistent compilation cache (the directory autopp.parallelize would choose) from the start, in this process
# and in the processes the tests start: the multi-process tests' workers load what this process compiled first.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["XDG_CACHE_HOME"], "autopp", "xla")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
