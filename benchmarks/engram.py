"""Engram ops on upstream's benchmark grid: T in {4001, 8001}, M = 4,
D in {2048, 2560, 3072, 4096, 6144, 7168}; hash N = 3, L = 2, E = 8. Byte counts as the spec sums them:

* ``engram_hash``: ``140·T + 304``;
* ``engram_gate_fwd``: ``26·T·D + 16·D`` (+ ``64·T`` with ``save_for_backward``);
* ``engram_gate_bwd``: ``44·T·D + 48·D + 64·T`` (the partial buffer is not counted; ``P`` = the op's
  default token chunks, e.g. 150 at ``D = 7168``, ``T = 8001``; the one-pass kernels (``D`` = 2048, 3072,
  4096, 6144) move these bytes, the two-pass kernels (``D`` = 2560, 7168) ``52·T·D``: ``go`` is read by both
  passes); the check compares ``grad_x``, ``grad_k``, ``grad_v`` and the partials' sum over ``P`` (the reference's
  default ``P`` differs from the kernel's);
* ``engram_gate:fwd+bwd``: ``jax.vjp`` of :func:`jaxkern.modeling.engram_gate` (forward with the saved
  intermediates, backward kernels, weight-gradient reduction) vs the same of the ``jnp`` composite compiled
  by XLA; bytes = the forward's plus the backward's. Its cotangent is zeroed on the (token, stream) rows
  with ``|d| < 1e-3`` (:func:`conditioned_grad_out`): there ``G ∝ |d|^-1/2`` amplifies the float32
  rounding of either forward's ``raw`` (``δG/G = δraw/(2·raw)``), so two correct float32 pipelines differ
  by more than the tolerance (one such row of randn data gave ``calc_diff`` 4.6e-6 of grad_k between the
  float32 and the float64 reference at ``T = 1000``); upstream's backward test avoids it by feeding the
  kernel the reference's intermediates, which ``engram_gate_bwd``'s rows do.

``fused_weight`` and ``grad_w_reduce`` are XLA code (no kernel), so they have no rows. Checks use the
spec's ``calc_diff`` thresholds (2e-10 forward, 1e-8 backward), the hash is bitwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.registry import BenchOp, Case, bitwise_check, register
from jaxkern import engram, modeling
from jaxkern.reference import engram as ref
from jaxkern.testing import assert_diff_below, hidden_sizes, randn

TOKENS = (4001, 8001)
EPS, CLAMP = 1e-20, 1e-6


def diff_check(tol):
  def check(out, expected):
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
      assert_diff_below(a, b, tol)
  return check


def _gate_args(key, t, d, m=4):
  ks = jax.random.split(key, 6)
  x, k = (randn(kk, (t, m, d), jnp.bfloat16) for kk in ks[:2])
  v = randn(ks[2], (t, d), jnp.bfloat16)
  wh, we = (randn(kk, (m, d), jnp.bfloat16) for kk in ks[3:5])
  return x, k, v, wh, we, randn(ks[5], (t, m, d), jnp.bfloat16)


def _fwd_case(t, d, save):
  def make_args(key):
    x, k, v, wh, we, _ = _gate_args(key, t, d)
    return x, k, v, ref.fused_weight(wh, we)

  nbytes = 26 * t * d + 16 * d + (64 * t if save else 0)
  return Case(f"T={t} D={d} save={save}", make_args, nbytes,
              dict(eps=EPS, clamp_value=CLAMP, save_for_backward=save))


register(BenchOp(
    "engram_gate_fwd", engram.engram_gate_fwd, ref.engram_gate_fwd,
    lambda: [_fwd_case(t, d, s) for t in TOKENS for d in hidden_sizes(128) for s in (True, False)],
    lambda: [_fwd_case(3, 512, True), _fwd_case(2, 2560, False)], check=diff_check(2e-10)))


def _bwd_case(t, d, p=None):
  def make_args(key):
    x, k, v, wh, we, go = _gate_args(key, t, d)
    wf = ref.fused_weight(wh, we)
    saved = ref.engram_gate_fwd(x, k, v, wf, eps=EPS, clamp_value=CLAMP)
    return (go, x, k, v, wf, *saved[1:])

  kwargs = dict(clamp_value=CLAMP) if p is None else dict(clamp_value=CLAMP, num_partials=p)
  return Case(f"T={t} D={d}", make_args, 44 * t * d + 48 * d + 64 * t, kwargs)


def _bwd_check(out, expected):
  """grad_x, grad_k, grad_v, and the weight gradient ``Σ_p grad_w_partial[p]`` at upstream's 1e-8."""
  for a, b in zip(out[:3], expected[:3], strict=True):
    assert_diff_below(a, b, 1e-8)
  assert_diff_below(jnp.sum(out[3], axis=0), jnp.sum(expected[3], axis=0), 1e-8)


