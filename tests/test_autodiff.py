"""Differentiation: the quantisation casts refuse it with a NotDifferentiableError naming the op and
work on ``jax.lax.stop_gradient`` inputs; the transposes have a custom_vjp; the top-k gates give the scores a
zero cotangent (the gradient through the picked scores is their one-hot mask)."""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import moe, quant
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, randn, random_bits
from jaxkern.transpose import batched_transpose, transpose

M, K = 128, 128  # a shape every cast accepts, small enough for interpret mode
IMPLEMENTATIONS = ["reference", "interpret"]


class Case(NamedTuple):
  """A call of the quantisation op ``op`` on ``inputs`` (arrays; the floating-point ones are differentiated)."""

  op: str
  inputs: Callable  # key -> tuple of arrays
  call: Callable  # *inputs -> the op's result


def _x(key, dtype=jnp.float32):
  return randn(key, (M, K), dtype)


def _cast(key, fmt, block):
  """``(data, sf)`` of the reference cast of a random ``(M, K)`` input (power-of-two sf)."""
  return tuple(ref.cast(_x(key), fmt, block, round_sf=True))


def _with_token_sf(key):
  x = _x(key)
  return x, ref.per_token_cast_with_sf_only(x, "e4m3", 64)


def _with_block_sf(key):
  x = _x(key)
  return x, ref.per_block_cast_with_sf_only(x, "e4m3", (32, 128))


def _swiglu_backward_inputs(key):
  """``(q, sf)`` of a random ``(M, 2K)`` input cast per token, a bf16 gradient ``(M, K)``, weights ``(M/2, 2)``."""
  k1, k2, k3 = jax.random.split(key, 3)
  q, sf = ref.per_token_cast(randn(k1, (M, 2 * K), jnp.bfloat16), "e4m3", 128)
  return q, sf, randn(k2, (M, K), jnp.bfloat16), jax.random.uniform(k3, (M // 2, 2), jnp.float32)


CASES = {
    "per_token_cast": Case("per_token_cast", lambda key: (_x(key),),
                           lambda x: quant.per_token_cast(x, "e4m3", 64)),
    "per_token_cast-quant_tensor": Case(
        "per_token_cast", lambda key: _cast(key, "e4m3", (128, 128)),
        lambda q, sf: quant.per_token_cast((q, sf), "e2m1", 128, x_block_size=(128, 128))),
    "per_token_cast_with_sf_only": Case("per_token_cast_with_sf_only", lambda key: (_x(key),),
                                        lambda x: quant.per_token_cast_with_sf_only(x, "e4m3", 64)),
    "per_token_cast_with_precomputed_sf": Case(
        "per_token_cast_with_precomputed_sf", _with_token_sf,
        lambda x, sf: quant.per_token_cast_with_precomputed_sf(x, "e4m3", 64, sf)),
    "per_block_cast": Case("per_block_cast", lambda key: (_x(key),),
                           lambda x: quant.per_block_cast(x, "e4m3", (32, 128))),
    "per_block_cast_with_sf_only": Case("per_block_cast_with_sf_only", lambda key: (_x(key),),
                                        lambda x: quant.per_block_cast_with_sf_only(x, "e4m3", (32, 128))),
    "per_block_cast_with_precomputed_sf": Case(
        "per_block_cast_with_precomputed_sf", _with_block_sf,
        lambda x, sf: quant.per_block_cast_with_precomputed_sf(x, "e2m1", (32, 128), sf)),
    "per_block_cast_lossless": Case(
        "per_block_cast_lossless", lambda key: _cast(key, "e2m1", (1, 32)),
        lambda q, sf: quant.per_block_cast_lossless((q, sf), "e4m3", (1, 32), (32, 128))),
    "per_channel_cast": Case("per_channel_cast", lambda key: (_x(key),),
                             lambda x: quant.per_channel_cast(x, "e4m3", 128)),
    "per_channel_cast_and_transpose": Case("per_channel_cast_and_transpose", lambda key: (_x(key, jnp.bfloat16),),
                                           lambda x: quant.per_channel_cast_and_transpose(x, "e4m3", 32)),
    "per_channel_cast_fused-gather": Case(
        "per_channel_cast_fused", lambda key: (_x(key),),
        lambda x: quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=jnp.arange(M - 2, -2, -1))),
    "per_channel_cast_fused-quant_tensor": Case(
        "per_channel_cast_fused", lambda key: _cast(key, "e4m3", (1, 128)),
        lambda q, sf: quant.per_channel_cast_fused((q, sf), "e4m3", 128, num_per_channels=128)),
    "cast_back": Case("cast_back", lambda key: _cast(key, "e4m3", (32, 128)),
                      lambda q, sf: quant.cast_back((q, sf), "fp32", (32, 128))),
    "cast_back-e2m1": Case("cast_back", lambda key: _cast(key, "e2m1", (1, 32)),
                           lambda q, sf: quant.cast_back((q, sf), "bf16", (1, 32))),
    "per_token_cast_back": Case("per_token_cast_back", lambda key: _cast(key, "e4m3", (1, 64)),
                                lambda q, sf: quant.per_token_cast_back((q, sf), "bf16", 64)),
    "per_token_cast_to_e5m6": Case("per_token_cast_to_e5m6", lambda key: (_x(key),),
                                   lambda x: quant.per_token_cast_to_e5m6(x, K)),
    "cast_back_e5m6": Case("cast_back_e5m6", lambda key: tuple(ref.per_token_cast_to_e5m6(_x(key), K)),
                           lambda q, sf: quant.cast_back_e5m6((q, sf), "fp32", (1, K))),
    "swiglu_forward_and_per_token_cast": Case(
        "swiglu_forward_and_per_token_cast", lambda key: (randn(key, (M, 2 * K), jnp.bfloat16),),
        lambda x: quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)),
    "swiglu_forward_and_per_channel_cast_and_transpose": Case(
        "swiglu_forward_and_per_channel_cast_and_transpose", lambda key: (randn(key, (M, 2 * K), jnp.bfloat16),),
        lambda x: quant.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, swiglu_clamp_value=0.5)),
    "swiglu_backward_and_per_token_cast": Case(
        "swiglu_backward_and_per_token_cast", _swiglu_backward_inputs,
        lambda q, sf, g, w: quant.swiglu_backward_and_per_token_cast(
            (q, sf), g, w, jnp.arange(M, dtype=jnp.int32), jnp.arange(M, dtype=jnp.int32).reshape(M // 2, 2), 128)),
}


def test_every_quant_op_has_a_case():
  """``unpack_from_e2m1fn_x2`` has no floating-point input (see :func:`test_unpack_has_no_derivative`)."""
  ops = {name for name in quant.__all__
         if name not in ("QuantTensor", "QuantTensorWithClampedCount", "SwigluBackward", "sf_logical",
                             "sf_to_float")}
  assert {case.op for case in CASES.values()} == ops - {"unpack_from_e2m1fn_x2"}


def _floating(inputs):
  return tuple(i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.inexact))


def _total(out):
  """A float32 scalar that depends on every leaf of ``out``."""
  return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))


