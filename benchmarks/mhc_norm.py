"""mHC ``pre_norm_fn`` (docs/mhc.md): forward, backward, and forward + backward.

Shapes: upstream's correctness grid ``T ∈ {4096, 8192} × H ∈ {1280, 2560, 7168}`` and its split-K grid
``T ∈ {13, 48, 512} × H ∈ {1280, 2560, 4096, 7168}`` (``M = 4``, ``J = 24``, ``K = 4H``; no norm weight: it is
merged into ``fn`` by XLA before the kernels). Upstream has no benchmark for this op. Byte counts (each array
once): forward ``2TK + 4JK + 4TJ`` (residual, fn, mixes); ``pre_norm_fn_bwd`` ``4TK + 8JK + 8TJ + 4T``
(residual read and its gradient written, fn read and its gradient written, grad_mixes, out_mul, sqrsum);
``pre_norm_fn:fwd+bwd`` (``jax.value_and_grad`` w.r.t. residual and fn) the forward with its saved sums
(``+4TJ + 4T``) plus the backward. The XLA columns time the ``jnp`` references compiled by XLA (for the
backward rows: the hand backward reference; for fwd+bwd: ``jax.value_and_grad`` of the forward reference).
Checks use upstream's tolerances (mixes ``1e-3``; gradients relative to their scale).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.registry import BenchOp, Case, register
from jaxkern import mhc
from jaxkern.reference import mhc_norm as ref

J = 24
GRID = [(t, h) for t in (4096, 8192) for h in (1280, 2560, 7168)]
SPLIT_GRID = [(t, h) for t in (13, 48, 512) for h in (1280, 2560, 4096, 7168)]


def tol_check(tol):
  def check(out, expected) -> None:
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      scale = float(np.max(np.abs(b), initial=0.0))
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(scale, 1e-30))
  return check


def _args(key, t, h, grad=False):
  kx, kf, kg = jax.random.split(key, 3)
  x = (jax.random.normal(kx, (t, 4, h)) * (1 + 0.01 * jnp.arange(4))[:, None]).astype(jnp.bfloat16)
  fn = jax.random.normal(kf, (J, 4 * h)) * 1e-4
  if not grad:
    return x, fn
  return x, fn, jax.random.normal(kg, (t, J))


def _fwd_bytes(t, h):
  k = 4 * h
  return 2 * t * k + 4 * J * k + 4 * t * J


def _bwd_bytes(t, h):
  k = 4 * h
  return 4 * t * k + 8 * J * k + 8 * t * J + 4 * t


def _case(t, h, nbytes, grad=False):
  return Case(f"T={t} H={h}", lambda key: _args(key, t, h, grad), nbytes(t, h))


def _fwd(x, fn, **implementation):
  return mhc.pre_norm_fn(x, fn, **implementation)


def _fwd_ref(x, fn):
  return ref.pre_norm_fn(x, fn)


register(BenchOp(
    "pre_norm_fn", _fwd, _fwd_ref,
    lambda: [_case(t, h, _fwd_bytes) for t, h in GRID + SPLIT_GRID],
    lambda: [_case(70, 64, _fwd_bytes), _case(13, 128, _fwd_bytes)], check=tol_check(1e-3)))


def _bwd_args(key, t, h):
  x, fn, g = _args(key, t, h, grad=True)
  saved = ref.pre_norm_fn_fwd(x, fn)
  return g, x, fn, saved.out_mul, saved.sqrsum


def _bwd_case(t, h):
  return Case(f"T={t} H={h}", lambda key: _bwd_args(key, t, h), _bwd_bytes(t, h))


register(BenchOp(
    "pre_norm_fn_bwd", mhc.pre_norm_fn_bwd, ref.pre_norm_fn_bwd,
    lambda: [_bwd_case(t, h) for t, h in GRID + SPLIT_GRID],
    lambda: [_bwd_case(70, 64)], check=tol_check(2e-2)))


def _vg(f, x, fn, g):
  # jitted: eager interpret-mode kernels mixed with XLA ops can deadlock XLA:CPU (seen in CI)
  return jax.jit(jax.value_and_grad(lambda x, fn: jnp.sum(f(x, fn) * g), argnums=(0, 1)))(x, fn)


register(BenchOp(
    "pre_norm_fn:fwd+bwd",
    lambda x, fn, g, **implementation: _vg(functools.partial(mhc.pre_norm_fn, **implementation), x, fn, g),
    lambda x, fn, g: _vg(ref.pre_norm_fn, x, fn, g),
    lambda: [_case(t, h, lambda t, h: _fwd_bytes(t, h) + 4 * t * J + 4 * t + _bwd_bytes(t, h), grad=True)
             for t, h in GRID],
    lambda: [_case(70, 64, lambda t, h: _fwd_bytes(t, h) + 4 * t * J + 4 * t + _bwd_bytes(t, h), grad=True)],
    check=tol_check(2e-2)))
