"""Per-channel e4m3 casts: one scale per column and group of ``num_per_tokens`` rows (quant.md §7).

One Mosaic GPU kernel serves all three ops. Each CTA owns ``R = max(npt, 64)`` rows and 128 columns
(the last column box is clipped by TMA). The rows arrive with one TMA box copy, or, with a
``pos_to_token`` gather, with one one-row TMA copy per row (all on one barrier; rows with a
negative or out-of-range position copy a clamped row and are zeroed in registers). A QuantTensor input (e4m3 +
one float32 sf per row and 128 columns) is dequantised in registers (``RN(q·sf)``) before the cast.
Each 64-row half is loaded in the WGMMA layout and reduced down its columns (masked to 32-row halves
for ``npt = 32``); the sf row vectors go to a column-padded float32 buffer that the wrapper cuts to
``K``. ``per_channel_cast_and_transpose`` writes the e4m3 data transposed from the same registers (a
WGMMA -> WGMMA_TRANSPOSED lane shuffle on the int16-widened bytes, as in
:mod:`jaxkern.transpose`), so the data crosses DRAM once. Divisions as in
:mod:`jaxkern.quant.per_token_cast`.
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
from jaxkern.quant.common import BM, FP8_TRANSFORMS
from jaxkern.reference import quant as ref

_COLS = 128  # columns per CTA (and per input sf of a QuantTensor)


def _transposed_e4m3(q):
  """e4m3 ``(64, C)`` in the WGMMA layout -> the same values in the WGMMA_TRANSPOSED layout."""
  w = lax.bitcast_convert_type(q, jnp.int8).astype(jnp.int16)
  w = plgpu.layout_cast(w, plgpu.Layout.WGMMA_TRANSPOSED)
  return lax.bitcast_convert_type(w.astype(jnp.int8), jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("npt", "round_sf", "transpose_out", "num_rows", "interpret"))
def _kernel(x, sf_in=None, pos=None, *, npt, round_sf, transpose_out=False, num_rows=None, interpret=None):
  """Per-channel cast of the (gathered, dequantised) rows of ``x`` ``(M, K)``.

  ``pos`` int32, padded with -1 to a multiple of ``R``, gathers the ``num_rows`` output rows
  (negative: zero row); without it ``M % R == 0``. ``sf_in`` float32 ``(M, K/128)``, or ``(len(pos),
  K/128)`` already gathered, makes ``x`` (e4m3) a QuantTensor. Returns ``(out (Mo, K) e4m3, or
  (K, Mo) if transpose_out, sf (ceil(Mo/npt), K) float32)``.
  """
  m, k = x.shape
  r, t = max(npt, BM), _COLS
  mo = m if pos is None else num_rows
  grid_rows = m // r if pos is None else pos.shape[0] // r
  kt = ref.cdiv(k, t)
  halves = r // BM
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  if transpose_out:
    out_type = jax.ShapeDtypeStruct((k, mo), jnp.float8_e4m3fn)
    o_smem = plgpu.SMEM((halves, t, BM), jnp.float8_e4m3fn)
  else:
    out_type = jax.ShapeDtypeStruct((mo, k), jnp.float8_e4m3fn)
    o_smem = plgpu.SMEM((r, t), jnp.float8_e4m3fn, transforms=FP8_TRANSFORMS)
  inputs = [x, jnp.full((t,), ref.FP8_MAX, jnp.float32)]
  if sf_in is not None:
    inputs.append(sf_in)
  if pos is not None:
    inputs.append(pos)

  @functools.partial(
      plgpu.kernel, grid=(grid_rows, kt), grid_names=("i", "j"), interpret=interpret,
      out_type=(out_type, jax.ShapeDtypeStruct((grid_rows * r // npt, kt * t), jnp.float32)),
      scratch_types=dict(x_s=plgpu.SMEM((r, t), x.dtype), o_s=o_smem,
                         bar=plgpu.Barrier(num_arrivals=1 if pos is None else r)))
  def kernel(x_g, c_g, *refs, x_s, o_s, bar):
    refs = list(refs)
    s_g = refs.pop(0) if sf_in is not None else None
    p_g = refs.pop(0) if pos is not None else None
    o_g, sf_g = refs
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * t, t)
    if p_g is None:
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r, r), cols], x_s, bar)
    else:
      for row in range(r):
        p = jnp.clip(p_g[i * r + row], 0, m - 1)  # padding rows copy a real row, zeroed below
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(p, 1), cols], x_s.at[pl.ds(row, 1)], bar)
    maxv = plgpu.load(c_g, layout=col_layout, optimized=False)
    plgpu.barrier_wait(bar)
    v = []
    for h in range(halves):
      rows = pl.ds(i * r + h * BM, BM)
      vh = plgpu.load(x_s.at[pl.ds(h * BM, BM)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      if s_g is not None:
        vh = vh * plgpu.load(s_g.at[rows, j], layout=row_layout, optimized=False)[:, None]
      if p_g is not None:
        ph = plgpu.load(p_g.at[rows], layout=row_layout, optimized=False)
        vh = jnp.where(((ph >= 0) & (ph < m))[:, None], vh, 0.0)
      v.append(vh)
    if npt == 128:
      a = jnp.maximum(jnp.max(jnp.abs(v[0]), axis=0), jnp.max(jnp.abs(v[1]), axis=0))
      sf, inv = ref.scale_factors(a, maxv, "e4m3", round_sf, div=common.exact_div)
      sf_g[i, cols] = sf
      invs = [inv[None, :]] * 2
    else:
      row = plgpu.broadcasted_iota(jnp.int32, (BM, t), 0, layout=plgpu.Layout.WGMMA) < 32
      av = jnp.abs(v[0])
      lo = ref.scale_factors(jnp.max(jnp.where(row, av, 0.0), axis=0), maxv, "e4m3", round_sf, div=common.exact_div)
      hi = ref.scale_factors(jnp.max(jnp.where(row, 0.0, av), axis=0), maxv, "e4m3", round_sf, div=common.exact_div)
      sf_g[2 * i, cols] = lo[0]
      sf_g[2 * i + 1, cols] = hi[0]
      invs = [jnp.where(row, lo[1][None, :], hi[1][None, :])]
    for h, inv in enumerate(invs):
      q = ref.encode_e4m3(v[h] * inv)
      if transpose_out:
        o_s.at[h].T[...] = _transposed_e4m3(q)
      else:
        o_s.at[pl.ds(h * BM, BM)][...] = q
    plgpu.commit_smem()
    if transpose_out:
      for h in range(halves):
        plgpu.copy_smem_to_gmem(o_s.at[h], o_g.at[cols, pl.ds(i * r + h * BM, BM)])
    else:
      plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(i * r, r), cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out, sf = kernel(*inputs)
  return out, sf[:, :k]


def per_channel_cast_fused(x, fmt: str, num_per_tokens: int, round_sf: bool = False, num_per_channels=None,
                           pos_to_token=None, *, implementation: str | None = None):
  """Per-channel (128-row) e4m3 cast with an optional row gather and dequantisation of the input.

  Args:
    x: ``(M, K)`` bf16 / float32 (``K % 64 == 0``), or a QuantTensor ``(q e4m3 (M, K), sf float32
      (M, K/128))`` with ``num_per_channels=128`` (``K % 128 == 0``).
    fmt: ``"e4m3"``. num_per_tokens: 128.
    pos_to_token: optional int32 ``(Mo,)``, ``Mo % 16 == 0``; row ``p`` is ``x[pos_to_token[p]]``, or
      zeros where negative (or ``>= M``: out of range, zeros too). Without it ``M % 128 == 0``.

  Returns:
    ``(out (Mo, K) e4m3, out_sf (ceil(Mo/128), K) float32)``.
  """
  common.check_fmt(fmt, ("e4m3",))
  if num_per_tokens != 128:
    raise ValueError(f"num_per_tokens must be 128, got {num_per_tokens}")
  if isinstance(x, tuple):
    if num_per_channels != 128:
      raise ValueError("num_per_channels must be 128 for a QuantTensor input")
    q, sf = x
    _checks.check_rank("x[0]", q, 2)
    _checks.check_dtype("x[0]", q, (jnp.float8_e4m3fn,))
    _checks.check_multiple("x[0]", q, 1, 128)
    common.check_sf("x[1]", sf, (q.shape[0], q.shape[1] // 128), jnp.float32)
    rows = q.shape[0]
  else:
    if num_per_channels is not None:
      raise ValueError("num_per_channels must be None for a plain input")
    _checks.check_rank("x", x, 2)
    _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
    _checks.check_multiple("x", x, 1, 64)
    rows = x.shape[0]
  if pos_to_token is None:
    if rows % 128:
      raise ValueError(f"x must have a multiple of 128 rows without pos_to_token, got {rows}")
  else:
    _checks.check_rank("pos_to_token", pos_to_token, 1)
    _checks.check_dtype("pos_to_token", pos_to_token, (jnp.int32,))
    _checks.check_multiple("pos_to_token", pos_to_token, 0, 16)
  impl = _config.get_implementation(implementation)
  num_rows = rows if pos_to_token is None else pos_to_token.shape[0]
  if impl == "reference" or rows == 0 or num_rows == 0:
    return ref.per_channel_cast_fused(x, num_per_tokens, round_sf, pos_to_token)
  data, sf = x if isinstance(x, tuple) else (x, None)
  if pos_to_token is not None:
    pos_to_token = jnp.pad(pos_to_token, (0, -num_rows % 128), constant_values=-1)
    if sf is not None:
      sf = sf[jnp.clip(pos_to_token, 0, rows - 1)]  # one word per row and 128 columns
  return _kernel(data, sf, pos_to_token, npt=num_per_tokens, round_sf=round_sf, num_rows=num_rows,
                 interpret=_config.mosaic_interpret(impl))


def _check_plain(x, fmt, num_per_tokens, allowed, dtypes):
  common.check_fmt(fmt, ("e4m3",))
  if num_per_tokens not in allowed:
    raise ValueError(f"num_per_tokens must be in {allowed}, got {num_per_tokens}")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, dtypes)
  _checks.check_multiple("x", x, 0, 128)
  _checks.check_multiple("x", x, 1, 64)


def per_channel_cast(x, fmt: str, num_per_tokens: int, round_sf: bool = False, *,
                     implementation: str | None = None):
  """Per-channel e4m3 cast of ``x`` ``(M, K)`` (``M % 128 == 0``, ``K % 64 == 0``), 128-row blocks.

  Returns ``(out (M, K) e4m3, out_sf (M/128, K) float32)``.
  """
  _check_plain(x, fmt, num_per_tokens, (128,), (jnp.bfloat16, jnp.float32))
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0:
    return ref.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
  return _kernel(x, npt=num_per_tokens, round_sf=round_sf, interpret=_config.mosaic_interpret(impl))


def per_channel_cast_and_transpose(x, fmt: str, num_per_tokens: int, round_sf: bool = False, *,
                                   implementation: str | None = None):
  """Per-channel e4m3 cast of bf16 ``x`` ``(M, K)`` with ``num_per_tokens ∈ {32, 128}``, data transposed.

  Returns ``(out (K, M) e4m3, out_sf (M/npt, K) float32)``.
  """
  _check_plain(x, fmt, num_per_tokens, (32, 128), (jnp.bfloat16,))
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0:
    out, sf = ref.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
    return out.T, sf
  return _kernel(x, npt=num_per_tokens, round_sf=round_sf, transpose_out=True,
                 interpret=_config.mosaic_interpret(impl))
