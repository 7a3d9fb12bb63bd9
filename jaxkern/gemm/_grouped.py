"""FP8 grouped GEMM on the fused MoE layout: ``out[r] = x[r] · w[block_expert[r // 128]]ᵀ`` (issue 24).

Mosaic GPU kernels (:func:`default_variant` picks one per K and N; :data:`VARIANT` forces one at trace time):

* ``"k2tma_gh"`` (the default for ``K > SMEM_SCALES_MAX_K``, :func:`_ws2_kernel`): persistent and
  warp-specialised like ``"ws"``, with deferred promotion (2 x 128 of K per pipeline step into two wgmma
  accumulators, the first promoted while the second runs; 3 stages), an SMEM + TMA-store epilogue overlapped with
  the next item, and items in groups of column tiles (L2 reuse; :func:`half_row_group`); ``"k2tma_g8"`` 8 per
  group, ``"k2tma"`` without the grouping. H200: 1186-1200 TF/s at the DeepSeek-V3 expert shapes with K = 7168,
  1152-1188 at their input-gradient shapes (benchmarks/NOTES.md).
* ``"k2tma_gh_ss"`` (the default for ``GROUPED_RASTER_MIN_K <= K <= SMEM_SCALES_MAX_K``): ``"k2tma_gh"`` with each
  step's scales TMA'd into the pipeline's SMEM beside its tiles instead of GMEM loads on the compute warpgroups'
  path. H200: 1192-1242 TF/s at K = 4096, N = 7168 (the gate / up projection's input gradient), 3-7% over
  ``"k2tma_gh"``.
* ``"wide192"`` (the default below ``GROUPED_RASTER_MIN_K`` where 192 nearly divides N, :func:`_wide_kernel`): one SMEM ring of 128-deep
  steps through all items of a CTA (the next item's tiles load while the current one finishes), 64 x 192 tiles per
  compute warpgroup, promotion after each step's wgmma. H200: 1176-1198 TF/s at K = 2048; ``"wide192_gh"`` grouped
  column tiles, ``"wide160"`` 64 x 160 tiles.
* ``"ring_nodefer"`` (:func:`_ws3_kernel`, the default below ``GROUPED_RASTER_MIN_K`` where 192-column tiles would
  compute more than 1/32 extra columns): the same ring with 64 x 128 tiles. H100: 1101-1108 TF/s at K = 2048.
* ``"ws"`` (:func:`_ws_kernel`, the first kernel, 780-857 TF/s), the design of ../shared/notes/fp8_grouped_gemm.md
  that reached 1,033-1,065 TF/s with scales on an H100 without an epilogue: persistent (one CTA per SM looping
  over (128-row block, 128-column tile) items, N fastest), warp-specialised (a TMA warpgroup runs ``STAGES``
  steps ahead of two compute warpgroups of 64 rows each; 64x128 float32 per warpgroup, 128x128 spilled in the
  notes); ``"ws6"`` the same with 6 stages.
* ``"simple"`` (:func:`_simple_kernel`): one CTA per (64-row tile, 128-column tile), one warpgroup, a
  ``plgpu.emit_pipeline`` TMA pipeline.
* Other ``"ring"`` variants (:func:`_ws3_kernel`, issue 24 round 3): the persistent kernel with its own
  K pipeline, one SMEM ring of 128-deep steps through all items of a CTA (the memory warpgroup loads the next
  item's tiles while the compute warpgroups finish the current one), promotion of each step under the next step's
  wgmma, the x scales TMA'd with the tiles; ``_g8`` grouped raster, ``_nodefer`` without the deferral, ``ring3``
  3 stages, ``ring_mc`` clusters of 2 CTAs sharing the x tile by TMA multicast, ``ring_late`` each item's epilogue
  under the next item's first wgmma.
* Other timed variants of :func:`_ws2_kernel`: ``"k2"`` (register epilogue), ``"tma"`` (no deferred promotion;
  4 stages), ``"k2tma2"`` (2 stages), ``"tma6"`` (6 stages), ``"tma_g8"``, and ``"k2tma_g1"`` (row blocks
  fastest; for the tests of the item order).

Both: per 128-deep K step the ``(rows, 128)`` e4m3 tile of ``x`` and the ``(128, 128)`` e4m3 tile of ``w[e]``
(stored ``(N, K)``, i.e. K-major, passed to wgmma transposed: FP8 wgmma needs K-major operands on both sides)
land in swizzled SMEM; the step's wgmma accumulates into a fresh float32 accumulator, whose value is promoted
into the float32 carry as ``total += p · (sf_x[rows, step] · sf_w[e, n_block, step])`` (DeepGEMM's numerics;
the scale loads are issued after the wgmma, in ``"ws"`` one step ahead). Items whose block id is -1 (or
outside ``[0, G)``) write zeros and load nothing. Results go from registers straight to GMEM (``"ws"``) or through SMEM and a TMA store (``"tma"`` variants).

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
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.reference import gemm as ref
from jaxkern.reference import quant as rq
from jaxkern.types import QuantTensor

BLOCK = 128  # rows per expert block of the fused layout, K step, weight-scale block
BM = 64  # rows per CTA (one wgmma M per warpgroup)
BN = 128  # output columns per CTA
STAGES = 4  # TMA pipeline depth: 4 x (8 + 16) KiB of SMEM
WIDE_TILE = 192  # output columns per compute warpgroup of "wide192", the default below GROUPED_RASTER_MIN_K
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


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "stages"))
def _ws_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, stages=STAGES):
  """The persistent warp-specialised kernel (arguments as :func:`_simple_kernel`): one CTA per SM loops
  over the (128-row block, 128-column tile) work items, N fastest; a memory warpgroup issues the TMA
  loads of ``stages`` steps ahead (32 KiB of SMEM each; 6 fit, 8 do not), two compute warpgroups take
  64 rows each (64x128 f32 per warpgroup: the notes' 128x128 per warpgroup spilled). Each step's scales
  are loaded one step ahead (their GMEM latency is longer than a step's wgmma)."""
  m, k = xq.shape
  _, n, _ = wq.shape
  ks = k // BLOCK
  m_iters, n_iters = m // BLOCK, n // BN
  wm = BLOCK // 2  # rows per compute warpgroup

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g):
    wg = lax.axis_index("wg")

    pipeline = functools.partial(_k_pipeline, steps=ks, step_k=BLOCK, stages=stages)

    ignore = lambda *_, **__: None

    @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(x_g, w_g.at[0]),
                       collective_axes="wg")
    def _scope(allocs):
      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _items(info):
        (lin,) = info.index
        mi, ni = lin // n_iters, lin % n_iters
        e = be_g[mi]
        rows = pl.ds(mi * BLOCK + wg * wm, wm)
        cols = pl.ds(ni * BN, BN)

        def scales(kk):
          return plgpu.load(sfx_g.at[kk, rows], layout=WG.reduce(1), optimized=False), sfw_g[e, ni, kk]

        def compute_context(run_pipeline):
          sx, sw = scales(0)
          total, _, _ = run_pipeline((plgpu.layout_cast(jnp.zeros((wm, BN), jnp.float32), WG), sx, sw))
          o_g[rows, cols] = total.astype(out_dtype)

        def mma_body(idx, x_s, w_s, carry):
          (kk,) = idx
          total, sx, sw = carry

          def scope(acc):
            plgpu.wgmma(acc, x_s.at[pl.ds(wg * wm, wm)], w_s.T)
            nxt = scales(jnp.minimum(kk + 1, ks - 1))
            return acc[...], nxt

          part, (sx_next, sw_next) = pl.run_scoped(scope, plgpu.ACC((wm, BN), jnp.float32))
          return total + part * (sx * sw)[:, None], sx_next, sw_next

        @pl.when(e >= 0)
        def _compute():
          pipeline(mma_body, compute_context)(x_g.at[pl.ds(mi * BLOCK, BLOCK), :], w_g.at[e, cols, :],
                                              allocations=allocs)

        @pl.when((e < 0) & (wg < 2))
        def _skip():
          o_g[rows, cols] = plgpu.layout_cast(jnp.zeros((wm, BN), out_dtype), WG)

  return _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret)(
      block_expert, xq, sfx_t, wq, wsf)


