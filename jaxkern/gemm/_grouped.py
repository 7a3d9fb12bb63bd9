"""FP8 grouped GEMM on the fused MoE layout: ``out[r] = x[r] · w[block_expert[r // 128]]ᵀ``.

Mosaic GPU kernels (:func:`default_variant` picks one per K and N; :data:`VARIANT` forces one at trace time; the
figures and the variants tried: docs/gemm.md, "Kernels and performance"):

* ``"pair192"`` (:func:`_pair_mc_kernel`, the default from ``K >= PAIR_MIN_K`` where 192-column tiles fit N):
  DeepGEMM's schedule, 128 x 192 CTA tiles, the weight tile TMA-multicast to a 2-CTA cluster on a pair of row blocks
  of one expert, 16 row blocks per raster group (rows fastest); ``"pair192_r32"`` the same with 32, the default up to
  ``K = PAIR_R32_MAX_K``.
  H200: 1323-1330 TF/s at N = 4096, K = 7168, 7-8% above ``"wide192"``; 1289-1291 at N = 7168, K = 2048. Each compute warpgroup synchronises its four
  warps before it releases a ring slot to the pair; released by the first warp alone, a slot could be refilled while
  the other warps still read it, and the results differed from run to run on the training step's fused layout
  (H200, 2026-11-29; with the warpgroup barrier 40 runs of one executable gave the same bits as ``"wide192"``;
  benchmarks/NOTES.md).
* ``"wide192"`` (:func:`_wide_kernel`, the default below ``PAIR_MIN_K`` where 192-column tiles fit N, and
  ``"pair192"``'s fallback for an odd number of row blocks): persistent 64 x 192 tiles per compute warpgroup, one
  SMEM ring of 128-deep steps through all items of a CTA, column tiles fastest.
* ``"k2tma_gh"`` (:func:`_raster_kernel`, the default for ``K > SMEM_SCALES_MAX_K`` where 192-column tiles do not
  fit): persistent and warp-specialised, with deferred promotion (2 x 128 of K per pipeline step into two wgmma
  accumulators, the first promoted while the second runs; 3 stages), an SMEM + TMA-store epilogue overlapped with
  the next item, and items in groups of column tiles (L2 reuse; :func:`half_row_group`).
* ``"k2tma_gh_ss"`` (the same kernel, the default for ``GROUPED_RASTER_MIN_K <= K <= SMEM_SCALES_MAX_K`` where
  192-column tiles do not fit): each step's scales TMA'd into the pipeline's SMEM beside its tiles instead of GMEM
  loads on the compute warpgroups' path.
* ``"ring_nodefer"`` (:func:`_ring_kernel`, the default below ``GROUPED_RASTER_MIN_K`` where 192-column tiles do not
  fit, and what ``"wide192"`` runs for ``N < 192``): the SMEM ring with 64 x 128 tiles.
* ``"simple"`` (:func:`_simple_kernel`, the tests' independent check): one CTA per (64-row tile, 128-column tile),
  one warpgroup, a ``plgpu.emit_pipeline`` TMA pipeline.

All: per 128-deep K step the ``(rows, 128)`` e4m3 tile of ``x`` and the ``(128, 128)`` e4m3 tile of ``w[e]``
(stored ``(N, K)``, i.e. K-major, passed to wgmma transposed: FP8 wgmma needs K-major operands on both sides)
land in swizzled SMEM; the step's wgmma accumulates into a fresh float32 accumulator, whose value is promoted
into the float32 carry as ``total += p · (sf_x[rows, step] · sf_w[e, n_block, step])`` (DeepGEMM's numerics;
``"pair192"`` and ``"wide192"`` read the step's x scales before its wgmma, the other kernels after it). Items whose
block id is -1 (or outside ``[0, G)``) write zeros and load nothing. Results go from registers straight to GMEM
(``"simple"``) or through SMEM and a TMA store.

Scale layouts: the kernel reads the per-token sf of ``x`` as the column-major ``(K/128, M)`` float32
matrix (layout B's buffer, one contiguous vector of rows per step); the wrapper transposes layout A
and decodes the packed UE8M0 layout C to that matrix with XLA (``M·K/128`` words, about 0.8% of the
bytes of ``x``), and passes layout B through. Weight sf: float32 ``(G, N/128, K/128)`` (what
``jax.vmap(per_block_cast)`` of the ``(N, K)`` weights with 128x128 blocks returns), read as one
scalar per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.state import primitives as state_primitives  # ref_set on an accumulator in interpret mode
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.reference import gemm as ref
from jaxkern.reference import quant as rq
from jaxkern.types import QuantTensor

BLOCK = 128  # rows per expert block of the fused layout, K step, weight-scale block
BM = 64  # rows per CTA (one wgmma M per warpgroup)
BN = 128  # output columns per CTA
STAGES = 4  # TMA pipeline depth: 4 x (8 + 16) KiB of SMEM
WIDE_TILE = 192  # output columns per compute warpgroup of "pair192" and "wide192" (where they fit N)
SMEM_LIMIT = 232_448  # bytes per CTA on an H100
OUT_DTYPES = (jnp.bfloat16, jnp.float32)
WG = plgpu.Layout.WGMMA
FP8_TILED = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))  # 128-byte rows of e4m3
SCALE_ROW = 32  # float32 lanes of a pipeline step's weight-scale row: a TMA into SMEM lands 128-byte aligned


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms"))
def _simple_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms=None):
  """``xq (M, K)`` e4m3, ``sfx_t (K/128, M)`` float32, ``wq (G, N, K)`` e4m3, ``wsf (G, N/128, K/128)``
  float32, ``block_expert (M/128,)`` int32 (ids outside ``[0, G)`` skipped) -> ``(M, N)`` ``out_dtype``
  (``num_sms`` unused: one CTA per tile)."""
  del num_sms
  m, k = xq.shape
  _, n, _ = wq.shape
  ks = k // BLOCK

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
                     grid=(m // BM, n // BN), grid_names=("m", "n"), interpret=interpret)
  def kernel(be_g, x_g, sfx_g, w_g, sfw_g, o_g):
    i, j = lax.axis_index("m"), lax.axis_index("n")
    e = be_g[i * BM // BLOCK]
    rows, cols = pl.ds(i * BM, BM), pl.ds(j * BN, BN)

    @pl.when(e < 0)
    def _skip():
      o_g[rows, cols] = plgpu.layout_cast(jnp.zeros((BM, BN), out_dtype), WG)

    @pl.when(e >= 0)
    def _compute():
      def body(idx, x_s, w_s, total):
        (kk,) = idx

        def scope(acc):
          plgpu.wgmma(acc, x_s, w_s.T)
          sx = plgpu.load(sfx_g.at[kk, rows], layout=WG.reduce(1), optimized=False)
          return acc[...], sx * sfw_g[e, j, kk]

        part, scale = pl.run_scoped(scope, plgpu.ACC((BM, BN), jnp.float32))
        return total + part * scale[:, None]

      total = plgpu.emit_pipeline(
          body, grid=(ks,), max_concurrent_steps=min(STAGES, ks),
          in_specs=[plgpu.BlockSpec((BM, BLOCK), lambda kk: (0, kk), transforms=FP8_TILED),
                    plgpu.BlockSpec((BN, BLOCK), lambda kk: (0, kk), transforms=FP8_TILED)],
          init_carry=plgpu.layout_cast(jnp.zeros((BM, BN), jnp.float32), WG),
      )(x_g.at[rows, :], w_g.at[e, cols, :])
      o_g[rows, cols] = total.astype(out_dtype)

  return kernel(block_expert, xq, sfx_t, wq, wsf)


def _k_pipeline(mma_body, compute_context, *, steps, step_k, stages, scales=False):
  """The warp-specialised K pipeline of the persistent kernels: a memory warpgroup loads the ``(128, step_k)``
  tile of ``x`` and the ``(BN, step_k)`` tile of ``w`` of each of ``steps`` K steps into swizzled SMEM, up to
  ``stages`` steps ahead of two compute warpgroups running ``mma_body``. ``scales``: also the step's
  ``(step_k/128, 128)`` block of the column-major x scales and its row of weight scales (:data:`SCALE_ROW`
  lanes, the first ``step_k/128`` used)."""
  kb = step_k // BLOCK
  specs = [plgpu.BlockSpec((BLOCK, step_k), lambda kk: (0, kk), transforms=FP8_TILED, memory_space=plgpu.SMEM),
           plgpu.BlockSpec((BN, step_k), lambda kk: (0, kk), transforms=FP8_TILED, memory_space=plgpu.SMEM)]
  if scales:
    specs += [plgpu.BlockSpec((kb, BLOCK), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
              plgpu.BlockSpec((1, SCALE_ROW), lambda kk: (kk, 0), memory_space=plgpu.SMEM)]
  return plgpu.emit_pipeline_warp_specialized(
      mma_body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
      max_concurrent_steps=min(stages, steps), compute_context=compute_context, in_specs=specs)


def _persistent_call(body, out_shape, out_dtype, items: int, num_sms: int, interpret, scratch_types=None):
  """``body`` as a persistent kernel: one CTA per SM (at most one per work item) of three warpgroups (axis
  ``"wg"``: two compute, one memory), Warpgroup lowering; ``scratch_types`` (a dict, passed to ``body`` as
  keyword arguments) only where given."""
  extra = {} if scratch_types is None else dict(scratch_types=scratch_types)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(min(num_sms, items),),
                      grid_names=("sm",), num_threads=3, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                      interpret=interpret, **extra)


def _out_transforms(dtype, cols: int = BN):
  """Swizzled SMEM tiling of a ``(rows, cols)`` output staging tile: the widest swizzle that divides a row's bytes."""
  row_bytes = cols * jnp.dtype(dtype).itemsize
  swizzle = next(sw for sw in (128, 64, 32) if row_bytes % sw == 0)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "stages", "kpair", "smem_scales"))
