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


def run_8dev_tests(path, devices: int = 8, keyword: str = "8dev"):
  """Runs the ``keyword`` (default ``8dev``) tests of the test file ``path`` in a child pytest with ``devices``
  simulated CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip())
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-k", keyword,
                           os.path.abspath(path)], cwd=root, env=env, capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
