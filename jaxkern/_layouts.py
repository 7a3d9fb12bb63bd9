"""Register layouts and compiler parameters shared by the Mosaic GPU kernels."""

from __future__ import annotations

import math

from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu


# For kernels whose threads never write SMEM that another thread then reads without a commit_smem()
# (which syncs the warpgroup) in between: Pallas's automatic warpgroup barriers around every SMEM /
# GMEM store and TMA issue guard nothing there.
NO_AUTO_BARRIERS = plgpu.CompilerParams(unsafe_no_auto_barriers=True)


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two that divides ``n`` and is at most ``cap``."""
  p = 1
  while p < cap and n % (2 * p) == 0:
    p *= 2
  return p


def row_layout(width: int, itemsize: int, max_lanes: int = 32):
  """Register layout for a ``(rows, width)`` tile read straight from / written straight to GMEM.

  Each thread holds vectors of up to 16 bytes (``itemsize`` is the widest element type involved)
  that lie along a row, consecutive lanes (then warps) cover consecutive vectors of a row and the
  remaining lanes / warps consecutive rows, so a warp reads whole contiguous row segments
  (coalesced) and a reduction along the row is a vector, warp-shuffle (and, when warps share a row,
  SMEM) reduction. At most ``max_lanes`` lanes share a row (warps share rows only with 32 lanes);
  a row wider than the lanes' vectors repeats over registers.

  Returns ``(layout, rows)``: the Pallas layout and the number of rows it covers once (a tile's
  row count must be a multiple of it).
  """
  v = math.gcd(16 // itemsize, width)
  nvec = width // v
  lanes_c = _pow2_divisor(nvec, max_lanes)
  warps_c = _pow2_divisor(nvec // lanes_c, 4) if lanes_c == 32 else 1
  lanes_r, warps_r = 32 // lanes_c, 4 // warps_c
  tiling = mgpu_fa.Tiling(((warps_r * lanes_r, warps_c * lanes_c * v), (lanes_r, lanes_c * v), (v,)))
  lay = mgpu_fa.TiledLayout(tiling, (-5, -4), (-3, -2), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim), warps_r * lanes_r


def group_layout(groups: int, group: int, itemsize: int):
  """Register layout for a ``(rows, groups, group)`` view of rows cut into groups of ``group`` consecutive
  values, each group held whole by one thread.

  Each thread holds its group as vectors of up to 16 bytes (``itemsize`` is the widest element type
  involved), so GMEM loads and stores of whole groups are contiguous vectors; consecutive lanes (then
  warps) take consecutive groups of a row, the remaining lanes / warps consecutive rows (as
  :func:`row_layout`). Because the group dimension lies in one thread's registers, an iota along it is a
  compile-time constant per register and vector element: selects on it fold away, and a reduction along
  it is in-thread. ``layout.reduce(2)`` is the matching layout of one value per group.

  Returns ``(layout, rows)``: the Pallas layout and the number of rows it covers once.
  """
  v = math.gcd(16 // itemsize, group)
  lanes_c = _pow2_divisor(groups, 32)
  warps_c = _pow2_divisor(groups // lanes_c, 4) if lanes_c == 32 else 1
  lanes_r, warps_r = 32 // lanes_c, 4 // warps_c
  tiling = mgpu_fa.Tiling(((warps_r * lanes_r, warps_c * lanes_c, group), (lanes_r, lanes_c, group), (v,)))
  lay = mgpu_fa.TiledLayout(tiling, (-7, -6), (-4, -3), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim), warps_r * lanes_r



def group_vectors_layout(groups: int, group: int, itemsize: int):
  """Register layout for a ``(rows, groups, parts, vec)`` view of rows cut into groups of ``group = parts·vec``
  consecutive values, ``vec`` = 16 bytes of ``itemsize``: the ``parts`` vectors of a group lie on consecutive
  lanes, so one vector access of a warp covers a contiguous 512-byte span (a thread holding whole groups of
  32 bytes, :func:`group_layout`, would leave every access half-strided). An iota along the last dimension
  is a compile-time constant per vector element, one along ``parts`` a lane property.
  ``layout.reduce(3).reduce(2)`` holds one value per group, replicated over the group's lanes.

  Returns ``(layout, rows)``: the Pallas layout and the number of rows it covers once.
  """
  vec = min(16 // itemsize, group)
  parts = group // vec
  lanes_c = _pow2_divisor(groups, 32 // parts)
  warps_c = _pow2_divisor(groups // lanes_c, 4) if lanes_c * parts == 32 else 1
  lanes_r, warps_r = 32 // (lanes_c * parts), 4 // warps_c
  tiling = mgpu_fa.Tiling(((warps_r * lanes_r, warps_c * lanes_c, parts, vec), (lanes_r, lanes_c, parts, vec),
                           (vec,)))
  lay = mgpu_fa.TiledLayout(tiling, (-9, -8), (-5, -4, -3), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim), warps_r * lanes_r

def flat_layout(vec: int):
  """Register layout of a 1-D array spread over one warpgroup: each thread holds vectors of ``vec``
  consecutive elements, consecutive lanes (then warps) consecutive vectors, so a warp reads
  ``32·vec`` contiguous elements (coalesced) and the layout covers ``128·vec`` elements once (the
  array's length must be a multiple of that; longer arrays repeat over registers). A reduction to a
  scalar is a vector, warp-shuffle and SMEM reduction."""
  tiling = mgpu_fa.Tiling(((128 * vec,), (32 * vec,), (vec,)))
  lay = mgpu_fa.TiledLayout(tiling, (-3,), (-2,), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim)


def flat_chunks(width: int, itemsize: int):
  """Static column chunks ``(offset, length, vec)`` covering ``width`` with :func:`flat_layout`
  layouts: the widest 16-byte vectors first (``vec = 16 / itemsize``), then halves for the rest.
  ``width`` must be a multiple of ``128·vec_min`` with ``vec_min = 2`` (a multiple of 256)."""
  chunks, off, vec = [], 0, 16 // itemsize
  while off < width:
    n = (width - off) // (128 * vec) * (128 * vec)
    if n:
      chunks.append((off, n, vec))
      off += n
    vec //= 2
    if vec == 0 and off < width:
      raise ValueError(f"width {width} is not a multiple of 128")
  return tuple(chunks)