def _out_transforms(dtype, cols: int = BN):
  """Swizzled SMEM tiling of a ``(rows, cols)`` output staging tile: the widest swizzle that divides a row's bytes."""
  row_bytes = cols * jnp.dtype(dtype).itemsize
  swizzle = next(sw for sw in (128, 64, 32) if row_bytes % sw == 0)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "stages", "kpair", "epilogue",
                                             "group_n", "smem_scales"))
def _ws2_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, stages=4, kpair=2,
                epilogue="tma", group_n=None, smem_scales=False):
  """:func:`_ws_kernel` (arguments as :func:`_simple_kernel`) with two speed options (issue 24):

  * ``kpair=2`` (deferred promotion): a pipeline step carries ``2 x 128`` of K (``stages`` such steps in
    SMEM, 64 KiB each: 3 fit); each compute warpgroup issues both steps' wgmmas into two accumulators, then
    waits for the first only (``wgmma_accumulator_load(wait_n=1)``) and promotes it while the second runs,
    then promotes the second. Same numerics: every 128-deep product is promoted on its own, in step order.
    Falls back to ``kpair=1`` when ``K/128`` is odd.
  ``stages`` shrinks (down to 2) until the pipeline and the staging tile fit SMEM.
  * ``epilogue="tma"``: the result goes registers -> swizzled SMEM (one ``(64, 128)`` tile per compute
    warpgroup) -> TMA store, whose completion is only awaited before the next item's result is staged, so
    the store overlaps the next item's main loop (``"reg"``: registers straight to GMEM).
  * ``group_n`` (grouped rasterisation for L2 reuse): items walk ``gcd(group_n, N/128)`` column tiles at a
    time, 128-row blocks slower, column groups slowest, so the CTAs of one wave share fewer distinct ``x``
    row blocks and weight tiles (``None``: all column tiles of a row block, then the next row block;
    ``"half"``: :func:`half_row_group`).
  * ``smem_scales=True``: the step's scales travel through the pipeline with its tiles (a TMA of the ``(kp, 128)``
    x scales and one of the ``kp`` weight scales, from a copy the wrapper pads to :data:`SCALE_ROW` lanes per step
    so that each slot is 128-byte aligned), and the compute warpgroups read them from SMEM. Otherwise they are GMEM
    loads issued a step ahead, whose latency the warpgroups wait out (ncu, H200, session 26: a fifth of the compute
    warps' stall samples at A).
  """
  m, k = xq.shape
  g, n, _ = wq.shape
  ks = k // BLOCK
  kp = kpair if ks % kpair == 0 else 1
  steps = ks // kp
  m_iters, n_iters = m // BLOCK, n // BN
  wm = BLOCK // 2  # rows per compute warpgroup
  tma_out = epilogue == "tma"
  if group_n is None:
    gn = n // BN
  elif group_n == "half":
    gn = half_row_group(n // BN)
  else:
    gn = int(np.gcd(group_n, n // BN))
  scale_bytes = (kp * BLOCK + SCALE_ROW) * 4 if smem_scales else 0
  stage_bytes = kp * (BLOCK + BN) * BLOCK + scale_bytes

  def out_bytes(cols):
    return 2 * wm * cols * jnp.dtype(out_dtype).itemsize if tma_out else 0

  # The staging tile's columns: all BN, or half of them (two stores per item) where that keeps a stage more.
  out_cols = BN
  fits = lambda st, cols: st * stage_bytes + out_bytes(cols) <= SMEM_LIMIT - 1024
  if tma_out and not fits(stages, BN) and fits(stages, BN // 2):
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
    allocs = dict(pipe=pipeline(ignore, ignore).get_allocations(*pipe_refs))
    if tma_out:
      allocs["out_s"] = plgpu.SMEM((2, wm, out_cols), out_dtype, transforms=_out_transforms(out_dtype, out_cols))

    @functools.partial(pl.run_scoped, collective_axes="wg", **allocs)
    def _scope(pipe, out_s=None):
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
          if tma_out:
            for c in range(0, BN, out_cols):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store has read out_s
              out_s[wg] = (total if out_cols == BN else total[:, c:c + out_cols]).astype(out_dtype)
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_s.at[wg], o_g.at[rows, pl.ds(ni * BN + c, out_cols)])
          else:
            o_g[rows, cols] = total.astype(out_dtype)

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

      if tma_out:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret)(
      block_expert, xq, sfx_t, wq, wsf)


# Column tiles per raster group of "k2tma_gh": half a row of tiles, and a whole row up to this many. H200, 2026-11-27
# (session 23, TF/s): 32 tiles (N=4096, K=7168; A / C) 16 per group 1200 / 1195, 8 1175 / 1174, 4 1141 / 1132 (H100,
# session 17: all 32 1055 against 8's 1110); 16 tiles (N=2048, K=7168) all 16 1188, 8 1167-1176; 56 tiles (N=7168,
# K=4096) 28 1152-1155, 16 or 8 1125-1141, all 56 1084-1109.
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


def _ring_memory_warpgroup(items, first, coords, expert_of, load, *, steps, stages, consumed):
  """The memory warpgroup of the SMEM-ring kernels (:func:`_ws3_kernel`, :func:`_wide_kernel`): walks the CTA's
  items as the compute warpgroups do (``coords(lin)``: row block and column position; ``expert_of(lin)``, carried
  one item ahead, ``first`` the carry of the CTA's first item; items of expert < 0 load nothing), and for each of an
  item's ``steps`` K steps waits until its ring slot is released (``consumed``) and calls ``load(slot, step, row
  block, column, expert)`` to issue the step's TMA loads. At the end it observes the last releases (every phase of
  the ``consumed`` barriers) before the kernel ends."""
  plgpu.set_max_registers(40, action="decrease")
  ctas = lax.axis_size("sm")

  @plgpu.nd_loop(items, collective_axes="sm", init_carry=first)
  def _items(info, carry):
    (lin,) = info.index
    t0, e = carry
    e_next = expert_of(lin + ctas)
    mi, col = coords(lin)

    @pl.when(e >= 0)
    def _load():
      @pl.loop(0, steps)
      def _step(s):
        t = t0 + s
        slot = lax.rem(t, stages)

        @pl.when(t >= stages)
        def _wait_free():
          plgpu.barrier_wait(consumed.at[slot])

        load(slot, s, mi, col, e)

    return t0 + jnp.where(e >= 0, steps, 0).astype(jnp.int32), e_next

  total_steps = _items[0]

  @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
  def _drain(t):
    plgpu.barrier_wait(consumed.at[lax.rem(t, stages)])


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "stages", "group_n", "defer",
                                             "multicast", "late_epilogue"))
