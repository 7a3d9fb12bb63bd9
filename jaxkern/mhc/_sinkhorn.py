"""``sinkhorn_normalize`` (docs/mhc.md, "sinkhorn_normalize"): push the comb logits towards doubly-stochastic matrices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.mhc import _common, _sinkhorn_kernel as kern
from jaxkern.reference import mhc as ref



# "auto" runs XLA for the backward: the first kernel (it recomputed the iteration chain for every step, O(repeat²))
# ran at 0.26-0.74x XLA on an H100 (2026-11-26, runner with CUPTI, T 1-8192). The current kernel (saved iterates,
# linear chain), timed through the private _JAXKERN_MHC_FORCE_KERNEL switch on the same card and day: 0.30-0.94x
# (a few µs, launch- and latency-bound).
_BWD_SLOWER = "kernel 0.26-0.74x XLA on an H100 (2026-11-26)"

def _check(name, x):
  x = _common.array(name, x, 2)
  m = x.shape[-1]
  if x.shape[-2] != m or m == 0:
    raise ValueError(f"{name} must have shape (..., M, M) with M >= 1, got {tuple(x.shape)}")
  return x, x.shape[:-2], m


def _unsupported(*arrays):
  if any(a.dtype != jnp.float32 for a in arrays):
    return "the kernels take float32 matrices"
  return kern.unsupported(arrays[0].shape[-1])


def sinkhorn_normalize_bwd(grad_output: jax.Array, x: jax.Array, *, repeat: int = 10, eps: float = 1e-6,
                           implementation: str | None = None) -> jax.Array:
  """Backward of :func:`sinkhorn_normalize` for the logits ``x`` (docs/mhc.md, "sinkhorn_normalize"): the chain is recomputed from
  ``x`` and walked backwards (``t = Σ g·X_i / (Σ_i + eps)``, ``g = (g - t) / (Σ_i + eps)`` per normalisation,
  then the softmax backward ``(g - Σ_n g·P)·P``). Equal to autodiff of the forward.

  Args:
    grad_output: ``(..., M, M)`` cotangent of the output.
    x: ``(..., M, M)`` the forward's input logits (float32 for the kernel).
    repeat, eps: the forward's options.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., M, M)`` in ``promote(x.dtype, float32)``.

  Raises:
    ValueError (naming the argument): shapes other than ``(..., M, M)`` / mismatched, ``repeat < 1``, a
      non-finite or negative ``eps``.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also non-float32 inputs and
  ``M > 8`` or ``M·M`` not a multiple of 4. Kernel: Mosaic GPU, one token per thread, 128 per CTA: the forward
  chain once, its iterates kept per thread, then the steps in reverse with multiplies by the reciprocal sums
  (within an ulp or so of the divisions; ``repeat > 16``: the chain recomputed per step, the reference's divisions;
  :mod:`jaxkern.mhc._sinkhorn_kernel`).

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  x, lead, m = _check("x", x)
  g, _, _ = _check("grad_output", grad_output)
  _common.shape("grad_output", g, x.shape)
  repeat, eps = _common.repeat(repeat), _checks.check_float("eps", eps, nonnegative=True)
  g, x = _autodiff.guard("sinkhorn_normalize_bwd", _common.BWD_ADVICE, g, x)
  t = _common.tokens(lead)

  def kernel(interpret):
    out = kern.sinkhorn_kernel(x.reshape(t, m, m), g.reshape(t, m, m), repeat=repeat, eps=eps, backward_pass=True,
                               interpret=_config.mosaic_interpret(interpret))
    return out.reshape(x.shape)

  return _dispatch.run("sinkhorn_normalize_bwd", implementation, kernel=kernel,
                       xla=lambda: ref.sinkhorn_normalize_bwd(g, x, repeat=repeat, eps=eps), empty=t == 0,
                       unsupported=_unsupported(x, g), xla_faster=_common.xla_faster("sinkhorn_normalize_bwd", _BWD_SLOWER))


def _fwd_op(x, repeat, eps, implementation):
  m = x.shape[-1]
  t = _common.tokens(x.shape[:-2])

  def kernel(interpret):
    out = kern.sinkhorn_kernel(x.reshape(t, m, m), None, repeat=repeat, eps=eps, backward_pass=False,
                               interpret=_config.mosaic_interpret(interpret))
    return out.reshape(x.shape)

  return _dispatch.run("sinkhorn_normalize", implementation, kernel=kernel,
                       xla=lambda: ref.sinkhorn_normalize(x, repeat=repeat, eps=eps), empty=t == 0,
                       unsupported=_unsupported(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _sinkhorn(x, repeat, eps, implementation):
  return _fwd_op(x, repeat, eps, implementation)


def _sinkhorn_fwd(x, repeat, eps, implementation):
  return _fwd_op(x, repeat, eps, implementation), x


def _sinkhorn_bwd(repeat, eps, implementation, x, g):
  return (sinkhorn_normalize_bwd(g, x, repeat=repeat, eps=eps, implementation=implementation).astype(x.dtype),)


_sinkhorn.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


def sinkhorn_normalize(x: jax.Array, *, repeat: int = 10, eps: float = 1e-6,
                       implementation: str | None = None) -> jax.Array:
  """Sinkhorn-Knopp normalisation of per-token ``M x M`` logits (docs/mhc.md, "sinkhorn_normalize").

  Softmax over the last axis, ``+ eps``, a column normalisation ``X / (Σ_m X + eps)``, then ``repeat - 1``
  pairs of row and column normalisations (``2·repeat - 1`` normalisations; columns sum to ~1).

  Args:
    x: ``(..., M, M)`` floating (float32 for the kernel); any leading dims, flattened.
    repeat: Sinkhorn iterations (an int >= 1, default 10).
    eps: added after the softmax and to every denominator (default 1e-6).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., M, M)`` in ``promote(x.dtype, float32)``.

  Raises:
    ValueError (naming the argument): not ``(..., M, M)``, a non-floating dtype, ``repeat < 1``, a negative or
      non-finite ``eps``.

  XLA (the reference, ``2·repeat - 1`` unrolled reductions) instead of the kernel: zero tokens; under
  ``"auto"`` also non-float32 ``x`` and ``M > 8`` or ``M·M`` not a multiple of 4. Kernel: Mosaic GPU, one token
  per thread (the whole iteration in registers), 128 tokens per CTA; the GPU's float32 division is
  approximate (within ~2 ulp), so results differ from the reference in the last bits (the tests' tolerance:
  fp32 ``assert_close``).

  Differentiation: ``jax.custom_vjp``; residual ``x`` only; backward :func:`sinkhorn_normalize_bwd` (a kernel
  that recomputes the chain from ``x``).
  """
  x, _, _ = _check("x", x)
  repeat, eps = _common.repeat(repeat), _checks.check_float("eps", eps, nonnegative=True)
  return _sinkhorn(x, repeat, eps, _config.get_implementation(implementation))
