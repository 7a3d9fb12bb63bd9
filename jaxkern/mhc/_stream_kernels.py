"""Mosaic GPU kernels of the memory-bound mHC stream ops: expand (§4.1), pre_apply_mix (§4.6), post (§4.7),
forward and backward.

Data layout: a hidden row of ``H`` bf16 values is viewed as ``(H/128, 128)`` (free reshape of the GMEM
array), and each token's row is processed in tiles of ``(8, 128)`` = 1024 values in the register layout
:func:`jaxkern._layouts.row_layout` ``(128, 2)``: each thread holds one 16-byte vector (8 values), 16 lanes
cover a 256-byte row, a warp two consecutive rows, the warpgroup 8 rows = 2 KiB contiguous. Loads and
stores go GMEM <-> registers directly (no SMEM, no TMA); the many CTAs per SM keep enough loads in flight.
When ``H/128`` is not a multiple of 8 the last tile starts at row ``H/128 - 8`` and overlaps the previous
one: element-wise outputs are written twice with identical values, reductions mask the overlapping rows.

Per-token reductions over ``H`` (the backward's mix / comb / post gradients) are a row sum of each tile
(in-thread vector sum + 4 lane shuffles) accumulated across tiles as an ``(8,)`` vector, then one
warpgroup reduction per output scalar and token.

Each CTA takes ``tokens_per_cta`` consecutive tokens in a loop; the last CTA's token range is clamped to
``T``, so it recomputes a few tokens of its neighbour (identical values), and no masking is needed.

All arithmetic is float32 with one rounding at the store. Summation orders (also the contract for fused
kernels that must be bit-identical to these, e.g. ``pre_big_fuse`` / ``multilayer_recompute``):

* ``pre_apply_mix``: ``acc = mix[0]·x[0]``, then ``acc = acc + mix[m]·x[m]`` for ``m = 1..M-1``;
* ``post``: ``acc = post[n]·x``, then ``acc = acc + comb[m, n]·residual[m]`` for ``m = 0..M-1``;
* backward: ``d_residual[m] = Σ_n comb[m, n]·dO[n]``, ``d_x = Σ_n post[n]·dO[n]`` (``n`` in order, starting
  from the ``n = 0`` product), ``x_grad[m] = acc[m] + mix[m]·og`` with the accumulator when given;
* expand backward: ``g[0] + g[1] + ... + g[M-1]``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import row_layout

COLS = 128  # a view row: 128 bf16 = 256 bytes
TILE_ROWS = 8  # view rows of one register tile (row_layout(128, 2) covers 8 rows once)
MIN_HIDDEN = COLS * TILE_ROWS
LAYOUT, _UNIT = row_layout(COLS, 2)
assert _UNIT == TILE_ROWS
VEC = LAYOUT.reduce(1)
DEFAULT_TOKENS_PER_CTA = 2


def unsupported_hidden(h: int) -> str | None:
  if h % COLS or h < MIN_HIDDEN:
    return f"hidden size {h} is not a multiple of {COLS} of at least {MIN_HIDDEN}"
  return None


def tiles(h: int):
  """Static ``(first_row, overlap)`` of each ``(8, 128)`` tile of a row of ``h`` values (``h/128 >= 8``);
  ``overlap`` rows at the top of a tile were already covered by the previous tile."""
  r = h // COLS
  out = [(s, 0) for s in range(0, r - TILE_ROWS + 1, TILE_ROWS)]
  if r % TILE_ROWS:
    out.append((r - TILE_ROWS, TILE_ROWS - r % TILE_ROWS))
  return out


def _f32(a):
  return a.astype(jnp.float32)


def _load(ref):
  return _f32(plgpu.load(ref, layout=LAYOUT, optimized=False))


def _row_sums(v, overlap):
  """``(8,)`` row sums of an ``(8, 128)`` tile, rows ``< overlap`` zeroed."""
  if overlap:
    rows = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, COLS), 0, layout=LAYOUT)
    v = jnp.where(rows >= overlap, v, 0.0)
  return jnp.sum(v, axis=1)


def _grid(t, tokens_per_cta):
  bt = max(1, min(tokens_per_cta, t))
  return bt, pl.cdiv(t, bt)


def _token_loop(t, bt, body):
  """Runs ``body(token)`` for the CTA's ``bt`` tokens (the last CTA's range clamped to end at ``t``)."""
  t0 = jnp.minimum(lax.axis_index("i") * bt, t - bt)
  if bt == 1:
    body(t0)
  else:
    lax.fori_loop(0, bt, lambda j, c: (body(t0 + j), c)[1], 0)


def _rows(r0):
  return pl.ds(r0, TILE_ROWS)


# ----------------------------------------------------------------------------------------------
# expand

@functools.partial(jax.jit, static_argnames=("mhc_mult", "tokens_per_cta", "interpret"))
def expand_fwd_kernel(x, *, mhc_mult, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """``x (T, H)`` bf16 (``T >= 1``) -> ``(T, M, H)``."""
  t, h = x.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, mhc_mult, r, COLS), x.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, o_g):
    def token(i):
      for r0, _ in tiles(h):
        v = plgpu.load(x_g.at[i, _rows(r0)], layout=LAYOUT, optimized=False)
        for m in range(mhc_mult):
          o_g[i, m, _rows(r0)] = v
    _token_loop(t, bt, token)

  return kernel(x.reshape(t, r, COLS)).reshape(t, mhc_mult, h)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def expand_bwd_kernel(g, *, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """``g (T, M, H)`` bf16 -> ``(T, H)``: the float32 stream sum, rounded once."""
  t, mm, h = g.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, r, COLS), g.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(g_g, o_g):
    def token(i):
      for r0, _ in tiles(h):
        vs = [_load(g_g.at[i, m, _rows(r0)]) for m in range(mm)]
        acc = vs[0]
        for v in vs[1:]:
          acc = acc + v
        o_g[i, _rows(r0)] = acc.astype(o_g.dtype)
    _token_loop(t, bt, token)

  return kernel(g.reshape(t, mm, r, COLS)).reshape(t, h)


# ----------------------------------------------------------------------------------------------
# pre_apply_mix

@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_fwd_kernel(x, mix, *, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """``x (T, M, H)`` bf16, ``mix (T, M)`` float32 -> ``(T, H)`` bf16."""
  t, mm, h = x.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, r, COLS), x.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, mix_g, o_g):
    def token(i):
      w = [mix_g[i, m] for m in range(mm)]
      for r0, _ in tiles(h):
        xs = [_load(x_g.at[i, m, _rows(r0)]) for m in range(mm)]
        acc = w[0] * xs[0]
        for m in range(1, mm):
          acc = acc + w[m] * xs[m]
        o_g[i, _rows(r0)] = acc.astype(o_g.dtype)
    _token_loop(t, bt, token)

  return kernel(x.reshape(t, mm, r, COLS), mix).reshape(t, h)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_bwd_kernel(og, x, mix, x_grad_acc, *, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """``og (T, H)``, ``x (T, M, H)`` bf16, ``mix (T, M)`` float32, ``x_grad_acc (T, M, H)`` bf16 or None ->
  ``(x_grad (T, M, H) bf16, mix_grad (T, M) float32)``."""
  t, mm, h = x.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS
  out_type = (jax.ShapeDtypeStruct((t, mm, r, COLS), x.dtype), jax.ShapeDtypeStruct((t, mm), jnp.float32))
  has_acc = x_grad_acc is not None

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(*refs):
    if has_acc:
      og_g, x_g, mix_g, acc_g, xg_g, mg_g = refs
    else:
      og_g, x_g, mix_g, xg_g, mg_g = refs

    def token(i):
      w = [mix_g[i, m] for m in range(mm)]
      parts = [None] * mm
      for r0, overlap in tiles(h):
        o = _load(og_g.at[i, _rows(r0)])
        for m in range(mm):
          xm = _load(x_g.at[i, m, _rows(r0)])
          d = w[m] * o
          if has_acc:
            d = _load(acc_g.at[i, m, _rows(r0)]) + d
          xg_g[i, m, _rows(r0)] = d.astype(xg_g.dtype)
          s = _row_sums(o * xm, overlap)
          parts[m] = s if parts[m] is None else parts[m] + s
      for m in range(mm):
        mg_g[i, m] = jnp.sum(parts[m])
    _token_loop(t, bt, token)

  args = (og.reshape(t, r, COLS), x.reshape(t, mm, r, COLS), mix)
  if has_acc:
    args += (x_grad_acc.reshape(t, mm, r, COLS),)
  xg, mg = kernel(*args)
  return xg.reshape(t, mm, h), mg


# ----------------------------------------------------------------------------------------------
# post

@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def post_fwd_kernel(x, residual, post, comb, *, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """``x (T, H)``, ``residual (T, M, H)`` bf16, ``post (T, M)``, ``comb (T, M, M)`` float32 -> ``(T, M, H)``."""
  t, mm, h = residual.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, mm, r, COLS), residual.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, res_g, post_g, comb_g, o_g):
    def token(i):
      p = [post_g[i, n] for n in range(mm)]
      c = [[comb_g[i, m, n] for n in range(mm)] for m in range(mm)]
      for r0, _ in tiles(h):
        xv = _load(x_g.at[i, _rows(r0)])
        rv = [_load(res_g.at[i, m, _rows(r0)]) for m in range(mm)]
        for n in range(mm):
          acc = p[n] * xv
          for m in range(mm):
            acc = acc + c[m][n] * rv[m]
          o_g[i, n, _rows(r0)] = acc.astype(o_g.dtype)
    _token_loop(t, bt, token)

  return kernel(x.reshape(t, r, COLS), residual.reshape(t, mm, r, COLS), post, comb).reshape(t, mm, h)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def post_bwd_kernel(d_o, x, residual, post, comb, *, tokens_per_cta=DEFAULT_TOKENS_PER_CTA, interpret=None):
  """-> ``(d_x (T, H), d_residual (T, M, H)`` bf16, ``d_post (T, M)``, ``d_comb (T, M, M)`` float32).

  ``d_o`` in another dtype than ``residual`` (a float32 cotangent) is rounded to ``residual``'s dtype value by
  value in registers (the same numbers as an XLA cast before the kernel, without its extra pass over ``dO``)."""
  t, mm, h = residual.shape
  bt, grid = _grid(t, tokens_per_cta)
  r = h // COLS
  out_type = (jax.ShapeDtypeStruct((t, r, COLS), x.dtype), jax.ShapeDtypeStruct((t, mm, r, COLS), residual.dtype),
              jax.ShapeDtypeStruct((t, mm), jnp.float32), jax.ShapeDtypeStruct((t, mm, mm), jnp.float32))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(do_g, x_g, res_g, post_g, comb_g, dx_g, dr_g, dp_g, dc_g):
    def token(i):
      p = [post_g[i, n] for n in range(mm)]
      c = [[comb_g[i, m, n] for n in range(mm)] for m in range(mm)]
      dp = [None] * mm
      dc = [[None] * mm for _ in range(mm)]

      def add(a, b):
        return b if a is None else a + b

      for r0, overlap in tiles(h):
        dv = [_f32(plgpu.load(do_g.at[i, n, _rows(r0)], layout=LAYOUT, optimized=False).astype(residual.dtype))
              for n in range(mm)]
        xv = _load(x_g.at[i, _rows(r0)])
        dx = p[0] * dv[0]
        for n in range(1, mm):
          dx = dx + p[n] * dv[n]
        dx_g[i, _rows(r0)] = dx.astype(dx_g.dtype)
        for n in range(mm):
          dp[n] = add(dp[n], _row_sums(xv * dv[n], overlap))
        for m in range(mm):
          rm = _load(res_g.at[i, m, _rows(r0)])
          acc = c[m][0] * dv[0]
          for n in range(1, mm):
            acc = acc + c[m][n] * dv[n]
          dr_g[i, m, _rows(r0)] = acc.astype(dr_g.dtype)
          for n in range(mm):
            dc[m][n] = add(dc[m][n], _row_sums(rm * dv[n], overlap))
      for n in range(mm):
        dp_g[i, n] = jnp.sum(dp[n])
        for m in range(mm):
          dc_g[i, m, n] = jnp.sum(dc[m][n])
    _token_loop(t, bt, token)

  dx, dr, dp, dc = kernel(d_o.reshape(t, mm, r, COLS), x.reshape(t, r, COLS), residual.reshape(t, mm, r, COLS),
                          post, comb)
  return dx.reshape(t, h), dr.reshape(t, mm, h), dp, dc


# ----------------------------------------------------------------------------------------------
# Whole-row kernels (second version, issue 20 performance): the reduce-over-M stream ops with one register tile
# per stream covering whole hidden rows of ``rows`` consecutive tokens.
#
# Layout ``row_layout(H, 2)``: a warp's lanes cover consecutive 16-byte vectors of a row (a 512-byte contiguous
# span per access), a row of H values repeats over ``H / 8 / (lanes · warps on the row)`` registers, and the
# warpgroup covers ``rows`` = 4 / 2 / 1 tokens for H = 1280 / 2560 / 4096 and 7168. Compared with the ``(8, 128)``
# tiles above: (a) each thread issues all of its row's vectors of all M streams before it needs any (H = 7168:
# 7 x 16 bytes per stream, 28 loads in flight per thread instead of 4), (b) no overlapping tiles when ``H/128``
# is not a multiple of 8 (H = 1280: the first version read and wrote 16 rows of 128 for 10, +60%), (c) one
# warpgroup reduction per tile and output scalar for all its tokens. The token loop's last tile is clamped to
# end at ``T`` (it recomputes identical values of its neighbour). The per-token mix is a ``(rows,)`` vector
# (layout ``reduce(1)``, loaded from the ``(T, M)`` mix with stride M) broadcast along the row. The arithmetic and summation orders are those of the first
# version (module docstring), so the element-wise outputs are the same bits; ``mix_grad`` sums in another order
# (its float32 reduction tree differs: ~1e-7 relative). `use_rows` picks them; `_JAXKERN_MHC_STREAM_V1=1` (private,
# timing scripts) keeps the first version.

MAX_ROW_REGS = 8  # 16-byte vectors per thread and stream row; wider rows keep the (8, 128) tiles


def whole_rows(h: int):
  """``(layout, rows)`` of the whole-row kernels for hidden size ``h``, or None where they do not apply."""
  if h % 8:
    return None
  lay, rows = row_layout(h, 2)
  threads_on_row = 128 // rows
  if (h // 8) % threads_on_row or (h // 8) // threads_on_row > MAX_ROW_REGS:
    return None
  return lay, rows


STREAM_V1_ENV = "_JAXKERN_MHC_STREAM_V1"  # private, for timing scripts: "1" keeps the (8, 128)-tile kernels


def use_rows(h: int, t: int) -> bool:
  """Whether the reduce-over-M ops run the whole-row kernels for ``t`` tokens of hidden size ``h``."""
  wr = whole_rows(h)
  return wr is not None and t >= wr[1] and not os.environ.get(STREAM_V1_ENV)


def _row_grid(t, rows, tokens_per_cta):
  tiles = pl.cdiv(t, rows)
  per = max(1, min(tokens_per_cta // rows, tiles))
  return per, pl.cdiv(tiles, per)


def _tile_loop(t, rows, per, body):
  """Runs ``body(t0)`` for the CTA's ``per`` tiles of ``rows`` tokens starting at ``t0`` (clamped to ``t - rows``)."""
  base = lax.axis_index("i") * per
  def one(j):
    body(jnp.minimum((base + j) * rows, t - rows))
  if per == 1:
    one(0)
  else:
    lax.fori_loop(0, per, lambda j, c: (one(j), c)[1], 0)


