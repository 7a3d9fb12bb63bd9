"""One Mosaic GPU kernel for ``multilayer_recompute`` (docs/mhc.md, "multilayer_recompute"): all layers of a layer group in one pass.

Each CTA (one warpgroup) owns a block of ``BT`` consecutive tokens and one hidden chunk of ``C`` columns of them;
it walks its tokens one after another and, for each, runs the whole layer loop with the token's residual chunk
``R_i`` (``M`` streams) in registers: it reads ``R_0`` once, then per layer reads only that layer's sublayer
output chunk and the token's mixes and writes the sublayer input chunk and ``R_{i+1}``. The bytes moved are
upstream's ``io_fused`` byte model; the layer-by-layer composition also reads every ``R_i`` twice.

* Layout: a chunk is a 1-D slice of ``C = 128·vec·k`` values in :func:`jaxkern._layouts.flat_layout` ``(vec)``
  (16-, 8-, 4- or 2-byte vectors, the widest that divides the row), ``C/128`` values per thread and stream;
  loads and stores go GMEM <-> registers directly (no TMA for the streams).
* Mixes: the ``L + 2·Lp`` per-layer mix arrays of the CTA's ``BT`` tokens are copied into SMEM by TMA
  (one barrier) when the CTA starts, then read as scalars per token and layer (where TMA can copy them: ``M = 4``
  and ``BT`` a multiple of 8), otherwise read straight from GMEM as scalars one layer ahead.
* Loads ahead: the sublayer output of layer ``l + D`` is loaded before layer ``l`` is computed
  (``Config.out_prefetch`` ``D``), and, when ``BT > 1``, the next token's ``R_0`` and first outputs during the
  last layer: the compiler keeps loads behind earlier stores (it cannot tell that the outputs do not alias the
  inputs), so the loads go out in program order.
* Layers are unrolled (each layer's arrays are separate operands); tokens are a loop.

Numerics (bit-identical to the composition, the contract of :mod:`jaxkern.mhc._stream_kernels`): the residual
kept in registers is the float32 value of the rounded bf16 residual that the composition stores and reads back;
every sum of products is explicit PTX with a rounding mode (:func:`pinned_sum`: ``fma.rn`` / ``mul.rn`` /
``add.rn``, which neither LLVM nor ptxas contracts or reorders), in the roundings that LLVM gives the per-layer
kernels' sums (``pre_apply_mix``: ``w0·x0 + w1·x1 + ...``; ``post``: ``post[n]·y`` then ``+ comb[m, n]·R_m`` for
``m = 0..M-1``): the first add fused with the product of its first operand, ``fma(w0, x0, w1·x1)``, then
``fma(w_k, x_k, acc)`` for each further term. Where the composition's ``pre_apply_mix`` is XLA code on a GPU
(``"auto"``: no contraction), ``contract_pre=False`` rounds every product and partial sum on its own, as XLA does
(``post`` is always the kernel where this kernel can run). In interpret mode XLA:CPU runs the body and the same
sums written as the per-layer kernels write them, and contracts them alike (``contract_pre`` must be True there).

Speed: measured on one H200 (2026-11-28, L = 10, Lp = 9, S = 8192 tokens, CUPTI, cold L2) only for the kernel as
it was before its sums were pinned to PTX, with 8 tokens per CTA: 685.5 µs at H = 2560, 1095.4 at 4096, 2178.8
at 8192 (TileKernels: 849.2, 1098.3, 2185.0), about 3620 GB/s of ``io_fused``, 84% of a device-to-device copy.
The kernel as it is (sums pinned, 32 tokens per CTA) and the Lp = 10 shapes have not been timed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import flat_layout


class Config(NamedTuple):
  """The kernel's tiling and prefetch choices (a static argument of :func:`recompute_kernel`)."""

  values_per_thread: int
  tokens_per_cta: int
  out_prefetch: int


