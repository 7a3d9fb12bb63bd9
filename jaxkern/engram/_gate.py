"""Engram gate forward and backward (docs/engram.md, "Gate"): Mosaic GPU kernels.

Every kernel moves the hidden rows GMEM -> registers -> GMEM in 16-byte vectors (8-byte ones where ``D`` asks for
it; two kernels stage the rows they read in SMEM by TMA copies first: the forward's :func:`gate_fwd_tma_kernel` and
the large-``D`` backward's :func:`gate_bwd_ring_kernel`) and does all arithmetic in float32. Two register layouts of
a token's ``(M, D)`` rows:

* One warp per stream (:func:`stream_rows_layout`, ``M % 4 == 0``): a warp's lanes hold 16-byte vectors of
  256-column segments of its stream's row (512 contiguous bytes per access, any ``D % 256 == 0``, so
  ``D = 2560`` is ten such segments), and a row reduction is in-thread plus warp shuffles: no SMEM, no
  barrier. ``v`` is loaded by every warp (the other three from L1).
* Rows spread over the warpgroup (:func:`jaxkern._layouts.flat_layout` for one row,
  :func:`block_rows_layout` for ``M`` rows): a thread holds the same columns of every stream, so sums over
  streams are in-thread and row reductions end in an SMEM step across the 4 warps (one barrier pair, for
  all rows of a block at once in :func:`block_rows_layout`).

Kernels (the thresholds next to the module's constants say which measurement chose them):

* Forward, where :func:`fwd_rows_applies` (``M % 4 == 0`` and a ``D`` that the flat kernel would move in vectors
  narrower than 16 bytes, :func:`column_block` below 1024: ``D = 2560`` among the benchmarked sizes):
  :func:`gate_fwd_rows_kernel`, persistent CTAs (:data:`FWD_ROWS_CTAS_PER_SM` per SM) over contiguous token
  ranges, one warp per stream: the three row sums ``Σx²``, ``Σk²``, ``Σx·wf·k``, the gate,
  ``out = bf16(x + g·v)``, the next token's ``x`` and ``k`` loaded while the current one finishes. Elsewhere,
  from ``D = 6144`` where two CTAs' SMEM rings fit an SM (:func:`fwd_tma_applies`, ``D`` up to about 9500):
  :func:`gate_fwd_tma_kernel`, the flat kernel's arithmetic (below) in persistent CTAs whose ``x`` and ``k`` rows
  come into a ring of SMEM slots, and ``v`` into two, by bulk TMA copies issued a slot ahead. Otherwise
  one token per CTA (grid ``T``): :func:`gate_fwd_flat_kernel`, the streams one after the other, each row
  spread over the warpgroup; where ``M·D <= PRELOAD_MAX_VALUES`` (``D = 2048`` at ``M = 4``) the rows of all
  streams loaded up front and each stream's three row sums in three cross-warp reductions, above it (``D = 3072,
  4096`` at ``M = 4``) the rows stream by stream, each stream's three sums in one cross-warp reduction and ``x``,
  ``v`` held as packed bf16 (fewer registers); a ``D`` such as 2560 with ``M % 4 != 0`` in a 2048-column chunk of
  16-byte vectors and a 512-column chunk of 8-byte ones (:func:`jaxkern._layouts.flat_chunks`). ``wf``
  (``4·M·D`` bytes) is re-read for every token (from the caches). The saved ``(T, M)`` float32 intermediates
  (``save``): the rows kernel stores them after the token's output, from lane 0 of each stream's warp; the flat
  kernel (``M`` = 2 or 4) at the token's end as one ``M``-wide vector per array from one thread; the TMA kernel (and
  the flat kernel at other ``M``) each stream's scalars after its output, from every thread.
* Backward, one pass (:func:`gate_bwd_fused_kernel`, where :func:`fused_applies`: 16-byte vectors,
  ``D <= FUSED_MAX_D``, ``M <= 4``): persistent CTAs over token ranges, whole rows (:func:`block_rows_layout`);
  per token ``dldg = Σ go·v`` of all streams in one reduction, ``G`` (docs/engram.md, "Gate"), then
  ``grad_x``, ``grad_k``, ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order) and the weight-gradient partial
  ``Σ_t G·x⊙k`` in an ``(M, D)`` float32 SMEM accumulator. ``44·T·D`` bytes from HBM (every array read or
  written once).
* Backward, one pass for large ``D`` (:func:`gate_bwd_ring_kernel`, where :func:`onepass_applies` and the
  fused kernel does not: ``M = 4``, ``D % 2048 == 0`` above ``FUSED_MAX_D`` where its SMEM fits one CTA, 4096 and
  6144): one persistent CTA per SM of two warpgroups, each one half of every row (16-byte vectors), the rows of
  ``go``, ``x``, ``k``, ``v`` and the saved vectors brought into SMEM by bulk TMA copies issued ahead (``go``'s
  row and ``v``'s a token ahead, ``x`` and ``k`` in a ring of :data:`RING_XK_SLOTS` column-block slots); per token
  each warpgroup's half of ``dldg = Σ go·v`` (one warp per stream, :func:`stream_rows_layout`), the two halves
  exchanged through SMEM behind an mbarrier, ``G``, then its half's columns as in the fused kernel (``wf``'s
  blocks from the caches, the weight-gradient partial in an ``(M, D)`` float32 SMEM accumulator). ``44·T·D``
  bytes from HBM.
* Backward, two passes (elsewhere: ``D`` above ``FUSED_MAX_D`` whose halves are not multiples of 1024 columns,
  such as 7168, or too wide for the one-pass kernel's SMEM, from 8192; ``D`` such as 2560 with narrower vectors;
  other ``M``):

  1. Row pass, one token per CTA (grid ``T``; :func:`gate_bwd_rows_kernel`, one warp per stream where
     ``M % 4 == 0``): ``v`` and the ``M`` rows of ``go``, ``dldg = Σ go·v`` per stream, then ``G`` and the
     scalars of the column pass: a ``(T, M, 4)`` float32 array ``[g, G, raw·rx²/D, raw·rk²/D]``.
  2. Column pass, grid ``(D / w column blocks) × (P token chunks)``: CTA ``(c, p)`` takes columns
     ``[c·w, (c+1)·w)`` (``w = 128·vec``, :func:`column_block`: each thread ``vec`` consecutive columns of
     every stream, 16-byte bf16 vectors for ``w = 1024``) of the tokens
     ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))``. Per token it loads ``go``, ``x``, ``k`` of the ``M``
     streams (the loads of :data:`TOKENS_PER_STEP` tokens issued together) and writes ``grad_x``,
     ``grad_k`` and ``grad_v`` from the registers. No thread exchanges data with another: the
     weight-gradient partial of the CTA's ``(M, w)`` block is a ``lax.fori_loop`` carry (``M·vec`` float32
     registers per thread), stored once into ``grad_w_partial[p, :, cols]`` (zeros for an empty chunk);
     ``wf``'s block is loaded once.

  Traffic: ``10·T·D`` bytes (row pass) + ``42·T·D`` (column pass) = ``52·T·D`` (``go`` is read twice: ``G``
  needs a whole row before any column can be finished).

:func:`default_num_partials` picks ``P`` (the rows of ``grad_w_partial``) for every backward.

No kernel relies on Pallas's automatic warpgroup barriers (``NO_AUTO_BARRIERS``): no thread reads SMEM that
another wrote, except inside Mosaic's reductions, which synchronise themselves, rows written by TMA copies, read
after their mbarriers, and the large-``D`` one-pass backward's half-row sums, read after an mbarrier that every
thread of both warpgroups arrives at. A TMA copy refills a slot only after every thread that read it is past its
reads: the forward's after its row sums' barriers, the backward's after an mbarrier of the reading warpgroup.

Signed square root at ``d = ±0`` (docs/engram.md, "Gate"): the kernel uses ``copysign`` (``u = ±sqrt(c)``, so
the gate is ``σ(±sqrt(c))``), the ``jnp`` reference upstream's ``sign`` (``u = 0``, gate 0.5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith as arith_d
from jaxlib.mlir.dialects import llvm as llvm_d
from jaxlib.mlir.dialects import memref as memref_d
from jaxlib.mlir.dialects import vector as vector_d

from jaxkern import _config
from jaxkern._layouts import NO_AUTO_BARRIERS, flat_chunks, flat_layout

CTAS_PER_SM = 8  # column-pass CTAs per SM that the default token chunking aims at (over all waves)
MIN_CHUNK = 16  # tokens per chunk at least, by default
TOKENS_PER_STEP = 2  # tokens whose loads the column pass issues together
MAX_STREAMS = 8  # hc_mult the backward's column pass takes (registers: 5·M·vec float32 per thread)
# Accumulators of Mosaic's in-thread float sums (fragmented_array.reduce, acc_ilp for "add" in jax 0.11.2): a row of
# fewer vector values per thread than this is summed over interleaved accumulators, not in order.
MOSAIC_ADD_ILP = 8
FUSED_MAX_STREAMS = 4  # hc_mult the fused backward takes (registers: a thread holds M·D/128 values of each operand)
# The flat kernels (the forward outside fwd_rows_applies, the backward row pass with M % 4 != 0): rows of at most
# this many values per token (M·D) are loaded for all streams before any arithmetic (the forward's x and k, the
# backward row pass's go): more bytes in flight per CTA than stream after stream, whose row reductions' barriers
# keep the next stream's loads from being issued early. 4·2560 (M = 4, D <= 2560: 80 registers of packed bf16 x, k
# per thread). H100, 2026-11-26, bit-identical: forward D = 2048 / 2560 1.01-1.06x faster (D = 2560 from 85-94% to
# 88-96% of copy), D = 3072 unchanged (already 95-98%); the backward row pass unchanged.
# It also picks the forward flat kernel's form (gate_fwd_flat_kernel): above it each stream's three row sums in one
# cross-warp reduction instead of three, x and v held as packed bf16 instead of float32; at or below it the three
# reductions with float32 x and v. H200, 2026-11-30, M = 4, CUPTI, cold L2, one process, every output bit-identical,
# µs three reductions -> one reduction with packed x and v (the loading unchanged: stream by stream at D = 3072 /
# 4096, preloaded at 2048), save=True / save=False: T=8001 D=4096 214.04 -> 205.63 / 212.98 -> 204.70, T=4001 D=4096
# 112.28 -> 106.09 / 110.57 -> 105.73, T=8001 D=3072 159.75 -> 155.30 / 158.46 -> 154.88, T=4001 D=3072 82.70 ->
# 82.02 / 82.41 -> 81.53; preloaded, slower: T=8001 D=2048 109.47 -> 118.36 / 104.33 -> 110.62, T=4001 D=2048 60.08
# -> 63.27 / 56.94 -> 58.89. ptxas registers (save=False / save=True): D=4096 147 / 154 -> 109 / 109, 3072 119 /
# 127 -> 88 / 93, 2048 114 / 122 -> 102 / 111.
PRELOAD_MAX_VALUES = 4 * 2560
# The fused backward (one pass) takes D up to this (only with 16-byte vectors, column_block(D) = 1024), the large-D
# one-pass kernel (onepass_applies; gate_bwd_kernel gives its measurement) or the two-pass kernels (row pass one warp
# per stream) the rest. H200, 2026-11-29, T=8001, M=4, CUPTI, cold L2, median of 20, all bit-exact: fused D = 2048
# 197.3 µs (1.26x TileKernels; 2026-11-28's kernels 233.0), 3072 286.8 (1.14x); above it the fused kernel loses: 4096
# 462.1 (0.88x; 2026-11-28's 447.7), 6144 827.6 (0.68x) against 638.5 for the two-pass kernels. D = 2560 (8-byte
# vectors) two-pass: 287.7 µs (1.10x; the fused kernel took 385.8 there).
FUSED_MAX_D = 3072
# CTAs per SM of the fused backward at most (register budget: 2 fit even 255 registers per thread). H200, 2026-11-29,
# T=8001: 3 per SM took 226.2 / 347.1 µs at D = 2048 / 3072, 4 per SM 201.3 / 316.7, 2 per SM 207.8 / 326.8 (go then
# re-read from L2 for each column block): no gain above 2, and more partials to reduce.
FUSED_MAX_CTAS_PER_SM = 2
# Column blocks of x, k, wf whose loads the fused backward issues before G's barriers (the next ones follow the
# arithmetic of the previous block).
FUSED_XK_EARLY_BLOCKS = 1
# CTAs per SM of the forward's rows kernel (persistent, contiguous token ranges, wf re-loaded for every token). H200,
# 2026-11-29, T=8001, D=2560, M=4, CUPTI, cold L2, median of 20, two rounds, all bit-exact: save=True 138.6 / 138.0
# µs (TileKernels 142.9), save=False 135.5 / 135.2 (TileKernels 143.4), against 151.4 / 151.6 and 150.2 / 150.0 with
# one token per CTA (grid T); 4 per SM 137.5 / 138.2 (save=True), no gain; 2 per SM with wf held in registers for
# all tokens instead of re-loaded 157.5 / 157.1 (save=True), 135.4 / 135.2 (save=False).
FWD_ROWS_CTAS_PER_SM = 2


def _f32(a):
  return a.astype(jnp.float32)


def _signed_sqrt(d, c):
  """``copysign(sqrt(max(|d|, c)), d)`` on a float32 scalar."""
  u = lax.sqrt(jnp.maximum(jnp.abs(d), c))
  negative = (d < 0) | ((d == 0) & (1.0 / d < 0))  # the sign bit (1 / -0 = -inf)
  return jnp.where(negative, -u, u)


def _sigmoid(u):
  return 1.0 / (1.0 + jnp.exp(-u))


def unsupported(d: int, m: int, x_dtype, wf_dtype, backward: bool) -> str | None:
  """Why the gate kernels cannot run these arguments, or None."""
  wrong = []
  if x_dtype != jnp.bfloat16:
    names = "grad_out, hidden_states, k, v" if backward else "hidden_states, k, v"
    wrong.append(f"{names} are {jnp.dtype(x_dtype).name} (the kernels take bfloat16)")
  if wf_dtype != jnp.float32:
    wrong.append(f"weight_fused is {jnp.dtype(wf_dtype).name} (the kernels take float32)")
  if wrong:
    return "; ".join(wrong)
  if d % 256:
    return f"hidden_size {d} is not a multiple of 256"
  if backward and m > MAX_STREAMS:
    return f"hc_mult {m} > {MAX_STREAMS}: the column pass keeps M·(2 + 3·TOKENS_PER_STEP) row pieces in registers"
  return None


def _unsupported_saved(**saved) -> str | None:
  """Why the backward kernel cannot take the saved intermediates (each must be float32), or None."""
  wrong = [f"{name} is {a.dtype.name}" for name, a in saved.items() if a.dtype != jnp.float32]
  if wrong:
    return f"{', '.join(wrong)} (the kernel takes float32 dot, gate_score, rstd_x, rstd_k)"
  return None


def _tiled(lay):
  """A :class:`mgpu_fa.TiledLayout` as a Pallas layout."""
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim)


def stream_rows_layout() -> mgpu_fa.TiledLayout:
  """Register layout of a ``(M, D)`` block of one token (``M % 4 == 0``, ``D % 256 == 0``) with one warp per
  stream: warp ``w`` holds the rows ``w, w + 4, ...``, its lanes 16-byte bf16 vectors (8 columns) of 256-column
  segments (a warp reads 512 contiguous bytes per vector access), the ``D / 256`` segments in registers. A row
  reduction is in-thread plus 5 warp shuffles (no SMEM, no barrier); ``reduce((0,))`` is the matching layout
  of a ``(D,)`` row replicated in every warp (``v``), ``reduce((1,))`` one value per row (every lane of the
  row's warp holds it)."""
  tiling = mgpu_fa.Tiling(((4, 256), (8,)))
  return mgpu_fa.TiledLayout(tiling, (-3,), (-2,), -1, _check_canonical=False).canonicalize()


def fwd_rows_applies(d: int, m: int) -> bool:
  """Whether :func:`gate_fwd_kernel` runs :func:`gate_fwd_rows_kernel` (one warp per stream) for ``(D, M)``:
  ``M % 4 == 0`` and a ``D`` that the flat kernel would move partly in vectors narrower than 16 bytes
  (:func:`column_block` below 1024; ``D = 2560`` among the benchmarked sizes). H200, 2026-11-29, T=8001,
  save=True, CUPTI, cold L2, median of 20, all bit-exact, µs of the rows kernel (then one token per CTA) against
  the flat kernel (2026-11-28): D = 2560 150.9 against 172.5 (TileKernels 142.9; the persistent rows kernel
  138.6, :data:`FWD_ROWS_CTAS_PER_SM`); with 16-byte vectors the flat kernel wins: 2048 123.8 against 108.3, 3072
  180.4 against 160.5."""
  return m % 4 == 0 and column_block(d) < 1024


def fwd_rows_ctas(t: int) -> int:
  """CTAs of :func:`gate_fwd_rows_kernel` for ``T >= 1`` tokens: :data:`FWD_ROWS_CTAS_PER_SM` per SM, at most
  ``T``."""
  return max(1, min(t, FWD_ROWS_CTAS_PER_SM * _config.num_sms()))


def gate_fwd_kernel(x, k, v, wf, *, eps, clamp_value, save, interpret):
  """``x``, ``k`` ``(T, M, D)`` bf16, ``v`` ``(T, D)`` bf16, ``wf`` ``(M, D)`` float32 (``T >= 1``) ->
  ``(out, dot, gate, rstd_x, rstd_k)`` (the last four only with ``save``): :func:`gate_fwd_rows_kernel` in
  :func:`fwd_rows_ctas` CTAs where :func:`fwd_rows_applies`, else :func:`gate_fwd_tma_kernel` in
  :data:`FWD_TMA_CTAS_PER_SM` CTAs per SM where :func:`fwd_tma_applies`, else :func:`gate_fwd_flat_kernel`."""
  t, m, d = x.shape
  if fwd_rows_applies(d, m):
    return gate_fwd_rows_kernel(x, k, v, wf, eps=eps, clamp_value=clamp_value, save=save, num_ctas=fwd_rows_ctas(t),
                                interpret=interpret)
  if fwd_tma_applies(d):
    return gate_fwd_tma_kernel(x, k, v, wf, eps=eps, clamp_value=clamp_value, save=save,
                               num_ctas=max(1, min(t, FWD_TMA_CTAS_PER_SM * _config.num_sms())), interpret=interpret)
  return gate_fwd_flat_kernel(x, k, v, wf, eps=eps, clamp_value=clamp_value, save=save, interpret=interpret)


# The forward outside fwd_rows_applies: the flat kernel's arithmetic in persistent CTAs (FWD_TMA_CTAS_PER_SM per SM)
# whose x and k rows come into an SMEM ring of FWD_TMA_SLOTS (token, stream) slots by bulk TMA copies, v into two
# token slots (gate_fwd_tma_kernel), from D = FWD_TMA_MIN_D where that fits 2 CTAs per SM. H200, 2026-11-29, D = 7168,
# M = 4, CUPTI, cold L2, median of 20, bit-exact against the flat kernel (one token per CTA) on every output: T=8001
# save=True 401.5 -> 375.0 µs (TileKernels 391.3), save=False 398.3 -> 371.4 (388.7); T=4001 207.2 -> 194.0 (199.7),
# 206.2 -> 190.6 (199.0). 3 slots with v loaded into registers instead of SMEM 382.3 / 380.2 / 198.8 / 196.5; 2 slots
# at 3 CTAs per SM (v in registers) 445.6 / 391.5 / 233.4 / 203.4; 4 slots at 1 CTA per SM 474.3 / 470.6 / 252.2 /
# 249.1. The runner's grid, flat -> TMA kernel (same call, µs, T=8001 save=False / save=True): D=2048 104.0 / 109.3 ->
# 121.8 / 124.4, D=3072 158.9 / 159.4 -> 164.3 / 167.1, D=4096 213.8 / 215.1 -> 226.1 / 237.6, D=6144 347.0 / 359.0 ->
# 318.8 / 324.6, D=7168 399.4 / 405.0 -> 370.5 / 372.7 (T=4001 alike): the flat kernel below 6144.
FWD_TMA_MIN_D = 6144
FWD_TMA_SLOTS = 2
FWD_TMA_CTAS_PER_SM = 2
FWD_TMA_REDUCTION_SCRATCH = 1024  # bytes of Mosaic's reduction scratch (default 2048; 1024 is its unit)
_IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # contiguous rows: a plain bulk copy (cp.async.bulk), no tensor map


def fwd_tma_smem_bytes(d: int) -> int:
  """SMEM of :func:`gate_fwd_tma_kernel` as Mosaic sizes it: :data:`FWD_TMA_SLOTS` rows each of ``x`` and ``k`` and
  2 of ``v`` (bf16), the reduction scratch, the barriers (8 bytes each)."""
  return (2 * FWD_TMA_SLOTS + 2) * 2 * d + FWD_TMA_REDUCTION_SCRATCH + 8 * (FWD_TMA_SLOTS + 2)


def fwd_tma_applies(d: int) -> bool:
  """Whether the forward outside :func:`fwd_rows_applies` runs :func:`gate_fwd_tma_kernel`: from
  :data:`FWD_TMA_MIN_D` where :data:`FWD_TMA_CTAS_PER_SM` of its CTAs fit an SM's shared memory (``D`` up to about
  9500 at 2 per SM)."""
  return d >= FWD_TMA_MIN_D and FWD_TMA_CTAS_PER_SM * (fwd_tma_smem_bytes(d) + 1024) <= SMEM_PER_SM


@functools.partial(jax.jit, static_argnames=("eps", "clamp_value", "save", "num_ctas", "interpret"))
def gate_fwd_tma_kernel(x, k, v, wf, *, eps, clamp_value, save, num_ctas, interpret):
  """The flat kernel's arithmetic (its preloading form's: the same register layouts, loads converted the same way, the
  same sums in the same order; on the GPU the bits of either form, :func:`gate_fwd_flat_kernel`) in ``P = num_ctas``
  persistent CTAs, CTA ``p`` the tokens ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))``. The CTA's (token, stream) units
  ``u`` (token-major) have their ``x`` and ``k`` rows brought by bulk TMA copies into slot ``u % S`` of an SMEM ring
  (``S =`` :data:`FWD_TMA_SLOTS`, one mbarrier per slot), ``v`` into one of two token slots; a unit's slot is refilled
  with unit ``u + S`` as soon as its three row sums are done (their cross-warp SMEM reductions have a warpgroup
  barrier that every thread reaches only after its loads of the slot), ``v``'s slot for token ``q + 1`` once token
  ``q``'s first stream's sums are done. ``wf``'s row is loaded from GMEM (the caches) before the wait for the unit's
  slot; ``out`` is stored from registers. So the bytes in flight sit in SMEM, not in the registers that cap the flat
  kernel's occupancy."""
  t, m, d = x.shape
  slots = FWD_TMA_SLOTS
  chunks = [(off, n, flat_layout(vec)) for off, n, vec in flat_chunks(d, 2)]
  inv_d, s = float(np.float32(1.0 / d)), float(np.float32(np.float64(d) ** -0.5))
  eps32, c = float(np.float32(eps)), float(np.float32(clamp_value))
  out_type = _fwd_out_type(t, m, d, save)
  per = -(-t // num_ctas)
  scratch = dict(x_s=plgpu.SMEM((slots, d), jnp.bfloat16), k_s=plgpu.SMEM((slots, d), jnp.bfloat16),
                 xk_bar=plgpu.Barrier(num_arrivals=2, num_barriers=slots),
                 v_s=plgpu.SMEM((2, d), jnp.bfloat16), v_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  params = plgpu.CompilerParams(unsafe_no_auto_barriers=True, reduction_scratch_bytes=FWD_TMA_REDUCTION_SCRATCH)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_ctas,), grid_names=("p",), interpret=interpret,
                     compiler_params=params, scratch_types=scratch)
  def kernel(x_g, k_g, v_g, w_g, o_g, *saved, x_s, k_s, xk_bar, v_s, v_bar):
    start = jnp.minimum(lax.axis_index("p") * per, t)
    count = jnp.minimum(start + per, t) - start  # tokens of this CTA (0 for an empty range)

    def issue_xk(q, j):  # unit (token start + q, stream j), j static
      @pl.when(q < count)
      def _():
        slot = lax.rem(q * m + j, slots)
        plgpu.copy_gmem_to_smem(x_g.at[start + q, j], x_s.at[slot], xk_bar.at[slot], oob_mode=_IN_BOUNDS)
        plgpu.copy_gmem_to_smem(k_g.at[start + q, j], k_s.at[slot], xk_bar.at[slot], oob_mode=_IN_BOUNDS)

    def issue_v(q):
      @pl.when(q < count)
      def _():
        plgpu.copy_gmem_to_smem(v_g.at[start + q], v_s.at[lax.rem(q, 2)], v_bar.at[lax.rem(q, 2)],
                                oob_mode=_IN_BOUNDS)

    for u in range(slots):
      issue_xk(jnp.int32(u // m), u % m)
    issue_v(jnp.int32(0))

    def token(q, carry):
      i = start + q
      vslot = lax.rem(q, 2)
      for j in range(m):
        slot = lax.rem(q * m + j, slots)
        wcs = [plgpu.load(w_g.at[j, pl.ds(off, n)], layout=lay, optimized=False) for off, n, lay in chunks]
        plgpu.barrier_wait(xk_bar.at[slot])
        xs, sxx, skk, raw = [], 0.0, 0.0, 0.0
        for (off, n, lay), wc in zip(chunks, wcs):
          xc = _f32(plgpu.load(x_s.at[slot, pl.ds(off, n)], layout=lay, optimized=False))
          kc = _f32(plgpu.load(k_s.at[slot, pl.ds(off, n)], layout=lay, optimized=False))
          sxx, skk, raw = sxx + jnp.sum(xc * xc), skk + jnp.sum(kc * kc), raw + jnp.sum(xc * wc * kc)
          xs.append(xc)
        rx = lax.rsqrt(sxx * inv_d + eps32)
        rk = lax.rsqrt(skk * inv_d + eps32)
        g = _sigmoid(_signed_sqrt(raw * rx * rk * s, c))
        # Every thread is past its loads of this slot (the sums' barriers): refill it with unit u + slots.
        ahead = j + slots
        issue_xk(q + ahead // m, ahead % m)
        if j == 0:
          issue_v(q + 1)  # its slot was last read by token q - 1's outputs
          plgpu.barrier_wait(v_bar.at[vslot])
        for (off, n, lay), xc in zip(chunks, xs):
          vc = _f32(plgpu.load(v_s.at[vslot, pl.ds(off, n)], layout=lay, optimized=False))
          o_g[i, j, pl.ds(off, n)] = (xc + g * vc).astype(jnp.bfloat16)
        if save:
          dot_g, gate_g, rx_g, rk_g = saved
          dot_g[i, j], gate_g[i, j], rx_g[i, j], rk_g[i, j] = raw, g, rx, rk
      return carry

    lax.fori_loop(0, count, token, 0)

  return kernel(x, k, v, wf)


def _gate_of(raw, sxx, skk, *, d, eps, clamp_value):
  """``(g, rx, rk)`` from the float32 row sums (scalars or arrays), the forward's formulas."""
  inv_d, s = float(np.float32(1.0 / d)), float(np.float32(np.float64(d) ** -0.5))
  eps32, c = float(np.float32(eps)), float(np.float32(clamp_value))
  rx = lax.rsqrt(sxx * inv_d + eps32)
  rk = lax.rsqrt(skk * inv_d + eps32)
  return _sigmoid(_signed_sqrt(raw * rx * rk * s, c)), rx, rk


def _fwd_out_type(t, m, d, save):
  """The forward kernels' outputs: ``out`` ``(T, M, D)`` bf16, then with ``save`` ``dot``, ``gate``, ``rstd_x``,
  ``rstd_k`` ``(T, M)`` float32."""
  return (jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16),) + (jax.ShapeDtypeStruct((t, m), jnp.float32),) * (4 * save)


_SCALAR = plgpu.Layout.WG_SPLAT(shape=())  # a scalar operand of inline Mosaic GPU code


def _first_thread():
  """(Inline Mosaic GPU) the i1 ``thread index % 128 == 0``: thread 0 of its warpgroup."""
  i32 = ir.IntegerType.get_signless(32)
  tid = arith_d.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
  return arith_d.cmpi(arith_d.CmpIPredicate.eq, tid, mgpu_utils.c(0, i32))


def _store_rows_one_thread(refs, i, rows):
  """``refs[r][i, :] = rows[r]`` (``(T, M)`` float32 arrays, ``rows[r]`` ``M`` warpgroup-uniform float32 scalars,
  ``M`` = 2 or 4) as one ``M``-wide vector store per array (``st.global.v4.f32`` at ``M = 4``) from thread 0 of the
  warpgroup only (inline Mosaic GPU: GPU only). The store assumes the ABI alignment of ``vector<M x f32>`` (``4·M``
  bytes), which row ``i`` has: it starts at ``4·M·i`` bytes of its array."""
  n, m = len(refs), len(rows[0])

  @plgpu.inline_mgpu(arg_types=((plgpu.RefType(),) * n, _SCALAR, ((_SCALAR,) * m,) * n))
  def body(_, refs_, i_, rows_):
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    with mgpu_utils.when(_first_thread()):
      first = arith_d.muli(arith_d.extui(i64, i_.registers.item()), mgpu_utils.c(m, i64))
      for ref, row in zip(refs_, rows_):
        vec = llvm_d.mlir_undef(ir.VectorType.get((m,), f32))
        for e, val in enumerate(row):
          vec = llvm_d.insertelement(vec, val.registers.item(), mgpu_utils.c(e, i32))
        llvm_d.store(vec, mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [first], f32))

  body(tuple(refs), jnp.asarray(i, jnp.int32), tuple(tuple(r) for r in rows))


def _replicated_row_layout(m: int):
  """A ``(M,)`` float32 register layout held whole (one ``M``-wide vector) by every thread of the warpgroup."""
  return plgpu.Layout.TILED(mgpu_fa.Tiling(((m,),)), (mgpu_fa.Replicated(4),), (mgpu_fa.Replicated(32),), -1)


def _store_rows_all_threads(refs, i, rows):
  """:func:`_store_rows_one_thread`'s stores in plain Pallas: every thread stores the same ``M``-wide vector of
  each array (:func:`_replicated_row_layout`)."""
  m = len(rows[0])
  iota = plgpu.broadcasted_iota(jnp.int32, (m,), 0, layout=_replicated_row_layout(m))
  for ref, row in zip(refs, rows):
    vec = jnp.zeros((m,), jnp.float32)
    for j, val in enumerate(row):
      vec = jnp.where(iota == j, val, vec)
    ref[i] = vec


def saved_rows_apply(m: int) -> bool:
  """Whether :func:`gate_fwd_flat_kernel` stores a token's saved scalars at its end as one ``M``-wide row per array
  (:func:`_store_saved_rows`): ``M`` = 2 or 4 (8- or 16-byte vectors); otherwise each stream's four scalars after
  its output, by every thread."""
  return m in (2, 4)


def _store_saved_rows(saved, i, streams, interpret):
  """``dot``, ``gate``, ``rstd_x``, ``rstd_k`` ``[i, :]`` of the flat kernel (``saved``) from ``streams``, the ``M``
  streams' ``(raw, g, rx, rk)`` (warpgroup-uniform float32 scalars), at the token's end: compiled, four ``M``-wide
  vector stores by thread 0 of the warpgroup (:func:`_store_rows_one_thread`, 4 store requests per token at
  ``M = 4``), instead of each stream's four scalars stored by every thread after its output (``16·M`` warp-level
  store requests per token; counted, not profiled: at ``D = 2048`` about a tenth of the token's requests to L2,
  against under 3% at 7168). In interpret mode, which
  cannot run inline Mosaic GPU code, every thread stores the same rows (:func:`_store_rows_all_threads`): the same
  values, so the same bits.

  H200, 2026-11-30, M = 4, save=True, CUPTI, cold L2, one process, median of 20, two rounds, every output
  bit-identical, µs every thread's scalar stores -> this: T=4001 D=2048 59.92 -> 57.62 (TileKernels about 58.3),
  T=8001 D=2048 108.85 -> 104.38, T=8001 D=3072 155.42 -> 155.39, T=4001 D=3072 81.97 -> 81.81, T=8001 D=4096
  205.48 -> 204.46, T=4001 D=4096 106.14 -> 105.60. Thread 0 storing the four scalars per stream instead (no
  vectors): T=4001 / 8001 D=2048 59.16 / 107.32, but D=3072 85.26 / 164.08; every thread storing the rows
  (:func:`_store_rows_all_threads`): D=2048 58.07 / 107.24. ptxas registers (save=True) 122 -> 121 at D=2048, 93 ->
  94 at 3072, 109 at 4096. The TMA kernel (D=7168) keeps every thread's scalar stores: each of these forms was within
  ±0.3% there."""
  rows = [tuple(s[a] for s in streams) for a in range(len(saved))]
  if not interpret:  # inline Mosaic GPU code cannot run in interpret mode
    _store_rows_one_thread(saved, i, rows)
  else:
    _store_rows_all_threads(saved, i, rows)


def _store_rows_lane0(refs, i, vals, layout):
  """``refs[r][i] = vals[r]`` for ``(M,)`` float32 arrays in ``layout`` (:func:`gate_fwd_rows_kernel`'s
  ``stream_rows_layout().reduce((1,))``: a stream's value in every lane of its warp), stored by lane 0 of each warp
  only (inline Mosaic GPU: GPU only), after the token's output stores.

  H200, 2026-11-30, D=2560, M = 4, save=True, CUPTI, cold L2, one process, median of 20, two rounds, every output
  bit-identical, µs all 32 lanes storing before the ``v`` load -> lane 0 after the output: T=4001 72.67 -> 70.96,
  T=8001 137.46 -> 135.57; all lanes after the output 71.46 / 135.36, lane 0 before the ``v`` load 71.25 / 137.37.
  ptxas registers 242 either way."""
  n = len(refs)

  @plgpu.inline_mgpu(arg_types=((plgpu.RefType(),) * n, _SCALAR, (layout,) * n))
  def body(_, refs_, i_, vals_):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    lane = arith_d.remui(mgpu_utils.thread_idx(), mgpu_utils.c(32, i32))
    with mgpu_utils.when(arith_d.cmpi(arith_d.CmpIPredicate.eq, lane, mgpu_utils.c(0, i32))):
      row = arith_d.index_cast(index, i_.registers.item())
      for ref, fa in zip(refs_, vals_):
        for (col,), reg in zip(fa.layout.thread_idxs(fa.shape), fa.registers.flat):
          for e in range(ir.VectorType(reg.type).shape[0]):
            val = vector_d.extract(reg, [], [e])
            memref_d.store(val, ref, [row, arith_d.addi(col, mgpu_utils.c(e, index)) if e else col])

  body(tuple(refs), jnp.asarray(i, jnp.int32), tuple(vals))


@functools.partial(jax.jit, static_argnames=("eps", "clamp_value", "save", "num_ctas", "interpret"))
def gate_fwd_rows_kernel(x, k, v, wf, *, eps, clamp_value, save, num_ctas, interpret):
  """The forward with one warp per stream (:func:`stream_rows_layout`, ``M % 4 == 0``; ``T >= 1``) in
  ``P = num_ctas`` persistent CTAs (``1 <= P <= T``, :func:`fwd_rows_ctas`), CTA ``p`` the tokens
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))`` (the last ones short or empty where ``P`` does not divide ``T``).
  Per token: its ``(M, D)`` rows of ``x``, ``k`` and ``wf`` (``wf`` re-loaded for every token rather than held
  in registers), their three row sums without any barrier, then ``out = bf16(x + g·v)`` with ``v`` loaded by
  every warp and ``x`` kept in registers (``D/32`` values of each row per thread). The next token's ``x`` and
  ``k`` (a ``lax.fori_loop`` carry) are loaded as soon as the row sums are done, so they are in flight during
  the gate, the ``v`` load and the stores. With ``save`` the token's saved ``(M,)`` rows ``dot``, ``gate``,
  ``rstd_x``, ``rstd_k`` are stored after its output, each stream's values by lane 0 of its warp
  (:func:`_store_rows_lane0`, which gives the measurement; in interpret mode, which cannot run that inline Mosaic GPU
  code, by plain stores of the same values)."""
  t, m, d = x.shape
  per = -(-t // num_ctas)
  lay = stream_rows_layout()
  rows, row_v = _tiled(lay), _tiled(lay.reduce((0,)))
  out_type = _fwd_out_type(t, m, d, save)
  saved_layout, one_lane = _tiled(lay.reduce((1,))), not interpret

  def load(ref, layout=rows):
    return plgpu.load(ref, layout=layout, optimized=False)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_ctas,), grid_names=("p",), interpret=interpret,
                     compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, k_g, v_g, w_g, o_g, *saved):
    start = jnp.minimum(lax.axis_index("p") * per, t)
    end = jnp.minimum(start + per, t)

    def x_k_of(i):  # clamped in bounds: past the range (its last token, an empty range) loaded and left unused
      i = jnp.minimum(i, t - 1)
      return load(x_g.at[i]), load(k_g.at[i])

    def token(i, x_k):
      xf, kf = _f32(x_k[0]), _f32(x_k[1])
      raw = 0.0 + jnp.sum(xf * load(w_g) * kf, axis=1)  # -0 becomes +0, as in the flat kernel's chunk sums
      g, rx, rk = _gate_of(raw, jnp.sum(xf * xf, axis=1), jnp.sum(kf * kf, axis=1), d=d, eps=eps,
                           clamp_value=clamp_value)
      ahead = x_k_of(i + 1)
      vf = _f32(load(v_g.at[i], row_v))
      o_g[i] = (xf + g[:, None] * vf[None, :]).astype(jnp.bfloat16)
      if save and one_lane:  # after the output (_store_rows_lane0 gives the measurement)
        _store_rows_lane0(saved, i, (raw, g, rx, rk), saved_layout)
      elif save:
        for ref, val in zip(saved, (raw, g, rx, rk)):
          ref[i] = val
      return ahead

    lax.fori_loop(start, end, token, x_k_of(start))

  return kernel(x, k, v, wf)


def _f32_by_bits(a):
  """bf16 -> float32 as ``bits << 16``: the value of ``a.astype(float32)`` (NaN payloads aside) by other operations
  than ``astype``'s, so that LLVM does not merge it with an earlier conversion of the same registers (and keep that
  conversion's float32 registers alive instead of the packed bf16 ones)."""
  b = lax.bitcast_convert_type(a, jnp.int16).astype(jnp.int32)
  return lax.bitcast_convert_type(b << 16, jnp.float32)


def _three_products(xc, wc, kc):
  """The ``(3, n)`` block ``[x², k², x·wf·k]`` of ``(1, n)`` float32 rows (:func:`block_rows_layout`)."""
  return jnp.concatenate([xc * xc, kc * kc, xc * wc * kc], axis=0)


def _three_sums(p):
  """``(Σx², Σk², Σx·wf·k)`` of :func:`_three_products`' block in one cross-warp reduction (one barrier pair).
  Bit-identical to three ``jnp.sum`` of the same rows in :func:`jaxkern._layouts.flat_layout` on the GPU (the same
  in-thread order, the same shuffles; the cross-warp step adds the four warps' parts as ``(p0 + p1) + (p2 + p3)`` up
  to the commutation of each ``+``), not in interpret mode (XLA's order for a ``(3, n)`` block)."""
  s = jnp.sum(p, axis=1)  # (3,), in every thread
  # Row r as a scalar: the in-thread sum of s with the other rows zeroed (Mosaic GPU cannot index s[r]); exact, as
  # x + 0 = x but for -0 -> +0, which the callers' 0 + sum applies anyway (and Σx², Σk² are never -0).
  rows = lax.broadcasted_iota(jnp.int32, (3,), 0)
  return tuple(jnp.sum(jnp.where(rows == r, s, 0.0)) for r in range(3))


@functools.partial(jax.jit, static_argnames=("eps", "clamp_value", "save", "interpret"))
def gate_fwd_flat_kernel(x, k, v, wf, *, eps, clamp_value, save, interpret):
  """The forward with each row spread over the warpgroup (any ``M``): one token per CTA (grid ``T``), the streams
  one after the other (the module docstring's flat design), in one of two forms (:data:`PRELOAD_MAX_VALUES` gives
  the measurements that chose each):

  * ``M·D <= PRELOAD_MAX_VALUES``: the ``x`` and ``k`` rows of all streams loaded before any arithmetic, rows of
    :func:`jaxkern._layouts.flat_layout`, ``v`` converted to float32 once for all streams; each stream's ``Σx²``,
    ``Σk²``, ``Σx·wf·k`` in three cross-warp reductions (a barrier pair each).
  * Above (``D = 3072, 4096`` at ``M = 4``): stream by stream (its ``x``, ``k``, ``wf``, then ``v``; the first
    stream's ``v`` before its rows), the rows as ``(1, n)`` blocks of :func:`block_rows_layout`; the three sums in
    one cross-warp reduction of a ``(3, n)`` block (:func:`_three_sums`: one barrier pair per stream instead of
    three), ``x`` kept as packed bf16 until the output (:func:`_f32_by_bits`) and ``v`` re-loaded per stream as
    packed bf16 (from the caches after the first stream) instead of held in float32 for the whole token: about
    ``D/128`` fewer registers per thread.

  The two forms give the same bits on the GPU (H200, D = 2048 / 3072 / 4096, every output); in interpret mode the
  second sums in XLA's order (:func:`_three_sums`).

  With ``save``, where :func:`saved_rows_apply` (``M`` = 2 or 4), the token's saved ``dot``, ``gate``, ``rstd_x``,
  ``rstd_k`` rows are stored at its end, one ``M``-wide vector per array from thread 0 of the warpgroup
  (:func:`_store_saved_rows`, which gives the measurement; in interpret mode, which cannot run that inline Mosaic
  GPU code, the same rows from every thread); for other ``M`` each stream's four scalars after its output, by every
  thread."""
  t, m, d = x.shape
  preload, rows_at_end = m * d <= PRELOAD_MAX_VALUES, saved_rows_apply(m)
  chunks = [(off, n, flat_layout(vec) if preload else _tiled(block_rows_layout(128 * vec)))
            for off, n, vec in flat_chunks(d, 2)]
  inv_d, s = float(np.float32(1.0 / d)), float(np.float32(np.float64(d) ** -0.5))
  eps32, c = float(np.float32(eps)), float(np.float32(clamp_value))
  out_type = _fwd_out_type(t, m, d, save)

  def load(ref, lay):
    return plgpu.load(ref, layout=lay, optimized=False)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(t,), grid_names=("t",), interpret=interpret,
                     compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, k_g, v_g, w_g, o_g, *saved):
    i = lax.axis_index("t")
    streams = []  # each stream's saved (raw, g, rx, rk), stored at the token's end (saved_rows_apply)

    def load_v():  # the second form's v: packed bf16, (1, n) blocks
      return [load(v_g.at[pl.ds(i, 1), pl.ds(off, n)], lay) for off, n, lay in chunks]

    if preload:
      vs = [_f32(load(v_g.at[i, pl.ds(off, n)], lay)) for off, n, lay in chunks]
      rows = [[(load(x_g.at[i, j, pl.ds(off, n)], lay), load(k_g.at[i, j, pl.ds(off, n)], lay))
               for off, n, lay in chunks] for j in range(m)]
    else:
      v_first = load_v()
    for j in range(m):
      if preload:
        xs, sxx, skk, raw = [], 0.0, 0.0, 0.0
        for (off, n, lay), (xc, kc) in zip(chunks, rows[j]):
          xc, kc = _f32(xc), _f32(kc)
          wc = load(w_g.at[j, pl.ds(off, n)], lay)
          sxx, skk, raw = sxx + jnp.sum(xc * xc), skk + jnp.sum(kc * kc), raw + jnp.sum(xc * wc * kc)
          xs.append(xc)
      else:
        xks = [(load(x_g.at[i, pl.ds(j, 1), pl.ds(off, n)], lay), load(k_g.at[i, pl.ds(j, 1), pl.ds(off, n)], lay))
               for off, n, lay in chunks]
        wcs = [load(w_g.at[pl.ds(j, 1), pl.ds(off, n)], lay) for off, n, lay in chunks]
        vbs = v_first if j == 0 else load_v()
        fs = [(_f32(xb), _f32(kb), wc) for (xb, kb), wc in zip(xks, wcs)]
        blocks = [_three_products(xc, wc, kc) for xc, kc, wc in fs]
        sxx, skk, raw = 0.0, 0.0, 0.0
        for a, b, e in [_three_sums(p) for p in blocks]:
          sxx, skk, raw = sxx + a, skk + b, raw + e
      rx = lax.rsqrt(sxx * inv_d + eps32)
      rk = lax.rsqrt(skk * inv_d + eps32)
      g = _sigmoid(_signed_sqrt(raw * rx * rk * s, c))
      if preload:
        for (off, n, _), xc, vc in zip(chunks, xs, vs):
          o_g[i, j, pl.ds(off, n)] = (xc + g * vc).astype(jnp.bfloat16)
      else:
        vcs = [_f32(vb) for vb in vbs]
        for (off, n, _), (xb, _), vc in zip(chunks, xks, vcs):
          o_g[i, pl.ds(j, 1), pl.ds(off, n)] = (_f32_by_bits(xb) + g * vc).astype(jnp.bfloat16)
      if save and rows_at_end:
        streams.append((raw, g, rx, rk))
      elif save:
        for ref, val in zip(saved, (raw, g, rx, rk)):
          ref[i, j] = val
    if streams:
      _store_saved_rows(saved, i, streams, interpret)

  return kernel(x, k, v, wf)


