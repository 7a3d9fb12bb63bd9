"""The two backward GEMMs of an FP8 grouped linear layer ``y = x · w[e]ᵀ`` on the fused MoE layout.

Input gradient ``dx = dy · w[e]`` (:func:`fp8_grouped_gemm_input_grad`): the forward GEMM with the
weights transposed to ``(G, K, N)`` (FP8 wgmma needs K-major operands on both sides: here the
contraction runs over N), by :func:`jaxkern.transpose.batched_transpose` (bit-exact; about 4% of the
GEMM's time at the DeepSeek-V3 shapes), and their 128x128 block scales transposed with them.

Weight gradient ``dw[e] = Σ_{rows r of e} dy[r]ᵀ x[r]`` (:func:`fp8_grouped_gemm_weight_grad`): the
contraction runs over each expert's ragged range of 128-row blocks, so both operands come token-major
-> K-major, i.e. transposed, with per-channel scales (one per column and 128-row block), as
:func:`jaxkern.quant.per_channel_cast_and_transpose` makes them. Mosaic GPU kernel (:func:`_wgrad_kernel`):
one CTA per (expert, 64 rows of N, 128 columns of K), one warpgroup; a TMA pipeline over the expert's
blocks (a dynamic trip count: the blocks of one expert must be contiguous, as in the fused layout)
with one fresh float32 wgmma accumulator per block, promoted as ``total += p · (sf_dy[b, n] ·
sf_x[b, k])`` (an outer product of the row and column scale vectors).
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


def transpose_weights(w, *, implementation: str | None = None) -> QuantTensor:
  """``(G, N, K)`` e4m3 weights with ``(G, N/128, K/128)`` block sf -> the ``(G, K, N)`` K-major copy the
  input gradient needs, sf ``(G, K/128, N/128)`` (bit-exact)."""
  w = _grouped._quant("w", w)
  return QuantTensor(batched_transpose(w.data, implementation=implementation), jnp.swapaxes(w.sf, 1, 2))


def fp8_grouped_gemm_input_grad(dy, w, block_expert, *, out_dtype=jnp.bfloat16,
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

  Returns ``(M, K)`` ``out_dtype``. Numerics, errors, XLA cases, differentiation: :func:`fp8_grouped_gemm`
  (promotion per 128-deep step of N with ``sf_dy[r, step] · sf_w[e, step, k // 128]``).
  """
  w = _grouped._quant("w", w)
  _checks.check_rank("w.data", w.data, 3)
  return fp8_grouped_gemm(dy, transpose_weights(w, implementation=implementation), block_expert,
                          out_dtype=out_dtype, x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf,
                          implementation=implementation)


@functools.partial(jax.jit, static_argnames=("interpret", "num_sms"))
def _wgrad_kernel(starts, counts, dyq, sdy, xq, sx, *, interpret, num_sms=None):
  """``dyq (N, M)``, ``xq (K, M)`` e4m3, ``sdy (M/128, N)``, ``sx (M/128, K)`` float32, ``starts`` / ``counts``
  ``(G,)`` int32 (each expert's first block and number of blocks) -> ``(G, N, K)`` float32 (``num_sms`` unused)."""
  del num_sms
  n, m = dyq.shape
  k = xq.shape[0]
  g = starts.shape[0]

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((g, n, k), jnp.float32),
                     grid=(g, n // WN, k // BLOCK), grid_names=("g", "n", "k"), interpret=interpret)
  def kernel(st_g, ct_g, dy_g, sdy_g, x_g, sx_g, o_g):
    e, i, j = lax.axis_index("g"), lax.axis_index("n"), lax.axis_index("k")
    start, count = st_g[e], ct_g[e]
    rows, cols = pl.ds(i * WN, WN), pl.ds(j * BLOCK, BLOCK)

    @pl.when(count == 0)
    def _empty():
      o_g[e, rows, cols] = plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG)

    @pl.when(count > 0)
    def _compute():
      def body(idx, dy_s, x_s, total):
        (s,) = idx
        b = start + s

        def scope(acc):
          plgpu.wgmma(acc, dy_s, x_s.T)
          a = plgpu.load(sdy_g.at[b, rows], layout=WG.reduce(1), optimized=False)
          c = plgpu.load(sx_g.at[b, cols], layout=WG.reduce(0), optimized=False)
          return acc[...], a, c

        part, a, c = pl.run_scoped(scope, plgpu.ACC((WN, BLOCK), jnp.float32))
        return total + part * a[:, None] * c[None, :]

      total = plgpu.emit_pipeline(
          body, grid=(count,), max_concurrent_steps=STAGES,
          in_specs=[plgpu.BlockSpec((WN, BLOCK), lambda s: (0, start + s), transforms=FP8_TILED),
                    plgpu.BlockSpec((BLOCK, BLOCK), lambda s: (0, start + s), transforms=FP8_TILED)],
          init_carry=plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG),
      )(dy_g.at[rows, :], x_g.at[cols, :])
      o_g[e, rows, cols] = total

  return kernel(starts, counts, dyq, sdy, xq, sx)


