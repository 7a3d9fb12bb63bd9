"""Backward passes of the MoE routing ops, and forward + backward of the routing path of a MoE layer.

* ``expand_to_fused.bwd`` (``dx[t] = sum_k dy[pos[t, k]]``, the reduce kernel without weights) on the
  expand grid's hidden sizes that are multiples of 256, bf16; bytes = the used rows of ``dy`` read +
  ``dx`` written + ``token_topk_to_pos``.
* ``reduce_fused.bwd`` (``dx[p] = w[t, k] dy[t]``, zero on unused fused rows, and ``dw[t, k] = <x[p],
  dy[t]>``) on the expand grid's mappings (``x`` has the mapping's ``N`` rows), float32 and bf16;
  bytes = ``dy`` + the used rows of ``x`` read + ``dx`` written (all ``N`` rows) + ``token_topk_to_pos``
  + ``topk_weights`` + ``dw``.
* ``top2_sum_gate:fwd+bwd`` and ``normalize_weight:fwd+bwd``: ``jax.vjp`` of the weights (forward
  kernel plus the XLA backward) at the DeepSeek-V3 gate shape (8192 x 256, 8/4 groups, K = 8) and on
  the routing grid; bytes = the forward's inputs and outputs plus the cotangents in and out.
* ``moe_routing_path:fwd+bwd``: ``expand -> ragged_dot -> silu -> ragged_dot -> weighted reduce`` and
  the gradients w.r.t. ``x``, the weights and both expert matrices, at DeepSeek-V3-like sizes (256
  experts over 8 EP ranks: 32 local experts, K = 8, H = 7168, expert width 2048; bf16); the XLA
  timing is the same layer built from the ``jnp`` references. Bytes = ``x`` + the expert matrices.

The XLA columns time ``jax.vjp`` of the ``jnp`` references (their forward is dead code there and
XLA removes it). Checks use tolerances: the references' derivatives accumulate in other orders.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe import _gate_case
from benchmarks.moe_routing import MOE_PARAMS, _label, _routing
from benchmarks.registry import BenchOp, Case, register
from jaxkern import _config, moe
from jaxkern.moe import _expand_to_fused, _reduce_fused
from jaxkern.reference import moe as ref
from jaxkern.testing import hidden_sizes, randn


def close_check(out, expected) -> None:
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
    tol = 1e-4 if a.dtype == b.dtype == jnp.float32 else 2e-2
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(float(np.max(np.abs(b), initial=0.0)), 1.0)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


def _expand_bwd(x, pos, pte, dy, *, implementation=None):
  del x, pte
  return _expand_to_fused._sum_slots("expand_to_fused.bwd", dy, pos, _config.get_implementation(implementation))


def _expand_bwd_ref(x, pos, pte, dy):
  return jax.vjp(lambda x: ref.expand_to_fused(x, pos, pte), x)[1](dy)[0]


def _expand_bwd_case(experts, ranks, num_topk, hidden, send_tokens=None):
  idx, pos, pte = _routing(experts, ranks, num_topk, *(() if send_tokens is None else (send_tokens,)))
  t, n = idx.shape[0], pte.shape[0]
  nbytes = (int((pos >= 0).sum()) + t) * hidden * 2 + t * num_topk * 4

  def make_args(key):
    return (jnp.zeros((t, hidden), jnp.bfloat16), jnp.asarray(pos), jnp.asarray(pte),
            randn(key, (n, hidden), jnp.bfloat16))

  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} bf16"), make_args, nbytes)


register(BenchOp(
    "expand_to_fused.bwd", _expand_bwd, _expand_bwd_ref,
    lambda: [_expand_bwd_case(*p, h) for p in MOE_PARAMS for h in hidden_sizes(256)],
    lambda: [_expand_bwd_case(9, 8, 2, 256, 2)], check=close_check))


def _reduce_bwd(x, w, pos, dy, *, implementation=None):
  residuals = (x, None, w, pos, None, _reduce_fused._Needs(x=True, dots=True))
  d_x, _, d_w, _, _ = _reduce_fused._reduce_bwd(x.dtype, _config.get_implementation(implementation), residuals, dy)
  return d_x, d_w


def _reduce_bwd_ref(x, w, pos, dy):
  return jax.vjp(lambda x, w: ref.reduce_fused(x, w, pos), x, w)[1](dy)


def _reduce_bwd_case(experts, ranks, num_topk, hidden, dtype, send_tokens=None):
  idx, pos, pte = _routing(experts, ranks, num_topk, *(() if send_tokens is None else (send_tokens,)))
  t, n = idx.shape[0], pte.shape[0]
  size = jnp.dtype(dtype).itemsize
  nbytes = (t + int((pos >= 0).sum()) + n) * hidden * size + 3 * t * num_topk * 4

  def make_args(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return (randn(k1, (n, hidden), dtype), jax.random.uniform(k2, (t, num_topk), jnp.float32), jnp.asarray(pos),
            randn(k3, (t, hidden), dtype))

  name = jnp.dtype(dtype).name
  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} {name}"), make_args, nbytes)


register(BenchOp(
    "reduce_fused.bwd", _reduce_bwd, _reduce_bwd_ref,
    lambda: [_reduce_bwd_case(e, r, k, h, d) for (e, r, k) in MOE_PARAMS if k in (6, 8)
             for h in hidden_sizes(256) for d in (jnp.float32, jnp.bfloat16)],
    lambda: [_reduce_bwd_case(9, 8, 6, 256, jnp.bfloat16, 1)], check=close_check))


def _routing_path(expand, reduce, x, w, pos, pte, group_sizes, w_up, w_down, dy, **implementation):
  """Gradients of ``<dy, layer(x, w, w_up, w_down)>`` w.r.t. all four (``implementation=`` for jaxkern ops)."""
  expand, reduce = (functools.partial(f, **implementation) for f in (expand, reduce))

  def layer(x, w, w_up, w_down):
    h = jax.lax.ragged_dot(expand(x, pos, pte), w_up, group_sizes)
    h = jax.nn.silu(h.astype(jnp.float32)).astype(x.dtype)
    return reduce(jax.lax.ragged_dot(h, w_down, group_sizes), w, pos)

  return jax.vjp(layer, x, w, w_up, w_down)[1](dy)


def _path_case(experts, ranks, num_topk, hidden, width, send_tokens=None):
  idx = _routing(experts, ranks, num_topk, *(() if send_tokens is None else (send_tokens,)))[0]
  m = ref.get_fused_mapping(jnp.asarray(idx), experts, 0, 128)
  pos, pte, sizes = (np.asarray(a) for a in (m.token_topk_to_pos, m.pos_to_expert, m.num_tokens_per_expert))
  t = idx.shape[0]
  nbytes = 2 * (t * hidden + 2 * experts * hidden * width)

  def make_args(key):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    scale = lambda fan_in: jnp.asarray(fan_in ** -0.5, jnp.bfloat16)
    return (randn(k1, (t, hidden), jnp.bfloat16), jax.random.uniform(k2, (t, num_topk), jnp.float32),
            jnp.asarray(pos), jnp.asarray(pte), jnp.asarray(sizes),
            randn(k3, (experts, hidden, width), jnp.bfloat16) * scale(hidden),
            randn(k4, (experts, width, hidden), jnp.bfloat16) * scale(width), randn(k5, (t, hidden), jnp.bfloat16))

  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} I={width} bf16"), make_args, nbytes)


register(BenchOp(
    "moe_routing_path:fwd+bwd",
    functools.partial(_routing_path, moe.expand_to_fused, moe.reduce_fused),
    functools.partial(_routing_path, ref.expand_to_fused, ref.reduce_fused),
    lambda: [_path_case(32, 8, 8, 7168, 2048)],
    lambda: [_path_case(4, 8, 2, 256, 128, 4)], check=close_check))


def _gate_weights_vjp(top2_sum_gate, logits, bias, arrays, cfg, d_weights, **implementation):
  """Forward and backward of ``topk_weights`` w.r.t. ``logits`` (the forward also yields the logical ids)."""
  weights = lambda x: top2_sum_gate(x, bias, **dict(cfg.kwargs), **arrays, **implementation).topk_weights
  return jax.vjp(weights, logits)[1](d_weights)[0]


def _gate_grad_case(func, tokens=8192):
  case = _gate_case(8, 4, 256, 0, 8, func, active=tokens, masked=0)

  def make_args(key):
    return (*case.make_args(key), jax.random.normal(jax.random.fold_in(key, 1), (tokens, 8), jnp.float32))

  return Case(case.label, make_args, 3 * case.nbytes + tokens * 8 * 4)


register(BenchOp(
    "top2_sum_gate:fwd+bwd",
    functools.partial(_gate_weights_vjp, moe.top2_sum_gate), functools.partial(_gate_weights_vjp, ref.top2_sum_gate),
    lambda: [_gate_grad_case(func) for func in ("sigmoid", "sqrtsoftplus", "softmax")],
    lambda: [_gate_grad_case("softmax", 40)], check=close_check))


def _normalize_vjp(normalize_weight, w, d_normalized, **implementation):
  return jax.vjp(lambda w: normalize_weight(w, **implementation).normalized_weights, w)[1](d_normalized)[0]


def _normalize_grad_case(experts, ranks, num_topk, tokens=None):
  t = tokens or _routing(experts, ranks, num_topk)[0].shape[0]

  def make_args(key):
    k1, k2 = jax.random.split(key)
    return jax.random.uniform(k1, (t, num_topk), jnp.float32), jax.random.normal(k2, (t, num_topk), jnp.float32)

  return Case(_label(experts, ranks, num_topk, t), make_args, t * num_topk * 4 * 4 + t * 4)


register(BenchOp(
    "normalize_weight:fwd+bwd",
    functools.partial(_normalize_vjp, moe.normalize_weight), functools.partial(_normalize_vjp, ref.normalize_weight),
    lambda: [_normalize_grad_case(*p) for p in MOE_PARAMS],
    lambda: [_normalize_grad_case(9, 8, 6, 5)], check=close_check))
