"""``mask_indices_by_tp``: EP/TP masking and local renumbering of expert ids (spec §3.6, §6.4).

Mosaic GPU kernel on the flat ``T*K`` int32 entries, one warpgroup per CTA and no shared
memory: a CTA maps ``ELEMS_PER_CTA`` consecutive entries, read and written straight between
GMEM and registers in 16-byte vectors (a strided layout: consecutive threads, consecutive
vectors). The divisions by the static ``R`` and ``num_tp_ranks`` are divisions by constants;
``tp_rank`` is a scalar read from GMEM, so a traced rank does not recompile. The last CTA
starts at the last vector-aligned window (it recomputes entries of the previous one) and also
maps the up to 3 entries past the last whole vector with scalar code, so ragged ``T*K`` needs
no masking; fewer than one CTA's entries are padded. int64 indices (only with ``jax_enable_x64``)
and ``K`` in ``XLA_TOPK`` run the ``jnp`` reference.

H200 (CUPTI, cold L2, median of 30; two sessions), XLA reference in brackets: K = 9: 1.95-2.30 us
(2.21-2.88; XLA does not vectorise rows of 9 int32). K = 2: 1.44-1.52 (1.47-1.60) and K = 8:
1.87-2.14 (2.02-2.11), ties to within about +-8% that went the kernel's way more often than not.
K = 6: 1.70-1.98 (1.73-1.98), 0.92-1.03x, so that K keeps the reference's XLA fusion. This is the
floor of a one-pass streaming kernel at these sizes: 512, 1024 or 2048 entries per CTA
(1.79-2.38 us) and a Pallas-Triton flat kernel (1.76-2.98) were not faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref
from jaxkern.reference.moe import mask_by_tp

VEC = 4  # int32 entries per 16-byte vector
ELEMS_PER_CTA = 128 * VEC  # one vector per thread
XLA_TOPK = (6,)  # K values that run the reference (see the module docstring)


@functools.partial(jax.jit, static_argnames=("r", "tp", "elems_per_cta", "interpret"))
def _kernel(indices, tp_rank, *, r, tp, elems_per_cta=ELEMS_PER_CTA, interpret=None):
  n = indices.size
  flat = indices.reshape(n)
  block = min(elems_per_cta, max(n // (128 * VEC), 1) * 128 * VEC)
  npad = max(n, block)
  if npad != n:  # fewer entries than one CTA maps: pad (tiny inputs only)
    flat = jnp.pad(flat, (0, npad - n))
  nvec = npad // VEC * VEC
  grid = pl.cdiv(nvec, block)
  layout = plgpu.Layout.WG_STRIDED((block,), vec_size=VEC)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((npad,), jnp.int32), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(x_g, rank_g, o_g):
    i = lax.axis_index("i")
    rank = rank_g[0]
    s = pl.ds(jnp.minimum(i * block, nvec - block), block)
    o_g[s] = mask_by_tp(plgpu.load(x_g.at[s], layout=layout), r, rank, tp)
    if nvec != npad:
      @pl.when(i == grid - 1)
      def _tail():
        for j in range(nvec, npad):
          o_g[j] = mask_by_tp(x_g[j], r, rank, tp)

  out = kernel(flat, jnp.asarray(tp_rank, jnp.int32).reshape(1))
  return out[:n].reshape(indices.shape)


def mask_indices_by_tp(indices: jax.Array, n: int, num_ep_ranks: int, tp_rank, num_tp_ranks: int, *,
                       implementation: str | None = None) -> jax.Array:
  """Keeps the experts of EP ranks ``q`` with ``q % num_tp_ranks == tp_rank``, renumbered densely.

  With ``R = n // num_ep_ranks`` and ``q = p // R``: ``p -> (q // num_tp_ranks) * R + p % R`` when
  kept, else -1; negative entries become -1.

  Args:
    indices: ``(T, K)`` int32 or int64 global expert ids.
    n: total experts over all EP ranks (static).
    num_ep_ranks, num_tp_ranks: static rank counts.
    tp_rank: this TP rank (int or traced int32 scalar).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    Array of the shape and dtype of ``indices``.
  """
  _routing.check_index("indices", indices, 2)
  if num_ep_ranks < 1 or n < num_ep_ranks:
    raise ValueError(f"num_ep_ranks must be in [1, n], got num_ep_ranks={num_ep_ranks}, n={n}")
  if num_tp_ranks < 1:
    raise ValueError(f"num_tp_ranks must be positive, got {num_tp_ranks}")
  if isinstance(tp_rank, int) and not 0 <= tp_rank < num_tp_ranks:
    raise ValueError(f"tp_rank must be in [0, {num_tp_ranks}), got {tp_rank}")
  impl = _config.get_implementation(implementation)
  if (impl == "reference" or indices.size == 0 or indices.dtype != jnp.int32
      or indices.shape[1] in XLA_TOPK):
    return ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
  return _kernel(indices, tp_rank, r=n // num_ep_ranks, tp=num_tp_ranks, interpret=_config.mosaic_interpret(impl))
