"""Benchmark runner: ``python -m benchmarks.run [--ops NAMES] [--shapes REGEX] [--tilekernels] [--out FILE] [--iterations N]``.

``--tilekernels``: only the shapes that have a TileKernels target (all the ops that have one unless ``--ops``
names some): one run that shows where jaxkern stands against TileKernels on the card the targets came from.

On a GPU: lowers every (op, shape) in a background thread and compiles it in ``--jobs``
threads (never while a timing runs; ``--workers N`` splits the shapes over N processes that
lower in parallel), and for each, in order, checks the kernel against the reference and times the kernel and the XLA-compiled ``jnp`` reference with CUPTI
(cold L2, median of ``--iterations``), and reports device µs, GB/s, % of the
device-to-device copy bandwidth measured in the same run, the speed-up over
XLA and, where ``benchmarks/anchors/`` has a TileKernels target for the shape on the card the run is on
(an H100 80GB HBM3 or an H200), that speed-up against TileKernels' (``vs_tilekernels`` = speed-up /
``tilekernels_target_speedup``, > 1: faster than TileKernels). Every row records
the path the op call took (``pallas`` or ``xla``, from :func:`jaxkern.explain`; ``path_reason`` says why where it is not the kernel). Rows go to a JSONL
file under ``benchmarks/results/``; regenerate the summary with ``python -m benchmarks.summarize``.

Device memory (``benchmarks/memory.py``): a case whose inputs, outputs and temporaries cannot fit the
memory its process may use is skipped with a one-line reason, written as a row with a ``skipped``
field (before compiling where the registry's byte count already rules it out, else from the compiled
executables' sizes or an allocation that failed); the exit status is then 1. ``--workers N`` sizes
the processes' XLA pools from the device's memory: N workers share it for the cases that fit a
share, then one process with nearly all of it runs the larger ones.

Without a GPU it says so and runs a small correctness-only pass of the kernels in Pallas interpret
mode (the XLA path where the kernel cannot run a case), over the small cases whose label matches
``--shapes``; ``--out`` then receives correctness rows without timings. A ``--shapes`` pattern that
matches nothing is an error (exit status 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import importlib
import json
import multiprocessing
import os
import pathlib
import pkgutil
import queue
import re
import sys
import threading
import time
import types

import jax

import benchmarks
import jaxkern
from benchmarks import memory, targets
from benchmarks.registry import REGISTRY

RESULTS = pathlib.Path(__file__).parent / "results"
_NOT_OPS = {"memory", "registry", "run", "summarize", "targets"}

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


def _path(decisions) -> str:
  """The paths one call ran (``pallas``, ``interpret``, ``xla``, ``reference``), in call order, ``+``-joined."""
  return "+".join(dict.fromkeys(d.path for d in decisions)) or "none"


def _path_reason(decisions) -> str:
  return "; ".join(dict.fromkeys(f"{d.op}: {d.reason}" for d in decisions if d.path not in ("pallas", "interpret")))


# The path the CPU pass runs: the kernels in Pallas interpret mode (a case a kernel cannot run takes the XLA path).
CPU_PASS_IMPLEMENTATION = "interpret"


def _correctness_pass(ops, shapes: str | None, out_path: pathlib.Path | None) -> int:
  """Runs the small cases (labels matching ``shapes``) in interpret mode, or on the XLA path where the
  kernel cannot run them; checks them against the reference; appends rows to ``out_path`` if given."""
  print(f"No GPU found (JAX backend: {jax.default_backend()}): nothing is timed. "
        "Running a correctness-only pass of the kernels in Pallas interpret mode.")
  todo = [(op, case) for op in ops for case in op.small_cases() if not shapes or re.search(shapes, case.label)]
  if not todo:
    raise SystemExit(f"--shapes {shapes!r} matches none of the small CPU cases of {[op.name for op in ops]}")
  failures = 0
  key = jax.random.key(0)
  rows = []
  for op, case in todo:
    key, sub = jax.random.split(key)
    args = case.make_args(sub)
    t0 = time.perf_counter()
    path = ""
    try:
      impl = CPU_PASS_IMPLEMENTATION
      fn = functools.partial(op.fn, **case.kwargs)  # registered callables take no implementation argument
      try:
        with jaxkern.use_implementation(impl):
          decisions = jaxkern.explain(fn, *args)
      except jaxkern.KernelUnavailableError:
        impl = "xla"
        with jaxkern.use_implementation(impl):
          decisions = jaxkern.explain(fn, *args)
      path = _path(decisions)
      with jaxkern.use_implementation(impl):
        out = op.fn(*args, **case.kwargs)
      op.check(out, op.reference(*args, **case.kwargs))
      status, ok = "ok", True
    except Exception as e:  # report every case, fail at the end
      failures += 1
      status, ok = f"FAILED: {type(e).__name__}: {e}", False
    seconds = time.perf_counter() - t0
    print(f"{op.name:24s} {case.label:28s} {path:10s} {seconds:6.2f}s  {status}")
    rows.append(dict(op=op.name, shape=case.label, path=path, correct=ok, seconds=round(seconds, 2),
                     backend=jax.default_backend(), jax=jax.__version__, date=datetime.date.today().isoformat()))
  if out_path is not None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {out_path} (correctness rows, no timings)")
  print(f"{len(rows) - failures} ok, {failures} failed, 0 skipped")
  return failures


def _avals(case, key, quiet):
  """Shapes of ``case.make_args(key)``, without building the arrays where the generator allows."""
  try:
    return jax.eval_shape(case.make_args, key)
  except Exception:  # generators that need concrete values (host-side numpy)
    with quiet.timing():  # they build the arrays on the GPU: not while a timing runs
      args = case.make_args(key)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


class _Quiet:
  """Keeps compiles (XLA may autotune on the GPU while compiling) and timings apart: a timing
  waits for running compiles and holds new ones back. Threads of one process share the default
  state; worker processes share ``multiprocessing`` primitives (``cv``, ``compiling``, ``timing``)."""

  def __init__(self, cv=None, compiling=None, timing=None):
    self._cv = cv or threading.Condition()
    self._compiling = compiling or types.SimpleNamespace(value=0)
    self._timing = timing or types.SimpleNamespace(value=False)

  def compile(self, lowered):
    with self._cv:
      self._cv.wait_for(lambda: not self._timing.value)
      self._compiling.value += 1
    try:
      return lowered.compile()
    finally:
      with self._cv:
        self._compiling.value -= 1
        self._cv.notify_all()

  @contextlib.contextmanager
  def timing(self):
    with self._cv:
      self._cv.wait_for(lambda: not self._timing.value)
      self._timing.value = True
      self._cv.wait_for(lambda: not self._compiling.value)
    try:
      yield
    finally:
      with self._cv:
        self._timing.value = False
        self._cv.notify_all()


def _compile_all(todo, jobs: int, quiet: _Quiet):
  """Lowers the flushed kernel and reference executables of every ``(op, case, key, item)`` in a
  background thread (tracing holds the GIL) and compiles them in ``jobs`` threads; yields ``(op, case,
  key, item, avals, decisions, kernel, ref)`` in order as they become ready (``decisions``: the
  dispatch of the op call)."""
  from jaxkern.testing.timing import flush_buffer, lower_timed

  with quiet.timing():  # measures the flush's kernels on the GPU
    flush_buffer()
  ready = queue.Queue(maxsize=4 * jobs)
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:

    def produce():
      try:
        for op, case, key, item in todo:
          try:
            avals = _avals(case, key, quiet)  # may build the arrays on the GPU
          except Exception as e:
            if not memory.is_out_of_memory(e):
              raise
            ready.put(_TooLargeCase(op, case, item, _oom_reason(e)))
            continue
          fns = (functools.partial(op.fn, **case.kwargs), functools.partial(op.reference, **case.kwargs))
          with jaxkern._dispatch.recording() as decisions:  # the paths the timed kernel call takes
            lowered = [lower_timed(f, *avals) for f in fns]
          futures = [pool.submit(quiet.compile, lowered_fn) for lowered_fn in lowered]
          ready.put((op, case, key, item, avals, decisions, futures))
      except BaseException as e:  # surfaces in the consumer
        ready.put(e)
      ready.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ready.get()) is not None:
      if isinstance(item, BaseException):
        raise item
      if isinstance(item, _TooLargeCase):
        yield item
        continue
      op, case, key, todo_item, avals, decisions, futures = item
      try:
        compiled = [f.result() for f in futures]  # XLA may autotune on the GPU while compiling
      except Exception as e:
        if not memory.is_out_of_memory(e):
          raise
        yield _TooLargeCase(op, case, todo_item, _oom_reason(e))
        continue
      yield op, case, key, todo_item, avals, decisions, *compiled


class _TooLarge(Exception):
  """A case that does not fit its process's device memory (the message: the reason)."""