def _raster_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, stages=3, kpair=2,
                   smem_scales=False):
  """A persistent, warp-specialised kernel (arguments as :func:`_simple_kernel`): one CTA per SM loops over the
  (128-row block, 128-column tile) work items; per item a memory warpgroup runs an
  ``emit_pipeline_warp_specialized`` TMA pipeline up to ``stages`` steps ahead of two compute warpgroups of 64 rows.

  * ``kpair=2`` (deferred promotion): a pipeline step carries ``2 x 128`` of K (``stages`` such steps in
    SMEM, 64 KiB each: 3 fit); each compute warpgroup issues both steps' wgmmas into two accumulators, then
    waits for the first only (``wgmma_accumulator_load(wait_n=1)``) and promotes it while the second runs,
    then promotes the second. Same numerics: every 128-deep product is promoted on its own, in step order.
    Falls back to one 128-deep step where ``K/128`` is odd.
  ``stages`` shrinks (down to 2) until the pipeline and the staging tile fit SMEM.
  * Epilogue: the result goes registers -> swizzled SMEM (one ``(64, 128)`` tile per compute warpgroup) -> TMA
    store, whose completion is only awaited before the next item's result is staged, so the store overlaps the
    next item's main loop.
  * Grouped rasterisation for L2 reuse: items walk :func:`half_row_group` column tiles at a time, 128-row blocks
    slower, column groups slowest, so the CTAs of one wave share fewer distinct ``x`` row blocks and weight tiles.
  * ``smem_scales=True``: the step's scales travel through the pipeline with its tiles (a TMA of the ``(kp, 128)``
    x scales and one of the ``kp`` weight scales, from a copy the wrapper pads to :data:`SCALE_ROW` lanes per step
    so that each slot is 128-byte aligned), and the compute warpgroups read them from SMEM. Otherwise they are GMEM
    loads issued a step ahead, whose latency the warpgroups wait out (ncu, H200, 2026-11-28: a fifth of the compute
    warps' stall samples at N = 4096, K = 7168).
  """
  m, k = xq.shape
  g, n, _ = wq.shape
  ks = k // BLOCK
  kp = kpair if ks % kpair == 0 else 1
  steps = ks // kp
  m_iters, n_iters = m // BLOCK, n // BN
  wm = BLOCK // 2  # rows per compute warpgroup
  gn = half_row_group(n // BN)
  scale_bytes = (kp * BLOCK + SCALE_ROW) * 4 if smem_scales else 0
  stage_bytes = kp * (BLOCK + BN) * BLOCK + scale_bytes

  def out_bytes(cols):
    return 2 * wm * cols * jnp.dtype(out_dtype).itemsize

  # The staging tile's columns: all BN, or half of them (two stores per item) where that keeps a stage more.
  out_cols = BN
  fits = lambda st, cols: st * stage_bytes + out_bytes(cols) <= SMEM_LIMIT - 1024
  if not fits(stages, BN) and fits(stages, BN // 2):
    out_cols = BN // 2
  while stages > 2 and not fits(stages, out_cols):
    stages -= 1  # e.g. the float32 staging tile leaves room for one stage fewer
  if smem_scales:  # (G, N/128, steps, SCALE_ROW): a step's kp weight scales in the first lanes of a row
    wsf = jnp.pad(wsf.reshape(g, n // BLOCK, steps, kp), ((0, 0), (0, 0), (0, 0), (0, SCALE_ROW - kp)))

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g):
    wg = lax.axis_index("wg")

    pipeline = functools.partial(_k_pipeline, steps=steps, step_k=kp * BLOCK, stages=stages,
                                 scales=smem_scales)

    ignore = lambda *_, **__: None
    pipe_refs = (x_g, w_g.at[0]) + ((sfx_g, sfw_g.at[0, 0]) if smem_scales else ())
    allocs = dict(pipe=pipeline(ignore, ignore).get_allocations(*pipe_refs),
                  out_s=plgpu.SMEM((2, wm, out_cols), out_dtype, transforms=_out_transforms(out_dtype, out_cols)))

    @functools.partial(pl.run_scoped, collective_axes="wg", **allocs)
    def _scope(pipe, out_s):
      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _items(info):
        (lin,) = info.index
        mi, ni = _raster(lin, m_iters, gn)
        e = be_g[mi]
        rows = pl.ds(mi * BLOCK + wg * wm, wm)
        cols = pl.ds(ni * BN, BN)

        def scales(step):
          step = jnp.minimum(step, ks - 1)
          return plgpu.load(sfx_g.at[step, rows], layout=WG.reduce(1), optimized=False), sfw_g[e, ni, step]

        def compute_context(run_pipeline):
          zero = plgpu.layout_cast(jnp.zeros((wm, BN), jnp.float32), WG)
          if smem_scales:
            total = run_pipeline(zero)
          else:
            total, _ = run_pipeline((zero, tuple(scales(j) for j in range(kp))))
          for c in range(0, BN, out_cols):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store has read out_s
            out_s[wg] = (total if out_cols == BN else total[:, c:c + out_cols]).astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[wg], o_g.at[rows, pl.ds(ni * BN + c, out_cols)])

        def mma_body(idx, x_s, w_s, *refs):
          (kk,) = idx
          *scale_refs, carry = refs
          xs = x_s.at[pl.ds(wg * wm, wm)]

          def scope(*accs):
            for j, acc in enumerate(accs):
              plgpu.wgmma(acc, xs.at[:, pl.ds(j * BLOCK, BLOCK)], w_s.at[:, pl.ds(j * BLOCK, BLOCK)].T)
            if smem_scales:
              sx_s, sw_s = scale_refs
              total = carry
              sc = [(plgpu.load(sx_s.at[j, pl.ds(wg * wm, wm)], layout=WG.reduce(1), optimized=False),
                     sw_s[0, j]) for j in range(kp)]
            else:
              total, sc = carry
              nxt = tuple(scales((kk + 1) * kp + j) for j in range(kp))
            t = total
            for j, acc in enumerate(accs):
              part = plgpu.wgmma_accumulator_load(acc, wait_n=kp - 1 - j)
              sx, sw = sc[j]
              t = t + part * (sx * sw)[:, None]
            return t if smem_scales else (t, nxt)

          return pl.run_scoped(scope, *[plgpu.ACC((wm, BN), jnp.float32) for _ in range(kp)])

        @pl.when(e >= 0)
        def _compute():
          refs = (x_g.at[pl.ds(mi * BLOCK, BLOCK), :], w_g.at[e, cols, :])
          if smem_scales:
            refs += (sfx_g.at[:, pl.ds(mi * BLOCK, BLOCK)], sfw_g.at[e, ni])
          pipeline(mma_body, compute_context)(*refs, allocations=pipe)

        @pl.when((e < 0) & (wg < 2))
        def _skip():
          o_g[rows, cols] = plgpu.layout_cast(jnp.zeros((wm, BN), out_dtype), WG)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret)(
      block_expert, xq, sfx_t, wq, wsf)


# Column tiles per raster group of "k2tma_gh": half a row of tiles, and a whole row up to this many. H200, 2026-11-27
# (TF/s): 32 tiles (N=4096, K=7168; uniform / 32 skewed experts) 16 per group 1200 / 1195, 8 1175 / 1174, 4 1141 /
# 1132 (H100, 2026-11-27: all 32 1055 against 8's 1110); 16 tiles (N=2048, K=7168) all 16 1188, 8 1167-1176; 56 tiles
# (N=7168, K=4096) 28 1152-1155, 16 or 8 1125-1141, all 56 1084-1109.
WHOLE_ROW_GROUP_MAX = 16


def half_row_group(n_tiles: int) -> int:
  """Column tiles per raster group for a row of ``n_tiles``: all of them up to :data:`WHOLE_ROW_GROUP_MAX`, else the
  largest divisor of ``n_tiles`` up to half of it (the whole row where that is below 8)."""
  if n_tiles <= WHOLE_ROW_GROUP_MAX:
    return n_tiles
  half = max(d for d in range(1, n_tiles // 2 + 1) if n_tiles % d == 0)
  return half if half >= 8 else n_tiles


def _raster(lin, m_iters: int, gn: int):
  """Item ``lin`` -> (128-row block, column tile): ``gn`` column tiles per group, row blocks slower, groups slowest."""
  grp, within = lin // (m_iters * gn), lin % (m_iters * gn)
  return within // gn, grp * gn + within % gn


def _zero_acc(acc, interpret):
  """Zero a wgmma accumulator for the next step's product. Compiled: ``acc[...] = 0`` (Mosaic GPU's accumulator
  store). GPU interpret mode has no rule for that primitive, so there a plain ref store writes the zeros."""
  zeros = plgpu.layout_cast(jnp.zeros(acc.shape, jnp.float32), WG)
  if interpret:
    state_primitives.ref_set(acc, (), zeros)
  else:
    acc[...] = zeros


def _ring_slot(t, stages: int):
  """The ring slot of pipeline step ``t >= 0``: an AND where ``stages`` is a power of two. The signed remainder
  ``lax.rem`` lowers to four dependent uniform-datapath instructions, and the compute warpgroup's slot sits on the
  path from one step's wgmma wait to the next step's wgmma. ``"pair192"``, H200, 2026-11-30 (CUPTI, cold L2,
  M = 32768, three alternating rounds of 10, with the release of :func:`_warpgroup_barrier`): G = 4, N = 7168,
  K = 2048 1309.7-1310.0 -> 1325.1-1327.4 TF/s; G = 4, N = 4096, K = 7168 1309.1-1315.7 -> 1315.8-1320.6;
  bit-identical."""
  if stages & (stages - 1) == 0:
    return lax.bitwise_and(t, stages - 1)
  return lax.rem(t, stages)


def _ring_memory_warpgroup(items, first, coords, expert_of, load, *, steps, stages, consumed, on_item=None,
                           on_end=None, one_warp=False):
  """The memory warpgroup of the SMEM-ring kernels (:func:`_ring_kernel`, :func:`_wide_kernel`,
  :func:`_pair_mc_kernel`): walks the CTA's items as the compute warpgroups do (``coords(lin)``: row block and
  column position; ``expert_of(lin)``, carried one item ahead, ``first`` the carry of the CTA's first item; items
  of expert < 0 load nothing), and for each of an item's ``steps`` K steps waits until its ring slot is released
  (``consumed``) and calls ``load(slot, step, row block, column, expert)`` to issue the step's TMA loads. At the
  end it observes the last releases (every phase of the ``consumed`` barriers) before the kernel ends.
  ``on_item(t0, row block, column, expert)``, where given, runs before the first step's loads of each loaded item
  (``t0``: the ring position of that step); ``on_end(total steps)`` at the end. ``one_warp``: the first warp alone
  runs the loop and the other three end at once (Pallas then places no warpgroup barrier before each TMA issue)."""
  plgpu.set_max_registers(40, action="decrease")
  loop = functools.partial(_ring_memory_loop, items, first, coords, expert_of, load, steps=steps, stages=stages,
                           consumed=consumed, on_item=on_item, on_end=on_end)
  if not one_warp:
    loop()
    return

  def first_warp(warp):
    pl.when(warp == 0)(loop)

  plgpu.warp_map(first_warp)


def _ring_memory_loop(items, first, coords, expert_of, load, *, steps, stages, consumed, on_item, on_end):
  """The loop of :func:`_ring_memory_warpgroup` (arguments as there)."""
  ctas = lax.axis_size("sm")

  @plgpu.nd_loop(items, collective_axes="sm", init_carry=first)
  def _items(info, carry):
    (lin,) = info.index
    t0, e = carry
    e_next = expert_of(lin + ctas)
    mi, col = coords(lin)

    @pl.when(e >= 0)
    def _load():
      if on_item is not None:
        on_item(t0, mi, col, e)

      @pl.loop(0, steps)
      def _step(s):
        t = t0 + s
        slot = _ring_slot(t, stages)

        @pl.when(t >= stages)
        def _wait_free():
          plgpu.barrier_wait(consumed.at[slot])

        load(slot, s, mi, col, e)

    return t0 + jnp.where(e >= 0, steps, 0).astype(jnp.int32), e_next

  total_steps = _items[0]

  @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
  def _drain(t):
    plgpu.barrier_wait(consumed.at[_ring_slot(t, stages)])

  if on_end is not None:
    on_end(total_steps)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "stages"))
def _ring_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, stages=5):
  """A persistent, warp-specialised kernel with its own K pipeline (arguments as :func:`_simple_kernel`).

  Unlike :func:`_raster_kernel` (one ``emit_pipeline_warp_specialized`` per work item, whose memory warpgroup waits
  for the compute warpgroups to drain each item before it loads the next item's first tiles), one ring of
  ``stages`` SMEM slots of 128-deep K steps runs through all items of a CTA: the memory warpgroup walks the same
  item sequence as the compute warpgroups and loads the next item's first steps while they finish the current
  one (no bubble between items; the slot counter runs on across items, so any number of stages works).
  Each slot holds the ``(128, 128)`` e4m3 tile of ``x``, the ``(BN, 128)`` tile of ``w[e]`` and the step's 128
  per-token scales of ``x`` (one 512-byte TMA row of the column-major ``(K/128, M)`` scales, so no GMEM load of
  them on the compute warpgroups' path); the weight scale is a scalar GMEM load two steps ahead.

  Each step's wgmma is awaited, then promoted: ``total += part_s * (sf_x[rows, s] * sf_w[e, n_block, s])`` in step
  order (the other kernels' numerics). Items: all column tiles of a row block, then the next row block. Epilogue:
  registers -> swizzled SMEM -> TMA store, awaited only before the warpgroup's next item is staged. ``stages``
  shrinks until SMEM fits.
  """
  m, k = xq.shape
  _, n, _ = wq.shape
  ks = k // BLOCK
  m_iters, n_iters = m // BLOCK, n // BN
  wm = BLOCK // 2  # rows per compute warpgroup
  out_bytes = 2 * wm * BN * jnp.dtype(out_dtype).itemsize
  stage_bytes = (BLOCK + BN) * BLOCK + BLOCK * 4
  while stages > 2 and stages * stage_bytes + out_bytes > SMEM_LIMIT - 1024:
    stages -= 1
  scratch = dict(
      x_s=plgpu.SMEM((stages, BLOCK, BLOCK), xq.dtype, transforms=FP8_TILED),
      w_s=plgpu.SMEM((stages, BN, BLOCK), wq.dtype, transforms=FP8_TILED),
      sx_s=plgpu.SMEM((stages, BLOCK), jnp.float32),
      out_s=plgpu.SMEM((2, wm, BN), out_dtype, transforms=_out_transforms(out_dtype)),
      produced=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages))

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g, *, x_s, w_s, sx_s, out_s, produced, consumed):
    wg = lax.axis_index("wg")
    items = (m_iters * n_iters,)

    def coords(lin):
      return lin // n_iters, lin % n_iters

    def expert_of(lin):  # the expert of item ``lin`` (clamped into range: a prefetch past the last item is unused)
      return be_g[coords(jnp.minimum(lin, items[0] - 1))[0]]

    # Each warpgroup loads the expert id of its next item one item ahead (the loop carry), so the GMEM latency of
    # that load is not paid at the start of every item.
    ctas = lax.axis_size("sm")
    first = (jnp.int32(0), expert_of(lax.axis_index("sm")))

    @pl.when(wg == 2)
    def _memory():
      def load(slot, s, mi, ni, e):
        kcols = pl.ds(s * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(mi * BLOCK, BLOCK), kcols], x_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(w_g.at[e, pl.ds(ni * BN, BN), kcols], w_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(sfx_g.at[s, pl.ds(mi * BLOCK, BLOCK)], sx_s.at[slot], produced.at[slot])

      _ring_memory_warpgroup(items, first, coords, expert_of, load, steps=ks, stages=stages, consumed=consumed)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")

      @plgpu.nd_loop(items, collective_axes="sm", init_carry=first)
      def _items(info, carry):
        (lin,) = info.index
        t0, e = carry
        e_next = expert_of(lin + ctas)
        mi, ni = coords(lin)
        r0 = mi * BLOCK + wg * wm
        rows = pl.ds(r0, wm)
        cols = pl.ds(ni * BN, BN)

        def w_scale(s):
          return sfw_g[e, ni, jnp.minimum(s, ks - 1)]

        def k_loop(acc):
          def step(s, c):
            total, sw, sw1 = c
            slot = _ring_slot(t0 + s, stages)
            plgpu.barrier_wait(produced.at[slot])
            _zero_acc(acc, interpret)
            plgpu.wgmma(acc, x_s.at[slot, pl.ds(wg * wm, wm)], w_s.at[slot].T)
            part = plgpu.wgmma_accumulator_load(acc, wait_n=0)
            sx = plgpu.load(sx_s.at[slot, pl.ds(wg * wm, wm)], layout=WG.reduce(1), optimized=False)
            plgpu.barrier_arrive(consumed.at[slot])
            return total + part * (sx * sw)[:, None], sw1, w_scale(s + 2)

          zero = plgpu.layout_cast(jnp.zeros((wm, BN), jnp.float32), WG)
          return lax.fori_loop(0, ks, step, (zero, w_scale(0), w_scale(1)))[0]

        @pl.when(e >= 0)
        def _run():
          total = pl.run_scoped(k_loop, plgpu.ACC((wm, BN), jnp.float32))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read out_s
          out_s[wg] = total.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_s.at[wg], o_g.at[pl.ds(pl.multiple_of(r0, wm), wm), cols])

        @pl.when(e < 0)
        def _skip():
          o_g[rows, cols] = plgpu.layout_cast(jnp.zeros((wm, BN), out_dtype), WG)

        return t0 + jnp.where(e >= 0, ks, 0).astype(jnp.int32), e_next

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret, scratch_types=scratch)
  return call(block_expert, xq, sfx_t, wq, wsf)


