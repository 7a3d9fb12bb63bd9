"""``grouped_matmul``: ``jax.lax.ragged_dot`` that also works under ``jax.vmap`` with shared weights.

``ragged_dot``'s batching rule (jax 0.11.2) needs every operand batched along axis 0: vmapping a
layer over token blocks with one set of expert weights (``in_axes=(None, 0)``) raises
``NotImplementedError: ragged_dot vmap over any dim but 0``. Here the product is a
``jax.custom_batching.custom_vmap`` whose rule maps over the blocks (``lax.map``, one ragged_dot per
block, no copy of the weights) when the weights are shared, and uses the native rule when they are
batched too. ``custom_vmap`` has no reverse-mode autodiff, so the whole op is a ``jax.custom_vjp``
whose backward pass is built from two batchable products: ``dx = ragged_dot(dy, w^T)`` (the same
``custom_vmap``) and ``dw = x^T dy`` per group (a ragged contraction over the rows, every operand
batched), both with float32 accumulation. Under ``vmap`` with shared weights the weight gradient is
formed per block and then summed by JAX (``custom_vjp`` batching): ``(blocks, G, K, N)`` in memory.

Under ``jax.shard_map`` (``check_vma=True``) a ``custom_vjp`` backward must return cotangents of the same
varying-manual-axes type as its inputs: with replicated weights (e.g. shared experts) and sharded rows the
weight gradient varies over the mesh axis while the weights do not. So :func:`grouped_matmul` first casts its
operands to the union of their varying axes (:func:`jaxkern._autodiff.vary_like`, free in the forward pass);
JAX transposes that cast to a ``psum`` of the weight gradient over the devices that share the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from jaxkern._autodiff import vary_like

# dw[g] = sum over the rows r of group g of x[r]^T dy[r]: the rows are the ragged contracting dimension.
_WEIGHT_GRAD_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _ragged_dot(x, w, group_sizes):
  return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


@custom_vmap
def _rows_times_group_weights(x, w, group_sizes):
  return _ragged_dot(x, w, group_sizes)


@_rows_times_group_weights.def_vmap
def _rows_times_group_weights_batched(axis_size, in_batched, x, w, group_sizes):
  x_batched, w_batched, sizes_batched = in_batched
  x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
  group_sizes = group_sizes if sizes_batched else jnp.broadcast_to(group_sizes, (axis_size, *group_sizes.shape))
  if w_batched:
    return jax.vmap(_ragged_dot)(x, w, group_sizes), True
  return lax.map(lambda block: _rows_times_group_weights(block[0], w, block[1]), (x, group_sizes)), True


def _ragged_weight_grad(x, dy, group_sizes):
  return lax.ragged_dot_general(x, dy, group_sizes, _WEIGHT_GRAD_DIMS, preferred_element_type=jnp.float32)


@custom_vmap
def _weight_grad(x, dy, group_sizes):
  """``(G, K, N)`` float32: ``x[rows of g]^T @ dy[rows of g]`` for each group ``g``."""
  return _ragged_weight_grad(x, dy, group_sizes)


@_weight_grad.def_vmap
def _weight_grad_batched(axis_size, in_batched, *operands):
  operands = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(operands, in_batched)]
  return jax.vmap(_ragged_weight_grad)(*operands), True


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """``out[r] = x[r] @ w[g]`` for the rows ``r`` of group ``g`` (consecutive, ``group_sizes[g]`` of them).

  Args:
    x: ``(M, K)`` float32 or bfloat16 rows.
    w: ``(G, K, N)`` weights of ``x.dtype``.
    group_sizes: ``(G,)`` int32 rows per group, in row order; they should sum to ``M`` (rows past the
      sum get zeros).

  Returns:
    ``(M, N)`` of ``x.dtype``, accumulated in float32.
  """
  return _grouped_matmul(*vary_like(x, w, group_sizes))


@jax.custom_vjp
def _grouped_matmul(x, w, group_sizes):
  return _rows_times_group_weights(x, w, group_sizes)


def _grouped_matmul_fwd(x, w, group_sizes):
  return _grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_bwd(residuals, dy):
  x, w, group_sizes = residuals
  dx = _rows_times_group_weights(dy, jnp.swapaxes(w, 1, 2), group_sizes)
  dw = _weight_grad(x, dy, group_sizes).astype(w.dtype)
  return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
