import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Measured profiles are cached under $XDG_CACHE_HOME/autopp: keep the tests' out of the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autopp-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
