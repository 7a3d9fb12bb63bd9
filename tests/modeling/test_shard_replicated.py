"""Sharded storage of the replicated params (``shard_replicated``, jaxkern.modeling.sharding): ``storage_specs``, the
step with the replicated params stored split over a batch axis against the step without and the unsharded step,
the shardings it returns, chained steps compiling once, the argument checks.

The ``*_8dev`` tests need 8 devices; :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest
with 8 simulated CPU devices (tests/modeling/multi_device.py). The model is test_sharding.py's (a replicated input
projection, the expert-parallel MoE layer on the ``jnp`` references) with a scalar and an indivisible param added, so
that every kind of leaf is there: stored split (``w_in``, ``router``, ``router_bias``), replicated (the scalar, ``(3,
H)``, the one shared expert), expert-sharded.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from jaxkern.modeling import (init_optimizer_state, make_sharded_train_step, moe_layer, moe_layer_ep, moe_param_specs,
                              shard_params, sharded_value_and_grad, storage_specs)
from tests.modeling.multi_device import EIGHT, mesh as _mesh, needs_8, run_8dev_tests
from tests.modeling.test_sharding import H, SHARED, _as_moe_params, _assert_close, _batch, _ep_params, _inputs

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def test_storage_specs():
  """P() leaves with dim 0 a positive multiple of the axis size get P(axis); sharded leaves, scalars, indivisible
  or empty dim 0 keep their spec; other mesh axes do not matter."""
  mesh = AbstractMesh((2, 4), ("data", "expert"))
  shapes = {"w": jax.ShapeDtypeStruct((8, 3), jnp.float32), "bias": jax.ShapeDtypeStruct((4,), jnp.float32),
            "odd": jax.ShapeDtypeStruct((6, 4), jnp.float32), "scalar": jax.ShapeDtypeStruct((), jnp.float32),
            "empty": jax.ShapeDtypeStruct((0, 4), jnp.float32), "experts": jax.ShapeDtypeStruct((8, 2), jnp.float32),
            "cols": jax.ShapeDtypeStruct((8, 8), jnp.float32), "none": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
  specs = {"w": P(), "bias": P(), "odd": P(), "scalar": P(), "empty": P(), "experts": P("expert"),
           "cols": P(None, "data"), "none": P(None, None)}
  got = storage_specs(specs, shapes, mesh, "expert")
  assert got == {"w": P("expert"), "bias": P("expert"), "odd": P(), "scalar": P(), "empty": P(),
                 "experts": P("expert"), "cols": P(None, "data"), "none": P("expert")}
  got = storage_specs(specs, shapes, mesh, "data")  # size 2: (6, 4) divides now
  assert got["odd"] == P("data") and got["w"] == P("data") and got["scalar"] == P() and got["cols"] == P(None, "data")
  arrays = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)  # arrays work as well as shapes
  assert storage_specs(specs, arrays, mesh, "data") == got
  with pytest.raises(ValueError, match="axis='model'"):
    storage_specs(specs, shapes, mesh, "model")


def _model(config, layer):
  """test_sharding's model with a scalar ``scale`` and an indivisible ``(3, H)`` ``odd`` param."""

  def loss(params, batch):
    x, target = batch
    h = jnp.tanh(x @ params["w_in"] + jnp.sum(params["odd"], axis=0)) * params["scale"]
    y = h + layer(params["moe"], h, config=config)
    return jnp.mean((y - target) ** 2)

  return loss


def _params(key, config):
  k_in, k_odd, k_moe = jax.random.split(key, 3)
  moe, _ = _inputs(k_moe, config)
  return {"w_in": jax.random.normal(k_in, (H, H)) * H ** -0.5, "odd": jax.random.normal(k_odd, (3, H)) * 0.1,
          "scale": jnp.asarray(1.25, jnp.float32), "moe": moe}


def _setup(key, mesh, expert_axis, implementation="reference"):
  config = SHARED
  params = _params(key, config)
  ep = dict(params, moe=_ep_params(params["moe"], config))
  specs = dict(jax.tree.map(lambda _: P(), params), moe=moe_param_specs(ep["moe"], expert_axis))
  loss = _model(config, functools.partial(moe_layer_ep, mesh_axis=expert_axis, implementation=implementation))
  unsharded = _model(config, functools.partial(moe_layer, implementation=implementation))
  return params, ep, specs, loss, unsharded


