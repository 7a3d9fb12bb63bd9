"""``expand_to_mhc`` (docs/mhc.md, "expand_to_mhc"): widen a hidden state to ``M`` identical residual streams."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _autodiff, _config, _dispatch
from jaxkern.mhc import _common, _stream_kernels as sk
from jaxkern.reference import mhc as ref



# "auto" runs XLA for the backward: 0.87-0.97x XLA on an H100 (2026-11-26, runner with CUPTI, 8 shapes), the first
# (8, 128)-tile kernel; the whole-row kernel (second version), timed through the private _JAXKERN_MHC_FORCE_KERNEL
# switch on the same card and day, 0.97-1.00x.
_BWD_SLOWER = "kernel 0.87-0.97x XLA on an H100 (2026-11-26)"

MAX_M = 8


def _unsupported(name, dtype, m_name, m):
  """Why the kernels cannot run (None where they can); ``name`` / ``m_name``: the user's argument and its ``M``."""
  if dtype != jnp.bfloat16:
    return f"{name} has dtype {jnp.dtype(dtype).name}; the kernel takes bfloat16"
  if m > MAX_M:
    return f"{m_name} = {m}; the kernel takes {m_name} <= {MAX_M}"
  return None


def expand_to_mhc_bwd(out_grad: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """Backward of :func:`expand_to_mhc`: ``bf16(Σ_m f32(out_grad[..., m, :]))`` (m in order, one rounding).

  Args:
    out_grad: ``(..., M, H)`` floating (bfloat16 for the kernel).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., H)`` in ``out_grad``'s dtype.

  Raises:
    ValueError (naming the argument): rank < 2, a non-floating dtype, ``M = 0`` or ``H = 0``.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also dtypes other than bfloat16 and
  ``M > 8`` (``"pallas"`` raises :class:`jaxkern.KernelUnavailableError` there). Kernel (any ``H``): Mosaic GPU,
  16-byte vectors (narrower where ``H`` is not a multiple of 8), float32 sums (register tiles of whole hidden rows
  of 1-4 tokens, or of up to 128 tokens x a divisor of ``H``, else ``(8, 128)`` tiles; the same bits).

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  g, lead, m, h = _common.streams("out_grad", out_grad)
  g = _autodiff.guard("expand_to_mhc_bwd", _common.BWD_ADVICE, g)
  t = _common.tokens(lead)

  def kernel(interpret):
    bwd = sk.expand_bwd_rows_kernel if sk.use_rows(h, t) else sk.expand_bwd_kernel
    return bwd(g.reshape(t, m, h), interpret=_config.mosaic_interpret(interpret)).reshape(*lead, h)

  return _dispatch.run("expand_to_mhc_bwd", implementation, kernel=kernel, xla=lambda: ref.expand_to_mhc_bwd(g),
                       empty=t == 0, unsupported=_unsupported("out_grad", g.dtype, "out_grad.shape[-2] (M)", m),
                       xla_faster=_common.xla_faster("expand_to_mhc_bwd", _BWD_SLOWER))


def _fwd_op(hidden, mhc_mult, implementation):
  lead, h = hidden.shape[:-1], hidden.shape[-1]
  t = _common.tokens(lead)

  def kernel(interpret):
    fwd = sk.expand_fwd_kernel if sk.tiles_fit(h) else sk.expand_fwd_rows_kernel
    out = fwd(hidden.reshape(t, h), mhc_mult=mhc_mult, interpret=_config.mosaic_interpret(interpret))
    return out.reshape(*lead, mhc_mult, h)

  return _dispatch.run("expand_to_mhc", implementation, kernel=kernel,
                       xla=lambda: ref.expand_to_mhc(hidden, mhc_mult=mhc_mult), empty=t == 0,
                       unsupported=_unsupported("hidden", hidden.dtype, "mhc_mult", mhc_mult))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _expand(hidden, mhc_mult, implementation):
  return _fwd_op(hidden, mhc_mult, implementation)


def _expand_fwd(hidden, mhc_mult, implementation):
  return _fwd_op(hidden, mhc_mult, implementation), None


def _expand_bwd(mhc_mult, implementation, _, g):
  return (expand_to_mhc_bwd(g, implementation=implementation),)


_expand.defvjp(_expand_fwd, _expand_bwd)


def expand_to_mhc(hidden: jax.Array, *, mhc_mult: int, implementation: str | None = None) -> jax.Array:
  """``(..., H)`` -> ``(..., M, H)`` with ``out[..., m, :] = hidden`` for every ``m`` (exact copy).

  Args:
    hidden: ``(..., H)`` floating (bfloat16 for the kernel); any leading dims, also none or zero-size.
    mhc_mult: ``M``, the number of residual streams (an int >= 1; only 4 is used end to end upstream).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., M, H)`` in ``hidden``'s dtype.

  Raises:
    ValueError (naming the argument): rank 0, a non-floating dtype, ``H = 0``, ``mhc_mult`` not an int >= 1.

  XLA (a broadcast) instead of the kernel: zero tokens; under ``"auto"`` also dtypes other than bfloat16 and
  ``mhc_mult > 8``. Kernel (any ``H``): Mosaic GPU, each token's row loaded once in 16-byte vectors (narrower
  where ``H`` is not a multiple of 8) and stored ``M`` times.

  Differentiation: ``jax.custom_vjp``; the cotangent is :func:`expand_to_mhc_bwd` (float32 stream sum,
  one rounding), run with the same implementation.
  """
  hidden = _common.array("hidden", hidden, 1)
  if hidden.shape[-1] == 0:
    raise ValueError(f"hidden must have a non-empty hidden size, got shape {tuple(hidden.shape)}")
  mhc_mult = _common.mhc_mult(mhc_mult)
  return _expand(hidden, mhc_mult, _config.get_implementation(implementation))
