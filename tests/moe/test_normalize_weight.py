from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import moe
from jaxkern.moe._normalize_weight import _kernel
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx


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
  d, nw = jax.jit(moe.normalize_weight)(w)
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
  d, nw = _kernel(w, interpret=jaxkern._config.mosaic_interpret(jaxkern.get_implementation() == "interpret"))
  want_d, want = ref.normalize_weight(w)
  assert_bitwise_equal(d, want_d)
  assert_bitwise_equal(nw, want)


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
  d, nw = f(w)
  want_d, want = ref.normalize_weight(w)
  assert_bitwise_equal(d, want_d)
  assert_bitwise_equal(nw, want)


def test_division_is_correctly_rounded():
  """Hard quotients (random bits, negative weights, tiny sums) against exact rationals."""
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((300, 3)) * rng.choice([1e-30, 1.0, 1e30], (300, 1))).astype(np.float32)
  d, nw = ref.normalize_weight(jnp.asarray(w))
  d, nw = np.asarray(d), np.asarray(nw)
  want = np.array([[_ieee_div(w[t, k], d[t]) for k in range(3)] for t in range(300)], np.float32)
  assert_bitwise_equal(nw, want)


def test_zero_row_and_seed():
  d, nw = moe.normalize_weight(jnp.zeros((2, 3), jnp.float32))
  assert (np.asarray(d).view(np.int32) == 0x1E3CE508).all() and (np.asarray(nw) == 0).all()
  d, nw = moe.normalize_weight(jnp.zeros((0, 3), jnp.float32))
  assert d.shape == (0,) and nw.shape == (0, 3)


@pytest.mark.parametrize("bad, match", [(jnp.ones((4,)), "rank 2"), (jnp.ones((4, 2), jnp.bfloat16), "dtype")])
def test_bad_inputs(bad, match):
  with pytest.raises(ValueError, match=f"topk_weights must have {match}"):
    moe.normalize_weight(bad)
