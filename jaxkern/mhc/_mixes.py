"""``pre_split_mixes`` and ``head_compute_mix`` (docs/mhc.md): per-token affine + sigmoid maps of
the mixing logits. XLA code, no Pallas kernel.

Why XLA: both are element-wise maps of ``(T, J)`` / ``(T, M)`` float32 rows (96 / 16 bytes per token, one
read and one write), which XLA compiles into a single fusion that already streams at memory bandwidth; a
Pallas kernel has nothing left to fuse (its input comes from the ``pre_norm_fn`` GEMM, its outputs feed
Sinkhorn and ``pre_apply_mix``, all separate kernels). Their backward passes reduce ``da·z`` and ``da`` over
all tokens for the ``scale`` / ``base`` gradients, which XLA does as one reduction fusion (upstream uses
per-SM partials plus a sum; XLA's reduction emitter does the same internally). The fused inference path
(``pre_big_fuse``) computes these maps inside its own kernel.
"""

from __future__ import annotations

import functools

import jax

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.mhc import _common
from jaxkern.reference import mhc as ref
from jaxkern.types import HeadComputeMixGrads, PreSplitMixes, PreSplitMixesGrads


def _check_split(input_mixes, mhc_scale, mhc_base, mhc_mult):
  mhc_mult = _common.mhc_mult(mhc_mult)
  j = mhc_mult * (mhc_mult + 2)
  z = _common.array("input_mixes", input_mixes, 1)
  if z.shape[-1] != j:
    raise ValueError(f"input_mixes must have {j} = M·(M+2) mixes on its last axis for mhc_mult={mhc_mult}, "
                     f"got shape {tuple(z.shape)}")
  scale = _common.array("mhc_scale", mhc_scale, 1)
  _common.shape("mhc_scale", scale, (3,))
  base = _common.array("mhc_base", mhc_base, 1)
  _common.shape("mhc_base", base, (j,))
  return z, scale, base, mhc_mult


