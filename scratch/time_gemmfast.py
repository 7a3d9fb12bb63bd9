"""Issue 24: time every variant of the FP8 grouped GEMM forward, the input-gradient and weight-gradient kernels at
shapes A-D (benchmarks/gemm.py), with CUPTI and a cold L2 (jaxkern.testing.timing), and check each result's
max-relative error against the float32 product of the dequantised inputs (<= 0.5%).

GPU:  python scratch/time_gemmfast.py [--shapes ABCD] [--iters 10] [--kernels fwd,dgrad,wgrad] [--budget 400]
CPU:  python scratch/time_gemmfast.py --tiny        (small shapes, interpret mode, no CUPTI: tests the logic)

Prints one line per (kernel, variant, shape) as it goes: µs (median), TF/s (2·M·N·K over padded rows), max rel err.
A variant that fails to compile or run prints one line and the script goes on.
"""

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemm import SHAPES, make_inputs
from jaxkern import gemm
from jaxkern.gemm import _backward, _grouped
from jaxkern.reference import gemm as ref
from jaxkern.types import QuantTensor

HI = jax.lax.Precision.HIGHEST
E4M3 = jnp.float8_e4m3fn
TINY = {"a": ([128, 256], 256, 384), "b": ([256, 128, 128], 384, 256)}


@jax.jit
def _rel_err_dev(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30)


def rel_err(got, want):
  """max |got - want| / max |want| (on the device, in float32: ample for a 0.5% bound)."""
  return float(_rel_err_dev(got, want))


def row(kernel, variant, shape, us, flops, err, note=""):
  tfs = flops / (us * 1e-6) / 1e12 if us else float("nan")
  flag = "" if err is None or err <= 5e-3 else "  ERR>0.5%"
  us_s = f"{us:9.1f}" if us else "        -"
  err_s = f"{err:.2e}" if err is not None else "       -"
  print(f"{kernel:6s} {variant:12s} {shape:2s} {us_s} {tfs:7.0f} {err_s}{flag} {note}", flush=True)


def fail(kernel, variant, shape, e, tiny):
  msg = " ".join(str(e).split())[:200]
  print(f"{kernel:6s} {variant:12s} {shape:2s} FAILED {type(e).__name__}: {msg}", flush=True)
  if tiny:
    traceback.print_exc()


def attempt_batch(kernel, shape, flops, items, args, want, iters, tiny, setdown=None):
  """Time each ``(variant, fn, setup)`` of ``items`` on ``args``: ``setup()`` (e.g. picking the module's variant)
  then trace + lower one after another (the variant is read at trace time), compile all in threads (the
  compiles release the GIL), then run each once for its error and time it (GPU: CUPTI, cold L2 via
  jaxkern.testing.timing; ``tiny``: no timing, no flush)."""
  from concurrent.futures import ThreadPoolExecutor
  from jaxkern.testing import timing
  flush = not tiny
  lowered = {}
  for variant, fn, setup in items:
    try:
      setup()
      # a fresh function object per variant: jax.jit's trace cache is keyed on the function, and the variant is
      # a module attribute read at trace time
      lowered[variant] = timing.lower_timed(lambda *a, _fn=fn: _fn(*a), *args, flush=flush)
    except Exception as e:  # noqa: BLE001 -- one line per failing variant, then go on
      fail(kernel, variant, shape, e, tiny)
  if setdown:
    setdown()
  t0 = time.time()
  with ThreadPoolExecutor(max_workers=8) as ex:
    futures = {v: ex.submit(low.compile) for v, low in lowered.items()}
    compiled = {}
    for v, fut in futures.items():
      try:
        compiled[v] = fut.result()
      except Exception as e:  # noqa: BLE001
        fail(kernel, v, shape, e, tiny)
  note = f"(compile {time.time() - t0:.0f}s for {len(lowered)})"
  for v, c in compiled.items():
    try:
      out = c(timing.flush_buffer(), *args)[1] if flush else c(*args)
      err = rel_err(out, want) if want is not None else None
      del out
      us = float(np.median(timing.device_times_us(None, *args, iterations=iters, compiled=c))) if flush else None
      row(kernel, v, shape, us, flops, err, note)
      note = ""
    except Exception as e:  # noqa: BLE001
      fail(kernel, v, shape, e, tiny)
  del compiled


def segments_of(rows):
  out, start = [], 0
  for r in rows:
    out.append((start, start + r))
    start += r
  return out


def fwd_inputs(key, rows, n, k, tiny):
  x, w, be, _ = make_inputs(key, rows, n, k)
  if tiny:  # one skipped block at the end too
    x, w, be, _ = make_inputs(key, rows, n, k, skip_blocks=1)
  return x, w, be


