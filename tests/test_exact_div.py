"""Correctly rounded float32 division: the kernel helper and the reference against numpy's IEEE ``/``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _ieee
from jaxkern.reference import ieee
from jaxkern.testing import assert_bitwise_equal, lower_for_h100


def _in_kernel(f, *args):
  """``f`` on ``(R, 128)`` float32 arrays inside a Mosaic GPU kernel, in interpret mode on the CPU
  (XLA on GPU neither contracts ``a*b+c`` nor divides exactly; the GPU kernels are checked by the
  ``gpu`` tests of the ops)."""
  cpu = jax.devices("cpu")[0]
  args = [jax.device_put(x.reshape(-1, 128), cpu) for x in args]

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct(args[0].shape, jnp.float32), interpret=True)
  def kernel(*refs):
    *ins, o_g = refs
    o_g[...] = f(*(r[...] for r in ins))

  with jax.default_device(cpu):
    return kernel(*args)


def _hard_pairs(rng, n):
  """Pairs whose quotient lies within a few float32 ulps of a midpoint between two float32 values."""
  q = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(2.0) ** rng.integers(-20, 20, n)
  b = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(2.0) ** rng.integers(-20, 20, n)
  q, b = q.astype(np.float32), b.astype(np.float32)
  mid = (q.astype(np.float64) + np.nextafter(q, np.float32(np.inf)).astype(np.float64)) / 2
  a = (mid * b.astype(np.float64)).astype(np.float32)
  return a, b


def _pairs():
  rng = np.random.default_rng(0)
  n = 1 << 14
  a0 = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
  b0 = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
  a1, b1 = _hard_pairs(rng, n)
  # The scale-factor divisions: amax of bf16 data over 448 / 6, their inverses and 1 / sf.
  amax = np.maximum(np.abs(rng.standard_normal(n).astype(jnp.bfloat16).astype(np.float32)) * 10, np.float32(1e-4))
  c = np.where(rng.random(n) < 0.5, np.float32(448), np.float32(6)).astype(np.float32)
  sf = (amax / c).astype(np.float32)
  a = np.concatenate([a0, a1, -a1, amax, c, np.ones_like(sf)])
  b = np.concatenate([b0, b1, b1, c, amax, sf])
  return a.astype(np.float32), b.astype(np.float32)


def test_kernel_exact_div_matches_numpy():
  a, b = _pairs()
  want = a / b
  # The hard pairs really are hard: a reciprocal multiply gets many of them wrong.
  assert np.mean(a * (np.float32(1) / b) != want) > 0.05
  assert_bitwise_equal(np.asarray(_in_kernel(_ieee.exact_div, a, b)).reshape(-1), want)
  # A constant numerator (``1 / sf`` with a precomputed sf).
  assert_bitwise_equal(np.asarray(_in_kernel(lambda y: _ieee.exact_div(1.0, y), b)).reshape(-1), np.float32(1) / b)


def test_kernel_exact_div_near_the_e2m1_clamp():
  """e2m1 scale factors of near-zero groups: ``amax / 6`` and ``6 / amax`` for amax at and just above
  the clamp minimum 6·2^-126 (the residuals are subnormal; XLA on CPU flushes them)."""
  rng = np.random.default_rng(3)
  tiny = (np.float32(6 * 2.0**-126) * (1 + rng.integers(0, 64, 1 << 12) * np.float32(2.0**-23))).astype(np.float32)
  six = np.full_like(tiny, 6)
  assert_bitwise_equal(np.asarray(_in_kernel(_ieee.exact_div, tiny, six)).reshape(-1), tiny / six)
  assert_bitwise_equal(np.asarray(_in_kernel(_ieee.exact_div, six, tiny)).reshape(-1), six / tiny)


def test_kernel_refine_quotient_corrects_2_ulp():
  """The first quotient on the GPU is approximate: every start within 2 ulp must be corrected."""
  a, b = _pairs()
  want = a / b
  k = np.random.default_rng(1).integers(-2, 3, want.shape).astype(np.int32)
  q0 = (want.view(np.int32) + k).view(np.float32)  # sign-magnitude step: ± ulp away from the true quotient
  assert np.mean(q0 != want) > 0.7
  got = _in_kernel(_ieee.refine_quotient, q0, a, b)
  assert_bitwise_equal(np.asarray(got).reshape(-1), want)


@pytest.mark.parametrize("jit", [False, True])
def test_reference_ieee_div_matches_numpy(jit):
  a, b = _pairs()
  f = jax.jit(ieee.div) if jit else ieee.div
  assert_bitwise_equal(f(jnp.asarray(a), jnp.asarray(b)), a / b)
  # Constant divisors and numerators (XLA turns ``x / c`` into a reciprocal multiply).
  assert_bitwise_equal(jax.jit(lambda x: ieee.div(x, 448.0))(jnp.asarray(a)), a / np.float32(448))
  assert_bitwise_equal(jax.jit(lambda x: ieee.div(448.0, x))(jnp.asarray(b)), np.float32(448) / b)


def test_reference_rounding_survives_an_inexact_float64_quotient():
  """The GPU's float64 quotient need not be correctly rounded: start from the float64 midpoint
  between the true float32 quotient and a neighbour, where rounding alone goes wrong half the time."""
  a, b = _pairs()
  a, b = np.abs(a), np.abs(b)
  want = a / b
  up = np.random.default_rng(2).random(want.shape) < 0.5
  other = np.nextafter(want, np.where(up, np.float32(np.inf), np.float32(0)))
  q64 = (want.astype(np.float64) + other.astype(np.float64)) / 2
  assert np.mean(q64.astype(np.float32) != want) > 0.3
  with jax.enable_x64(True):
    got = ieee.round_quotient(jnp.asarray(q64), jnp.asarray(a, jnp.float64), jnp.asarray(b, jnp.float64))
  assert_bitwise_equal(got, want)


def _newton_pairs():
  """Operands of :func:`jaxkern._ieee.newton_div`: SwiGLU's ``x / (1 + exp(-x))`` (also where ``exp``
  overflows), hard pairs with ``b >= 1``, divisors above ``2^64`` (scaled) and infinite ones, both signs."""
  rng = np.random.default_rng(4)
  n = 1 << 14
  x = (rng.standard_normal(n) * np.float32(2.0) ** rng.integers(-10, 7, n)).astype(np.float32)
  x = np.concatenate([x, np.linspace(-89, -43, 4096, dtype=np.float32), [0.0, -0.0, 2.0**-30, -(2.0**-80)]])
  with np.errstate(over="ignore"):
    d = (np.float32(1) + np.exp(-x)).astype(np.float32)
  a1, b1 = _hard_pairs(rng, 4 * n)
  keep = (b1 >= 1) & (np.abs(a1) >= 2.0**-100)
  a1, b1 = a1[keep], b1[keep]
  big = (np.abs(rng.standard_normal(n)) * np.float32(2.0) ** rng.integers(60, 126, n)).astype(np.float32)
  a2 = (np.sign(rng.standard_normal(n)) * big * np.float32(2.0**-100)).astype(np.float32)  # normal quotients
  a = np.concatenate([x, a1, -a1, a2, a2[:8]]).astype(np.float32)
  b = np.concatenate([d, b1, b1, np.maximum(big, 1), np.full(8, np.inf)]).astype(np.float32)
  return a, b


def test_kernel_newton_div_matches_numpy():
  a, b = _newton_pairs()
  assert np.isinf(b).sum() > 8 and (b > 2.0**64).sum() > 1000
  with np.errstate(all="ignore"):
    want = a / b
  got = np.asarray(_in_kernel(_ieee.newton_div, a[: a.size // 128 * 128], b[: a.size // 128 * 128])).reshape(-1)
  assert_bitwise_equal(got, want[: got.size])


def _gpu_kernel_div(a, b, div=_ieee.exact_div):
  """``div`` (:func:`jaxkern._ieee.exact_div`) in a compiled Mosaic GPU kernel: ``(R, 128)`` float32 tiles of 64 rows via TMA."""
  r = a.shape[0]

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct(a.shape, jnp.float32), grid=(r // 64,),
                     grid_names=("i",), scratch_types=dict(a_s=plgpu.SMEM((64, 128), jnp.float32),
                                                           b_s=plgpu.SMEM((64, 128), jnp.float32),
                                                           o_s=plgpu.SMEM((64, 128), jnp.float32),
                                                           bar=plgpu.Barrier(num_arrivals=2)))
  def kernel(a_g, b_g, o_g, a_s, b_s, o_s, bar):
    rows = pl.ds(lax.axis_index("i") * 64, 64)
    plgpu.copy_gmem_to_smem(a_g.at[rows], a_s, bar)
    plgpu.copy_gmem_to_smem(b_g.at[rows], b_s, bar)
    plgpu.barrier_wait(bar)
    o_s[...] = div(plgpu.load(a_s, layout=plgpu.Layout.WGMMA), plgpu.load(b_s, layout=plgpu.Layout.WGMMA))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[rows])
    plgpu.wait_smem_to_gmem(0)

  return kernel(a, b)


def test_gpu_kernel_lowers_for_h100():
  s = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
  assert "mosaic_gpu" in lower_for_h100(_gpu_kernel_div, s, s).as_text()
  assert "mosaic_gpu" in lower_for_h100(functools.partial(_gpu_kernel_div, div=_ieee.newton_div), s, s).as_text()


@pytest.mark.gpu
def test_gpu_kernel_exact_div_matches_numpy():
  a, b = _pairs()
  got = _gpu_kernel_div(jnp.asarray(a.reshape(-1, 128)), jnp.asarray(b.reshape(-1, 128)))
  assert_bitwise_equal(np.asarray(got).reshape(-1), a / b)


@pytest.mark.gpu
def test_gpu_kernel_newton_div_matches_numpy():
  a, b = _newton_pairs()
  n = a.size // (64 * 128) * 64 * 128
  with np.errstate(all="ignore"):
    want = a[:n] / b[:n]
  got = _gpu_kernel_div(jnp.asarray(a[:n].reshape(-1, 128)), jnp.asarray(b[:n].reshape(-1, 128)), _ieee.newton_div)
  assert_bitwise_equal(np.asarray(got).reshape(-1), want)
