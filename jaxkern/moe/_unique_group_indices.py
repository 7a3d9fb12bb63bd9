"""``unique_group_indices``: functional form of upstream's ``inplace_unique_group_indices`` (docs/moe.md, "Helpers").

Mosaic GPU kernel, one warpgroup per CTA: a CTA owns ``ROWS_PER_CTA`` rows, each thread one row.
Rows of up to ``DIRECT_MAX_TOPK`` entries are read and written column by column straight from
GMEM (one strided load per column); wider rows go through shared memory
(:func:`jaxkern.moe._routing.load_staged_rows`: coalesced vector loads and stores of the CTA's
``(128, K)`` block, each thread's columns read and written in SMEM). Entry ``j`` becomes -1 when
it is non-negative and equal to one of the entries before it (``K(K-1)/2`` register compares, no
``num_groups``-sized table). The last CTA starts at ``T - 128`` (it recomputes rows of the
previous one), so ragged ``T`` needs no masking; fewer than 128 rows are padded.

H200 (CUPTI, cold L2, groups = 8, median of 30), XLA reference in brackets: K = 2 direct
1.41-1.47 us (2.59-2.82), through SMEM 1.49-1.54; K = 8 through SMEM 1.95-2.16 (4.50-4.69;
direct 3.41-4.48); K = 9 1.98-2.27 (2.37-3.23; direct 3.90-5.41). K = 6 (the block in 8-byte
vectors, H200, 2026-11-25): 1.76-1.82 against XLA's 1.73-1.76 below 2^17 entries (T = 18506, 19444;
XLA's own ``~x`` of the same array takes 1.66, the floor of one pass over these bytes), so
``XLA_BELOW_ENTRIES`` keeps the reference's single XLA fusion there under ``"auto"``, and 1.82-1.86 against
1.98 at T = 26991 (162k entries), where the kernel runs. int64 indices (only with ``jax_enable_x64``: the
kernel maps int32) run the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _config, _dispatch
from jaxkern.moe import _routing
from jaxkern.reference import moe as ref

ROWS_PER_CTA = 128  # one row per thread
DIRECT_MAX_TOPK = 2  # wider rows are staged through SMEM
XLA_BELOW_ENTRIES = {6: 1 << 17}  # K -> below this many entries, the reference (module docstring)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _kernel(g, *, interpret=None):
  t, k = g.shape
  staged = k > DIRECT_MAX_TOPK
  g, rt, grid, layout = _routing.thread_rows(g, ROWS_PER_CTA)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct(g.shape, jnp.int32), grid=(grid,),
                     grid_names=("i",), scratch_types=[plgpu.SMEM((rt, k), jnp.int32)] if staged else [],
                     compiler_params=_routing.LANE if staged else None, interpret=interpret)
  def kernel(g_g, o_g, *scratch):
    if staged:
      rows, cols = _routing.load_staged_rows(g_g, scratch[0], rt, layout)
    else:
      rows, cols = _routing.load_thread_rows(g_g, rt, layout)
    out = [cols[0]]
    for j, c in enumerate(cols[1:], 1):
      dup = functools.reduce(jnp.logical_or, [c == e for e in cols[:j]])
      out.append(jnp.where(dup & (c >= 0), jnp.int32(-1), c))
    if staged:
      _routing.store_staged_rows(o_g, scratch[0], rows, out)
    else:
      for j, c in enumerate(out):
        o_g[rows, j] = c

  return kernel(g)[:t]


def unique_group_indices(group_indices: jax.Array, num_groups: int, *,
                         implementation: str | None = None) -> jax.Array:
  """Replaces each repeated non-negative value of a row (after its first occurrence) by -1.

  Negative values are kept unchanged (the upstream kernel's behaviour); so are values
  ``>= num_groups`` (compared like any other).

  Args:
    group_indices: ``(T, K)`` int32 or int64 array (or nested list).
    num_groups: number of groups (static, in ``[1, 128]`` as upstream requires; the kernel does not
      depend on it).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`).

  Returns:
    The new array (same shape and dtype); upstream modifies its argument in place.

  Raises:
    ValueError: ``group_indices`` not of rank 2 or of another dtype (bool included); ``num_groups``
      outside ``[1, 128]``.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with int64 indices.

  XLA instead of a kernel: int64 indices, zero-size arrays and, under ``"auto"`` on a GPU, ``K`` in
  ``XLA_BELOW_ENTRIES`` below its entry count (``K = 6`` below 2^17 entries; module docstring).
  """
  group_indices = _routing.check_index("group_indices", group_indices, 2)
  if not 1 <= num_groups <= 128:
    raise ValueError(f"num_groups must be in [1, 128], got {num_groups}")
  k, size = group_indices.shape[1], group_indices.size
  xla_faster = None
  if size < XLA_BELOW_ENTRIES.get(k, 0):
    xla_faster = f"K = {k} with {size} < XLA_BELOW_ENTRIES[{k}] = {XLA_BELOW_ENTRIES[k]} entries"
  return _dispatch.run(
      "unique_group_indices", implementation,
      kernel=lambda interpret: _kernel(group_indices, interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: ref.unique_group_indices(group_indices, num_groups),
      unsupported=None if group_indices.dtype == jnp.int32 else f"{group_indices.dtype} indices (the kernel "
                                                                  "maps int32)",
      xla_faster=xla_faster, empty=size == 0)