def _wide_tile(e, c0, r0, t0, *, wg, wm, bn, ks, stages, first_cols_cases, x_s, w_s, sx_s, sfw_g, produced,
               consumed, out_s, o_g, out_dtype, interpret, release=None, w_scales_smem=None):
  """One compute warpgroup's ``(wm, bn)`` tile of the 192-column kernels (:func:`_wide_kernel`,
  :func:`_pair_mc_kernel`) for expert ``e >= 0``: the K loop over the pipeline's slots from ``t0`` (the step's x
  scales read and multiplied by the two column blocks' weight scales; the wgmma; the per-step promotion), then the
  TMA-store epilogue. The tile's split between two weight-scale blocks (``first_cols``) is a compile-time constant
  per case. A slot is released by ``release(slot)`` once its wgmma has completed and its x scales are in registers
  (default: every thread's arrival on ``consumed[slot]``).

  Weight scales: scalar GMEM loads two steps ahead in the loop carry, or (``w_scales_smem = (sw_s, full, free)``)
  the tile's ``(2, K/128)`` rows of them, TMA'd into SMEM once per item by the memory warpgroup
  (:func:`_tile_w_scales_loader`; two buffers by the parity of the CTA's loaded items, ``full`` their barriers),
  read per step before the wgmma; the warpgroup arrives on ``free`` once its K loop is done with them."""
  if release is None:
    release = lambda slot: plgpu.barrier_arrive(consumed.at[slot])
  scale_block = c0 // BLOCK
  if w_scales_smem is not None:
    sw_all, sw_full, sw_free = w_scales_smem
    parity = lax.rem(t0 // ks, 2)
    sw = sw_all.at[parity]

  def w_scales(s):  # the weight scales of the tile's two column blocks at step s
    s = jnp.minimum(s, ks - 1)
    return sfw_g[e, scale_block, s], sfw_g[e, scale_block + 1, s]

  def k_loop(first_cols, acc):
    def step(s, carry, slot):
      if w_scales_smem is None:
        total, (w0, w1), w_next = carry
      else:
        total = carry
      plgpu.barrier_wait(produced.at[slot])
      # The step's x scales are read from SMEM and multiplied by the weight scales before the wgmma (as DeepGEMM
      # does), so their latency is hidden under the tensor-core work and only the release and the FMAs follow the
      # wait. H200, 2026-11-29, "wide192", M = 32768, N = 7168, K = 2048: 1236 -> 1264 TF/s at G = 4, 1230 -> 1257
      # at G = 8 against reading them after the wait; bit-identical.
      sx = plgpu.load(sx_s.at[slot, pl.ds(wg * wm, wm)], layout=WG.reduce(1), optimized=False)
      if w_scales_smem is not None:
        w0, w1 = sw[0, s], sw[1, s]
      s0, s1 = sx * w0, sx * w1
      _zero_acc(acc, interpret)
      plgpu.wgmma(acc, x_s.at[slot, pl.ds(wg * wm, wm)], w_s.at[slot].T)
      part = plgpu.wgmma_accumulator_load(acc, wait_n=0)
      release(slot)
      promoted = jnp.concatenate([part[:, :first_cols] * s0[:, None],
                                  part[:, first_cols:] * s1[:, None]], axis=1)
      return (total + promoted, w_next, w_scales(s + 2)) if w_scales_smem is None else total + promoted

    # The slot rides in the carry, computed off the path from one step's wgmma wait to the next step's wgmma.
    # "pair192", H200, 2026-11-30 (CUPTI, cold L2, M = 32768, three alternating rounds of 10): G = 4, N = 4096,
    # K = 7168 1332.9-1334.9 -> 1341.7-1343.3 TF/s, G = 8 1325.4-1330.0 -> 1335.8-1339.6; N = 7168, K = 2048
    # 1336.6-1339.0 -> 1338.3-1340.0; bit-identical.
    # Two steps per loop iteration where K/128 and the ring are even: ``t0`` is a multiple of K/128, so each pair of
    # steps starts at an even slot and its second slot is the first plus one, with no wrap; ptxas then schedules the
    # second step's barrier arithmetic among the first step's FMAs. With the weight scales staged in SMEM
    # (:func:`_w_scales_staged`), "pair192", H200, 2026-11-30 (CUPTI, cold L2, M = 32768, three alternating rounds of
    # 10): G = 4, N = 7168, K = 2048 1344.9-1346.9 -> 1356.6-1359.2 TF/s; bit-identical. With the scalar weight-scale
    # loads it was slower at K = 7168 (1333.9-1334.8 -> 1322.8-1327.5), so K = 7168 stages its scales too.
    per_iter = 2 if ks % 2 == 0 and stages % 2 == 0 else 1

    def loop(init):
      def steps(j, carry):
        carry, slot = carry
        for i in range(per_iter):
          carry = step(per_iter * j + i, carry, slot + i)
        return carry, _ring_slot(slot + per_iter, stages)

      return lax.fori_loop(0, ks // per_iter, steps, (init, _ring_slot(t0, stages)))[0]

    zero = plgpu.layout_cast(jnp.zeros((wm, bn), jnp.float32), WG)
    if w_scales_smem is None:
      return loop((zero, w_scales(0), w_scales(1)))[0]
    plgpu.barrier_wait(sw_full.at[parity])
    total = loop(zero)
    plgpu.commit_smem()  # fence + warpgroup barrier: every warp has read the scales before warp 0 frees them
    plgpu.barrier_arrive(sw_free.at[parity])
    return total

  for first_cols in first_cols_cases:
    @pl.when((e >= 0) & (c0 % BLOCK == BLOCK - first_cols))
    def _run():
      total = pl.run_scoped(functools.partial(k_loop, first_cols), plgpu.ACC((wm, bn), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read out_s
      out_s[wg] = total.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_s.at[wg], o_g.at[pl.ds(pl.multiple_of(r0, wm), wm), pl.ds(c0, bn)])


def _check_wide_tile(bn: int) -> None:
  """A ``bn``-column tile of the 192-column kernels must straddle at most two 128-column weight-scale blocks from
  every first column it can start at (a multiple of ``gcd(bn, 128)``): ``bn - gcd(bn, 128) <= 128``, so ``bn`` is 160
  or 192 (224 would start 96 columns into a block and reach a third; 256 divides into whole blocks, the 128-column
  kernels' case). H200, 2026-11-30 (CUPTI, cold L2, M = 32768, two rounds of 10), TF/s, ``"pair192_r32"`` against
  ``bn = 160``: G = 4 / 8, N = 7168, K = 2048 1303.5 / 1303.9 against 1233.4 / 1233.8 (45 column tiles of which 0.4%
  are computed twice instead of 38 and 1.8%; 5 ring stages instead of 4: 1219); G = 8, N = 4096, K = 7168
  (``"pair192"``) 1307.3 against 1257.1; bit-identical."""
  if not (BLOCK < bn < 2 * BLOCK and bn % 32 == 0 and bn - np.gcd(bn, BLOCK) <= BLOCK):
    raise ValueError(f"bn={bn}: the 192-column kernels take 160 or 192 columns per tile")


def _tile_w_scales_loader(wsf_g, sw_s, sw_full, sw_free, *, ks, expert_index=lambda e: e):
  """The memory warpgroup's hooks (``on_item``, ``on_end`` of :func:`_ring_memory_warpgroup`) for SMEM weight
  scales: per loaded item the TMA of the tile's two rows of weight scales (column blocks ``c0 // 128`` and the next,
  all K steps) into the buffer of the item's parity, once the compute warpgroups are done with the item two before
  it; at the end, the wait for their release of the last two items (every phase of the ``free`` barriers
  observed before the kernel ends)."""
  def on_item(t0, mi, c0, e):
    del mi
    item = t0 // ks
    parity = lax.rem(item, 2)

    @pl.when(item >= 2)
    def _wait_free():
      plgpu.barrier_wait(sw_free.at[parity])

    if _w_scales_per_block(ks):
      for j in range(2):
        plgpu.copy_gmem_to_smem(wsf_g.at[expert_index(e), c0 // BLOCK + j, :], sw_s.at[parity, j, pl.ds(0, ks)],
                                sw_full.at[parity])
    else:
      plgpu.copy_gmem_to_smem(wsf_g.at[expert_index(e), pl.ds(c0 // BLOCK, 2), :], sw_s.at[parity],
                              sw_full.at[parity])

  def on_end(total_steps):
    @pl.loop(jnp.maximum(total_steps // ks - 2, 0), total_steps // ks)
    def _drain(item):
      plgpu.barrier_wait(sw_free.at[lax.rem(item, 2)])

  return on_item, on_end


# From this K the memory warpgroup of :func:`_pair_mc_kernel` issues its loads from one warp (the other three end at
# once): fewer instructions and no warpgroup barriers between a slot's release and its loads. H200, 2026-11-30 (CUPTI,
# cold L2, M = 32768, three alternating rounds of 10, bit-identical, 20 runs of the fused layout gave one result),
# TF/s, four warps against one: N = 4096, K = 7168 1292.0-1312.7 -> 1318.7-1328.8 at G = 4, 1289.3-1310.6 ->
# 1317.3-1330.2 at G = 8; but N = 7168, K = 4096 1360.0-1371.5 -> 1333.2-1341.3 and K = 2048 1327.3-1335.9 ->
# 1305.2-1311.4 at G = 4 (those two stage the weight scales per item from the same warp).
ONE_WARP_LOADS_MIN_K = 6144


# :func:`_pair_mc_kernel` stages a tile's weight scales in SMEM where a row of them (``K/128`` float32) is whole
# 16-byte units, as a TMA needs (``K/128`` a multiple of 4; elsewhere scalar GMEM loads). Where ``K/128`` is also a
# multiple of :data:`W_SCALES_SMEM_UNIT`, each ``(2, K/128)`` buffer is whole 128-byte units (a TMA into SMEM lands
# 128-byte aligned) and one TMA brings both column blocks' rows; otherwise (K = 7168: 56 scales, 224 bytes) one TMA
# per column block lands in a row padded to 128-byte units. That is what let K = 7168 take the two-step K loop
# (``_wide_tile``): "pair192", H200, 2026-11-30 (CUPTI, cold L2, M = 32768, three alternating rounds of 10), G = 4,
# N = 4096, K = 7168 1338.2-1352.2 -> 1374.4-1378.2 TF/s, G = 8 1311.5-1349.7 -> 1369.1-1377.7; staged without the
# two-step loop it gained nothing (1315.8-1320.6 against 1315.7-1320.0). An earlier form that padded the scales to 64
# columns in XLA before the kernel cost more than it saved (2026-11-29: 1290.2-1291.0 against 1299.8-1300.8).
W_SCALES_SMEM_UNIT = 16
W_SCALES_ROW_UNIT = 4


def _w_scales_staged(ks: int) -> bool:
  return ks % W_SCALES_ROW_UNIT == 0 or ks % W_SCALES_SMEM_UNIT == 0


def _w_scales_per_block(ks: int) -> bool:  # one TMA per column block, into rows padded to 128-byte units
  return ks % W_SCALES_SMEM_UNIT != 0


def _w_scales_row(ks: int) -> int:  # floats per row of a staged buffer
  return -(-ks // 32) * 32 if _w_scales_per_block(ks) else ks


def _w_scales_scratch(ks: int):
  return dict(sw_s=plgpu.SMEM((2, 2, _w_scales_row(ks)), jnp.float32),
              sw_full=plgpu.Barrier(num_arrivals=2 if _w_scales_per_block(ks) else 1, num_barriers=2),
              sw_free=plgpu.Barrier(num_arrivals=2, num_barriers=2))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "bn", "stages"))
def _wide_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, bn=192, stages=5):
  """The SMEM ring of :func:`_ring_kernel` with ``bn``-column tiles, ``128 < bn < 256`` a multiple of
  32 (arguments as :func:`_simple_kernel`): each compute warpgroup computes a ``64 x bn`` tile (DeepGEMM's
  wide CTA tiles), so a wgmma reads fewer SMEM bytes per FLOP than at 128 columns and each item's fixed costs are
  spread over more FLOPs.

  ``N`` need not be a multiple of ``bn``: the last column tile of a row starts at ``N - bn`` and overlaps the one
  before it (the overlapping columns are computed twice, identically, and stored twice). A tile straddles two
  128-column weight-scale blocks, the first ``b`` of its columns in block ``c0 // 128`` (``b = 128 - c0 % 128``, a
  multiple of ``gcd(bn, 128)``): the K loop is traced once per possible ``b``, and each step promotes the static
  column slices ``[:b]`` and ``[b:]`` of the wgmma result with their own row-scale vector, ``sf_x[row] *
  sf_w[block]`` (the other kernels' float32 products; per-element scale products instead cost 10-16% and a column
  mask spills: H200, 2026-11-28). The two weight scales of a step are scalar loads two steps ahead. Items: all column
  tiles of a row block, then the next row block. ``N < bn`` runs :func:`_ring_kernel`.
  """
  m, k = xq.shape
  _, n, _ = wq.shape
  _check_wide_tile(bn)
  if n < bn:
    return _ring_kernel(block_expert, xq, sfx_t, wq, wsf, out_dtype=out_dtype, interpret=interpret, num_sms=num_sms,
                        stages=stages)
  ks = k // BLOCK
  m_iters, n_iters = m // BLOCK, -(-n // bn)
  wm = BLOCK // 2  # rows per compute warpgroup
  out_bytes = 2 * wm * bn * jnp.dtype(out_dtype).itemsize
  stage_bytes = (BLOCK + bn) * BLOCK + BLOCK * 4
  while stages > 2 and stages * stage_bytes + out_bytes > SMEM_LIMIT - 2048:  # 1024-byte alignment of 5 buffers
    stages -= 1
  scratch = dict(
      x_s=plgpu.SMEM((stages, BLOCK, BLOCK), xq.dtype, transforms=FP8_TILED),
      w_s=plgpu.SMEM((stages, bn, BLOCK), wq.dtype, transforms=FP8_TILED),
      sx_s=plgpu.SMEM((stages, BLOCK), jnp.float32),
      out_s=plgpu.SMEM((2, wm, bn), out_dtype, transforms=_out_transforms(out_dtype, bn)),
      produced=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages))
  first_cols_cases = range(BLOCK, 0, -int(np.gcd(bn, BLOCK)))  # every c0 is a multiple of gcd(bn, 128)

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g, *, x_s, w_s, sx_s, out_s, produced, consumed):
    wg = lax.axis_index("wg")
    items = (m_iters * n_iters,)

    def coords(lin):  # (row block, first column) of item ``lin``
      mi, ni = lin // n_iters, lin % n_iters
      return mi, pl.multiple_of(jnp.minimum(ni * bn, n - bn), 32)

    def expert_of(lin):  # clamped: a prefetch past the last item is unused
      return be_g[coords(jnp.minimum(lin, items[0] - 1))[0]]

    ctas = lax.axis_size("sm")
    first = (jnp.int32(0), expert_of(lax.axis_index("sm")))

    @pl.when(wg == 2)
    def _memory():
      def load(slot, s, mi, c0, e):
        kcols = pl.ds(s * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(mi * BLOCK, BLOCK), kcols], x_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(w_g.at[e, pl.ds(c0, bn), kcols], w_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(sfx_g.at[s, pl.ds(mi * BLOCK, BLOCK)], sx_s.at[slot], produced.at[slot])

      _ring_memory_warpgroup(items, first, coords, expert_of, load, steps=ks, stages=stages, consumed=consumed)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")

      @plgpu.nd_loop(items, collective_axes="sm", init_carry=first)
      def _items(info, carry):
        (lin,) = info.index
        t0, e = carry
        e_next = expert_of(lin + ctas)
        mi, c0 = coords(lin)
        r0 = mi * BLOCK + wg * wm
        _wide_tile(e, c0, r0, t0, wg=wg, wm=wm, bn=bn, ks=ks, stages=stages, first_cols_cases=first_cols_cases,
                   x_s=x_s, w_s=w_s, sx_s=sx_s, sfw_g=sfw_g, produced=produced, consumed=consumed, out_s=out_s,
                   o_g=o_g, out_dtype=out_dtype, interpret=interpret)

        @pl.when(e < 0)
        def _skip():
          o_g[pl.ds(r0, wm), pl.ds(c0, bn)] = plgpu.layout_cast(jnp.zeros((wm, bn), out_dtype), WG)

        return t0 + jnp.where(e >= 0, ks, 0).astype(jnp.int32), e_next

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret, scratch_types=scratch)
  return call(block_expert, xq, sfx_t, wq, wsf)


def row_unit_group(units: int, rows_per_group: int, cluster: int) -> int:
  """Row units (of ``cluster`` 128-row blocks) per raster group of :func:`_pair_mc_kernel`: the largest divisor of
  ``units`` that keeps a group within ``rows_per_group`` row blocks (at least one unit)."""
  cap = max(rows_per_group // cluster, 1)
  return max(d for d in range(1, min(cap, units) + 1) if units % d == 0)


def pair_load_code(own, peer, g: int):
  """What the CTA of a row block of expert ``own`` loads beside its pair's block of expert ``peer`` in
  :func:`_pair_mc_kernel` (integers or arrays, -1 = skipped): -1 nothing (both blocks skipped), else the expert whose
  weight tile it loads (its own, or its peer's where its own block is skipped), plus ``g`` where both blocks have the
  same expert and the tile is multicast to the pair. Both CTAs of a pair get -1 together and the multicast together,
  so they walk the same ring slots and each multicast has both halves issued."""
  shared = (own == peer) & (own >= 0)
  return jnp.where((own < 0) & (peer < 0), -1, jnp.where(own >= 0, own, peer) + jnp.where(shared, g, 0))


def pair_unit(u, units_per_group: int, n_tiles: int):
  """Work unit ``u`` of :func:`_pair_mc_kernel` -> (row-block pair, column tile): ``units_per_group`` pairs per
  raster group, pairs fastest inside a group, then the column tiles, groups slowest."""
  grp, within = u // (units_per_group * n_tiles), u % (units_per_group * n_tiles)
  return grp * units_per_group + within % units_per_group, within // units_per_group


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "bn", "stages", "row_group"))
def _pair_mc_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, bn=192, stages=4,
                    row_group=16):
  """:func:`_wide_kernel` (``64 x bn`` tiles per compute warpgroup, one SMEM ring through all items, promotion after
  each step's wgmma) with DeepGEMM's schedule for the m-grouped contiguous layout (arguments as
  :func:`_simple_kernel`):

  * Clusters of 2 CTAs on the row blocks ``(2p, 2p + 1)`` of one column tile. Where both blocks belong
    to the same expert, the weight tile both need is loaded once for the pair by TMA multicast (each CTA's memory
    warpgroup fetches half of it into both CTAs' SMEM): 28 instead of 40 KiB per CTA per K step from L2 at
    ``bn = 192``. Otherwise each CTA loads the weight tile of its own expert (a CTA whose block is skipped loads its
    peer's, computes nothing and writes zeros, so that both CTAs walk the ring in step; :func:`pair_load_code`).
  * A slot is refilled only when both CTAs are done with it (the peer's multicast writes into it): each compute
    warpgroup of both CTAs arrives on a cluster barrier (``consumed``) in both CTAs, and the memory warpgroups wait
    for all four arrivals. Mosaic GPU's cluster-barrier arrival comes from the warpgroup's first warp only, so each
    release is preceded by a warpgroup barrier (:func:`_warpgroup_barrier`): all four warps have completed their
    wgmma and read the step's x scales before the slot is handed to the pair. Without any barrier a slot could be
    released by one warp while the other warps of the warpgroup still read it: on the training step's fused layout
    (H200, 2026-11-29, 40 runs of one executable) 26 and 39 of the 39 later runs differed from the first at
    N = 4096, K = 7168 and N = 7168, K = 2048 (64-row tiles of the last row blocks, 8-row runs); with
    ``plgpu.commit_smem()`` (proxy fence + warpgroup barrier) all 40 gave the same bits as ``"wide192"``, and with
    the warpgroup barrier alone (2026-11-30) so did 20 runs, and the GPU determinism tests. Relaying every thread's
    CTA-local arrival through the memory warpgroups (no fence, no warpgroup barrier) still differed in 16-39 of 39.
  * Raster: groups of ``row_group`` row blocks (:func:`row_unit_group`, :func:`pair_unit`), row blocks fastest
    inside a group, then the column tiles, groups slowest; the CTAs of one wave share a few weight tiles and
    ``row_group`` row blocks of ``x``.
  * Where ``K/128`` is a multiple of 4 (:func:`_w_scales_staged`), the weight scales of a tile (its two 128-column
    blocks, every K step) are TMA'd into SMEM once per item by the memory warpgroup, as DeepGEMM stages them
    (:func:`_tile_w_scales_loader`), and read from there each step (:func:`_wide_tile`) instead of two scalar GMEM
    loads a step (as :func:`_wide_kernel` reads them). H200, 2026-11-29, M = 32768, N = 7168, K = 2048 (CUPTI, cold
    L2, two rounds of 10): 1288.1-1289.2 -> 1301.9-1304.0 TF/s at G = 4, 1286.4-1287.7 -> 1302.9-1304.2 at G = 8,
    bit-identical; at K = 7168 (rows padded, :data:`W_SCALES_SMEM_UNIT`) they are what the two-step K loop needs.

  * From :data:`ONE_WARP_LOADS_MIN_K` the loads come from one warp of the memory warpgroup.
  * The memory warpgroup issues each step's weight tile before its x tile and x scales: the slot is complete only
    once both halves of a multicast tile, one from each CTA, have landed, so those go out first. H200, 2026-11-30
    (CUPTI, cold L2, M = 32768, four alternating rounds of 10): N = 7168, K = 2048 1280.7-1287.1 -> 1303.1-1307.2
    TF/s at G = 4, 1284.1-1286.2 -> 1306.0-1307.4 at G = 8; N = 4096, K = 7168 unchanged (1275.5-1293.7 against
    1281.7-1290.5); bit-identical, and 20 runs of the fused layout with skipped row blocks gave one result.

  Same numerics as the other kernels (bit-identical results). Falls back to :func:`_wide_kernel` where ``N < bn`` or
  ``M/128`` is odd.
  """
  cluster = 2  # CTAs per cluster: one row block each
  m, k = xq.shape
  g, n, _ = wq.shape
  _check_wide_tile(bn)
  m_iters = m // BLOCK
  if n < bn or m_iters % cluster:
    return _wide_kernel(block_expert, xq, sfx_t, wq, wsf, out_dtype=out_dtype, interpret=interpret, num_sms=num_sms,
                        bn=bn, stages=stages)
  ks = k // BLOCK
  n_iters = -(-n // bn)
  wm = BLOCK // 2  # rows per compute warpgroup
  row_units = m_iters // cluster
  gp = row_unit_group(row_units, row_group, cluster)
  units = row_units * n_iters
  stage_w_scales = _w_scales_staged(ks)
  sw_bytes = 2 * 2 * _w_scales_row(ks) * 4 if stage_w_scales else 0
  out_bytes = 2 * wm * bn * jnp.dtype(out_dtype).itemsize
  stage_bytes = (BLOCK + bn) * BLOCK + BLOCK * 4
  while stages > 2 and stages * stage_bytes + out_bytes + sw_bytes > SMEM_LIMIT - 2048:  # 1024-byte alignment
    stages -= 1
  scratch = dict(
      x_s=plgpu.SMEM((stages, BLOCK, BLOCK), xq.dtype, transforms=FP8_TILED),
      w_s=plgpu.SMEM((stages, bn, BLOCK), wq.dtype, transforms=FP8_TILED),
      sx_s=plgpu.SMEM((stages, BLOCK), jnp.float32),
      out_s=plgpu.SMEM((2, wm, bn), out_dtype, transforms=_out_transforms(out_dtype, bn)),
      produced=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      consumed=plgpu.ClusterBarrier(collective_axes=("cl",), num_arrivals=2, num_barriers=stages),
      **(_w_scales_scratch(ks) if stage_w_scales else {}))
  first_cols_cases = range(BLOCK, 0, -int(np.gcd(bn, BLOCK)))  # every c0 is a multiple of gcd(bn, 128)

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g, *, x_s, w_s, sx_s, out_s, produced, consumed, sw_s=None,
           sw_full=None, sw_free=None):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cl")

    def coords(u, hint=True):  # (this CTA's row block, first column) of unit ``u``; ``hint``: the column's alignment
      unit, j = pair_unit(u, gp, n_iters)
      c0 = jnp.minimum(j * bn, n - bn)
      return unit * cluster + cta, pl.multiple_of(c0, 32) if hint else c0

    def experts_of(u):  # (own expert, the pair's load code); clamped: a prefetch past the last unit is unused
      mi, _ = coords(jnp.minimum(u, units - 1), hint=False)
      own = be_g[mi]
      return own, pair_load_code(own, be_g[mi + 1 - 2 * cta], g)

    ctas = lax.axis_size("sm")
    first_own, first_code = experts_of(lax.axis_index("sm"))

    def release_slot(slot):  # a compute warpgroup is done with ``slot``: tell both CTAs of the pair
      if interpret:  # the interpreter runs no inline Mosaic GPU code; commit_smem is the same ordering and more
        plgpu.commit_smem()
      else:
        _warpgroup_barrier()  # every warp is done with the slot before warp 0 arrives
      plgpu.barrier_arrive(consumed.at[slot])

    @pl.when(wg == 2)
    def _memory():
      def load(slot, s, mi, c0, code):  # the weight tile first: the pair's two halves of it gate the slot
        kcols = pl.ds(s * BLOCK, BLOCK)
        w_src = w_g.at[lax.rem(code, g), pl.ds(c0, bn), kcols]

        @pl.when(code >= g)
        def _shared():
          plgpu.copy_gmem_to_smem(w_src, w_s.at[slot], produced.at[slot], collective_axes="cl")

        @pl.when(code < g)
        def _own():
          plgpu.copy_gmem_to_smem(w_src, w_s.at[slot], produced.at[slot])

        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(mi * BLOCK, BLOCK), kcols], x_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(sfx_g.at[s, pl.ds(mi * BLOCK, BLOCK)], sx_s.at[slot], produced.at[slot])

      on_item = on_end = None
      if stage_w_scales:  # the tile's weight scales of the expert whose weights the CTA loads (its own or its peer's)
        on_item, on_end = _tile_w_scales_loader(sfw_g, sw_s, sw_full, sw_free, ks=ks,
                                                expert_index=lambda c: lax.rem(c, g))
      one_warp = k >= ONE_WARP_LOADS_MIN_K
      # no alignment hint for the one-warp loop: pl.multiple_of has no lowering at warp scope
      _ring_memory_warpgroup((units,), (jnp.int32(0), first_code), functools.partial(coords, hint=not one_warp),
                             lambda u: experts_of(u)[1], load, steps=ks, stages=stages, consumed=consumed,
                             on_item=on_item, on_end=on_end, one_warp=one_warp)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")

      @plgpu.nd_loop((units,), collective_axes="sm", init_carry=(jnp.int32(0), first_own, first_code))
      def _items(info, carry):
        (lin,) = info.index
        t0, e, code = carry
        e_next, code_next = experts_of(lin + ctas)
        mi, c0 = coords(lin)
        r0 = mi * BLOCK + wg * wm
        _wide_tile(e, c0, r0, t0, wg=wg, wm=wm, bn=bn, ks=ks, stages=stages, first_cols_cases=first_cols_cases,
                   x_s=x_s, w_s=w_s, sx_s=sx_s, sfw_g=sfw_g, produced=produced, consumed=consumed, out_s=out_s,
                   o_g=o_g, out_dtype=out_dtype, interpret=interpret, release=release_slot,
                   w_scales_smem=(sw_s, sw_full, sw_free) if stage_w_scales else None)

        @pl.when((e < 0) & (code >= 0))
        def _peer_only():  # this block is skipped, its peer's is not: release each slot the pair's loads fill
          if stage_w_scales:  # and the weight scales loaded for the item (their barriers' phases stay in step)
            parity = lax.rem(t0 // ks, 2)
            plgpu.barrier_wait(sw_full.at[parity])
            plgpu.barrier_arrive(sw_free.at[parity])

          @pl.loop(0, ks)
          def _step(s):
            slot = _ring_slot(t0 + s, stages)
            plgpu.barrier_wait(produced.at[slot])
            release_slot(slot)

        @pl.when(e < 0)
        def _skip():
          o_g[pl.ds(r0, wm), pl.ds(c0, bn)] = plgpu.layout_cast(jnp.zeros((wm, bn), out_dtype), WG)

        return t0 + jnp.where(code >= 0, ks, 0).astype(jnp.int32), e_next, code_next

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
                      grid=(max(min(num_sms // cluster, units), 1),), grid_names=("sm",),
                      cluster=(cluster,), cluster_names=("cl",), num_threads=3, thread_name="wg",
                      scratch_types=scratch, interpret=interpret,
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return call(block_expert, xq, sfx_t, wq, wsf)


def _warpgroup_barrier():
  """A barrier of the calling warpgroup's four warps (Mosaic GPU's ``warpgroup_barrier``, a ``bar.sync`` of 128
  threads), without the shared-memory proxy fence of ``plgpu.commit_smem()``. :func:`_pair_mc_kernel` releases a
  ring slot with it: the slot is read only by the warpgroup's wgmmas (complete at their wait) and by its x-scale
  loads (complete before the wgmma is issued), so no generic-proxy write to it needs ordering before the TMA that
  refills it. In the SASS, ``commit_smem`` adds a ``MEMBAR.ALL.CTA`` and a ``FENCE.VIEW.ASYNC.S`` to each step.
  H200, 2026-11-30 (CUPTI, cold L2, M = 32768, three alternating rounds of 10): G = 4, N = 4096, K = 7168
  1301.8-1308.1 -> 1309.1-1315.7 TF/s, G = 8 1298.1-1308.5 -> 1306.4-1315.0; N = 7168, K = 2048 unchanged
  (1309.8-1311.6 against 1309.7-1310.0); bit-identical, and 20 runs of the fused layout with skipped row blocks
  gave one result."""
  @plgpu.inline_mgpu()
  def bar(ctx):
    del ctx
    mgpu_utils.warpgroup_barrier()

  bar()


# The kernels :func:`default_variant` picks, what they fall back to, and an independent check for the tests (module
# attribute read at trace time). The figures of the variants tried and dropped: docs/gemm.md and benchmarks/NOTES.md.
VARIANTS = {
    # DeepGEMM's schedule (:func:`_pair_mc_kernel`): 128 x 192 CTA tiles, weight tiles multicast to 2-CTA clusters
    # on row-block pairs; 16 row blocks per raster group (rows fastest), the default from PAIR_MIN_K where 192-column
    # tiles fit; "_r32": 32 row blocks per group, the default up to PAIR_R32_MAX_K
    "pair192": functools.partial(_pair_mc_kernel, bn=WIDE_TILE),
    "pair192_r32": functools.partial(_pair_mc_kernel, bn=WIDE_TILE, row_group=32),
    # the default below PAIR_MIN_K where 192-column tiles fit (:func:`_wide_kernel`: 64 x 192 tiles); also
    # :func:`_pair_mc_kernel`'s fallback for an odd number of row blocks
    "wide192": functools.partial(_wide_kernel, bn=WIDE_TILE),
    # deferred promotion over 2 x 128 of K per step, grouped column tiles (:func:`_raster_kernel`); "_ss": the
    # scales through the pipeline's SMEM
    "k2tma_gh": _raster_kernel,
    "k2tma_gh_ss": functools.partial(_raster_kernel, smem_scales=True),
    # one SMEM ring of 128-deep steps across a CTA's items, 64 x 128 tiles (:func:`_ring_kernel`)
    "ring_nodefer": _ring_kernel,
    # one CTA per (64-row, 128-column) tile, a plain TMA pipeline: the tests' independent check
    "simple": _simple_kernel}
VARIANT = None  # a VARIANTS key forces that kernel (tests, timing scripts); None: default_variant(K, N)
# From this K, "pair192" where the 192-column tile fits; below it "wide192" (not measured there). H200, 2026-11-29,
# CUPTI, L2 flushed, two rounds of 10, M = 32768, TF/s, G = 4 / G = 8, both kernels with the x scales read before the
# wgmma (bit-identical results; "pair192" deterministic over 20 runs of the training step's fused layout at the
# first two shapes): N = 4096, K = 7168 "pair192" 1328.2-1329.6 / 1323.4-1324.2 against "wide192" 1236.4-1237.9 /
# 1227.3-1227.9 (DeepGEMM 1275.2 / 1281.9); N = 7168, K = 2048 1288.8-1289.6 / 1290.8-1291.0 against 1266.1-1269.8 /
# 1258.7-1263.0 (DeepGEMM 1354.3 / 1228.6); the input gradient's N = 7168, K = 4096 1343.7-1343.9 / 1331.4-1338.3
# against 1240.6-1245.1 / 1227.7-1230.9, and N = 2048, K = 7168 1287.1-1289.6 / 1285.9-1286.6 against 1249.0-1249.6 /
# 1242.2-1243.0. (With the x scales read after the wgmma wait, "pair192" lost 5% to "wide192" at K = 4096 and tied
# at K = 2048, and the threshold was 6144.)
PAIR_MIN_K = 2048
# Up to this K "pair192" runs with 32 row blocks per raster group ("pair192_r32"), above it with 16. H200, 2026-11-29,
# CUPTI, L2 flushed, two rounds of 10, M = 32768, TF/s, bit-identical: N = 7168, K = 2048 G = 4 1283.2 / 1283.2 against
# 1273.2 / 1272.2 with 16, G = 8 1281.8 / 1280.8 against 1272.6 / 1271.1 (DeepGEMM 1354.3 / 1228.6); N = 4096, K = 7168
# G = 8 1254.6 / 1231.4 against 1290.4 / 1289.7 (8 row blocks: 1276.9 / 1267.3 at the two shapes; 64: 1272.9 / 1192.8).
PAIR_R32_MAX_K = 2048
# Where the 192-column tile does not fit: from GROUPED_RASTER_MIN_K the grouped raster (L2 reuse of the x rows over a
# group of column tiles) wins, below it the SMEM ring across items without deferral (short K loops: the gap between
# items is a larger share).
# H100, 2026-11-27, CUPTI cold L2, bf16 out, TF/s at K = 7168, N = 4096 (uniform / 32 skewed experts) and K = 2048,
# N = 7168 (uniform / skewed): "k2tma_g8" 1110 / 1101 and 970 / 955; "ring_nodefer" 1092 / 1063 and 1108 / 1101.
# The group size: half_row_group.
GROUPED_RASTER_MIN_K = 4096
# The share of extra columns the wide tile may compute (its last tile of a row overlaps the one before it where
# WIDE_TILE does not divide N) and still be the default: at N = 7168 (1.8% extra) "wide192" was 7-9% faster than
# 128-column tiles (H200, 2026-11-28, K = 2048: 1176-1198 against "ring_nodefer" 1104-1114 TF/s), so up to about 7%
# extra would break even; at N = 4096 and N = 2048 the extra is exactly 1/32.
WIDE_TILE_MAX_EXTRA = 1 / 32
# The largest K for which "k2tma_gh_ss" (scales through the pipeline's SMEM) is the default where the wide tile does
# not fit. H200, 2026-11-28 (two calls, TF/s, "k2tma_gh_ss" against "k2tma_gh"): K = 4096, N = 7168 1242 / 1220
# against 1162 / 1160, with 32 skewed experts 1215 / 1192 against 1162 / 1160; K = 7168, N = 4096 1184 / 1160 against
# 1200 / 1198 (32 skewed experts 1188 / 1164 against 1194 / 1196), K = 7168, N = 2048 1173 against 1183. At K = 7168
# the GPU runs at its 700 W power cap: ncu saw the SMEM scales raise the tensor pipe's share of cycles from 68% to
# 73% while the SM clock fell from 1.62 to 1.52 GHz, the same 1.62 ms.
SMEM_SCALES_MAX_K = 4096


def wide_tile_extra(n: int, bn: int = WIDE_TILE) -> float:
  """The share of columns computed twice by ``bn``-column tiles over ``n`` columns (``n >= bn``)."""
  return (-(-n // bn) * bn - n) / n


def default_variant(k: int, n: int) -> str:
  """The forward kernel for a contraction of ``k`` and ``n`` output columns. Where the 192-column tile's overlapping
  last tile adds at most :data:`WIDE_TILE_MAX_EXTRA` of the work: from :data:`PAIR_MIN_K` ``"pair192"`` (DeepGEMM's
  schedule, weight tiles multicast to 2-CTA clusters; ``"pair192_r32"`` up to :data:`PAIR_R32_MAX_K`), below it ``"wide192"`` (the same tiles and ring without
  clusters, as fast there). Elsewhere, from :data:`GROUPED_RASTER_MIN_K`: ``"k2tma_gh_ss"`` (deferred promotion,
  TMA-store epilogue, grouped column tiles, the scales through the pipeline's SMEM) up to :data:`SMEM_SCALES_MAX_K`,
  ``"k2tma_gh"`` (the same with GMEM scale loads) above it; below it ``"ring_nodefer"`` (one SMEM ring through all
  items, 64 x 128 tiles)."""
  if n >= WIDE_TILE and wide_tile_extra(n) <= WIDE_TILE_MAX_EXTRA:
    if k < PAIR_MIN_K:
      return "wide192"
    return "pair192_r32" if k <= PAIR_R32_MAX_K else "pair192"
  if k >= GROUPED_RASTER_MIN_K:
    return "k2tma_gh_ss" if k <= SMEM_SCALES_MAX_K else "k2tma_gh"
  return "ring_nodefer"


def _quant(name, x):
  if not isinstance(x, tuple) or len(x) != 2:
    raise ValueError(f"{name} must be a QuantTensor (data, sf), got {type(x).__name__}")
  return QuantTensor(_checks.as_array(f"{name}.data", x[0]), _checks.as_array(f"{name}.sf", x[1]))


def _check_sf(name, sf, shape, dtype):
  if tuple(sf.shape) != tuple(shape) or sf.dtype != jnp.dtype(dtype):
    raise ValueError(f"{name} must be {jnp.dtype(dtype).name} {tuple(shape)}, got {sf.dtype} {tuple(sf.shape)}")


def check_args(x, w, block_expert, out_dtype, x_use_tma_aligned_col_major_sf):
  """Validated ``(x, w, block_expert, out_dtype)``; raises ValueError naming the argument."""
  x, w = _quant("x", x), _quant("w", w)
  _checks.check_rank("x.data", x.data, 2)
  _checks.check_dtype("x.data", x.data, (jnp.float8_e4m3fn,))
  _checks.check_rank("w.data", w.data, 3)
  _checks.check_dtype("w.data", w.data, (jnp.float8_e4m3fn,))
  m, k = x.data.shape
  g, n, kw = w.data.shape
  if kw != k:
    raise ValueError(f"w.data must be (G, N, K) with x's K = {k}, got shape {tuple(w.data.shape)}")
  _checks.check_multiple("x.data", x.data, 0, BLOCK)
  _checks.check_multiple("x.data", x.data, 1, BLOCK)
  _checks.check_multiple("w.data", w.data, 1, BLOCK)
  if g == 0:
    raise ValueError("w.data must hold at least one expert (G >= 1)")
  kb = k // BLOCK
  if x.sf.dtype == jnp.int32:
    if not x_use_tma_aligned_col_major_sf:
      raise ValueError("x.sf: an int32 (packed UE8M0, layout C) sf needs x_use_tma_aligned_col_major_sf=True")
    _check_sf("x.sf", x.sf, (-(-kb // 4), m), jnp.int32)
  elif x_use_tma_aligned_col_major_sf:
    _check_sf("x.sf", x.sf, (kb, m), jnp.float32)
  else:
    _check_sf("x.sf", x.sf, (m, kb), jnp.float32)
  _check_sf("w.sf", w.sf, (g, n // BLOCK, kb), jnp.float32)
  block_expert = _checks.as_array("block_expert", block_expert)
  _checks.check_rank("block_expert", block_expert, 1)
  _checks.check_dtype("block_expert", block_expert, (jnp.int32,))
  if block_expert.shape[0] != m // BLOCK:
    raise ValueError(f"block_expert must have shape (M/128,) = ({m // BLOCK},), got {tuple(block_expert.shape)}")
  if not isinstance(block_expert, jax.core.Tracer):
    be = np.asarray(block_expert)
    if be.size and (be.min() < -1 or be.max() >= g):
      raise ValueError(f"block_expert entries must be -1 (skip) or expert ids in [0, {g}), "
                       f"got values in [{be.min()}, {be.max()}]")
  _checks.debug_check_entries("fp8_grouped_gemm", "block_expert", block_expert, lambda v: (v < -1) | (v >= g),
                              f"-1 (skip) or an expert id in [0, {g}) (G = w.data.shape[0]; treated as -1)")
  if jnp.dtype(out_dtype) not in tuple(jnp.dtype(d) for d in OUT_DTYPES):
    raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype).name}")
  return x, w, block_expert, jnp.dtype(out_dtype)


def column_major_x_scales(sf, m, kb, x_use_tma_aligned_col_major_sf):
  """The per-token sf of ``x`` as the kernel reads it: float32 ``(K/128, M)`` (layout B's buffer)."""
  if sf.dtype == jnp.float32 and x_use_tma_aligned_col_major_sf:
    return sf
  if sf.dtype == jnp.float32:
    return sf.T
  return rq.sf_to_float(sf, m, kb).T


def fp8_grouped_gemm(x: QuantTensor | tuple[jax.Array, jax.Array], w: QuantTensor | tuple[jax.Array, jax.Array],
                     block_expert: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
                     x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None) -> jax.Array:
  """FP8 grouped GEMM on the fused MoE layout: ``out[r, :] = x[r, :] · w[block_expert[r // 128]]ᵀ``.

  Args:
    x: QuantTensor ``(data (M, K) float8_e4m3fn, sf)`` in the fused (expert-major, 128-row aligned)
      layout, with per-token 1x128 scales as :func:`jaxkern.quant.per_token_cast` ``(..., "e4m3", 128)``
      or :func:`jaxkern.moe.expand_to_fused_with_sf` produce them: layout A float32 ``(M, K/128)``
      (default), layout B float32 ``(K/128, M)`` (``x_use_tma_aligned_col_major_sf=True``) or layout C
      packed UE8M0 int32 ``(ceil(K/512), M)`` (``x_use_tma_aligned_col_major_sf=True``, the int32 dtype
      says packed). The kernel reads layout B; A is transposed and C decoded to it by XLA in the wrapper.
    w: QuantTensor ``(data (G, N, K) float8_e4m3fn, sf (G, N/128, K/128) float32)``: the weights of each
      expert as ``(N, K)`` (K-major) with 128x128 block scales (``jax.vmap`` of
      :func:`jaxkern.quant.per_block_cast` ``(..., "e4m3", (128, 128))``).
    block_expert: ``(M/128,)`` int32, the expert of each 128-row block (``pos_to_expert[::128]`` of a
      :func:`jaxkern.moe.get_fused_mapping` with ``alignment=128``); ``-1`` marks a skipped block (e.g.
      past the last segment): its output rows are zero. Preconditions: entries in ``{-1} ∪ [0, G)``. Concrete
      values outside raise ``ValueError``; traced ones outside ``[0, G)`` are treated as ``-1`` (kernel and
      reference alike), and ``checkify.checkify(f, errors=checkify.user_checks)`` reports the first of them
      (docs/usage.md, "Bad values under jit").
    out_dtype: bfloat16 (default) or float32.
    x_use_tma_aligned_col_major_sf: the layout of ``x.sf`` (see ``x``).
    implementation: see :mod:`jaxkern._dispatch`.

  Returns:
    ``(M, N)`` ``out_dtype``.

  Numerics (DeepGEMM's): per 128-deep K step a float32 wgmma product, promoted into a float32
  accumulator with ``sf_x[r, step] · sf_w[e, n // 128, step]`` in step order, one rounding to
  ``out_dtype`` at the end (:mod:`jaxkern.reference.gemm`). Kernel and reference differ only by the
  summation order inside a step (and FMA contraction of the promotion on the CPU).

  Raises:
    ValueError: non-e4m3 data, M, K or N not multiples of 128, w's K not x's, scale shapes or dtypes
      other than above, ``block_expert`` not ``(M/128,)`` int32 or (concrete) out of range, another
      ``out_dtype``.

  XLA cases: ``M == 0`` (an empty result, no launch). ``"xla"`` runs the reference compiled by XLA.

  Differentiation: not differentiable (quantised inputs); :func:`jaxkern.modeling.fp8_grouped_linear`
  is the trainable layer. ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  x, w, block_expert, out_dtype = check_args(x, w, block_expert, out_dtype, x_use_tma_aligned_col_major_sf)
  x = QuantTensor(*_autodiff.guard("fp8_grouped_gemm", _autodiff.DEQUANT_ADVICE, *x))
  w = QuantTensor(*_autodiff.guard("fp8_grouped_gemm", _autodiff.DEQUANT_ADVICE, *w))
  m, k = x.data.shape
  g, n, _ = w.data.shape
  flag = x_use_tma_aligned_col_major_sf

  def reference():
    return ref.fp8_grouped_gemm(x, w, block_expert, out_dtype=out_dtype, x_use_tma_aligned_col_major_sf=flag)

  def kernel(interpret):
    be = jnp.where((block_expert >= 0) & (block_expert < g), block_expert, -1)
    sfx_t = column_major_x_scales(x.sf, m, k // BLOCK, flag)
    return VARIANTS[VARIANT or default_variant(k, n)](be, x.data, sfx_t, w.data, w.sf, out_dtype=out_dtype,
                             interpret=_config.mosaic_interpret(interpret), num_sms=_config.num_sms())

  def xla():
    if m == 0:
      return jnp.zeros((0, n), out_dtype)
    return reference()

  return _dispatch.run("fp8_grouped_gemm", implementation, kernel=kernel, xla=xla, reference=reference,
                       empty=m == 0)
