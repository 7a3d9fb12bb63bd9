"""Mosaic GPU kernels of the memory-bound mHC stream ops: expand, pre_apply_mix, post,
forward and backward, for every hidden size ``H``: the ``(8, 128)``-tile kernels (first version, below) where
``H`` is a multiple of 128 of at least 1024, the row kernels (second version, further below) for every ``H``.

Data layout of the first version: a hidden row of ``H`` bf16 values is viewed as ``(H/128, 128)`` (free reshape of the GMEM
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
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import row_layout

COLS = 128  # a view row: 128 bf16 = 256 bytes
TILE_ROWS = 8  # view rows of one register tile (row_layout(128, 2) covers 8 rows once)
LAYOUT, _UNIT = row_layout(COLS, 2)
assert _UNIT == TILE_ROWS
VEC = LAYOUT.reduce(1)
DEFAULT_TOKENS_PER_CTA = 2


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
# Row kernels (second version): one register tile per stream covering ``rows`` consecutive tokens and a chunk of
# ``C`` hidden columns (``C = H`` where the whole row fits, "whole-row"), for every hidden size ``H``.
#
# Layout ``row_layout(C, 2)``: a warp's lanes cover consecutive 16-byte vectors of a row (up to a 512-byte
# contiguous span per access), a row of C values repeats over ``C / 8 / (lanes · warps on the row)`` registers,
# and the warpgroup covers ``rows`` tokens: 4 / 2 / 1 for H = 1280 / 2560 / 4096 and 7168 (whole rows), 16 for
# H = 64, 192, 320, and 576 (three chunks of 192). `row_plan` picks ``C``: the divisor of ``H`` that puts the most
# threads on a row (the widest contiguous accesses), then the widest such divisor with at most ``max_regs``
# vectors per thread and stream; ``H`` not a multiple of 8 takes 8-, 4- or 2-byte vectors. A tile walks its
# chunks in order (unrolled up to `MAX_UNROLLED_CHUNKS`, else a loop). Compared with the ``(8, 128)`` tiles
# above: (a) each thread issues all of its row's vectors of all M streams before it needs any (H = 7168:
# 7 x 16 bytes per stream, 28 loads in flight per thread instead of 4), (b) no overlapping tiles when ``H/128``
# is not a multiple of 8 (H = 1280: the first version read and wrote 16 rows of 128 for 10, +60%), (c) one
# warpgroup reduction per tile, chunk and output scalar for all its tokens, (d) any ``H`` (the tiles need a
# multiple of 128 of at least 1024). The token loop's last tile is clamped to end at ``T`` (it recomputes
# identical values of its neighbour); fewer than ``rows`` tokens are padded with zeros to one tile (outside the
# kernel) and the outputs cut back. The per-token mixes are ``(rows,)`` vectors (layout ``reduce(1)``, loaded
# from the ``(T, M)`` / ``(T, M, M)`` mixes with their strides) broadcast along the row. The arithmetic and
# summation orders are those of the first version (module docstring), so the element-wise outputs are the same
# bits; the per-token reductions (``mix_grad``, ``post``'s mix gradients) sum in another order (their float32
# reduction trees differ: ~1e-7 relative). `use_rows` picks them for the reduce-over-M ops (`tiles_fit` for
# expand's forward and ``post``); `_JAXKERN_MHC_STREAM_V1=1` (private, timing scripts) keeps the first version
# where it applies.

MAX_ROW_REGS = 8  # 16-byte vectors per thread and stream row (the reduce-over-M ops; H = 7168 takes 7)
# ``post`` keeps more streams live (forward: x and M residual rows; backward: M cotangent rows, x, a residual
# row and the M(M+1) partial sums), so its chunks hold fewer vectors. H200, 2026-11-29, T=8192 H=576, CUPTI cold L2:
# forward 24.7 µs with 2 vectors (chunks of 64) against 26.9 with 4 (chunks of 192), XLA 29.8; backward 40.6 with 2
# against 43.5 with 8, XLA 99.3.
POST_FWD_MAX_REGS = 2
POST_BWD_MAX_REGS = 2
MAX_UNROLLED_CHUNKS = 8  # more chunks per row (H with few small divisors, e.g. 1000 = 25 x 40) run as a loop


class RowPlan(NamedTuple):
  """The row kernels' tiling of a hidden row: ``rows`` tokens x ``chunk`` columns per register tile."""

  layout: Any
  rows: int
  chunk: int


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


