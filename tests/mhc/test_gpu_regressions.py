"""GPU checks of the two mHC kernels that the H100 benchmark run of 2026-11-26 reported wrong, on exactly the
benchmark's shapes, data generators and tolerances (``implementation="pallas"`` vs the ``jnp`` references).
Every test prints its per-output errors (run with ``-s``); all are skipped without a GPU.

1. ``pre_norm_fn`` forward (every shape failed): the XLA code split ``fn_r`` into bf16 ``hi + lo`` through an
   ``f32 -> bf16 -> f32`` round trip that XLA:GPU removes, so ``lo`` was 0 on the GPU (fixed in
   ``jaxkern.mhc._norm_fn.split_bf16``). ``test_old_split_loses_lo_on_gpu`` shows the cause on the device.
2. ``pre_apply_mix`` forward (2 of 8 shapes failed): diagnosed as one-bf16-ulp differences on rare outputs
   (the kernel's multiply-adds are FMA-contracted by the GPU compiler, XLA's reference rounds each product),
   which the benchmark's ``atol 1e-2`` flags only where ``|out| >= 2`` (one bf16 ulp = 2^-6 there): the
   benchmark drew ``x`` from N(0, 1), upstream's test draws ``sigmoid(randn)`` (``|out| < 1``).
   ``test_pre_apply_mix_benchmark_data_within_one_bf16_ulp`` checks that diagnosis (any real indexing or
   race bug gives errors of many ulps) and prints which FMA order the kernel matches.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import mhc
from jaxkern.mhc import _norm_fn
from jaxkern.reference import ieee
from jaxkern.reference import mhc as ref_mix
from jaxkern.reference import mhc_norm as ref_norm

pytestmark = pytest.mark.gpu

J = 24
NORM_SHAPES = [(t, h) for t in (4096, 8192) for h in (1280, 2560, 7168)] + [
    (t, h) for t in (13, 48, 512) for h in (1280, 2560, 4096, 7168)]
MIX_SHAPES = [(t, h) for t in (4096, 8192) for h in (1280, 2560, 4096, 7168)]
FAILED_MIX = {(4096, 7168), (8192, 2560)}


def _key(*ids):
  return jax.random.key(zlib.crc32(repr(ids).encode()))


def _max_err(name, got, want, tol):
  """Prints and returns the benchmark check's numbers: max |err|, max |err| / max |ref|, elements beyond
  ``rtol = tol, atol = tol · max|ref|`` (benchmarks/mhc_norm.py ``tol_check``)."""
  a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = float(np.max(np.abs(b), initial=0.0))
  err = np.abs(a - b)
  bad = int(np.count_nonzero(err > tol * np.abs(b) + tol * scale))
  print(f"  {name:8s} max|err| {err.max():.3e}  max|err|/max|ref| {err.max() / max(scale, 1e-30):.3e}  "
        f"beyond tol: {bad}/{err.size}  nan: {int(np.isnan(a).sum())}")
  return bad


# ---------------------------------------------------------------------------------------------- pre_norm_fn

def _norm_args(key, t, h):  # benchmarks/mhc_norm.py _args
  kx, kf = jax.random.split(key)
  x = (jax.random.normal(kx, (t, 4, h)) * (1 + 0.01 * jnp.arange(4))[:, None]).astype(jnp.bfloat16)
  return x, jax.random.normal(kf, (J, 4 * h)) * 1e-4


def test_old_split_loses_lo_on_gpu():
  """Evidence for the cause (printed): the old XLA split gives ``lo == 0`` on the GPU; the fixed one is exact."""
  v = ref_norm.round_to_tf32(jax.random.normal(jax.random.key(0), (J, 4096)) * 1e-4)

  @jax.jit
  def old_split(v):
    hi = v.astype(jnp.bfloat16)
    return hi, (v - hi.astype(jnp.float32)).astype(jnp.bfloat16)

  _, old_lo = old_split(v)
  hi, lo = jax.jit(_norm_fn.split_bf16)(v)
  print(f"\n  old split: nonzero lo {int(jnp.count_nonzero(old_lo))}/{v.size};  "
        f"new split: nonzero lo {int(jnp.count_nonzero(lo))}/{v.size}")
  np.testing.assert_array_equal(np.asarray(hi, np.float64) + np.asarray(lo, np.float64), np.asarray(v, np.float64))
  assert int(jnp.count_nonzero(lo)) > v.size // 2


@pytest.mark.parametrize("t, h", NORM_SHAPES)
def test_pre_norm_fn_forward_benchmark_shapes(t, h):
  x, fn = _norm_args(_key("norm", t, h), t, h)
  print(f"\npre_norm_fn T={t} H={h}")
  got = jax.jit(functools.partial(mhc.pre_norm_fn, implementation="pallas"))(x, fn)
  want = jax.jit(ref_norm.pre_norm_fn)(x, fn)
  bad = _max_err("mixes", got, want, 1e-3)
  parts = jax.jit(functools.partial(mhc.pre_norm_fn_fwd, implementation="pallas"))(x, fn)
  wparts = jax.jit(ref_norm.pre_norm_fn_fwd)(x, fn)
  bad += _max_err("out_mul", parts.out_mul, wparts.out_mul, 1e-3)
  bad += _max_err("sqrsum", parts.sqrsum, wparts.sqrsum, 1e-3)
  # the kernel's products are exact, so it is in fact much closer than the benchmark's 1e-3
  _max_err("mixes@1e-5", got, want, 1e-5)
  assert bad == 0


@pytest.mark.parametrize("t, h", [(4096, 7168), (512, 1280), (13, 2560)])
def test_pre_norm_fn_fwd_bwd_benchmark_shapes(t, h):
  x, fn = _norm_args(_key("normvg", t, h), t, h)
  g = jax.random.normal(_key("g", t, h), (t, J))

  def vg(f):
    return jax.jit(jax.value_and_grad(lambda x, fn: jnp.sum(f(x, fn) * g), argnums=(0, 1)))(x, fn)

  print(f"\npre_norm_fn:fwd+bwd T={t} H={h}")
  (v, (gx, gf)) = vg(functools.partial(mhc.pre_norm_fn, implementation="pallas"))
  (wv, (wgx, wgf)) = vg(ref_norm.pre_norm_fn)
  bad = _max_err("value", v, wv, 2e-2) + _max_err("grad_x", gx, wgx, 2e-2) + _max_err("grad_fn", gf, wgf, 2e-2)
  _max_err("grad_fn@1e-3", gf, wgf, 1e-3)  # tighter now that lo is no longer lost
  assert bad == 0


# ---------------------------------------------------------------------------------------------- pre_apply_mix

def _mix_args(key, t, h, spec_data):
  """benchmarks/mhc.py ``_apply`` (x ~ N(0, 1)) or upstream's test data (x = sigmoid(randn)); mix = softmax."""
  k1, k2 = jax.random.split(key)
  z = jax.random.normal(k1, (t, 4, h))
  x = (jax.nn.sigmoid(z) if spec_data else z).astype(jnp.bfloat16)
  mix = jax.nn.softmax(jax.random.normal(jax.random.split(k2)[0], (t, 4, 1)), axis=-2)
  return x, mix