def column_block(d: int) -> int:
  """Columns per CTA of the backward's column pass: ``128·vec`` with the widest ``vec`` in {8, 4, 2} (16-,
  8-, 4-byte bf16 vectors) dividing ``D`` (1024 for 2048, 3072, 4096, 6144, 7168; 512 for 2560)."""
  for vec in (8, 4, 2):
    if d % (128 * vec) == 0:
      return 128 * vec
  raise ValueError(f"hidden_size {d} is not a multiple of 256")


def default_num_partials(t: int, d: int, m: int = 4) -> int:
  """Token chunks of the backward (the rows of ``grad_w_partial``) when the caller gives none. For the fused
  kernel (:func:`fused_applies`) its persistent grid, ``SMs·fused_ctas_per_sm(D, M)``, at most ``T``; for the
  large-``D`` one-pass kernel (:func:`onepass_applies`) its persistent grid, :func:`onepass_ctas`. For the
  two-pass column pass ``CTAS_PER_SM·SMs // (D / w)`` (about :data:`CTAS_PER_SM` CTAs per SM over the column
  blocks, several waves so that the last one's quantisation costs little), at most one chunk per
  :data:`MIN_CHUNK` tokens (the partials' ``16·P·D`` bytes, written here and read by ``grad_w_reduce``, stay a
  few % of the traffic). At least 1. A tuning knob: ``num_partials=`` overrides it."""
  if d % 256 == 0 and fused_applies(d, m):
    return max(1, min(fused_ctas_per_sm(d, m) * _config.num_sms(), t))
  if d % 256 == 0 and onepass_applies(d, m):
    return onepass_ctas(t)
  blocks = d // column_block(d) if d % 256 == 0 else 1
  return max(1, min(CTAS_PER_SM * _config.num_sms() // blocks, -(-t // MIN_CHUNK)))


def _big_g(dldg, raw, g, rx, rk, *, d, clamp_value):
  """``G`` (docs/engram.md, "Gate") from the float32 ``dldg`` and the saved ``raw``, ``g``, ``rx``, ``rk``
  (scalars or arrays)."""
  s, c = float(np.float32(np.float64(d) ** -0.5)), float(np.float32(clamp_value))
  a = jnp.abs(raw)
  active = a * s * rx * rk >= c
  return jnp.where(active, dldg * g * (1.0 - g) * 0.5 * lax.sqrt(s * rx * rk / jnp.where(active, a, 1.0)), 0.0)


def gate_bwd_rows_kernel(go, v, dot, gate, rstd_x, rstd_k, *, clamp_value, interpret):
  """Row pass of the two-pass backward (``T >= 1``): ``(T, M, 4)`` float32 factors ``[g, G, raw·rx²/D,
  raw·rk²/D]`` per (token, stream), ``G`` from ``dldg = Σ go·v`` (docs/engram.md, "Gate"). One warp per stream
  (:func:`stream_rows_layout`, no barrier) where ``M % 4 == 0``, else the rows spread over the warpgroup. H200,
  2026-11-29, T=8001 D=2560, both passes: 286.9 µs with the row pass by stream, 321.2 with the flat one
  (2026-11-28)."""
  kernel = _rows_pass_by_stream if go.shape[1] % 4 == 0 else _rows_pass_flat
  return kernel(go, v, dot, gate, rstd_x, rstd_k, clamp_value=clamp_value, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("clamp_value", "interpret"))
def _rows_pass_by_stream(go, v, dot, gate, rstd_x, rstd_k, *, clamp_value, interpret):
  t, m, d = go.shape
  lay = stream_rows_layout()
  rows, row_v, per_row = _tiled(lay), _tiled(lay.reduce((0,))), _tiled(lay.reduce((1,)))
  inv_d = float(np.float32(1.0 / d))

  def load(ref, layout):
    return plgpu.load(ref, layout=layout, optimized=False)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, m, 4), jnp.float32), grid=(t,),
                     grid_names=("t",), interpret=interpret, compiler_params=NO_AUTO_BARRIERS)
  def kernel(go_g, v_g, dot_g, gate_g, rx_g, rk_g, f_g):
    i = lax.axis_index("t")
    dldg = 0.0 + jnp.sum(_f32(load(go_g.at[i], rows)) * _f32(load(v_g.at[i], row_v))[None, :], axis=1)
    raw, g, rx, rk = (load(ref.at[i], per_row) for ref in (dot_g, gate_g, rx_g, rk_g))
    f_g[i, :, 0], f_g[i, :, 1] = g, _big_g(dldg, raw, g, rx, rk, d=d, clamp_value=clamp_value)
    f_g[i, :, 2], f_g[i, :, 3] = raw * rx * rx * inv_d, raw * rk * rk * inv_d

  return kernel(go, v, dot, gate, rstd_x, rstd_k)


