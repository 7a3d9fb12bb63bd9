"""Register tiling shared by the :mod:`jaxkern.quant` row kernels: how many rows a CTA takes and how
an ``(M, K)`` array is viewed as rows of whole scale groups."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BM = 64  # rows of the WGMMA register layout (per-channel kernel)
# 64-byte swizzle for e4m3 SMEM tiles, so that arrays whose width is a multiple of 64 (576) can be copied.
FP8_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
THREAD_BYTES = 128  # input bytes per thread and CTA that the row kernels aim for
# Lanes that share one row of a group (the rest of the warp takes other rows). Every lane holding a
# part of a row redoes that row's scale-factor arithmetic, so narrow groups want few lanes per row;
# 4 lanes (64 contiguous bytes of a row per load) measured best on the H200 for 128-wide groups.
GROUP_LANES = 4


MAX_SEGMENTS = 16  # partial last group: at most this many groups per row run as separate segments


def row_plan(m: int, k: int, group: int):
  """How the row kernels view an ``(m, k)`` array with one value per row and ``group`` columns:
  ``(view rows, view width, column segments)`` (one segment per group of a view row), or None
  (too many groups per row; use the reference). ``(m·k/group, group)`` when ``group`` divides
  ``k`` (then the view-row order of the per-group values is row-major ``(m, k/group)``)."""
  if group >= k:
    return m, k, ((0, k),)
  if k % group == 0:
    return m * k // group, group, ((0, group),)
  segs = tuple((c, min(group, k - c)) for c in range(0, k, group))
  return (m, k, segs) if len(segs) <= MAX_SEGMENTS else None


def tile_rows(num_rows: int, width: int, itemsize: int, unit: int, thread_bytes: int = THREAD_BYTES) -> int:
  """Rows per CTA for ``(num_rows, width)``: a multiple of ``unit`` near ``thread_bytes`` per thread,
  at most ``num_rows`` (the caller pads arrays with fewer than ``unit`` rows)."""
  rows = max(1, thread_bytes * 128 // (width * itemsize) // unit) * unit
  return max(unit, min(rows, num_rows // unit * unit))


def over_chunks(body, chunk_index, num_items: int, chunk: int) -> None:
  """Inside a kernel: ``body(chunk_index, n)`` for the CTA's chunk of ``chunk`` items (``n`` static), the last of
  ``cdiv(num_items, chunk)`` chunks covering only the ``num_items - (chunks - 1)·chunk`` that remain."""
  num_chunks = -(-num_items // chunk)
  tail = num_items - (num_chunks - 1) * chunk
  if tail == chunk:
    body(chunk_index, chunk)
  else:
    pl.when(chunk_index < num_chunks - 1)(lambda: body(chunk_index, chunk))
    pl.when(chunk_index == num_chunks - 1)(lambda: body(num_chunks - 1, tail))