def _ordered(a):
  """bf16 values -> integers in value order (adjacent bf16 values differ by 1)."""
  b = np.asarray(a).view(np.int16).astype(np.int32)
  return np.where(b < 0, -(b & 0x7FFF), b)


@jax.jit
def _fma_chains(x, mix):
  """bf16 results of the two FMA-contracted orders a GPU compiler may pick for ``Σ_m mix[m]·x[m]``."""
  xw, mw = x.astype(jnp.float32), mix.astype(jnp.float32)
  p = [mw[..., m, :] * xw[..., m, :] for m in range(4)]
  a = p[0]  # fma(w1, x1, w0·x0), then fma(w_m, x_m, acc)
  b = ieee.fma(mw[..., 0, :], xw[..., 0, :], p[1])  # fma(w0, x0, w1·x1), then fma(w_m, x_m, acc)
  a = ieee.fma(mw[..., 1, :], xw[..., 1, :], a)
  for m in range(2, 4):
    a = ieee.fma(mw[..., m, :], xw[..., m, :], a)
    b = ieee.fma(mw[..., m, :], xw[..., m, :], b)
  return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)


@pytest.mark.parametrize("t, h", MIX_SHAPES)
def test_pre_apply_mix_benchmark_data_within_rounding_order(t, h):
  x, mix = _mix_args(_key("mix", t, h), t, h, spec_data=False)
  got = jax.jit(functools.partial(mhc.pre_apply_mix, implementation="pallas"))(x, mix)
  want = jax.jit(ref_mix.pre_apply_mix)(x, mix)
  fa, fb = _fma_chains(x, mix)
  g, w = np.asarray(got), np.asarray(want)
  ulps = np.abs(_ordered(g) - _ordered(w))
  a, b = np.asarray(g, np.float64), np.asarray(w, np.float64)
  beyond = int(np.count_nonzero(np.abs(a - b) > 1e-2 + 1e-3 * np.abs(b)))  # the benchmark's check
  print(f"\npre_apply_mix T={t} H={h} (benchmark data, N(0,1) x){'  [failed on the H100]' if (t, h) in FAILED_MIX else ''}"
        f"\n  vs XLA ref: differing {int(np.count_nonzero(ulps))}/{ulps.size}, max {int(ulps.max())} bf16 ulp, "
        f"max|err| {np.abs(a - b).max():.3e}, beyond the benchmark's atol 1e-2 rtol 1e-3: {beyond}"
        f"\n  vs FMA order A (fma(w1,x1,w0*x0), ...): differing {int(np.count_nonzero(g != np.asarray(fa)))}"
        f";  vs FMA order B (fma(w0,x0,w1*x1), ...): differing {int(np.count_nonzero(g != np.asarray(fb)))}")
  assert not np.isnan(a).any()
  # Rounding-order differences (FMA contraction on the GPU, separate products in XLA) are bounded by a few float32
  # ulps of the terms' magnitudes plus one bf16 ulp of the result (at most 2^-7 of it: 8 significant bits; 2^-8
  # failed every shape on an H200, 2026-11-27, at max|err| 2^-7 for results in [1, 2)); counting bf16 ulps alone is
  # meaningless where the mix cancels to near zero (seen on an H100: up to 25686 "ulps" between tiny values of
  # opposite sign).
  terms = np.abs(np.asarray(x, np.float64) * np.asarray(mix, np.float64)).sum(axis=-2)
  excess = np.abs(a - b) - (2.0**-7 * np.abs(b) + 2.0**-20 * terms)
  assert (excess <= 0).all(), f"beyond rounding-order differences: {np.count_nonzero(excess > 0)} elements"


@pytest.mark.parametrize("t, h", MIX_SHAPES)
def test_pre_apply_mix_spec_data_spec_tolerance(t, h):
  """Upstream's test (x = sigmoid(randn) bf16, mix = softmax, atol 1e-2 rtol 1e-3), which
  the benchmark now uses too."""
  x, mix = _mix_args(_key("mixspec", t, h), t, h, spec_data=True)
  print(f"\npre_apply_mix T={t} H={h} (spec data, sigmoid x)")
  got = jax.jit(functools.partial(mhc.pre_apply_mix, implementation="pallas"))(x, mix)
  want = jax.jit(ref_mix.pre_apply_mix)(x, mix)
  a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.abs(a - b)
  print(f"  max|err| {err.max():.3e}, differing {int(np.count_nonzero(err))}/{err.size}")
  np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-2)
