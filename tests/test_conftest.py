"""tests/conftest.py's random draws in few programs: off a GPU, ``jax.random.normal``, ``uniform``, ``bits`` and
``randint`` are wrapped so that eager draws of many shapes share a few compiled programs; the values must stay JAX's
own, bit for bit, or every test's inputs would change under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

WRAPPED = (jax.random.normal, jax.random.uniform, jax.random.bits, jax.random.randint)
ON_GPU = jax.default_backend() == "gpu"


def _same_bits(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))


@pytest.mark.skipif(ON_GPU, reason="the draws are wrapped off a GPU only")
def test_the_draws_are_wrapped():
  assert all(hasattr(f, "__wrapped__") for f in WRAPPED)


@pytest.mark.skipif(ON_GPU, reason="the draws are wrapped off a GPU only")
@pytest.mark.parametrize("shape", [(), (1025,), (3, 5, 7), (2, 0, 3)], ids=str)
def test_values_are_jax_own(shape):
  """Shapes of one value, just past a flat length, of several dimensions, of none; the draws' options. (Each shape
  compiles JAX's own draws once more: a few shapes only.)"""
  key = jax.random.split(jax.random.key(3))[1]
  for dtype in (jnp.float32, jnp.bfloat16):
    _same_bits(jax.random.normal(key, shape, dtype), jax.random.normal.__wrapped__(key, shape, dtype))
  _same_bits(jax.random.normal(key, list(shape)), jax.random.normal.__wrapped__(key, shape))
  _same_bits(jax.random.uniform(key, shape), jax.random.uniform.__wrapped__(key, shape))
  _same_bits(jax.random.uniform(key, shape, jnp.float32, 0.1, 1.0),
             jax.random.uniform.__wrapped__(key, shape, jnp.float32, 0.1, 1.0))
  _same_bits(jax.random.uniform(key, shape, minval=2 ** -8, maxval=2 ** -6),
             jax.random.uniform.__wrapped__(key, shape, minval=2 ** -8, maxval=2 ** -6))
  for dtype in (jnp.uint8, jnp.uint32):
    _same_bits(jax.random.bits(key, shape, dtype), jax.random.bits.__wrapped__(key, shape, dtype))
  _same_bits(jax.random.randint(key, shape, -1, 9), jax.random.randint.__wrapped__(key, shape, -1, 9))
  _same_bits(jax.random.randint(key, shape, 0, 300, jnp.int16), jax.random.randint.__wrapped__(key, shape, 0, 300,
                                                                                               jnp.int16))


@pytest.mark.skipif(ON_GPU, reason="the draws are wrapped off a GPU only")
def test_raw_keys():
  key = jax.random.PRNGKey(7)
  _same_bits(jax.random.normal(key, (37, 5)), jax.random.normal.__wrapped__(key, (37, 5)))


@pytest.mark.skipif(ON_GPU, reason="the draws are wrapped off a GPU only")
def test_float64_and_traced_draws():
  key = jax.random.key(11)
  with jax.enable_x64(True):
    _same_bits(jax.random.normal(key, (5, 9), jnp.float64), jax.random.normal.__wrapped__(key, (5, 9), jnp.float64))
  traced = jax.jit(lambda k: jax.random.normal(k, (4, 3)))(key)  # under a trace: JAX's own function
  _same_bits(traced, jax.random.normal.__wrapped__(key, (4, 3)))
  _same_bits(jax.vmap(lambda k: jax.random.normal(k, (6,)))(jax.random.split(key, 3)),
             jax.vmap(lambda k: jax.random.normal.__wrapped__(k, (6,)))(jax.random.split(key, 3)))
