"""``expand_to_fused`` and ``expand_to_fused_with_sf``: scatter token rows into the fused layout.

Mosaic GPU kernel, one CTA per block of ``BT`` tokens or of ``BN`` fused rows. Rows are
viewed as ``(R, C)`` (``row_tiling``) so that one 2-D TMA copy moves a whole hidden row.
A token CTA loads its ``BT`` rows with one TMA copy and, meanwhile, the ``BT*K``
positions (scalar loads issued back to back, before any store), then issues one TMA store per valid
slot ``token_topk_to_pos[t, k] = p >= 0`` into fused row ``p`` (all stores in flight at
once). A padding CTA TMA-loads one zero row (a tiny constant input: a register store of
zeros would need the row size to fit a warpgroup register layout) and TMA-stores it into
every row of its block with ``pos_to_expert[p] < 0``. The last token block starts at ``T - BT`` and skips the
tokens already owned by the previous block, so ragged ``T`` needs no masking.

Fused rows that no slot references and that ``pos_to_expert`` does not mark as padding
(impossible for a mapping made by ``get_fused_mapping``) are left unwritten by the kernel;
the reference writes zeros there. Traced positions are not range-checked: a slot pointing
at row ``>= N`` is undefined in the kernel (an out-of-bounds TMA store, which the TMA unit
should clip away; not verified) and dropped by the reference. ``expand_to_fused_with_sf`` moves the data rows with this kernel
and the few scale words per row with an XLA gather.
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

_TOKEN_BLOCK_BYTES = 56 << 10  # SMEM for the token rows of one CTA (about 4 CTAs per SM)
_MAX_TOKEN_BLOCK = 16
_ROW_BLOCK = 32  # fused rows checked for padding per CTA


@functools.partial(jax.jit, static_argnames=("interpret",))
def _expand_kernel(x, token_topk_to_pos, pos_to_expert, interpret=None):
  t, h = x.shape
  k = token_topk_to_pos.shape[1]
  n = pos_to_expert.shape[0]
  r, c = _routing.row_tiling(h, x.dtype.itemsize, "x")
  row_bytes = h * x.dtype.itemsize
  # A TMA copy needs a 128-byte aligned SMEM address: several rows per CTA only if each row keeps it.
  bt = max(1, min(_MAX_TOKEN_BLOCK, t, _TOKEN_BLOCK_BYTES // row_bytes)) if row_bytes % 128 == 0 else 1
  gt, gn = pl.cdiv(t, bt), pl.cdiv(n, _ROW_BLOCK)

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((n, r, c), x.dtype),
      grid=(gt + gn,),
      grid_names=("i",),
      scratch_types=dict(x_s=plgpu.SMEM((bt, r, c), x.dtype), bar=plgpu.Barrier(num_arrivals=1)),
      interpret=interpret,
  )
  def kernel(x_g, pos_g, expert_g, zero_g, o_g, x_s, bar):
    i = lax.axis_index("i")

    @pl.when(i < gt)
    def _():
      t0 = jnp.minimum(i * bt, t - bt)
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(t0, bt)], x_s, bar)
      positions = [pos_g[t0 + j // k, j % k] for j in range(bt * k)]  # independent loads, all in flight
      plgpu.barrier_wait(bar)
      for j, p in enumerate(positions):
        row = j // k

        @pl.when((p >= 0) & (t0 + row >= i * bt))
        def _():
          plgpu.copy_smem_to_gmem(x_s.at[row], o_g.at[p])

    @pl.when(i >= gt)
    def _():
      p0 = (i - gt) * _ROW_BLOCK
      plgpu.copy_gmem_to_smem(zero_g, x_s.at[pl.ds(0, 1)], bar)
      experts = [expert_g[jnp.minimum(p0 + q, n - 1)] for q in range(_ROW_BLOCK)]
      plgpu.barrier_wait(bar)
      for q, e in enumerate(experts):

        @pl.when((p0 + q < n) & (e < 0))
        def _():
          plgpu.copy_smem_to_gmem(x_s.at[0], o_g.at[p0 + q])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  zero = jnp.zeros((1, r, c), x.dtype)
  return kernel(x.reshape(t, r, c), token_topk_to_pos, pos_to_expert, zero).reshape(n, h)


def _check(x, token_topk_to_pos, pos_to_expert, x_name="x") -> None:
  _checks.check_rank(x_name, x, 2)
  _routing.check_index("token_topk_to_pos", token_topk_to_pos, 2, (jnp.int32,))
  _routing.check_index("pos_to_expert", pos_to_expert, 1, (jnp.int32,))
  if token_topk_to_pos.shape[0] != x.shape[0]:
    raise ValueError(f"token_topk_to_pos must have {x.shape[0]} rows (one per token of {x_name}), "
                     f"got shape {tuple(token_topk_to_pos.shape)}")
  if x.dtype.itemsize not in (1, 2, 4):
    raise ValueError(f"{x_name} must have a 1-, 2- or 4-byte dtype, got {x.dtype}")
  _routing.row_tiling(x.shape[1], x.dtype.itemsize, x_name)
  _routing.check_values_below("token_topk_to_pos", token_topk_to_pos, pos_to_expert.shape[0])


def expand_to_fused(x: jax.Array, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array, *,
                    implementation: str | None = None) -> jax.Array:
  """Copies each token row into its fused rows; padding rows become zero (bit copy).

  Args:
    x: ``(T, H)`` array of a 1-, 2- or 4-byte dtype; ``H`` a multiple of 16 bytes.
    token_topk_to_pos: ``(T, K)`` int32 fused row of each slot, negative = unused.
    pos_to_expert: ``(N,)`` int32; a negative entry marks a padding row.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(N, H)`` array of ``x.dtype`` with ``out[token_topk_to_pos[t, k]] = x[t]`` and zeros
    where ``pos_to_expert < 0``.
  """
  _check(x, token_topk_to_pos, pos_to_expert)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0 or pos_to_expert.shape[0] == 0:
    return ref.expand_to_fused(x, token_topk_to_pos, pos_to_expert)
  return _expand_kernel(x, token_topk_to_pos, pos_to_expert, interpret=_config.mosaic_interpret(impl))


def expand_to_fused_with_sf(x: tuple[jax.Array, jax.Array], num_per_channels: int,
                            token_topk_to_pos: jax.Array, pos_to_expert: jax.Array,
                            use_tma_aligned_col_major_sf: bool = False, *,
                            implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """:func:`expand_to_fused` of quantised data with its per-token scale factors.

  Args:
    x: ``(x_data, x_sf)``: ``(T, H)`` data (e.g. float8_e4m3fn) and row-major ``(T, Hs)``
      scales, float32 (``Hs = ceil(H / num_per_channels)``) or int32 packed UE8M0
      (``Hs = ceil(ceil(H / num_per_channels) / 4)``, requires ``use_tma_aligned_col_major_sf``).
    num_per_channels: channels per scale block (static).
    token_topk_to_pos, pos_to_expert: as in :func:`expand_to_fused`.
    use_tma_aligned_col_major_sf: return the scales as the physical ``(Hs, align(N, 4))``
      buffer of a TMA-aligned column-major layout (padding columns zero) instead of ``(N, Hs)``.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(out, out_sf)``: the expanded data and the scale rows moved (bit copies) with their tokens.
  """
  if not isinstance(x, tuple) or len(x) != 2:
    raise ValueError("x must be a tuple (x_data, x_sf)")
  x_data, x_sf = x
  _check(x_data, token_topk_to_pos, pos_to_expert, "x_data")
  _checks.check_rank("x_sf", x_sf, 2)
  _checks.check_dtype("x_sf", x_sf, (jnp.float32, jnp.int32))
  if num_per_channels <= 0:
    raise ValueError(f"num_per_channels must be positive, got {num_per_channels}")
  blocks = -(-x_data.shape[1] // num_per_channels)
  hs = -(-blocks // 4) if x_sf.dtype == jnp.int32 else blocks
  _routing.check_shape("x_sf", x_sf, (x_data.shape[0], hs))
  if x_sf.dtype == jnp.int32 and not use_tma_aligned_col_major_sf:
    raise ValueError("x_sf holding packed UE8M0 (int32) requires use_tma_aligned_col_major_sf=True")
  out = expand_to_fused(x_data, token_topk_to_pos, pos_to_expert, implementation=implementation)
  return out, ref.expand_sf(x_sf, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf)