@dataclasses.dataclass(frozen=True)
class _TooLargeCase:
  """A case that ran out of device memory before it was measured (building its inputs, compiling)."""

  op: object
  case: object
  item: tuple
  reason: str


def _oom_reason(error: BaseException) -> str:
  return f"ran out of device memory: {str(error).splitlines()[0][:200]}"


def _pool_bytes() -> int:
  """The XLA pool limit of this process (bytes)."""
  return int((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))


def _check_fits(kernel, ref, iterations: int) -> None:
  """Raises :class:`_TooLarge` where the compiled case's buffers cannot fit this process's pool."""
  pool = _pool_bytes()
  if not pool:
    return
  stats = [c.memory_analysis() for c in (kernel, ref)]
  if None in stats:
    return
  k, r = stats
  peak = memory.peak_bytes(max(k.argument_size_in_bytes, r.argument_size_in_bytes),
                           (k.output_size_in_bytes, r.output_size_in_bytes),
                           (k.temp_size_in_bytes, r.temp_size_in_bytes), pool, iterations)
  if not memory.fits(peak, pool):
    raise _TooLarge(memory.too_large(peak, pool, "its compiled buffers"))


def _tflops(row) -> str:
  return f"  {row['tflops']:.0f} TF/s (XLA {row['xla_tflops']:.0f})" if "tflops" in row else ""