def wgrad_inputs(key, rows, n, k):
  m = sum(rows)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  dyq = jnp.clip(jax.random.normal(k1, (n, m)) * 100, -448, 448).astype(E4M3)
  dys = jax.random.uniform(k2, (m // 128, n), minval=2 ** -8, maxval=2 ** -6)
  xq = jnp.clip(jax.random.normal(k3, (k, m)) * 100, -448, 448).astype(E4M3)
  xs = jax.random.uniform(k4, (m // 128, k), minval=2 ** -8, maxval=2 ** -6)
  be = jnp.asarray(np.concatenate([np.full(r // 128, e, np.int32) for e, r in enumerate(rows)]))
  return (dyq, dys), (xq, xs), be


@jax.jit
def _deq_t(q, s):
  return q.astype(jnp.float32) * jnp.repeat(s, 128, axis=0).T


def wgrad_want(dyt, xt, rows):
  dyd, xd = _deq_t(*dyt), _deq_t(*xt)
  dot = jax.jit(lambda a, b: jnp.dot(a, b.T, precision=HI))
  return jnp.stack([dot(dyd[:, a:b], xd[:, a:b]) for a, b in segments_of(rows)])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="CPU: small shapes, interpret mode, no CUPTI")
  p.add_argument("--shapes", default=None)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--kernels", default="fwd,dgrad,wgrad")
  p.add_argument("--variants", default=None, help="comma list of forward variants (default: all)")
  p.add_argument("--dgrad-variants", default=None, help="forward variants timed on transposed weights "
                 "(default: ws,k2,tma,k2tma)")
  p.add_argument("--budget", type=float, default=1e9, help="seconds: skip what starts after this")
  a = p.parse_args()
  tiny = a.tiny
  impl = "interpret" if tiny else "pallas"
  shapes = TINY if tiny else SHAPES
  names = list(a.shapes) if a.shapes else list(shapes)
  kernels = a.kernels.split(",")
  fwd_variants = a.variants.split(",") if a.variants else list(_grouped.VARIANTS)
  dgrad_variants = (a.dgrad_variants.split(",") if a.dgrad_variants
                    else [v for v in ("ws", "k2", "tma", "k2tma") if v in _grouped.VARIANTS])
  t_start = time.time()
  print(f"# {jax.devices()[0].device_kind}  jax {jax.__version__}  impl={impl}  forward default "
        f"{_grouped.VARIANT!r}, wgrad default {_backward.WGRAD_VARIANT!r}", flush=True)
  print(f"{'kernel':6s} {'variant':12s} sh        µs    TF/s  max rel", flush=True)
  key = jax.random.key(0)

  def over_budget():
    if time.time() - t_start > a.budget:
      print(f"# budget of {a.budget:.0f}s spent: stopping", flush=True)
      return True
    return False

  def pick(v):
    return lambda: setattr(_grouped, "VARIANT", v)

  def pick_w(v):
    return lambda: setattr(_backward, "WGRAD_VARIANT", v)

  def fwd_like(kind, variants):
    for name in names:
      rows, n, k = shapes[name]
      x, w, be = fwd_inputs(key, rows, n, k, tiny)
      m = x.data.shape[0]
      if kind == "fwd":
        want = jax.jit(ref.dequantized_product)(x, w, be)
        if over_budget():
          return False
        fn = lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, out_dtype=jnp.bfloat16, implementation=impl)
        attempt_batch("fwd", name, 2 * m * n * k, [(v, fn, pick(v)) for v in variants], (x, w, be), want,
                      a.iters, tiny, setdown=pick("ws"))
      else:
        # dy (M, N) with per-token sf along N (layout A), the forward weights (G, N, K) -> dx (M, K).
        kd1, kd2 = jax.random.split(jax.random.key(1))
        dy = QuantTensor(jnp.clip(jax.random.normal(kd1, (m, n)) * 100, -448, 448).astype(E4M3),
                         jax.random.uniform(kd2, (m, n // 128), minval=2 ** -8, maxval=2 ** -6))
        wt = jax.jit(gemm.transpose_weights)(w)
        want = jax.jit(ref.dequantized_product)(dy, wt, be)
        if over_budget():
          return False
        attempt_batch("dgrad", name, 2 * m * n * k,
                      [("op(ws)", lambda dy, w, be: gemm.fp8_grouped_gemm_input_grad(dy, w, be, implementation=impl),
                        pick("ws"))], (dy, w, be), want, a.iters, tiny)
        # the kernel alone, on pre-transposed weights (what a layer caching w^T runs)
        fn = lambda dy, wt, be: gemm.fp8_grouped_gemm(dy, wt, be, implementation=impl)
        attempt_batch("dgradT", name, 2 * m * n * k, [(v, fn, pick(v)) for v in variants], (dy, wt, be), want,
                      a.iters, tiny, setdown=pick("ws"))
      _grouped.VARIANT = "ws"
    return True

  def wgrad():
    for name in names:
      rows, n, k = shapes[name]
      dyt, xt, be = wgrad_inputs(key, rows, n, k)
      m = sum(rows)
      want = wgrad_want(dyt, xt, rows)
      if over_budget():
        return False
      fn = lambda dyt, xt, be, g=len(rows): gemm.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g,
                                                                              implementation=impl)
      attempt_batch("wgrad", name, 2 * m * n * k, [(v, fn, pick_w(v)) for v in _backward.WGRAD_VARIANTS],
                    (dyt, xt, be), want, a.iters, tiny, setdown=pick_w("ws"))
    return True

  # order: forward, weight grad, input grad (the forward kernel on transposed weights), then the old variants
  # ws6 / simple (timed before) and k2tma_g1 (a test of the item order) go last, so a spent budget loses the least new information
  late = [v for v in fwd_variants if v in ("ws6", "simple", "k2tma_g1")] if not a.variants else []
  first = [v for v in fwd_variants if v not in late]
  if "fwd" in kernels and not fwd_like("fwd", first):
    return
  if "wgrad" in kernels and not wgrad():
    return
  if "dgrad" in kernels and not fwd_like("dgrad", dgrad_variants):
    return
  if "fwd" in kernels and late and not fwd_like("fwd", late):
    return
  print(f"# done in {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
  sys.exit(main())
