"""Data + expert parallelism (jaxkern.modeling.sharding): the expert-parallel MoE layer and the shard_map training
step against the unsharded layer and step: outputs, loss, gradients, updated params.

Several devices: the tests named ``*_8dev`` need 8 devices. On a CPU they come from
``--xla_force_host_platform_device_count=8``, which must be in ``XLA_FLAGS`` before JAX starts its backend, and
every test of one pytest process shares that backend. Rather than give the whole suite 8 CPU devices (from
tests/conftest.py: every other test would then run with 8 host devices, which nobody has checked for cost or
behaviour), :func:`test_multi_device_tests_in_a_subprocess` reruns this file's ``8dev`` tests in a child pytest
with that flag (about a minute of CPU time), unless this process already has 8 devices (then they run here and
the wrapper skips).

Kernels: under ``jax.shard_map`` on several simulated devices Pallas' Mosaic GPU interpreter fails
(``expand_to_fused``: ``AssertionError: Barrier remains allocated at key HostAllocationKey(memory_space_id=1,
device_id=5, ...)``, raised by ``jax._src.pallas.mosaic.interpret.shared_memory`` when the devices run the kernel
concurrently; the other kernels of the layer run), so the whole layer is checked in interpret mode on a one-device
mesh, and the kernels that the interpreter runs on 8 devices (``top2_sum_gate``, Pallas-Triton;
``mask_indices_by_tp``, ``reduce_fused``, the FP8 ``swiglu``) are checked there alone.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxkern import moe
from tests.modeling.multi_device import EIGHT, mesh as _mesh, needs_8, run_8dev_tests
from jaxkern.modeling import MoeConfig, init_moe_params, moe_layer
from jaxkern.modeling.sharding import (MoeEpParams, init_optimizer_state, make_sharded_train_step, merge_shared_experts,
                                       moe_layer_ep, moe_param_specs, shard_params, sharded_value_and_grad,
                                       split_shared_experts)
from jaxkern.testing import lower_for_h100

H, I = 256, 128  # reduce_fused needs H % 256 == 0
T = 32  # tokens: 4 per device on 8 devices
SHARED = MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8)
GROUPED = MoeConfig(num_experts=16, num_topk=4, num_shared_experts=2, num_groups=4, num_topk_groups=2,
                    scoring_func="softmax", routed_scaling_factor=2.5, alignment=4)
NO_SHARED = MoeConfig(num_experts=8, num_topk=3, scoring_func="sqrtsoftplus", alignment=8)


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def _assert_close(actual, expected, what=""):
  expected = np.asarray(expected, np.float32)
  atol = 2e-5 * max(float(np.abs(expected).max(initial=0.0)), 1.0)
  np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=2e-4, atol=atol, err_msg=what)


def _inputs(key, config, tokens=T):
  k_params, k_x = jax.random.split(key)
  params = init_moe_params(k_params, config, H, I, jnp.float32)
  params = params._replace(router_bias=jax.random.normal(k_params, params.router_bias.shape) * 0.1)
  return params, jax.random.normal(k_x, (tokens, H), jnp.float32)


def _ep_params(params, config):
  return split_shared_experts(params, config) if config.num_shared_experts else params


def _as_moe_params(params):
  return merge_shared_experts(params) if isinstance(params, MoeEpParams) else params


def _loss_of(y):
  """A nonlinear scalar, so that every output element gets its own cotangent."""
  return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _check_layer(key, config, mesh, axis, implementation, check_vma=True):
  """moe_layer_ep under shard_map (tokens over every mesh axis, experts over ``axis``) against moe_layer: the
  output and the gradients w.r.t. params and x."""
  params, x = _inputs(key, config)
  ep = _ep_params(params, config)
  specs = moe_param_specs(ep, axis)
  tokens = P(tuple(mesh.axis_names))
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis=axis, implementation=implementation)
  sharded = jax.shard_map(layer, mesh=mesh, in_specs=(specs, tokens), out_specs=tokens, check_vma=check_vma)
  unsharded = functools.partial(moe_layer, config=config, implementation=implementation)

  y = jax.jit(sharded)(ep, x)
  y_ref = jax.jit(unsharded)(params, x)
  assert y.shape == (T, H) and y.dtype == x.dtype
  _assert_close(y, y_ref, "output")

  if check_vma:  # jax.grad outside shard_map: JAX sums the replicated params' gradients over the devices
    grads = jax.jit(jax.grad(lambda p, x: _loss_of(sharded(p, x)), argnums=(0, 1)))(ep, x)
  else:  # per-device gradients, summed by sharded_value_and_grad
    vg = sharded_value_and_grad(lambda p, xs: _loss_of(layer(p, xs)) / T, mesh, specs, check_vma=False)
    loss, g = jax.jit(vg)(ep, x)
    _assert_close(loss * mesh.size, _loss_of(y_ref) / T, "loss")
    grads = (jax.tree.map(lambda a: a * (T * mesh.size), g), None)  # the gradient of the mean of the shards' losses
  want = jax.jit(jax.grad(lambda p, x: _loss_of(unsharded(p, x)), argnums=(0, 1)))(params, x)
  names = ["router", "router_bias", "w_gate", "w_up", "w_down"]
  for name, g, w in zip(names, _as_moe_params(grads[0]), want[0]):
    assert g.shape == w.shape, name
    _assert_close(g, w, name)
  assert not np.any(grads[0].router_bias), "the balancing bias is a buffer"
  assert np.any(want[0].router) and np.any(want[0].w_down[-1]), "the test's gradients are not trivially zero"
  if grads[1] is not None:
    _assert_close(grads[1], want[1], "x")


# ---------------------------------------------------------------------------------------------------------------
# One device (runs in the main test process): the kernels in interpret mode.


def test_layer_one_device_mesh_interpret(key):
  _check_layer(key, SHARED, _mesh((1,), ("data",)), "data", "interpret", check_vma=False)


def _mlp_moe_model(config, layer):
  """A small model: a replicated input projection, then the MoE layer with a residual."""

  def apply(params, x):
    h = jnp.tanh(x @ params["w_in"])
    return h + layer(params["moe"], h, config=config)

  def loss(params, batch):
    x, target = batch
    return jnp.mean((apply(params, x) - target) ** 2)

  return loss


def _model_params(key, config):
  k_in, k_moe = jax.random.split(key)
  params, _ = _inputs(k_moe, config)
  return {"w_in": jax.random.normal(k_in, (H, H)) * H ** -0.5, "moe": params}


def _batch(key, tokens=T):
  kx, ky = jax.random.split(jax.random.fold_in(key, 7))
  return jax.random.normal(kx, (tokens, H)), jax.random.normal(ky, (tokens, H))


def _check_train_step(key, config, mesh, expert_axis, implementation, check_vma, steps=2):
  """make_sharded_train_step against the same jitted unsharded step: loss and params after ``steps``."""
  params = _model_params(key, config)
  batch = _batch(key)
  # SGD with momentum (a params-shaped optimiser state): linear in the gradients, unlike Adam, whose normalised
  # updates of near-zero gradients turn float32 summation-order differences into differences of order lr.
  optimizer = optax.sgd(0.05, momentum=0.9)
  unsharded_loss = _mlp_moe_model(config, functools.partial(moe_layer, implementation=implementation))

  @jax.jit
  def reference_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(unsharded_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  ep_params = {"w_in": params["w_in"], "moe": _ep_params(params["moe"], config)}
  specs = {"w_in": P(), "moe": moe_param_specs(ep_params["moe"], expert_axis)}
  sharded_loss = _mlp_moe_model(config, functools.partial(moe_layer_ep, mesh_axis=expert_axis,
                                                          implementation=implementation))
  step = make_sharded_train_step(sharded_loss, optimizer, mesh, specs, check_vma=check_vma)
  ep_params = shard_params(ep_params, mesh, specs)
  state, ref_state = init_optimizer_state(optimizer, ep_params, mesh), optimizer.init(params)
  initial_loss = unsharded_loss(params, batch)
  for i in range(steps):
    ep_params, state, loss = step(ep_params, state, batch)
    params, ref_state, ref_loss = reference_step(params, ref_state, batch)
    _assert_close(loss, ref_loss, f"loss of step {i}")
  assert float(unsharded_loss(params, batch)) < float(initial_loss), "the loss falls"
  _assert_close(ep_params["w_in"], params["w_in"], "w_in")
  for name, got, want in zip(["router", "router_bias", "w_gate", "w_up", "w_down"],
                             _as_moe_params(ep_params["moe"]), params["moe"]):
    _assert_close(got, want, name)
  if mesh.size > 1:
    assert ep_params["moe"].w_gate.sharding.spec == P(expert_axis), "expert weights stay sharded"


def test_train_step_one_device_mesh(key):
  """The step's per-device gradient sums (check_vma=False, the kernels' setting) on one device; the reference ops
  (the kernels' gradients under shard_map: test_layer_one_device_mesh_interpret)."""
  _check_train_step(key, SHARED, _mesh((1,), ("data",)), "data", "reference", check_vma=False)


def test_chained_adam_steps_compile_once(key):
  """Adam's step count: with init_optimizer_state the step fed its own outputs does not compile again; with plain
  optimizer.init (the count off the mesh) it does."""
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
      else None)
  config, mesh = SHARED, _mesh((1,), ("data",))
  params, batch = _model_params(key, config), _batch(key)
  ep_params = {"w_in": params["w_in"], "moe": _ep_params(params["moe"], config)}
  specs = {"w_in": P(), "moe": moe_param_specs(ep_params["moe"], "data")}
  loss = _mlp_moe_model(config, functools.partial(moe_layer_ep, mesh_axis="data", implementation="reference"))
  optimizer = optax.adam(1e-3)
  ep_params = shard_params(ep_params, mesh, specs)
  for init, recompiles in [(init_optimizer_state, 0), (lambda opt, p, mesh: opt.init(p), 1)]:
    step = make_sharded_train_step(loss, optimizer, mesh, specs, check_vma=False)
    p, state, _ = step(ep_params, init(optimizer, ep_params, mesh), batch)
    del compiles[:]
    for _ in range(2):
      p, state, _ = step(p, state, batch)
    assert compiles.count("/jax/core/compile/backend_compile_duration") == recompiles, (init, compiles)


