"""Per-block casts (``bm × bk`` blocks, ``bm, bk ∈ {32, 128}``) and the lossless FP4 -> FP8 re-quantisation.

Mosaic GPU kernel for e4m3 and bf16 -> e2m1 (``per_block_cast*``): each CTA owns one block row and ``nb`` block
columns (``bm · nb·bk`` elements, ``nb·bk`` = 256 columns for ``bm = 32``, 128 for ``bm = 128``).
Each block comes in by its own TMA box into an untiled SMEM buffer (the box clips at the array
edges and zero-fills, so partial blocks and any row count need no padding), is loaded into
registers in :func:`jaxkern._layouts.row_layout` (conflict-free: the buffer is contiguous), and
reduced over both axes to the block's amax; the quantisation re-reads the buffer, writes e4m3 to an
SMEM buffer and TMA stores it (clipped at the edges). The sf is stored per block from the kernel,
float32 ``(Mb, kt·nb)``; the wrapper cuts the padding columns and formats the layout. Divisions as
in :mod:`jaxkern.quant.per_token_cast`.

e2m1 from bf16 reads each pair of columns as one int32 word (a free bitcast of the input; the data
TMA boxes are half as wide) and packs the two nibbles per output byte as in
:mod:`jaxkern.quant.per_token_cast`. float32 -> e2m1 (the pair split would need strided SMEM
loads, which do not lower) runs the ``jnp`` reference (:mod:`jaxkern.reference.quant`).

``per_block_cast_lossless`` computes the exponents per block in XLA (small: one value per input
block) and moves the data through the packed-e2m1 row kernel of :mod:`jaxkern.quant.cast_back`
with an e4m3 output (decode, multiply by the block's power of two, saturating e4m3 pairs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.quant.cast_back import _kernel as _cast_back_kernel
from jaxkern.reference import quant as ref

BLOCK_SIDES = (32, 128)


def _blocks_per_cta(block_size) -> int:
  bm, bk = block_size
  return (256 if bm == 32 else 128) // bk


def _load_halves(x_s, layout, fp4):
  """Float32 values of an SMEM block: ``(v,)``, or for e2m1 (bf16 pairs as int32 words) the even
  and odd columns."""
  if not fp4:
    return (plgpu.load(x_s, layout=layout).astype(jnp.float32),)
  u = plgpu.load(x_s, layout=layout)
  return (lax.bitcast_convert_type(u << 16, jnp.float32), lax.bitcast_convert_type(u & jnp.int32(-65536), jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "round_sf", "write_data", "compute_sf",
                                             "interpret"))
def _kernel(x, sf_in, *, fmt, block_size, round_sf, write_data, compute_sf, interpret):
  """``x`` ``(M, K)``; ``sf_in`` precomputed layout-A sf ``(Mb, Kb)`` or None.

  Returns ``(out (M, K) e4m3 or (M, K/2) int8 | None, sf (Mb, Kb) float32 | None)``.
  """
  m, k = x.shape
  bm, bk = block_size
  nb = _blocks_per_cta(block_size)
  mb, kb, kt = ref.cdiv(m, bm), ref.cdiv(k, bk), ref.cdiv(k, nb * bk)
  fp4 = fmt == "e2m1"  # bf16 only: each pair of columns as one int32 word (a free bitcast of the input)
  if fp4:
    x = lax.bitcast_convert_type(x.reshape(m, k // 2, 2), jnp.int32)
  obk = bk // 2 if fp4 else bk  # block width in x's columns and in output bytes
  layout, _ = common.row_layout(obk, x.dtype.itemsize)
  # e2m1 works on 32-row slices of a block: the integer rounding of a whole 128-row block at once
  # needs too many registers (measured 6x slower than the e4m3 kernel on the H200).
  rc = 32 if fp4 else bm
  chunks = [pl.ds(r0, rc) for r0 in range(0, bm, rc)]
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((m, k // 2), jnp.int8) if fp4 else
                    jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((mb, kt * nb), jnp.float32))

  # A one-row tiling keeps the buffers row-major and stops the transform inference from choosing
  # an (8, ·) tiling, which would make TMA require a row count that is a multiple of 8.
  # The tile width must divide the array's width too (K/2 is only a multiple of 32).
  def untiled(width, array_width):
    return (plgpu.TilingTransform((1, math.gcd(64, width, array_width))),)

  scratch = dict(x_s=plgpu.SMEM((nb, bm, obk), x.dtype, transforms=untiled(obk, x.shape[1])),
                 bar=plgpu.Barrier(num_arrivals=1, num_barriers=nb))
  if write_data:
    scratch["o_s"] = plgpu.SMEM((nb, bm, obk), jnp.int8 if fp4 else jnp.float8_e4m3fn,
                                 transforms=untiled(obk, k // 2 if fp4 else k))

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mb, kt), grid_names=("i", "j"),
                     scratch_types=scratch, interpret=interpret)
  def kernel(*refs, x_s, bar, o_s=None):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    i, j = lax.axis_index("i"), lax.axis_index("j")
    rows = pl.ds(i * bm, bm)

    for s in range(nb):
      plgpu.copy_gmem_to_smem(x_g.at[rows, pl.ds((j * nb + s) * obk, obk)], x_s.at[s], bar.at[s])
    for s in range(nb):
      plgpu.barrier_wait(bar.at[s])
      # The block's amax / sf are scalars; the sf arithmetic (bit casts) runs on splat vectors
      # (one register per thread), as scalar bit casts do not lower.
      if sf_in is not None:
        inv = common.exact_div(1.0, jnp.broadcast_to(sfin_g[i, j * nb + s], (rc,)))
      else:
        a = functools.reduce(jnp.maximum, [jnp.max(jnp.max(jnp.abs(h), axis=1), axis=0)
                                           for c in chunks for h in _load_halves(x_s.at[s, c], layout, fp4)])
        sf, inv = ref.scale_factors(jnp.broadcast_to(a, (rc,)), jnp.broadcast_to(c_g[0], (rc,)), fmt, round_sf,
                                    div=common.exact_div)
        if compute_sf:
          sf_g[i, j * nb + s] = jnp.max(sf, axis=0)
      if write_data:
        for c in chunks:
          q = [h * inv[:, None] for h in _load_halves(x_s.at[s, c], layout, fp4)]
          if fp4:
            o_s.at[s, c][...] = (ref.encode_e2m1(q[0]) | (ref.encode_e2m1(q[1]) << 4)).astype(jnp.int8)
          else:
            o_s.at[s, c][...] = ref.encode_e4m3(q[0]) if sf_in is not None else q[0].astype(jnp.float8_e4m3fn)
    if write_data:
      plgpu.commit_smem()
      for s in range(nb):
        plgpu.copy_smem_to_gmem(o_s.at[s], o_g.at[rows, pl.ds((j * nb + s) * obk, obk)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  consts = jnp.full((1,), ref.MAX_VALUE[fmt], jnp.float32)
  if sf_in is not None:
    sf_in = jnp.pad(sf_in, ((0, 0), (0, kt * nb - kb)), constant_values=1.0)
  outs = list(kernel(*((x, consts) if sf_in is None else (x, consts, sf_in))))
  out = outs.pop(0) if write_data else None
  return out, (outs.pop(0)[:, :kb] if compute_sf else None)


def _run_kernel(x, fmt, block_size, impl, *, sf_in=None, round_sf=False, write_data=True, compute_sf=True):
  return _kernel(x, sf_in, fmt=fmt, block_size=block_size, round_sf=round_sf, write_data=write_data, compute_sf=compute_sf,
                 interpret=_config.mosaic_interpret(impl))


def _use_kernel(impl, x, fmt) -> bool:
  """The kernel covers e4m3 and bf16 -> e2m1 (float32 -> e2m1 runs the reference)."""
  return impl != "reference" and x.shape[0] > 0 and (fmt == "e4m3" or x.dtype == jnp.bfloat16)


def _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  if isinstance(x, tuple):
    raise ValueError("x must be a plain (M, K) array (no QuantTensor input for per-block casts)")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  _checks.check_multiple("x", x, 1, 64)
  common.check_fmt(fmt)
  if len(block_size) != 2 or any(b not in BLOCK_SIDES for b in block_size):
    raise ValueError(f"block_size must be (bm, bk) with bm, bk in {BLOCK_SIDES}, got {block_size}")
  common.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_block_cast(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                   use_packed_ue8m0: bool = False, *, implementation: str | None = None):
  """Blockwise cast of ``x`` ``(M, K)`` bf16 / float32 (``K % 64 == 0``) to e4m3 or packed e2m1.

  Returns ``(out, out_sf)``: ``out`` ``(M, K)`` float8_e4m3fn or ``(M, K/2)`` int8; ``out_sf`` for
  ``(ceil(M/bm), ceil(K/bk))`` blocks in layout A / B / C (:mod:`jaxkern.reference.quant`).
  """
  _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  if not _use_kernel(impl, x, fmt):
    return ref.cast(x, fmt, tuple(block_size), round_sf=round_sf,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)
  out, sf = _run_kernel(x, fmt, tuple(block_size), impl, round_sf=round_sf)
  return out, ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast_with_sf_only(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                implementation: str | None = None):
  """The ``out_sf`` of :func:`per_block_cast`, without writing the data."""
  _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  if not _use_kernel(impl, x, fmt):
    return ref.cast(x, fmt, tuple(block_size), round_sf=round_sf, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                    use_packed_ue8m0=use_packed_ue8m0)[1]
  _, sf = _run_kernel(x, fmt, tuple(block_size), impl, round_sf=round_sf, write_data=False)
  return ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast_with_precomputed_sf(x, fmt: str, block_size, sf, use_tma_aligned_col_major_sf: bool = False,
                                       round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                       implementation: str | None = None):
  """Quantises with a caller-given layout-A float32 ``sf`` ``(Mb, Kb)`` (``sf_inv = 1/sf``); returns ``out``."""
  _check(x, fmt, block_size, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  common.check_sf("sf", sf, (ref.cdiv(m, block_size[0]), ref.cdiv(k, block_size[1])), jnp.float32)
  impl = _config.get_implementation(implementation)
  if not _use_kernel(impl, x, fmt):
    return ref.cast(x, fmt, tuple(block_size), sf=sf)
  out, _ = _run_kernel(x, fmt, tuple(block_size), impl, sf_in=sf, compute_sf=False)
  return out


def per_block_cast_lossless(x, fmt: str, x_block_size, out_block_size, use_tma_aligned_col_major_sf: bool = False,
                            round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                            x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None):
  """Exact re-quantisation of a packed-e2m1 QuantTensor (power-of-two sf) into e4m3 with larger blocks.

  Precondition (not checked inside ``jit``): within one output block the input sf span at most 2^11;
  otherwise the values round or flush in the e4m3 conversion. ``round_sf`` has no effect. Returns
  ``(out (M, K) e4m3, out_sf)`` for blocks ``out_block_size`` in the layout of the flags.
  """
  k = common.check_quant_tensor("x", x, x_block_size, col_major=x_use_tma_aligned_col_major_sf)
  if x[0].dtype == jnp.float8_e4m3fn:
    raise ValueError("x[0] must be packed e2m1 (int8)")
  if k % 32:
    raise ValueError(f"x[0] must have a logical width K % 32 == 0, got K={k}")
  common.check_fmt(fmt, ("e4m3",))
  common.check_sf_flags(use_tma_aligned_col_major_sf, True, use_packed_ue8m0)
  (ibm, ibk), (obm, obk) = x_block_size, out_block_size
  if ibk & (ibk - 1) or obk & (obk - 1) or obm % ibm or obk % ibk:
    raise ValueError(f"out_block_size {out_block_size} must be a multiple of x_block_size {x_block_size} "
                     "with power-of-two widths")
  impl = _config.get_implementation(implementation)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
               x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  if impl == "reference" or x[0].shape[0] == 0:
    return ref.per_block_cast_lossless(x, tuple(x_block_size), tuple(out_block_size), **flags)
  return _lossless(x, tuple(x_block_size), tuple(out_block_size), interpret=_config.mosaic_interpret(impl), **flags)


@functools.partial(jax.jit, static_argnames=("x_block_size", "out_block_size", "use_tma_aligned_col_major_sf",
                                             "use_packed_ue8m0", "x_use_tma_aligned_col_major_sf", "interpret"))
def _lossless(x, x_block_size, out_block_size, *, use_tma_aligned_col_major_sf, use_packed_ue8m0,
              x_use_tma_aligned_col_major_sf, interpret):
  """Exponent bookkeeping per block in XLA (:func:`jaxkern.reference.quant.lossless_scales`), then the
  e2m1 row kernel of :mod:`jaxkern.quant.cast_back` multiplies each decoded value by its block's
  power of two and writes e4m3 pairs."""
  q4, sf_in = x
  m, k = q4.shape[0], 2 * q4.shape[1]
  scale, e_out = ref.lossless_scales(sf_in, m, k, x_block_size, out_block_size, x_use_tma_aligned_col_major_sf)
  out = _cast_back_kernel(q4, scale, block_size=(1, x_block_size[1]), out_dtype=jnp.float8_e4m3fn,
                            col_major=False, interpret=interpret)
  out_sf = lax.bitcast_convert_type(e_out << 23, jnp.float32)
  return out, ref.format_sf(out_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)
