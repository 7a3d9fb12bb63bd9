"""Test setup: the real kernels run (compiled on a GPU, in Pallas interpret mode elsewhere);
tests marked ``gpu`` are skipped without a GPU; off a GPU one persistent compilation cache serves the whole session."""

import os
import shutil
import tempfile

import jax
import pytest

import jaxkern


def _share_compilation_cache():
  """JAX's persistent compilation cache in one directory for every process of the session: the xdist workers, the
  child pytest runs of the multi-device tests and the notebooks' kernels inherit the environment variables set here,
  so a program another process (or another ``jax.jit`` of the same function) compiled is loaded, not compiled again.
  Interpret-mode tests spend most of their CPU time in XLA:CPU compilation; a hit costs about 7% of a compile, a
  miss the write of the entry, under 2% of a test's CPU time (CPU seconds, 2026-11-29). Every program is stored,
  however small or quick to compile. A ``JAX_COMPILATION_CACHE_DIR`` set beforehand is used as it is (kept across
  sessions, it spares the compiles of unchanged programs: the cache key is the whole program, the compile options and
  the jax / XLA versions); otherwise a fresh temporary directory, removed when the session ends (the returned path).
  ``JAX_ENABLE_COMPILATION_CACHE=false`` turns the cache off."""
  owned = None
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    owned = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxkern-compilation-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
  return owned


ON_GPU = jax.default_backend() == "gpu"
# Off a GPU only (the GPU runs keep their compiles as they were); before anything compiles: JAX decides once per
# process whether it uses the cache.
_OWNED_CACHE_DIR = None if ON_GPU else _share_compilation_cache()


def pytest_configure(config):
  jaxkern.set_implementation("pallas" if ON_GPU else "interpret")


def pytest_unconfigure(config):
  if _OWNED_CACHE_DIR:  # the session's first process (the xdist controller) made it; its workers have exited
    shutil.rmtree(_OWNED_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
  # The multi-device tests rerun a module in a child pytest with simulated devices: the suite's longest tests (one
  # to thirteen minutes each on 2 cores, about a fifth of its summed time; 2026-11-29). Started first, so that
  # pytest-xdist's workers fill the rest of the run around them instead of one of them ending the run alone.
  items.sort(key=lambda item: not item.name.endswith("_in_a_subprocess"))


@pytest.fixture
def key(request):
  """A PRNG key that differs per test (seeded from the test id)."""
  import zlib

  return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
