import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import _ieee
from jaxkern.testing import assert_bitwise_equal

TINY = np.float32(np.finfo(np.float32).tiny)


def _operands(n=100_000):
  rng = np.random.default_rng(0)
  a = np.concatenate([rng.random(n), np.exp(rng.uniform(-80, 80, n)), [1.0, 0.0, 3.0, 1e-20]]).astype(np.float32)
  b = np.concatenate([1 + rng.random(n), np.exp(rng.uniform(-80, 80, n)), [3.0, 7.0, 1.0, 3.0]]).astype(np.float32)
  with np.errstate(all="ignore"):
    q = a / b
  keep = np.isfinite(q) & ((q == 0) | (q >= TINY)) & ((a == 0) | (a >= TINY))
  return a[keep], b[keep], q[keep]


def test_div_is_correctly_rounded():
  a, b, q = _operands()
  assert_bitwise_equal(jax.jit(_ieee.div)(a, b), q)
  assert_bitwise_equal(_ieee.div(jnp.asarray(a[:100]), jnp.float32(3.0)), (a[:100] / np.float32(3)).astype(np.float32))


def test_sqrt_is_correctly_rounded():
  a, _, _ = _operands()
  assert_bitwise_equal(jax.jit(_ieee.sqrt)(a), np.sqrt(a))


def test_a_seed_two_ulps_off_is_corrected():
  a, b, q = _operands(20_000)
  for d in (-2, 2):
    def div(a, b):
      seed = lax.bitcast_convert_type(jnp.maximum(lax.bitcast_convert_type(a / b, jnp.int32) + d, 0), jnp.float32)
      sa, ea = _ieee._split(a)
      sb, eb = _ieee._split(b)

      def above(lo):
        m, em = _ieee._midpoint(lo)
        return _ieee._compare(sa, ea - em - eb, *_ieee._mul(m, sb))

      return jnp.where(a == 0, 0.0, _ieee._round(seed, above))

    assert_bitwise_equal(jax.jit(div)(a, b), q)
