"""The fused epilogue of ``pre_big_fuse`` (engram_mhc.md §4.9): one Mosaic GPU kernel after the ``pre_norm_fn`` GEMM.

Schedule (TileKernels' ``pre_big_fuse`` schedule: the GEMM kernel, then one kernel for everything else):

1. :func:`jaxkern.mhc._norm_fn.fwd_mul_kernel` (the unchanged ``pre_norm_fn`` forward GEMM, same split count
   ``S`` for the same ``T``) writes the split partials ``out_mul_s (T, 24)``, ``sqrsum_s (T,)``; XLA packs them
   as ``(S, T, 32)`` rows ``[out_mul_s | sqrsum_s | 0…]`` (a few hundred bytes per token).
2. :func:`epilogue_kernel`: CTA ``(i, c)`` takes ``TB = 32`` consecutive tokens (the last block's range clamped
   to end at ``T``: it recomputes a few of its neighbour's tokens, identical values); the ``HS`` CTAs
   ``c = 0..HS-1`` of a block (:func:`h_splits`) all compute the block's mixes and each applies the pre mix
   to every ``HS``-th ``(8, 128)`` tile of the hidden rows (``c = 0`` stores ``post`` / ``comb``). One ``(32, 32)`` float32 tile per
   split in the register layout ``row_layout(32, 4, max_lanes=4)`` (4 lanes per token); the 24 mixes and the
   sum of squares of a token become per-token scalars (masked in-row sums: exact) held by those 4 lanes, and
   every thread then runs, on its token:

   * the split sum ``p_0 + p_1 + … + p_{S-1}`` (the order of ``pre_norm_fn``'s XLA sum) and
     ``mixes = out_mul · rsqrt(sqrsum / K + eps)`` (the same expression as ``pre_norm_fn``);
   * ``pre_split_mixes`` (``a = z·scale[grp] + base``, ``σ(a) = 1 / (1 + exp(-a))``, as the reference);
   * Sinkhorn: :func:`jaxkern.mhc._sinkhorn_kernel.forward` (the ``sinkhorn_normalize`` kernel's own code);

   ``post`` and ``comb`` are stored as one ``(T, 32)`` row ``[pre | post | comb | 0…]`` (split by XLA), ``pre``
   also into SMEM; then for each of the 32 tokens the pre mix is applied to the residual row exactly as the
   ``pre_apply_mix`` kernel does (:mod:`jaxkern.mhc._stream_kernels`: ``(8, 128)`` tiles GMEM -> registers,
   ``acc = pre[0]·x[0]``, ``acc = acc + pre[m]·x[m]``, one bf16 rounding).

Bit-identity: every float operation is the one the unfused chain runs with the kernels (``pre_norm_fn`` GEMM
kernel + XLA sum/normalisation, ``pre_split_mixes`` XLA, ``sinkhorn_normalize`` kernel, ``pre_apply_mix``
kernel), in the same order. On a CPU (interpret mode) both sides are XLA:CPU code and the tests check
equality. On a GPU the normalisation and the sigmoid are lowered by Mosaic GPU here but by XLA in the unfused
chain (``rsqrt``, ``/``, ``exp``): whether both lowerings give the same bits is checked on the GPU by
``tests/mhc/test_fused.py::test_pre_big_fuse_gpu_bit_exact`` (not verifiable on a CPU).

Traffic: the residual is still read twice from HBM (by the GEMM and by the apply loop), so this cannot reach
80% of copy bandwidth by the spec's byte count (at most ~55% at ``T = 8192``, ``H = 7168``); see the
``jaxkern.mhc._fused`` module docstring for what a single-pass kernel needs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import row_layout
from jaxkern.mhc import _sinkhorn_kernel as skn
from jaxkern.mhc import _stream_kernels as sk

TB = 32  # tokens per CTA
W = 32  # packed row width (float32)
LAY, _ROWS = row_layout(W, 4, max_lanes=4)
assert _ROWS == TB
M = 4
J = M * (M + 2)


def unsupported(h: int) -> str | None:
  return sk.unsupported_hidden(h)


def _scalars(tile, n):
  """The first ``n`` columns of a ``(TB, W)`` tile as per-token ``(TB,)`` vectors (exact masked sums)."""
  cols = plgpu.broadcasted_iota(jnp.int32, (TB, W), 1, layout=LAY)
  return [jnp.sum(jnp.where(cols == c, tile, 0.0), axis=1) for c in range(n)]


def _join(vals):
  """Per-token ``(TB,)`` vectors -> a ``(TB, W)`` tile with ``vals[c]`` in column ``c`` (zeros after)."""
  cols = plgpu.broadcasted_iota(jnp.int32, (TB, W), 1, layout=LAY)
  out = jnp.zeros((TB, W), jnp.float32)
  for c, v in enumerate(vals):
    out = jnp.where(cols == c, v[:, None], out)
  return out


def _sigmoid(z):
  return 1 / (1 + jnp.exp(-z))  # jaxkern.reference.mhc._sigmoid


def h_splits(t: int, h: int, sms: int) -> int:
  """``HS``: CTAs per token block, each applying every ``HS``-th ``(8, 128)`` tile of the hidden row, so that
  the grid has about 4 CTAs per SM (the apply loop keeps few loads in flight per CTA)."""
  return max(1, min(len(sk.tiles(h)), -(-4 * sms // -(-t // TB))))


@functools.partial(jax.jit, static_argnames=("k", "rms_eps", "pre_eps", "post_mult", "sinkhorn_eps", "repeat",
                                             "hs", "interpret"))
def epilogue_kernel(parts, params, x, *, k, rms_eps, pre_eps, post_mult, sinkhorn_eps, repeat, hs=1,
                    interpret=None):
  """``parts (S, T, 32)`` float32 ``[out_mul_s | sqrsum_s | 0]``, ``params (32,)`` float32
  ``[base (24) | scale (3) | 0]``, ``x (T, M, H)`` bf16 (``T >= 32``) -> ``small (T, 32)`` float32
  ``[pre | post | comb (row-major) | 0]`` and ``layer_input (T, H)`` bf16."""
  s, t, _ = parts.shape
  _, mm, h = x.shape
  r = h // sk.COLS
  grid = -(-t // TB)
  f32 = jnp.float32
  rms_eps, pre_eps, post_mult, sinkhorn_eps = (float(np.float32(v)) for v in (rms_eps, pre_eps, post_mult,
                                                                               sinkhorn_eps))

  @functools.partial(
      plgpu.kernel,
      out_type=(jax.ShapeDtypeStruct((t, W), f32), jax.ShapeDtypeStruct((t, r, sk.COLS), x.dtype)),
      grid=(grid, hs), grid_names=("i", "c"),
      scratch_types=(plgpu.SMEM((TB, W), f32),),
      interpret=interpret)
  def kernel(p_g, prm_g, x_g, small_g, o_g, pre_s):
    t0 = jnp.minimum(lax.axis_index("i") * TB, t - TB)
    rows = pl.ds(t0, TB)
    vals = _scalars(plgpu.load(p_g.at[0, rows], layout=LAY, optimized=False), J + 1)
    om, sq = vals[:J], vals[J]
    for i in range(1, s):  # fixed split order, as pre_norm_fn's XLA sum
      v = _scalars(plgpu.load(p_g.at[i, rows], layout=LAY, optimized=False), J + 1)
      om = [a + b for a, b in zip(om, v[:J])]
      sq = sq + v[J]
    rho = lax.rsqrt(sq / k + f32(rms_eps))
    z = [o * rho for o in om]
    base = [prm_g[j] for j in range(J)]
    scale = [prm_g[J + g] for g in range(3)]
    # XLA on a GPU rounds z·scale before adding base (pre_split_mixes is XLA code), Mosaic GPU would contract
    # the two into an FMA: the select keeps the product a separate, rounded value (XLA on CPU, which runs the
    # kernel body in interpret mode, contracts like the unfused XLA code, so nothing is needed there)
    prod = [z[j] * scale[min(2, j // mm)] for j in range(J)]
    if not interpret:
      prod = [jnp.where(p == p, p, jnp.float32(0)) for p in prod]  # (not foldable into p)
    a = [p + base[j] for j, p in enumerate(prod)]
    pre = [_sigmoid(v) + pre_eps for v in a[:mm]]
    post = [_sigmoid(v) * post_mult for v in a[mm:2 * mm]]
    comb = skn.forward([a[2 * mm + q * mm:2 * mm + (q + 1) * mm] for q in range(mm)], repeat, sinkhorn_eps)
    c = lax.axis_index("c")

    @pl.when(c == 0)
    def _():
      small_g[rows] = _join(pre + post + [v for row in comb for v in row])

    pre_s[...] = _join(pre)
    plgpu.commit_smem()

    def token(jj, carry):
      i = t0 + jj
      w = [pre_s[jj, q] for q in range(mm)]
      for n, (r0, _) in enumerate(sk.tiles(h)):
        @pl.when(c == n % hs)
        def _():
          xs = [sk._load(x_g.at[i, q, sk._rows(r0)]) for q in range(mm)]
          acc = w[0] * xs[0]
          for q in range(1, mm):
            acc = acc + w[q] * xs[q]
          o_g[i, sk._rows(r0)] = acc.astype(o_g.dtype)
      return carry

    lax.fori_loop(0, TB, token, 0)

  small, out = kernel(parts, params, x.reshape(t, mm, r, sk.COLS))
  return small, out.reshape(t, h)