def test_errors(key):
  params, x = _inputs(key, SHARED)
  mesh = _mesh((1,), ("data",))

  def call(p, config=SHARED):
    f = functools.partial(moe_layer_ep, config=config, mesh_axis="data", implementation="reference")
    return jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(p, x)

  with pytest.raises(ValueError, match="MoeEpParams"):
    call(params)  # shared experts inside MoeParams
  ep = split_shared_experts(params, SHARED)
  with pytest.raises(ValueError, match="E/P"):
    call(ep._replace(w_gate=ep.w_gate[:4]))
  with pytest.raises(ValueError, match="shared_gate"):
    call(ep._replace(shared_gate=jnp.concatenate([ep.shared_gate] * 2)))
  np.testing.assert_array_equal(merge_shared_experts(ep).w_down, params.w_down)  # the split round-trips


def test_lowers_for_h100():
  """The sharded layer (one-device mesh, check_vma off) with the compiled kernels lowers for an H100."""
  config = dataclasses_replace(SHARED, alignment=128)
  params = jax.eval_shape(lambda: split_shared_experts(init_moe_params(jax.random.key(0), config, H, I), config))
  x = jax.ShapeDtypeStruct((256, H), jnp.bfloat16)

  def f(p, x):
    layer = functools.partial(moe_layer_ep, config=config, mesh_axis="x", implementation="pallas")
    specs = moe_param_specs(p, "x")  # lower_for_h100's abstract mesh has an Explicit axis: place the inputs first
    p, x = jax.reshard(p, specs), jax.reshard(x, P("x"))
    return jax.shard_map(layer, in_specs=(specs, P("x")), out_specs=P("x"), check_vma=False)(p, x)

  text = lower_for_h100(f, params, x).as_text()
  assert "all-gather" in text or "all_gather" in text
  assert "reduce-scatter" in text or "reduce_scatter" in text


