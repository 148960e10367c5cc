"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""
import os

# Eight simulated devices on two cores: single-threaded Eigen keeps each device's work on its own
# thread, so a device cannot starve the others inside a collective (seen as rare hangs).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    " --xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