def _ws3_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, stages=5, group_n=None,
                defer=True, multicast=False, late_epilogue=False):
  """A persistent, warp-specialised kernel with its own K pipeline (issue 24; arguments as :func:`_simple_kernel`).

  Unlike :func:`_ws2_kernel` (one ``emit_pipeline_warp_specialized`` per work item, whose memory warpgroup waits
  for the compute warpgroups to drain each item before it loads the next item's first tiles), one ring of
  ``stages`` SMEM slots of 128-deep K steps runs through all items of a CTA: the memory warpgroup walks the same
  item sequence as the compute warpgroups and loads the next item's first steps while they finish the current
  one (no bubble between items; the slot counter runs on across items, so any number of stages works).
  Each slot holds the ``(128, 128)`` e4m3 tile of ``x``, the ``(BN, 128)`` tile of ``w[e]`` and the step's 128
  per-token scales of ``x`` (one 512-byte TMA row of the column-major ``(K/128, M)`` scales, so no GMEM load of
  them on the compute warpgroups' path); the weight scale is a scalar GMEM load two steps ahead.

  ``defer=True``: the promotion of step ``s`` runs while the wgmma of step ``s + 1`` is in flight, across pipeline
  steps (two accumulators alternate; step ``s``'s slot is released once its wgmma has completed), so every
  promotion of a compute warpgroup overlaps one of its own wgmmas (``_ws2_kernel``'s ``kpair=2`` leaves every
  second promotion without one). ``defer=False``: wait for each step's wgmma, then promote it.
  Same numerics as the other kernels: ``total += part_s * (sf_x[rows, s] * sf_w[e, n_block, s])`` in step order.
  ``group_n``: column tiles per raster group as in :func:`_ws2_kernel`. Epilogue: registers -> swizzled SMEM ->
  TMA store, awaited only before the warpgroup's next item is staged. ``stages`` shrinks until SMEM fits.

  ``multicast=True`` (when ``N/128`` is even): clusters of 2 CTAs, one cluster per pair of column tiles
  ``(2j, 2j + 1)`` of a row block, each CTA one tile; the ``x`` tile both need is loaded once for the pair by TMA
  multicast (each CTA's memory warpgroup fetches half of it into both CTAs' SMEM), so each CTA reads 24 KiB
  instead of 32 KiB from L2 per K step. A slot is then refilled only when the compute warpgroups of both CTAs
  have released it (a cluster barrier).

  ``late_epilogue=True``: a compute warpgroup keeps an item's result in registers and stages / stores it only
  after it has issued the next item's first wgmma (the result and its position are the item loop's carry), so the
  epilogue runs under a wgmma instead of leaving the tensor cores idle between items.
  """
  m, k = xq.shape
  _, n, _ = wq.shape
  ks = k // BLOCK
  m_iters, n_iters = m // BLOCK, n // BN
  wm = BLOCK // 2  # rows per compute warpgroup
  cs = 2 if multicast and n_iters % 2 == 0 else 1  # CTAs per cluster, one column tile each
  n_units = n_iters // cs  # column units (of cs tiles) per row block
  gn = n_units if group_n is None else int(np.gcd(max(group_n // cs, 1), n_units))
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
      consumed=(plgpu.ClusterBarrier(collective_axes=("cl",), num_arrivals=2, num_barriers=stages) if cs > 1
                else plgpu.Barrier(num_arrivals=2, num_barriers=stages)))

  def body(be_g, x_g, sfx_g, w_g, sfw_g, o_g, *, x_s, w_s, sx_s, out_s, produced, consumed):
    wg = lax.axis_index("wg")
    items = (m_iters * n_units,)
    cta = lax.axis_index("cl") if cs > 1 else 0
    x_copy = dict(collective_axes="cl") if cs > 1 else {}

    def coords(lin):
      mi, nu = _raster(lin, m_iters, gn)
      return mi, nu * cs + cta

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
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(mi * BLOCK, BLOCK), kcols], x_s.at[slot], produced.at[slot], **x_copy)
        plgpu.copy_gmem_to_smem(w_g.at[e, pl.ds(ni * BN, BN), kcols], w_s.at[slot], produced.at[slot])
        plgpu.copy_gmem_to_smem(sfx_g.at[s, pl.ds(mi * BLOCK, BLOCK)], sx_s.at[slot], produced.at[slot])

      _ring_memory_warpgroup(items, first, coords, expert_of, load, steps=ks, stages=stages, consumed=consumed)

    def store(total, r0, c0):  # registers -> swizzled SMEM -> TMA store of one warpgroup's (wm, BN) result
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read out_s
      out_s[wg] = total.astype(out_dtype)
      plgpu.commit_smem()
      dst = o_g.at[pl.ds(pl.multiple_of(r0, wm), wm), pl.ds(pl.multiple_of(c0, BN), BN)]
      plgpu.copy_smem_to_gmem(out_s.at[wg], dst)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      init = first
      if late_epilogue:  # (pending?, its result, its first row, its first column)
        init = (*first, jnp.int32(0), plgpu.layout_cast(jnp.zeros((wm, BN), jnp.float32), WG), jnp.int32(0),
                jnp.int32(0))

      @plgpu.nd_loop(items, collective_axes="sm", init_carry=init)
      def _items(info, carry):
        (lin,) = info.index
        t0, e, *late = carry
        e_next = expert_of(lin + ctas)
        mi, ni = coords(lin)
        rows = pl.ds(mi * BLOCK + wg * wm, wm)
        cols = pl.ds(ni * BN, BN)

        def slot_of(s):
          return lax.rem(t0 + s, stages)

        def w_scale(s):
          return sfw_g[e, ni, jnp.minimum(s, ks - 1)]

        def issue(acc, s):
          slot = slot_of(s)
          plgpu.barrier_wait(produced.at[slot])
          _zero_acc(acc, interpret)
          plgpu.wgmma(acc, x_s.at[slot, pl.ds(wg * wm, wm)], w_s.at[slot].T)

        def retire(acc, s, total, sw, wait_n):
          slot = slot_of(s)
          part = plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)
          sx = plgpu.load(sx_s.at[slot, pl.ds(wg * wm, wm)], layout=WG.reduce(1), optimized=False)
          plgpu.barrier_arrive(consumed.at[slot])
          return total + part * (sx * sw)[:, None]

        def k_loop(after_first_issue, acc_a, acc_b):
            zero = plgpu.layout_cast(jnp.zeros((wm, BN), jnp.float32), WG)
            if not defer:
              after_first_issue()
              def one(s, c):
                total, sw, sw1 = c
                issue(acc_a, s)
                return retire(acc_a, s, total, sw, 0), sw1, w_scale(s + 2)
              total, _, _ = lax.fori_loop(0, ks, one, (zero, w_scale(0), w_scale(1)))
              return total
            # step s in acc_a (s even) / acc_b (s odd); invariant at a pair's start: step 2p issued into acc_a
            issue(acc_a, 0)
            after_first_issue()

            def pair(p, c):
              total, sw0, sw1 = c
              s = 2 * p
              nxt = (w_scale(s + 2), w_scale(s + 3))
              issue(acc_b, s + 1)
              total = retire(acc_a, s, total, sw0, 1)
              issue(acc_a, s + 2)
              total = retire(acc_b, s + 1, total, sw1, 1)
              return (total, *nxt)

            full = (ks - 1) // 2
            total, sw0, sw1 = lax.fori_loop(0, full, pair, (zero, w_scale(0), w_scale(1)))
            s = 2 * full  # issued into acc_a, not retired
            if ks % 2 == 0:
              issue(acc_b, s + 1)
              total = retire(acc_a, s, total, sw0, 1)
              total = retire(acc_b, s + 1, total, sw1, 0)
            else:
              total = retire(acc_a, s, total, sw0, 0)
            return total

        def run_item(after_first_issue):
          return pl.run_scoped(functools.partial(k_loop, after_first_issue), plgpu.ACC((wm, BN), jnp.float32),
                               plgpu.ACC((wm, BN), jnp.float32))

        def skip_item():
          o_g[rows, cols] = plgpu.layout_cast(jnp.zeros((wm, BN), out_dtype), WG)

        t_next = t0 + jnp.where(e >= 0, ks, 0).astype(jnp.int32)
        if not late_epilogue:
          @pl.when(e >= 0)
          def _run():
            store(run_item(lambda: None), mi * BLOCK + wg * wm, ni * BN)

          pl.when(e < 0)(skip_item)
          return t_next, e_next

        pend, tot_prev, prow, pcol = late

        def flush():
          pl.when(pend != 0)(lambda: store(tot_prev, prow, pcol))

        def real():
          return jnp.int32(1), run_item(flush), mi * BLOCK + wg * wm, ni * BN

        def skip():
          flush()
          skip_item()
          return jnp.int32(0), tot_prev, prow, pcol

        return t_next, e_next, *lax.cond(e >= 0, real, skip)

      if late_epilogue:
        _, _, pend, tot_prev, prow, pcol = _items
        pl.when(pend != 0)(lambda: store(tot_prev, prow, pcol))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  if cs == 1:
    call = _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret, scratch_types=scratch)
  else:
    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
                        grid=(max(min(num_sms // cs, m_iters * n_units), 1),), grid_names=("sm",),
                        cluster=(cs,), cluster_names=("cl",), num_threads=3, thread_name="wg",
                        scratch_types=scratch, interpret=interpret,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return call(block_expert, xq, sfx_t, wq, wsf)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_sms", "bn", "stages", "group_n"))
def _wide_kernel(block_expert, xq, sfx_t, wq, wsf, *, out_dtype, interpret, num_sms, bn=192, stages=5,
                 group_n=None):
  """The SMEM ring of :func:`_ws3_kernel` (``defer=False``) with ``bn``-column tiles, ``128 < bn < 256`` a multiple of
  32 (issue 24; arguments as :func:`_simple_kernel`): each compute warpgroup computes a ``64 x bn`` tile (DeepGEMM's
  wide CTA tiles), so a wgmma reads fewer SMEM bytes per FLOP than at 128 columns and each item's fixed costs are
  spread over more FLOPs.

  ``N`` need not be a multiple of ``bn``: the last column tile of a row starts at ``N - bn`` and overlaps the one
  before it (the overlapping columns are computed twice, identically, and stored twice). A tile straddles two
  128-column weight-scale blocks, the first ``b`` of its columns in block ``c0 // 128`` (``b = 128 - c0 % 128``, a
  multiple of ``gcd(bn, 128)``): the K loop is traced once per possible ``b``, and each step promotes the static
  column slices ``[:b]`` and ``[b:]`` of the wgmma result with their own row-scale vector, ``sf_x[row] *
  sf_w[block]`` (the other kernels' float32 products; per-element scale products instead cost 10-16%, session 24,
  and a column mask spills, session 25). The two weight scales of a step are scalar loads two steps ahead.
  ``N < bn`` runs ``"ring_nodefer"``.
  """
  m, k = xq.shape
  _, n, _ = wq.shape
  assert BLOCK < bn < 2 * BLOCK and bn % 32 == 0, bn
  if n < bn:
    return _ws3_kernel(block_expert, xq, sfx_t, wq, wsf, out_dtype=out_dtype, interpret=interpret, num_sms=num_sms,
                       stages=stages, defer=False)
  ks = k // BLOCK
  m_iters, n_iters = m // BLOCK, -(-n // bn)
  wm = BLOCK // 2  # rows per compute warpgroup
  gn = n_iters if group_n is None else half_row_group(n_iters) if group_n == "half" else int(np.gcd(group_n, n_iters))
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
      mi, ni = _raster(lin, m_iters, gn)
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
        scale_block = c0 // BLOCK

        def w_scales(s):  # the weight scales of the tile's two column blocks at step s
          s = jnp.minimum(s, ks - 1)
          return sfw_g[e, scale_block, s], sfw_g[e, scale_block + 1, s]

        def k_loop(first_cols, acc):
          def step(s, carry):
            total, (w0, w1), w_next = carry
            slot = lax.rem(t0 + s, stages)
            plgpu.barrier_wait(produced.at[slot])
            _zero_acc(acc, interpret)
            plgpu.wgmma(acc, x_s.at[slot, pl.ds(wg * wm, wm)], w_s.at[slot].T)
            part = plgpu.wgmma_accumulator_load(acc, wait_n=0)
            sx = plgpu.load(sx_s.at[slot, pl.ds(wg * wm, wm)], layout=WG.reduce(1), optimized=False)
            plgpu.barrier_arrive(consumed.at[slot])
            promoted = jnp.concatenate([part[:, :first_cols] * (sx * w0)[:, None],
                                        part[:, first_cols:] * (sx * w1)[:, None]], axis=1)
            return total + promoted, w_next, w_scales(s + 2)

          zero = plgpu.layout_cast(jnp.zeros((wm, bn), jnp.float32), WG)
          return lax.fori_loop(0, ks, step, (zero, w_scales(0), w_scales(1)))[0]

        for first_cols in first_cols_cases:
          @pl.when((e >= 0) & (c0 % BLOCK == BLOCK - first_cols))
          def _run():
            total = pl.run_scoped(functools.partial(k_loop, first_cols), plgpu.ACC((wm, bn), jnp.float32))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store has read out_s
            out_s[wg] = total.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[wg], o_g.at[pl.ds(pl.multiple_of(r0, wm), wm), pl.ds(c0, bn)])

        @pl.when(e < 0)
        def _skip():
          o_g[pl.ds(r0, wm), pl.ds(c0, bn)] = plgpu.layout_cast(jnp.zeros((wm, bn), out_dtype), WG)

        return t0 + jnp.where(e >= 0, ks, 0).astype(jnp.int32), e_next

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _persistent_call(body, (m, n), out_dtype, m_iters * n_iters, num_sms, interpret, scratch_types=scratch)
  return call(block_expert, xq, sfx_t, wq, wsf)


# Kernel variants (module attribute read at trace time; scratch/gpu_gemm.sh times each).
VARIANTS = {"ws": _ws_kernel, "ws6": functools.partial(_ws_kernel, stages=6), "simple": _simple_kernel,
            # issue 24 speed variants (:func:`_ws2_kernel`): deferred promotion over 2 x 128 K per step, TMA epilogue
            "k2": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="reg"),
            "tma": functools.partial(_ws2_kernel, stages=4, kpair=1, epilogue="tma"),
            "k2tma": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="tma"),
            "k2tma2": functools.partial(_ws2_kernel, stages=2, kpair=2, epilogue="tma"),
            "tma6": functools.partial(_ws2_kernel, stages=6, kpair=1, epilogue="tma"),
            "k2tma_g8": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="tma", group_n=8),
            "k2tma_gh": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="tma", group_n="half"),
            "k2tma_gh_ss": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="tma", group_n="half",
                                             smem_scales=True),
            "tma_g8": functools.partial(_ws2_kernel, stages=4, kpair=1, epilogue="tma", group_n=8),
            "k2tma_g1": functools.partial(_ws2_kernel, stages=3, kpair=2, epilogue="tma", group_n=1),
            # issue 24, round 3 (:func:`_ws3_kernel`): one SMEM ring across items, promotion deferred across steps
            "ring": functools.partial(_ws3_kernel, stages=5),
            "ring_g8": functools.partial(_ws3_kernel, stages=5, group_n=8),
            "ring_nodefer": functools.partial(_ws3_kernel, stages=5, defer=False),
            "ring3": functools.partial(_ws3_kernel, stages=3),
            "ring_mc": functools.partial(_ws3_kernel, stages=5, multicast=True),
            "ring_mc_g8": functools.partial(_ws3_kernel, stages=5, multicast=True, group_n=8),
            "ring_late": functools.partial(_ws3_kernel, stages=5, late_epilogue=True),
            "ring_late_g8": functools.partial(_ws3_kernel, stages=5, late_epilogue=True, group_n=8),
            "ring_late_mc": functools.partial(_ws3_kernel, stages=5, late_epilogue=True, multicast=True),
            "ring_late_mc_g8": functools.partial(_ws3_kernel, stages=5, late_epilogue=True, multicast=True,
                                                 group_n=8),
            # 64 x 192 / 64 x 160 tiles per warpgroup (:func:`_wide_kernel`)
            "wide192": functools.partial(_wide_kernel, bn=WIDE_TILE),
            "wide192_gh": functools.partial(_wide_kernel, group_n="half"),
            "wide160": functools.partial(_wide_kernel, bn=160)}
