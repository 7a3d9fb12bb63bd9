from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import moe
from jaxkern.moe._normalize_weight import MAX_KERNEL_TOPK, _kernel
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx
from jaxkern.types import NormalizedWeights


def _check(got, want):
  assert isinstance(got, NormalizedWeights) and isinstance(want, NormalizedWeights)
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


def _ieee_div(a: np.float32, b: np.float32) -> np.float32:
  """Correctly rounded float32 quotient, from exact rationals (ties to even)."""
  q = np.float32(a) / np.float32(b)  # NumPy's float32 division is IEEE on the host
  exact = Fraction(float(a)) / Fraction(float(b))
  cands = [np.nextafter(q, np.float32(-np.inf)), q, np.nextafter(q, np.float32(np.inf))]
  return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.int32)) & 1))


@pytest.mark.parametrize("num_topk, experts, ranks", [(1, 1, 1), (2, 9, 8), (6, 32, 8), (9, 4, 64), (8, 256, 1)])
def test_bit_exact(key, num_topk, experts, ranks):
  t = moe_topk_idx(key, 8, num_topk, experts, ranks).shape[0]
  w = jax.random.uniform(key, (t, num_topk), jnp.float32)
  out = jax.jit(moe.normalize_weight)(w)
  assert isinstance(out, NormalizedWeights)
  d, nw = out.denominator, out.normalized_weights
  wn = np.asarray(w)
  want_d = np.full(t, np.float32(1e-20))
  for k in range(num_topk):
    want_d = (want_d + wn[:, k]).astype(np.float32)
  assert_bitwise_equal(d, want_d)
  assert_bitwise_equal(nw, wn / want_d[:, None])


@pytest.mark.parametrize("t, num_topk", [(5, 6), (130, 9), (257, 2), (131, 8)])
def test_kernel_signed_weights(key, t, num_topk):
  """Negative weights and ragged T (padded, overlapping last CTA) against the reference, rows read
  straight from GMEM (K = 2) and staged through SMEM (K = 6, 8, 9: 8-, 16- and 4-byte vectors)."""
  w = jax.random.normal(key, (t, num_topk), jnp.float32) + 0.5
  got = _kernel(w, interpret=jaxkern._config.mosaic_interpret(jaxkern.get_implementation() == "interpret"))
  _check(got, ref.normalize_weight(w))


@pytest.mark.parametrize("num_topk", [2, 6, 8, 9])
def test_lowers_for_h100(num_topk):
  spec = jax.ShapeDtypeStruct((18506, num_topk), jnp.float32)
  assert "mosaic_gpu" in lower_for_h100(lambda w: moe.normalize_weight(w, implementation="pallas"), spec).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 9, 8), (9, 32, 8), (8, 4, 64), (9, 4, 64)])
def test_spec_shapes_gpu(key, num_topk, experts, ranks):
  t = moe_topk_idx(key, 4001, num_topk, experts, ranks).shape[0]
  w = jax.random.uniform(key, (t, num_topk), jnp.float32)
  f = jax.jit(moe.normalize_weight)
  jax.block_until_ready(f(w))
  jnp.full((t, num_topk), -1, jnp.int32).block_until_ready()  # poison the allocator
  _check(f(w), ref.normalize_weight(w))


def test_division_is_correctly_rounded():
  """Hard quotients (random bits, negative weights, tiny sums) against exact rationals."""
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((300, 3)) * rng.choice([1e-30, 1.0, 1e30], (300, 1))).astype(np.float32)
  d, nw = ref.normalize_weight(jnp.asarray(w))
  d, nw = np.asarray(d), np.asarray(nw)
  want = np.array([[_ieee_div(w[t, k], d[t]) for k in range(3)] for t in range(300)], np.float32)
  assert_bitwise_equal(nw, want)