def test_errors(key):
  mesh = _mesh((1,), ("data",))
  _, _, specs, loss, _ = _setup(key, mesh, "data")
  with pytest.raises(ValueError, match="shard_replicated='data'.*check_vma=False"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=True, shard_replicated="data")
  with pytest.raises(ValueError, match="shard_replicated='data'.*check_vma=False"):
    make_sharded_train_step(loss, optax.sgd(0.1), mesh, specs, shard_replicated="data")  # check_vma defaults True
  with pytest.raises(ValueError, match="shard_replicated='expert' must be one of the batch axes"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=False, shard_replicated="expert")


def test_one_device_mesh(key):
  """On a one-device mesh the gather is the identity: the step equals the step without."""
  mesh = _mesh((1,), ("data",))
  _, ep, specs, loss, _ = _setup(key, mesh, "data")
  batch = _batch(key)
  optimizer = optax.sgd(0.05, momentum=0.9)
  outs = []
  for axis in (None, "data"):
    step = make_sharded_train_step(loss, optimizer, mesh, specs, check_vma=False, shard_replicated=axis)
    stored = storage_specs(specs, ep, mesh, "data") if axis else specs
    p = shard_params(ep, mesh, stored)
    p, _, l = step(p, init_optimizer_state(optimizer, p, mesh), batch)
    outs.append((l, p))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  jax.tree.map(np.testing.assert_array_equal, outs[0][1], outs[1][1])


def run_beside_plain_and_unsharded(key, mesh, expert_axis, optimizer, *, steps, store, state_kw, bit_equal=False,
                                   **step_kw):
  """``steps`` of ``make_sharded_train_step(**step_kw)`` (params placed with ``store(specs, ep)``, state from
  ``init_optimizer_state(..., **state_kw)``) beside the plain sharded step and the unsharded step: the loss of every
  step and the final params close to both (bit-equal to the plain step's with ``bit_equal``); the lowered step
  reduce-scatters and all-gathers. Returns the step under test's ``(params, opt_state)``, the compute ``specs`` and
  the unplaced ``ep`` params."""
  params, ep, specs, loss, unsharded = _setup(key, mesh, expert_axis)
  batch = _batch(key)

  @jax.jit
  def reference_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(unsharded)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  tested = make_sharded_train_step(loss, optimizer, mesh, specs, check_vma=False, **step_kw)
  plain = make_sharded_train_step(loss, optimizer, mesh, specs, check_vma=False)
  p_t, p_p = shard_params(ep, mesh, store(specs, ep)), shard_params(ep, mesh, specs)
  s_t, s_p = init_optimizer_state(optimizer, p_t, mesh, **state_kw), init_optimizer_state(optimizer, p_p, mesh)
  ref_state = optimizer.init(params)
  text = tested.lower(p_t, s_t, batch).as_text()
  assert "reduce_scatter" in text and "all_gather" in text
  for i in range(steps):
    p_t, s_t, l_t = tested(p_t, s_t, batch)
    p_p, s_p, l_p = plain(p_p, s_p, batch)
    params, ref_state, l_r = reference_step(params, ref_state, batch)
    _assert_close(l_t, l_p, f"loss of step {i} vs the step without")
    _assert_close(l_t, l_r, f"loss of step {i} vs unsharded")
  assert float(l_r) < float(unsharded(_params(key, SHARED), batch)), "the loss falls"
  for (path, got), want, ref in zip(jax.tree_util.tree_flatten_with_path(p_t)[0], jax.tree.leaves(p_p),
                                    jax.tree.leaves(dict(params, moe=_ep_params(params["moe"], SHARED)))):
    if bit_equal:
      np.testing.assert_array_equal(got, want, err_msg=f"{jax.tree_util.keystr(path)} vs the step without")
    _assert_close(got, want, f"{jax.tree_util.keystr(path)} vs the step without")
    _assert_close(got, ref, f"{jax.tree_util.keystr(path)} vs unsharded")
  _assert_close(_as_moe_params(p_t["moe"]).w_down, params["moe"].w_down, "merged w_down")
  return p_t, s_t, specs, ep


