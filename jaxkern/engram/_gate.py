"""Engram gate forward and backward (engram_mhc.md §3.4, §3.5): Mosaic GPU kernels.

The forward and the backward's row pass move each hidden row straight GMEM -> registers -> GMEM in 16-byte vectors
(:func:`jaxkern._layouts.flat_layout`: one ``D``-row spread over the warpgroup's 128 threads, a warp
reading contiguous 512-byte segments; ``D = 2560`` runs a 2048-column chunk of 16-byte vectors and a
512-column chunk of 8-byte ones, :func:`jaxkern._layouts.flat_chunks`). All arithmetic is float32;
row reductions are per-thread vector sums, then warp shuffles and an SMEM step across the 4 warps.

* Forward: one token per CTA (grid ``T``; the rows of all ``M`` streams loaded up front where
  ``M·D <= PRELOAD_MAX_VALUES``), its ``M`` streams one after the other: ``Σx²``, ``Σk²``
  and ``Σx·wf·k`` of the row, the gate as scalars, then ``out = bf16(x + g·v)`` from the registers
  (``v`` is loaded once per token and shared by the streams). ``wf`` (``4·M·D`` bytes) is re-read
  by every CTA from L2. The saved ``(T, M)`` intermediates are scalar stores.
* Backward: two kernels, bandwidth first (the first version's persistent CTAs, each with a float32
  ``(M, D)`` SMEM accumulator, reached 37-66% of copy bandwidth on an H100).

  1. Row pass, one token per CTA (grid ``T``, like the forward, with the same preloading): ``v`` and the ``M`` rows of ``go`` in
     16-byte vectors, ``dldg = Σ go·v`` per stream (float32 row reductions), then ``G`` (spec §3.5) and
     the scalars of the column pass: a ``(T, M, 4)`` float32 array ``[g, G, raw·rx²/D, raw·rk²/D]``.
  2. Column pass, grid ``(D / w column blocks) × (P token chunks)``: CTA ``(c, p)`` takes columns
     ``[c·w, (c+1)·w)`` (``w = 128·vec``, :func:`column_block`: each thread ``vec`` consecutive columns of
     every stream, 16-byte bf16 vectors for ``w = 1024``) of the tokens
     ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))``. Per token it loads ``go``, ``x``, ``k`` of the ``M``
     streams (the loads of :data:`TOKENS_PER_STEP` tokens issued together) and writes ``grad_x``,
     ``grad_k`` and ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order, float32) from the registers. No
     thread exchanges data with another: the weight-gradient partial ``Σ_t G·x⊙k`` of the CTA's
     ``(M, w)`` block is a ``lax.fori_loop`` carry (``M·vec`` float32 registers per thread), stored once
     into ``grad_w_partial[p, :, cols]`` (zeros for an empty chunk); ``wf``'s block is loaded once.
     :func:`default_num_partials` picks ``P`` for about :data:`CTAS_PER_SM` CTAs per SM.

  Traffic: ``10·T·D`` bytes (row pass) + ``42·T·D`` (column pass) = ``52·T·D`` against the spec's
  ``44·T·D`` count (``go`` is read twice: ``G`` needs a whole row before any column can be finished).

Signed square root at ``d = ±0`` (spec §8.1): the kernel uses ``copysign`` (``u = ±sqrt(c)``, so the gate is
``σ(±sqrt(c))``), the ``jnp`` reference upstream's ``sign`` (``u = 0``, gate 0.5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _config
from jaxkern._layouts import flat_chunks, flat_layout

CTAS_PER_SM = 8  # column-pass CTAs per SM that the default token chunking aims at (over all waves)
MIN_CHUNK = 16  # tokens per chunk at least, by default
TOKENS_PER_STEP = 2  # tokens whose loads the column pass issues together
MAX_STREAMS = 8  # hc_mult the backward's column pass takes (registers: 5·M·vec float32 per thread)
# Rows of at most this many values per token (M·D) are loaded for all streams before any arithmetic (the forward's
# x and k, the backward row pass's go): more bytes in flight per CTA than stream after stream, whose row reductions'
# barriers keep the next stream's loads from being issued early. 4·2560 (M = 4, D <= 2560: 80 registers of packed
# bf16 x, k per thread). H100, 2026-11-26, bit-identical: forward D = 2048 / 2560 1.01-1.06x faster (D = 2560 from
# 85-94% to 88-96% of copy), D = 3072 unchanged (already 95-98%); the backward row pass unchanged.
PRELOAD_MAX_VALUES = 4 * 2560


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
  if x_dtype != jnp.bfloat16 or wf_dtype != jnp.float32:
    return f"the kernels take bfloat16 x, k, v (got {jnp.dtype(x_dtype).name}) and a float32 weight_fused " \
           f"(got {jnp.dtype(wf_dtype).name})"
  if d % 256:
    return f"hidden_size {d} is not a multiple of 256"
  if backward and m > MAX_STREAMS:
    return f"hc_mult {m} > {MAX_STREAMS}: the column pass keeps M·(2 + 3·TOKENS_PER_STEP) row pieces in registers"
  return None


@functools.partial(jax.jit, static_argnames=("eps", "clamp_value", "save", "interpret"))
def gate_fwd_kernel(x, k, v, wf, *, eps, clamp_value, save, interpret):
  """``x``, ``k`` ``(T, M, D)`` bf16, ``v`` ``(T, D)`` bf16, ``wf`` ``(M, D)`` float32 (``T >= 1``) ->
  ``(out, dot, gate, rstd_x, rstd_k)`` (the last four only with ``save``)."""
  t, m, d = x.shape
  chunks = [(off, n, flat_layout(vec)) for off, n, vec in flat_chunks(d, 2)]
  inv_d, s = float(np.float32(1.0 / d)), float(np.float32(np.float64(d) ** -0.5))
  eps32, c = float(np.float32(eps)), float(np.float32(clamp_value))
  out_type = [jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16)]
  if save:
    out_type += [jax.ShapeDtypeStruct((t, m), jnp.float32)] * 4

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(t,), grid_names=("t",), interpret=interpret)
  def kernel(x_g, k_g, v_g, w_g, o_g, *saved):
    i = lax.axis_index("t")
    vs = [_f32(plgpu.load(v_g.at[i, pl.ds(off, n)], layout=lay, optimized=False)) for off, n, lay in chunks]

    def load_rows(j):
      return [(plgpu.load(x_g.at[i, j, pl.ds(off, n)], layout=lay, optimized=False),
               plgpu.load(k_g.at[i, j, pl.ds(off, n)], layout=lay, optimized=False)) for off, n, lay in chunks]

    preloaded = [load_rows(j) for j in range(m)] if m * d <= PRELOAD_MAX_VALUES else None
    for j in range(m):
      xs, sxx, skk, raw = [], 0.0, 0.0, 0.0
      for (off, n, lay), (xc, kc) in zip(chunks, preloaded[j] if preloaded else load_rows(j)):
        xc, kc = _f32(xc), _f32(kc)
        wc = plgpu.load(w_g.at[j, pl.ds(off, n)], layout=lay, optimized=False)
        sxx, skk, raw = sxx + jnp.sum(xc * xc), skk + jnp.sum(kc * kc), raw + jnp.sum(xc * wc * kc)
        xs.append(xc)
      rx = lax.rsqrt(sxx * inv_d + eps32)
      rk = lax.rsqrt(skk * inv_d + eps32)
      g = _sigmoid(_signed_sqrt(raw * rx * rk * s, c))
      for (off, n, _), xc, vc in zip(chunks, xs, vs):
        o_g[i, j, pl.ds(off, n)] = (xc + g * vc).astype(jnp.bfloat16)
      if save:
        dot_g, gate_g, rx_g, rk_g = saved
        dot_g[i, j], gate_g[i, j], rx_g[i, j], rk_g[i, j] = raw, g, rx, rk

  return kernel(x, k, v, wf)


def column_block(d: int) -> int:
  """Columns per CTA of the backward's column pass: ``128·vec`` with the widest ``vec`` in {8, 4, 2} (16-,
  8-, 4-byte bf16 vectors) dividing ``D`` (1024 for 2048, 3072, 4096, 6144, 7168; 512 for 2560)."""
  for vec in (8, 4, 2):
    if d % (128 * vec) == 0:
      return 128 * vec
  raise ValueError(f"hidden_size {d} is not a multiple of 256")


def default_num_partials(t: int, d: int) -> int:
  """Token chunks of the column pass (the rows of ``grad_w_partial``) when the caller gives none:
  ``CTAS_PER_SM·SMs // (D / w)`` (about :data:`CTAS_PER_SM` CTAs per SM over the column blocks, several
  waves so that the last one's quantisation costs little), at most one chunk per :data:`MIN_CHUNK` tokens
  (the partials' ``16·P·D`` bytes, written here and read by ``grad_w_reduce``, stay a few % of the
  traffic), at least 1. A tuning knob: ``num_partials=`` overrides it."""
  blocks = d // column_block(d) if d % 256 == 0 else 1
  return max(1, min(CTAS_PER_SM * _config.num_sms() // blocks, -(-t // MIN_CHUNK)))


@functools.partial(jax.jit, static_argnames=("clamp_value", "interpret"))
def gate_bwd_rows_kernel(go, v, dot, gate, rstd_x, rstd_k, *, clamp_value, interpret):
  """Row pass of the backward (``T >= 1``): ``(T, M, 4)`` float32 factors ``[g, G, raw·rx²/D, raw·rk²/D]``
  per (token, stream), ``G`` from ``dldg = Σ go·v`` (spec §3.5)."""
  t, m, d = go.shape
  chunks = [(off, n, flat_layout(vec)) for off, n, vec in flat_chunks(d, 2)]
  s = float(np.float32(np.float64(d) ** -0.5))
  inv_d, c = float(np.float32(1.0 / d)), float(np.float32(clamp_value))

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((t, m, 4), jnp.float32), grid=(t,),
                     grid_names=("t",), interpret=interpret)
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
      a = jnp.abs(raw)
      active = a * s * rx * rk >= c
      big_g = jnp.where(active, dldg * g * (1.0 - g) * 0.5 * lax.sqrt(s * rx * rk / jnp.where(active, a, 1.0)), 0.0)
      f_g[i, j, 0], f_g[i, j, 1] = g, big_g
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

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(d // w, p), grid_names=("c", "p"), interpret=interpret)
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
          gv = goc * g if gv is None else gv + goc * g  # m = 0..M-1 in order (spec §3.5)
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


def gate_bwd_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, *, clamp_value, num_partials, interpret):
  """The backward's two kernels (``T >= 1``) -> ``(grad_x, grad_k, grad_v, grad_w_partial (P, M, D) float32)``."""
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
    if tuple(a.shape) != want[name]:
      raise ValueError(f"{name} must have shape {want[name]} (from {first} {tuple(x.shape)}), got {tuple(a.shape)}")
    if name in ("k", "v", "grad_out") and a.dtype != x.dtype:
      raise ValueError(f"{name} must have the dtype of {first} ({x.dtype}), got {a.dtype}")
  if d == 0 or m == 0:
    raise ValueError(f"{first} must have a non-empty hidden_size and hc_mult, got shape {tuple(x.shape)}")
  return tuple(out.values())