@functools.cache
def row_plan(h: int, max_regs: int = MAX_ROW_REGS) -> RowPlan:
  """The row kernels' tile for hidden size ``h >= 1`` (module comment above ``MAX_ROW_REGS``)."""
  best = None
  for c in _divisors(h):
    lay, rows = row_layout(c, 2)
    threads_on_row = 128 // rows
    if c // math.gcd(8, c) // threads_on_row <= max_regs:
      key = (threads_on_row, c)
      if best is None or key > best[0]:
        best = (key, RowPlan(lay, rows, c))
  return best[1]


def tiles_fit(h: int) -> bool:
  """Whether the ``(8, 128)``-tile kernels (first version) take hidden size ``h``."""
  return h % COLS == 0 and h >= COLS * TILE_ROWS


STREAM_V1_ENV = "_JAXKERN_MHC_STREAM_V1"  # private, for timing scripts: "1" keeps the (8, 128)-tile kernels


def use_rows(h: int, t: int) -> bool:
  """Whether the reduce-over-M ops run the row kernels for ``t`` tokens of hidden size ``h``: always where the
  ``(8, 128)`` tiles do not fit, else where whole rows fit one tile and ``t`` fills one."""
  if not tiles_fit(h):
    return True
  plan = row_plan(h)
  return plan.chunk == h and t >= plan.rows and not os.environ.get(STREAM_V1_ENV)


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


def _over_chunks(n, step):
  """Runs ``step(j)`` for the row's ``n`` chunks in order and returns the chunk-by-chunk sums of its results
  (tuples of per-token float32 vectors; ``()`` for element-wise kernels)."""
  acc = step(0)
  add = lambda a, b: tuple(x + y for x, y in zip(a, b))
  if n <= MAX_UNROLLED_CHUNKS:
    for j in range(1, n):
      acc = add(acc, step(j))
    return acc
  return lax.fori_loop(1, n, lambda j, a: add(a, step(j)), acc)


def _token_padded(kernel, t, rows, *args):
  """``kernel(*args)`` on ``(T, ...)`` arrays for ``T = t`` tokens; fewer than one tile of
  ``rows`` tokens are padded with zeros (the kernel is built for ``max(t, rows)`` tokens) and the outputs cut
  back to ``t``."""
  if t >= rows:
    return kernel(*args)
  pad = lambda a: jnp.pad(a, [(0, rows - t)] + [(0, 0)] * (a.ndim - 1))
  return jax.tree.map(lambda o: o[:t], kernel(*(pad(a) for a in args)))


def _bcast(v, rows, c):
  return lax.broadcast_in_dim(v, (rows, c), (0,))


def _mix(ref, lay, rows, c):
  """A per-token mix ``(rows,)`` (a strided GMEM view) broadcast to a ``(rows, c)`` tile."""
  return _bcast(plgpu.load(ref, layout=lay.reduce(1), optimized=False), rows, c)


