"""``pre_norm_fn`` (docs/mhc.md, "pre_norm_fn"): the RMS-normalised skinny projection of the flattened mHC residual.

Kernels (Mosaic GPU, ``BT = 64`` tokens per tile, ``KB = 64`` columns per step):

* forward ``fwd_mul_kernel``: grid ``(ceil(T/64), S)``; CTA ``(i, s)`` reads its 64 residual rows over the
  ``K/S`` columns of split ``s`` once (TMA ring of ``(64, 64)`` bf16 tiles, 128-byte swizzle) and forms both
  the projection partial ``out_mul_s (64, J)`` and the partial ``sqrsum_s (64,)`` from the same tile:
  the tile is loaded into registers (WGMMA layout), squared and row-summed in float32 on the CUDA cores,
  and stored once more into a tiled SMEM buffer that feeds the tensor cores. The last tile starts at
  ``T - 64`` (it overlaps the previous one and rewrites identical values), so no read or write leaves the
  arrays; ``T < 64`` is padded with zero rows by XLA.
* backward ``bwd_mul_kernel``: grid ``(C, K/64)``; CTA ``(c, b)`` loops over the token tiles of chunk ``c``
  (2-slot TMA ring) for its 64 columns and produces both the residual gradient (written once, through SMEM
  and a TMA store) and the float32 partial ``fn`` gradient of the chunk (accumulated in a wgmma accumulator
  over all its tiles, stored once; the ``C`` partials are summed by XLA). ``C`` is chosen so that
  ``C · K/64`` fills the GPU (``C = 1`` for ``K >= 8448``).

Why bf16 wgmma and not tf32: the products are exact (``x`` is bf16, ``fn_r`` = ``tf32_rna(fn)`` has 11
significant bits). ``fn_r = hi + lo`` with ``hi`` = ``fn_r`` truncated to bf16 and ``lo = fn_r - hi`` is an exact
split into two bfloat16 values (``lo`` has at most 3 significant bits; :func:`split_bf16`, made with integer
bit operations because XLA:GPU removes an ``f32 -> bf16 -> f32`` round trip), so ``x·fn_r = x·hi + x·lo`` with both products exact
in the float32 accumulator: the same numbers as the TF32 MMA up to float32 summation order (what the tests'
1e-3 tolerance allows), while the residual tile stays bf16 in SMEM (no float32 conversion pass, half the SMEM
bytes of a tf32 operand, and bf16 wgmma runs at twice the tf32 rate). The backward's ``q = tf32(G·ρ)`` is
split the same way, so ``q·fn_r = q_hi·fn_hi + q_lo·fn_hi + q_hi·fn_lo + q_lo·fn_lo`` (two K = 64 wgmmas over
``[q_hi, q_lo, 0]`` and ``[fn_hi; fn_hi; 0]`` / ``[fn_lo; fn_lo; 0]``) and ``Σ_t q·x`` needs one wgmma with
``[q_hi, q_lo, 0]ᵀ`` (its row halves are added by XLA). J = 24 output columns are a legal wgmma N (multiple
of 8); no FMA formulation is needed.

Why the residual tile goes through registers before the wgmma: a tiled TMA copy needs the token dimension of
the whole GMEM array to be a multiple of 8 (upstream token counts are 4001, 13, ...), and the register-operand
form of wgmma does not run in GPU interpret mode; the swizzled-only TMA copy has no such constraint, and the
register pass is needed anyway for ``Σx²``.

Split-K: ``S`` = the largest divisor of ``K/64`` that is at most ``min(n_splits, ceil(2·SMs / ceil(T/64)))``;
the ``S`` partials are added in split order (``p_0 + p_1 + …``, fixed) and normalised by XLA:
``mixes = out_mul · rsqrt(sqrsum / K + eps)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BT = 64  # tokens per tile (one wgmma M)
KB = 64  # residual columns per step (128 bytes of bf16: one swizzle span)
JP = 64  # padded rows of the backward's [q_hi, q_lo, 0] operands
STAGES = 4
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
SWIZZLED = (plgpu.SwizzleTransform(128),)
WG = plgpu.Layout.WGMMA




def split_bf16(v):
  """float32 ``v`` (TF32-representable) -> ``(hi, lo)`` bfloat16 with ``hi + lo == v`` exactly.

  ``hi`` is ``v`` truncated to bfloat16 by clearing the low 16 bits (integer ops), ``lo = v - hi`` the
  remaining (at most 3) significant bits of the TF32 value; both float32 -> bfloat16 conversions are exact.

  Fixed bug (wrong forward on the H100, 2026-11-26): this was ``hi = bf16(v)``,
  ``lo = bf16(v - f32(hi))``. XLA:GPU (``xla_allow_excess_precision``, on by default) removes the
  ``f32 -> bf16 -> f32`` round trip inside one jit (openxla/xla#41605; XLA:CPU keeps it), so on the GPU
  ``lo`` was ``bf16(v - v) = 0`` and the kernels multiplied by ``bf16(fn_r)`` alone: relative errors up to
  2^-9 per product, about 1e-3 of the mixes, beyond the forward's 1e-3 check but inside the backward's
  2e-2 (so only the forward benchmark failed). Interpret mode on CPU could not show it. The split is
  now made with integer bit operations, which no floating-point simplification can remove.
  """
  v = jnp.asarray(v, jnp.float32)
  hi32 = lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
  return hi32.astype(jnp.bfloat16), (v - hi32).astype(jnp.bfloat16)


def num_splits(t: int, k: int, n_splits: int, sms: int) -> int:
  """``S`` of the forward (see the module docstring)."""
  steps = k // KB
  want = max(1, min(n_splits, -(-2 * sms // -(-t // BT))))
  return max(d for d in range(1, min(want, steps) + 1) if steps % d == 0)


def num_chunks(t: int, k: int, sms: int) -> int:
  """``C`` of the backward: token chunks so that ``C · K/64`` CTAs fill ``sms`` SMs (at most the tiles)."""
  return max(1, min(-(-t // BT), -(-sms // (k // KB))))


@functools.partial(jax.jit, static_argnames=("splits", "interpret"))
def fwd_mul_kernel(x, fhi, flo, *, splits, interpret):
  """``x (T, K)`` bf16 (``T >= 64``), ``fhi``, ``flo`` ``(J, K)`` bf16 -> partials ``(S, T, J)``, ``(S, T)`` float32."""
  t, k = x.shape
  j = fhi.shape[0]
  nt = pl.cdiv(t, BT)
  ks = k // splits
  steps = ks // KB

  @functools.partial(
      plgpu.kernel,
      out_type=(jax.ShapeDtypeStruct((splits, t, j), jnp.float32), jax.ShapeDtypeStruct((splits, t), jnp.float32)),
      grid=(splits, nt),
      grid_names=("s", "t"),
      scratch_types=(plgpu.SMEM((BT, KB), jnp.bfloat16, transforms=TILED),),
      interpret=interpret,
  )
  def kernel(x_g, hi_g, lo_g, o_g, sq_g, xt_s):
    i, s = lax.axis_index("t"), lax.axis_index("s")
    t0 = jnp.minimum(i * BT, t - BT)
    cols = pl.ds(s * ks, ks)

    def scope(acc):
      def body(_, x_s, hi_s, lo_s, sq):
        xr = plgpu.load(x_s, layout=WG, optimized=False)
        xt_s[...] = xr
        plgpu.commit_smem()
        plgpu.wgmma(acc, xt_s, hi_s.T)
        plgpu.wgmma(acc, xt_s, lo_s.T)
        v = xr.astype(jnp.float32)
        sq = sq + jnp.sum(v * v, axis=1)
        plgpu.wgmma_wait(0)
        return sq

      sq = plgpu.emit_pipeline(
          body, grid=(steps,), max_concurrent_steps=min(STAGES, steps),
          in_specs=[plgpu.BlockSpec((BT, KB), lambda kk: (0, kk), transforms=SWIZZLED),
                    plgpu.BlockSpec((j, KB), lambda kk: (0, kk), transforms=TILED),
                    plgpu.BlockSpec((j, KB), lambda kk: (0, kk), transforms=TILED)],
          init_carry=plgpu.layout_cast(jnp.zeros((BT,), jnp.float32), WG.reduce(1)),
      )(x_g.at[pl.ds(t0, BT), cols], hi_g.at[:, cols], lo_g.at[:, cols])
      return acc[...], sq

    out, sq = pl.run_scoped(scope, plgpu.ACC((BT, j), jnp.float32))
    o_g[s, pl.ds(t0, BT), :] = out
    sq_g[s, pl.ds(t0, BT)] = sq

  return kernel(x, fhi, flo)


@functools.partial(jax.jit, static_argnames=("chunks", "interpret"))
def bwd_mul_kernel(x, qx, sqg2, fb1, fb2, *, chunks, interpret):
  """The backward GEMMs.

  Args: ``x (T, K)`` bf16 (``T >= 64``); ``qx (nt·64, 64)`` bf16: per tile ``i`` the rows
  ``[start_i, start_i + 64)`` of ``[q_hi, q_lo, 0]`` (``start_i = min(64 i, T - 64)``); ``sqg2 (nt·64,)``
  float32: ``2·sqrsum_grad`` gathered the same way; ``fb1``, ``fb2`` ``(64, K)`` bf16:
  ``[fn_hi; fn_hi; 0]``, ``[fn_lo; fn_lo; 0]``.

  Returns: ``grad_x (T, K)`` bf16 and the partial ``(C, 64, K)`` float32 of ``[q_hi, q_lo, 0]ᵀ @ x``.
  """
  t, k = x.shape
  nt = pl.cdiv(t, BT)
  per = -(-nt // chunks)
  nb = k // KB

  @functools.partial(
      plgpu.kernel,
      out_type=(jax.ShapeDtypeStruct((t, k), jnp.bfloat16), jax.ShapeDtypeStruct((chunks, JP, k), jnp.float32)),
      grid=(chunks, nb),
      grid_names=("c", "b"),
      scratch_types=dict(
          x_s=plgpu.SMEM((2, BT, KB), jnp.bfloat16, transforms=SWIZZLED),
          q_s=plgpu.SMEM((2, BT, JP), jnp.bfloat16, transforms=TILED),
          f1_s=plgpu.SMEM((JP, KB), jnp.bfloat16, transforms=TILED),
          f2_s=plgpu.SMEM((JP, KB), jnp.bfloat16, transforms=TILED),
          xt_s=plgpu.SMEM((BT, KB), jnp.bfloat16, transforms=TILED),
          qm_s=plgpu.SMEM((BT, JP), jnp.bfloat16, transforms=TILED),
          o_s=plgpu.SMEM((2, BT, KB), jnp.bfloat16, transforms=SWIZZLED),
          bar=plgpu.Barrier(num_arrivals=2, num_barriers=2),
          fbar=plgpu.Barrier(num_arrivals=2),
      ),
      interpret=interpret,
  )
  def kernel(x_g, q_g, sqg_g, f1_g, f2_g, xg_g, fg_g, x_s, q_s, f1_s, f2_s, xt_s, qm_s, o_s, bar, fbar):
    c, b = lax.axis_index("c"), lax.axis_index("b")
    cols = pl.ds(b * KB, KB)
    first = jnp.minimum(c * per, nt)
    count = jnp.minimum((c + 1) * per, nt) - first

    def start(g):
      return jnp.minimum(g * BT, t - BT)

    def fetch(n):
      @pl.when(n < count)
      def _():
        g = first + n
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(start(g), BT), cols], x_s.at[n % 2], bar.at[n % 2])
        plgpu.copy_gmem_to_smem(q_g.at[pl.ds(g * BT, BT)], q_s.at[n % 2], bar.at[n % 2])

    plgpu.copy_gmem_to_smem(f1_g.at[:, cols], f1_s, fbar)
    plgpu.copy_gmem_to_smem(f2_g.at[:, cols], f2_s, fbar)
    fetch(0)
    fetch(1)
    plgpu.barrier_wait(fbar)

    def fn_scope(acc_fg):
      def body(n, carry):
        g = first + n
        slot = n % 2
        plgpu.barrier_wait(bar.at[slot])
        xr = plgpu.load(x_s.at[slot], layout=WG, optimized=False)
        sqg = plgpu.load(sqg_g.at[pl.ds(g * BT, BT)], layout=WG.reduce(1), optimized=False)

        def xg_scope(acc):
          plgpu.wgmma(acc, q_s.at[slot], f1_s)
          plgpu.wgmma(acc, q_s.at[slot], f2_s)
          return acc[...]

        xg = pl.run_scoped(xg_scope, plgpu.ACC((BT, KB), jnp.float32))
        xg = xg + xr.astype(jnp.float32) * lax.broadcast_in_dim(sqg, (BT, KB), (0,))
        # fn gradient: rows that an earlier tile already covered (the overlapping last tile) count once.
        qr = plgpu.load(q_s.at[slot], layout=WG, optimized=False)
        row = plgpu.broadcasted_iota(jnp.int32, (BT, JP), 0, layout=WG) + start(g)
        qm_s[...] = jnp.where(row >= g * BT, qr, jnp.zeros_like(qr))
        xt_s[...] = xr
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store of tile n - 2 has read o_s[slot]
        o_s.at[slot][...] = xg.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.wgmma(acc_fg, qm_s.T, xt_s)
        plgpu.copy_smem_to_gmem(o_s.at[slot], xg_g.at[pl.ds(start(g), BT), cols])
        plgpu.wgmma_wait(0)
        fetch(n + 2)
        return carry

      lax.fori_loop(0, count, body, None)
      return acc_fg[...]

    fg = pl.run_scoped(fn_scope, plgpu.ACC((JP, KB), jnp.float32))
    fg_g[c, :, cols] = fg
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel(x, qx, sqg2, fb1, fb2)


# ----------------------------------------------------------------------------------------------
# Public ops.

from jaxkern import _autodiff, _checks, _config, _dispatch  # noqa: E402
from jaxkern.reference import mhc_norm as ref  # noqa: E402
from jaxkern.types import PreNormFnFwd, PreNormFnGrads  # noqa: E402

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
SUPPORTED_MHC_MULT = (4,)
ADVICE = ("it is a building block of pre_norm_fn; differentiate jaxkern.mhc.pre_norm_fn, whose custom_vjp "
          "runs pre_norm_fn_bwd")


def round_to_tf32(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """``tf32_rna(x) = bitcast_f32((bitcast_u32(x) + 0x1000) & 0xFFFFE000)`` (docs/mhc.md, "pre_norm_fn"), elementwise.

  Round to nearest TF32 (10 explicit mantissa bits), ties away from zero, with the low 13 bits cleared
  (upstream leaves them set; the tensor cores ignore them). float32 only is rounded; other dtypes come back
  unchanged (the float64 gradient checks use the exact math). Values that round past FLT_MAX become ±inf
  (out of contract, docs/mhc.md, "pre_norm_fn"). An XLA elementwise op (no kernel). Not differentiable in a useful sense
  (zero derivative almost everywhere, as written in ``jnp``).
  """
  x = _checks.as_array("x", x)
  _checks.check_dtype("x", x, FLOATS)
  del implementation
  return ref.round_to_tf32(x)


def fn_normw_merge(fn: jax.Array, normw: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """``fn * normw`` (docs/mhc.md, "pre_norm_fn"): ``fn (J, K)`` float32 times the RMSNorm weight ``normw (K,)`` on every row.

  Plain ``jnp`` (docs/mhc.md, "pre_norm_fn"): autodiff gives upstream's backward ``grad_fn = g·normw``,
  ``grad_normw = Σ_j g·fn``. Raises ValueError (naming the argument) for other ranks or a length mismatch.
  ``implementation`` is accepted for the common signature; every choice runs the same ``jnp`` product.
  """
  del implementation
  fn = _checks.as_array("fn", fn)
  normw = _checks.as_array("normw", normw)
  _checks.check_rank("fn", fn, 2)
  _checks.check_rank("normw", normw, 1)
  _checks.check_dtype("fn", fn, FLOATS)
  _checks.check_dtype("normw", normw, FLOATS)
  if normw.shape[0] != fn.shape[1]:
    raise ValueError(f"normw must have shape ({fn.shape[1]},) (fn's K), got {tuple(normw.shape)}")
  return ref.fn_normw_merge(fn, normw)


def _check_splits(n_splits):
  if not isinstance(n_splits, (int, np.integer)) or isinstance(n_splits, bool) or n_splits < 1:
    raise ValueError(f"n_splits must be an int >= 1, got {n_splits!r}")
  return int(n_splits)


def _check_residual_fn(residual, fn):
  residual = _checks.as_array("residual", residual)
  fn = _checks.as_array("fn", fn)
  if residual.ndim < 2:
    raise ValueError(f"residual must have shape [*, mhc_mult, hidden], got {tuple(residual.shape)}")
  _checks.check_dtype("residual", residual, FLOATS)
  _checks.check_dtype("fn", fn, FLOATS)
  m, h = residual.shape[-2:]
  if m not in SUPPORTED_MHC_MULT:
    raise ValueError(f"residual: mhc_mult (residual.shape[-2]) must be one of {SUPPORTED_MHC_MULT} "
                     f"(J = mhc_mult·(mhc_mult+2) = 24 mixes), got shape {tuple(residual.shape)}")
  if h == 0:
    raise ValueError(f"residual must have a non-empty hidden size, got shape {tuple(residual.shape)}")
  j = m * (m + 2)
  _checks.check_shape("fn", fn, (j, m * h), " = (mhc_mult·(mhc_mult+2), mhc_mult·hidden)")
  return residual, fn


def _unsupported(residual, fn) -> str | None:
  k = fn.shape[1]
  if residual.dtype != jnp.bfloat16:
    return f"the kernels take a bfloat16 residual, got {residual.dtype.name}"
  if fn.dtype != jnp.float32:
    return f"the kernels take a float32 fn, got {fn.dtype.name}"
  if k % 256:
    return f"K = mhc_mult·hidden = {k} is not a multiple of 256 (hidden % 64 != 0)"
  return None


def _pad_rows(a, rows):
  return a if a.shape[0] >= rows else jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def _fwd_kernel(r2, fn, *, norm_eps, n_splits, interpret):
  t, k = r2.shape
  fn_r = ref.round_to_tf32(fn)
  fhi, flo = split_bf16(fn_r)
  xp = _pad_rows(r2, BT)
  s = num_splits(t, k, n_splits, _config.num_sms())
  om_p, sq_p = fwd_mul_kernel(xp, fhi, flo, splits=s, interpret=_config.mosaic_interpret(interpret))
  om, sq = om_p[0, :t], sq_p[0, :t]
  for i in range(1, s):  # fixed split order
    om, sq = om + om_p[i, :t], sq + sq_p[i, :t]
  mixes = om * lax.rsqrt(sq / k + jnp.float32(norm_eps))[:, None]
  return mixes, om, sq


def _bwd_kernel(g, r2, fn, out_mul, sqrsum, *, norm_eps, interpret):
  t, k = r2.shape
  j = fn.shape[0]
  eps = jnp.float32(norm_eps)
  rho = lax.rsqrt(sqrsum / k + eps)
  q = ref.round_to_tf32(g * rho[:, None])
  rho_grad = jnp.sum(g * out_mul, axis=-1)
  sqg2 = 2 * (rho_grad * rho / (sqrsum + eps * k) / -2)
  q_hi, q_lo = split_bf16(q)
  qcat = jnp.concatenate([q_hi, q_lo, jnp.zeros((t, JP - 2 * j), jnp.bfloat16)], axis=1)
  fn_hi, fn_lo = split_bf16(ref.round_to_tf32(fn))
  zero = jnp.zeros((JP - 2 * j, k), jnp.bfloat16)
  fb1 = jnp.concatenate([fn_hi, fn_hi, zero])
  fb2 = jnp.concatenate([fn_lo, fn_lo, zero])
  xp = _pad_rows(r2, BT)
  tp = xp.shape[0]
  nt = -(-tp // BT)
  if tp % BT:  # the last tile starts at tp - 64
    tail = jnp.arange(tp - BT, tp)
    qx = jnp.concatenate([qcat[: (nt - 1) * BT], qcat[tail]])
    sg = jnp.concatenate([sqg2[: (nt - 1) * BT], sqg2[tail]])
  else:
    qx = _pad_rows(qcat, tp)
    sg = _pad_rows(sqg2, tp)
  chunks = num_chunks(tp, k, _config.num_sms())
  xg, fgp = bwd_mul_kernel(xp, qx, sg, fb1, fb2, chunks=chunks, interpret=_config.mosaic_interpret(interpret))
  fgp = jnp.sum(fgp, axis=0)
  return xg[:t], fgp[:j] + fgp[j:2 * j]


def pre_norm_fn_fwd(residual: jax.Array, fn: jax.Array, *, norm_eps: float = 1e-6, n_splits: int = 16,
                    implementation: str | None = None) -> PreNormFnFwd:
  """The forward of :func:`pre_norm_fn` with the sums its backward needs (docs/mhc.md, "pre_norm_fn").

  Per token, ``r = vec(residual[t])`` (stream-major, ``K = M·H``), ``fn_r = round_to_tf32(fn)``:
  ``out_mul = r @ fn_rᵀ`` (exact products, float32 accumulation), ``sqrsum = Σ r²`` (float32),
  ``mixes = out_mul · rsqrt(sqrsum / K + norm_eps)``.

  Args:
    residual: ``[*, M, H]`` bfloat16 (``M = mhc_mult = 4``; any leading dims, including zero-size ones).
    fn: ``(J, M·H)`` float32, ``J = M(M+2) = 24``: the merged weight (:func:`fn_normw_merge` already applied);
      rounded to TF32 here (idempotent).
    norm_eps: RMS epsilon (float32).
    n_splits: upper bound on the forward's K splits (a performance knob; module docstring of
      ``jaxkern.mhc._norm_fn``).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``PreNormFnFwd(mixes [*, J], out_mul [*, J], sqrsum [*])``, float32 (``promote(dtype, float32)`` on the
    reference path).

  Raises:
    ValueError (naming the argument): ``mhc_mult`` other than 4, ``fn`` not ``(24, 4·H)``, non-float dtypes,
      ``norm_eps`` negative or not finite, ``n_splits < 1``.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also a residual other than
  bfloat16 or an ``fn`` other than float32, and ``K % 256 != 0`` (``"pallas"`` raises
  :class:`jaxkern.KernelUnavailableError`). The split partials' sum and the normalisation are XLA code.

  Numerics: equal to the reference up to float32 summation order (the tests' tolerance ``atol = rtol = 1e-3``).

  Non-finite values: a token whose residual holds ±inf or NaN, or whose products or sums overflow float32, gets
  non-finite ``out_mul`` and ``mixes`` in kernel and reference alike, NaN or ±inf, not always the same in both (the
  kernels' exact split ``fn_r = hi + lo`` multiplies an infinity by a zero ``lo``, giving NaN where the reference
  has ±inf, and sums of infinities differ in order). Under ``checkify.checkify(f,
  errors=checkify.user_checks)`` the first non-finite ``mixes`` entry is reported (docs/usage.md, "Bad values under
  jit").

  Differentiation: none (building block); ``jax.grad`` raises :class:`jaxkern.NotDifferentiableError`.
  """
  residual, fn = _check_residual_fn(residual, fn)
  eps = _checks.check_float("norm_eps", norm_eps, nonnegative=True)
  n_splits = _check_splits(n_splits)
  residual, fn = _autodiff.guard("pre_norm_fn_fwd", ADVICE, residual, fn)
  return _fwd(residual, fn, eps, n_splits, implementation)


def _fwd(residual, fn, eps, n_splits, implementation) -> PreNormFnFwd:
  j, k = fn.shape
  lead = residual.shape[:-2]
  t = int(np.prod(lead, dtype=np.int64))

  def kernel(interpret):
    mixes, om, sq = _fwd_kernel(residual.reshape(t, k), fn, norm_eps=eps, n_splits=n_splits, interpret=interpret)
    return PreNormFnFwd(mixes.reshape(*lead, j), om.reshape(*lead, j), sq.reshape(lead))

  def reference():
    return ref.pre_norm_fn_fwd(residual, fn, norm_eps=eps)

  out = _dispatch.run("pre_norm_fn_fwd", implementation, kernel=kernel, xla=reference, empty=t == 0,
                      unsupported=_unsupported(residual, fn))
  _checks.debug_check_entries("pre_norm_fn", "mixes", out.mixes, lambda v: ~jnp.isfinite(v),
                              "finite (a residual element not finite, or r @ fn_rᵀ or Σ r² overflowing float32)")
  return out


def pre_norm_fn_bwd(grad_mixes: jax.Array, residual: jax.Array, fn: jax.Array, out_mul: jax.Array, sqrsum: jax.Array, *,
                    norm_eps: float = 1e-6, implementation: str | None = None) -> PreNormFnGrads:
  """The backward of :func:`pre_norm_fn` (docs/mhc.md, "pre_norm_fn") from :func:`pre_norm_fn_fwd`'s sums.

  Per token (float32): ``ρ = rsqrt(sqrsum/K + eps)``, ``q = round_to_tf32(G·ρ)``,
  ``sqrsum_grad = (Σ_j G·out_mul)·ρ / (sqrsum + eps·K) / (-2)``;
  ``grad_residual = bf16(q @ fn_r + 2·r·sqrsum_grad)``, ``grad_fn = Σ_t qᵀ r`` (float32, w.r.t. the merged
  weight: the rounding passes the gradient unchanged).

  Args:
    grad_mixes: ``[*, J]`` float32 cotangent of ``mixes``.
    residual, fn: the forward's inputs (see :func:`pre_norm_fn_fwd`).
    out_mul: ``[*, J]``, sqrsum: ``[*]``: as returned by :func:`pre_norm_fn_fwd`.
    norm_eps: the forward's epsilon.
    implementation: as :func:`pre_norm_fn_fwd`.

  Returns:
    ``PreNormFnGrads(grad_residual, grad_fn)``: the residual's shape and dtype, ``(J, K)`` in ``fn``'s dtype.
    Upstream adds ``grad_residual`` into an existing bf16 buffer (``fuse_grad_acc``); here it is returned and
    JAX adds cotangents (docs/modeling.md, "mHC layers").

  Raises:
    ValueError (naming the argument): as :func:`pre_norm_fn_fwd`, or ``grad_mixes`` / ``out_mul`` /
      ``sqrsum`` of the wrong shape.

  XLA (the reference) instead of the kernel: as :func:`pre_norm_fn_fwd`. The per-token scalars (``ρ``, ``q``,
  ``sqrsum_grad``, the hi/lo operand split) and the sum of the ``C`` partial ``fn`` gradients are XLA code;
  both GEMMs, the norm term and the residual-gradient store are one kernel.

  Numerics: products exact (TF32-rounded ``q`` and ``fn``), float32 accumulation in another order than the
  reference; deterministic for a fixed device.

  Differentiation: none (it is the backward).
  """
  residual, fn = _check_residual_fn(residual, fn)
  eps = _checks.check_float("norm_eps", norm_eps, nonnegative=True)
  j = fn.shape[0]
  lead = residual.shape[:-2]
  g = _checks.as_array("grad_mixes", grad_mixes)
  out_mul = _checks.as_array("out_mul", out_mul)
  sqrsum = _checks.as_array("sqrsum", sqrsum)
  for name, a, shape in (("grad_mixes", g, (*lead, j)), ("out_mul", out_mul, (*lead, j)), ("sqrsum", sqrsum, lead)):
    _checks.check_dtype(name, a, FLOATS)
    _checks.check_shape(name, a, shape)
  g, residual, fn, out_mul, sqrsum = _autodiff.guard("pre_norm_fn_bwd", ADVICE, g, residual, fn, out_mul, sqrsum)
  return _bwd(g, residual, fn, out_mul, sqrsum, eps, implementation)


def _bwd(g, residual, fn, out_mul, sqrsum, eps, implementation) -> PreNormFnGrads:
  j, k = fn.shape
  lead = residual.shape[:-2]
  t = int(np.prod(lead, dtype=np.int64))
  bad = _unsupported(residual, fn)

  def kernel(interpret):
    f32 = jnp.float32
    xg, fg = _bwd_kernel(g.reshape(t, j).astype(f32), residual.reshape(t, k), fn, out_mul.reshape(t, j).astype(f32),
                         sqrsum.reshape(t).astype(f32), norm_eps=eps, interpret=interpret)
    return PreNormFnGrads(xg.reshape(residual.shape), fg)

  def reference():
    return ref.pre_norm_fn_bwd(g, residual, fn, out_mul, sqrsum, norm_eps=eps)

  return _dispatch.run("pre_norm_fn_bwd", implementation, kernel=kernel, xla=reference, empty=t == 0,
                       unsupported=bad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _pre_norm_fn(residual, fn, eps, n_splits, implementation):
  return _fwd(residual, fn, eps, n_splits, implementation).mixes


def _pre_norm_fn_vjp_fwd(residual, fn, eps, n_splits, implementation):
  out = _fwd(residual, fn, eps, n_splits, implementation)
  return out.mixes, (residual, fn, out.out_mul, out.sqrsum)


def _pre_norm_fn_vjp_bwd(eps, n_splits, implementation, res, g):
  del n_splits
  residual, fn, out_mul, sqrsum = res
  grads = _bwd(g, residual, fn, out_mul, sqrsum, eps, implementation)
  return grads.grad_residual.astype(residual.dtype), grads.grad_fn.astype(fn.dtype)


_pre_norm_fn.defvjp(_pre_norm_fn_vjp_fwd, _pre_norm_fn_vjp_bwd)


def pre_norm_fn(residual: jax.Array, fn: jax.Array, norm_weight: jax.Array | None = None, *, norm_eps: float = 1e-6,
                fuse_grad_acc: bool = True, n_splits: int = 16, implementation: str | None = None) -> jax.Array:
  """The mHC mixing logits: ``RMSNorm(vec(R); norm_weight) @ fnᵀ`` per token (docs/mhc.md, "pre_norm_fn"), differentiable.

  ``fn_eff = fn * norm_weight`` (:func:`fn_normw_merge`, if given), ``fn_r = round_to_tf32(fn_eff)``;
  per token ``mixes = (r @ fn_rᵀ) · rsqrt(Σr²/K + norm_eps)`` with ``r = vec(residual[t])`` (stream-major).

  Args:
    residual: ``[*, M, H]`` bfloat16 residual streams (``M = mhc_mult = 4``; any leading dims). Other float
      dtypes run the reference (e.g. float64 for gradient checks).
    fn: ``(J, M·H)`` float32, ``J = M(M+2) = 24``.
    norm_weight: optional ``(M·H,)`` float32 RMSNorm weight, merged into ``fn`` (autodiff of the product gives
      upstream's M2 backward).
    norm_eps: RMS epsilon (upstream default 1e-6).
    fuse_grad_acc: accepted for upstream compatibility; no effect (JAX adds the residual's cotangents
      functionally; docs/modeling.md, "mHC layers").
    n_splits: upper bound on the forward's K splits (performance only).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``; used by
      the forward and the backward.

  Returns:
    ``[*, J]`` float32 (``promote(dtype, float32)`` on the reference path).

  Raises:
    ValueError (naming the argument): ``mhc_mult`` other than 4, ``fn`` not ``(24, 4·H)``, ``norm_weight`` not
      ``(4·H,)``, non-float dtypes, a negative or non-finite ``norm_eps``, ``n_splits < 1``.

  XLA instead of kernels: see :func:`pre_norm_fn_fwd` / :func:`pre_norm_fn_bwd`.

  Numerics: the tests' tolerances: mixes ``atol = rtol = 1e-3``; residual gradient bf16 (``rtol 1.6e-2``); fn
  gradient ``atol 3e-2, rtol 1e-3``.

  Non-finite values: as :func:`pre_norm_fn_fwd` (non-finite mixes, NaN or ±inf, not always the same in kernel and
  reference; reported under checkify); such a token's gradients are non-finite too.

  Differentiation: ``jax.custom_vjp``; residuals ``residual, fn_eff, out_mul, sqrsum``; backward
  :func:`pre_norm_fn_bwd` (kernels), then the product rule of the merge. Cotangents come back in the
  inputs' dtypes; ``norm_eps`` and ``n_splits`` have none.
  """
  del fuse_grad_acc
  residual, fn = _check_residual_fn(residual, fn)
  eps = _checks.check_float("norm_eps", norm_eps, nonnegative=True)
  n_splits = _check_splits(n_splits)
  if norm_weight is not None:
    norm_weight = _checks.as_array("norm_weight", norm_weight)
    _checks.check_dtype("norm_weight", norm_weight, FLOATS)
    _checks.check_shape("norm_weight", norm_weight, (fn.shape[1],))
    fn = ref.fn_normw_merge(fn, norm_weight)
  implementation = _config.get_implementation(implementation)
  residual, fn = _autodiff.vary_like(residual, fn)  # sharded residual, replicated fn: one vma type
  return _pre_norm_fn(residual, fn, eps, n_splits, implementation)