register(BenchOp(
    "engram_gate_bwd", engram.engram_gate_bwd, ref.engram_gate_bwd,
    lambda: [_bwd_case(t, d) for t in TOKENS for d in hidden_sizes(128)],
    lambda: [_bwd_case(3, 512, 4), _bwd_case(2, 1024)], check=_bwd_check))


def conditioned_grad_out(x, k, wh, we, go, *, min_abs_d=1e-3):
  """``go`` with the (token, stream) rows zeroed where the reference forward's ``|d| < min_abs_d``: the
  backward's ``G ∝ |d|^-1/2`` makes those rows' gradients ill-conditioned in the float32 ``raw`` (see the
  module docstring); elsewhere ``go`` is unchanged."""
  wf = ref.fused_weight(wh, we)
  saved = ref.engram_gate_fwd(x, k, x[:, 0], wf, eps=EPS, clamp_value=CLAMP)
  d = saved.dot * saved.rstd_x * saved.rstd_k * np.float32(np.float64(x.shape[-1]) ** -0.5)
  return jnp.where((jnp.abs(d) < min_abs_d)[..., None], jnp.zeros_like(go), go)


def _gate_vjp(gate, x, k, v, wh, we, go, **implementation):
  out, vjp = jax.vjp(lambda *a: gate(*a, clamp_value=CLAMP, eps=EPS, **implementation), x, k, v, wh, we)
  return out, vjp(go)


def _grad_case(t, d):
  nbytes = (26 * t * d + 16 * d + 64 * t) + (44 * t * d + 48 * d + 64 * t)
  def make_args(key):
    x, k, v, wh, we, go = _gate_args(key, t, d)
    return x, k, v, wh, we, conditioned_grad_out(x, k, wh, we, go)

  return Case(f"T={t} D={d}", make_args, nbytes)


register(BenchOp(
    "engram_gate:fwd+bwd", functools.partial(_gate_vjp, modeling.engram_gate),
    functools.partial(_gate_vjp, ref.engram_gate),
    lambda: [_grad_case(t, d) for t in TOKENS for d in (4096, 7168)],
    lambda: [_grad_case(2, 256)], check=diff_check(1e-6)))


def _hash_case(t, n=3, num_layers=2, e=8):
  def make_args(key):
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()[-1])
    ids = rng.integers(0, 100000, (t, n), dtype=np.int32)
    mult = rng.integers(0, 100000, (num_layers, n), dtype=np.int64)
    sizes = rng.integers(100000, 1000000, (num_layers, n - 1, e), dtype=np.int32)
    return (jnp.asarray(ids), ref.split_multipliers(mult), jnp.asarray(sizes), ref.make_offsets(sizes))

  nbytes = 4 * t * n + 8 * num_layers * n + 8 * num_layers * (n - 1) * e + 4 * num_layers * t * (n - 1) * e
  return Case(f"T={t} N={n} L={num_layers} E={e}", make_args, nbytes)


register(BenchOp(
    "engram_hash", engram.engram_hash, ref.engram_hash,
    lambda: [_hash_case(t) for t in TOKENS], lambda: [_hash_case(40)], check=bitwise_check))
