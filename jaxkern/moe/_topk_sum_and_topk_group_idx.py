"""``topk_sum_and_topk_group_idx``: rank expert groups per token, Mosaic GPU (docs/moe.md, "topk_sum_and_topk_group_idx").

Same row blocking as :mod:`jaxkern.moe._topk_gate` (64 token rows per CTA, TMA into
SMEM, WGMMA register layout, int32 order keys). Each group's score is a masked row
max (and, for ``num_topk_sum = 2``, a second max with the first occurrence of the
best marked taken, summed in fp32). A group's rank counts the groups that beat it
(higher score, or equal score and smaller index); output slot ``r`` holds the
group of rank ``r``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkern import _checks, _config, _dispatch
from jaxkern.moe import _select
from jaxkern.moe._topk_gate import pad_rows_and_cols
from jaxkern.reference import moe as ref


def _unsupported(num_groups: int) -> str | None:
  """Why the kernel cannot run, or None. One group has the constant rank 0, whose splat register array
  Mosaic GPU (jax 0.11.2) cannot store as a 64-row block ("Arrays with the splat layout can only be stored
  when they have a single element or a multiple of 128 elements")."""
  if num_groups == 1:
    return "one group (scores.shape[1] == 1): every index is 0, nothing to rank"
  return None


@functools.partial(jax.jit, static_argnames=("num_groups", "group_size", "num_topk_sum", "num_topk_groups",
                                             "interpret"))
def _kernel(x: jax.Array, num_groups: int, group_size: int, num_topk_sum: int, num_topk_groups: int,
            interpret=None):
  t, e = x.shape

  def body(row0, x_g, o_g, smem, bars):
    keys = _select.load_keys(x_g, smem, bars, row0, e)
    ranks = _select.group_ranks(_select.group_scores(keys, num_groups, group_size, num_topk_sum))
    for r in range(num_topk_groups):
      out = jnp.zeros_like(ranks[0])
      for g, rank in enumerate(ranks):
        out = jnp.where(rank == r, g, out)
      o_g[pl.ds(row0, _select.BLOCK_ROWS), r] = out

  out_type = jax.ShapeDtypeStruct((t, num_topk_groups), jnp.int32)
  return _select.row_block_kernel(body, t, out_type, _select.scratch(e), interpret)(x)


def topk_sum_and_topk_group_idx(scores: jax.Array, num_topk_sum: int, num_topk_groups: int, *,
                                implementation: str | None = None) -> jax.Array:
  """The ``num_topk_groups`` best expert groups of each token, best first.

  A group's score is its best value (``num_topk_sum = 1``) or the fp32 sum of its two
  best values (``= 2``); NaN ranks as ``-inf`` (kernel and reference alike; under ``checkify.checkify(f,
  errors=checkify.user_checks)`` the first NaN score is reported, since the indices would look valid;
  docs/usage.md, "Bad values under jit"); ties go to the smaller group index.

  Args:
    scores: ``(T, G, Epg)`` float32 (an array or a nested list).
    num_topk_sum: 1 or 2 (``<= Epg``; static).
    num_topk_groups: ``1 <= num_topk_groups <= G`` (static).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(T, num_topk_groups)`` int32 group indices (int64 upstream; docs/moe.md, "Conventions").

  Raises:
    ValueError: ``scores`` not a rank-3 float32 array (bool included), or an option out of range.

  XLA instead of a kernel: ``T == 0`` (an empty result) and ``G == 1`` (nothing to rank: every index is 0;
  ``"pallas"`` / ``"interpret"`` raise :class:`jaxkern.KernelUnavailableError`). The Mosaic GPU kernel runs
  every other case (``"auto"`` off a GPU runs the reference).

  Differentiation: indices only; the scores get a zero cotangent (as the indices of ``jax.lax.top_k``).
  """
  scores = _checks.as_array("scores", scores)
  _checks.check_rank("scores", scores, 3)
  _checks.check_dtype("scores", scores, (jnp.float32,))
  t, g, epg = scores.shape
  if num_topk_sum not in (1, 2) or num_topk_sum > epg:
    raise ValueError(f"num_topk_sum must be 1 or 2 and at most scores.shape[2] = {epg}, got {num_topk_sum}")
  if not 1 <= num_topk_groups <= g:
    raise ValueError(f"num_topk_groups must be in [1, {g}] (scores.shape[1]), got {num_topk_groups}")
  _checks.debug_check_nan("topk_sum_and_topk_group_idx", "scores", scores,
                          "NaN ranks as -inf; the group indices would look valid")
  scores = jax.lax.stop_gradient(scores)  # piecewise-constant indices: a zero derivative, no kernel JVP

  def kernel(interpret):
    x = pad_rows_and_cols(scores.reshape(t, g * epg), -jnp.inf)
    out = _kernel(x, g, epg, num_topk_sum, num_topk_groups, interpret=_config.mosaic_interpret(interpret))
    return out[:t]

  return _dispatch.run("topk_sum_and_topk_group_idx", implementation, kernel=kernel,
                       xla=lambda: ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups),
                       unsupported=_unsupported(g), empty=t == 0)