def _of_one(case, inputs, i):
  """``case.call`` as a scalar function of ``inputs[i]`` alone."""
  return lambda x: _total(case.call(*inputs[:i], x, *inputs[i + 1:]))


TRANSFORMS = {
    "grad": lambda f, x: jax.grad(f)(x),
    "jit-grad": lambda f, x: jax.jit(jax.grad(f))(x),
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "vjp": lambda f, x: jax.vjp(f, x),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", CASES)
def test_quant_op_raises_under_differentiation(key, case, transform, implementation):
  """Also with the (``jnp``, differentiable) reference, which ``"auto"`` runs off a GPU."""
  case = CASES[case]
  inputs = case.inputs(key)
  assert _floating(inputs), "nothing to differentiate"
  for i in _floating(inputs):  # each floating-point input (data and sf of a QuantTensor) on its own
    with jaxkern.use_implementation(implementation), pytest.raises(
        jaxkern.NotDifferentiableError,
        match=rf"^jaxkern op '{case.op}' is not differentiable: .*jax\.lax\.stop_gradient"):
      TRANSFORMS[transform](_of_one(case, inputs, i), inputs[i])


@pytest.mark.parametrize("case", CASES)
def test_quant_op_on_stopped_gradient_inputs(key, case):
  """Inside a differentiated function, the op applied to ``jax.lax.stop_gradient`` of its inputs runs (the kernel,
  as without differentiation) and the rest of the function has its gradient."""
  case = CASES[case]
  inputs = case.inputs(key)
  floating = _floating(inputs)

  def loss(*xs):
    out = case.call(*map(jax.lax.stop_gradient, xs))
    return 2 * sum(jnp.sum(xs[i].astype(jnp.float32)) for i in floating) + _total(out), out

  grads, out = jax.grad(loss, argnums=floating, has_aux=True)(*inputs)
  assert_bitwise_equal(out, case.call(*inputs))
  for i, g in zip(floating, grads):
    assert_bitwise_equal(g, jnp.full_like(inputs[i], 2))


def test_unpack_has_no_derivative(key):
  """Integer bytes in: a constant to ``jax.grad`` / ``jax.jvp`` (a zero tangent), no error."""
  b = random_bits(key, (M, K // 2), jnp.int8)
  values = quant.unpack_from_e2m1fn_x2(b)
  assert_bitwise_equal(jax.grad(lambda w: jnp.sum(w * quant.unpack_from_e2m1fn_x2(b)))(values), values)
  out, tangent = jax.jvp(quant.unpack_from_e2m1fn_x2, (b,), (np.zeros(b.shape, jax.dtypes.float0),))
  assert_bitwise_equal(out, values)
  assert_bitwise_equal(tangent, jnp.zeros_like(values))


TRANSPOSES = [(transpose, (64, 128)), (batched_transpose, (2, 64, 128))]


def _swap(x):
  return np.swapaxes(np.asarray(x), -1, -2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op, shape", TRANSPOSES, ids=["transpose", "batched_transpose"])
def test_transpose_check_grads(key, op, shape, implementation):
  x = randn(key, shape, jnp.float32)
  check_grads(jax.jit(functools.partial(op, implementation=implementation)), (x,), order=1, modes=("rev",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op, shape", TRANSPOSES, ids=["transpose", "batched_transpose"])
def test_transpose_vjp_is_the_transposed_cotangent(key, op, shape, implementation, dtype):
  k1, k2 = jax.random.split(key)
  x = randn(k1, shape, dtype)
  dy = randn(k2, _swap(x).shape, dtype)
  y, vjp = jax.vjp(functools.partial(op, implementation=implementation), x)
  assert_bitwise_equal(y, _swap(x))
  (dx,) = vjp(dy)
  assert_bitwise_equal(dx, _swap(dy))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op, shape", TRANSPOSES, ids=["transpose", "batched_transpose"])
def test_transpose_grad_under_vmap_and_jit(key, op, shape, implementation):
  k1, k2 = jax.random.split(key)
  xs = randn(k1, (3, *shape), jnp.float32)
  w = randn(k2, _swap(xs[0]).shape, jnp.float32)
  grad = jax.grad(lambda x: jnp.sum(op(x, implementation=implementation) * w))
  assert_bitwise_equal(jax.jit(jax.vmap(grad))(xs), np.broadcast_to(_swap(w), xs.shape))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_integer_transpose_under_vmap(key, implementation):
  x = random_bits(key, (2, 64, 128), jnp.int8)
  assert_bitwise_equal(jax.vmap(functools.partial(transpose, implementation=implementation))(x), _swap(x))


def _one_hot(shape, rows, picked):
  """Ones at ``[rows, picked]`` (whole trailing slices for a rank-3 ``shape``), zeros elsewhere."""
  return jnp.zeros(shape, jnp.float32).at[rows[:, None], picked].set(1.0)


@pytest.mark.parametrize("implementation", ["interpret", "reference"])
def test_topk_gate_gradient_is_the_one_hot_mask(key, implementation):
  scores = jax.random.normal(key, (8, 16), jnp.float32)

  def picked_sum(s):
    return jnp.sum(jnp.take_along_axis(s, moe.topk_gate(s, 3, implementation=implementation), axis=1))

  want = _one_hot(scores.shape, jnp.arange(8), jax.lax.top_k(scores, 3)[1])
  assert_bitwise_equal(jax.grad(picked_sum)(scores), want)


@pytest.mark.parametrize("num_topk_sum", [1, 2])
@pytest.mark.parametrize("implementation", ["interpret", "reference"])
def test_topk_group_idx_gradient_is_the_one_hot_mask(key, implementation, num_topk_sum):
  scores = jax.random.normal(key, (8, 4, 4), jnp.float32)

  def picked_groups_sum(s):
    groups = moe.topk_sum_and_topk_group_idx(s, num_topk_sum, 2, implementation=implementation)
    return jnp.sum(jnp.take_along_axis(s, groups[:, :, None], axis=1))

  group_scores = jnp.sum(jax.lax.top_k(scores, num_topk_sum)[0], axis=2)
  want = _one_hot(scores.shape, jnp.arange(8), jax.lax.top_k(group_scores, 2)[1])
  assert_bitwise_equal(jax.grad(picked_groups_sum)(scores), want)


# ---------------------------------------------------------------------------------------------- mHC
# The backward passes and building blocks of jaxkern.mhc raise NotDifferentiableError (their forward ops are
# custom_vjps; pre_big_fuse is the inference path of jaxkern.modeling.mhc_pre, multilayer_recompute the
# checkpoint recompute of pre_apply_mix / post).

from jaxkern import mhc  # noqa: E402

T_MHC, M_MHC, H_MHC = 3, 4, 64
J_MHC = M_MHC * (M_MHC + 2)


def _mhc_arrays(key, *shapes):
  """Random arrays; shapes given as (shape, dtype)."""
  ks = jax.random.split(key, len(shapes))
  return tuple(jax.random.normal(k, s).astype(d) for k, (s, d) in zip(ks, shapes))


BF, F32 = jnp.bfloat16, jnp.float32
_R = ((T_MHC, M_MHC, H_MHC), BF)
_X = ((T_MHC, H_MHC), BF)
_MIX = ((T_MHC, M_MHC, 1), F32)
_COMB = ((T_MHC, M_MHC, M_MHC), F32)
_FN = ((J_MHC, M_MHC * H_MHC), F32)


def _norm_bwd_inputs(key):
  r, fn, g = _mhc_arrays(key, _R, _FN, ((T_MHC, J_MHC), F32))
  saved = jax.lax.stop_gradient(mhc.pre_norm_fn_fwd(r, fn, implementation="reference"))
  return g, r, fn, saved.out_mul, saved.sqrsum


MHC_CASES = {
    "expand_to_mhc_bwd": Case("expand_to_mhc_bwd", lambda key: _mhc_arrays(key, _R), mhc.expand_to_mhc_bwd),
    "pre_apply_mix_bwd": Case("pre_apply_mix_bwd", lambda key: _mhc_arrays(key, _X, _R, _MIX, _R),
                              mhc.pre_apply_mix_bwd),
    "post_bwd": Case("post_bwd", lambda key: _mhc_arrays(key, _R, _X, _R, _MIX, _COMB), mhc.post_bwd),
    "sinkhorn_normalize_bwd": Case("sinkhorn_normalize_bwd", lambda key: _mhc_arrays(key, _COMB, _COMB),
                                   mhc.sinkhorn_normalize_bwd),
    "pre_split_mixes_bwd": Case(
        "pre_split_mixes_bwd",
        lambda key: _mhc_arrays(key, _MIX, _MIX, _COMB, ((T_MHC, J_MHC), F32), _MIX, ((3,), F32), ((J_MHC,), F32)),
        functools.partial(mhc.pre_split_mixes_bwd, mhc_mult=M_MHC, mhc_post_mult_value=1.0)),
    "head_compute_mix_bwd": Case(
        "head_compute_mix_bwd",
        lambda key: _mhc_arrays(key, ((T_MHC, M_MHC), F32), ((T_MHC, M_MHC), F32), ((1,), F32), ((M_MHC,), F32)),
        mhc.head_compute_mix_bwd),
    "pre_norm_fn_fwd": Case("pre_norm_fn_fwd", lambda key: _mhc_arrays(key, _R, _FN), mhc.pre_norm_fn_fwd),
    "pre_norm_fn_bwd": Case("pre_norm_fn_bwd", _norm_bwd_inputs, mhc.pre_norm_fn_bwd),
    "pre_big_fuse": Case("pre_big_fuse", lambda key: _mhc_arrays(key, _R, _FN, ((3,), F32), ((J_MHC,), F32)),
                         mhc.pre_big_fuse),
    "multilayer_recompute": Case(
        "multilayer_recompute", lambda key: _mhc_arrays(key, _R, _MIX, _MIX, _X, _MIX, _COMB),
        lambda r, p0, p1, y, post, comb: mhc.multilayer_recompute(r, [p0, p1], [y], [post], [comb])),
}


def test_every_non_differentiable_mhc_op_has_a_case():
  """The other jaxkern.mhc ops are custom_vjps (or plain jnp: fn_normw_merge, round_to_tf32)."""
  differentiable = {"expand_to_mhc", "pre_apply_mix", "post", "sinkhorn_normalize", "pre_split_mixes",
                    "head_compute_mix", "pre_norm_fn", "fn_normw_merge", "round_to_tf32"}
  assert {case.op for case in MHC_CASES.values()} == set(mhc.__all__) - differentiable


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", MHC_CASES)
def test_mhc_op_raises_under_differentiation(key, case, transform, implementation):
  case = MHC_CASES[case]
  inputs = case.inputs(key)
  for i in _floating(inputs):
    with jaxkern.use_implementation(implementation), pytest.raises(
        jaxkern.NotDifferentiableError, match=rf"^jaxkern op '{case.op}' is not differentiable: "):
      TRANSFORMS[transform](_of_one(case, inputs, i), inputs[i])


@pytest.mark.parametrize("case", MHC_CASES)
def test_mhc_op_on_stopped_gradient_inputs(key, case):
  case = MHC_CASES[case]
  inputs = case.inputs(key)
  floating = _floating(inputs)

  def loss(*xs):
    with jaxkern.use_implementation("xla"):
      out = case.call(*map(jax.lax.stop_gradient, xs))
    return 2 * sum(jnp.sum(xs[i].astype(jnp.float32)) for i in floating) + _total(out), out

  grads, out = jax.jit(jax.grad(loss, argnums=floating, has_aux=True))(*inputs)
  with jaxkern.use_implementation("xla"):
    want = jax.jit(case.call)(*inputs)
  assert_bitwise_equal(out, want)
  for i, g in zip(floating, grads):
    assert_bitwise_equal(g, jnp.full_like(inputs[i], 2))
