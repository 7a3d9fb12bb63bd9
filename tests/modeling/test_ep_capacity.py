"""The expert-parallel layer's capacity (``MoeConfig.ep_capacity_factor``, jaxkern.modeling.sharding): each device's
fused rows sized for the capacity where every device's routed slots fit, the worst-case layout otherwise; the same
function either way.

Checked: the static row counts and the per-device need; forward and gradients with the fast path taken and with the
fallback forced (a router bias that sends every token to the first device's experts) against ``moe_layer_ep`` with
the capacity off (bit-equal on a CPU: within the used rows the fused layout and every op's output are those of the
worst-case layout) and against the unsharded layer (test_sharding.py's tolerance); that forcing the fast path on
the overloaded routing changes the result (the fallback is what keeps the function; the comparison can fail); that
no worst-case-sized tensor crosses from the forward to the backward (the ``lax.cond`` outputs of ``jax.grad``'s
jaxpr); the FP8 path (``fp8_expand``, ``fp8_swiglu``, ``fp8_gemm``, references) on 2 devices; the kernels in
interpret mode on a one-device mesh with the capacity forced below the worst case (the interpreter's multi-device
limits: tests/modeling/test_sharding.py); the H100 lowering with the compiled kernels on a 2-device abstract mesh.

The ``*_4dev`` tests need 4 devices: :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest
with 4 simulated CPU devices (tests/modeling/multi_device.py).
"""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxkern.modeling import MoeConfig, init_moe_params, moe_layer, route_tokens, sharding
from jaxkern.modeling.moe import EP_CAPACITY_FACTOR
from jaxkern.modeling.sharding import (ep_fused_rows, merge_shared_experts, moe_layer_ep, moe_param_specs,
                                       split_shared_experts)
from tests.modeling.multi_device import mesh as _mesh, run_8dev_tests
from tests.modeling.test_sharding import _assert_close

H, I = 256, 128
FOUR = jax.device_count() >= 4
needs_4 = pytest.mark.skipif(not FOUR, reason="needs 4 devices (run by test_multi_device_tests_in_a_subprocess)")
# 64 tokens, 8 experts top-2 over 4 devices: capacity 2.0 -> 80 rows (2 x 32 slots + padding 14), worst 144.
SHARED = MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8,
                   ep_capacity_factor=2.0)
T = 64
# The v3 benchmark's FP8 layer at CPU size: 192 tokens, 8 experts top-4 over 2 devices, alignment 128, capacity
# 1.0: 384 + 508 -> 896 rows, worst 768 + 508 -> 1280 (the overloading bias needs 4 x round_up(192, 128) = 1024).
FP8 = MoeConfig(num_experts=8, num_topk=4, num_shared_experts=1, alignment=128, fp8_expand=True, fp8_swiglu=True,
                fp8_gemm=True, ep_capacity_factor=1.0)
T_FP8 = 192


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def test_fused_rows():
  """The static row counts (the v3 benchmark's layer: 8192 tokens, K 4, E 8, 2 devices, alignment 128) and their
  limits; MoeConfig's check of the factor."""
  assert MoeConfig(num_experts=8, num_topk=4).ep_capacity_factor is None  # off by default (not timed on GPUs)
  v3 = MoeConfig(num_experts=8, num_topk=4, num_shared_experts=1, alignment=128, ep_capacity_factor=EP_CAPACITY_FACTOR)
  assert v3.ep_capacity_factor == 1.25
  # worst: 8192 * min(4, 4) + 127 * 4 = 33276 -> 33280; capacity: ceil(1.25 * 8192 * 4 / 2) + 508 = 20988 -> 20992.
  assert ep_fused_rows(v3, 8192, 2) == (20992, 33280)
  assert ep_fused_rows(v3, 8192, 4) == (10496, 16640)  # 1.25 * 8192 + 254 = 10494 -> 10496; 8192 * 2 + 254 -> 16640
  for off in (None, 0, 0.0):
    assert ep_fused_rows(dataclasses.replace(v3, ep_capacity_factor=off), 8192, 2) == (33280, 33280)
  assert ep_fused_rows(dataclasses.replace(v3, ep_capacity_factor=3.0), 8192, 2) == (33280, 33280)  # capped
  assert ep_fused_rows(v3, 0, 2) == (512, 512)  # T = 0: the padding bound only
  assert ep_fused_rows(SHARED, T, 4) == (80, 144)
  for bad in (-0.5, float("inf"), float("nan"), "1.25"):
    with pytest.raises(ValueError, match="ep_capacity_factor"):
      MoeConfig(num_experts=8, num_topk=2, ep_capacity_factor=bad)


