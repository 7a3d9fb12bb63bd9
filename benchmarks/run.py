"""Benchmark runner: ``python -m benchmarks.run [--ops NAMES] [--shapes REGEX] [--out FILE] [--iterations N]``.

On a GPU: lowers every (op, shape) in a background thread and compiles it in ``--jobs``
threads (never while a timing runs), and for each, in order, checks the kernel against the reference and times the kernel and the XLA-compiled ``jnp`` reference with CUPTI
(cold L2, median of ``--iterations``), and reports device µs, GB/s, % of the
device-to-device copy bandwidth measured in the same run, and the speed-up over
XLA. Rows go to a JSONL file under ``benchmarks/results/``; regenerate the summary
with ``python -m benchmarks.summarize``.

Without a GPU it says so and runs a small correctness-only pass of the kernels in
Pallas interpret mode.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import functools
import importlib
import json
import os
import pathlib
import pkgutil
import queue
import re
import sys
import threading
import time

import jax

import benchmarks
import jaxkern
from benchmarks.registry import REGISTRY

RESULTS = pathlib.Path(__file__).parent / "results"
_NOT_OPS = {"registry", "run", "summarize"}

for _m in pkgutil.iter_modules(benchmarks.__path__):
  if _m.name not in _NOT_OPS:
    importlib.import_module(f"benchmarks.{_m.name}")  # each op module registers its ops


def _select(names: str | None):
  if not names:
    return list(REGISTRY.values())
  unknown = [n for n in names.split(",") if n not in REGISTRY]
  if unknown:
    raise SystemExit(f"unknown ops {unknown}; registered: {sorted(REGISTRY)}")
  return [REGISTRY[n] for n in names.split(",")]


def _correctness_pass(ops) -> int:
  print(f"No GPU found (JAX backend: {jax.default_backend()}): nothing is timed. "
        "Running a correctness-only pass of the kernels in Pallas interpret mode.")
  failures = 0
  key = jax.random.key(0)
  for op in ops:
    for case in op.small_cases():
      key, sub = jax.random.split(key)
      args = case.make_args(sub)
      t0 = time.perf_counter()
      try:
        with jaxkern.use_implementation("interpret"):
          out = op.fn(*args, **case.kwargs)
        op.check(out, op.reference(*args, **case.kwargs))
        status = "ok"
      except Exception as e:  # report every case, fail at the end
        failures += 1
        status = f"FAILED: {type(e).__name__}: {e}"
      print(f"{op.name:24s} {case.label:28s} {time.perf_counter() - t0:6.2f}s  {status}")
  return failures


def _avals(case, key):
  """Shapes of ``case.make_args(key)``, without building the arrays where the generator allows."""
  try:
    return jax.eval_shape(case.make_args, key)
  except Exception:  # generators that need concrete values (host-side numpy)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), case.make_args(key))


class _Quiet:
  """Keeps compiles (XLA may autotune on the GPU while compiling) and timings apart."""

  def __init__(self):
    self._cv = threading.Condition()
    self._compiling = 0
    self._timing = False

  def compile(self, lowered):
    with self._cv:
      self._cv.wait_for(lambda: not self._timing)
      self._compiling += 1
    try:
      return lowered.compile()
    finally:
      with self._cv:
        self._compiling -= 1
        self._cv.notify_all()

  @contextlib.contextmanager
  def timing(self):
    with self._cv:
      self._timing = True
      self._cv.wait_for(lambda: not self._compiling)
    try:
      yield
    finally:
      with self._cv:
        self._timing = False
        self._cv.notify_all()


def _compile_all(todo, jobs: int, quiet: _Quiet):
  """Lowers the flushed kernel and reference executables of every case in a background thread
  (tracing holds the GIL) and compiles them in ``jobs`` threads; yields ``(op, case, key, avals,
  kernel, ref)`` in order as they become ready."""
  from jaxkern.testing.timing import flush_buffer, lower_timed

  flush_buffer()
  ready = queue.Queue(maxsize=4 * jobs)
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:

    def produce():
      try:
        for op, case, key in todo:
          avals = _avals(case, key)
          fns = (functools.partial(op.fn, **case.kwargs), functools.partial(op.reference, **case.kwargs))
          ready.put((op, case, key, avals, [pool.submit(quiet.compile, lower_timed(f, *avals)) for f in fns]))
      except BaseException as e:  # surfaces in the consumer
        ready.put(e)
      ready.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ready.get()) is not None:
      if isinstance(item, BaseException):
        raise item
      op, case, key, avals, futures = item
      yield op, case, key, avals, *(f.result() for f in futures)


def _benchmark(ops, out_path: pathlib.Path, iterations: int, shapes: str | None, jobs: int) -> int:
  from jaxkern.testing.timing import copy_bandwidth_gbps, device_time_us, flush_buffer

  device = jax.devices()[0].device_kind
  date = datetime.date.today().isoformat()
  copy_bw = copy_bandwidth_gbps()
  print(f"{device}, jax {jax.__version__}, {date}; device-to-device copy: {copy_bw:.0f} GB/s")
  header = f"{'op':20s} {'shape':26s} {'µs':>9s} {'GB/s':>7s} {'%copy':>6s} {'xla µs':>9s} {'speed-up':>8s}"
  print(header)
  todo = [(op, case) for op in ops for case in op.cases() if not shapes or re.search(shapes, case.label)]
  keys = jax.random.split(jax.random.key(0), max(len(todo), 1))
  failures = 0
  out_path.parent.mkdir(parents=True, exist_ok=True)
  with out_path.open("a") as f:
    quiet = _Quiet()
    for op, case, key, avals, kernel, ref in _compile_all([(*t, k) for t, k in zip(todo, keys)], jobs, quiet):
      args = case.make_args(key)
      if jax.tree.map(lambda a: (a.shape, a.dtype), args) != jax.tree.map(lambda a: (a.shape, a.dtype), avals):
        raise RuntimeError(f"{op.name} {case.label}: make_args gave other shapes than it traced to")
      try:
        op.check(kernel(flush_buffer(), *args)[1], ref(flush_buffer(), *args)[1])
        ok = True
      except AssertionError as e:
        ok = False
        failures += 1
        print(f"{op.name} {case.label}: WRONG RESULT: {e}")
      fk = functools.partial(op.fn, **case.kwargs)
      fr = functools.partial(op.reference, **case.kwargs)
      with quiet.timing():
        t = device_time_us(fk, *args, iterations=iterations, compiled=kernel)
        t_ref = device_time_us(fr, *args, iterations=iterations, compiled=ref)
      gbps = case.nbytes / t / 1e3
      row = dict(op=op.name, shape=case.label, device_us=round(t, 3), gbps=round(gbps, 1),
                 pct_copy=round(100 * gbps / copy_bw, 1), xla_us=round(t_ref, 3),
                 speedup=round(t_ref / t, 3), correct=ok, bytes=case.nbytes, copy_gbps=round(copy_bw, 1),
                 gpu=device, date=date, jax=jax.__version__, iterations=iterations,
                 time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
      f.write(json.dumps(row) + "\n")
      f.flush()
      print(f"{op.name:20s} {case.label:26s} {t:9.2f} {gbps:7.0f} {row['pct_copy']:6.1f} "
            f"{t_ref:9.2f} {row['speedup']:8.2f}{'' if ok else '  WRONG'}", flush=True)
      del args
  print(f"wrote {out_path}")
  return failures


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ops", help="comma-separated op names (default: all registered)")
  parser.add_argument("--shapes", help="only the shapes whose label matches this regular expression")
  parser.add_argument("--out", type=pathlib.Path, help="JSONL output (default: benchmarks/results/<date>_<gpu>.jsonl)")
  parser.add_argument("--iterations", type=int, default=30, help="timed calls per measurement (median)")
  parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="threads compiling ahead of the timing")
  args = parser.parse_args(argv)
  ops = _select(args.ops)
  if jax.default_backend() != "gpu":
    return 1 if _correctness_pass(ops) else 0
  slug = jax.devices()[0].device_kind.replace(" ", "-")
  out = args.out or RESULTS / f"{datetime.date.today().isoformat()}_{slug}.jsonl"
  return 1 if _benchmark(ops, out, args.iterations, args.shapes, args.jobs) else 0


if __name__ == "__main__":
  sys.exit(main())