def _measure(op, case, key, avals, decisions, kernel, ref, iterations: int, quiet: _Quiet, env: dict) -> dict:
  """Checks and times one compiled case (all its GPU work inside ``quiet.timing()``); returns its JSONL
  row; raises :class:`_TooLarge` where it cannot fit the device memory."""
  _check_fits(kernel, ref, iterations)
  try:
    return _check_and_time(op, case, key, avals, decisions, kernel, ref, iterations, quiet, env)
  except Exception as e:
    if memory.is_out_of_memory(e):
      raise _TooLarge(_oom_reason(e)) from None
    raise


def _check_and_time(op, case, key, avals, decisions, kernel, ref, iterations, quiet, env) -> dict:
  from jaxkern.testing.timing import device_time_us, flush_buffer

  with quiet.timing():
    args = case.make_args(key)
    if jax.tree.map(lambda a: (a.shape, a.dtype), args) != jax.tree.map(lambda a: (a.shape, a.dtype), avals):
      raise RuntimeError(f"{op.name} {case.label}: make_args gave other shapes than it traced to")
    try:
      op.check(kernel(flush_buffer(), *args)[1], ref(flush_buffer(), *args)[1])
      ok, error = True, ""
    except AssertionError as e:
      ok, error = False, str(e)
    t = device_time_us(functools.partial(op.fn, **case.kwargs), *args, iterations=iterations, compiled=kernel)
    t_ref = device_time_us(functools.partial(op.reference, **case.kwargs), *args, iterations=iterations,
                           compiled=ref)
  gbps = case.nbytes / t / 1e3
  row = dict(op=op.name, shape=case.label, path=_path(decisions), device_us=round(t, 3), gbps=round(gbps, 1),
             pct_copy=round(100 * gbps / env["copy_gbps"], 1), xla_us=round(t_ref, 3),
             speedup=round(t_ref / t, 3), **targets.fields(op.name, case.label, t_ref / t, env["gpu"]),
             correct=ok, bytes=case.nbytes, copy_gbps=round(env["copy_gbps"], 1),
             gpu=env["gpu"], date=env["date"], jax=jax.__version__, iterations=iterations,
             time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
  if case.flops:
    row.update(flops=case.flops, tflops=round(case.flops / t / 1e6, 1), xla_tflops=round(case.flops / t_ref / 1e6, 1))
  if reason := _path_reason(decisions):
    row["path_reason"] = reason
  return row if ok else dict(row, error=error)


def _cases(todo_items):
  """``(op, case, key, item)`` of ``(op name, shape label, index, count)`` items; the key depends on the
  index only."""
  from_label, keys = {}, None
  for item in todo_items:
    name, label, i, n = item
    if name not in from_label:
      from_label[name] = {c.label: c for c in REGISTRY[name].cases()}
    keys = jax.random.split(jax.random.key(0), n) if keys is None else keys
    yield REGISTRY[name], from_label[name][label], keys[i], item


def _skipped_row(name: str, label: str, nbytes: int, reason: str, env: dict) -> dict:
  return dict(op=name, shape=label, skipped=reason, bytes=nbytes, gpu=env["gpu"], date=env["date"],
              jax=jax.__version__, time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))


