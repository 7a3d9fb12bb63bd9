"""Test setup: the real kernels run (compiled on a GPU, in Pallas interpret mode elsewhere);
tests marked ``gpu`` are skipped without a GPU; off a GPU one persistent compilation cache serves the whole session
and JAX's eager random draws compile once per flat length, not per shape (the same values); Python's garbage
collector runs less often."""

import gc
import inspect
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core as _jax_core

import jaxkern


def _dispatch_cpu_programs_inline():
  """XLA:CPU runs each program before the call returns (``jax_cpu_enable_async_dispatch`` off), in this process and
  in the ones it starts (the notebooks' kernels, the child pytest runs), before the CPU client exists.

  An interpret-mode kernel runs its threads' steps as host callbacks that themselves dispatch JAX operations. A test
  that leaves such a kernel running (its result not awaited) while it dispatches more operations can hang: on this
  2-core CI machine, 2026-11-30, ``tests/quant/test_per_block_cast.py::test_jit_does_not_retrace`` stopped with both
  xdist workers idle, the main thread in an eager multiply and a kernel's callback in the interpreter's
  ``wait_smem_to_gmem``; a loop of that test's calls, results not awaited, hung in 1 of 7 runs of 25 iterations, and
  ran 5 of 5 with inline dispatch."""
  os.environ.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
  jax.config.update("jax_cpu_enable_async_dispatch", os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"].lower() == "true")


_dispatch_cpu_programs_inline()


def _enough_xla_cpu_threads():
  """XLA:CPU's thread pool gets 16 threads (``NPROC``, read when the CPU client is made; inherited by the child
  processes), not one per core. An interpret-mode kernel runs each warpgroup (or warp) as a thread whose program waits
  on barriers in host callbacks, and those callbacks occupy the pool's threads while they wait. With 2 threads (this
  2-core CI machine) two waiting callbacks starved the other threads' programs, and the kernel never ended. Seen on
  2026-11-30 with two variants of the clustered FP8 GEMM (the loads from one warp, and the next step's barrier
  wait at the end of a step). gdb found both "XLAEigen" threads in barrier-wait callbacks, while four warpgroup
  threads waited for their programs to run. With ``NPROC=16`` the same case ended in 13 s."""
  os.environ.setdefault("NPROC", "16")


_enough_xla_cpu_threads()


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


def _in_few_programs(draw):
  """``draw`` (``jax.random.normal``, ``uniform``, ``bits`` or ``randint``) with the same values, compiled for few
  shapes.

  Every new shape of a draw is a new program, and a threefry draw compiles slowly: 0.3-0.9 CPU seconds, against
  0.06 for a small elementwise program (2026-11-29: 131 normal draws took 121 of tests/mhc's 724 CPU seconds).
  JAX's threefry counts through the flattened array (``jax_threefry_partitionable``, the default), so the values of
  a draw are the first ones of a longer flat draw with the same key: called outside any trace with an uncommitted
  key and scalar options, the wrapper draws a flat power-of-two length (at least 1024) in a program compiled once per
  length and dtype, and returns the first ``prod(shape)`` values, reshaped. Other calls go to ``draw`` unchanged.
  The values are ``draw``'s own bit for bit (tests/test_conftest.py)."""
  signature = inspect.signature(draw)
  flat = jax.jit(lambda key, options, *, shape, dtype: draw(key, shape, **options, **dict(dtype)),
                 static_argnames=("shape", "dtype"))

  def wrapper(*args, **kwargs):
    try:
      named = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
      return draw(*args, **kwargs)
    key, shape = named.pop("key"), named.pop("shape", ())
    dtype = {"dtype": named.pop("dtype")} if "dtype" in named else {}
    if named.get("out_sharding", 0) is None:
      del named["out_sharding"]
    if (not _jax_core.trace_state_clean() or getattr(key, "_committed", True) or "out_sharding" in named
        or not isinstance(shape, (tuple, list)) or not all(isinstance(d, (int, np.integer)) for d in shape)
        or any(np.ndim(v) for v in named.values()) or not jax.sharding.get_abstract_mesh().empty):
      return draw(*args, **kwargs)
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if size == 0:
      return draw(*args, **kwargs)
    values = flat(key, named, shape=(max(1024, 1 << (size - 1).bit_length()),), dtype=tuple(dtype.items()))
    return jnp.asarray(np.asarray(values)[:size].reshape(shape))

  wrapper.__wrapped__ = draw
  return wrapper


ON_GPU = jax.default_backend() == "gpu"
# Off a GPU only (the GPU runs keep their compiles as they were); before anything compiles: JAX decides once per
# process whether it uses the cache.
_OWNED_CACHE_DIR = None if ON_GPU else _share_compilation_cache()
if not ON_GPU and jax.config.jax_threefry_partitionable:
  jax.random.normal = _in_few_programs(jax.random.normal)
  jax.random.uniform = _in_few_programs(jax.random.uniform)
  jax.random.bits = _in_few_programs(jax.random.bits)
  jax.random.randint = _in_few_programs(jax.random.randint)


def _collect_garbage_less_often():
  """Python's cyclic garbage collector tuned for a long test process: the objects alive after the imports (jax,
  jaxkern, pytest) frozen out of its scans, and the generations' thresholds 50,000 / 20 / 100 instead of 700 / 10 /
  10 (cycles are still collected, later). CPU seconds, 2026-11-29, one process running tests/test_autodiff.py,
  test_preconditions.py, test_api.py and test_fuzz.py: 408.8 with the defaults, 11.5 of them in collections (8.7 in
  14 full ones); 399.2 tuned, 3.1 in collections. The xdist workers live longer, with larger heaps: each full
  collection costs them more."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)


def pytest_configure(config):
  jaxkern.set_implementation("pallas" if ON_GPU else "interpret")
  _collect_garbage_less_often()


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
