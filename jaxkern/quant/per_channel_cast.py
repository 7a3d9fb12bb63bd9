"""Per-channel e4m3 casts: one scale per column and group of ``num_per_tokens`` rows (quant.md §7).

Mosaic GPU kernel for plain inputs (``per_channel_cast``, ``per_channel_cast_and_transpose``): each
CTA owns ``max(npt, 64)`` rows (``M % 128 == 0``, so row blocks are always full) and 128 columns
(one TMA box, clipped at the right edge). Each 64-row half is loaded in the WGMMA layout and
reduced down its columns (masked to 32-row halves for ``npt = 32``); the sf row vectors are stored
to a column-padded float32 buffer that the wrapper cuts to ``K``. Divisions as in
:mod:`jaxkern.quant.per_token_cast`. The transposed variant runs the same kernel followed by the
bit-exact :func:`jaxkern.transpose.transpose` kernel (two passes over the e4m3 data; a fused
transposed store is future work). ``per_channel_cast_fused`` with a gather or a QuantTensor input runs
the ``jnp`` reference.
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
from jaxkern.transpose import transpose

_COLS = 128  # columns per CTA


@functools.partial(jax.jit, static_argnames=("npt", "round_sf", "interpret"))
def _kernel(x, *, npt, round_sf, interpret):
  """``x`` ``(M, K)`` with ``M % 128 == 0`` -> ``(out (M, K) e4m3, sf (M/npt, Kt·128) float32)``."""
  m, k = x.shape
  r, t = max(npt, BM), _COLS
  kt = ref.cdiv(k, t)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  @functools.partial(
      plgpu.kernel, grid=(m // r, kt), grid_names=("i", "j"), interpret=interpret,
      out_type=(jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m // npt, kt * t), jnp.float32)),
      scratch_types=dict(x_s=plgpu.SMEM((r, t), x.dtype), o_s=plgpu.SMEM((r, t), jnp.float8_e4m3fn,
                                                                        transforms=FP8_TRANSFORMS),
                         bar=plgpu.Barrier(num_arrivals=1)))
  def kernel(x_g, c_g, o_g, sf_g, x_s, o_s, bar):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * t, t)
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r, r), cols], x_s, bar)
    plgpu.barrier_wait(bar)
    maxv = plgpu.load(c_g, layout=col_layout, optimized=False)
    v = [plgpu.load(x_s.at[pl.ds(h * BM, BM)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
         for h in range(r // BM)]
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
      o_s.at[pl.ds(h * BM, BM)][...] = ref.encode_e4m3(v[h] * inv)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(i * r, r), cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out, sf = kernel(x, jnp.full((t,), ref.FP8_MAX, jnp.float32))
  return out, sf[:, :k]


def per_channel_cast_fused(x, fmt: str, num_per_tokens: int, round_sf: bool = False, num_per_channels=None,
                           pos_to_token=None, *, implementation: str | None = None):
  """Per-channel (128-row) e4m3 cast with an optional row gather and dequantisation of the input.

  Args:
    x: ``(M, K)`` bf16 / float32 (``K % 64 == 0``), or a QuantTensor ``(q e4m3 (M, K), sf float32
      (M, K/128))`` with ``num_per_channels=128`` (``K % 128 == 0``).
    fmt: ``"e4m3"``. num_per_tokens: 128.
    pos_to_token: optional int32 ``(Mo,)``, ``Mo % 16 == 0``; row ``p`` is ``x[pos_to_token[p]]``, or
      zeros where negative. Without it ``M % 128 == 0``.

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
  if impl != "reference" and pos_to_token is None and not isinstance(x, tuple) and rows:
    return _kernel(x, npt=num_per_tokens, round_sf=round_sf, interpret=_config.mosaic_interpret(impl))
  return ref.per_channel_cast_fused(x, num_per_tokens, round_sf, pos_to_token)


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
  out, sf = _kernel(x, npt=num_per_tokens, round_sf=round_sf, interpret=_config.mosaic_interpret(impl))
  return transpose(out, implementation=impl), sf
