"""``pre_big_fuse`` and ``multilayer_recompute`` (docs/mhc.md).

``pre_big_fuse`` is a composition of jaxkern's own mHC ops, traced into the caller's jit (no kernel of its own),
so it is bit-identical to the unfused chain of those ops by construction, on every backend and under every
implementation (the exact-equality tests; docs/mhc.md, "pre_big_fuse"). Each part takes the implementation given here and
makes its own dispatch decision (``jaxkern.explain`` lists one decision per part, not one for the composite).
What a fused kernel would fuse (later performance work): after the ``pre_norm_fn`` GEMM (which reads the residual
once), one kernel per token block doing the split-partial sum and the RMS normalisation, the affine + sigmoid split,
the Sinkhorn iteration (in registers) and the pre-mix application, which reads the residual a second time. The
unfused chain additionally writes and reads the ``(T, 24)`` mixes, the split mixes and the Sinkhorn output (a few
hundred bytes per token, against ``2·M·H`` bytes per residual read) and launches five kernels or fusions instead
of two.

``multilayer_recompute`` runs one fused kernel (:mod:`jaxkern.mhc._recompute_kernel`) that keeps the running
residual in registers and streams each layer's small inputs (docs/mhc.md, "multilayer_recompute"; it moves ``io_fused = 2nMH + L(4nM +
2nH) + Lp(2nH + 4nM + 4nM² + 2nMH)`` bytes against the composition's ``io_ref = L·io_pre + Lp·io_post``, which
re-reads every residual ``R_i`` once for ``pre_apply_mix`` and once for ``post``), bit-identical to the
composition run with the same implementation; the composition is its XLA path.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.mhc import _apply, _common, _post, _recompute_kernel as rck
from jaxkern.mhc._apply import pre_apply_mix
from jaxkern.mhc._mixes import pre_split_mixes
from jaxkern.mhc._norm_fn import _check_residual_fn, _check_splits, pre_norm_fn
from jaxkern.mhc._post import post
from jaxkern.mhc._sinkhorn import sinkhorn_normalize
from jaxkern.types import MultilayerRecompute, PreBigFuse

BIG_FUSE_ADVICE = ("it is the inference (no-gradient) path; differentiate jaxkern.modeling.mhc_pre, whose "
                   "custom_vjp runs the same forward (bit-identical) and the parts' backward passes")
RECOMPUTE_ADVICE = ("it rebuilds activations for checkpointing; differentiate the per-layer ops "
                    "(jaxkern.mhc.pre_apply_mix, jaxkern.mhc.post)")


def pre_big_fuse(residual: jax.Array, fn: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array,
                 norm_weight: jax.Array | None = None, *, rms_eps: float = 1e-6, mhc_pre_eps: float = 1e-6,
                 mhc_sinkhorn_eps: float = 1e-6, mhc_post_mult_value: float = 1.0, sinkhorn_repeat: int = 10,
                 n_splits: int = 16, implementation: str | None = None) -> PreBigFuse:
  """The fused mHC pre-processing of the inference path (docs/mhc.md, "pre_big_fuse"): mixes, Sinkhorn and sublayer input.

  Exactly :func:`pre_norm_fn` -> :func:`pre_split_mixes` -> :func:`sinkhorn_normalize` (comb logits) ->
  :func:`pre_apply_mix` (pre mix). Upstream's fused kernel must be bit-identical to that chain; this first
  version *is* that chain (the module docstring says what a fused kernel would fuse), so it is bit-identical
  to the unfused jaxkern ops run with the same implementation.

  Args:
    residual: ``(..., M, H)`` bfloat16 residual streams (``M = 4``: ``pre_norm_fn``'s constraint; any leading
      dims, also zero-size).
    fn: ``(J, M·H)`` float32, ``J = M(M+2) = 24``.
    mhc_scale: ``(3,)`` float32; mhc_base: ``(J,)`` float32.
    norm_weight: optional ``(M·H,)`` RMSNorm weight, merged into ``fn`` before the TF32 rounding (docs/mhc.md, "pre_big_fuse":
      upstream's inference path ignores it; jaxkern merges it on both paths so they agree).
    rms_eps: RMS epsilon of ``pre_norm_fn``; mhc_pre_eps: added to the pre mix; mhc_sinkhorn_eps: Sinkhorn's
      eps; mhc_post_mult_value: post-mix multiplier (non-zero); sinkhorn_repeat: Sinkhorn iterations.
    n_splits: ``pre_norm_fn``'s split-K bound (performance only).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``, passed to
      every part.

  Returns:
    ``PreBigFuse(post_mix (..., M, 1) float32, comb_mix (..., M, M) float32, layer_input (..., H))`` in
    upstream's order; ``layer_input`` in the residual's dtype.

  Raises:
    ValueError (naming the argument): as the parts (``M`` other than 4, ``fn`` not ``(24, 4H)``, ``mhc_scale``
      not ``(3,)``, ``mhc_base`` not ``(24,)``, ``norm_weight`` not ``(4H,)``, bad scalars).
    :class:`jaxkern.KernelUnavailableError` under ``"pallas"`` / ``"interpret"`` where a part's kernel cannot
      run (e.g. ``pre_norm_fn`` needs ``M·H`` a multiple of 256, ``H`` a multiple of 64).

  XLA instead of kernels: each part decides for itself (see their docstrings; on an H100 ``"auto"`` currently
  runs XLA for ``pre_norm_fn``'s forward and ``pre_apply_mix``); zero tokens run XLA.

  Numerics: those of the parts; bit-identical to the unfused chain of jaxkern ops.

  Non-finite values: a token whose mixes are not finite (:func:`pre_norm_fn_fwd`: a residual element not finite,
  or a float32 overflow) gets unspecified outputs: a NaN mix in one and a ±inf one in the other go through
  Sinkhorn differently (e.g. NaN against 0). Checkify reports the first such mixes entry.

  Differentiation: none (the inference path): :class:`jaxkern.NotDifferentiableError`;
  :func:`jaxkern.modeling.mhc_pre` is the differentiable form (same forward values).
  """
  residual, fn = _check_residual_fn(residual, fn)
  m = residual.shape[-2]
  rms_eps = _checks.check_float("rms_eps", rms_eps, nonnegative=True)
  n_splits = _check_splits(n_splits)
  sinkhorn_repeat = _common.repeat(sinkhorn_repeat)
  mhc_sinkhorn_eps = _checks.check_float("mhc_sinkhorn_eps", mhc_sinkhorn_eps, nonnegative=True)
  mhc_pre_eps = _checks.check_float("mhc_pre_eps", mhc_pre_eps)
  mhc_post_mult_value = _checks.check_float("mhc_post_mult_value", mhc_post_mult_value, nonzero=True)
  scale = _common.array("mhc_scale", mhc_scale, 1)
  _common.shape("mhc_scale", scale, (3,))
  base = _common.array("mhc_base", mhc_base, 1)
  _common.shape("mhc_base", base, (fn.shape[0],))
  if norm_weight is not None:
    norm_weight = _common.array("norm_weight", norm_weight, 1)
    _common.shape("norm_weight", norm_weight, (fn.shape[1],))
  residual, fn, scale, base, norm_weight = _autodiff.guard("pre_big_fuse", BIG_FUSE_ADVICE, residual, fn, scale,
                                                           base, norm_weight)
  impl = _config.get_implementation(implementation)
  mixes = pre_norm_fn(residual, fn, norm_weight, norm_eps=rms_eps, n_splits=n_splits, implementation=impl)
  pre, post_mix, comb = pre_split_mixes(mixes, scale, base, mhc_mult=m, mhc_post_mult_value=mhc_post_mult_value,
                                        mhc_pre_eps=mhc_pre_eps, implementation=impl)
  comb = sinkhorn_normalize(comb, repeat=sinkhorn_repeat, eps=mhc_sinkhorn_eps, implementation=impl)
  return PreBigFuse(post_mix, comb, pre_apply_mix(residual, pre, implementation=impl))


def _list(name, seq):
  if isinstance(seq, jax.Array) or not isinstance(seq, Sequence) or isinstance(seq, str):
    raise ValueError(f"{name} must be a list or tuple of arrays, got {type(seq).__name__}")
  return [_common.array(f"{name}[{i}]", a, 1) for i, a in enumerate(seq)]


RECOMPUTE_HIDDEN_MULTIPLE = 128  # the fused kernel's 1-D hidden chunks span 128 threads (rck.chunk_plan)


def _recompute_unsupported(r, pres, outs, posts, combs):
  """Why the fused kernel cannot run (None where it can): dtypes and ``M`` where the per-layer kernels run, so
  that its numerics follow theirs, and its own hidden-size constraint."""
  if r.dtype != jnp.bfloat16:
    return f"initial_residual has dtype {r.dtype.name}; the kernel takes bfloat16"
  for name, lst, want in (("layer_output_list", outs, jnp.bfloat16), ("pre_mix_list", pres, jnp.float32),
                          ("post_mix_list", posts, jnp.float32), ("comb_mix_list", combs, jnp.float32)):
    for i, a in enumerate(lst):
      if a.dtype != want:
        return f"{name}[{i}] has dtype {a.dtype.name}; the kernel takes {jnp.dtype(want).name}"
  if r.shape[-2] > _post.MAX_M:
    return f"initial_residual.shape[-2] (M) = {r.shape[-2]}; the kernel takes M <= {_post.MAX_M} (post's kernel)"
  if r.shape[-1] % RECOMPUTE_HIDDEN_MULTIPLE:
    return (f"initial_residual.shape[-1] (H) = {r.shape[-1]}; the fused kernel takes H a multiple of "
            f"{RECOMPUTE_HIDDEN_MULTIPLE} (implementation='auto' / 'xla' run the layer-by-layer kernels, which "
            "take any H)")
  return None


def _pre_apply_mix_is_kernel(impl, r, pre) -> bool:
  """Whether the composition's ``pre_apply_mix`` runs its kernel (FMA-contracted sums) rather than XLA (separately
  rounded products on a GPU) for these arguments: the fused kernel rounds its sublayer inputs the same way."""
  d = _dispatch.decide("pre_apply_mix", impl, unsupported=_apply._unsupported(r, pre),
                       xla_faster=_common.xla_faster("pre_apply_mix", _apply._FWD_SLOWER))
  return d.path in ("pallas", "interpret")


def multilayer_recompute(initial_residual: jax.Array, pre_mix_list: Sequence[jax.Array],
                         layer_output_list: Sequence[jax.Array], post_mix_list: Sequence[jax.Array],
                         comb_mix_list: Sequence[jax.Array], *,
                         implementation: str | None = None) -> MultilayerRecompute:
  """Rebuild the sublayer inputs and residuals of ``L`` mHC layers from the first residual (docs/mhc.md, "multilayer_recompute").

  ``R_0 = initial_residual``; for ``i = 0..L-1``: ``layer_input[i] = pre_apply_mix(R_i, pre_mix[i])`` and, if
  ``i < Lp``, ``R_{i+1} = post(layer_output[i], R_i, post_mix[i], comb_mix[i])``. Kernel path: one fused Mosaic
  GPU kernel (:mod:`jaxkern.mhc._recompute_kernel`) that reads ``R_0`` once and keeps each token's residual
  chunk in registers across the layers, bit-identical to calling :func:`pre_apply_mix` and :func:`post` layer by
  layer with the same implementation (upstream's test demands exact equality): under ``"auto"`` the
  composition's ``pre_apply_mix`` is XLA (separately rounded products) and its ``post`` the kernel, and the fused
  kernel rounds as they do; under ``"pallas"`` / ``"interpret"`` both are kernels. XLA path: that composition,
  each part dispatching for itself. Upstream writes into preallocated output lists; here the outputs are returned.

  Args:
    initial_residual: ``(..., M, H)`` bfloat16 (for the kernel); any leading dims.
    pre_mix_list: ``L >= 1`` arrays ``(..., M, 1)`` float32.
    layer_output_list: ``Lp`` arrays ``(..., H)`` (the residual's dtype), ``Lp`` in ``{L - 1, L}``.
    post_mix_list: ``Lp`` arrays ``(..., M, 1)`` float32; comb_mix_list: ``Lp`` arrays ``(..., M, M)`` float32
      (after Sinkhorn).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``; the XLA
      path passes it to every :func:`pre_apply_mix` / :func:`post`.

  Returns:
    ``MultilayerRecompute(layer_input_list, residual_list)``: tuples of ``L`` arrays ``(..., H)`` and ``Lp``
    arrays ``(..., M, H)`` (``R_1 .. R_Lp``) in the residual's dtype.

  Raises:
    ValueError (naming the argument, e.g. ``post_mix_list[2]``): empty ``pre_mix_list``, ``Lp`` not in
      ``{L - 1, L}``, lists of different lengths, shapes that do not match ``initial_residual``, non-floating
      dtypes, arguments that are not lists / tuples.
    :class:`jaxkern.KernelUnavailableError` under ``"pallas"`` / ``"interpret"`` where the kernel cannot run
      (below).

  XLA instead of the kernel (the composition): zero tokens; under ``"auto"`` also dtypes other than a bfloat16
  residual and layer outputs with float32 mixes and ``M > 4`` (where the per-layer kernels do not run either),
  and ``H`` not a multiple of 128 (the fused kernel's constraint; the per-layer kernels take any ``H``).

  Non-finite results: as :func:`pre_apply_mix` and :func:`post`, a column ``h`` in which a product of finite
  factors overflows float32 is unspecified from that layer on (in that layer's input, and in every later layer
  input and residual: the streams mix per column).

  Differentiation: none (activation recompute): :class:`jaxkern.NotDifferentiableError`.
  """
  r, lead, m, h = _common.streams("initial_residual", initial_residual)
  pres, outs = _list("pre_mix_list", pre_mix_list), _list("layer_output_list", layer_output_list)
  posts, combs = _list("post_mix_list", post_mix_list), _list("comb_mix_list", comb_mix_list)
  n, np_ = len(pres), len(outs)
  if n == 0:
    raise ValueError("pre_mix_list must hold at least one layer's pre mix, got an empty list")
  if np_ not in (n - 1, n):
    raise ValueError(f"layer_output_list must hold L - 1 or L = {n} arrays (L = len(pre_mix_list)), got {np_}")
  for name, lst in (("post_mix_list", posts), ("comb_mix_list", combs)):
    if len(lst) != np_:
      raise ValueError(f"{name} must hold len(layer_output_list) = {np_} arrays, got {len(lst)}")
  for name, lst, want in (("pre_mix_list", pres, (*lead, m, 1)), ("layer_output_list", outs, (*lead, h)),
                          ("post_mix_list", posts, (*lead, m, 1)), ("comb_mix_list", combs, (*lead, m, m))):
    for i, a in enumerate(lst):
      _common.shape(f"{name}[{i}]", a, want)
  r, *rest = _autodiff.guard("multilayer_recompute", RECOMPUTE_ADVICE, r, *pres, *outs, *posts, *combs)
  pres, rest = rest[:n], rest[n:]
  outs, posts, combs = rest[:np_], rest[np_:2 * np_], rest[2 * np_:]
  impl = _config.get_implementation(implementation)
  t = _common.tokens(lead)

  def composition():
    inputs, residuals, res = [], [], r
    for i in range(n):
      inputs.append(pre_apply_mix(res, pres[i], implementation=impl))
      if i < np_:
        res = post(outs[i], res, posts[i], combs[i], implementation=impl)
        residuals.append(res)
    return MultilayerRecompute(tuple(inputs), tuple(residuals))

  def kernel(interpret):
    inputs, residuals = rck.recompute_kernel(
        r.reshape(t, m, h), [a.reshape(t, m) for a in pres], [a.reshape(t, h) for a in outs],
        [a.reshape(t, m) for a in posts], [a.reshape(t, m * m) for a in combs],
        contract_pre=_pre_apply_mix_is_kernel(impl, r, pres[0]), config=rck.current_config(),
        interpret=_config.mosaic_interpret(interpret))
    return MultilayerRecompute(tuple(a.reshape(*lead, h) for a in inputs),
                               tuple(a.reshape(*lead, m, h) for a in residuals))

  return _dispatch.run("multilayer_recompute", impl, kernel=kernel, xla=composition, empty=t == 0,
                       unsupported=_recompute_unsupported(r, pres, outs, posts, combs))
