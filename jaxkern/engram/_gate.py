"""Engram gate forward and backward (engram_mhc.md §3.4, §3.5): Mosaic GPU kernels.

Both kernels move each hidden row straight GMEM -> registers -> GMEM in 16-byte vectors
(:func:`jaxkern._layouts.flat_layout`: one ``D``-row spread over the warpgroup's 128 threads, a warp
reading contiguous 512-byte segments; ``D = 2560`` runs a 2048-column chunk of 16-byte vectors and a
512-column chunk of 8-byte ones, :func:`jaxkern._layouts.flat_chunks`). All arithmetic is float32;
row reductions are per-thread vector sums, then warp shuffles and an SMEM step across the 4 warps.

* Forward: one token per CTA (grid ``T``), its ``M`` streams one after the other: ``Σx²``, ``Σk²``
  and ``Σx·wf·k`` of the row, the gate as scalars, then ``out = bf16(x + g·v)`` from the registers
  (``v`` is loaded once per token and shared by the streams). ``wf`` (``4·M·D`` bytes) is re-read
  by every CTA from L2. The saved ``(T, M)`` intermediates are scalar stores.
* Backward: ``P`` persistent CTAs (default: the SM count), CTA ``p`` taking the token range
  ``[p·ceil(T/P), min((p+1)·ceil(T/P), T))`` (spec §3.5). Per token: pass 1 forms ``dldg = Σ go·v`` per
  stream and the common factor ``G``; pass 2 re-reads ``go`` (an L1/L2 hit) with ``x``, ``k``, ``wf``,
  writes ``grad_x``, ``grad_k``, accumulates ``G·x⊙k`` into a float32 ``(M, D)`` SMEM accumulator
  (``16·D`` bytes for ``M = 4``: registers cannot hold ``M·D`` float32 per CTA) and writes
  ``grad_v = bf16(Σ_m go_m·g_m)`` (``m`` in order). At the end the CTA copies its accumulator to
  ``grad_w_partial[p]`` (zeros for a CTA without tokens).

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

from jaxkern._layouts import flat_chunks, flat_layout

SMEM_LIMIT = 200 * 1024  # bytes of the backward's float32 (M, D) accumulator


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
  if backward and 4 * m * d > SMEM_LIMIT:
    return f"the float32 weight-gradient accumulator of {4 * m * d} bytes exceeds {SMEM_LIMIT} bytes of SMEM"
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
    for j in range(m):
      xs, sxx, skk, raw = [], 0.0, 0.0, 0.0
      for off, n, lay in chunks:
        xc = _f32(plgpu.load(x_g.at[i, j, pl.ds(off, n)], layout=lay, optimized=False))
        kc = _f32(plgpu.load(k_g.at[i, j, pl.ds(off, n)], layout=lay, optimized=False))
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


@functools.partial(jax.jit, static_argnames=("clamp_value", "num_partials", "interpret"))
def gate_bwd_kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k, *, clamp_value, num_partials, interpret):
  """The backward's kernel (``T >= 1``) -> ``(grad_x, grad_k, grad_v, grad_w_partial (P, M, D) float32)``."""
  t, m, d = x.shape
  p = num_partials
  per = -(-t // p)
  chunks = [(off, n, flat_layout(vec)) for off, n, vec in flat_chunks(d, 2)]
  s = float(np.float32(np.float64(d) ** -0.5))
  inv_d, c = float(np.float32(1.0 / d)), float(np.float32(clamp_value))
  out_type = (jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, m, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((p, m, d), jnp.float32))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(p,), grid_names=("p",), interpret=interpret,
                     scratch_types=(plgpu.SMEM((m, d), jnp.float32),))
  def kernel(go_g, x_g, k_g, v_g, w_g, dot_g, gate_g, rx_g, rk_g, gx_g, gk_g, gv_g, gw_g, acc_s):
    pid = lax.axis_index("p")
    for j in range(m):
      for off, n, lay in chunks:
        acc_s[j, pl.ds(off, n)] = plgpu.layout_cast(jnp.zeros((n,), jnp.float32), lay)

    def load(ref, lay):
      return _f32(plgpu.load(ref, layout=lay, optimized=False))

    def token(i, carry):
      vs = [load(v_g.at[i, pl.ds(off, n)], lay) for off, n, lay in chunks]
      factors = []
      for j in range(m):  # pass 1: dldg and the common factor G per stream
        dldg = 0.0
        for (off, n, lay), vc in zip(chunks, vs):
          dldg = dldg + jnp.sum(load(go_g.at[i, j, pl.ds(off, n)], lay) * vc)
        raw, g, rx, rk = dot_g[i, j], gate_g[i, j], rx_g[i, j], rk_g[i, j]
        a = jnp.abs(raw)
        active = a * s * rx * rk >= c
        big_g = jnp.where(active, dldg * g * (1.0 - g) * 0.5 * lax.sqrt(s * rx * rk / jnp.where(active, a, 1.0)), 0.0)
        factors.append((g, big_g, raw * rx * rx * inv_d, raw * rk * rk * inv_d))
      for off, n, lay in chunks:  # pass 2: grad_x, grad_k, the weight-gradient sum, grad_v
        gv = None
        for j, (g, big_g, cx, ck) in enumerate(factors):
          cols = pl.ds(off, n)
          goc, xc, kc = (load(r.at[i, j, cols], lay) for r in (go_g, x_g, k_g))
          wc = plgpu.load(w_g.at[j, cols], layout=lay, optimized=False)
          gx_g[i, j, cols] = (goc + big_g * (kc * wc - xc * cx)).astype(jnp.bfloat16)
          gk_g[i, j, cols] = (big_g * (xc * wc - kc * ck)).astype(jnp.bfloat16)
          acc_s[j, cols] = plgpu.load(acc_s.at[j, cols], layout=lay, optimized=False) + big_g * xc * kc
          gv = goc * g if gv is None else gv + goc * g
        gv_g[i, pl.ds(off, n)] = gv.astype(jnp.bfloat16)
      return carry

    lax.fori_loop(jnp.minimum(pid * per, t), jnp.minimum((pid + 1) * per, t), token, 0)
    for j in range(m):
      for off, n, lay in chunks:
        gw_g[pid, j, pl.ds(off, n)] = plgpu.load(acc_s.at[j, pl.ds(off, n)], layout=lay, optimized=False)

  return kernel(go, x, k, v, wf, dot, gate, rstd_x, rstd_k)


