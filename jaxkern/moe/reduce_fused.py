"""``reduce_fused``: weighted fp32 sum of each token's expert-output rows (spec §5.4).

Mosaic GPU kernel on a ``(token blocks, hidden chunks)`` grid. Rows are viewed as
``(R, 256)``; a CTA owns ``BT`` tokens and ``RC`` of the ``R`` pieces. It first issues one
TMA copy per valid slot (each with its own barrier, so skipped slots cost nothing and all
copies are in flight together; the positions, weights and row scales are scalar loads issued
back to back before any wait), then, per token, waits for each slot in order and
accumulates ``acc = x * s + acc`` in fp32, casts, and writes the ``(BT, RC, 256)`` output
block with one TMA store. The last token block starts at ``T - BT`` (it recomputes a few
rows of the previous block, with identical results), so ragged ``T`` needs no masking.

Fused multiply-add: Mosaic GPU lowers vector ``a * b`` and ``a + b`` (``FragmentedArray``
in ``jax/experimental/mosaic/gpu/fragmented_array.py``: ``mulf``/``addf``) to
``arith.mulf``/``arith.addf`` with ``fastmath<contract>``; there is no explicit fma
primitive (``jax.lax`` has none, and no Mosaic GPU rule emits ``math.fma``). In this
kernel's lowered module every accumulation step is such a ``mulf`` whose only use is such
an ``addf`` (a CPU test checks this), which LLVM's NVPTX backend fuses into
``fma.rn.f32``: the single rounding the spec asks for. The ``gpu``-marked test checks the
resulting bits against the exact-FMA reference.
In interpret mode on CPU, XLA contracts ``a * b + c`` into an FMA as well. The per-slot
scale ``w * x_sf[p]`` and the final ``acc * sf`` are scalar / lone multiplies, rounded once.

Traced positions are not range-checked: a slot pointing at a row ``>= x.shape[0]`` reads
out of bounds in the kernel (TMA zero-fills such boxes) and is clamped to the last row by
the reference; keep the mapping consistent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref

CHUNK = 256  # hidden elements per TMA box row; H must be a multiple
_SLOT_BYTES = 48 << 10  # SMEM for the K input slots of one token
_CTA_BYTES = 100 << 10  # SMEM per CTA (two CTAs per SM)
_MAX_TOKEN_BLOCK = 4
_FP8_MAX = 448.0


def _tiling(t: int, k: int, r: int, in_size: int, out_size: int) -> tuple[int, int]:
  rc = max([d for d in range(1, r + 1) if r % d == 0 and k * d * CHUNK * in_size <= _SLOT_BYTES] or [1])
  per_token = rc * CHUNK * (k * in_size + out_size)
  return max(1, min(_MAX_TOKEN_BLOCK, t, _CTA_BYTES // per_token)), rc


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def _reduce_kernel(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, interpret=None):
  n_rows, h = x.shape
  t, k = token_topk_to_pos.shape
  r = h // CHUNK
  out_dtype = jnp.dtype(out_dtype)
  bt, rc = _tiling(t, k, r, x.dtype.itemsize, out_dtype.itemsize)
  shape = (rc, CHUNK)
  optional = [a is not None for a in (x_sf, topk_weights, sf)]

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((t, r, CHUNK), out_dtype),
      grid=(pl.cdiv(t, bt), r // rc),
      grid_names=("i", "j"),
      scratch_types=dict(
          x_s=plgpu.SMEM((bt * k, rc, CHUNK), x.dtype),
          o_s=plgpu.SMEM((bt, rc, CHUNK), out_dtype),
          bar=plgpu.Barrier(num_arrivals=1, num_barriers=bt * k),
      ),
      interpret=interpret,
  )
  def kernel(*refs, x_s, o_s, bar):
    x_g, pos_g, *rest, o_g = refs
    sf_x_g, w_g, sf_g = (rest.pop(0) if present else None for present in optional)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    t0 = jnp.minimum(i * bt, t - bt)
    positions = [pos_g[t0 + slot // k, slot % k] for slot in range(bt * k)]
    for slot, p in enumerate(positions):

      @pl.when(p >= 0)
      def _():
        plgpu.copy_gmem_to_smem(x_g.at[p, pl.ds(j * rc, rc)], x_s.at[slot], bar.at[slot])

    scales = [jnp.float32(1) if w_g is None else w_g[t0 + slot // k, slot % k] for slot in range(bt * k)]
    if sf_x_g is not None:
      scales = [s * sf_x_g[jnp.maximum(p, 0)] for s, p in zip(scales, positions)]
    for row in range(bt):
      acc = jnp.zeros(shape, jnp.float32)
      for slot in range(row * k, (row + 1) * k):
        p = positions[slot]

        @pl.when(p >= 0)
        def _():
          plgpu.barrier_wait(bar.at[slot])

        v = x_s[slot].astype(jnp.float32)
        acc = jnp.where(jnp.broadcast_to(p >= 0, shape), v * jnp.broadcast_to(scales[slot], shape) + acc, acc)
      if sf_g is not None:
        acc = acc * jnp.broadcast_to(sf_g[0], shape)
      if out_dtype == jnp.float8_e4m3fn:
        acc = jnp.minimum(jnp.maximum(acc, jnp.full(shape, -_FP8_MAX, jnp.float32)),
                          jnp.full(shape, _FP8_MAX, jnp.float32))
      o_s[row] = acc.astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(t0, bt), pl.ds(j * rc, rc)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  args = [a for a in (x_sf, topk_weights, sf) if a is not None]
  return kernel(x.reshape(n_rows, r, CHUNK), token_topk_to_pos, *args).reshape(t, h)


def reduce_fused(x, topk_weights: jax.Array | None, token_topk_to_pos: jax.Array, fp8_format: str = "",
                 sf: jax.Array | None = None, *, implementation: str | None = None) -> jax.Array:
  """For each token, the fp32 FMA-accumulated sum of its slots' rows times their weights.

  ``acc = 0; for k: if p = token_topk_to_pos[t, k] >= 0: acc = fma(x[p], w[t, k] * x_sf[p], acc)``;
  then ``acc * sf[0]`` if ``sf`` is given, cast to the output dtype (e4m3: saturating).

  Args:
    x: ``(N', H)`` float32 or bfloat16 expert outputs in the fused layout (``H`` a multiple
      of 256), or a tuple ``(x, x_sf)`` with a ``(N',)`` float32 per-row scale.
    topk_weights: ``(T, K)`` float32 routing weights, or ``None`` (weight 1).
    token_topk_to_pos: ``(T, K)`` int32 fused row of each slot; negative = skip.
    fp8_format: ``""`` (output in ``x.dtype``) or ``"e4m3"`` (float8_e4m3fn, saturated to ±448).
    sf: ``(1,)`` float32 global output scale, only with ``fp8_format="e4m3"``.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(T, H)`` array. Tokens without a valid slot get ``+0`` (times ``sf[0]``).
  """
  x, x_sf = x if isinstance(x, tuple) else (x, None)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.float32, jnp.bfloat16))
  _checks.check_multiple("x", x, 1, CHUNK)
  _routing.check_index("token_topk_to_pos", token_topk_to_pos, 2, (jnp.int32,))
  if x_sf is not None:
    _checks.check_dtype("x_sf", x_sf, (jnp.float32,))
    _routing.check_shape("x_sf", x_sf, (x.shape[0],))
  if topk_weights is not None:
    _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
    _routing.check_shape("topk_weights", topk_weights, token_topk_to_pos.shape)
  if fp8_format not in ("", "e4m3"):
    raise ValueError(f"fp8_format must be '' or 'e4m3', got {fp8_format!r}")
  if sf is not None:
    if fp8_format != "e4m3":
      raise ValueError("sf is only allowed with fp8_format='e4m3'")
    _checks.check_dtype("sf", sf, (jnp.float32,))
    _routing.check_shape("sf", sf, (1,))
  _routing.check_values_below("token_topk_to_pos", token_topk_to_pos, x.shape[0])
  impl = _config.get_implementation(implementation)
  if impl == "reference" or token_topk_to_pos.shape[0] == 0 or x.shape[0] == 0:
    return ref.reduce_fused(x if x_sf is None else (x, x_sf), topk_weights, token_topk_to_pos, fp8_format, sf)
  out_dtype = jnp.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
  return _reduce_kernel(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype,
                        interpret=_config.mosaic_interpret(impl))
