"""fp8_grouped_linear's weight gradient for any block layout: the blocks of one expert not contiguous
(``[0, 1, 0]``), ``block_expert`` traced under ``jax.jit`` and concrete, interpret-mode kernels against the
reference implementation (to a bf16 rounding: the kernel walks each expert's blocks in block order, as the
reference; the ``"kn"`` products may be summed in another order)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.modeling import fp8_grouped_linear

G, K, N = 2, 256, 256


def _inputs(key, blocks):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (128 * blocks, K), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (G, N, K), jnp.float32) / 16).astype(jnp.bfloat16)
  # A bf16 cotangent: from a float32 one, XLA on a GPU may drop the bf16 rounding of the cast inside one jit (its
  # excess-precision rule), and the jitted reference then quantises other values than the kernels read.
  dy = jax.random.normal(k3, (128 * blocks, N), jnp.float32).astype(jnp.bfloat16)
  return x, w, dy


def _grads(implementation, weight_layout, x, w, dy, block_expert):
  def loss(x, w, be):
    y = fp8_grouped_linear(x, w, be, weight_layout=weight_layout, implementation=implementation)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1))(x, w, block_expert)


def _assert_close(got, want):
  for g, r in zip(got, want):
    r = np.asarray(r, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=2 ** -7, atol=2 ** -10 * np.abs(r).max())


@pytest.mark.parametrize("weight_layout", ["nk", "kn"])
@pytest.mark.parametrize("layout", [[0, 1, 0], [1, 0, 1, -1, 0]])
def test_weight_grad_any_layout_traced(key, weight_layout, layout):
  """``block_expert`` a traced argument of ``jax.jit``: the kernels' gradients equal the reference's."""
  x, w, dy = _inputs(key, len(layout))
  if weight_layout == "kn":
    w = jnp.swapaxes(w, 1, 2)
  be = jnp.asarray(layout, jnp.int32)
  got = jax.jit(functools.partial(_grads, None, weight_layout))(x, w, dy, be)
  want = jax.jit(functools.partial(_grads, "reference", weight_layout))(x, w, dy, be)
  _assert_close(got, want)
  assert np.count_nonzero(np.asarray(want[1][0], np.float32))  # expert 0 has rows in two runs


def test_weight_grad_any_layout_concrete(key):
  """A concrete non-contiguous ``block_expert`` (closed over): the same gradients, no error."""
  x, w, dy = _inputs(key, 3)
  be = jnp.asarray([0, 1, 0], jnp.int32)
  got = jax.jit(lambda x, w, dy: _grads(None, "nk", x, w, dy, be))(x, w, dy)
  want = _grads("reference", "nk", x, w, dy, be)
  _assert_close(got, want)
