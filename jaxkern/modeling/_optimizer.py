"""The two pieces of a training step that optax users expect, without needing optax installed.

``jaxkern.modeling`` takes any optimiser with optax's ``init`` / ``update`` interface (an
``optax.GradientTransformation``); it never imports optax itself, so ``pip install jaxkern`` without extras can import
every module. Both functions compute what their optax namesakes compute (``optax.apply_updates``,
``optax.softmax_cross_entropy_with_integer_labels``), operation for operation, so losses and parameters are the same
bits with either.
"""

import jax
import jax.numpy as jnp


def apply_updates(params, updates):
  """``params + updates`` leaf by leaf, each sum cast back to its param's dtype (``None`` leaves stay ``None``)."""
  return jax.tree.map(lambda p, u: None if p is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
                      params, updates, is_leaf=lambda x: x is None)


def cross_entropy_with_integer_labels(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross entropy per position: ``logsumexp(logits) - logits[label]`` over the last axis.

  Args:
    logits: ``(..., V)`` float logits.
    labels: ``(...)`` integer labels in ``[0, V)``.

  Returns:
    ``(...)`` losses, the dtype of ``logits``.
  """
  label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - label_logits
