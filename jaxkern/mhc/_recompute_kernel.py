"""Mosaic GPU kernel of ``multilayer_recompute`` (engram_mhc.md §4.10): every layer's ``pre_apply_mix`` and
``post`` in one pass that keeps the running residual on chip.

Each CTA takes ``tokens_per_cta`` tokens (the stream kernels' token loop) and walks a token's hidden row in
``(8, 128)`` register tiles (:mod:`jaxkern.mhc._stream_kernels`). For one tile it loads ``R_0``'s ``M`` stream
tiles once, then for every layer ``i``: ``layer_input[i] = Σ_m pre_i[m]·R_i[m]`` (stored), and for ``i < Lp``
``R_{i+1}[n] = post_i[n]·x_i + Σ_m comb_i[m, n]·R_i[m]`` rounded to bf16 (stored, and kept in registers as the
next layer's residual). HBM traffic is upstream's ``io_fused`` (spec §6.4) instead of re-reading every ``R_i``
twice. The per-layer mixes are read per tile as scalars (they stay in L1).

Arithmetic and summation order are those of the stream kernels (their module docstring states the contract),
so the result is bit-identical to calling the ``pre_apply_mix`` and ``post`` kernels layer by layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern.mhc import _stream_kernels as sk


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def recompute_kernel(residual, pres, outs, posts, combs, *, tokens_per_cta=sk.DEFAULT_TOKENS_PER_CTA,
                     interpret=None):
  """``residual (T, M, H)`` bf16; ``pres``: ``L`` arrays ``(T, M)`` float32; ``outs``: ``Lp`` arrays ``(T, H)``
  bf16; ``posts``: ``Lp`` arrays ``(T, M)``, ``combs``: ``Lp`` arrays ``(T, M, M)`` float32 (``T >= 1``,
  ``Lp <= L``) -> ``(layer inputs: L arrays (T, H), residuals R_1..R_Lp: Lp arrays (T, M, H))`` bf16."""
  t, mm, h = residual.shape
  num_layers, num_post = len(pres), len(outs)
  bt, grid = sk._grid(t, tokens_per_cta)
  r = h // sk.COLS
  dtype = residual.dtype
  out_type = ((jax.ShapeDtypeStruct((t, r, sk.COLS), dtype),) * num_layers
              + (jax.ShapeDtypeStruct((t, mm, r, sk.COLS), dtype),) * num_post)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(*refs):
    res_g, refs = refs[0], refs[1:]
    pre_g, refs = refs[:num_layers], refs[num_layers:]
    out_g, post_g, comb_g, refs = (refs[:num_post], refs[num_post:2 * num_post], refs[2 * num_post:3 * num_post],
                                   refs[3 * num_post:])
    inp_o, res_o = refs[:num_layers], refs[num_layers:]

    def token(i):
      for r0, _ in sk.tiles(h):
        rows = sk._rows(r0)
        rv = [sk._load(res_g.at[i, m, rows]) for m in range(mm)]
        for layer in range(num_layers):
          w = [pre_g[layer][i, m] for m in range(mm)]
          acc = w[0] * rv[0]
          for m in range(1, mm):
            acc = acc + w[m] * rv[m]
          inp_o[layer][i, rows] = acc.astype(dtype)
          if layer < num_post:
            p = [post_g[layer][i, n] for n in range(mm)]
            c = [[comb_g[layer][i, m, n] for n in range(mm)] for m in range(mm)]
            xv = sk._load(out_g[layer].at[i, rows])
            new = []
            for n in range(mm):
              acc = p[n] * xv
              for m in range(mm):
                acc = acc + c[m][n] * rv[m]
              rounded = acc.astype(dtype)
              res_o[layer][i, n, rows] = rounded
              new.append(rounded.astype(jnp.float32))
            rv = new
    sk._token_loop(t, bt, token)

  got = kernel(residual.reshape(t, mm, r, sk.COLS), *pres, *(o.reshape(t, r, sk.COLS) for o in outs), *posts, *combs)
  inputs = tuple(a.reshape(t, h) for a in got[:num_layers])
  residuals = tuple(a.reshape(t, mm, h) for a in got[num_layers:])
  return inputs, residuals