@dataclasses.dataclass(frozen=True)
class _Deferred:
  """A case a phase-1 worker hands to the large-pool process (``item``: its todo item)."""

  item: tuple
  reason: str


def _rows(todo_items, iterations: int, jobs: int, quiet: _Quiet, env: dict, defer: bool = False):
  """Rows of the cases, in order; a case too large for this process: a :class:`_Deferred` with
  ``defer``, else a skipped row."""
  with quiet.timing():  # the keys are made on the GPU
    todo = list(_cases(todo_items))
  for ready in _compile_all(todo, jobs, quiet):
    if isinstance(ready, _TooLargeCase):
      op, case, item, reason = ready.op, ready.case, ready.item, ready.reason
    else:
      op, case, key, item, avals, decisions, kernel, ref = ready
      try:
        yield _measure(op, case, key, avals, decisions, kernel, ref, iterations, quiet, env)
        continue
      except _TooLarge as e:
        reason = str(e)
    yield _Deferred(item, reason) if defer else _skipped_row(op.name, case.label, case.nbytes, reason, env)


def _worker(todo_items, iterations, jobs, shared, env, rows, defer):
  """A worker process: lowers and compiles its share of the cases; times them one at a time."""
  try:
    for row in _rows(todo_items, iterations, jobs, _Quiet(*shared), env, defer):
      rows.put(row)
  except BaseException as e:  # reported by the parent
    rows.put(RuntimeError(f"worker failed: {type(e).__name__}: {e}"))
  rows.put(None)


def _parallel_rows(shares, iterations: int, jobs: int, env: dict, mem_fraction: str, deferred: list | None = None):
  """Rows from one process per share of todo items, as they arrive; each process's XLA pool is
  ``mem_fraction`` of the device. Tracing holds a process's GIL: processes lower in parallel, and
  share one :class:`_Quiet` so no timing overlaps a compile or another timing. With ``deferred``,
  cases too large for their process are appended to it (as :class:`_Deferred`) instead of skipped."""
  shares = [s for s in shares if s]
  ctx = multiprocessing.get_context("spawn")
  shared = (ctx.Condition(), ctx.Value("i", 0, lock=False), ctx.Value("b", False, lock=False))
  rows = ctx.Queue()
  procs = [ctx.Process(target=_worker, args=(share, iterations, jobs, shared, env, rows, deferred is not None))
           for share in shares]
  before = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = mem_fraction  # read by each process's JAX at its start
  try:
    for p in procs:
      p.start()
  finally:
    if before is None:
      del os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    else:
      os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = before
  running = len(procs)
  while running:
    row = rows.get()
    if row is None:
      running -= 1
    elif isinstance(row, BaseException):
      for p in procs:
        p.terminate()
      raise SystemExit(f"benchmark run stopped: {row}")
    elif isinstance(row, _Deferred):
      print(f"{row.item[0]} {row.item[1]}: deferred to the large-memory process: {row.reason}", flush=True)
      deferred.append(row)
    else:
      yield row
  for p in procs:
    p.join()