# Tiling and prefetch, chosen on one H200 (2026-11-28, L = 10, Lp = 9, S = 8192 tokens, "auto", CUPTI, cold L2;
# the kernel before its sums were pinned to PTX, 8 tokens per CTA unless said): 8 values per thread and stream
# (16: 1210 µs against 1099 at H = 4096; 20, one CTA per 2560-wide row: 778 against 686 at H = 2560), 32 tokens per
# CTA (1083 µs against 1099 at H = 4096), sublayer outputs loaded two layers ahead with the next token's first loads
# issued during the last layer (neither: 1132 µs against 1099), mixes staged in SMEM (straight from GMEM: 1276 µs
# against 1099).
DEFAULT_CONFIG = Config(values_per_thread=8, tokens_per_cta=32, out_prefetch=2)


def current_config() -> Config:
  """The configuration the op runs (tests replace :data:`DEFAULT_CONFIG` to cover the other code paths)."""
  return DEFAULT_CONFIG


def _vec(h: int) -> int:
  for vec in (8, 4, 2, 1):
    if h % (128 * vec) == 0:
      return vec
  raise ValueError(f"hidden size {h} is not a multiple of 128")


def chunk_plan(h: int, values_per_thread: int) -> tuple[int, int]:
  """``(C, vec)``: the hidden chunk of one CTA and the vector width of its layout, for hidden size ``h`` (a
  multiple of 128): ``C = 128·vec·k`` with ``k`` the largest divisor of ``h / (128·vec)`` such that a thread holds
  at most ``values_per_thread`` values per stream (at least one vector)."""
  target = values_per_thread
  vec = _vec(h)
  reps = h // (128 * vec)
  k = max(d for d in range(1, reps + 1) if reps % d == 0 and (d == 1 or d * vec <= target))
  return 128 * vec * k, vec