VARIANT = None  # a VARIANTS key forces that kernel (tests, timing scripts); None: default_variant(K, N)
# The forward kernel per contraction K. H100, 2026-11-27, CUPTI cold L2, bf16 out (scratch/time_gemmfast.py, every
# variant within 3.5e-3 of the float32 product), TF/s at A (K=7168 N=4096) / C (32 skewed experts, K=7168) and
# B (K=2048 N=7168) / D (32 skewed, K=2048): "k2tma_g8" 1110 / 1101 and 970 / 955; "ring_nodefer" 1092 / 1063 and
# 1108 / 1101; "k2tma" 1055 / 1057 and 998 / 996; "ring" (deferred promotion) 1000 / 1008 and 1046 / 1029. From
# GROUPED_RASTER_MIN_K the grouped raster (L2 reuse of the x rows over a group of column tiles) wins; below it the
# SMEM ring across items without deferral (short K loops: the gap between items is a larger share), since session 25
# with 192-column tiles: H200, 2026-11-28, same call, B / D "wide192" 1198 / 1176, "wide192_gh" 1184 / 1193,
# "ring_nodefer" 1114 / 1104; at A / C "wide192_gh" 1189 / 1148 against "k2tma_gh" 1179 / 1170 (no gain: the wide
# tile has no register room for the deferred promotion). The group size: half_row_group.
GROUPED_RASTER_MIN_K = 4096
# The share of extra columns the wide tile may compute (its last tile of a row overlaps the one before it where
# WIDE_TILE does not divide N) and still be the default: at N = 7168 (1.8% extra) it is 7-9% faster than 128-column
# tiles (session 25, above), so up to about 7% extra would break even; at N = 4096 the extra is exactly 1/32.
WIDE_TILE_MAX_EXTRA = 1 / 32
# The largest K for which "k2tma_gh_ss" (scales through the pipeline's SMEM) is the default. H200, 2026-11-28 (session
# 26, two calls, TF/s, "k2tma_gh_ss" against "k2tma_gh"): K = 4096, N = 7168 (the input gradient of the gate / up
# projection) 1242 / 1220 against 1162 / 1160, with 32 skewed experts 1215 / 1192 against 1162 / 1160; K = 7168,
# N = 4096 1184 / 1160 against 1200 / 1198 (32 skewed experts 1188 / 1164 against 1194 / 1196), K = 7168, N = 2048
# 1173 against 1183. At K = 7168 the GPU runs at its 700 W power cap: ncu saw the SMEM scales raise the tensor pipe's
# share of cycles from 68% to 73% while the SM clock fell from 1.62 to 1.52 GHz, the same 1.62 ms.
SMEM_SCALES_MAX_K = 4096


