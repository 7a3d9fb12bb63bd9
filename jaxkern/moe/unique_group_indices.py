"""``unique_group_indices``: functional form of upstream's ``inplace_unique_group_indices`` (spec §6.5).

Mosaic GPU kernel, one warpgroup per CTA and no shared memory: a CTA owns ``ROWS_PER_CTA``
rows, each thread whole rows. Column ``k`` of the CTA's rows is one strided GMEM load (a
warp's loads of the ``K`` columns hit the same cache lines); entry ``j`` becomes -1 when it is
non-negative and equal to one of the entries before it (``K(K-1)/2`` register compares, no
``num_groups``-sized table) and every column is stored back. The last CTA starts at
``T - ROWS_PER_CTA`` (it recomputes rows of the previous one), so ragged ``T`` needs no
masking; fewer than 128 rows are padded. int64 indices (only with ``jax_enable_x64``) and ``K``
outside ``KERNEL_TOPK`` (where XLA measured faster) run the ``jnp`` reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref

ROWS_PER_CTA = 128  # one row per thread
# K values that run the kernel. H200 (CUPTI, cold L2, groups=8): K = 2: 1.44-1.47 us vs XLA
# 2.50-2.85; K = 8: 3.42-4.50 vs 4.48-4.69; but K = 6: 1.98-2.14 vs 1.79-2.05 and K = 9: 3.81-5.41
# vs 2.37-3.20, so those keep the single XLA fusion of the reference.
KERNEL_TOPK = (2, 8)


@functools.partial(jax.jit, static_argnames=("rows_per_cta", "interpret"))
def _kernel(g, *, rows_per_cta=ROWS_PER_CTA, interpret=None):
  t, k = g.shape
  g, rt, grid, layout = _routing.thread_rows(g, rows_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct(g.shape, jnp.int32), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(g_g, o_g):
    rows, cols = _routing.load_thread_rows(g_g, rt, layout)
    for j, c in enumerate(cols):
      if j:
        dup = functools.reduce(jnp.logical_or, [c == e for e in cols[:j]])
        c = jnp.where(dup & (c >= 0), jnp.int32(-1), c)
      o_g[rows, j] = c

  return kernel(g)[:t]


def unique_group_indices(group_indices: jax.Array, num_groups: int, *,
                         implementation: str | None = None) -> jax.Array:
  """Replaces each repeated non-negative value of a row (after its first occurrence) by -1.

  Negative values are kept unchanged (the upstream kernel's behaviour).

  Args:
    group_indices: ``(T, K)`` int32 or int64.
    num_groups: number of groups (static; upstream requires ``<= 128``; the kernel does not
      depend on it).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    The new array (same shape and dtype); upstream modifies its argument in place.
  """
  _routing.check_index("group_indices", group_indices, 2)
  if not 1 <= num_groups <= 128:
    raise ValueError(f"num_groups must be in [1, 128], got {num_groups}")
  impl = _config.get_implementation(implementation)
  if (impl == "reference" or group_indices.size == 0 or group_indices.dtype != jnp.int32
      or group_indices.shape[1] not in KERNEL_TOPK):
    return ref.unique_group_indices(group_indices, num_groups)
  return _kernel(group_indices, interpret=_config.mosaic_interpret(impl))