# Lane semantics: explicit layouts (every array here has the layout of its load), no layout inference (which took
# ~90% of the lowering time of a 10-layer kernel, 30 s against 3 s on a CPU). No automatic barriers: no thread
# writes SMEM, and the TMA copies into it are issued once, before any read.
_PARAMS = plgpu.CompilerParams(unsafe_no_auto_barriers=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def _smem_mixes_fit(bt: int, mm: int) -> bool:
  """Whether TMA can copy the mixes of ``bt`` tokens: copies issued from Lane semantics move a multiple of 128
  bytes, TMA rows a multiple of 16 (``M = 4``: 8 tokens a block). Other blocks read their mixes from GMEM."""
  return (4 * mm) % 16 == 0 and (4 * mm * bt) % 128 == 0


def _f32(a):
  return a.astype(jnp.float32)


# Where a sum of products is pinned to explicit PTX (compiled kernels): the instructions with a rounding mode
# (``.rn``) are never contracted or reassociated by LLVM or ptxas, so the roundings do not depend on the schedule.
# Left to the compiler, the sums depended on the instruction order (H200, 2026-11-28: 276 of 16.4M outputs one bf16
# ulp off the composition, and a different schedule gave other bits); the likely cause: what LLVM leaves unfused
# (e.g. the "auto" path's pre-mix products behind an optimization barrier, an empty inline asm) it emits as
# contractable ``mul.f32`` / ``add.f32``, which ptxas may fuse into FMAs or not.
_MUL, _FMA, _ADD = (mgpu_fa.FragmentedArray._lift_fast_instr(op) for op in ("mul.rn.f32", "fma.rn.f32", "add.rn.f32"))
_SCALAR = plgpu.Layout.WG_SPLAT(shape=())


def pinned_sum(weights, values, layout, contracted):
  """``Σ_k weights[k]·values[k]`` in a compiled kernel (float32 scalars times float32 arrays in ``layout``),
  rounded exactly as the per-layer computation it stands for:

  * ``contracted`` (a Mosaic GPU kernel: LLVM contracts ``a·b + c·d`` into ``fma(a, b, c·d)``, the add's first
    operand fused, then every further ``acc + w·x`` into ``fma(w, x, acc)``):
    ``fma(w[K-1], x[K-1], ... fma(w[2], x[2], fma(w[0], x[0], w[1]·x[1])))``;
  * otherwise (XLA on a GPU: no contraction): ``((w[0]·x[0] + w[1]·x[1]) + w[2]·x[2]) + ...``, every product
    and sum rounded on its own.
  """
  k = len(values)
  out = plgpu.ShapeDtypeStruct(values[0].shape, jnp.float32, layout)

  @plgpu.inline_mgpu(arg_types=((_SCALAR,) * k, (layout,) * k), return_type=out)
  def body(_, w, x):
    if k == 1:
      return x[0]._pointwise(_MUL, w[0])
    if contracted:
      acc = x[0]._pointwise(_FMA, w[0], x[1]._pointwise(_MUL, w[1]))
      for j in range(2, k):
        acc = x[j]._pointwise(_FMA, w[j], acc)
      return acc
    acc = x[0]._pointwise(_MUL, w[0])
    for j in range(1, k):
      acc = acc._pointwise(_ADD, x[j]._pointwise(_MUL, w[j]))
    return acc

  return body(tuple(weights), tuple(values))


def interpreted_sum(weights, values):
  """The same sum in interpret mode, written as the per-layer kernels write it (XLA:CPU runs both and contracts
  both alike)."""
  acc = weights[0] * values[0]
  for w, x in zip(weights[1:], values[1:]):
    acc = acc + w * x
  return acc


@functools.partial(jax.jit, static_argnames=("contract_pre", "config", "interpret"))
def recompute_kernel(r0, pres, outs, posts, combs, *, contract_pre=True, config: Config, interpret=None):
  """``r0 (T, M, H)`` bf16 (``T >= 1``); lists of ``L`` pre mixes ``(T, M)``, ``Lp`` sublayer outputs ``(T, H)``
  bf16, post mixes ``(T, M)`` and comb mixes ``(T, M·M)`` (row ``m`` = input stream), float32 ->
  ``(L sublayer inputs (T, H), Lp residuals (T, M, H))`` bf16."""
  t, mm, h = r0.shape
  nl, np_ = len(pres), len(outs)
  c, vec = chunk_plan(h, config.values_per_thread)
  lay = flat_layout(vec)
  bt = max(1, min(config.tokens_per_cta, t))
  ahead = max(0, config.out_prefetch)
  if interpret is not None and not contract_pre:
    raise ValueError("interpret mode contracts like the interpreted per-layer kernels: contract_pre must be True")
  smem_mixes = _smem_mixes_fit(bt, mm)
  next_token = bt > 1
  out_type = ([jax.ShapeDtypeStruct((t, h), r0.dtype)] * nl + [jax.ShapeDtypeStruct((t, mm, h), r0.dtype)] * np_)
  scratch = {}
  if smem_mixes:
    scratch["pre_s"] = plgpu.SMEM((nl, bt, mm), jnp.float32)
    if np_:
      scratch["post_s"] = plgpu.SMEM((np_, bt, mm), jnp.float32)
      scratch["comb_s"] = plgpu.SMEM((np_, bt, mm * mm), jnp.float32)
    scratch["bar"] = plgpu.Barrier(num_arrivals=nl + 2 * np_)

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(h // c, pl.cdiv(t, bt)), grid_names=("c", "i"),
                     scratch_types=scratch, compiler_params=_PARAMS, interpret=interpret)
  def kernel(*refs, **smem):
    r_g, refs = refs[0], refs[1:]
    pre_g, refs = refs[:nl], refs[nl:]
    out_g, post_g, comb_g, refs = refs[:np_], refs[np_:2 * np_], refs[2 * np_:3 * np_], refs[3 * np_:]
    li_g, res_g = refs[:nl], refs[nl:]
    t0 = jnp.minimum(lax.axis_index("i") * bt, t - bt)
    cols = pl.ds(lax.axis_index("c") * c, c)

    if smem_mixes:
      toks = pl.ds(t0, bt)
      for layer in range(nl):
        plgpu.copy_gmem_to_smem(pre_g[layer].at[toks], smem["pre_s"].at[layer], smem["bar"])
      for layer in range(np_):
        plgpu.copy_gmem_to_smem(post_g[layer].at[toks], smem["post_s"].at[layer], smem["bar"])
        plgpu.copy_gmem_to_smem(comb_g[layer].at[toks], smem["comb_s"].at[layer], smem["bar"])
      plgpu.barrier_wait(smem["bar"])

    def mixes(layer, j, i):
      """The token's pre mix of ``layer`` and, below ``Lp``, its post and comb mixes (``comb[m][n]``)."""
      if smem_mixes:
        pre = [smem["pre_s"][layer, j, m] for m in range(mm)]
        if layer >= np_:
          return pre, None, None
        post = [smem["post_s"][layer, j, n] for n in range(mm)]
        comb = [[smem["comb_s"][layer, j, m * mm + n] for n in range(mm)] for m in range(mm)]
      else:
        pre = [pre_g[layer][i, m] for m in range(mm)]
        if layer >= np_:
          return pre, None, None
        post = [post_g[layer][i, n] for n in range(mm)]
        comb = [[comb_g[layer][i, m * mm + n] for n in range(mm)] for m in range(mm)]
      return pre, post, comb

    def dot(weights, values, contracted):
      """One of the per-layer ops' sums of mixes times float32 streams, rounded as that op rounds it."""
      if interpret is not None:
        return interpreted_sum(weights, values)
      return pinned_sum(weights, values, lay, contracted)

    def load_out(layer, i):
      return plgpu.load(out_g[layer].at[i, cols], layout=lay, optimized=False)

    def load_token(i):
      """The loads that start a token: its ``R_0`` chunk and the first sublayer outputs (bf16, in flight)."""
      return ([plgpu.load(r_g.at[i, m, cols], layout=lay, optimized=False) for m in range(mm)],
              {layer: load_out(layer, i) for layer in range(min(ahead, np_))})

    def token(j, loaded):
      i = t0 + j
      if loaded is None:
        loaded = load_token(i)
      r_bf, ys = loaded
      ys = dict(ys)
      nxt = None
      rs = [_f32(v) for v in r_bf]
      mix_next = None if smem_mixes else mixes(0, j, i)
      for layer in range(nl):
        if ahead and layer + ahead < np_:
          ys[layer + ahead] = load_out(layer + ahead, i)
        if next_token and layer == nl - 1:
          nxt = load_token(jnp.minimum(i + 1, t - 1))
        if smem_mixes:
          pre, post, comb = mixes(layer, j, i)
        else:
          pre, post, comb = mix_next
          if layer + 1 < nl:
            mix_next = mixes(layer + 1, j, i)
        # sublayer input: pre_apply_mix's sum
        li_g[layer][i, cols] = dot(pre, rs, contract_pre).astype(li_g[layer].dtype)
        if layer >= np_:
          continue
        # next residual: post's sums, rounded to bf16 (stored, and kept as float32 for the next layer)
        y = _f32(ys.pop(layer) if layer in ys else load_out(layer, i))
        new = []
        for n in range(mm):
          acc = dot([post[n]] + [comb[m][n] for m in range(mm)], [y] + rs, True)
          rounded = acc.astype(res_g[layer].dtype)
          res_g[layer][i, n, cols] = rounded
          new.append(rounded)
        rs = [_f32(v) for v in new]
      return nxt

    if next_token:
      lax.fori_loop(0, bt, token, load_token(t0))
    else:
      token(0, None)

  results = kernel(r0, *pres, *outs, *posts, *combs)
  return tuple(results[:nl]), tuple(results[nl:])