def wide_tile_extra(n: int, bn: int = WIDE_TILE) -> float:
  """The share of columns computed twice by ``bn``-column tiles over ``n`` columns (``n >= bn``)."""
  return (-(-n // bn) * bn - n) / n


def default_variant(k: int, n: int) -> str:
  """The forward kernel for a contraction of ``k`` and ``n`` output columns. From :data:`GROUPED_RASTER_MIN_K`:
  ``"k2tma_gh_ss"`` (deferred promotion, TMA-store epilogue, grouped column tiles, the scales through the pipeline's
  SMEM) up to :data:`SMEM_SCALES_MAX_K`, ``"k2tma_gh"`` (the same with GMEM scale loads) above it. Below it
  ``"wide192"`` (one SMEM ring through all items, 64 x 192 tiles per warpgroup) where its overlapping last tile adds
  at most :data:`WIDE_TILE_MAX_EXTRA` of the work, else ``"ring_nodefer"`` (the same ring with 64 x 128 tiles)."""
  if k >= GROUPED_RASTER_MIN_K:
    return "k2tma_gh_ss" if k <= SMEM_SCALES_MAX_K else "k2tma_gh"
  return "wide192" if n >= WIDE_TILE and wide_tile_extra(n) <= WIDE_TILE_MAX_EXTRA else "ring_nodefer"


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


def fp8_grouped_gemm(x, w, block_expert, *, out_dtype=jnp.bfloat16, x_use_tma_aligned_col_major_sf: bool = False,
                     implementation: str | None = None) -> jax.Array:
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
      past the last segment): its output rows are zero. Concrete values outside ``[-1, G)`` raise; traced
      ones outside ``[0, G)`` are treated as ``-1``.
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
