"""Runs a snippet in a fresh Python process that simulates a given number of CPU devices.

The test process has 8 simulated devices, fixed when JAX started. Questions about 16, 32 or 64
workers (bytes that must not grow with the worker count) are answered by compiling, never
running, the step in a child process with that many devices.
"""

import json
import os
import subprocess
import sys
import textwrap


def run_with_devices(num_devices: int, code: str, timeout: float = 600) -> object:
  """Executes ``code`` with ``num_devices`` CPU devices and returns what it prints as JSON.

  ``code`` must print exactly one JSON document on its last line of stdout.
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"child with {num_devices} devices failed:\n{result.stderr[-4000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])
