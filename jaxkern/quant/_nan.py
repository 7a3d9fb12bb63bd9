"""NaN handling shared by the quantising kernels, so that kernel and reference give the same bits for NaN and
±inf inputs on every backend: NaN-propagating maxima of ``|x|`` (:func:`abs_key`, :func:`key_value`) and the
GPU's canonical NaN (:func:`gpu_nan`). The compiled kernels do nothing extra; interpret mode pays for both."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxkern.reference import quant as ref


def abs_key(h, interpret):
  """``|h|`` (float32) in the form whose maximum the kernels take: NaN-propagating on both backends.

  On the GPU ``|h|`` itself (the kernels' code as it was measured): ``jnp.maximum`` / ``jnp.max`` lower to
  ``max.NaN.f32`` in Mosaic GPU, so a NaN wins. In interpret mode XLA's float max reductions drop NaN on the
  CPU for some shapes, so there the key is the float32 pattern with the sign cleared, whose integer order is
  that of the magnitudes with NaN above +inf (:func:`jaxkern.reference.quant.abs_max`). Elementwise
  ``jnp.maximum`` and ``jnp.max`` work on either key; :func:`key_value` turns the maximum back into a float32.
  """
  return jnp.abs(h) if interpret is None else lax.bitcast_convert_type(h, jnp.int32) & 0x7FFFFFFF


def key_value(k, interpret):
  """The float32 value of a maximum of :func:`abs_key` keys."""
  return k if interpret is None else lax.bitcast_convert_type(k, jnp.float32)


def gpu_nan(v, interpret):
  """NaN results as the GPU makes them: on the GPU ``v`` itself (every NaN an instruction returns is the
  canonical NaN 0x7FFFFFFF), in interpret mode ``v`` with its NaNs made canonical (the CPU keeps an
  operand's NaN or makes a negative one; :func:`jaxkern.reference.quant.canonical_nan`)."""
  return v if interpret is None else ref.canonical_nan(v)
