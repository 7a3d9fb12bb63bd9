"""``topk_gate``: per-row top-k expert indices as a Mosaic GPU kernel (spec moe_transpose.md §4.1).

One CTA (one warpgroup) takes 64 token rows: TMA copies the ``(64, E)`` block
into SMEM (in chunks of at most 64 columns), it is loaded into registers in the
WGMMA layout and turned into int32 order keys, then ``K`` rounds of "row max,
smallest column holding it, mark it taken" produce the slots best-first. Each
slot is stored straight from registers into its column of the ``(T, K)`` output.
Rows count that is not a multiple of 64 is handled by shifting the last block back
(rows computed twice give identical values). ``E`` not a multiple of 8 is padded
with ``-inf`` columns by XLA before the kernel, and fewer than 64 tokens are padded
to 64 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkern import _checks, _config, _dispatch
from jaxkern.moe import _select
from jaxkern.reference import moe as ref


def pad_rows_and_cols(x: jax.Array, fill) -> jax.Array:
  """Pads ``(T, E)`` to at least 64 rows and a multiple of 8 columns with ``fill``."""
  t, e = x.shape
  pt, pe = max(_select.BLOCK_ROWS - t, 0), _select.padded_width(e) - e
  return jnp.pad(x, ((0, pt), (0, pe)), constant_values=fill) if pt or pe else x


@functools.partial(jax.jit, static_argnames=("num_topk", "num_experts", "interpret"))
def _topk_gate_kernel(scores: jax.Array, num_topk: int, num_experts: int, interpret=None) -> jax.Array:
  t, e = scores.shape

  def body(row0, x_g, o_g, smem, bars):
    keys = _select.load_keys(x_g, smem, bars, row0, e)
    for k in range(num_topk):
      _, idx, keys = _select.pick_best(keys, num_experts)
      o_g[pl.ds(row0, _select.BLOCK_ROWS), k] = idx

  out_type = jax.ShapeDtypeStruct((t, num_topk), jnp.int32)
  return _select.row_block_kernel(body, t, out_type, _select.scratch(e), interpret)(scores)


def topk_gate(scores: jax.Array, num_topk: int, *, implementation: str | None = None) -> jax.Array:
  """Indices of the ``num_topk`` largest scores of each row, best first, ties -> smaller index.

  Args:
    scores: ``(T, E)`` float32 (an array or a nested list).
    num_topk: ``1 <= num_topk <= E`` (static).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(T, num_topk)`` int32 (int64 upstream; spec §9.1). NaN ranks as ``-inf`` and ``-0.0`` as
    ``+0.0``; rows with fewer than ``num_topk`` finite scores still get distinct indices.

  Raises:
    ValueError: ``scores`` not a rank-2 float32 array (bool included), or ``num_topk`` out of range.

  XLA instead of a kernel: ``T == 0`` (an empty result). The Mosaic GPU kernel runs every other
  case (``"auto"`` off a GPU runs the reference).

  Differentiation: indices only; the scores get a zero cotangent (as the indices of ``jax.lax.top_k``).
  """
  scores = _checks.as_array("scores", scores)
  _checks.check_rank("scores", scores, 2)
  _checks.check_dtype("scores", scores, (jnp.float32,))
  t, e = scores.shape
  if not 1 <= num_topk <= e:
    raise ValueError(f"num_topk must be in [1, {e}] (the number of experts), got {num_topk}")
  scores = jax.lax.stop_gradient(scores)  # piecewise-constant indices: a zero derivative, no kernel JVP

  def kernel(interpret):
    x = pad_rows_and_cols(scores, -jnp.inf)
    out = _topk_gate_kernel(x, num_topk, e, interpret=_config.mosaic_interpret(interpret))
    return out[:t] if x.shape[0] != t else out

  return _dispatch.run("topk_gate", implementation, kernel=kernel, xla=lambda: ref.topk_gate(scores, num_topk),
                       empty=t == 0)