def dataclasses_replace(config, **changes):
  import dataclasses

  return dataclasses.replace(config, **changes)


# ---------------------------------------------------------------------------------------------------------------
# 8 devices


@needs_8
@pytest.mark.parametrize("config", [GROUPED, NO_SHARED], ids=["grouped", "no_shared"])
def test_layer_8dev_reference(key, config):
  _check_layer(key, config, _mesh((8,), ("data",)), "data", "reference")


@needs_8
def test_layer_8dev_reference_without_check_vma(key):
  _check_layer(key, SHARED, _mesh((8,), ("data",)), "data", "reference", check_vma=False)


@needs_8
def test_layer_8dev_data_and_expert_axes(key):
  """A (2, 4) mesh: tokens over both axes, experts over "expert"; two independent EP groups of 4."""
  _check_layer(key, SHARED, _mesh((2, 4), ("data", "expert")), "expert", "reference")


@needs_8
@pytest.mark.parametrize("mesh_shape, check_vma", [((8,), True), ((2, 4), False)], ids=["8", "2x4_no_check_vma"])
def test_train_step_8dev_reference(key, mesh_shape, check_vma):
  names = ("data",) if len(mesh_shape) == 1 else ("data", "expert")
  _check_train_step(key, SHARED, _mesh(mesh_shape, names), names[-1], "reference", check_vma)


@needs_8
def test_routing_kernels_8dev_interpret(key):
  """The kernels the interpreter runs on 8 devices: the local routing (top2_sum_gate, Pallas-Triton) and the
  EP masking (mask_indices_by_tp) under shard_map, against their references."""
  mesh = _mesh((8,), ("data",))
  params, x = _inputs(key, SHARED)
  e = SHARED.num_experts

  def body(router, x, implementation):
    routing = moe.top2_sum_gate(x @ router, jnp.zeros((e,)), SHARED.num_topk, scoring_func="sigmoid",
                                routed_scaling_factor=1.5, implementation=implementation)
    idx = jax.lax.all_gather(routing.topk_idx, "data", axis=0, tiled=True)
    local = moe.mask_indices_by_tp(idx, e, 8, jax.lax.axis_index("data"), 8, implementation=implementation)
    return routing.topk_weights, local[None]

  outs = {}
  for implementation in ("interpret", "reference"):
    f = jax.shard_map(functools.partial(body, implementation=implementation), mesh=mesh, in_specs=(P(), P("data")),
                      out_specs=(P("data"), P("data")), check_vma=False)
    outs[implementation] = jax.jit(f)(params.router, x)
  np.testing.assert_array_equal(outs["interpret"][1], outs["reference"][1])
  _assert_close(outs["interpret"][0], outs["reference"][0])
  local = np.asarray(outs["reference"][1])  # (8 ranks, T, K)
  assert ((local >= -1) & (local < e // 8)).all()
  assert ((local >= 0).sum(axis=0) == 1).all(), "every slot is kept by exactly one rank"


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(EIGHT, reason="this process has 8 devices: the 8dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``8dev`` tests in a child pytest with 8 simulated CPU devices."""
  run_8dev_tests(__file__)