def engram_gate_fwd(hidden_states, k, v, weight_fused, *, eps: float, clamp_value: float,
                    save_for_backward: bool = True, implementation: str | None = None) -> EngramGateOutput:
  """Engram gate forward (engram_mhc.md §3.4): ``out = bf16(x + σ(signed_sqrt(d))·v)`` per (token, stream).

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
  device; compared by the spec's ``calc_diff < 2e-10``. At ``d = ±0`` (``raw = ±0``) the kernel's
  ``copysign`` gives the gate ``σ(±sqrt(c))``, the reference's ``sign`` 0.5 (spec §8.1). Other float
  dtypes run the reference in ``promote(dtype, float32)``.

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


def engram_gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, *,
                    clamp_value: float, num_partials: int | None = None,
                    implementation: str | None = None) -> EngramGateGrads:
  """Engram gate backward (engram_mhc.md §3.5) from the forward's saved intermediates.

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
    num_partials: ``P``, the rows of ``grad_w_partial``: the kernel's token chunks (spec §3.5 / §9.4 fix the
      token-range structure, not ``P``; :func:`jaxkern.engram.grad_w_reduce` sums any number of rows). A
      static int >= 1; default (``jaxkern.engram._gate.default_num_partials``):
      ``max(1, min(8·SMs // (D / w), ceil(T / 16)))`` with the column block ``w`` (1024, or 512 / 256 where
      1024 does not divide ``D``), e.g. 150 at ``D = 7168``, ``T = 8001`` on 132 SMs (132 assumed when
      tracing off a GPU).
    implementation: as :func:`engram_gate_fwd`.

  Returns:
    ``EngramGateGrads(grad_hidden_states, grad_k, grad_v, grad_w_partial)``: the first three in the input
    dtype, ``grad_w_partial`` ``(P, M, D)`` float32.

  Raises:
    ValueError (naming the argument): shapes or dtypes as :func:`engram_gate_fwd`, ``num_partials < 1``.

  XLA (the reference) instead of the kernel: ``T = 0`` (zero partials); under ``"auto"`` also other dtypes,
  ``D % 256 != 0`` and ``M > 8`` (``"pallas"`` raises :class:`jaxkern.KernelUnavailableError` for those).

  Kernels (module docstring): a row pass (``G`` per token and stream) and a column pass (everything else,
  the weight-gradient partial of each token chunk kept in registers); ``52·T·D`` bytes of traffic against
  the spec's ``44·T·D`` count (``go`` is read by both).

  Numerics: float32, other summation orders than the reference (spec tolerance ``calc_diff < 1e-8``);
  the weight-gradient partials are deterministic for a fixed ``P``.

  Differentiation: none (it is the backward); ``jax.grad`` through it raises
  :class:`jaxkern.NotDifferentiableError`.
  """
  go, x, k, v, wf, dot, gate, rx, rk = check_gate_arrays(
      grad_out=grad_out, hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused, dot=dot,
      gate_score=gate_score, rstd_x=rstd_x, rstd_k=rstd_k)
  clamp_value = _checks.check_float("clamp_value", clamp_value, nonnegative=True)
  t, m, d = x.shape
  p = default_num_partials(t, d) if num_partials is None else num_partials
  if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1:
    raise ValueError(f"num_partials must be an int >= 1, got {num_partials!r}")
  p = int(p)
  go, x, k, v, wf, dot, gate, rx, rk = _autodiff.guard("engram_gate_bwd", ADVICE, go, x, k, v, wf, dot, gate, rx, rk)
  bad = unsupported(d, m, x.dtype, wf.dtype, backward=True)
  if bad is None and any(a.dtype != jnp.float32 for a in (dot, gate, rx, rk)):
    bad = "the saved intermediates must be float32"

  def kernel(interpret):
    return EngramGateGrads(*gate_bwd_kernel(go, x, k, v, wf, dot, gate, rx, rk, clamp_value=clamp_value,
                                            num_partials=p, interpret=_config.mosaic_interpret(interpret)))

  def reference():
    return ref.engram_gate_bwd(go, x, k, v, wf, dot, gate, rx, rk, clamp_value=clamp_value, num_partials=p)

  return _dispatch.run("engram_gate_bwd", implementation, kernel=kernel, xla=reference, empty=t == 0,
                       unsupported=bad)