# ----------------------------------------------------------------------------------------------
# Public ops.

from jaxkern import _autodiff, _checks, _config, _dispatch  # noqa: E402
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


def _check_scalar(name, value):
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a Python float, got {type(value).__name__}") from None
  if not np.isfinite(value) or value < 0:
    raise ValueError(f"{name} must be finite and >= 0, got {value}")
  return value


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
  eps, clamp_value = _check_scalar("eps", eps), _check_scalar("clamp_value", clamp_value)
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
    num_partials: ``P``, the rows of ``grad_w_partial`` (the kernel's persistent CTAs); default the GPU's SM
      count (132 when tracing off a GPU). A static int >= 1.
    implementation: as :func:`engram_gate_fwd`.

  Returns:
    ``EngramGateGrads(grad_hidden_states, grad_k, grad_v, grad_w_partial)``: the first three in the input
    dtype, ``grad_w_partial`` ``(P, M, D)`` float32.

  Raises:
    ValueError (naming the argument): shapes or dtypes as :func:`engram_gate_fwd`, ``num_partials < 1``.

  XLA (the reference) instead of the kernel: ``T = 0`` (zero partials); under ``"auto"`` also other dtypes,
  ``D % 256 != 0`` and an accumulator ``4·M·D`` above 200 KiB of SMEM (``D > 12800`` at ``M = 4``).

  Numerics: float32, other summation orders than the reference (spec tolerance ``calc_diff < 1e-8``);
  the weight-gradient partials are deterministic for a fixed ``P``.

  Differentiation: none (it is the backward); ``jax.grad`` through it raises
  :class:`jaxkern.NotDifferentiableError`.
  """
  go, x, k, v, wf, dot, gate, rx, rk = check_gate_arrays(
      grad_out=grad_out, hidden_states=hidden_states, k=k, v=v, weight_fused=weight_fused, dot=dot,
      gate_score=gate_score, rstd_x=rstd_x, rstd_k=rstd_k)
  clamp_value = _check_scalar("clamp_value", clamp_value)
  p = _config.num_sms() if num_partials is None else num_partials
  if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1:
    raise ValueError(f"num_partials must be an int >= 1, got {num_partials!r}")
  p = int(p)
  go, x, k, v, wf, dot, gate, rx, rk = _autodiff.guard("engram_gate_bwd", ADVICE, go, x, k, v, wf, dot, gate, rx, rk)
  t, m, d = x.shape
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
