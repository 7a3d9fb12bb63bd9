"""``mask_indices_by_tp``: EP/TP masking and local renumbering of expert ids (docs/moe.md, "Helpers").

Mosaic GPU kernel on the flat ``T*K`` int32 entries, one warpgroup per CTA and no shared
memory: a CTA maps 128 vectors of consecutive entries, read and written straight between GMEM
and registers (a strided layout: consecutive threads, consecutive vectors). The divisions by the
static ``R`` and ``num_tp_ranks`` are divisions by constants. A Python-int ``tp_rank`` is baked
into the kernel (one compilation per rank, 8-byte vectors); a traced one is a scalar read from
GMEM (16-byte vectors), which costs about 0.1 us at these sizes. The last CTA starts at the last
vector-aligned window (it recomputes entries of the previous one) and also maps the entries past
the last whole vector with scalar code, so ragged ``T*K`` needs no masking; fewer than one CTA's
entries are padded. int64 indices (only with ``jax_enable_x64``: the kernel maps int32) run the
``jnp`` reference; so do, under ``"auto"``, ``K`` in ``XLA_TOPK`` with a traced rank and ``K = 8``
from 2^18 entries on (``XLA_MIN_ENTRIES``), where XLA measured faster.

H200 (CUPTI, cold L2, median of 30), XLA reference in brackets. Static rank (2026-11-25): K = 2
1.41-1.49 us (1.44-1.52), K = 6 1.66-1.79 (1.70-1.92; XLA's own ``~x`` of the same array takes
1.66-1.73, the floor of one pass over these bytes), K = 8 1.78-1.92 (2.02-2.05), K = 9 1.86-2.27
(2.18-2.87; XLA does not vectorise rows of 9 int32). Traced rank: K = 2 1.44-1.52 (1.47-1.60), K = 8
1.87-2.14 (2.02-2.11), K = 9 1.95-2.30 (2.21-2.88), K = 6 1.82-1.90 against 1.70-1.98, so a traced
rank leaves K = 6 to XLA. K = 8 from 2^18 entries (E=4x64 T=34186) ran 2.08-2.16 against
1.95-2.08 with either rank. 512 to 2048 entries per CTA with a traced rank, 128 or 256 entries per
CTA with a static one, and a Pallas-Triton flat kernel (1.76-2.98) were not faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch
from jaxkern._layouts import NO_AUTO_BARRIERS
from jaxkern.moe import _routing
from jaxkern.reference import moe as ref
from jaxkern.reference.moe import mask_by_tp

VEC = 4  # int32 entries per thread (one 16-byte vector) with a traced rank
STATIC_VEC = 2  # with a static rank
XLA_TOPK = (6,)  # K values that run the reference with a traced rank (see the module docstring)
XLA_MIN_ENTRIES = {8: 1 << 18}  # K -> from this many entries on, the reference (module docstring)


@functools.partial(jax.jit, static_argnames=("r", "tp", "rank", "vec", "interpret"))
def _kernel(indices, rank_g=None, *, r, tp, rank=None, vec=VEC, interpret=None):
  """``rank``: the static TP rank, or None to read it from the int32 scalar ``rank_g``."""
  n = indices.size
  flat = indices.reshape(n)
  block = 128 * vec
  npad = max(n, block)
  if npad != n:  # fewer entries than one CTA maps: pad (tiny inputs only)
    flat = jnp.pad(flat, (0, npad - n))
  nvec = npad // vec * vec
  grid = pl.cdiv(nvec, block)
  layout = plgpu.Layout.WG_STRIDED((block,), vec_size=vec)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((npad,), jnp.int32), grid=(grid,),
                     grid_names=("i",), compiler_params=NO_AUTO_BARRIERS, interpret=interpret)
  def kernel(x_g, *refs):
    o_g = refs[-1]
    i = lax.axis_index("i")
    rank_v = rank if rank is not None else refs[0][0]
    s = pl.ds(jnp.minimum(i * block, nvec - block), block)
    o_g[s] = mask_by_tp(plgpu.load(x_g.at[s], layout=layout), r, rank_v, tp)
    if nvec != npad:
      @pl.when(i == grid - 1)
      def _tail():
        for j in range(nvec, npad):
          o_g[j] = mask_by_tp(x_g[j], r, rank_v, tp)

  args = (flat,) if rank is not None else (flat, jnp.asarray(rank_g, jnp.int32).reshape(1))
  return kernel(*args)[:n].reshape(indices.shape)


def _xla_faster(indices, static: bool) -> str | None:
  """Why ``"auto"`` on a GPU leaves these indices to XLA (measured; module docstring), or None."""
  k = indices.shape[1]
  if not static and k in XLA_TOPK:
    return f"K = {k} in XLA_TOPK with a traced tp_rank (XLA's fusion ties or beats the kernel there)"
  if indices.size >= XLA_MIN_ENTRIES.get(k, indices.size + 1):
    return f"K = {k} with {indices.size} >= XLA_MIN_ENTRIES[{k}] = {XLA_MIN_ENTRIES[k]} entries"
  return None


def mask_indices_by_tp(indices: jax.Array, n: int, num_ep_ranks: int, tp_rank: int | jax.Array, num_tp_ranks: int,
                       *, implementation: str | None = None) -> jax.Array:
  """Keeps the experts of EP ranks ``q`` with ``q % num_tp_ranks == tp_rank``, renumbered densely.

  With ``R = n // num_ep_ranks`` and ``q = p // R``: ``p -> (q // num_tp_ranks) * R + p % R`` when
  kept, else -1; negative entries become -1.

  Args:
    indices: ``(T, K)`` int32 or int64 array (or nested list) of global expert ids. Precondition: every entry
      below ``n``. A concrete array with an entry ``>= n`` raises; a traced one gets the formula above (no
      meaningful id), and ``checkify.checkify(f,
      errors=checkify.user_checks)`` reports the first such entry (docs/usage.md, "Bad values under jit").
    n: total experts over all EP ranks (static).
    num_ep_ranks: static EP rank count in ``[1, n]``.
    tp_rank: this TP rank: a Python int in ``[0, num_tp_ranks)`` (baked into the kernel) or a traced
      int32 scalar (read by the kernel; out of range, nothing is kept, and checkify reports it).
    num_tp_ranks: static TP rank count (positive).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`).

  Returns:
    Array of the shape and dtype of ``indices``.

  Raises:
    ValueError: ``indices`` not of rank 2 or of another dtype (bool included); ``num_ep_ranks``,
      ``num_tp_ranks`` or a Python-int ``tp_rank`` out of range; a concrete ``indices`` entry ``>= n``.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with int64 indices.

  XLA instead of a kernel: int64 indices, zero-size arrays and, under ``"auto"`` on a GPU, the
  measured cases of the module docstring (``K`` in ``XLA_TOPK`` with a traced ``tp_rank``; ``K = 8``
  from ``XLA_MIN_ENTRIES[8]`` = 2^18 entries).
  """
  indices = _routing.check_index("indices", indices, 2)
  if num_ep_ranks < 1 or n < num_ep_ranks:
    raise ValueError(f"num_ep_ranks must be in [1, n], got num_ep_ranks={num_ep_ranks}, n={n}")
  if num_tp_ranks < 1:
    raise ValueError(f"num_tp_ranks must be positive, got {num_tp_ranks}")
  static = isinstance(tp_rank, (int, np.integer))
  if static and not 0 <= tp_rank < num_tp_ranks:
    raise ValueError(f"tp_rank must be in [0, {num_tp_ranks}), got {tp_rank}")
  _checks.check_and_debug_check("mask_indices_by_tp", "indices", indices, lambda v: v >= n,
                                f"a negative value (unused) or an expert id in [0, {n}) (n)")
  if not static:
    _checks.debug_check_entries("mask_indices_by_tp", "tp_rank", jnp.asarray(tp_rank),
                                lambda v: (v < 0) | (v >= num_tp_ranks),
                                f"a TP rank in [0, {num_tp_ranks}) (num_tp_ranks; otherwise nothing is kept)")
  r = n // num_ep_ranks

  def kernel(interpret):
    mosaic = _config.mosaic_interpret(interpret)
    if static:
      return _kernel(indices, r=r, tp=num_tp_ranks, rank=int(tp_rank), vec=STATIC_VEC, interpret=mosaic)
    return _kernel(indices, tp_rank, r=r, tp=num_tp_ranks, interpret=mosaic)

  return _dispatch.run(
      "mask_indices_by_tp", implementation, kernel=kernel,
      xla=lambda: ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks),
      unsupported=None if indices.dtype == jnp.int32 else f"{indices.dtype} indices (the kernel maps int32)",
      xla_faster=_xla_faster(indices, static), empty=indices.size == 0)
