"""``pre_apply_mix`` (docs/mhc.md, "pre_apply_mix"): the sublayer input as the ``pre``-weighted sum of the streams."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _autodiff, _config, _dispatch
from jaxkern.mhc import _common, _stream_kernels as sk
from jaxkern.reference import mhc as ref
from jaxkern.types import PreApplyMixGrads

MAX_M = 8

# "auto" runs XLA (H100, 2026-11-26, runner with CUPTI, 8 shapes T 4096/8192 x H 1280-7168): the forward kernel
# ran at 0.93-0.98x XLA, the backward kernel at 0.83-0.96x. (The forward's two benchmark mismatches on N(0, 1)
# data were rounding order, FMA-contracted sums against XLA's separate products, beyond that check's atol where
# outputs reach 4: tests/mhc/test_gpu_regressions.py bounds the difference on the GPU; the upstream tests' data pass.)
# Those figures are of the first, (8, 128)-tile kernels. The whole-row kernels (jaxkern.mhc._stream_kernels, second
# version), timed through the private _JAXKERN_MHC_FORCE_KERNEL switch (H100, 2026-11-26, same runner and shapes),
# reach XLA without passing it: forward 0.97-1.00x, backward 0.95-0.99x, so "auto" still runs XLA.
_FWD_SLOWER = "kernel 0.93-0.98x XLA on an H100 (2026-11-26)"
_BWD_SLOWER = "kernel 0.83-0.96x XLA on an H100 (2026-11-26)"


def _unsupported(x, mix, others=()):
  """Why the kernels cannot run (None where they can); ``others``: ``(argument name, array)`` of the further
  bfloat16 arrays."""
  for name, a in (("x", x), *others):
    if a.dtype != jnp.bfloat16:
      return f"{name} has dtype {a.dtype.name}; the kernels take bfloat16"
  if mix.dtype != jnp.float32:
    return f"mix has dtype {mix.dtype.name}; the kernels take float32"
  if x.shape[-2] > MAX_M:
    return f"x.shape[-2] (M) = {x.shape[-2]}; the kernels take M <= {MAX_M}"
  return None


def _check(x, mix):
  x, lead, m, h = _common.streams("x", x)
  mix = _common.array("mix", mix, 2)
  _common.shape("mix", mix, (*lead, m, 1))
  return x, mix, lead, m, h


def pre_apply_mix_bwd(o_grad: jax.Array, x: jax.Array, mix: jax.Array, x_grad_acc: jax.Array | None = None, *,
                      implementation: str | None = None) -> PreApplyMixGrads:
  """Backward of :func:`pre_apply_mix` (docs/mhc.md, "pre_apply_mix"), optionally accumulated onto a residual gradient.

  ``x_grad[m, h] = bf16(f32(x_grad_acc[m, h]) + mix[m]·f32(og[h]))`` (without ``x_grad_acc``:
  ``bf16(mix[m]·og[h])``); ``mix_grad[m] = Σ_h og[h]·x[m, h]`` in float32. ``x_grad_acc`` is the functional
  form of upstream's in-place accumulation into the ``grad_from_mhc_post`` buffer (docs/modeling.md, "mHC layers"): pass
  ``post_bwd``'s ``d_residual`` to get ``bf16(d_post + d_apply)`` in one pass.

  Args:
    o_grad: ``(..., H)``, the cotangent of the output (``x``'s dtype for the kernel).
    x: ``(..., M, H)`` the residual streams (bfloat16 for the kernel).
    mix: ``(..., M, 1)`` float32.
    x_grad_acc: optional ``(..., M, H)``, added to ``x_grad``.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``PreApplyMixGrads(x_grad (..., M, H) in x's dtype, mix_grad (..., M, 1) float32)`` (the widened dtype for
    float64 inputs).

  Raises:
    ValueError (naming the argument): shapes that do not match ``x``, non-floating dtypes.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also dtypes other than bfloat16
  streams / gradients with a float32 mix, ``M > 8``.
  Kernel (any ``H``): Mosaic GPU, 16-byte vectors (narrower where ``H`` is not a multiple of 8), per-token
  float32 reductions (register tiles of whole hidden rows of 1-4 tokens where ``H/8`` vectors spread evenly over
  at most 8 per thread and at least one tile of tokens is given, row sums of ``(8, 128)`` tiles where ``H`` is
  another multiple of 128 of at least 1024, else tiles of up to 128 tokens x a divisor of ``H``; then one
  warpgroup sum); the summation order differs from the reference's (float32 rounding only; where a partial sum
  overflows float32, ``mix_grad`` is ±inf or NaN as the order decides, in either).

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  x, mix, lead, m, h = _check(x, mix)
  og = _common.array("o_grad", o_grad, 1)
  _common.shape("o_grad", og, (*lead, h))
  others = [("o_grad", og)]
  if x_grad_acc is not None:
    x_grad_acc = _common.array("x_grad_acc", x_grad_acc, 2)
    _common.shape("x_grad_acc", x_grad_acc, x.shape)
    others.append(("x_grad_acc", x_grad_acc))
  og, x, mix, x_grad_acc = _autodiff.guard("pre_apply_mix_bwd", _common.BWD_ADVICE, og, x, mix, x_grad_acc)
  t = _common.tokens(lead)

  def kernel(interpret):
    acc = None if x_grad_acc is None else x_grad_acc.reshape(t, m, h)
    bwd = sk.apply_mix_bwd_rows_kernel if sk.use_rows(h, t) else sk.apply_mix_bwd_kernel
    xg, mg = bwd(og.reshape(t, h), x.reshape(t, m, h), mix.reshape(t, m), acc,
                 interpret=_config.mosaic_interpret(interpret))
    return PreApplyMixGrads(xg.reshape(x.shape), mg.reshape(mix.shape))

  return _dispatch.run("pre_apply_mix_bwd", implementation, kernel=kernel,
                       xla=lambda: ref.pre_apply_mix_bwd(og, x, mix, x_grad_acc), empty=t == 0,
                       unsupported=_unsupported(x, mix, others), xla_faster=_common.xla_faster("pre_apply_mix_bwd", _BWD_SLOWER))


