"""Differentiation support shared by the ops: the error of an op that is not differentiable.

Differentiable ops define a ``jax.custom_vjp`` next to their kernels (each op module says how).
Ops that are not differentiable (the quantisation casts and cast-backs) pass their floating-point
inputs through :func:`guard`: an identity that costs nothing, whose derivative rule raises
:class:`NotDifferentiableError` naming the op and what to do instead. JAX calls the rule only when
an input really carries a tangent, so ``jax.grad`` of a function that also calls a cast on
constants (or under ``jax.lax.stop_gradient``) works; ``jax.grad`` through the cast itself says why
it cannot, instead of JAX's ``Differentiation rule for 'mpmd_map' not implemented``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


class NotDifferentiableError(TypeError):
  """``jax.grad`` / ``jax.jvp`` / ``jax.vjp`` reached a jaxkern op that has no derivative."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _identity(op: str, advice: str, x):
  return x


@_identity.defjvp
def _identity_jvp(op, advice, primals, tangents):
  del primals, tangents
  raise NotDifferentiableError(f"jaxkern op {op!r} is not differentiable: {advice}")


def guard(op: str, advice: str, *arrays):
  """``arrays`` unchanged (one array, or a tuple of them; ``None`` passes through); differentiating
  through a floating-point one raises :class:`NotDifferentiableError` with ``advice``."""
  out = tuple(a if a is None or not jnp.issubdtype(jnp.result_type(a), jnp.inexact)
              else _identity(op, advice, a) for a in arrays)
  return out[0] if len(arrays) == 1 else out


CAST_ADVICE = ("quantisation rounds, so its derivative is zero almost everywhere. Apply the cast to "
               "jax.lax.stop_gradient(x) if no gradient should flow, or define the gradient you want "
               "(e.g. a straight-through jax.custom_vjp around the cast)")
DEQUANT_ADVICE = ("it takes quantised data, which has no derivative. Apply it to jax.lax.stop_gradient of its "
                  "inputs, or write the dequantisation (data.astype(jnp.float32) * scale) in jnp where gradients "
                  "w.r.t. the scales are needed")


def vary_like(*operands):
  """``operands`` (pytrees) with every array leaf cast to the union of the leaves' varying manual axes.

  Under ``jax.shard_map`` (``check_vma=True``) the backward pass of a ``jax.custom_vjp`` must return a
  cotangent of the same varying-manual-axes type as each input. A replicated input (a weight, a scale)
  combined with a sharded one (tokens) gets a gradient that varies over the mesh axis, which JAX rejects
  (``the manual axis types do not match``). Casting the replicated input to varying first
  (``lax.pcast(..., to="varying")``, free in the forward pass) fixes the types; JAX transposes the cast to a
  ``psum`` over the devices that share the input. Outside ``shard_map`` this returns ``operands`` unchanged.
  Python scalars are left alone (make them arrays first if they are differentiated).
  """
  leaves, treedef = jax.tree.flatten(operands)
  is_array = [isinstance(a, jax.Array) for a in leaves]
  varying = [jax.typeof(a).manual_axis_type.varying if arr else frozenset() for a, arr in zip(leaves, is_array)]
  axes = frozenset().union(*varying)
  if not axes:
    return operands
  leaves = [jax.lax.pcast(a, tuple(sorted(axes - v)), to="varying") if arr and axes - v else a
            for a, arr, v in zip(leaves, is_array, varying)]
  return jax.tree.unflatten(treedef, leaves)