@functools.partial(jax.jit, static_argnames=("interpret", "num_sms", "stages"))
def _wgrad_ws_kernel(starts, counts, dyq, sdy, xq, sx, *, interpret, num_sms, stages=STAGES):
  """The persistent warp-specialised weight-gradient kernel (arguments as :func:`_wgrad_kernel`): one CTA per SM
  loops over the (expert, 128 rows of N, 128 columns of K) items, expert slowest; a memory warpgroup issues the
  TMA loads of the expert's blocks ``stages`` ahead (a dynamic trip count), two compute warpgroups take 64 rows
  of N each; the scales of a block are loaded one block ahead."""
  n, m = dyq.shape
  k = xq.shape[0]
  g = starts.shape[0]
  n_iters, k_iters = n // BLOCK, k // BLOCK
  items = g * n_iters * k_iters

  def body(st_g, ct_g, dy_g, sdy_g, x_g, sx_g, o_g):
    wg = lax.axis_index("wg")

    def pipeline(mma_body, compute_context, count, start):
      def spec():
        return plgpu.BlockSpec((BLOCK, BLOCK), lambda s: (0, start + s), transforms=FP8_TILED,
                               memory_space=plgpu.SMEM)

      return plgpu.emit_pipeline_warp_specialized(
          mma_body, grid=(count,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
          max_concurrent_steps=stages, compute_context=compute_context, in_specs=[spec(), spec()])

    ignore = lambda *_, **__: None

    @functools.partial(pl.run_scoped,
                       allocs=pipeline(ignore, ignore, stages, 0).get_allocations(dy_g.at[pl.ds(0, BLOCK)],
                                                                               x_g.at[pl.ds(0, BLOCK)]),
                       collective_axes="wg")
    def _scope(allocs):
      @plgpu.nd_loop((items,), collective_axes="sm")
      def _items(info):
        (lin,) = info.index
        e = lin // (n_iters * k_iters)
        ni = (lin // k_iters) % n_iters
        kj = lin % k_iters
        start, count = st_g[e], ct_g[e]
        rows = pl.ds(ni * BLOCK + wg * WN, WN)
        cols = pl.ds(kj * BLOCK, BLOCK)

        def scales(s):
          b = start + s
          return (plgpu.load(sdy_g.at[b, rows], layout=WG.reduce(1), optimized=False),
                  plgpu.load(sx_g.at[b, cols], layout=WG.reduce(0), optimized=False))

        def compute_context(run_pipeline):
          a, c = scales(0)
          total, _, _ = run_pipeline((plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG), a, c))
          o_g[e, rows, cols] = total

        def mma_body(idx, dy_s, x_s, carry):
          (s,) = idx
          total, a, c = carry

          def scope(acc):
            plgpu.wgmma(acc, dy_s.at[pl.ds(wg * WN, WN)], x_s.T)
            nxt = scales(jnp.minimum(s + 1, count - 1))
            return acc[...], nxt

          part, (a_next, c_next) = pl.run_scoped(scope, plgpu.ACC((WN, BLOCK), jnp.float32))
          return total + part * a[:, None] * c[None, :], a_next, c_next

        @pl.when(count > 0)
        def _compute():
          pipeline(mma_body, compute_context, count, start)(
              dy_g.at[pl.ds(ni * BLOCK, BLOCK)], x_g.at[pl.ds(kj * BLOCK, BLOCK)], allocations=allocs)

        @pl.when((count == 0) & (wg < 2))
        def _empty():
          o_g[e, rows, cols] = plgpu.layout_cast(jnp.zeros((WN, BLOCK), jnp.float32), WG)

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, n, k), jnp.float32),
                        grid=(min(num_sms, items),), grid_names=("sm",), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        interpret=interpret)
  return kernel(starts, counts, dyq, sdy, xq, sx)


