"""Shared helpers of the mHC op tests."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxkern

sds = jax.ShapeDtypeStruct
BF16 = dict(rtol=1.6e-2, atol=1e-5)  # torch.testing.assert_close defaults, as upstream's tests use them
FP32 = dict(rtol=1.3e-6, atol=1e-5)


def close(actual, expected, **tol):
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, actual.dtype,
                                                                            expected.shape, expected.dtype)
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **tol)


def interpret(f):
  """``f`` run under jax.jit with the kernels in interpret mode."""
  def g(*args):
    with jaxkern.use_implementation("interpret"):
      return jax.jit(f)(*args)
  return g


def vjp(f, primals, cot):
  out, fn = jax.vjp(f, *primals)
  return out, fn(cot)


def poison_free(a):
  assert np.all(np.isfinite(np.asarray(a, np.float32)))