def test_extreme_row_sums_and_quotients():
  """Rows whose sum is zero, infinite, NaN or beyond 2^126, and quotients that overflow: the reference's IEEE
  quotients (±inf, ±0, NaN, 1.0 for a single dominant weight), bit for bit, never a NaN row in their place."""
  big = np.float32(np.finfo(np.float32).max)
  rows = np.array([
      [big, -big, 0.5, -0.5],          # sum exactly zero (the seed 1e-20 is absorbed): ±inf, NaN for 0/0
      [np.inf, 1.0, -2.0, 0.0],        # sum +inf: ±0, NaN for inf/inf
      [-np.inf, 3.0, 0.0, 1.0],        # sum -inf
      [np.inf, -np.inf, 1.0, 2.0],     # sum NaN
      [big, 2.0, -3.0, 4.0],           # sum beyond 2^126: 1.0 for the big weight, tiny normal quotients
      [-big, 2.0**100, 1.0, 0.0],      # the same, negative
      [big, -big, 1e-3, 2e-3],         # small sum, quotients overflowing to ±inf
      [2.0**120, 2.0**120, 2.0**126, 2.0**126],   # sum 2^127 + 2^121
  ] * 3, np.float32)
  got = moe.normalize_weight(jnp.asarray(rows), implementation="interpret")
  want = ref.normalize_weight(jnp.asarray(rows))
  _check(got, want)
  assert not np.isnan(np.asarray(got.normalized_weights)[4]).any()
  np.testing.assert_equal(np.asarray(got.normalized_weights)[4, 0], np.float32(1.0))


def test_zero_row_and_seed():
  d, nw = moe.normalize_weight(jnp.zeros((2, 3), jnp.float32))
  assert (np.asarray(d).view(np.int32) == 0x1E3CE508).all() and (np.asarray(nw) == 0).all()
  d, nw = moe.normalize_weight(jnp.zeros((0, 3), jnp.float32))
  assert d.shape == (0,) and nw.shape == (0, 3)
  d, nw = moe.normalize_weight(jnp.zeros((4, 0), jnp.float32))  # no weights: the seed alone
  assert (np.asarray(d).view(np.int32) == 0x1E3CE508).all() and nw.shape == (4, 0)
  for w in (jnp.zeros((0, 3), jnp.float32), jnp.zeros((4, 0), jnp.float32)):
    assert [d.path for d in jaxkern.explain(lambda w: moe.normalize_weight(w, implementation="pallas"), w)] == ["xla"]


def test_wide_rows_run_xla(key):
  """K > MAX_KERNEL_TOPK: the kernel is unavailable; "xla" and "auto" give the reference's result."""
  w = jax.random.uniform(key, (70, MAX_KERNEL_TOPK + 1), jnp.float32)
  with pytest.raises(jaxkern.KernelUnavailableError, match="MAX_KERNEL_TOPK"):
    moe.normalize_weight(w, implementation="interpret")
  want = ref.normalize_weight(w)
  for impl in ("xla", "auto"):
    _check(moe.normalize_weight(w, implementation=impl), want)
  _check(moe.normalize_weight(w[:, :MAX_KERNEL_TOPK]), ref.normalize_weight(w[:, :MAX_KERNEL_TOPK]))


def test_list_input(key):
  w = jax.random.uniform(key, (5, 3), jnp.float32)
  _check(moe.normalize_weight(w.tolist()), ref.normalize_weight(w))


def test_no_retrace(key):
  jax.block_until_ready(moe.normalize_weight(jnp.ones((8, 6), jnp.float32)))  # see test_topk_gate.test_no_retrace
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(w):
    return moe.normalize_weight(w)

  for i in range(3):
    f(jax.random.uniform(jax.random.fold_in(key, i), (130, 6), jnp.float32))


@pytest.mark.parametrize("bad, match", [(jnp.ones((4,)), "have rank 2"), (jnp.ones((4, 2), jnp.bfloat16), "have dtype"),
                                        (jnp.ones((4, 2), bool), "have dtype"), ((1.0, 2.0), "be an array")])
def test_bad_inputs(bad, match):
  with pytest.raises(ValueError, match=f"topk_weights must {match}"):
    moe.normalize_weight(bad)