def test_device_rows_needed():
  rng = np.random.default_rng(0)
  e, p, a = 16, 4, 8
  idx = np.stack([rng.choice(e, 3, replace=False) for _ in range(50)]).astype(np.int32)
  need = sharding.device_rows_needed(jnp.asarray(idx), num_experts=e, num_ranks=p, alignment=a)
  counts = np.bincount(idx.reshape(-1), minlength=e)
  want = [sum(-(-c // a) * a for c in counts[r * e // p:(r + 1) * e // p]) for r in range(p)]
  np.testing.assert_array_equal(need, want)
  assert need.dtype == jnp.int32 and int(need.sum()) >= idx.size


def _inputs(key, config, tokens, bias=None):
  k_params, k_x = jax.random.split(key)
  params = init_moe_params(k_params, config, H, I, jnp.float32)
  bias = jax.random.normal(k_params, params.router_bias.shape) * 0.1 if bias is None else bias
  return params._replace(router_bias=jnp.asarray(bias, jnp.float32)), jax.random.normal(k_x, (tokens, H), jnp.float32)


def _fits(params, x, config, num_ranks):
  """Whether the routing of ``x`` fits the capacity (the layer's predicate, from the unsharded routing)."""
  idx = route_tokens(params, x, config=config, implementation="reference").topk_idx[:, :config.num_topk]
  need = sharding.device_rows_needed(idx, num_experts=config.num_experts, num_ranks=num_ranks,
                                     alignment=config.alignment)
  rows, worst = ep_fused_rows(config, x.shape[0], num_ranks)
  assert rows < worst, "the capacity must be below the worst case for the cond to exist"
  return bool(jnp.max(need) <= rows)


def _sharded(config, mesh, implementation, check_vma):
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation=implementation)
  specs = moe_param_specs(split_shared_experts(init_moe_params(jax.random.key(0), config, H, I), config), "d")
  return jax.shard_map(layer, mesh=mesh, in_specs=(specs, P("d")), out_specs=P("d"), check_vma=check_vma)


def _value_and_grads(config, mesh, implementation, params, x, check_vma):
  """The sharded layer's output and the gradients of ``sum(sin(y))`` w.r.t. params and x (one jit)."""
  f = _sharded(config, mesh, implementation, check_vma)

  @jax.jit
  def run(ep, x):
    y, pullback = jax.vjp(f, ep, x)
    return y, *pullback(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

  y, gp, gx = run(split_shared_experts(params, config), x)
  return y, merge_shared_experts(gp), gx


def _check_paths(config, mesh, params, x, implementation="reference", check_vma=True, unsharded=True):
  """Capacity on against capacity off (bit-equal) and against the unsharded layer (outputs and gradients)."""
  on = _value_and_grads(config, mesh, implementation, params, x, check_vma)
  off = _value_and_grads(dataclasses.replace(config, ep_capacity_factor=None), mesh, implementation, params, x,
                         check_vma)
  names = ["y", *(f"d{n}" for n in params._fields), "dx"]
  for name, a, b in zip(names, jax.tree.leaves(on), jax.tree.leaves(off)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  if unsharded:
    layer = functools.partial(moe_layer, config=config, implementation=implementation)

    @jax.jit
    def run(p, x):
      y, pullback = jax.vjp(layer, p, x)
      return y, *pullback(jnp.cos(y))

    want = run(params, x)
    for name, a, b in zip(names, jax.tree.leaves(on), jax.tree.leaves(want)):
      _assert_close(a, b, name)
  assert np.any(np.asarray(on[1].w_down)) and np.any(np.asarray(on[2])), "nonzero gradients"
  return on


def _overloading_bias(config):
  """A router bias that sends every token's K routed slots to experts 0..K-1: all on the first device."""
  return jnp.where(jnp.arange(config.num_experts) < config.num_topk, 10.0, 0.0)


@needs_4
def test_fast_path_4dev(key):
  params, x = _inputs(key, SHARED, T)
  assert _fits(params, x, SHARED, 4), "this routing must take the fast path"
  _check_paths(SHARED, _mesh((4,), ("d",)), params, x, check_vma=True)


@needs_4
def test_fallback_4dev(key):
  params, x = _inputs(key, SHARED, T, bias=_overloading_bias(SHARED))
  assert not _fits(params, x, SHARED, 4), "this routing must take the fallback"
  _check_paths(SHARED, _mesh((4,), ("d",)), params, x, check_vma=False)


@needs_4
def test_forced_fast_path_drops_slots_4dev(key, monkeypatch):
  """The fast layout on the overloaded routing (the predicate forced true) loses the slots past the capacity: the
  output differs from the unsharded layer, so the fallback is what keeps the function (and the checks above can
  tell the two apart)."""
  params, x = _inputs(key, SHARED, T, bias=_overloading_bias(SHARED))
  monkeypatch.setattr(sharding, "_fits_capacity", lambda *a, **k: jnp.bool_(True))
  y = jax.jit(_sharded(SHARED, _mesh((4,), ("d",)), "reference", True))(split_shared_experts(params, SHARED), x)
  want = moe_layer(params, x, config=SHARED, implementation="reference")
  assert float(jnp.max(jnp.abs(y - want))) > 0.1 * float(jnp.max(jnp.abs(want)))


def _cond_outputs(jaxpr):
  """The output shapes of every ``cond`` in ``jaxpr`` and its sub-jaxprs, outside the conds' branches."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      shapes += [tuple(v.aval.shape) for v in eqn.outvars]
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          shapes += _cond_outputs(sub)
  return shapes


@needs_4
@pytest.mark.parametrize("config, tokens, devices", [(SHARED, T, 4), (FP8, T_FP8, 2)], ids=["f32", "fp8"])
def test_no_worst_case_residuals_4dev(config, tokens, devices):
  """``jax.grad`` of the layer: the two conds (forward with the fast residuals, backward) pass no tensor with the
  worst case's row count out of a branch, and the forward passes the fast (capacity-sized) residuals (a plain
  ``lax.cond`` would also return zero-filled worst-case residuals)."""
  params, x = _inputs(jax.random.key(0), config, tokens)
  f = _sharded(config, _mesh((devices,), ("d",)), "reference", False)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(f(p, x)), argnums=(0, 1)))(
      split_shared_experts(params, config), x).jaxpr
  shapes = _cond_outputs(jaxpr)
  rows, worst = ep_fused_rows(config, tokens, devices)
  assert len(shapes) > 2 and any(rows in s for s in shapes), shapes
  assert not any(worst in s for s in shapes), shapes


@needs_4
@pytest.mark.parametrize("bias", ["balanced", "overloaded"])
def test_fp8_two_devices_4dev(bias):
  """The FP8 layer (FP8 expand, SwiGLU and grouped GEMMs, the v3 benchmark's options; references) on 2 devices:
  capacity on equals capacity off bit for bit on both paths (the FP8 casts and GEMMs are per row / per 128-row
  block, so the unused rows past the capacity change nothing)."""
  b = None if bias == "balanced" else _overloading_bias(FP8)
  params, x = _inputs(jax.random.key(3), FP8, T_FP8, bias=b)
  assert _fits(params, x, FP8, 2) == (bias == "balanced")
  params = params._replace(**{n: getattr(params, n).astype(jnp.bfloat16) for n in ("w_gate", "w_up", "w_down")})
  _check_paths(FP8, _mesh((2,), ("d",)), params, x.astype(jnp.bfloat16), check_vma=False, unsharded=False)


def test_interpret_one_device_forced_capacity(key, monkeypatch):
  """The kernels in interpret mode (one-device mesh, check_vma off) through both branches: the capacity forced to
  the routing's need (the fast path) against it forced one alignment block lower (the fallback: the worst-case
  layout)."""
  config = dataclasses.replace(SHARED, num_experts=4, ep_capacity_factor=None)
  params, x = _inputs(key, config, 32)
  idx = route_tokens(params, x, config=config, implementation="reference").topk_idx[:, :config.num_topk]
  need = int(sharding.device_rows_needed(idx, num_experts=4, num_ranks=1, alignment=config.alignment)[0])
  worst = ep_fused_rows(config, 32, 1)[1]
  assert need < worst
  mesh = _mesh((1,), ("d",))
  results = []
  for rows in (need, need - config.alignment):
    monkeypatch.setattr(sharding, "ep_fused_rows", lambda *a, rows=rows: (rows, worst))
    results.append(_value_and_grads(config, mesh, "interpret", params, x, False))
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.any(np.asarray(results[0][1].w_down)), "nonzero gradients"


def test_lowers_for_h100_two_devices():
  """The layer with the compiled kernels (FP8 options) on a 2-device abstract H100 mesh lowers, with the capacity
  cond, its collectives outside it."""
  from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh

  from jaxkern.testing.lowering import H100

  mesh = AbstractMesh((2,), ("d",), axis_types=(AxisType.Auto,), abstract_device=H100)
  params = jax.eval_shape(lambda: split_shared_experts(init_moe_params(jax.random.key(0), FP8, H, I), FP8))
  x = jax.ShapeDtypeStruct((T_FP8, H), jnp.bfloat16)
  layer = functools.partial(moe_layer_ep, config=FP8, mesh_axis="d", implementation="pallas")
  f = jax.shard_map(layer, mesh=mesh, in_specs=(moe_param_specs(params, "d"), P("d")), out_specs=P("d"),
                    check_vma=False)
  loss = lambda p, x: jnp.sum(f(p, x).astype(jnp.float32))
  with use_abstract_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "stablehlo.case" in text
  assert "all_gather" in text and "reduce_scatter" in text
  # fp8_expand: the tokens travel as FP8 (tests/modeling/test_ep_fp8_dispatch.py)
  assert any("all_gather" in line and f"tensor<{T_FP8}x{H}xf8E4M3FN>" in line for line in text.splitlines())


@pytest.mark.skipif(FOUR, reason="this process has 4 devices: the 4dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``4dev`` tests in a child pytest with 4 simulated CPU devices."""
  run_8dev_tests(__file__, devices=4, keyword="4dev")
