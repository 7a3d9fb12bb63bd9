"""``topk_gate``: per-row top-k expert indices as a Mosaic GPU kernel (docs/moe.md, "topk_gate").

One CTA (one warpgroup) takes 64 token rows: TMA copies the ``(64, E)`` block
into SMEM (in chunks of at most 64 columns), it is loaded into registers in the
WGMMA layout and turned into int32 order keys, then ``K`` rounds of "row max,
smallest column holding it, mark it taken" produce the slots best-first. Each
slot is stored straight from registers into its column of the ``(T, K)`` output.
Rows count that is not a multiple of 64 is handled by shifting the last block back
(rows computed twice give identical values). ``E`` not a multiple of 8 is padded
with ``-inf`` columns by XLA before the kernel, and fewer than 64 tokens are padded
to 64 rows.

Many experts (:func:`_variant`): the WGMMA layout gives each thread two rows of ``E/4`` keys and a CTA 64
rows, so at ``E >= 96`` the ``K`` serial max / min passes over ``E/4`` keys per thread, on only
``T/64`` CTAs (63 for 4001 tokens: half the SMs), set the time. :func:`_narrow_rows_kernel` loads the rows
straight from GMEM in :func:`jaxkern._layouts.row_layout` with ``LANES_PER_ROW`` lanes per row (16-byte
vectors), so a thread holds ``E / LANES_PER_ROW`` keys, a CTA ``512 / LANES_PER_ROW`` rows, and the
reductions are in-thread plus lane shuffles (the split TileKernels uses: one warp per row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch
from jaxkern._layouts import row_layout
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


# From this many experts "auto" runs the narrow-rows kernel. H100, 2026-11-27 (CUPTI, cold L2; benchmarks/results/
# variants/2026-11-27_NVIDIA-H100-80GB-HBM3_topk-gate-narrow-rows.jsonl), K=6, µs WGMMA-layout kernel -> narrow
# (8 lanes): T=4001: E=36 4.74 -> 2.82, E=64 3.54 -> 3.17, E=72 4.00 -> 3.55; T=8001: E=36 5.28 -> 3.39,
# E=64 4.14 -> 4.26, E=72 4.83 -> 4.93; 96+ experts measured on an H100, 2026-11-26. E=16 / 32 not timed: they keep
# the WGMMA-layout kernel.
NARROW_MIN_EXPERTS = 36
LANES_PER_ROW = 8  # lanes sharing one row in the narrow-rows kernel (at most 16: warps never share a row)
_VARIANT_OVERRIDE = None  # "wgmma" / "narrow" / ("narrow", lanes): forces a kernel (timing scripts only)


def _variant(num_experts: int):
  """``("wgmma", None)`` or ``("narrow", lanes per row)`` for ``num_experts`` experts."""
  v = _VARIANT_OVERRIDE
  if v is None:
    v = "narrow" if num_experts >= NARROW_MIN_EXPERTS else "wgmma"
  if isinstance(v, tuple):
    return v
  return (v, LANES_PER_ROW if v == "narrow" else None)


def _narrow_layout(e: int, lanes: int):
  """``(layout, rows)`` of a ``(rows, e)`` float32 block: up to ``lanes`` (at most 16) lanes per row, with the
  widest vectors (4, 2, 1 values) that still give the row that many lanes (``E = 108``: 4 lanes of 1-value
  vectors; no padded columns)."""
  lanes = min(lanes, 16)
  for itemsize in (4, 8, 16):  # 16-byte budget over the item size: vectors of 4, 2, 1 float32
    lay, rows = row_layout(e, itemsize, max_lanes=lanes)
    if 128 // rows >= lanes:
      break
  return lay, rows


@functools.partial(jax.jit, static_argnames=("num_topk", "num_experts", "lanes", "interpret"))
def _narrow_rows_kernel(scores: jax.Array, num_topk: int, num_experts: int, lanes: int, interpret=None) -> jax.Array:
  """``scores`` ``(T, E)`` (``T >=`` the layout's rows) -> ``(T, K)`` int32; the last CTA's rows are moved
  back to end at ``T`` (rows computed twice give the same values)."""
  t, e = scores.shape
  lay, rt = _narrow_layout(e, lanes)
  red = lay.reduce(1)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, num_topk), jnp.int32),
                     grid=(pl.cdiv(t, rt),), grid_names=("i",), interpret=interpret)
  def kernel(x_g, o_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, t - rt), rt)
    keys = _select.order_key(plgpu.load(x_g.at[rows], layout=lay, optimized=False))
    col = plgpu.broadcasted_iota(jnp.int32, (rt, e), 1, layout=lay)
    for k in range(num_topk):
      m = jnp.max(keys, axis=1)
      idx = jnp.min(jnp.where(keys == m[:, None], col, num_experts), axis=1)
      if k + 1 < num_topk:
        keys = jnp.where(col == idx[:, None], _select.TAKEN, keys)
      o_g[rows, k] = plgpu.layout_cast(idx, red) if interpret is None else idx

  return kernel(scores)


def topk_gate(scores: jax.Array, num_topk: int, *, implementation: str | None = None) -> jax.Array:
  """Indices of the ``num_topk`` largest scores of each row, best first, ties -> smaller index.

  Args:
    scores: ``(T, E)`` float32 (an array or a nested list).
    num_topk: ``1 <= num_topk <= E`` (static).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(T, num_topk)`` int32 (int64 upstream; docs/moe.md, "Conventions"). NaN ranks as ``-inf`` and ``-0.0`` as
    ``+0.0``; rows with fewer than ``num_topk`` finite scores still get distinct indices.

  Non-finite scores: ``±inf`` rank as values (``-inf`` is the usual way to exclude an expert); a NaN ranks as
  ``-inf`` in kernel and reference alike, so its row's indices look valid: under ``checkify.checkify(f,
  errors=checkify.user_checks)`` the first NaN score is reported (docs/usage.md, "Bad values under jit").

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
  _checks.debug_check_nan("topk_gate", "scores", scores, "NaN ranks as -inf; the indices would look valid")
  scores = jax.lax.stop_gradient(scores)  # piecewise-constant indices: a zero derivative, no kernel JVP

  def kernel(interpret):
    variant, lanes = _variant(e)
    if variant == "narrow":  # no padded columns (an XLA pad is a launch of its own); fewer rows than a CTA padded
      rt = _narrow_layout(e, lanes)[1]
      x = jnp.pad(scores, ((0, rt - t), (0, 0)), constant_values=-jnp.inf) if t < rt else scores
      out = _narrow_rows_kernel(x, num_topk, e, lanes, interpret=_config.mosaic_interpret(interpret))
      return out[:t] if x.shape[0] != t else out
    x = pad_rows_and_cols(scores, -jnp.inf)
    out = _topk_gate_kernel(x, num_topk, e, interpret=_config.mosaic_interpret(interpret))
    return out[:t] if x.shape[0] != t else out

  return _dispatch.run("topk_gate", implementation, kernel=kernel, xla=lambda: ref.topk_gate(scores, num_topk),
                       empty=t == 0)
