"""Shared by the sharding tests: meshes over the first devices, and the child pytest that runs a file's ``8dev``
tests with 8 simulated CPU devices (the flag must be set before jax starts its backend, so not in this process)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

EIGHT = jax.device_count() >= 8
needs_8 = pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by test_multi_device_tests_in_a_subprocess)")


def mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


# XLA:CPU's backend (LLVM) optimisation off: for children whose tests compile the whole model's sharded step a few
# times and run it once on tiny shapes (CPU seconds, 2026-11-29, one child each: test_train_step_mgpu.py 437 at the
# default level, 362 at level 0, each of its 7 tests lower). Not the default: at level 0 XLA:CPU's float32 dots sum
# in another order (last-bit differences against the default level), which moved test_block_sharding.py's
# second-step loss past its tolerance (1.3e-3 against 1e-3), and the layer-sized children gained little or nothing
# (test_ep_fp8_dispatch.py 246 and 228, test_ep_capacity.py 154 and 154).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def run_8dev_tests(path, devices: int = 8, keyword: str = "8dev", xla_flags: str = ""):
  """Runs the ``keyword`` (default ``8dev``) tests of the test file ``path`` in a child pytest with ``devices``
  simulated CPU devices, ``xla_flags`` (e.g. :data:`FAST_COMPILE_FLAGS`) added to its ``XLA_FLAGS``."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices} {xla_flags}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-k", keyword,
                           os.path.abspath(path)], cwd=root, env=env, capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