def _bcast(v, rows, h):
  return lax.broadcast_in_dim(v, (rows, h), (0,))


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_fwd_rows_kernel(x, mix, *, tokens_per_cta=2, interpret=None):
  """``x (T, M, H)`` bf16 (``T >= rows``), ``mix (T, M)`` float32 -> ``(T, H)`` bf16."""
  t, mm, h = x.shape
  lay, rows = whole_rows(h)
  per, grid = _row_grid(t, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, h), x.dtype), grid=(grid,), grid_names=("i",),
                     interpret=interpret)
  def kernel(x_g, mix_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)
      xs = [_f32(plgpu.load(x_g.at[tok, m], layout=lay, optimized=False)) for m in range(mm)]
      w = [_bcast(plgpu.load(mix_g.at[tok, m], layout=lay.reduce(1), optimized=False), rows, h) for m in range(mm)]
      acc = w[0] * xs[0]
      for m in range(1, mm):
        acc = acc + w[m] * xs[m]
      o_g[tok] = acc.astype(o_g.dtype)
    _tile_loop(t, rows, per, tile)

  return kernel(x, mix)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_bwd_rows_kernel(og, x, mix, x_grad_acc, *, tokens_per_cta=2, interpret=None):
  """``og (T, H)``, ``x (T, M, H)`` bf16, ``mix (T, M)`` float32, ``x_grad_acc (T, M, H)`` bf16 or None ->
  ``(x_grad (T, M, H) bf16, mix_grad (T, M) float32)``."""
  t, mm, h = x.shape
  lay, rows = whole_rows(h)
  per, grid = _row_grid(t, rows, tokens_per_cta)
  out_type = (jax.ShapeDtypeStruct((t, mm, h), x.dtype), jax.ShapeDtypeStruct((t, mm), jnp.float32))
  has_acc = x_grad_acc is not None

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(*refs):
    if has_acc:
      og_g, x_g, mix_g, acc_g, xg_g, mg_g = refs
    else:
      og_g, x_g, mix_g, xg_g, mg_g = refs

    def tile(t0):
      tok = pl.ds(t0, rows)
      o = _f32(plgpu.load(og_g.at[tok], layout=lay, optimized=False))
      for m in range(mm):  # stream by stream: fewer live registers for H = 7168 (7 vectors per thread and row)
        xm = _f32(plgpu.load(x_g.at[tok, m], layout=lay, optimized=False))
        d = _bcast(plgpu.load(mix_g.at[tok, m], layout=lay.reduce(1), optimized=False), rows, h) * o
        if has_acc:
          d = _f32(plgpu.load(acc_g.at[tok, m], layout=lay, optimized=False)) + d
        xg_g[tok, m] = d.astype(xg_g.dtype)
        mg_g[tok, m] = jnp.sum(o * xm, axis=1)
    _tile_loop(t, rows, per, tile)

  args = (og, x, mix) + ((x_grad_acc,) if has_acc else ())
  return kernel(*args)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def expand_bwd_rows_kernel(g, *, tokens_per_cta=2, interpret=None):
  """``g (T, M, H)`` bf16 (``T >= rows``) -> ``(T, H)``: the float32 stream sum, rounded once."""
  t, mm, h = g.shape
  lay, rows = whole_rows(h)
  per, grid = _row_grid(t, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, h), g.dtype), grid=(grid,), grid_names=("i",),
                     interpret=interpret)
  def kernel(g_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)
      vs = [_f32(plgpu.load(g_g.at[tok, m], layout=lay, optimized=False)) for m in range(mm)]
      acc = vs[0]
      for v in vs[1:]:
        acc = acc + v
      o_g[tok] = acc.astype(o_g.dtype)
    _tile_loop(t, rows, per, tile)

  return kernel(g)