def _cols(j, c):
  return pl.ds(j * c, c)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_fwd_rows_kernel(x, mix, *, tokens_per_cta=2, interpret=None):
  """``x (T, M, H)`` bf16, ``mix (T, M)`` float32 -> ``(T, H)`` bf16."""
  t, mm, h = x.shape
  lay, rows, c = row_plan(h)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((tp, h), x.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, mix_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)
      w = [_mix(mix_g.at[tok, m], lay, rows, c) for m in range(mm)]

      def step(j):
        cols = _cols(j, c)
        xs = [_f32(plgpu.load(x_g.at[tok, m, cols], layout=lay, optimized=False)) for m in range(mm)]
        acc = w[0] * xs[0]
        for m in range(1, mm):
          acc = acc + w[m] * xs[m]
        o_g[tok, cols] = acc.astype(o_g.dtype)
        return ()
      _over_chunks(h // c, step)
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, x, mix)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def apply_mix_bwd_rows_kernel(og, x, mix, x_grad_acc, *, tokens_per_cta=2, interpret=None):
  """``og (T, H)``, ``x (T, M, H)`` bf16, ``mix (T, M)`` float32, ``x_grad_acc (T, M, H)`` bf16 or None ->
  ``(x_grad (T, M, H) bf16, mix_grad (T, M) float32)``."""
  t, mm, h = x.shape
  lay, rows, c = row_plan(h)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)
  out_type = (jax.ShapeDtypeStruct((tp, mm, h), x.dtype), jax.ShapeDtypeStruct((tp, mm), jnp.float32))
  has_acc = x_grad_acc is not None

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(*refs):
    if has_acc:
      og_g, x_g, mix_g, acc_g, xg_g, mg_g = refs
    else:
      og_g, x_g, mix_g, xg_g, mg_g = refs

    def tile(t0):
      tok = pl.ds(t0, rows)
      w = [_mix(mix_g.at[tok, m], lay, rows, c) for m in range(mm)]

      def step(j):
        cols = _cols(j, c)
        o = _f32(plgpu.load(og_g.at[tok, cols], layout=lay, optimized=False))
        sums = []
        for m in range(mm):  # stream by stream: fewer live registers for H = 7168 (7 vectors per thread and row)
          xm = _f32(plgpu.load(x_g.at[tok, m, cols], layout=lay, optimized=False))
          d = w[m] * o
          if has_acc:
            d = _f32(plgpu.load(acc_g.at[tok, m, cols], layout=lay, optimized=False)) + d
          xg_g[tok, m, cols] = d.astype(xg_g.dtype)
          sums.append(jnp.sum(o * xm, axis=1))
        return tuple(sums)
      sums = _over_chunks(h // c, step)
      for m in range(mm):
        mg_g[tok, m] = sums[m]
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, og, x, mix, *(() if x_grad_acc is None else (x_grad_acc,)))


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def expand_bwd_rows_kernel(g, *, tokens_per_cta=2, interpret=None):
  """``g (T, M, H)`` bf16 -> ``(T, H)``: the float32 stream sum, rounded once."""
  t, mm, h = g.shape
  lay, rows, c = row_plan(h)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((tp, h), g.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(g_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)

      def step(j):
        cols = _cols(j, c)
        vs = [_f32(plgpu.load(g_g.at[tok, m, cols], layout=lay, optimized=False)) for m in range(mm)]
        acc = vs[0]
        for v in vs[1:]:
          acc = acc + v
        o_g[tok, cols] = acc.astype(o_g.dtype)
        return ()
      _over_chunks(h // c, step)
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, g)


@functools.partial(jax.jit, static_argnames=("mhc_mult", "tokens_per_cta", "interpret"))
def expand_fwd_rows_kernel(x, *, mhc_mult, tokens_per_cta=2, interpret=None):
  """``x (T, H)`` bf16 -> ``(T, M, H)``: each row chunk loaded once and stored ``M`` times."""
  t, h = x.shape
  lay, rows, c = row_plan(h)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((tp, mhc_mult, h), x.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)

      def step(j):
        cols = _cols(j, c)
        v = plgpu.load(x_g.at[tok, cols], layout=lay, optimized=False)
        for m in range(mhc_mult):
          o_g[tok, m, cols] = v
        return ()
      _over_chunks(h // c, step)
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, x)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def post_fwd_rows_kernel(x, residual, post, comb, *, tokens_per_cta=2, interpret=None):
  """``x (T, H)``, ``residual (T, M, H)`` bf16, ``post (T, M)``, ``comb (T, M, M)`` float32 -> ``(T, M, H)``."""
  t, mm, h = residual.shape
  lay, rows, c = row_plan(h, POST_FWD_MAX_REGS)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((tp, mm, h), residual.dtype), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, res_g, post_g, comb_g, o_g):
    def tile(t0):
      tok = pl.ds(t0, rows)
      p = [_mix(post_g.at[tok, n], lay, rows, c) for n in range(mm)]
      cm = [[_mix(comb_g.at[tok, m, n], lay, rows, c) for n in range(mm)] for m in range(mm)]

      def step(j):
        cols = _cols(j, c)
        xv = _f32(plgpu.load(x_g.at[tok, cols], layout=lay, optimized=False))
        rv = [_f32(plgpu.load(res_g.at[tok, m, cols], layout=lay, optimized=False)) for m in range(mm)]
        for n in range(mm):
          acc = p[n] * xv
          for m in range(mm):
            acc = acc + cm[m][n] * rv[m]
          o_g[tok, n, cols] = acc.astype(o_g.dtype)
        return ()
      _over_chunks(h // c, step)
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, x, residual, post, comb)