@functools.partial(jax.jit, static_argnames=("clamp_value", "interpret"))
def _rows_pass_flat(go, v, dot, gate, rstd_x, rstd_k, *, clamp_value, interpret):
  t, m, d = go.shape
  chunks = [(off, n, flat_layout(vec)) for off, n, vec in flat_chunks(d, 2)]
  inv_d = float(np.float32(1.0 / d))

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, m, 4), jnp.float32), grid=(t,),
                     grid_names=("t",), interpret=interpret, compiler_params=NO_AUTO_BARRIERS)
  def kernel(go_g, v_g, dot_g, gate_g, rx_g, rk_g, f_g):
    i = lax.axis_index("t")
    vs = [_f32(plgpu.load(v_g.at[i, pl.ds(off, n)], layout=lay, optimized=False)) for off, n, lay in chunks]

    def load_row(j):
      return [plgpu.load(go_g.at[i, j, pl.ds(off, n)], layout=lay, optimized=False) for off, n, lay in chunks]

    preloaded = [load_row(j) for j in range(m)] if m * d <= PRELOAD_MAX_VALUES else None
    for j in range(m):
      dldg = 0.0
      for goc, vc in zip(preloaded[j] if preloaded else load_row(j), vs):
        dldg = dldg + jnp.sum(_f32(goc) * vc)
      raw, g, rx, rk = dot_g[i, j], gate_g[i, j], rx_g[i, j], rk_g[i, j]
      f_g[i, j, 0], f_g[i, j, 1] = g, _big_g(dldg, raw, g, rx, rk, d=d, clamp_value=clamp_value)
      f_g[i, j, 2], f_g[i, j, 3] = raw * rx * rx * inv_d, raw * rk * rk * inv_d

  return kernel(go, v, dot, gate, rstd_x, rstd_k)