# Weight-gradient kernel variants (read at trace time; scratch/gpu_gemm.sh times each).
WGRAD_VARIANTS = {"ws": _wgrad_ws_kernel, "ws6": functools.partial(_wgrad_ws_kernel, stages=6),
                  "simple": _wgrad_kernel}
WGRAD_VARIANT = "ws"


def expert_block_ranges(block_expert, num_experts: int):
  """``(starts, counts)`` ``(G,)`` int32: each expert's first 128-row block and its number of blocks
  (the blocks of one expert contiguous; ids outside ``[0, G)`` belong to none)."""
  ids = jnp.arange(num_experts, dtype=jnp.int32)
  hit = block_expert[None, :] == ids[:, None]
  counts = jnp.sum(hit, axis=1, dtype=jnp.int32)
  starts = jnp.where(counts > 0, jnp.argmax(hit, axis=1).astype(jnp.int32), 0)
  return starts, counts


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
    for e in np.unique(be[be >= 0]):
      pos = np.flatnonzero(be == e)
      if pos[-1] - pos[0] + 1 != pos.size:
        raise ValueError(f"block_expert: the blocks of expert {e} must be contiguous (the fused layout)")
  return dy_t, x_t, block_expert


def fp8_grouped_gemm_weight_grad(dy_t, x_t, block_expert, *, num_experts: int,
                                 implementation: str | None = None) -> jax.Array:
  """``dw[e] = Σ_{r in blocks of e} dy[r]ᵀ · x[r]``: the weight gradient of :func:`fp8_grouped_gemm`, float32.

  Args:
    dy_t: QuantTensor ``(data (N, M) float8_e4m3fn, sf (M/128, N) float32)``: the output gradient transposed,
      one scale per column and 128-row block (:func:`jaxkern.quant.per_channel_cast_and_transpose` of the
      bf16 ``(M, N)`` gradient with ``num_per_tokens=128``).
    x_t: QuantTensor ``(data (K, M) float8_e4m3fn, sf (M/128, K) float32)``: the forward input, cast the same way.
    block_expert: ``(M/128,)`` int32 as in :func:`fp8_grouped_gemm`; the blocks of each expert must be contiguous
      (the fused layout; checked for concrete values); blocks of -1 (or, traced, outside ``[0, G)``) contribute
      nothing.
    num_experts: ``G`` (a Python int).
    implementation: see :mod:`jaxkern._dispatch`.

  Returns ``(G, N, K)`` float32 (zeros for an expert without blocks).

  Numerics: per 128-row block a float32 wgmma product, promoted into a float32 accumulator with
  ``sf_dy[b, n] · sf_x[b, k]`` in block order (:func:`jaxkern.reference.gemm.fp8_grouped_gemm_weight_grad`).

  Raises ValueError for non-e4m3 data, dims not multiples of 128, other sf shapes or dtypes, different M,
  ``block_expert`` not ``(M/128,)`` int32, (concrete) out of range or not contiguous per expert, a bad
  ``num_experts``. XLA cases: ``M == 0`` (zeros). Not differentiable (quantised inputs).
  """
  dy_t, x_t, block_expert = _check_wgrad(dy_t, x_t, block_expert, num_experts)
  dy_t = QuantTensor(*_autodiff.guard("fp8_grouped_gemm_weight_grad", _autodiff.DEQUANT_ADVICE, *dy_t))
  x_t = QuantTensor(*_autodiff.guard("fp8_grouped_gemm_weight_grad", _autodiff.DEQUANT_ADVICE, *x_t))
  n, m = dy_t.data.shape
  k = x_t.data.shape[0]

  def reference():
    return ref.fp8_grouped_gemm_weight_grad(dy_t, x_t, block_expert, num_experts=num_experts)

  def kernel(interpret):
    starts, counts = expert_block_ranges(block_expert, num_experts)
    return WGRAD_VARIANTS[WGRAD_VARIANT](starts, counts, dy_t.data, dy_t.sf, x_t.data, x_t.sf,
                         interpret=_config.mosaic_interpret(interpret), num_sms=_config.num_sms())

  def xla():
    return jnp.zeros((num_experts, n, k), jnp.float32) if m == 0 else reference()

  return _dispatch.run("fp8_grouped_gemm_weight_grad", implementation, kernel=kernel, xla=xla, reference=reference,
                       empty=m == 0)
