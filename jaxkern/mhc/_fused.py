"""``pre_big_fuse`` (engram_mhc.md §4.9) and ``multilayer_recompute`` (§4.10).

``pre_big_fuse``: two Mosaic GPU kernels (:mod:`jaxkern.mhc._fuse_kernel`): the ``pre_norm_fn`` forward GEMM
(split partials, unchanged), then one fused epilogue kernel (split sum, RMS normalisation, affine + sigmoid
split, Sinkhorn in registers, pre-mix application), bit-identical to the unfused chain of the kernels (same
operations in the same order; the GPU check is ``tests/mhc/test_fused.py::test_gpu_pre_big_fuse_bit_exact``).
Shapes the kernels do not take (below) run the composition of jaxkern's own ops (each part dispatching
itself), bit-identical to that chain by construction.

What reaching copy bandwidth needs (not done): the epilogue still reads the residual a second time from HBM
(``2·M·H`` bytes per token again, plus the ``2·H`` output), so by the spec's byte count (residual once) the pair
is bounded near 55% of copy at ``T = 8192``, ``H = 7168`` (the composition measured 52% there on an H100). A
single-pass kernel must apply the pre mix to residual data still on chip, and the numbers at ``H = 7168``
(57 KiB of residual per token, 227 KiB SMEM per SM, 50 MB L2, 132 SMs) rule out the simple schedules:

* one CTA owning a token block over all of ``K``: the pre mix needs the whole row's GEMM first, so the block
  must stay in SMEM (at most 3 tokens fit, below a wgmma N of 8) or in L2 (``132 · n_tok · 57 KiB`` in flight:
  ``n_tok = 8`` is already 60 MB); and with so few tokens per step the ``fn`` operand (``2·24·64`` bf16 per
  64-column step) is re-read from L2 for every 8 tokens: about 6x the residual bytes, beyond L2 bandwidth;
* hence a cluster of CTAs per token block of 64+ tokens, each CTA reading the columns ``{m·H + h : m < M,
  h in its H-slice}`` (so it can apply the pre mix to exactly the data it read, from SMEM or from L2 right
  after), the split partials exchanged through DSMEM / GMEM behind a cluster barrier and summed in the same
  fixed order by every CTA; the unfused ``pre_norm_fn`` GEMM would have to use the same strided splits (and
  split count) to stay bit-identical.

``multilayer_recompute``: the composition of jaxkern's own ops (no kernel of its own), bit-identical to the
layer-by-layer chain by construction. What a fused kernel would fuse: one pass that keeps the running residual
in registers and streams each layer's small inputs (spec §6.4:
``io_fused = 2nMH + L(4nM + 2nH) + Lp(2nH + 4nM + 4nM² + 2nMH)`` against ``io_ref = L·io_pre + Lp·io_post``);
the composition re-reads every residual ``R_i`` once for ``pre_apply_mix`` and once for ``post``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern.mhc import _common, _fuse_kernel, _norm_fn
from jaxkern.mhc._apply import pre_apply_mix
from jaxkern.mhc._mixes import pre_split_mixes
from jaxkern.mhc._norm_fn import _check_residual_fn, _check_splits, pre_norm_fn
from jaxkern.mhc._post import post
from jaxkern.mhc._sinkhorn import sinkhorn_normalize
from jaxkern.reference import mhc_norm as mhc_norm_ref
from jaxkern.types import MultilayerRecompute, PreBigFuse

BIG_FUSE_ADVICE = ("it is the inference (no-gradient) path; differentiate jaxkern.modeling.mhc_pre, whose "
                   "custom_vjp runs the same forward (bit-identical) and the parts' backward passes")
# "auto" runs the composition until the fused kernels are checked bit-exact against the unfused chain on a GPU
# (scratch/gpu_mhcfuse.sh; tests/mhc/test_fused.py::test_gpu_pre_big_fuse_bit_exact) and timed: on the GPU the
# chain's normalisation and sigmoid are XLA code and the fused kernel's are Mosaic GPU code (``rsqrt``, ``exp``,
# ``/``), which may round differently. (Under "auto" the chain's pre_apply_mix is XLA too: making the kernel the
# "auto" path also needs the chain's "auto" parts to be the kernels, or jaxkern.modeling.mhc_pre's forward with
# and without gradients would differ.)
_AUTO_XLA = "fused kernel not yet checked bit-exact on a GPU (2026-11-26)"
RECOMPUTE_ADVICE = ("it rebuilds activations for checkpointing; differentiate the per-layer ops "
                    "(jaxkern.mhc.pre_apply_mix, jaxkern.mhc.post)")


def pre_big_fuse(residual, fn, mhc_scale, mhc_base, norm_weight=None, *, rms_eps: float = 1e-6,
                 mhc_pre_eps: float = 1e-6, mhc_sinkhorn_eps: float = 1e-6, mhc_post_mult_value: float = 1.0,
                 sinkhorn_repeat: int = 10, n_splits: int = 16, implementation: str | None = None) -> PreBigFuse:
  """The fused mHC pre-processing of the inference path (spec §4.9): mixes, Sinkhorn and sublayer input.

  Exactly :func:`pre_norm_fn` -> :func:`pre_split_mixes` -> :func:`sinkhorn_normalize` (comb logits) ->
  :func:`pre_apply_mix` (pre mix). Kernel path: the ``pre_norm_fn`` GEMM kernel, then one fused epilogue
  kernel (:mod:`jaxkern.mhc._fuse_kernel`), bit-identical to that chain run with the kernels
  (``implementation="pallas"`` / ``"interpret"``). XLA path (also ``"auto"`` for now, see ``_AUTO_XLA``): the
  chain itself, each part dispatching for itself, so ``"auto"`` stays bit-identical to the ``"auto"`` chain
  (whose ``pre_apply_mix`` is XLA: no FMA contraction) and to :func:`jaxkern.modeling.mhc_pre`'s forward.

  Args:
    residual: ``(..., M, H)`` bfloat16 residual streams (``M = 4``: ``pre_norm_fn``'s constraint; any leading
      dims, also zero-size).
    fn: ``(J, M·H)`` float32, ``J = M(M+2) = 24``.
    mhc_scale: ``(3,)`` float32; mhc_base: ``(J,)`` float32.
    norm_weight: optional ``(M·H,)`` RMSNorm weight, merged into ``fn`` before the TF32 rounding (spec §8.3:
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
    :class:`jaxkern.KernelUnavailableError` under ``"pallas"`` / ``"interpret"`` where the fused kernels cannot
      run (below).

  XLA instead of the fused kernels (the composition, each part deciding for itself): zero tokens; ``"auto"``
  (until the GPU check, ``_AUTO_XLA``); a residual other than bfloat16, ``fn`` / ``mhc_scale`` / ``mhc_base`` / ``norm_weight`` other
  than float32, ``H`` not a multiple of 128 of at least 1024 (the apply loop's ``(8, 128)`` tiles; this also
  gives ``K % 256 == 0`` for the GEMM). Any ``T >= 1`` runs the kernels (``T < 32`` is padded to one block).

  Numerics: those of the parts; bit-identical to the unfused chain of jaxkern ops (kernel path: the chain of
  the kernels, see above).

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
  lead, h = residual.shape[:-2], residual.shape[-1]
  t = int(np.prod(lead, dtype=np.int64))

  def composition():
    mixes = pre_norm_fn(residual, fn, norm_weight, norm_eps=rms_eps, n_splits=n_splits, implementation=impl)
    pre, post_mix, comb = pre_split_mixes(mixes, scale, base, mhc_mult=m, mhc_post_mult_value=mhc_post_mult_value,
                                          mhc_pre_eps=mhc_pre_eps, implementation=impl)
    comb = sinkhorn_normalize(comb, repeat=sinkhorn_repeat, eps=mhc_sinkhorn_eps, implementation=impl)
    return PreBigFuse(post_mix, comb, pre_apply_mix(residual, pre, implementation=impl))

  def kernel(interpret):
    f = fn if norm_weight is None else mhc_norm_ref.fn_normw_merge(fn, norm_weight)
    post_mix, comb, li = _fused_kernel(residual.reshape(t, m, h), f, scale, base, rms_eps=rms_eps,
                                       mhc_pre_eps=mhc_pre_eps, mhc_sinkhorn_eps=mhc_sinkhorn_eps,
                                       mhc_post_mult_value=mhc_post_mult_value, sinkhorn_repeat=sinkhorn_repeat,
                                       n_splits=n_splits, interpret=interpret)
    return PreBigFuse(post_mix.reshape(*lead, m, 1), comb.reshape(*lead, m, m), li.reshape(*lead, h))

  return _dispatch.run("pre_big_fuse", impl, kernel=kernel, xla=composition, empty=t == 0,
                       unsupported=_unsupported(residual, fn, scale, base, norm_weight), xla_faster=_AUTO_XLA)


def _unsupported(residual, fn, scale, base, norm_weight) -> str | None:
  bad = _norm_fn._unsupported(residual, fn)
  if bad:
    return bad
  if scale.dtype != jnp.float32 or base.dtype != jnp.float32 or (
      norm_weight is not None and norm_weight.dtype != jnp.float32):
    return "the fused kernel takes float32 mhc_scale, mhc_base and norm_weight"
  return _fuse_kernel.unsupported(residual.shape[-1])


def _fused_kernel(r, fn, scale, base, *, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
                  sinkhorn_repeat, n_splits, interpret):
  """``r (T, M, H)`` bf16, ``fn (J, K)`` float32 (merged) -> ``post (T, M)``, ``comb (T, M, M)``, ``(T, H)``.

  The GEMM exactly as :func:`jaxkern.mhc._norm_fn._fwd_kernel` (same split count for the same ``T``), then
  :func:`jaxkern.mhc._fuse_kernel.epilogue_kernel` on the packed partials (``T`` padded to its token block).
  """
  t, m, h = r.shape
  k = m * h
  fhi, flo = _norm_fn.split_bf16(mhc_norm_ref.round_to_tf32(fn))
  x2 = r.reshape(t, k)
  s = _norm_fn.num_splits(t, k, n_splits, _config.num_sms())
  om_p, sq_p = _norm_fn.fwd_mul_kernel(_norm_fn._pad_rows(x2, _norm_fn.BT), fhi, flo, splits=s,
                                       interpret=_config.mosaic_interpret(interpret))
  tp = max(t, _fuse_kernel.TB)
  parts = jnp.concatenate([om_p[:, :t], sq_p[:, :t, None], jnp.zeros((s, t, _fuse_kernel.W - fn.shape[0] - 1),
                                                                     jnp.float32)], axis=-1)
  parts = jnp.pad(parts, ((0, 0), (0, tp - t), (0, 0)))
  params = jnp.concatenate([base, scale, jnp.zeros((_fuse_kernel.W - base.shape[0] - 3,), jnp.float32)])
  small, li = _fuse_kernel.epilogue_kernel(
      parts, params, _norm_fn._pad_rows(r, tp), k=k, rms_eps=rms_eps, pre_eps=mhc_pre_eps,
      post_mult=mhc_post_mult_value, sinkhorn_eps=mhc_sinkhorn_eps, repeat=sinkhorn_repeat,
      hs=_fuse_kernel.h_splits(tp, h, _config.num_sms()), interpret=_config.mosaic_interpret(interpret))
  return small[:t, m:2 * m], small[:t, 2 * m:2 * m + m * m], li[:t]


def _list(name, seq):
  if isinstance(seq, jax.Array) or not isinstance(seq, Sequence) or isinstance(seq, str):
    raise ValueError(f"{name} must be a list or tuple of arrays, got {type(seq).__name__}")
  return [_common.array(f"{name}[{i}]", a, 1) for i, a in enumerate(seq)]


def multilayer_recompute(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, *,
                         implementation: str | None = None) -> MultilayerRecompute:
  """Rebuild the sublayer inputs and residuals of ``L`` mHC layers from the first residual (spec §4.10).

  ``R_0 = initial_residual``; for ``i = 0..L-1``: ``layer_input[i] = pre_apply_mix(R_i, pre_mix[i])`` and, if
  ``i < Lp``, ``R_{i+1} = post(layer_output[i], R_i, post_mix[i], comb_mix[i])``. First version: exactly that
  loop of jaxkern's :func:`pre_apply_mix` and :func:`post` (bit-identical to calling them layer by layer, as
  upstream's test demands); a fused kernel keeping ``R_i`` in registers is later work (module docstring).
  Upstream writes into preallocated output lists; here the outputs are returned.

  Args:
    initial_residual: ``(..., M, H)`` bfloat16 (for the kernels); any leading dims.
    pre_mix_list: ``L >= 1`` arrays ``(..., M, 1)`` float32.
    layer_output_list: ``Lp`` arrays ``(..., H)`` (the residual's dtype), ``Lp`` in ``{L - 1, L}``.
    post_mix_list: ``Lp`` arrays ``(..., M, 1)`` float32; comb_mix_list: ``Lp`` arrays ``(..., M, M)`` float32
      (after Sinkhorn).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``, passed to
      every :func:`pre_apply_mix` / :func:`post`.

  Returns:
    ``MultilayerRecompute(layer_input_list, residual_list)``: tuples of ``L`` arrays ``(..., H)`` and ``Lp``
    arrays ``(..., M, H)`` (``R_1 .. R_Lp``) in the residual's dtype.

  Raises:
    ValueError (naming the argument, e.g. ``post_mix_list[2]``): empty ``pre_mix_list``, ``Lp`` not in
      ``{L - 1, L}``, lists of different lengths, shapes that do not match ``initial_residual``, non-floating
      dtypes, arguments that are not lists / tuples.
    :class:`jaxkern.KernelUnavailableError` under ``"pallas"`` / ``"interpret"`` where the parts' kernels cannot
      run (``H`` not a multiple of 128 of at least 1024, ``M > 4`` for ``post``).

  XLA instead of kernels: as :func:`pre_apply_mix` and :func:`post` decide; zero tokens run XLA.

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
  inputs, residuals = [], []
  for i in range(n):
    inputs.append(pre_apply_mix(r, pres[i], implementation=impl))
    if i < np_:
      r = post(outs[i], r, posts[i], combs[i], implementation=impl)
      residuals.append(r)
  return MultilayerRecompute(tuple(inputs), tuple(residuals))

