"""Test setup: the real kernels run (compiled on a GPU, in Pallas interpret mode elsewhere);
tests marked ``gpu`` are skipped without a GPU."""

import jax
import pytest

import jaxkern

ON_GPU = jax.default_backend() == "gpu"


def pytest_configure(config):
  jaxkern.set_implementation("pallas" if ON_GPU else "interpret")


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def key(request):
  """A PRNG key that differs per test (seeded from the test id)."""
  import zlib

  return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
