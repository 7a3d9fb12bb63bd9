"""Per-channel e4m3 casts: one scale per column and group of ``num_per_tokens`` rows (quant.md §7).

One Mosaic GPU kernel serves all three ops. Each CTA owns ``R = max(npt, 64)`` rows and 128 columns
(one TMA box, clipped at the right edge). A QuantTensor input (e4m3 + one float32 sf per row and
128 columns) is dequantised in registers (``RN(q·sf)``). Each 64-row half is loaded from SMEM in the
WGMMA layout and reduced down its columns (masked to 32-row halves for ``npt = 32``); the column
maxima then pass through SMEM into a one-column-per-thread layout for the scale-factor division (in
the reduced WGMMA layout every thread would divide for many columns: 255 registers and spills, 0.7x
of XLA on an H200, against 128 registers and 1.5x with this step). ``per_channel_cast_and_transpose``
writes the e4m3 data transposed from the same registers (a WGMMA -> WGMMA_TRANSPOSED lane shuffle on
the int16-widened bytes, as in :mod:`jaxkern.transpose`), so the data crosses DRAM once. With a
``pos_to_token`` gather ``per_channel_cast_fused`` runs the XLA reference, measured faster on an H200
(MoE gathers of 25-29k rows) than the kernel fed by an XLA gather (0.77-0.85x) or by one-row TMA
copies inside the kernel (0.66x). Divisions as in :mod:`jaxkern.quant.per_token_cast`.
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


@functools.partial(jax.jit, static_argnames=("npt", "round_sf", "transpose_out", "interpret"))
def _kernel(x, sf_in=None, *, npt, round_sf, transpose_out=False, interpret=None):
  """Per-channel cast of ``x`` ``(M, K)``, ``M % 128 == 0``; ``sf_in`` float32 ``(M, K/128)`` makes
  ``x`` (e4m3) a QuantTensor. Returns ``(out (M, K) e4m3, or (K, M) if transpose_out, sf (M/npt, K)
  float32)``.
  """
  m, k = x.shape
  r, t = max(npt, BM), _COLS
  grid_rows = m // r
  kt = ref.cdiv(k, t)
  halves = r // BM
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  one_per_thread = plgpu.Layout.WG_STRIDED((t,), vec_size=1)
  if transpose_out:
    out_type = jax.ShapeDtypeStruct((k, m), jnp.float8_e4m3fn)
    o_smem = plgpu.SMEM((halves, t, BM), jnp.float8_e4m3fn)
  else:
    out_type = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    o_smem = plgpu.SMEM((r, t), jnp.float8_e4m3fn, transforms=FP8_TRANSFORMS)
  inputs = [x, jnp.full((t,), ref.FP8_MAX, jnp.float32)]
  if sf_in is not None:
    inputs.append(sf_in)

  @functools.partial(
      plgpu.kernel, grid=(grid_rows, kt), grid_names=("i", "j"), interpret=interpret,
      out_type=(out_type, jax.ShapeDtypeStruct((m // npt, kt * t), jnp.float32)),
      scratch_types=dict(x_s=plgpu.SMEM((r, t), x.dtype), o_s=o_smem, a_s=plgpu.SMEM((2, t), jnp.float32),
                         inv_s=plgpu.SMEM((2, t), jnp.float32),
                         bar=plgpu.Barrier(num_arrivals=1)))
  def kernel(x_g, c_g, *refs, x_s, o_s, a_s, inv_s, bar):
    s_g, o_g, sf_g = refs if sf_in is not None else (None, *refs)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * t, t)
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r, r), cols], x_s, bar)
    maxv = plgpu.load(c_g, layout=one_per_thread, optimized=False)
    plgpu.barrier_wait(bar)

    def value(h):  # float32 (64, 128) rows h*64.. of the block, dequantised
      vh = plgpu.load(x_s.at[pl.ds(h * BM, BM)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      if s_g is not None:
        vh = vh * plgpu.load(s_g.at[pl.ds(i * r + h * BM, BM), j], layout=row_layout, optimized=False)[:, None]
      return vh

    # Column maxima -> sf: the reduced WGMMA layout repeats each column over many threads, so the
    # maxima change layout through SMEM and each thread divides for one column (no register spills).
    if npt == 128:  # the two 64-row halves are read twice from SMEM rather than kept in registers
      a_s[0] = jnp.maximum(jnp.max(jnp.abs(value(0)), axis=0), jnp.max(jnp.abs(value(1)), axis=0))
      v = value
    else:  # two 32-row groups in one 64-row half
      v0 = value(0)
      row = plgpu.broadcasted_iota(jnp.int32, (BM, t), 0, layout=plgpu.Layout.WGMMA) < 32
      a_s[0] = jnp.max(jnp.where(row, jnp.abs(v0), 0.0), axis=0)
      a_s[1] = jnp.max(jnp.where(row, 0.0, jnp.abs(v0)), axis=0)
      v = lambda h: v0
    groups = r // npt
    plgpu.commit_smem()
    for g in range(groups):
      sf, inv = ref.scale_factors(plgpu.load(a_s.at[g], layout=one_per_thread), maxv, "e4m3", round_sf,
                                  div=common.exact_div)
      sf_g[groups * i + g, cols] = sf
      inv_s[g] = inv
    plgpu.commit_smem()
    if npt == 128:
      invs = [plgpu.load(inv_s.at[0], layout=col_layout)[None, :]] * 2
    else:
      invs = [jnp.where(row, plgpu.load(inv_s.at[0], layout=col_layout)[None, :],
                        plgpu.load(inv_s.at[1], layout=col_layout)[None, :])]
    for h, inv in enumerate(invs):
      q = ref.encode_e4m3(v(h) * inv)
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
  if impl == "reference" or rows == 0 or pos_to_token is not None:
    return ref.per_channel_cast_fused(x, num_per_tokens, round_sf, pos_to_token)
  data, sf = x if isinstance(x, tuple) else (x, None)
  return _kernel(data, sf, npt=num_per_tokens, round_sf=round_sf, interpret=_config.mosaic_interpret(impl))


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