def _check_step(key, mesh, expert_axis, axis, steps=2):
  """The step with ``shard_replicated=axis`` against the step without and the unsharded step (SGD with momentum, as
  test_sharding's _check_train_step; :func:`run_beside_plain_and_unsharded`); the returned params and momentum are
  stored as storage_specs says (each device holds 1/n of a split param)."""
  store = lambda specs, ep: storage_specs(specs, ep, mesh, axis)  # noqa: E731
  p_f, s_f, specs, ep = run_beside_plain_and_unsharded(key, mesh, expert_axis, optax.sgd(0.05, momentum=0.9),
                                                       steps=steps, store=store, state_kw={}, shard_replicated=axis)
  stored = store(specs, ep)
  is_spec = lambda s: isinstance(s, P)
  split = {path for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(stored, is_leaf=is_spec)[0],
                                        jax.tree.leaves(specs, is_leaf=is_spec)) if a != b}
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a == b or a == P(axis), stored, specs, is_leaf=is_spec)))
  names = {jax.tree_util.keystr(k) for k in split}
  assert names == {"['w_in']", "['moe'].router", "['moe'].router_bias"}, names
  n = mesh.shape[axis]
  momentum = s_f[0].trace
  for (path, leaf), mom, spec in zip(jax.tree_util.tree_flatten_with_path(p_f)[0], jax.tree.leaves(momentum),
                                     jax.tree.leaves(stored, is_leaf=lambda s: isinstance(s, P))):
    want = NamedSharding(mesh, spec)
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding, spec)
    assert mom.sharding.is_equivalent_to(want, mom.ndim), (jax.tree_util.keystr(path), mom.sharding, spec)
    if path in split:
      assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // n, jax.tree_util.keystr(path)


@needs_8
def test_step_8dev(key):
  _check_step(key, _mesh((8,), ("data",)), "data", "data")


@needs_8
def test_step_8dev_data_and_expert_axes(key):
  """A (2, 4) mesh, batch over both axes, experts over "expert", replicated params split over "data": the gradient
  is reduce-scattered over "data" and psum-med over "expert"."""
  _check_step(key, _mesh((2, 4), ("data", "expert")), "expert", "data")


@needs_8
def test_chained_adam_steps_compile_once_8dev(key):
  """Adam with shard_replicated on 8 devices: the step fed its own outputs (params in storage layout, sharded
  moments) does not compile again."""
  p, state = chained_adam_steps_compile_once(key, lambda specs, ep, mesh: storage_specs(specs, ep, mesh, "data"), {},
                                             shard_replicated="data")
  assert p["w_in"].sharding.spec == P("data")


def chained_adam_steps_compile_once(key, store, state_kw, **step_kw):
  """Two Adam steps of ``make_sharded_train_step(**step_kw)`` on 8 devices, each fed the outputs of the one before
  (params placed with ``store(specs, ep, mesh)``, state from ``init_optimizer_state(..., **state_kw)``), compile
  nothing after the first; Adam's moments of ``w_in`` come back split over ``"data"``. Returns the params and state."""
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if event == COMPILE_EVENT else None)
  mesh = _mesh((8,), ("data",))
  _, ep, specs, loss, _ = _setup(key, mesh, "data")
  optimizer = optax.adam(1e-3)
  p = shard_params(ep, mesh, store(specs, ep, mesh))
  step = make_sharded_train_step(loss, optimizer, mesh, specs, check_vma=False, **step_kw)
  batch = _batch(key)
  p, state, _ = step(p, init_optimizer_state(optimizer, p, mesh, **state_kw), batch)
  assert state[0].mu["w_in"].sharding.spec == P("data"), "Adam's moments are stored split"
  del compiles[:]
  for _ in range(2):
    p, state, _ = step(p, state, batch)
  assert compiles.count(COMPILE_EVENT) == 0, compiles
  return p, state


@pytest.mark.skipif(EIGHT, reason="this process has 8 devices: the 8dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``8dev`` tests in a child pytest with 8 simulated CPU devices."""
  run_8dev_tests(__file__)
