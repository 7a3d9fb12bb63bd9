"""Per-token casts to FP8 e4m3: one scale factor per row and group of ``num_per_channels`` columns.

Mosaic GPU kernel: each CTA (one warpgroup) owns 64 rows. Tiles of ``(64, 256)`` come in by TMA
(the box clips at the array edge, which zero-fills the partial last tile of a row), are loaded into
registers in the WGMMA layout (a row reduction gives each group's amax), quantised, written to SMEM
as e4m3 and stored by TMA (clipped at the edge). Groups of at most 128 columns never straddle a
tile, so the grid is ``(row blocks, column tiles)``; one scale per row (``num_per_channels == K``
with ``K > 256``) makes each CTA walk its rows twice: a TMA-pipelined amax pass (``emit_pipeline``,
up to 128 KiB of tiles in flight), then a quantisation pass that re-reads each tile.

Exact numerics (quant.md §3.3/§4.8): ``sf = a / 448``, ``sf_inv = 448 / a`` and ``1 / sf`` are
correctly rounded with :func:`jaxkern.quant.common.exact_div` (the GPU's ``/`` is approximate; the
divisor 448 is loaded from memory so that XLA cannot fold it in interpret mode), checked against
numpy by a ``gpu`` test. The kernel writes the scale factors as float32 ``(groups, rows)``; the
wrapper turns them into the requested layout (A, B or packed UE8M0 C). TMA needs the row count of the array to be a
multiple of 8 (the SMEM tiling of the WGMMA layout), so other row counts are padded in the wrapper.

FP4 e2m1 outputs and QuantTensor inputs run the ``jnp`` reference for now.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.reference import quant as ref

BM = 64  # rows per CTA (the WGMMA register layout)
TILE = 256  # columns per TMA box (the TMA limit)
ROW_ALIGN = 8  # TMA row granularity of the tiled SMEM
_PIPELINE_BYTES = 128 << 10  # SMEM for the in-flight tiles of the amax pipeline (one sf per row)
# 64-byte swizzle for e4m3 SMEM tiles, so that arrays whose width is a multiple of 64 (576) can be copied.
FP8_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def group_select(values, width: int):
  """Per-row values of consecutive column groups -> a ``(64, width)`` register array (WGMMA layout):
  ``values[s]`` fills the columns of group ``s`` (groups of ``width / len(values)`` columns)."""
  if len(values) == 1:
    return values[0][:, None]
  col = plgpu.broadcasted_iota(jnp.int32, (BM, width), 1, layout=plgpu.Layout.WGMMA) // (width // len(values))
  out = values[0][:, None]
  for s in range(1, len(values)):
    out = jnp.where(col == s, values[s][:, None], out)
  return out


def _tile_width(k: int, npc: int) -> int:
  return TILE if npc <= TILE else min(TILE, k)


@functools.partial(jax.jit, static_argnames=("npc", "round_sf", "write_data", "compute_sf", "interpret"))
def _kernel(x, sf_in, *, npc, round_sf, write_data, compute_sf, interpret):
  """``x`` ``(M, K)`` with ``M % 8 == 0``; ``sf_in`` ``(G, Mb·64)`` float32 precomputed sf or None.

  Returns ``(out (M, K) e4m3 | None, sf (G, Mb·64) float32 | None)`` with ``G`` groups per row
  (``G ≥ ceil(K / npc)``; the extra ones are padding).
  """
  m, k = x.shape
  t = _tile_width(k, npc)
  kt = ref.cdiv(k, t)
  row_mode = npc > TILE
  gpt = 1 if row_mode else t // npc  # groups per tile
  ng = 1 if row_mode else kt * gpt
  mb = ref.cdiv(m, BM)
  consts = jnp.full((BM,), ref.FP8_MAX, jnp.float32)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((ng, mb * BM), jnp.float32))
  scratch = {} if row_mode else dict(x_s=plgpu.SMEM((BM, t), x.dtype), bar=plgpu.Barrier(num_arrivals=1))
  if write_data:
    scratch["o_s"] = plgpu.SMEM((BM, t), jnp.float8_e4m3fn, transforms=FP8_TRANSFORMS)
  grid, names = ((mb,), ("i",)) if row_mode else ((mb, kt), ("i", "j"))
  gw = t if row_mode else npc  # group width inside a tile

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=grid, grid_names=names,
                     scratch_types=scratch, interpret=interpret)
  def kernel(*refs, x_s=None, bar=None, o_s=None):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    i = lax.axis_index("i")
    rows = pl.ds(i * BM, BM)
    maxv = plgpu.load(c_g, layout=row_layout, optimized=False)

    def load_tile(j):
      plgpu.copy_gmem_to_smem(x_g.at[rows, pl.ds(j * t, t)], x_s, bar)
      plgpu.barrier_wait(bar)

    cw = max(gw, 64)  # chunk width: the e4m3 SMEM tile is 64 columns wide
    nsub = cw // gw  # groups per chunk (groups of 16 / 32 columns are selected by masks)
    col = plgpu.broadcasted_iota(jnp.int32, (BM, cw), 1, layout=plgpu.Layout.WGMMA) // gw if nsub > 1 else None

    def chunk(c, src=None):
      src = x_s if src is None else src
      return plgpu.load(src.at[:, pl.ds(c * cw, cw)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)

    def chunk_amax(c):
      a = jnp.abs(chunk(c))
      if nsub == 1:
        return [jnp.max(a, axis=1)]
      return [jnp.max(jnp.where(col == s, a, 0.0), axis=1) for s in range(nsub)]

    def inverse(sf):
      return common.exact_div(1.0, sf)

    def quantise_tile(j, invs, src=None):
      for c in range(len(invs) // nsub):
        inv = group_select(invs[c * nsub:(c + 1) * nsub], cw)
        o_s.at[:, pl.ds(c * cw, cw)][...] = ref.encode_e4m3(chunk(c, src) * inv)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_g.at[rows, pl.ds(j * t, t)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if not row_mode:
      j = lax.axis_index("j")
      load_tile(j)
      if sf_in is not None:
        invs = [inverse(plgpu.load(sfin_g.at[j * gpt + g, rows], layout=row_layout, optimized=False))
                for g in range(gpt)]
      else:
        amaxes = [a for c in range(gpt // nsub) for a in chunk_amax(c)]
        invs = []
        for g, a in enumerate(amaxes):
          sf, inv = ref.scale_factors(a, maxv, "e4m3", round_sf, div=common.exact_div)
          invs.append(inv)
          if compute_sf:
            sf_g[j * gpt + g, rows] = sf
      if write_data:
        quantise_tile(j, invs)
      return

    pipeline = functools.partial(
        plgpu.emit_pipeline, grid=(kt,), in_specs=[plgpu.BlockSpec((BM, t), lambda j: (i, j))],
        max_concurrent_steps=min(kt, _PIPELINE_BYTES // (BM * t * x.dtype.itemsize)))
    if sf_in is not None:
      inv = inverse(plgpu.load(sfin_g.at[0, rows], layout=row_layout, optimized=False))
    else:
      def amax_step(_, x_blk, a):
        v = plgpu.load(x_blk, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        return jnp.maximum(a, jnp.max(jnp.abs(v), axis=1))

      a = pipeline(amax_step, init_carry=jnp.zeros((BM,), jnp.float32))(x_g)
      sf, inv = ref.scale_factors(a, maxv, "e4m3", round_sf, div=common.exact_div)
      if compute_sf:
        sf_g[0, rows] = sf
    if write_data:
      pipeline(lambda idx, x_blk: quantise_tile(idx[0], [inv], x_blk))(x_g)

  args = (x, consts) if sf_in is None else (x, consts, sf_in)
  outs = list(kernel(*args))
  return (outs.pop(0) if write_data else None), (outs.pop(0) if compute_sf else None)


def _check_plain(x, fmt, npc, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  common.check_fmt(fmt)
  common.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  k = x.shape[1]
  if npc not in (16, 32, 64, 128) and npc != k:
    raise ValueError(f"num_per_channels must be 16, 32, 64, 128 or K={k}, got {npc}")
  if npc == k and k % 64:
    raise ValueError(f"num_per_channels == K needs K % 64 == 0, got x.shape {tuple(x.shape)}")
  if fmt == "e2m1":
    _checks.check_multiple("x", x, 1, 2)


def _run_kernel(x, npc, impl, *, sf_in=None, round_sf=False, write_data=True, compute_sf=True):
  """Pads rows to a multiple of 8 if needed, runs the kernel, returns ``(out, sf (M, Kb))``."""
  m, k = x.shape
  mp = ref.cdiv(m, ROW_ALIGN) * ROW_ALIGN
  xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
  if sf_in is not None:
    sf_in = jnp.pad(sf_in.T, ((0, 0), (0, ref.cdiv(m, BM) * BM - m)))
    ng = 1 if npc > TILE else ref.cdiv(k, TILE) * (TILE // npc)
    sf_in = jnp.pad(sf_in, ((0, ng - sf_in.shape[0]), (0, 0)), constant_values=1.0)
  out, sf = _kernel(xp, sf_in, npc=npc, round_sf=round_sf, write_data=write_data, compute_sf=compute_sf,
                    interpret=_config.mosaic_interpret(impl))
  if out is not None and mp != m:
    out = out[:m]
  if sf is not None:
    sf = sf[:ref.cdiv(k, npc), :m].T
  return out, sf


def per_token_cast(x, fmt: str, num_per_channels: int, x_block_size=None, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                   x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None):
  """Row-wise cast to FP8 e4m3 or packed FP4 e2m1, one scale per ``num_per_channels`` columns.

  Args:
    x: ``(M, K)`` bfloat16 / float32, or a QuantTensor ``(q, sf)`` (e4m3 ``(M, K)`` or int8 packed
      e2m1 ``(M, K/2)``, sf in layout A / B / C) for blocks ``x_block_size``.
    fmt: ``"e4m3"`` or ``"e2m1"`` (``K`` even).
    num_per_channels: group width: 16, 32, 64, 128, or ``K`` (``K % 64 == 0``); the last group may be
      partial.
    x_block_size: ``(bm, bk)`` of a QuantTensor input, else None.
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: output sf layout and rounding (see
      :mod:`jaxkern.reference.quant`); packed needs column-major and ``round_sf``.
    x_use_tma_aligned_col_major_sf: a float32 input sf is the layout-B buffer.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(out, out_sf)``: ``out`` ``(M, K)`` float8_e4m3fn or ``(M, K/2)`` int8; ``out_sf`` layout A
    ``(M, Kb)`` float32, B ``(Kb, align(M, 4))`` float32 or C ``(ceil(Kb/4), align(M, 4))`` int32,
    ``Kb = ceil(K / num_per_channels)``.
  """
  quant_input = isinstance(x, tuple)
  if quant_input:
    common.check_quant_tensor("x", x, x_block_size, col_major=x_use_tma_aligned_col_major_sf)
    common.check_fmt(fmt)
    common.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if num_per_channels not in (16, 32, 64, 128):
      raise ValueError(f"num_per_channels must be 16, 32, 64 or 128 for a QuantTensor input, got {num_per_channels}")
  else:
    if x_block_size is not None:
      raise ValueError("x_block_size must be None for a plain input")
    _check_plain(x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  m = (x[0] if quant_input else x).shape[0]
  if impl == "reference" or m == 0 or quant_input or fmt != "e4m3":
    return ref.cast(x, fmt, (1, num_per_channels), x_block_size=x_block_size, round_sf=round_sf,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
                    x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  out, sf = _run_kernel(x, num_per_channels, impl, round_sf=round_sf)
  return out, ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_token_cast_with_sf_only(x, fmt: str, num_per_channels: int, x_block_size=None,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False, *, implementation: str | None = None):
  """The ``out_sf`` of :func:`per_token_cast` (plain input only), without writing the data."""
  if x_block_size is not None or isinstance(x, tuple):
    raise ValueError("x must be a plain (M, K) array and x_block_size None")
  _check_plain(x, fmt, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0 or fmt != "e4m3":
    return ref.cast(x, fmt, (1, num_per_channels), round_sf=round_sf,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)[1]
  _, sf = _run_kernel(x, num_per_channels, impl, round_sf=round_sf, write_data=False)
  return ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_token_cast_with_precomputed_sf(x, fmt: str, num_per_channels: int, sf, x_block_size=None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False, *, implementation: str | None = None):
  """Quantises with a caller-given float32 layout-A ``sf`` ``(M, ceil(K/npc))``: ``sf_inv = 1/sf``
  (correctly rounded), ``out = encode(x · sf_inv)`` with the e4m3 clamp to ±448. ``round_sf`` is
  ignored; column-major / packed flags are rejected. Returns ``out`` only."""
  if x_block_size is not None or isinstance(x, tuple):
    raise ValueError("x must be a plain (M, K) array and x_block_size None")
  _check_plain(x, fmt, num_per_channels, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  common.check_sf("sf", sf, (m, ref.cdiv(k, num_per_channels)), jnp.float32)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or m == 0 or fmt != "e4m3":
    return ref.cast(x, fmt, (1, num_per_channels), sf=sf)
  out, _ = _run_kernel(x, num_per_channels, impl, sf_in=sf, compute_sf=False)
  return out