@functools.partial(jax.jit, static_argnames=("num_partials", "interpret"))
def gate_bwd_cols_kernel(go, x, k, wf, factors, *, num_partials, interpret):
  """Column pass of the backward (``T >= 1``): ``(grad_x, grad_k, grad_v, grad_w_partial (P, M, D) float32)``
  from the row pass's ``factors``; CTA ``(c, p)`` takes column block ``c`` of the tokens
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))``."""
  t, m, d = x.shape
  p = num_partials
  per = -(-t // p)
  w = column_block(d)
  lay = flat_layout(w // 128)
  out_type = (jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((p, m, d), jnp.float32))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(d // w, p), grid_names=("c", "p"), interpret=interpret,
                     compiler_params=NO_AUTO_BARRIERS)
  def kernel(go_g, x_g, k_g, w_g, f_g, gx_g, gk_g, gv_g, gw_g):
    pid = lax.axis_index("p")
    cols = pl.ds(lax.axis_index("c") * w, w)
    wfs = [plgpu.load(w_g.at[j, cols], layout=lay, optimized=False) for j in range(m)]

    def load(ref):
      return plgpu.load(ref, layout=lay, optimized=False)

    def step(tokens, acc):
      # every load of the group first (TOKENS_PER_STEP tokens in flight per thread), then the arithmetic
      rows = [[(load(go_g.at[i, j, cols]), load(x_g.at[i, j, cols]), load(k_g.at[i, j, cols])) for j in range(m)]
              for i in tokens]
      facs = [[[f_g[i, j, q] for q in range(4)] for j in range(m)] for i in tokens]
      acc = list(acc)
      for i, row, fac in zip(tokens, rows, facs):
        gv = None
        for j, ((goc, xc, kc), (g, big_g, cx, ck)) in enumerate(zip(row, fac)):
          goc, xc, kc = _f32(goc), _f32(xc), _f32(kc)
          gx_g[i, j, cols] = (goc + big_g * (kc * wfs[j] - xc * cx)).astype(jnp.bfloat16)
          gk_g[i, j, cols] = (big_g * (xc * wfs[j] - kc * ck)).astype(jnp.bfloat16)
          acc[j] = acc[j] + big_g * xc * kc
          gv = goc * g if gv is None else gv + goc * g  # m = 0..M-1 in order (docs/engram.md, "Gate")
        gv_g[i, cols] = gv.astype(jnp.bfloat16)
      return tuple(acc)

    start = jnp.minimum(pid * per, t)
    end = jnp.minimum(start + per, t)
    groups = (end - start) // TOKENS_PER_STEP
    acc = tuple(plgpu.layout_cast(jnp.zeros((w,), jnp.float32), lay) for _ in range(m))
    acc = lax.fori_loop(0, groups, lambda q, acc: step(
        [start + q * TOKENS_PER_STEP + u for u in range(TOKENS_PER_STEP)], acc), acc)
    acc = lax.fori_loop(start + groups * TOKENS_PER_STEP, end, lambda i, acc: step([i], acc), acc)
    for j in range(m):
      gw_g[pid, j, cols] = acc[j]

  return kernel(go, x, k, wf, factors)


def block_rows_layout(w: int) -> mgpu_fa.TiledLayout:
  """Register layout of a ``(M, n)`` block (``n % w == 0``, ``w = 128·vec``) with every row spread over the
  warpgroup as :func:`jaxkern._layouts.flat_layout` spreads one (``vec`` consecutive columns per thread, a warp
  ``32·vec`` contiguous columns) and the rows and ``w``-column segments in registers: a reduction along the rows
  is in-thread (``m`` in order where :func:`fused_block` says so), one along the columns reduces all ``M`` rows
  in one SMEM step (one barrier pair, ``M <= 4``). ``reduce((0,))`` is :func:`jaxkern._layouts.flat_layout`,
  ``reduce((1,))`` one value per row held by every thread."""
  vec = w // 128
  tiling = mgpu_fa.Tiling(((1, w), (32 * vec,), (vec,)))
  return mgpu_fa.TiledLayout(tiling, (-3,), (-2,), -1, _check_canonical=False).canonicalize()


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM, of which at most 227 KiB per CTA
SMEM_PER_CTA_RESERVED = 1024 + 2048  # the driver's 1 KiB per CTA + Pallas's reduction scratch


def fused_ctas_per_sm(d: int, m: int) -> int:
  """CTAs per SM of :func:`gate_bwd_fused_kernel`: as many ``(M, D)`` float32 SMEM accumulators as fit in an
  SM, at most :data:`FUSED_MAX_CTAS_PER_SM`, at least 1."""
  return max(1, min(FUSED_MAX_CTAS_PER_SM, SMEM_PER_SM // (4 * m * d + SMEM_PER_CTA_RESERVED)))


def fused_block(d: int) -> int | None:
  """Columns per step of :func:`gate_bwd_fused_kernel` (``grad_x``, ``grad_k``, ``grad_v`` and the partial):
  the narrowest multiple of :func:`column_block` ``w`` dividing ``D`` whose rows span at least
  ``MOSAIC_ADD_ILP / vec`` registers per thread, so that Mosaic's in-thread sum over the streams (``grad_v``)
  adds them in order (with fewer it splits them over interleaved accumulators); None if there is none
  (``D = 512``). 1024 for 16-byte vectors (the fused kernel's); ``D`` itself for 2560."""
  w = column_block(d)
  for cb in range(w * max(1, MOSAIC_ADD_ILP * 128 // w), d + 1, w):
    if d % cb == 0:
      return cb
  return None


def fused_applies(d: int, m: int) -> bool:
  """Whether :func:`gate_bwd_kernel` runs :func:`gate_bwd_fused_kernel` for ``(D, M)``: column blocks of
  16-byte vectors (:func:`column_block` 1024), ``D <= FUSED_MAX_D`` (measurements there) and
  ``M <= FUSED_MAX_STREAMS`` (the ``(M, D)`` float32 accumulator then takes at most 48 KiB of SMEM)."""
  return column_block(d) == 1024 and d <= FUSED_MAX_D and m <= FUSED_MAX_STREAMS


@functools.partial(jax.jit, static_argnames=("clamp_value", "num_partials", "interpret"))
def gate_bwd_fused_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, *, clamp_value, num_partials, interpret):
  """The backward in one pass (``T >= 1``): ``P`` persistent CTAs, CTA ``p`` the tokens
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))`` one after the other, whole rows (:func:`block_rows_layout` with
  the :func:`column_block` width, 16-byte vectors). Per token: ``dldg = Σ go·v`` of the
  ``M`` streams in one reduction, ``G`` (the row pass's formulas), then per :func:`fused_block` of columns
  ``grad_x``, ``grad_k``, ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order) and the weight-gradient partial
  ``Σ G·x⊙k``, accumulated in an ``(M, D)`` float32 SMEM buffer that each thread reads and writes at its own
  positions (no barrier), stored into ``grad_w_partial[p]`` at the end. ``go`` is read once and kept in
  registers (``M·D/256`` packed registers per thread: 48 at ``M = 4``, ``D = 3072``). The loads of the first
  :data:`FUSED_XK_EARLY_BLOCKS` blocks of ``x``, ``k``, ``wf`` (never all of them) are issued before ``G``'s
  barriers."""
  t, m, d = x.shape
  p = num_partials
  per = -(-t // p)
  lay, cb = block_rows_layout(column_block(d)), fused_block(d)
  rows, row, per_stream = _tiled(lay), _tiled(lay.reduce((0,))), _tiled(lay.reduce((1,)))
  inv_d = float(np.float32(1.0 / d))
  blocks = [pl.ds(b * cb, cb) for b in range(d // cb)]
  early = min(FUSED_XK_EARLY_BLOCKS, len(blocks) - 1)  # not the whole row (D = 1024: one block)
  out_type = (jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((p, m, d), jnp.float32))

  def load(ref, layout=rows):
    return plgpu.load(ref, layout=layout, optimized=False)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(p,), grid_names=("p",), interpret=interpret,
                     scratch_types=[plgpu.SMEM((m, d), jnp.float32)], compiler_params=NO_AUTO_BARRIERS)
  def kernel(go_g, x_g, k_g, v_g, w_g, dot_g, gate_g, rx_g, rk_g, gx_g, gk_g, gv_g, gw_g, acc_s):
    pid = lax.axis_index("p")
    start = jnp.minimum(pid * per, t)
    end = jnp.minimum(start + per, t)
    for cols in blocks:
      acc_s[:, cols] = plgpu.layout_cast(jnp.zeros((m, cb), jnp.float32), rows)

    def token(i, carry):
      gob = load(go_g.at[i])
      xkw = [(load(x_g.at[i, :, cols]), load(k_g.at[i, :, cols]), load(w_g.at[:, cols])) for cols in blocks[:early]]
      dldg = 0.0 + jnp.sum(_f32(gob) * _f32(load(v_g.at[i], row))[None, :], axis=1)  # as the two-pass row pass
      raw, g, rx, rk = (load(ref.at[i], per_stream) for ref in (dot_g, gate_g, rx_g, rk_g))
      big_g = _big_g(dldg, raw, g, rx, rk, d=d, clamp_value=clamp_value)[:, None]
      cx, ck = (raw * rx * rx * inv_d)[:, None], (raw * rk * rk * inv_d)[:, None]
      for b, cols in enumerate(blocks):
        xb, kb, wb = xkw[b] if b < early else (load(x_g.at[i, :, cols]), load(k_g.at[i, :, cols]),
                                                load(w_g.at[:, cols]))
        goc = _f32(gob[:, b * cb:(b + 1) * cb])
        xc, kc = _f32(xb), _f32(kb)
        gx_g[i, :, cols] = (goc + big_g * (kc * wb - xc * cx)).astype(jnp.bfloat16)
        gk_g[i, :, cols] = (big_g * (xc * wb - kc * ck)).astype(jnp.bfloat16)
        acc_s[:, cols] = load(acc_s.at[:, cols]) + big_g * xc * kc
        gv_g[i, cols] = jnp.sum(goc * g[:, None], axis=0).astype(jnp.bfloat16)  # m in order (fused_block)
      return carry

    lax.fori_loop(start, end, token, 0)
    for cols in blocks:
      gw_g[pid, :, cols] = load(acc_s.at[:, cols])

  return kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k)


ONEPASS_WARPGROUPS = 2  # warpgroups per CTA of the large-D one-pass kernel (each one half of every row)
# x / k slots of gate_bwd_ring_kernel per warpgroup, (M, 1024) bf16 (token, column block) units of each: the count
# measured (gate_bwd_kernel gives the measurement). 3 slots do not fit one CTA at D = 6144 (about 261 KB of SMEM,
# more than the 232448 bytes a CTA may have).
RING_XK_SLOTS = 2
RING_REDUCTION_SCRATCH = 1024  # bytes of Mosaic's reduction scratch (no reduction of the ring kernel crosses warps)


def ring_smem_bytes(d: int, m: int) -> int:
  """SMEM of :func:`gate_bwd_ring_kernel` as Mosaic lays it out (each buffer from a 1024-byte boundary, then the
  reduction scratch and the barriers, 8 bytes each): the ``(M, D)`` float32 weight-gradient partial, ``go``'s
  ``(M, D)`` row and ``v``'s (bf16), the 4 saved ``(M,)`` vectors and the half-row sums (float32),
  :data:`RING_XK_SLOTS` ``(M, block)`` slots of ``x`` and of ``k`` per warpgroup (bf16). 175208 bytes at
  ``D = 4096``, 228472 at 6144, 281736 at 8192."""
  nw, slots = ONEPASS_WARPGROUPS, RING_XK_SLOTS
  cb = fused_block(d // nw)
  buffers = (4 * m * d, 2 * m * d, 2 * d, nw * 4 * m * 4, 2 * nw * m * 4, nw * slots * m * cb * 2,
             nw * slots * m * cb * 2)
  barriers = nw * (d // nw // cb) + nw + nw * slots + nw + 1  # go pieces, token, x / k slots, free, both
  return sum(-(-b // 1024) * 1024 for b in buffers) + RING_REDUCTION_SCRATCH + 8 * barriers


def onepass_applies(d: int, m: int) -> bool:
  """Whether :func:`gate_bwd_ring_kernel` takes ``(D, M)``: ``M = 4`` (one warp per stream in each warpgroup),
  halves of ``D`` in 16-byte vectors (:func:`column_block` 1024: ``D % 2048 == 0``) and its SMEM
  (:func:`ring_smem_bytes`) within one CTA's 227 KiB: ``D`` up to 6144. Narrower vectors are not taken: at
  ``D = 2560`` (halves of 1280 columns in 4-byte vectors) Mosaic's layout inference found no solution (after
  minutes, 2026-11-29)."""
  half = d // ONEPASS_WARPGROUPS
  return m == 4 and half % 1024 == 0 and ring_smem_bytes(d, m) <= SMEM_PER_SM - 1024


def onepass_ctas(t: int) -> int:
  """CTAs of :func:`gate_bwd_ring_kernel` for ``T >= 1`` tokens: one per SM (its SMEM takes nearly all of an
  SM's at ``D = 6144``), at most ``T``."""
  return max(1, min(t, _config.num_sms()))


@functools.partial(jax.jit, static_argnames=("clamp_value", "num_partials", "interpret"))
def gate_bwd_ring_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, *, clamp_value, num_partials, interpret):
  """The backward in one pass for large ``D`` (``T >= 1``, :func:`onepass_applies`), its operands staged in SMEM
  by bulk TMA copies (``cp.async.bulk`` of contiguous row pieces, :data:`_IN_BOUNDS`), so that the bytes in flight
  sit in SMEM, not in registers. ``P`` persistent CTAs of two warpgroups, CTA ``p`` the tokens
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))`` one after the other, warpgroup ``h`` the columns
  ``[h·D/2, (h+1)·D/2)`` of every row.

  Per token, each warpgroup: its half of the ``M`` rows of ``go`` and of ``v`` one warp per stream
  (:func:`stream_rows_layout`), the half-row sums ``Σ go·v`` by warp shuffles (no SMEM), written to SMEM; an
  mbarrier of both warpgroups; ``dldg`` = first half's sum + second half's, ``G`` (the row pass's formulas);
  then per :func:`fused_block` of its half (:func:`block_rows_layout`, every stream's same columns in one thread)
  ``grad_x``, ``grad_k``, ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order), stored from registers, and the
  weight-gradient partial ``Σ G·x⊙k`` in an ``(M, D)`` float32 SMEM buffer (each thread its own positions),
  stored into ``grad_w_partial[p]`` at the end. ``wf``'s blocks are loaded from GMEM (the caches) every token, one
  block ahead (into registers, during the previous block's arithmetic; block 0 of the next token a ``fori_loop``
  carry). The half-row sums sit in two SMEM slots by token parity, so a warpgroup a token ahead never overwrites
  a sum the other has not read. HBM sees every array once (``44·T·D`` bytes).

  Each warpgroup issues and waits for its own copies:

  * ``go``: the warpgroup's ``(M, D/2)`` part of one token, as :func:`fused_block` pieces with an mbarrier each;
    piece ``b`` of token ``q + 1`` is issued as soon as every thread of the warpgroup has read piece ``b`` of token
    ``q`` (its column block ``b``).
  * ``v``'s half row and the 4 saved ``(M,)`` vectors (``dot``, ``gate``, ``rstd_x``, ``rstd_k``) of one token,
    one mbarrier; token ``q + 1``'s are issued right after the mbarrier of both warpgroups that exchanges the
    half-row sums (every thread read them before arriving there).
  * ``x`` and ``k``: a ring of :data:`RING_XK_SLOTS` ``(M, block)`` slots over the (token, column block) units; a
    unit's slot is refilled with the unit :data:`RING_XK_SLOTS` ahead once every thread has read it.

  "Every thread has read it": an mbarrier per warpgroup that all its 128 threads arrive at right after their SMEM
  loads of the block and wait for after the block's arithmetic and stores, before the refills are issued."""
  t, m, d = x.shape
  p = num_partials
  per = -(-t // p)
  nw, slots = ONEPASS_WARPGROUPS, RING_XK_SLOTS
  half = d // nw
  s_lay = stream_rows_layout()
  s_rows, s_row = _tiled(s_lay), _tiled(s_lay.reduce((0,)))
  b_lay, cb = block_rows_layout(column_block(half)), fused_block(half)
  b_rows, b_per_stream = _tiled(b_lay), _tiled(b_lay.reduce((1,)))
  offsets = list(range(0, half, cb))
  nb = len(offsets)
  inv_d = float(np.float32(1.0 / d))
  f32, bf16 = jnp.float32, jnp.bfloat16
  out_type = (jax.ShapeDtypeStruct((t, m, d), bf16), jax.ShapeDtypeStruct((t, m, d), bf16),
              jax.ShapeDtypeStruct((t, d), bf16), jax.ShapeDtypeStruct((p, m, d), f32))
  scratch = dict(
      acc_s=plgpu.SMEM((m, d), f32),
      go_s=plgpu.SMEM((nw, m, half), bf16), v_s=plgpu.SMEM((nw, half), bf16), sc_s=plgpu.SMEM((nw, 4, m), f32),
      x_s=plgpu.SMEM((nw, slots, m, cb), bf16), k_s=plgpu.SMEM((nw, slots, m, cb), bf16),
      sums_s=plgpu.SMEM((2, nw, m), f32),
      go_bar=plgpu.Barrier(num_arrivals=m, num_barriers=nw * nb),
      tok_bar=plgpu.Barrier(num_arrivals=5, num_barriers=nw),
      xk_bar=plgpu.Barrier(num_arrivals=2 * m, num_barriers=nw * slots),
      free=plgpu.Barrier(num_arrivals=1, num_barriers=nw),
      both=plgpu.Barrier(num_arrivals=nw))
  params = plgpu.CompilerParams(unsafe_no_auto_barriers=True, reduction_scratch_bytes=RING_REDUCTION_SCRATCH)

  def load(ref, layout=b_rows):
    return plgpu.load(ref, layout=layout, optimized=False)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(p,), grid_names=("p",), num_threads=nw,
                     thread_name="wg", interpret=interpret, scratch_types=scratch, compiler_params=params)
  def kernel(go_g, x_g, k_g, v_g, w_g, dot_g, gate_g, rx_g, rk_g, gx_g, gk_g, gv_g, gw_g, *, acc_s, go_s, v_s,
             sc_s, x_s, k_s, sums_s, go_bar, tok_bar, xk_bar, free, both):
    pid, wg = lax.axis_index("p"), lax.axis_index("wg")
    base = wg * half
    start = jnp.minimum(pid * per, t)
    count = jnp.minimum(start + per, t) - start  # tokens of this CTA (0 for an empty range)

    def cols(off):
      return pl.ds(base + off, cb)

    def issue_go(q, b):  # piece b (static) of token start + q
      @pl.when(q < count)
      def _():
        for j in range(m):
          plgpu.copy_gmem_to_smem(go_g.at[start + q, j, cols(offsets[b])], go_s.at[wg, j, pl.ds(offsets[b], cb)],
                                  go_bar.at[wg * nb + b], oob_mode=_IN_BOUNDS)

    def issue_tok(q):  # v's half row and the saved vectors of token start + q
      @pl.when(q < count)
      def _():
        i = start + q
        plgpu.copy_gmem_to_smem(v_g.at[i, pl.ds(base, half)], v_s.at[wg], tok_bar.at[wg], oob_mode=_IN_BOUNDS)
        for r, ref in enumerate((dot_g, gate_g, rx_g, rk_g)):
          plgpu.copy_gmem_to_smem(ref.at[i], sc_s.at[wg, r], tok_bar.at[wg], oob_mode=_IN_BOUNDS)

    def issue_xk(q, b):  # unit (token start + q, block b static) into slot (q·nb + b) % slots
      @pl.when(q < count)
      def _():
        slot = lax.rem(q * nb + b, slots)
        for j in range(m):
          for src, dst in ((x_g, x_s), (k_g, k_s)):
            plgpu.copy_gmem_to_smem(src.at[start + q, j, cols(offsets[b])], dst.at[wg, slot, j],
                                    xk_bar.at[wg * slots + slot], oob_mode=_IN_BOUNDS)

    for off in offsets:
      acc_s[:, cols(off)] = plgpu.layout_cast(jnp.zeros((m, cb), f32), b_rows)
    for b in range(nb):
      issue_go(jnp.int32(0), b)
    issue_tok(jnp.int32(0))
    for u in range(slots):
      issue_xk(jnp.int32(u // nb), u % nb)

    def token(q, w_next):
      i = start + q
      par = lax.rem(q, 2)
      for b in range(nb):
        plgpu.barrier_wait(go_bar.at[wg * nb + b])
      plgpu.barrier_wait(tok_bar.at[wg])
      go_half = load(go_s.at[wg], s_rows)
      v_half = load(v_s.at[wg], s_row)
      sums_s[par, wg] = 0.0 + jnp.sum(_f32(go_half) * _f32(v_half)[None, :], axis=1)
      raw, g, rx, rk = (load(sc_s.at[wg, r], b_per_stream) for r in range(4))
      plgpu.barrier_arrive(both)
      plgpu.barrier_wait(both)
      issue_tok(q + 1)  # every thread of this warpgroup read v_s[wg] and sc_s[wg] before arriving at `both`
      dldg = load(sums_s.at[par, 0], b_per_stream)
      for h in range(1, nw):
        dldg = dldg + load(sums_s.at[par, h], b_per_stream)
      big_g = _big_g(dldg, raw, g, rx, rk, d=d, clamp_value=clamp_value)[:, None]
      cx, ck = (raw * rx * rx * inv_d)[:, None], (raw * rk * rk * inv_d)[:, None]
      for b, off in enumerate(offsets):
        slot = lax.rem(q * nb + b, slots)
        plgpu.barrier_wait(xk_bar.at[wg * slots + slot])
        goc = _f32(load(go_s.at[wg, :, pl.ds(off, cb)]))
        xc, kc = _f32(load(x_s.at[wg, slot])), _f32(load(k_s.at[wg, slot]))
        # wf's next block (block 0 of the next token after the last) from GMEM (the caches), a block ahead
        wb, a = w_next, load(acc_s.at[:, cols(off)])
        w_next = load(w_g.at[:, cols(offsets[(b + 1) % nb])])
        plgpu.barrier_arrive(free.at[wg])  # this thread's reads of go's piece b and of the x / k slot are done
        gx_g[i, :, cols(off)] = (goc + big_g * (kc * wb - xc * cx)).astype(bf16)
        gk_g[i, :, cols(off)] = (big_g * (xc * wb - kc * ck)).astype(bf16)
        acc_s[:, cols(off)] = a + big_g * xc * kc
        gv_g[i, cols(off)] = jnp.sum(goc * g[:, None], axis=0).astype(bf16)  # m in order (fused_block)
        plgpu.barrier_wait(free.at[wg])  # every thread of the warpgroup is past its reads: refill
        ahead = b + slots
        issue_xk(q + ahead // nb, ahead % nb)
        issue_go(q + 1, b)
      return w_next

    lax.fori_loop(0, count, token, load(w_g.at[:, cols(0)]))
    for off in offsets:
      gw_g[pid, :, cols(off)] = load(acc_s.at[:, cols(off)])

  return kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k)


def gate_bwd_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, *, clamp_value, num_partials, interpret):
  """The backward (``T >= 1``) -> ``(grad_x, grad_k, grad_v, grad_w_partial (P, M, D) float32)``:
  :func:`gate_bwd_fused_kernel` where :func:`fused_applies`, else :func:`gate_bwd_ring_kernel` where
  :func:`onepass_applies`, else the two-pass kernels. On the benchmark grid (``M = 4``): fused at ``D`` = 2048,
  3072; the large-``D`` one-pass (ring) kernel at 4096, 6144; two passes at 2560 (8-byte vectors) and 7168 (halves
  of 3584 columns)."""
  d, m = x.shape[2], x.shape[1]
  if fused_applies(d, m):
    return gate_bwd_fused_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, clamp_value=clamp_value,
                                 num_partials=num_partials, interpret=interpret)
  # The large-D one-pass kernel rather than the two passes. H200, 2026-11-29, M=4, CUPTI, cold L2, median of 20, the
  # runner's check passed, every leaf against the reference below calc_diff 1e-8: T=8001 D=6144 two passes 637.82
  # µs, one pass with its rows loaded into registers 620.13 (628.97 with only the first column block's loads issued
  # early; TileKernels 566.43); T=8001 D=4096 two passes 429.92, one pass 396.25 (TileKernels 407.53); runner,
  # T=4001: D=6144 325.5 -> 308.5, D=4096 223.0 -> 211.0.
  # Its rows staged in SMEM by TMA (gate_bwd_ring_kernel) rather than loaded into registers: H200, 2026-11-30, CUPTI,
  # cold L2, every output bit-identical to the register kernel's: T=8001 D=6144 619-621 -> 553 µs; runner: T=8001
  # D=6144 551.6 µs (TileKernels 568), T=4001 D=6144 284.2 (292; registers 310.6), T=8001 D=4096 371.1 (registers
  # about 396), T=4001 D=4096 194.6 (about 211). With the partial in registers and wf in SMEM instead: 1091 µs at
  # T=8001 D=6144 (spills).
  if onepass_applies(d, m):
    return gate_bwd_ring_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, clamp_value=clamp_value,
                                num_partials=num_partials, interpret=interpret)
  factors = gate_bwd_rows_kernel(go, v, dot, gate, rstd_x, rstd_k, clamp_value=clamp_value, interpret=interpret)
  return gate_bwd_cols_kernel(go, x, k, wf, factors, num_partials=num_partials, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Public ops.

from jaxkern import _autodiff, _checks, _dispatch  # noqa: E402
from jaxkern.reference import engram as ref  # noqa: E402
from jaxkern.types import EngramGateGrads, EngramGateOutput  # noqa: E402

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
ADVICE = ("it is a building block of the gate; differentiate jaxkern.modeling.engram_gate, whose custom_vjp "
          "runs engram_gate_bwd and grad_w_reduce")


def check_gate_arrays(**arrays):
  """Shared checks of the gate's ``(T, M, D)`` / ``(T, D)`` / ``(M, D)`` / ``(T, M)`` arrays; returns them
  (in order) after :func:`jaxkern._checks.as_array`. The first one named must be ``(T, M, D)``."""
  out = {name: _checks.as_array(name, a) for name, a in arrays.items()}
  first = next(iter(out))
  x = out[first]
  _checks.check_rank(first, x, 3)
  _checks.check_dtype(first, x, FLOATS)
  t, m, d = x.shape
  want = {"hidden_states": (t, m, d), "k": (t, m, d), "grad_out": (t, m, d), "v": (t, d), "weight_fused": (m, d),
          "dot": (t, m), "gate_score": (t, m), "rstd_x": (t, m), "rstd_k": (t, m)}
  for name, a in out.items():
    _checks.check_dtype(name, a, FLOATS)
    _checks.check_shape(name, a, want[name], f" (from {first} {tuple(x.shape)})")
    if name in ("k", "v", "grad_out") and a.dtype != x.dtype:
      raise ValueError(f"{name} must have the dtype of {first} ({x.dtype}), got {a.dtype}")
  if d == 0 or m == 0:
    raise ValueError(f"{first} must have a non-empty hidden_size and hc_mult, got shape {tuple(x.shape)}")
  return tuple(out.values())




def engram_gate_fwd(hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_fused: jax.Array, *, eps: float,
                    clamp_value: float, save_for_backward: bool = True,
                    implementation: str | None = None) -> EngramGateOutput:
  """Engram gate forward (docs/engram.md, "Gate"): ``out = bf16(x + σ(signed_sqrt(d))·v)`` per (token, stream).

  With ``s = fp32(D^-1/2)``, ``rx = rsqrt(Σx²/D + eps)``, ``rk = rsqrt(Σk²/D + eps)``, ``raw = Σ x·wf·k``,
  ``d = raw·rx·rk·s``, ``signed_sqrt(d) = sign(d)·sqrt(max(|d|, clamp_value))``, everything in float32.

  Args:
    hidden_states: ``(T, M, D)`` bfloat16 (``M = hc_mult`` streams).
    k: ``(T, M, D)``, the dtype of ``hidden_states``.
    v: ``(T, D)``, shared by the ``M`` streams.
    weight_fused: ``(M, D)`` float32, :func:`jaxkern.engram.fused_weight` of the two RMSNorm weights.
    eps: RMSNorm epsilon (a float, taken as float32; upstream tests use 1e-20).
    clamp_value: the signed-sqrt clamp ``c`` (upstream default 1e-6).
    save_for_backward: also return ``dot`` (the *unscaled* ``raw``), ``gate_score``, ``rstd_x``,
      ``rstd_k``, float32 ``(T, M)``; otherwise those are None. ``output`` is bit-identical either way.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``EngramGateOutput(output, dot, gate_score, rstd_x, rstd_k)``; ``output`` has ``hidden_states``' dtype.

  Raises:
    ValueError (naming the argument): another rank or shape, non-floating dtypes, ``k`` / ``v`` of another
      dtype than ``hidden_states``, ``M = 0`` or ``D = 0``, a negative or non-finite ``eps`` / ``clamp_value``.

  XLA (the reference) instead of the kernel: ``T = 0``; under ``"auto"`` also dtypes other than bfloat16
  x / k / v with a float32 ``weight_fused`` (e.g. the float64 gradient checks) and ``D % 256 != 0``
  (``"pallas"`` raises :class:`jaxkern.KernelUnavailableError` for those).

  Numerics: float32 sums in another order than the reference's, ``rsqrt`` / ``sqrt`` / ``exp`` of the
  device; within ``calc_diff < 2e-10`` of it (the tests' tolerance). At ``d = ±0`` (``raw = ±0``, an ``rstd`` of 0 from an
  infinite ``Σx²`` or ``Σk²``, or a product ``raw·rx·rk·s`` that underflows) the kernel's
  ``copysign`` gives the gate ``σ(±sqrt(c))``, the reference's ``sign`` 0.5 (docs/engram.md, "Gate"). Other float
  dtypes run the reference in ``promote(dtype, float32)``. Where a (token, stream)'s sum reaches float32's range
  (``Σ|x·wf·k|`` of the finite terms at FLT_MAX or beyond; ``Σx²`` or ``Σk²`` within rounding of it), its result
  depends on the summation order: a partial sum may overflow in one order and not in the other, so ``dot`` may be
  NaN, ±inf or finite in kernel and reference (an H200 found NaN against inf, 2026-11-29), and that stream's
  ``dot``, ``gate_score`` and ``output`` (``rstd_x`` / ``rstd_k`` for their sums) are unspecified. Elsewhere
  non-finite inputs propagate alike (IEEE: a NaN or ±inf term gives the same sum in any order).

  Differentiation: none (a building block): differentiate :func:`jaxkern.modeling.engram_gate`;
  ``jax.grad`` through this op raises :class:`jaxkern.NotDifferentiableError`.
  """
  x, k, v, wf = check_gate_arrays(hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused)
  eps = _checks.check_float("eps", eps, nonnegative=True)
  clamp_value = _checks.check_float("clamp_value", clamp_value, nonnegative=True)
  x, k, v, wf = _autodiff.guard("engram_gate_fwd", ADVICE, x, k, v, wf)
  t, m, d = x.shape
  save = bool(save_for_backward)

  def kernel(interpret):
    outs = gate_fwd_kernel(x, k, v, wf, eps=eps, clamp_value=clamp_value, save=save,
                           interpret=_config.mosaic_interpret(interpret))
    return EngramGateOutput(*outs) if save else EngramGateOutput(outs[0], None, None, None, None)

  def reference():
    return ref.engram_gate_fwd(x, k, v, wf, eps=eps, clamp_value=clamp_value, save_for_backward=save)

  return _dispatch.run("engram_gate_fwd", implementation, kernel=kernel, xla=reference, empty=t == 0,
                       unsupported=unsupported(d, m, x.dtype, wf.dtype, backward=False))


def engram_gate_bwd(grad_out: jax.Array, hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_fused: jax.Array,
                    dot: jax.Array, gate_score: jax.Array, rstd_x: jax.Array, rstd_k: jax.Array, *, clamp_value: float,
                    num_partials: int | None = None, implementation: str | None = None) -> EngramGateGrads:
  """Engram gate backward (docs/engram.md, "Gate") from the forward's saved intermediates.

  Per (token, stream), float32: ``dldg = Σ go·v``; ``G = 0`` where ``|dot|·s·rx·rk < clamp_value`` (the
  clamp is active; also ``dot = 0``), else ``dldg·g(1-g)·0.5·sqrt(s·rx·rk/|dot|)``;
  ``grad_x = bf16(go + G(k·wf - x·dot·rx²/D))``, ``grad_k = bf16(G(x·wf - k·dot·rk²/D))``,
  ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order) and ``grad_w_partial[p] = Σ G·x⊙k`` over the tokens
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))`` (float32; zeros for empty ranges), reduced by
  :func:`jaxkern.engram.grad_w_reduce`.

  Args:
    grad_out: ``(T, M, D)``, the dtype of ``hidden_states`` (bfloat16 for the kernel).
    hidden_states, k, v, weight_fused: the forward's inputs (see :func:`engram_gate_fwd`).
    dot, gate_score, rstd_x, rstd_k: ``(T, M)`` float32, as saved by the forward (any consistent values).
    clamp_value: the forward's clamp.
    num_partials: ``P``, the rows of ``grad_w_partial``: the kernel's token chunks (docs/engram.md, "Gate": contiguous
      token ranges, any ``P``; :func:`jaxkern.engram.grad_w_reduce` sums any number of rows). A
      static int >= 1; default (``jaxkern.engram._gate.default_num_partials``, 132 SMs assumed when tracing
      off a GPU): for the one-pass kernels their persistent grid, at most ``T``: ``SMs·c`` for the fused one with
      ``c`` the CTAs per SM whose ``(M, D)`` float32 accumulators fit in shared memory (at most a small cap), e.g.
      264 at ``D = 2048``, and ``SMs`` for the large-``D`` one (``D`` = 4096, 6144); for the two-pass kernels
      ``max(1, min(8·SMs // (D / w), ceil(T / 16)))`` with the column block ``w`` (1024, or 512 / 256 where 1024
      does not divide ``D``), e.g. 150 at ``D = 7168`` (``T = 8001``).
    implementation: as :func:`engram_gate_fwd`.

  Returns:
    ``EngramGateGrads(grad_hidden_states, grad_k, grad_v, grad_w_partial)``: the first three in the input
    dtype, ``grad_w_partial`` ``(P, M, D)`` float32.

  Raises:
    ValueError (naming the argument): shapes or dtypes as :func:`engram_gate_fwd`, ``num_partials < 1``.

  XLA (the reference) instead of the kernel: ``T = 0`` (zero partials); under ``"auto"`` also other dtypes,
  ``D % 256 != 0`` and ``M > 8`` (``"pallas"`` raises :class:`jaxkern.KernelUnavailableError` for those).

  Kernels (module docstring): one pass (persistent CTAs over token ranges, the weight-gradient partial in
  shared memory; ``44·T·D`` bytes of traffic, every array once) for ``D`` up to 3072 in 16-byte vectors and
  ``M <= 4`` (whole rows per warpgroup), and for ``M = 4`` with ``D % 2048 == 0`` above that up to 6144 (two
  warpgroups per CTA, one half of every row each, the rows staged in shared memory by TMA copies: ``D`` = 4096,
  6144); else a row pass (``G`` per token and stream) and a column pass (everything else, the weight-gradient
  partial of each token chunk kept in registers; ``52·T·D`` bytes: ``go`` is read by both), e.g. at ``D`` = 2560,
  7168, 8192.

  Numerics: float32, other summation orders than the reference (within ``calc_diff < 1e-8``, the tests' tolerance);
  the weight-gradient partials are deterministic for a fixed ``P``.

  Differentiation: none (it is the backward); ``jax.grad`` through it raises
  :class:`jaxkern.NotDifferentiableError`.
  """
  go, x, k, v, wf, dot, gate, rx, rk = check_gate_arrays(
      grad_out=grad_out, hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused, dot=dot,
      gate_score=gate_score, rstd_x=rstd_x, rstd_k=rstd_k)
  clamp_value = _checks.check_float("clamp_value", clamp_value, nonnegative=True)
  t, m, d = x.shape
  p = default_num_partials(t, d, m) if num_partials is None else num_partials
  if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1:
    raise ValueError(f"num_partials must be an int >= 1, got {num_partials!r}")
  p = int(p)
  go, x, k, v, wf, dot, gate, rx, rk = _autodiff.guard("engram_gate_bwd", ADVICE, go, x, k, v, wf, dot, gate, rx, rk)
  bad = unsupported(d, m, x.dtype, wf.dtype, backward=True)
  if bad is None:
    bad = _unsupported_saved(dot=dot, gate_score=gate, rstd_x=rx, rstd_k=rk)

  def kernel(interpret):
    return EngramGateGrads(*gate_bwd_kernel(go, x, k, v, wf, dot, gate, rx, rk, clamp_value=clamp_value,
                                            num_partials=p, interpret=_config.mosaic_interpret(interpret)))

  def reference():
    return ref.engram_gate_bwd(go, x, k, v, wf, dot, gate, rx, rk, clamp_value=clamp_value, num_partials=p)

  return _dispatch.run("engram_gate_bwd", implementation, kernel=kernel, xla=reference, empty=t == 0,
                       unsupported=bad)