def _phased_rows(items, nbytes, iterations: int, jobs: int, workers: int, env: dict, device_memory: int | None):
  """``--workers N``: the pools sized from the device's memory (:func:`benchmarks.memory.plan`); rows of
  the skipped cases, then of N worker processes, then of one process with the large pool."""
  parent_pool = _pool_bytes()
  if not parent_pool:
    raise SystemExit("cannot read the device's memory (no XLA pool limit in memory_stats()): use --workers 1")
  xla_total = int(parent_pool / memory.PARENT_FRACTION)  # XLA's pool limit is the device's memory x the fraction
  total = min(device_memory or xla_total, xla_total)
  plan = memory.plan(total, parent_pool, workers, nbytes)
  print(f"device memory {memory.gib(total)}: {workers} workers with {memory.gib(plan.worker_pool)} each, then "
        f"{len(plan.big)} larger cases in one process with {memory.gib(plan.big_pool)}; {len(plan.skipped)} too large")
  for i, reason in plan.skipped.items():
    yield _skipped_row(items[i][0], items[i][1], nbytes[i], reason, env)
  deferred = []
  yield from _parallel_rows([[items[i] for i in share] for share in plan.shares], iterations,
                            max(1, jobs // workers), env, memory.fraction(plan.worker_pool, xla_total), deferred)
  big = sorted(set(plan.big) | {d.item[2] for d in deferred})
  if big:
    print(f"{len(big)} cases in one process with a {memory.gib(plan.big_pool)} pool", flush=True)
    yield from _parallel_rows([[items[i] for i in big]], iterations, jobs, env,
                              memory.fraction(plan.big_pool, xla_total))


def _single_rows(items, nbytes, iterations: int, jobs: int, env: dict):
  """One process: the cases whose inputs and outputs cannot fit its pool are skipped without compiling,
  those whose compiled buffers cannot, before running."""
  pool = _pool_bytes()
  todo = []
  for item, n in zip(items, nbytes, strict=True):
    if pool and not memory.fits(memory.lower_bound(n), pool):
      reason = memory.too_large(memory.lower_bound(n), pool, "inputs and outputs alone")
      yield _skipped_row(item[0], item[1], n, reason, env)
    else:
      todo.append(item)
  yield from _rows(todo, iterations, jobs, _Quiet(), env)


def _fmt(x, spec: str, width: int) -> str:
  return f"{x:{width}{spec}}" if x is not None else f"{'—':>{width}s}"


def _todo(ops, shapes: str | None, tilekernels: bool, gpu: str | None = None) -> list[tuple[str, str, int]]:
  """``(op name, shape label, bytes)`` of the cases to run: those whose label matches ``shapes``, and with
  ``tilekernels`` only those with a TileKernels target on card ``gpu`` (on any card where ``gpu`` has none)."""
  todo = [(op.name, case.label, case.nbytes) for op in ops for case in op.cases()
          if (not shapes or re.search(shapes, case.label))
          and (not tilekernels or targets.has_target(op.name, case.label, gpu))]
  if not todo:
    raise SystemExit(f"--shapes {shapes!r}{' --tilekernels' if tilekernels else ''} matches none of the "
                     f"benchmark shapes of {[op.name for op in ops]}")
  return todo


def _benchmark(ops, out_path: pathlib.Path, iterations: int, shapes: str | None, jobs: int, workers: int,
               device_memory: int | None = None, tilekernels: bool = False) -> int:
  from jaxkern.testing.timing import copy_bandwidth_gbps

  gpu = jax.devices()[0].device_kind
  todo = _todo(ops, shapes, tilekernels, gpu)
  for row, reason in targets.by_card()[1]:
    print(f"warning: TileKernels target {row.get('op')} {row.get('shape')!r} not used: {reason}")
  env = dict(gpu=gpu, date=datetime.date.today().isoformat(), copy_gbps=copy_bandwidth_gbps())
  print(f"{env['gpu']}, jax {jax.__version__}, {env['date']}; device-to-device copy: {env['copy_gbps']:.0f} GB/s")
  print(f"{'op':20s} {'shape':26s} {'path':7s} {'µs':>9s} {'GB/s':>7s} {'%copy':>6s} {'xla µs':>9s} {'speed-up':>8s} "
        f"{'vs TK':>6s}")
  items = [(name, label, i, len(todo)) for i, (name, label, _) in enumerate(todo)]
  nbytes = [n for _, _, n in todo]
  if workers > 1:
    rows = _phased_rows(items, nbytes, iterations, jobs, workers, env, device_memory)
  else:
    rows = _single_rows(items, nbytes, iterations, jobs, env)
  failures, skipped = 0, []
  out_path.parent.mkdir(parents=True, exist_ok=True)
  with out_path.open("a") as f:
    for row in rows:
      if "skipped" in row:
        skipped.append(row)
        print(f"{row['op']} {row['shape']}: SKIPPED: {row['skipped']}", flush=True)
      elif not row["correct"]:
        failures += 1
        print(f"{row['op']} {row['shape']}: WRONG RESULT: {row.pop('error')}")
      f.write(json.dumps(row) + "\n")
      f.flush()
      if "skipped" not in row:
        print(f"{row['op']:20s} {row['shape']:26s} {row['path']:7s} {row['device_us']:9.2f} {row['gbps']:7.0f} "
              f"{row['pct_copy']:6.1f} {row['xla_us']:9.2f} {row['speedup']:8.2f} "
              f"{_fmt(row['vs_tilekernels'], '.2f', 6)}"
              f"{'' if row['correct'] else '  WRONG'}{_tflops(row)}", flush=True)
  print(f"wrote {out_path}")
  if skipped:
    print(f"{len(skipped)} case(s) skipped for lack of device memory: "
          + ", ".join(f"{r['op']} {r['shape']}" for r in skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
  return failures + len(skipped)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ops", help="comma-separated op names (default: all registered)")
  parser.add_argument("--shapes", help="only the shapes whose label matches this regular expression")
  parser.add_argument("--out", type=pathlib.Path, help="JSONL output (default: benchmarks/results/<date>_<gpu>.jsonl)")
  parser.add_argument("--tilekernels", action="store_true",
                      help="only the shapes with a TileKernels target (benchmarks/anchors/)")
  parser.add_argument("--iterations", type=int, default=30, help="timed calls per measurement (median)")
  parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="threads compiling ahead of the timing")
  parser.add_argument("--workers", type=int, default=1,
                      help="processes that lower and compile in parallel (tracing is GIL-bound); timings never "
                           "overlap; at most 6")
  parser.add_argument("--device-memory", type=float, metavar="GIB",
                      help="with --workers: the device memory the run may use, in GiB (default: all of it, as "
                           "the parent's XLA pool limit tells)")
  args = parser.parse_args(argv)
  if not 1 <= args.workers <= 6:
    parser.error("--workers must be in [1, 6]")
  if args.workers > 1:
    # Each process grows its own pool up to its share of the GPU memory (benchmarks/memory.py); the
    # parent's is small. (With the platform allocator, which frees memory back, some kernels timed up
    # to 1.6x slower than in a single process, for a reason not established; with pools they timed as
    # in a single process.)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if os.environ.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None) == "platform":  # pools are what the plan sizes
      print("--workers: ignoring XLA_PYTHON_CLIENT_ALLOCATOR=platform (each process gets a sized XLA pool)")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory.PARENT_FRACTION}"
  ops = _select(args.ops)
  if args.tilekernels and not args.ops:
    ops = [op for op in ops if op.name in targets.target_ops()]
  if jax.default_backend() != "gpu":
    return 1 if _correctness_pass(ops, args.shapes, args.out) else 0
  slug = jax.devices()[0].device_kind.replace(" ", "-")
  out = args.out or RESULTS / f"{datetime.date.today().isoformat()}_{slug}.jsonl"
  device_memory = int(args.device_memory * memory.GiB) if args.device_memory else None
  return 1 if _benchmark(ops, out, args.iterations, args.shapes, args.jobs, args.workers, device_memory,
                               args.tilekernels) else 0


if __name__ == "__main__":
  sys.exit(main())