@functools.partial(jax.jit, static_argnames=("tokens_per_cta", "interpret"))
def post_bwd_rows_kernel(d_o, x, residual, post, comb, *, tokens_per_cta=2, interpret=None):
  """As :func:`post_bwd_kernel` (``d_o`` in another dtype than ``residual`` is rounded to it in registers)."""
  t, mm, h = residual.shape
  lay, rows, c = row_plan(h, POST_BWD_MAX_REGS)
  tp = max(t, rows)
  per, grid = _row_grid(tp, rows, tokens_per_cta)
  out_type = (jax.ShapeDtypeStruct((tp, h), x.dtype), jax.ShapeDtypeStruct((tp, mm, h), residual.dtype),
              jax.ShapeDtypeStruct((tp, mm), jnp.float32), jax.ShapeDtypeStruct((tp, mm, mm), jnp.float32))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(grid,), grid_names=("i",), interpret=interpret)
  def kernel(do_g, x_g, res_g, post_g, comb_g, dx_g, dr_g, dp_g, dc_g):
    def tile(t0):
      tok = pl.ds(t0, rows)
      p = [_mix(post_g.at[tok, n], lay, rows, c) for n in range(mm)]
      cm = [[_mix(comb_g.at[tok, m, n], lay, rows, c) for n in range(mm)] for m in range(mm)]

      def step(j):
        cols = _cols(j, c)
        dv = [_f32(plgpu.load(do_g.at[tok, n, cols], layout=lay, optimized=False).astype(residual.dtype))
              for n in range(mm)]
        xv = _f32(plgpu.load(x_g.at[tok, cols], layout=lay, optimized=False))
        dx = p[0] * dv[0]
        for n in range(1, mm):
          dx = dx + p[n] * dv[n]
        dx_g[tok, cols] = dx.astype(dx_g.dtype)
        sums = [jnp.sum(xv * dv[n], axis=1) for n in range(mm)]
        for m in range(mm):
          rm = _f32(plgpu.load(res_g.at[tok, m, cols], layout=lay, optimized=False))
          acc = cm[m][0] * dv[0]
          for n in range(1, mm):
            acc = acc + cm[m][n] * dv[n]
          dr_g[tok, m, cols] = acc.astype(dr_g.dtype)
          sums += [jnp.sum(rm * dv[n], axis=1) for n in range(mm)]
        return tuple(sums)
      sums = _over_chunks(h // c, step)
      for n in range(mm):
        dp_g[tok, n] = sums[n]
        for m in range(mm):
          dc_g[tok, m, n] = sums[mm + m * mm + n]
    _tile_loop(tp, rows, per, tile)

  return _token_padded(kernel, t, rows, d_o, x, residual, post, comb)