def pre_split_mixes_bwd(pre_layer_mix_grad: jax.Array, post_layer_mix_grad: jax.Array, comb_res_mix_grad: jax.Array,
                        input_mixes: jax.Array, post_layer_mix: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *,
                        mhc_mult: int, mhc_post_mult_value: float,
                        implementation: str | None = None) -> PreSplitMixesGrads:
  """Backward of :func:`pre_split_mixes` (docs/mhc.md, "pre_split_mixes"), XLA code (see the module docstring).

  ``da_pre = g_pre·σ(1-σ)`` (σ recomputed from ``input_mixes``, ``mhc_scale``, ``mhc_base``),
  ``da_post = g_post·post·(1 - post/post_mult_value)`` (from the saved ``post_layer_mix``), ``da_comb = g_comb``;
  ``input_mixes_grad = da·scale[grp]``, ``mhc_scale_grad[g] = Σ_tokens Σ_{j in g} da·z``,
  ``mhc_base_grad = Σ_tokens da``.

  Args:
    pre_layer_mix_grad, post_layer_mix_grad: ``(..., M, 1)``; comb_res_mix_grad: ``(..., M, M)``.
    input_mixes, post_layer_mix, mhc_scale, mhc_base: the forward's inputs / saved post output.
    mhc_mult, mhc_post_mult_value: the forward's options (``mhc_post_mult_value`` non-zero).
    implementation: accepted for uniformity; every value runs XLA (``"reference"`` the same code).

  Returns:
    ``PreSplitMixesGrads(input_mixes_grad (..., J), mhc_scale_grad (3,), mhc_base_grad (J,))``, float32 (wider
    for float64 inputs); zero parameter gradients for zero tokens.

  Raises:
    ValueError (naming the argument): shapes, dtypes, ``mhc_mult``, a zero ``mhc_post_mult_value``.

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  z, scale, base, m = _check_split(input_mixes, mhc_scale, mhc_base, mhc_mult)
  lead = z.shape[:-1]
  pmv = _checks.check_float("mhc_post_mult_value", mhc_post_mult_value, nonzero=True)
  arrays = {"pre_layer_mix_grad": (pre_layer_mix_grad, (*lead, m, 1)),
            "post_layer_mix_grad": (post_layer_mix_grad, (*lead, m, 1)),
            "comb_res_mix_grad": (comb_res_mix_grad, (*lead, m, m)), "post_layer_mix": (post_layer_mix, (*lead, m, 1))}
  checked = []
  for name, (a, want) in arrays.items():
    a = _common.array(name, a, 1)
    _common.shape(name, a, want)
    checked.append(a)
  gpre, gpost, gcomb, post = _autodiff.guard("pre_split_mixes_bwd", _common.BWD_ADVICE, *checked)
  z, scale, base = _autodiff.guard("pre_split_mixes_bwd", _common.BWD_ADVICE, z, scale, base)
  return _dispatch.run("pre_split_mixes_bwd", implementation, kernel=None, xla=lambda: ref.pre_split_mixes_bwd(
      gpre, gpost, gcomb, z, post, scale, base, mhc_mult=m, mhc_post_mult_value=pmv))


def _split_op(z, scale, base, m, pmv, pre_eps, implementation):
  return _dispatch.run("pre_split_mixes", implementation, kernel=None, xla=lambda: ref.pre_split_mixes(
      z, scale, base, mhc_mult=m, mhc_post_mult_value=pmv, mhc_pre_eps=pre_eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _split(z, scale, base, m, pmv, pre_eps, implementation):
  return _split_op(z, scale, base, m, pmv, pre_eps, implementation)


def _split_fwd(z, scale, base, m, pmv, pre_eps, implementation):
  out = _split_op(z, scale, base, m, pmv, pre_eps, implementation)
  return out, (z, scale, base, out.post_layer_mix)


def _split_bwd(m, pmv, pre_eps, implementation, res, g):
  z, scale, base, post = res
  grads = pre_split_mixes_bwd(*g, z, post, scale, base, mhc_mult=m, mhc_post_mult_value=pmv,
                              implementation=implementation)
  return tuple(a.astype(p.dtype) for a, p in zip(grads, (z, scale, base)))


_split.defvjp(_split_fwd, _split_bwd)


def pre_split_mixes(input_mixes: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *, mhc_mult: int,
                    mhc_post_mult_value: float = 1.0, mhc_pre_eps: float = 1e-6,
                    implementation: str | None = None) -> PreSplitMixes:
  """Split the ``J = M·(M+2)`` logits per token into the pre, post and comb mixes (docs/mhc.md, "pre_split_mixes").

  ``a_j = z_j·scale[min(2, j // M)] + base_j``; ``pre = σ(a[:M]) + mhc_pre_eps``,
  ``post = σ(a[M:2M])·mhc_post_mult_value``, ``comb = a[2M:]`` as ``(M, M)`` (row = input stream), float32.

  Args:
    input_mixes: ``(..., J)`` float32 (upstream: exactly ``(B, S, J)``; any leading dims here).
    mhc_scale: ``(3,)``; mhc_base: ``(J,)``.
    mhc_mult: ``M`` (an int >= 1).
    mhc_post_mult_value: non-zero (the backward divides by it); mhc_pre_eps: added to the pre mix.
    implementation: accepted for uniformity; every value but ``"reference"`` runs the XLA code (the module
      docstring says why there is no kernel); ``"reference"`` runs the same ``jnp`` code.

  Returns:
    ``PreSplitMixes(pre_layer_mix (..., M, 1), post_layer_mix (..., M, 1), comb_res_mix (..., M, M))``.

  Raises:
    ValueError (naming the argument): ``input_mixes``' last axis not ``M·(M+2)``, ``mhc_scale`` not ``(3,)``,
      ``mhc_base`` not ``(J,)``, non-floating dtypes, ``mhc_mult`` not an int >= 1, a zero or non-finite
      ``mhc_post_mult_value``, a non-finite ``mhc_pre_eps``.

  Differentiation: ``jax.custom_vjp`` (residuals ``input_mixes, scale, base`` and the post output), backward
  :func:`pre_split_mixes_bwd`.
  """
  z, scale, base, m = _check_split(input_mixes, mhc_scale, mhc_base, mhc_mult)
  pmv = _checks.check_float("mhc_post_mult_value", mhc_post_mult_value, nonzero=True)
  pre_eps = _checks.check_float("mhc_pre_eps", mhc_pre_eps)
  z, scale, base = _autodiff.vary_like(z, scale, base)  # replicated params, sharded mixes: one vma type
  return _split(z, scale, base, m, pmv, pre_eps, _config.get_implementation(implementation))


def _check_head(input_mix, mhc_scale, mhc_base):
  z = _common.array("input_mix", input_mix, 1)
  m = z.shape[-1]
  if m == 0:
    raise ValueError(f"input_mix must have M >= 1 mixes on its last axis, got shape {tuple(z.shape)}")
  scale = _common.array("mhc_scale", mhc_scale, 1)
  _common.shape("mhc_scale", scale, (1,))
  base = _common.array("mhc_base", mhc_base, 1)
  _common.shape("mhc_base", base, (m,))
  return z, scale, base


def head_compute_mix_bwd(output_mix_grad: jax.Array, input_mix: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *,
                         implementation: str | None = None) -> HeadComputeMixGrads:
  """Backward of :func:`head_compute_mix` (docs/mhc.md, "head_compute_mix"), XLA code: ``dz = go·σ(1-σ)`` (σ recomputed),
  ``input_mix_grad = dz·scale``, ``mhc_scale_grad = Σ dz·z`` ``(1,)``, ``mhc_base_grad = Σ_tokens dz`` ``(M,)``.

  Args:
    output_mix_grad: ``(..., M)``; input_mix, mhc_scale, mhc_base: the forward's inputs.
    implementation: accepted for uniformity (always XLA / the same ``jnp`` code).

  Returns:
    ``HeadComputeMixGrads(input_mix_grad, mhc_scale_grad, mhc_base_grad)``, float32 (wider for float64 inputs).

  Raises:
    ValueError (naming the argument): shapes or dtypes.

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  z, scale, base = _check_head(input_mix, mhc_scale, mhc_base)
  go = _common.array("output_mix_grad", output_mix_grad, 1)
  _common.shape("output_mix_grad", go, z.shape)
  go, z, scale, base = _autodiff.guard("head_compute_mix_bwd", _common.BWD_ADVICE, go, z, scale, base)
  return _dispatch.run("head_compute_mix_bwd", implementation, kernel=None,
                       xla=lambda: ref.head_compute_mix_bwd(go, z, scale, base))


def _head_op(z, scale, base, pre_eps, implementation):
  return _dispatch.run("head_compute_mix", implementation, kernel=None,
                       xla=lambda: ref.head_compute_mix(z, scale, base, mhc_pre_eps=pre_eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(z, scale, base, pre_eps, implementation):
  return _head_op(z, scale, base, pre_eps, implementation)


def _head_fwd(z, scale, base, pre_eps, implementation):
  return _head_op(z, scale, base, pre_eps, implementation), (z, scale, base)


def _head_bwd(pre_eps, implementation, res, g):
  grads = head_compute_mix_bwd(g, *res, implementation=implementation)
  return tuple(a.astype(p.dtype) for a, p in zip(grads, res))


_head.defvjp(_head_fwd, _head_bwd)


def head_compute_mix(input_mix: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *, mhc_pre_eps: float = 1e-6,
                     implementation: str | None = None) -> jax.Array:
  """The head's pre mix ``σ(input_mix·scale + base) + mhc_pre_eps`` (docs/mhc.md, "head_compute_mix"), float32.

  Args:
    input_mix: ``(..., M)`` float32 (upstream: exactly ``(B, S, M)``).
    mhc_scale: ``(1,)``; mhc_base: ``(M,)``.
    mhc_pre_eps: added after the sigmoid.
    implementation: accepted for uniformity; XLA code for every value (see the module docstring).

  Returns:
    ``(..., M)`` in ``promote(dtype, float32)``.

  Raises:
    ValueError (naming the argument): ``mhc_scale`` not ``(1,)``, ``mhc_base`` not ``(M,)``, non-floating dtypes,
      ``M = 0``, a non-finite ``mhc_pre_eps``.

  Differentiation: ``jax.custom_vjp`` (residuals ``input_mix, scale, base``), backward
  :func:`head_compute_mix_bwd`.
  """
  z, scale, base = _check_head(input_mix, mhc_scale, mhc_base)
  pre_eps = _checks.check_float("mhc_pre_eps", mhc_pre_eps)
  z, scale, base = _autodiff.vary_like(z, scale, base)  # replicated params, sharded mixes: one vma type
  return _head(z, scale, base, pre_eps, _config.get_implementation(implementation))
