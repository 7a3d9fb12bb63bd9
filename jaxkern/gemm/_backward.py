"""The two backward GEMMs of an FP8 grouped linear layer ``y = x · w[e]ᵀ`` on the fused MoE layout.

Input gradient ``dx = dy · w[e]`` (:func:`fp8_grouped_gemm_input_grad`): the forward GEMM with the
weights transposed to ``(G, K, N)`` (FP8 wgmma needs K-major operands on both sides: here the
contraction runs over N), by :func:`jaxkern.transpose.batched_transpose` (bit-exact; about 4% of the
GEMM's time at the DeepSeek-V3 shapes), and their 128x128 block scales transposed with them.

Weight gradient ``dw[e] = Σ_{rows r of e} dy[r]ᵀ x[r]`` (:func:`fp8_grouped_gemm_weight_grad`): the
contraction runs over each expert's ragged range of 128-row blocks, so both operands come token-major
-> K-major, i.e. transposed, with per-channel scales (one per column and 128-row block), as
:func:`jaxkern.quant.per_channel_cast_and_transpose` makes them. Every kernel runs a TMA pipeline over the
expert's blocks (a dynamic trip count over the expert's run in a block order sorted by expert,
:func:`expert_block_order`: any block layout, the fused layout's order the identity) with one fresh float32 wgmma
accumulator per block, promoted as ``total += p · (sf_dy[b, n] · sf_x[b, k])`` (an outer product of the row and
column scale vectors). Kernels (:data:`WGRAD_VARIANTS`, :data:`WGRAD_VARIANT` picks; the
figures and the variants tried: docs/gemm.md, "Kernels and performance"):

* ``"xptma_g8b"`` (the default, :func:`_wgrad_xp_kernel`): persistent, warp-specialised, two compute warpgroups of
  64 rows on 128x128 tiles of dw; each block's row / column scales come by TMA with the tiles, two 128-row blocks per
  pipeline step into two accumulators (the first promoted while the second's wgmma runs; an odd count repeats the
  last block with a zero scale), a TMA-store epilogue, one pipeline across all the items of a CTA, experts by
  descending block count and 8 K tiles per group. H200, bf16 out: 954-1037 TF/s at the DeepSeek-V3 expert shapes.
* ``"simple"`` (:func:`_wgrad_kernel`, the tests' independent check): one CTA per (expert, 64 rows of N, 128 columns
  of K), one warpgroup.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.gemm import _grouped
from jaxkern.gemm._grouped import BLOCK, FP8_TILED, STAGES, WG, fp8_grouped_gemm
from jaxkern.reference import gemm as ref
from jaxkern.transpose import batched_transpose
from jaxkern.types import QuantTensor

WN = 64  # rows of dw (N) per CTA


def transpose_weights(w: QuantTensor | tuple[jax.Array, jax.Array], *,
                      implementation: str | None = None) -> QuantTensor:
  """``(G, N, K)`` e4m3 weights with ``(G, N/128, K/128)`` block sf -> the ``(G, K, N)`` K-major copy the
  input gradient needs, sf ``(G, K/128, N/128)`` (bit-exact)."""
  w = _grouped._quant("w", w)
  return QuantTensor(batched_transpose(w.data, implementation=implementation), jnp.swapaxes(w.sf, 1, 2))


def fp8_grouped_gemm_input_grad(dy: QuantTensor | tuple[jax.Array, jax.Array],
                                w: QuantTensor | tuple[jax.Array, jax.Array], block_expert: jax.Array, *,
                                out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
                                x_use_tma_aligned_col_major_sf: bool = False,
                                implementation: str | None = None) -> jax.Array:
  """``dx[r] = dy[r] · w[block_expert[r // 128]]``: the input gradient of :func:`fp8_grouped_gemm`.

  Args:
    dy: QuantTensor ``(data (M, N) float8_e4m3fn, sf)``, per-token 1x128 scales along N in layout A / B / C
      (as ``x`` of :func:`fp8_grouped_gemm`, with N in the place of K).
    w: the forward weights ``(data (G, N, K) float8_e4m3fn, sf (G, N/128, K/128) float32)``; transposed here
      (:func:`transpose_weights`). To reuse one transposed copy, call :func:`fp8_grouped_gemm` with it.
    block_expert, out_dtype, x_use_tma_aligned_col_major_sf (the layout of ``dy.sf``), implementation: as
      :func:`fp8_grouped_gemm`.

  Returns ``(M, K)`` ``out_dtype``. Numerics, errors, preconditions, XLA cases, differentiation:
  :func:`fp8_grouped_gemm` (promotion per 128-deep step of N with ``sf_dy[r, step] · sf_w[e, step, k // 128]``).
  """
  w = _grouped._quant("w", w)
  _checks.check_rank("w.data", w.data, 3)
  return fp8_grouped_gemm(dy, transpose_weights(w, implementation=implementation), block_expert,
                          out_dtype=out_dtype, x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf,
                          implementation=implementation)


@functools.partial(jax.jit, static_argnames=("interpret", "num_sms", "out_dtype"))
def _wgrad_kernel(starts, counts, blocks, dyq, sdy, xq, sx, *, interpret, num_sms=None, out_dtype=jnp.float32):
  """``dyq (N, M)``, ``xq (K, M)`` e4m3, ``sdy (M/128, N)``, ``sx (M/128, K)`` float32, ``blocks`` ``(M/128,)``
  int32 (the 128-row blocks sorted by expert), ``starts`` / ``counts`` ``(G,)`` int32 (each expert's first position
  in ``blocks`` and number of blocks, :func:`expert_block_order`) -> ``(G, N, K)`` ``out_dtype`` (the float32
  total rounded once; ``num_sms`` unused)."""
  del num_sms
  n, m = dyq.shape
  k = xq.shape[0]
  g = starts.shape[0]

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((g, n, k), out_dtype),
                     grid=(g, n // WN, k // BLOCK), grid_names=("g", "n", "k"), interpret=interpret)
  def kernel(st_g, ct_g, bl_g, dy_g, sdy_g, x_g, sx_g, o_g):
    e, i, j = lax.axis_index("g"), lax.axis_index("n"), lax.axis_index("k")
    start, count = st_g[e], ct_g[e]
    rows, cols = pl.ds(i * WN, WN), pl.ds(j * BLOCK, BLOCK)

    @pl.when(count == 0)
    def _empty():
      o_g[e, rows, cols] = plgpu.layout_cast(jnp.zeros((WN, BLOCK), out_dtype), WG)

    @pl.when(count > 0)
    def _compute():
      def body(idx, dy_s, x_s, total):
        (s,) = idx
        b = bl_g[start + s]

        def scope(acc):
          plgpu.wgmma(acc, dy_s, x_s.T)
          a = plgpu.load(sdy_g.at[b, rows], layout=WG.reduce(1), optimized=False)
          c = plgpu.load(sx_g.at[b, cols], layout=WG.reduce(0), optimized=False)
          return acc[...], a, c

        part, a, c = pl.run_scoped(scope, plgpu.ACC((WN, BLOCK), jnp.float32))
        return total + part * a[:, None] * c[None, :]

      total = plgpu.emit_pipeline(
          body, grid=(count,), max_concurrent_steps=STAGES,
          in_specs=[plgpu.BlockSpec((WN, BLOCK), lambda s: (0, bl_g[start + s]), transforms=FP8_TILED),
                    plgpu.BlockSpec((BLOCK, BLOCK), lambda s: (0, bl_g[start + s]), transforms=FP8_TILED)],
          init_carry=plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG),
      )(dy_g.at[rows, :], x_g.at[cols, :])
      o_g[e, rows, cols] = total.astype(out_dtype)

  return kernel(starts, counts, blocks, dyq, sdy, xq, sx)


def _wgrad_item(lin, order_g, *, n_iters, k_iters, gk):
  """Work item ``lin`` -> ``(expert, N tile, K tile)``: experts slowest (in ``order_g``'s order), then groups of
  ``gk`` K tiles, then N tiles, then the K tiles of the group."""
  per_e = n_iters * k_iters
  ei, r = lin // per_e, lin % per_e
  grp, within = r // (n_iters * gk), r % (n_iters * gk)
  return order_g[ei], within // gk, grp * gk + within % gk


def _store_result(total, out, out_s, wg, out_dtype):
  """A compute warpgroup's ``total`` as ``out_dtype`` into the GMEM tile ``out``: through its SMEM staging tile
  ``out_s[wg]`` and a TMA store (after the previous item's store has read it)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store has read out_s
  out_s[wg] = total.astype(out_dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_s.at[wg], out)


def _mma_and_promote(total, dy_tiles, x_tiles, dy_scales, x_scales, valid):
  """One pipeline step of a compute warpgroup: ``total + Σ_j (dy_j · x_jᵀ) * (sf_dy_j[:, None] * sf_x_j[None, :])``
  over the step's ``kp = len(dy_tiles)`` blocks, each a float32 wgmma product promoted on its own, in block order.

  ``dy_tiles[j]``: the warpgroup's ``(64, 128)`` e4m3 rows of block j; ``x_tiles[j]``: ``(128, 128)``;
  ``dy_scales[j]`` / ``x_scales[j]``: their ``(64,)`` / ``(128,)`` float32 SMEM scales; ``valid(j)``: False for a
  repeated block (the last step of an odd count), promoted with a zero row scale (its finite wgmma result adds
  exactly 0). All blocks' wgmmas are issued first, each into its own 128 columns of one ``(64, kp * 128)``
  accumulator; block j is promoted as soon as it is done (``wait_n = kp - 1 - j``), while the later ones run.

  One wide accumulator rather than one per block: ptxas zeroes only the first wgmma's accumulator for free
  (scale-d = 0); a second ``(64, 128)`` accumulator cost 64 register moves per step (of 440 instructions),
  and the wide one none (ncu SASS counts, H200, 2026-11-28). The zero factor goes on the row scale (2 values per
  thread) rather than the column scale (32)."""
  kp = len(dy_tiles)

  def scope(acc):
    for j in range(kp):
      plgpu.wgmma(acc.at[:, pl.ds(j * BLOCK, BLOCK)], dy_tiles[j], x_tiles[j].T)
    t = total
    for j in range(kp):
      part = plgpu.wgmma_accumulator_load(acc, wait_n=kp - 1 - j)[:, j * BLOCK:(j + 1) * BLOCK]
      a = plgpu.load(dy_scales[j], layout=WG.reduce(1), optimized=False)
      c = plgpu.load(x_scales[j], layout=WG.reduce(0), optimized=False)
      if j:
        a = a * valid(j).astype(jnp.float32)
      t = t + part * (a[:, None] * c[None, :])
    return t

  return pl.run_scoped(scope, plgpu.ACC((WN, kp * BLOCK), jnp.float32))


def _wgrad_plan(dyq, xq, starts, *, stages, kpair, group_k, out_dtype):
  """Sizes of :func:`_wgrad_xp_kernel`: ``(n, m, k, g, n_iters, k_iters, items, gk, stages)``, the stages shrunk
  (down to 2) until the pipeline and the staging tile fit SMEM."""
  n, m = dyq.shape
  k = xq.shape[0]
  g = starts.shape[0]
  n_iters, k_iters = n // BLOCK, k // BLOCK
  gk = int(np.gcd(group_k, k_iters))
  out_bytes = 2 * WN * BLOCK * jnp.dtype(out_dtype).itemsize
  while stages > 2 and stages * kpair * (2 * BLOCK * BLOCK + 2 * BLOCK * 4) + out_bytes > _grouped.SMEM_LIMIT - 1024:
    stages -= 1
  return n, m, k, g, n_iters, k_iters, g * n_iters * k_iters, gk, stages


@functools.partial(jax.jit, static_argnames=("interpret", "num_sms", "stages", "kpair", "group_k", "out_dtype"))
def _wgrad_xp_kernel(starts, counts, blocks, dyq, sdy, xq, sx, *, interpret, num_sms, stages=3, kpair=2, group_k=8,
                     out_dtype=jnp.float32):
  """A persistent, warp-specialised weight-gradient kernel (arguments as :func:`_wgrad_kernel`): one CTA per SM loops
  over the (expert, 128 rows of N, 128 columns of K) items; two compute warpgroups of 64 rows of N and a memory
  warpgroup.

  * One pipeline across all the items of a CTA: the memory warpgroup walks the CTA's items and their blocks with a
    global step counter (slot ``step % stages``, explicit produced / consumed barriers) and so loads the next item's
    first blocks while the compute warpgroups finish the current item (promotion, epilogue). Matters most for short
    items (experts with few blocks). An expert without blocks goes through the same epilogue with a zero total.
  * ``kpair=2`` (deferred promotion): a pipeline step carries two 128-row blocks of the expert (four ``(128, 128)``
    e4m3 tiles, 64 KiB); each compute warpgroup issues both blocks' wgmmas (into the two halves of one wide
    accumulator), waits for the first only (``wait_n=1``) and promotes it while the second runs, then promotes
    the second (:func:`_mma_and_promote`). For an odd block count the last step's second block is the expert's
    last block loaded again with a zero row scale (its wgmma result, finite for finite e4m3 data, adds exactly 0).
    Every block is promoted on its own, in block order.
  * The row and column scales of each block travel with the tiles: ``(1, 128)`` float32 TMA boxes of ``sdy`` and
    ``sx`` into SMEM (no GMEM-latency loads in the compute warpgroups, no scale vectors carried across steps:
    a 128-column scale vector is 32 registers per thread in the WGMMA layout).
  * Epilogue: the result (``out_dtype``) goes registers -> SMEM (one ``(64, 128)`` tile per compute warpgroup,
    64 KiB in all for float32, 32 KiB for bfloat16) -> TMA store, awaited only before the next item's result is
    staged. ``stages`` shrinks (down to 2) until the pipeline and the staging tile fit SMEM.
  * Item order: experts in descending block count (``argsort`` in XLA), so the longest items start first and the
    last wave holds the short ones (the ragged tail of a skewed routing); within an expert, items walk
    ``gcd(group_k, K/128)`` K tiles at a time, N tiles slower, K groups slowest (L2 reuse: the CTAs of one wave share
    fewer x tiles; :func:`_wgrad_item`).
  """
  n, m, k, g, n_iters, k_iters, items, gk, stages = _wgrad_plan(
      dyq, xq, starts, stages=stages, kpair=kpair, group_k=group_k, out_dtype=out_dtype)
  kp = kpair
  grid = min(num_sms, items)
  order = jnp.argsort(-counts, stable=True).astype(jnp.int32)

  def body(ord_g, st_g, ct_g, bl_g, dy_g, sdy_g, x_g, sx_g, o_g):
    wg, sm = lax.axis_index("wg"), lax.axis_index("sm")
    mine = (items - sm + grid - 1) // grid  # this CTA's items: sm, sm + grid, ...

    def item_of(i):
      e, ni, kj = _wgrad_item(sm + i * grid, ord_g, n_iters=n_iters, k_iters=k_iters, gk=gk)
      return e, ni, kj, st_g[e], ct_g[e]

    allocs = dict(
        dy_s=plgpu.SMEM((stages, kp, BLOCK, BLOCK), dyq.dtype, transforms=FP8_TILED),
        x_s=plgpu.SMEM((stages, kp, BLOCK, BLOCK), xq.dtype, transforms=FP8_TILED),
        sdy_s=plgpu.SMEM((stages, kp, 1, BLOCK), jnp.float32),
        sx_s=plgpu.SMEM((stages, kp, 1, BLOCK), jnp.float32),
        produced=plgpu.Barrier(num_arrivals=4 * kp, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        out_s=plgpu.SMEM((2, WN, BLOCK), out_dtype, transforms=_grouped._out_transforms(out_dtype)))

    @functools.partial(pl.run_scoped, collective_axes="wg", **allocs)
    def _scope(dy_s, x_s, sdy_s, sx_s, produced, consumed, out_s):
      def memory():
        plgpu.set_max_registers(40, action="decrease")

        def item(i, step0):
          _, ni, kj, start, count = item_of(i)

          def step(s, gstep):
            slot = lax.rem(gstep, stages)

            @pl.when(gstep >= stages)
            def _():
              plgpu.barrier_wait(consumed.at[slot])

            for j in range(kp):
              b = bl_g[start + jnp.minimum(s * kp + j, count - 1)]
              bar = produced.at[slot]
              plgpu.copy_gmem_to_smem(dy_g.at[pl.ds(ni * BLOCK, BLOCK), pl.ds(b * BLOCK, BLOCK)], dy_s.at[slot, j],
                                      bar)
              plgpu.copy_gmem_to_smem(x_g.at[pl.ds(kj * BLOCK, BLOCK), pl.ds(b * BLOCK, BLOCK)], x_s.at[slot, j], bar)
              plgpu.copy_gmem_to_smem(sdy_g.at[pl.ds(b, 1), pl.ds(ni * BLOCK, BLOCK)], sdy_s.at[slot, j], bar)
              plgpu.copy_gmem_to_smem(sx_g.at[pl.ds(b, 1), pl.ds(kj * BLOCK, BLOCK)], sx_s.at[slot, j], bar)
            return gstep + 1

          return lax.fori_loop(0, (count + kp - 1) // kp, step, step0)

        total = lax.fori_loop(0, mine, item, jnp.int32(0))

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _quiesce(gstep):  # observe the last consumed phases (the barriers' state stays consistent)
          plgpu.barrier_wait(consumed.at[lax.rem(gstep, stages)])

      def compute():
        plgpu.set_max_registers(232, action="increase")

        def item(i, step0):
          e, ni, kj, _, count = item_of(i)
          rows = pl.ds(ni * BLOCK + wg * WN, WN)
          out = o_g.at[e, rows, pl.ds(kj * BLOCK, BLOCK)]

          def step(s, carry):
            gstep, total = carry
            slot = lax.rem(gstep, stages)
            plgpu.barrier_wait(produced.at[slot])
            half = pl.ds(wg * WN, WN)  # this warpgroup's rows of the N tile
            total = _mma_and_promote(total, [dy_s.at[slot, j].at[half] for j in range(kp)],
                                     [x_s.at[slot, j] for j in range(kp)],
                                     [sdy_s.at[slot, j, 0, half] for j in range(kp)],
                                     [sx_s.at[slot, j, 0] for j in range(kp)], lambda j: s * kp + j < count)
            plgpu.barrier_arrive(consumed.at[slot])
            return gstep + 1, total

          zero = plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG)
          step_end, total = lax.fori_loop(0, (count + kp - 1) // kp, step, (step0, zero))
          _store_result(total, out, out_s, wg, out_dtype)
          return step_end

        lax.fori_loop(0, mine, item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      lax.cond(wg < 2, compute, memory)

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, n, k), out_dtype), grid=(grid,), grid_names=("sm",),
                        num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        interpret=interpret)
  return kernel(order, starts, counts, blocks, dyq, sdy, xq, sx)


# Weight-gradient kernels (read at trace time): the default and the tests' independent check. The figures of the
# variants tried and dropped: docs/gemm.md and benchmarks/NOTES.md.
WGRAD_VARIANTS = {"xptma_g8b": _wgrad_xp_kernel, "simple": _wgrad_kernel}
# H200, 2026-11-27, CUPTI cold L2, bf16 out, TF/s at A (8 x 4096 rows, N=4096 K=7168) / B (N=7168 K=2048) / C (32
# skewed experts, K=7168) / D (skewed, K=2048): "xptma_g8b" 947-955 / 934-938 / 868-892 / 875-882 against one
# pipeline per item ("k2tma") 892 / 961 / 796-799 / 864-870: one pipeline across a CTA's items and the balanced,
# grouped order win where items are short and uneven (C). H200, 2026-11-28 (bit-identical results), "xptma_g8b" at
# D / C / A: 862-879 / 864-876 / 932-950 with two (64, 128) accumulators and the zero factor on the column scale;
# 909-911 / 919-920 / 983 with it on the row scale; 954 / 972 / 1037 with one wide accumulator as well
# (:func:`_mma_and_promote`).
WGRAD_VARIANT = "xptma_g8b"


def expert_block_order(block_expert, num_experts: int):
  """``(blocks, starts, counts)``: ``blocks`` ``(M/128,)`` int32, the 128-row blocks sorted by expert (a stable
  sort: each expert's blocks in block order, ids outside ``[0, G)`` last; the identity for the fused layout), and
  ``starts`` / ``counts`` ``(G,)`` int32, each expert's first position in ``blocks`` and its number of blocks.
  Any layout: the blocks of one expert need not be contiguous."""
  g = num_experts
  valid = (block_expert >= 0) & (block_expert < g)
  blocks = jnp.argsort(jnp.where(valid, block_expert, g), stable=True).astype(jnp.int32)
  ids = jnp.arange(g, dtype=jnp.int32)
  counts = jnp.sum(block_expert[None, :] == ids[:, None], axis=1, dtype=jnp.int32)
  starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
  return blocks, starts, counts


def _check_wgrad(dy_t, x_t, block_expert, num_experts):
  dy_t, x_t = _grouped._quant("dy_t", dy_t), _grouped._quant("x_t", x_t)
  for name, q in (("dy_t", dy_t), ("x_t", x_t)):
    _checks.check_rank(f"{name}.data", q.data, 2)
    _checks.check_dtype(f"{name}.data", q.data, (jnp.float8_e4m3fn,))
    _checks.check_multiple(f"{name}.data", q.data, 0, BLOCK)
    _checks.check_multiple(f"{name}.data", q.data, 1, BLOCK)
    rows, m = q.data.shape
    _grouped._check_sf(f"{name}.sf", q.sf, (m // BLOCK, rows), jnp.float32)
  if dy_t.data.shape[1] != x_t.data.shape[1]:
    raise ValueError(f"dy_t.data (N, M) and x_t.data (K, M) must have the same M, got shapes "
                     f"{tuple(dy_t.data.shape)} and {tuple(x_t.data.shape)}")
  if not isinstance(num_experts, (int, np.integer)) or isinstance(num_experts, bool) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive Python int, got {num_experts!r}")
  m = x_t.data.shape[1]
  block_expert = _checks.as_array("block_expert", block_expert)
  _checks.check_rank("block_expert", block_expert, 1)
  _checks.check_dtype("block_expert", block_expert, (jnp.int32,))
  if block_expert.shape[0] != m // BLOCK:
    raise ValueError(f"block_expert must have shape (M/128,) = ({m // BLOCK},), got {tuple(block_expert.shape)}")
  if not isinstance(block_expert, jax.core.Tracer) and block_expert.size:
    be = np.asarray(block_expert)
    if be.min() < -1 or be.max() >= num_experts:
      raise ValueError(f"block_expert entries must be -1 (skip) or expert ids in [0, {num_experts}), "
                       f"got values in [{be.min()}, {be.max()}]")
  _checks.debug_check_entries("fp8_grouped_gemm_weight_grad", "block_expert", block_expert,
                              lambda v: (v < -1) | (v >= num_experts),
                              f"-1 (skip) or an expert id in [0, {num_experts}) (num_experts; treated as -1)")
  return dy_t, x_t, block_expert


def fp8_grouped_gemm_weight_grad(dy_t: QuantTensor | tuple[jax.Array, jax.Array],
                                 x_t: QuantTensor | tuple[jax.Array, jax.Array], block_expert: jax.Array, *,
                                 num_experts: int, out_dtype: jax.typing.DTypeLike = jnp.float32,
                                 implementation: str | None = None) -> jax.Array:
  """``dw[e] = Σ_{r in blocks of e} dy[r]ᵀ · x[r]``: the weight gradient of :func:`fp8_grouped_gemm`.

  Args:
    dy_t: QuantTensor ``(data (N, M) float8_e4m3fn, sf (M/128, N) float32)``: the output gradient transposed,
      one scale per column and 128-row block (:func:`jaxkern.quant.per_channel_cast_and_transpose` of the
      bf16 ``(M, N)`` gradient with ``num_per_tokens=128``).
    x_t: QuantTensor ``(data (K, M) float8_e4m3fn, sf (M/128, K) float32)``: the forward input, cast the same way.
    block_expert: ``(M/128,)`` int32 as in :func:`fp8_grouped_gemm`, any layout (the blocks of one expert need not
      be contiguous: the kernel walks them in a block order sorted by expert, :func:`expert_block_order`); blocks
      of -1 (or, traced, outside ``[0, G)``) contribute nothing. Preconditions: entries in ``{-1} ∪ [0, G)``;
      concrete values outside raise ``ValueError``, traced ones are reported by ``checkify.checkify(f,
      errors=checkify.user_checks)`` (docs/usage.md, "Bad values under jit").
    num_experts: ``G`` (a Python int).
    out_dtype: float32 (default) or bfloat16 (for bfloat16 weights: the kernel writes half the bytes and no
      separate cast runs; the same values as a float32 result cast to bfloat16).
    implementation: see :mod:`jaxkern._dispatch`.

  Returns ``(G, N, K)`` ``out_dtype`` (zeros for an expert without blocks). Passing ``x_t`` first and ``dy_t``
  second gives the transpose ``(G, K, N)``.

  Numerics: per 128-row block a float32 wgmma product, promoted into a float32 accumulator with
  ``sf_dy[b, n] · sf_x[b, k]`` in block order, one rounding to ``out_dtype`` at the end
  (:func:`jaxkern.reference.gemm.fp8_grouped_gemm_weight_grad`).

  Raises ValueError for non-e4m3 data, dims not multiples of 128, other sf shapes or dtypes, different M,
  ``block_expert`` not ``(M/128,)`` int32 or (concrete) out of range, a bad ``num_experts``, another
  ``out_dtype``. XLA cases: ``M == 0`` (zeros). Not differentiable (quantised inputs).
  """
  dy_t, x_t, block_expert = _check_wgrad(dy_t, x_t, block_expert, num_experts)
  if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"out_dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}")
  out_dtype = jnp.dtype(out_dtype)
  dy_t = QuantTensor(*_autodiff.guard("fp8_grouped_gemm_weight_grad", _autodiff.DEQUANT_ADVICE, *dy_t))
  x_t = QuantTensor(*_autodiff.guard("fp8_grouped_gemm_weight_grad", _autodiff.DEQUANT_ADVICE, *x_t))
  n, m = dy_t.data.shape
  k = x_t.data.shape[0]

  def reference():
    return ref.fp8_grouped_gemm_weight_grad(dy_t, x_t, block_expert, num_experts=num_experts, out_dtype=out_dtype)

  def kernel(interpret):
    blocks, starts, counts = expert_block_order(block_expert, num_experts)
    return WGRAD_VARIANTS[WGRAD_VARIANT](starts, counts, blocks, dy_t.data, dy_t.sf, x_t.data, x_t.sf,
                                         interpret=_config.mosaic_interpret(interpret), num_sms=_config.num_sms(),
                                         out_dtype=out_dtype)

  def xla():
    return jnp.zeros((num_experts, n, k), out_dtype) if m == 0 else reference()

  return _dispatch.run("fp8_grouped_gemm_weight_grad", implementation, kernel=kernel, xla=xla, reference=reference,
                       empty=m == 0)
