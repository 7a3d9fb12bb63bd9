"""Device-memory sizing of the benchmark runner (pure functions; the runner supplies the device's
figures, the tests fake them).

One case's ``_measure`` holds, in its process's XLA pool: the 256 MiB flush buffer and the inputs
for the whole case; while checking, the kernel's outputs (each call also returns the flushed
buffer) and, at the same time, the reference's outputs and temporaries; while timing,
``chunk`` calls' outputs at once, ``chunk = max(1, min(iterations, live // outputs))`` with
``live = min(16 GiB, pool / 4)`` (:func:`jaxkern.testing.timing.device_times_us`). A case fits a
pool when that peak is at most :data:`SAFETY` of it (the rest: fragmentation).

Before compiling, the runner only knows a case's registry byte count ``nbytes`` (each input read
and each output written once): :func:`estimate_peak` bounds the inputs plus two output sets by
``2 * nbytes``. After compiling, :func:`peak_bytes` uses the executables' own argument, output and
temporary sizes (``compiled.memory_analysis()``).

With ``--workers N`` (:func:`plan`): the parent process keeps a small pool (the copy-bandwidth
measurement); phase 1 runs the cases whose estimate fits an equal share of the rest in ``N``
worker processes (their pools never shrink, so each is capped at its share); phase 2 runs the
larger cases, and those a worker found too large once compiled or ran out of memory on, in one
process with the whole remainder, after the workers have exited. A case whose inputs and outputs
alone (:func:`lower_bound`) cannot fit that is skipped, with its reason, without being compiled;
one whose compiled buffers cannot fit it, or which runs out of memory, is skipped then.
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30
FLUSH_BYTES = 256 << 20  # jaxkern.testing.timing._FLUSH_WORDS uint32 words
LIVE_BYTES = 16 * GiB  # jaxkern.testing.timing._LIVE_BYTES
SAFETY = 0.9  # share of a pool one case may need
HEADROOM = 0.05  # share of the device no pool gets
CONTEXT_BYTES = GiB  # per process, outside its pool: CUDA context, library handles, loaded kernels
PARENT_FRACTION = 0.08  # the parent's pool (copy-bandwidth measurement: 1 GiB in, 1 GiB out; 0.04 = 3.2 GiB ran out of memory on an H100)
MIN_WORKER_POOL = 2 * GiB


def _timing_bytes(out_bytes: int, pool: int, iterations: int) -> int:
  """Outputs held at once while timing (``device_times_us``'s chunk of calls)."""
  live = min(LIVE_BYTES, pool // 4)
  chunk = max(1, min(iterations, live // max(out_bytes, 1)))
  return chunk * out_bytes


def peak_bytes(arg_bytes: int, out_bytes: tuple[int, int], temp_bytes: tuple[int, int], pool: int,
               iterations: int = 30) -> int:
  """Peak pool bytes of one case from its compiled kernel and reference (``memory_analysis()``:
  ``arg_bytes`` include the flush buffer, ``out_bytes`` the flushed buffer the call returns)."""
  (out_k, out_r), (temp_k, temp_r) = out_bytes, temp_bytes
  check = arg_bytes + out_k + out_r + max(temp_k, temp_r)
  timing = arg_bytes + max(_timing_bytes(out_k, pool, iterations) + temp_k,
                           _timing_bytes(out_r, pool, iterations) + temp_r)
  return max(check, timing)


def estimate_peak(nbytes: int, pool: int) -> int:
  """Upper bound of a case's peak from its registry byte count ``nbytes`` = inputs + outputs, however
  they split (temporaries are not known: the check of the compiled case catches them). Checking:
  flush + inputs + 2 x (flush + outputs) <= 3 flush + 2 nbytes; timing: flush + inputs + the outputs
  held at once, which are one call's or at most ``live`` bytes, <= flush + nbytes + max(flush, live)."""
  live = min(LIVE_BYTES, pool // 4)
  return max(3 * FLUSH_BYTES + 2 * nbytes, FLUSH_BYTES + nbytes + max(FLUSH_BYTES, live))


def lower_bound(nbytes: int) -> int:
  """Bytes a case needs at least: the flush buffer, the flushed buffer a call returns, its inputs and outputs."""
  return 2 * FLUSH_BYTES + nbytes


def fits(peak: int, pool: int) -> bool:
  return peak <= SAFETY * pool


def gib(n: float) -> str:
  return f"{n / GiB:.1f} GiB"


def too_large(peak: int, pool: int, basis: str) -> str:
  """The one-line reason of a skipped case (``basis``: what ``peak`` counts)."""
  return f"needs {gib(peak)} of device memory ({basis}), more than {SAFETY:.0%} of the {gib(pool)} its process can use"


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which process runs which case (indices into the case list): ``shares[w]`` in phase-1 worker
  ``w`` (pool ``worker_pool`` bytes), ``big`` in the phase-2 process (pool ``big_pool``),
  ``skipped`` not at all (index -> reason)."""

  worker_pool: int
  big_pool: int
  shares: tuple[tuple[int, ...], ...]
  big: tuple[int, ...]
  skipped: dict


def pools(total: int, parent_pool: int, workers: int) -> tuple[int, int]:
  """``(pool of each of the phase-1 workers, pool of the phase-2 process)`` on a device of ``total``
  bytes where the parent holds ``parent_pool``; SystemExit where a worker's share would be too small."""
  usable = int(total * (1 - HEADROOM)) - parent_pool - CONTEXT_BYTES  # the parent's context
  worker_pool = (usable - workers * CONTEXT_BYTES) // workers
  if worker_pool < MIN_WORKER_POOL:
    raise SystemExit(f"--workers {workers} leaves {gib(max(worker_pool, 0))} of device memory per worker on this "
                     f"{gib(total)} device (at least {gib(MIN_WORKER_POOL)} needed): use fewer workers")
  return worker_pool, usable - CONTEXT_BYTES


def plan(total: int, parent_pool: int, workers: int, nbytes: list[int]) -> Plan:
  """Assigns cases (registry byte counts ``nbytes``) to ``workers`` phase-1 processes round-robin,
  in order, where their estimate fits a worker's pool; the others to phase 2 or, where even their
  :func:`lower_bound` cannot fit its pool, to ``skipped`` (between the two, the check of the
  compiled case decides)."""
  worker_pool, big_pool = pools(total, parent_pool, workers)
  small, big, skipped = [], [], {}
  for i, n in enumerate(nbytes):
    if fits(estimate_peak(n, worker_pool), worker_pool):
      small.append(i)
    elif fits(lower_bound(n), big_pool):
      big.append(i)
    else:
      skipped[i] = too_large(lower_bound(n), big_pool, "inputs and outputs alone")
  return Plan(worker_pool, big_pool, tuple(tuple(small[w::workers]) for w in range(workers)), tuple(big), skipped)


def fraction(pool: int, total: int) -> str:
  """``XLA_PYTHON_CLIENT_MEM_FRACTION`` for a pool of ``pool`` bytes (XLA's limit: total x fraction),
  rounded down."""
  return f"{int(pool / total * 1e4) / 1e4:.4f}"


def is_out_of_memory(error: BaseException) -> bool:
  """Whether an exception is XLA's failed device allocation."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