def _fwd_op(x, mix, implementation):
  lead, (m, h) = x.shape[:-2], x.shape[-2:]
  t = _common.tokens(lead)

  def kernel(interpret):
    fwd = sk.apply_mix_fwd_rows_kernel if sk.use_rows(h, t) else sk.apply_mix_fwd_kernel
    out = fwd(x.reshape(t, m, h), mix.reshape(t, m), interpret=_config.mosaic_interpret(interpret))
    return out.reshape(*lead, h)

  return _dispatch.run("pre_apply_mix", implementation, kernel=kernel, xla=lambda: ref.pre_apply_mix(x, mix),
                       empty=t == 0, unsupported=_unsupported(x, mix), xla_faster=_common.xla_faster("pre_apply_mix", _FWD_SLOWER))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _apply(x, mix, implementation):
  return _fwd_op(x, mix, implementation)


def _apply_fwd(x, mix, implementation):
  return _fwd_op(x, mix, implementation), (x, mix)


def _apply_bwd(implementation, residuals, og):
  x, mix = residuals
  xg, mg = pre_apply_mix_bwd(og.astype(x.dtype), x, mix, implementation=implementation)
  return xg.astype(x.dtype), mg.astype(mix.dtype)


_apply.defvjp(_apply_fwd, _apply_bwd)


def pre_apply_mix(x: jax.Array, mix: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """``out[..., h] = bf16(Σ_m mix[..., m, 0]·f32(x[..., m, h]))`` (float32, ``m = 0..M-1`` in order).

  Args:
    x: ``(..., M, H)`` residual streams, floating (bfloat16 for the kernel); any leading dims.
    mix: ``(..., M, 1)`` float32 (upstream's trailing 1 is required).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., H)`` in ``x``'s dtype.

  Raises:
    ValueError (naming the argument): rank < 2, ``mix`` not ``(..., M, 1)``, non-floating dtypes, ``M`` or ``H`` 0.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also dtypes other than bfloat16
  ``x`` with a float32 ``mix``, ``M > 8``.
  Kernel (any ``H``): Mosaic GPU (see :mod:`jaxkern.mhc._stream_kernels`), bandwidth-bound; the products are summed
  as ``mix[0]·x[0] + mix[1]·x[1] + ...`` (the GPU contracts each add into an FMA). XLA on a GPU does not
  contract, so there the kernel and the XLA path round to different bf16 neighbours on about 1e-4 of the
  outputs (one bf16 ulp; XLA on CPU contracts like the kernel); where the products cancel, the float32 sums
  themselves differ, by at most ``M·2^-23·Σ_m |mix[m]·x[m]|`` (docs/mhc.md). Where a product ``mix[m]·x[m]`` of finite factors
  overflows float32, the output element is unspecified: the FMA does not round the product on its own, so the
  kernel may give ±inf or a finite value where XLA's separately rounded product gives ±inf, and NaN there from
  ``inf + (-inf)`` may be ±inf in the kernel (an H200 found -inf against NaN, 2026-11-29). Elsewhere non-finite
  inputs propagate alike (IEEE: NaN in, NaN out; ``inf - inf`` and ``inf·0`` NaN).

  Differentiation: ``jax.custom_vjp``; residuals ``x, mix``; backward :func:`pre_apply_mix_bwd` (a kernel)
  with the same implementation.
  """
  x, mix, _, _, _ = _check(x, mix)
  return _apply(*_autodiff.vary_like(x, mix), _config.get_implementation(implementation))
