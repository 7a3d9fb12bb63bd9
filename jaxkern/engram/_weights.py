"""``fused_weight`` and ``grad_w_reduce`` (docs/engram.md, "Gate"): XLA code, no Pallas kernels.

* ``fused_weight`` is an elementwise product of two ``(M, D)`` bf16 vectors (``32·D`` bytes, 229 KB at
  ``D = 7168``): one XLA fusion, launch-bound; a kernel cannot beat it.
* ``grad_w_reduce`` sums ``P`` float32 ``(M, D)`` partials (``16·P·D`` bytes, 15 MB at ``P = 132``,
  ``D = 7168``) and applies two multiply-adds: one XLA column-reduction fusion reading each partial once.
  Not yet measured against a kernel on a GPU (the lead's tuning list).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkern import _checks, _dispatch
from jaxkern.reference import engram as ref
from jaxkern.types import EngramWeightGrads

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def _weights(weight_hidden, weight_embed):
  wh = _checks.as_array("weight_hidden", weight_hidden)
  we = _checks.as_array("weight_embed", weight_embed)
  for name, a in (("weight_hidden", wh), ("weight_embed", we)):
    _checks.check_rank(name, a, 2)
    _checks.check_dtype(name, a, FLOATS)
  _checks.check_shape("weight_embed", we, wh.shape, " (the shape of weight_hidden)")
  return wh, we


def fused_weight(weight_hidden: jax.Array, weight_embed: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """``f32(weight_hidden) · f32(weight_embed)`` (docs/engram.md, "Gate"), the gate's fused RMSNorm weight.

  Args:
    weight_hidden, weight_embed: ``(M, D)`` bfloat16 (any float dtype: the product is formed in
      ``promote(dtype, float32)``).
    implementation: accepted for uniformity; XLA code under every implementation (see the module docstring).

  Returns:
    ``(M, D)`` float32 (float64 for float64 weights); bit-exact (a bf16 x bf16 product is exact in float32).

  Raises:
    ValueError: not rank 2, non-floating dtypes, different shapes.

  Differentiation: plain ``jnp`` code, differentiable by JAX.
  """
  wh, we = _weights(weight_hidden, weight_embed)
  return _dispatch.run("fused_weight", implementation, kernel=None, xla=lambda: ref.fused_weight(wh, we))


def grad_w_reduce(grad_w_partial: jax.Array, weight_hidden: jax.Array, weight_embed: jax.Array,
                  grad_weight_hidden: jax.Array, grad_weight_embed: jax.Array, *,
                  implementation: str | None = None) -> EngramWeightGrads:
  """The RMSNorm weight gradients from the gate backward's partials (docs/engram.md, "Gate"), functionally.

  ``gwf = Σ_p grad_w_partial[p]`` (float32), then ``(grad_weight_hidden + gwf·f32(weight_embed),
  grad_weight_embed + gwf·f32(weight_hidden))``: the chain rule through ``wf = w_h ⊙ w_e``. Upstream adds
  into the two accumulators in place; here they are inputs and the sums are returned (pass zeros for the
  plain gradients; donate the accumulators to a jitted caller to let XLA update them in place; docs/engram.md, "The trainable gate").

  Args:
    grad_w_partial: ``(P, M, D)`` float32.
    weight_hidden, weight_embed: ``(M, D)`` bfloat16 (any float dtype).
    grad_weight_hidden, grad_weight_embed: ``(M, D)`` float32 accumulators (float64 allowed; the result has
      their dtype).
    implementation: accepted for uniformity; XLA code under every implementation (see the module docstring).

  Returns:
    ``EngramWeightGrads(grad_weight_hidden, grad_weight_embed)``.

  Raises:
    ValueError (naming the argument): ranks, shapes or dtypes that do not match.

  Differentiation: plain ``jnp`` code, differentiable by JAX.
  """
  wh, we = _weights(weight_hidden, weight_embed)
  part = _checks.as_array("grad_w_partial", grad_w_partial)
  _checks.check_rank("grad_w_partial", part, 3)
  _checks.check_dtype("grad_w_partial", part, (jnp.float32, jnp.float64))
  if part.shape[1:] != wh.shape:
    raise ValueError(f"grad_w_partial must have shape (P, {wh.shape[0]}, {wh.shape[1]}), got {tuple(part.shape)}")
  accs = []
  for name, a in (("grad_weight_hidden", grad_weight_hidden), ("grad_weight_embed", grad_weight_embed)):
    a = _checks.as_array(name, a)
    _checks.check_dtype(name, a, (jnp.float32, jnp.float64))
    _checks.check_shape(name, a, wh.shape)
    accs.append(a)
  if accs[0].dtype != accs[1].dtype:
    raise ValueError(f"grad_weight_embed must have the dtype of grad_weight_hidden ({accs[0].dtype}), got {accs[1].dtype}")
  return _dispatch.run("grad_w_reduce", implementation, kernel=None,
                       xla=lambda: ref.grad_w_reduce(part, wh, we, *accs))
