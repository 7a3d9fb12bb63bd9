"""The trainable Engram gate (docs/engram.md, "The trainable gate"): a ``jax.custom_vjp`` over the
:mod:`jaxkern.engram` ops.

* Primal (no derivative taken): :func:`jaxkern.engram.fused_weight`, then
  :func:`jaxkern.engram.engram_gate_fwd` without the saved intermediates (bit-identical output).
* Forward rule: the same with ``save_for_backward=True``; the residuals are exactly upstream's list:
  ``x, k, v, weight_hidden, weight_embed, weight_fused, dot, gate_score, rstd_x, rstd_k`` (the weights as
  passed, so that their cotangents come back in their own dtype).
* Backward rule: :func:`jaxkern.engram.engram_gate_bwd` (``grad_x``, ``grad_k``, ``grad_v`` and the
  per-CTA partial gradient of ``weight_fused``), then :func:`jaxkern.engram.grad_w_reduce` into zero
  float32 accumulators. Upstream's ``main_grad`` convention (adding into an fp32 buffer in place and
  returning None) becomes the functional default (docs/engram.md, "Gate"): the full weight cotangents are returned;
  a training loop accumulates them (``acc = acc + g`` under ``jax.jit`` with the accumulator donated), and
  manual backward code can call ``grad_w_reduce`` with its own accumulators.

Each call runs the implementation chosen when it is traced (``implementation=`` or the active setting),
forward and backward alike; ``"reference"`` runs the ``jnp`` references inside the same ``custom_vjp``
(any float dtype, e.g. float64 for gradient checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _checks, _config, engram
from jaxkern._autodiff import vary_like
from jaxkern.engram._gate import FLOATS


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gate(x, k, v, wh, we, clamp_value, eps, implementation):
  wf = engram.fused_weight(_values(wh, x), _values(we, x), implementation=implementation)
  return engram.engram_gate_fwd(x, k, v, wf, eps=eps, clamp_value=clamp_value, save_for_backward=False,
                                implementation=implementation).output


def _values(w, x):
  """The weight values the gate uses: bfloat16 for bfloat16 activations (float32 master weights are
  rounded, docs/engram.md, "The trainable gate"), the weights as given otherwise."""
  return w.astype(jnp.bfloat16) if x.dtype == jnp.bfloat16 else w


def _gate_fwd(x, k, v, wh, we, clamp_value, eps, implementation):
  wf = engram.fused_weight(_values(wh, x), _values(we, x), implementation=implementation)
  out = engram.engram_gate_fwd(x, k, v, wf, eps=eps, clamp_value=clamp_value, save_for_backward=True,
                               implementation=implementation)
  return out.output, (x, k, v, wh, we, wf, out.dot, out.gate_score, out.rstd_x, out.rstd_k)


def _gate_bwd(clamp_value, eps, implementation, residuals, grad_out):
  del eps
  x, k, v, wh, we, wf, dot, gate, rstd_x, rstd_k = residuals
  grads = engram.engram_gate_bwd(grad_out.astype(x.dtype), x, k, v, wf, dot, gate, rstd_x, rstd_k,
                                 clamp_value=clamp_value, implementation=implementation)
  acc = jnp.zeros(wh.shape, jnp.promote_types(wf.dtype, jnp.float32))
  gwh, gwe = engram.grad_w_reduce(grads.grad_w_partial, _values(wh, x), _values(we, x), acc, acc,
                                  implementation=implementation)
  return grads.grad_hidden_states, grads.grad_k, grads.grad_v, gwh.astype(wh.dtype), gwe.astype(we.dtype)


_gate.defvjp(_gate_fwd, _gate_bwd)


def engram_gate(hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_hidden: jax.Array, weight_embed: jax.Array,
                *, clamp_value: float, eps: float, implementation: str | None = None) -> jax.Array:
  """The Engram gate ``x + σ(signed_sqrt(<RMSNorm(x; w_h), RMSNorm(k; w_e)>/sqrt(D)))·v``, differentiable.

  Args:
    hidden_states: ``[*, M, D]`` bfloat16 (``M = hc_mult`` residual streams; any leading dims, flattened to
      ``T`` tokens, including none and zero-size ones). Any float dtype runs where the ops allow it
      (float64 with ``implementation="reference"`` or ``"auto"`` off a GPU).
    k: ``[*, M, D]``, the shape and dtype of ``hidden_states``.
    v: ``[*, D]`` (the leading dims of ``hidden_states``), the same dtype.
    weight_hidden, weight_embed: ``(M, D)`` RMSNorm weights, bfloat16 or float32 (float32 master weights
      are rounded to bfloat16 for bfloat16 activations; their cotangents come back in float32).
    clamp_value: the signed-sqrt clamp ``c`` (upstream default 1e-6).
    eps: RMSNorm epsilon.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``; used by
      the forward and the backward.

  Returns:
    ``hidden_states``' shape and dtype.

  Raises:
    ValueError (naming the argument): mismatched shapes, non-floating dtypes, weights not ``(M, D)``.

  Differentiation: ``jax.custom_vjp`` (see the module docstring): cotangents of ``hidden_states``, ``k``,
  ``v`` in their dtype, of the weights in theirs (float32 sums of the partials); ``clamp_value`` and
  ``eps`` have none. Where the clamp is active (``|d| < c``) the gate is constant and passes no gradient
  to ``x``'s dot-product path, ``k`` or the weights; at ``|d| = c`` the gradient passes (torch's
  ``clamp_min``).
  """
  x = _checks.as_array("hidden_states", hidden_states)
  k = _checks.as_array("k", k)
  v = _checks.as_array("v", v)
  if x.ndim < 2:
    raise ValueError(f"hidden_states must have shape [*, M, D], got {tuple(x.shape)}")
  for name, a in (("hidden_states", x), ("k", k), ("v", v)):
    _checks.check_dtype(name, a, FLOATS)
  lead, (m, d) = x.shape[:-2], x.shape[-2:]
  if m == 0 or d == 0:
    raise ValueError(f"hidden_states must have non-empty M and D, got {tuple(x.shape)}")
  _checks.check_shape("k", k, x.shape, " (the shape of hidden_states)")
  _checks.check_shape("v", v, (*lead, d))
  wh, we = engram._weights._weights(weight_hidden, weight_embed)
  _checks.check_shape("weight_hidden", wh, (m, d))
  implementation = _config.get_implementation(implementation)
  t = x.size // (m * d)
  # Under shard_map: sharded activations and replicated weights cast to one vma type (their cotangents must match).
  xs, k, v, wh, we = vary_like(x.reshape(t, m, d), k.reshape(t, m, d), v.reshape(t, d), wh, we)
  out = _gate(xs, k, v, wh, we, float(clamp_value), float(eps), implementation)
  return out.reshape(x.shape)
