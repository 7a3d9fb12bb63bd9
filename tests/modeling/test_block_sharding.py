"""The model block's sharded training step (jaxkern.modeling.block.sharded_train_step): data parallelism over the
batch, expert parallelism over each layer's routed experts, one ``jax.shard_map`` around the loss and gradients,
against the unsharded :func:`jaxkern.modeling.block.train_step`: loss, updated params (SGD, so the update is the
gradient times the learning rate) and their shardings.

The ``*_8dev`` tests need 8 devices; :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest
with ``--xla_force_host_platform_device_count=8`` (the mechanism of tests/modeling/test_sharding.py, whose
docstring says why). They run the ``jnp`` references: the kernels in Pallas' interpreter trip its multi-device
limits (``expand_to_fused``, see test_sharding.py), and the whole block in interpret mode on one device needs
``H >= 1024`` for the mHC stream kernels, minutes of CPU time per step, over this file's budget (the unsharded
block in interpret mode against the references: tests/modeling/test_block.py; the EP MoE layer in interpret mode
on a one-device mesh: test_sharding.py).

Numerics: the sharded step changes the order of float32 sums (each token's MoE slots: per device, then over
devices; the replicated params' gradients: per device, then ``psum``). The block's activations are bfloat16, so
such a difference can flip a bfloat16 rounding of an activation, which then moves the gradients by more than
float32 summation order alone (measured on one device: about 0.6% of the update's norm for most params, 1.2% at
most). The tolerance is relative to each param's update, 3e-2 in norm; a missing or doubled gradient sum, a wrong
expert shard or a dropped token changes the updates by O(1). The loss: 1e-5 on the first step, 1e-3 after (params then differ).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from tests.modeling.multi_device import EIGHT, mesh as _mesh, needs_8, run_8dev_tests
from jaxkern.modeling import block
from jaxkern.modeling.sharding import MoeEpParams, _check_divisible, shard_params

# A small block for the references (the kernels would need hidden >= 1024).
CONFIG = block.BlockConfig(num_layers=1, hidden=256, vocab_size=32, engram_table_size=61, engram_embed_dim=8)
LR = 0.1
TOL = 3e-2  # per param: |sharded update - unsharded update| / |unsharded update| (Frobenius); see the docstring


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def _check_step(mesh, expert_axis, check_vma, steps=2, config=CONFIG):
  params = block.init_block_params(jax.random.key(1), config)
  # A nonzero router bias, so that its (absent) gradient and the routing it shifts are both exercised.
  params = params._replace(layers=tuple(
      layer._replace(moe=layer.moe._replace(router_bias=jax.random.normal(jax.random.key(i), (8,)) * 0.1))
      for i, layer in enumerate(params.layers)))
  batch = block.synthetic_batch(np.random.default_rng(3), batch=8, seq_len=8, vocab_size=config.vocab_size)
  optimizer = optax.sgd(LR, momentum=0.9)  # linear in the gradients (see test_sharding.py on Adam)
  reference = jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                        implementation="reference"))
  step = block.sharded_train_step(config, optimizer, mesh, expert_axis=expert_axis, implementation="reference",
                                  check_vma=check_vma)
  ep = block.ep_params(params, config)
  assert all(isinstance(layer.moe, MoeEpParams) for layer in ep.layers)
  specs = block.block_param_specs(ep, expert_axis)
  ep = shard_params(ep, mesh, specs)
  state, ref_state = optimizer.init(ep), optimizer.init(params)
  initial = params
  for i in range(steps):
    out = step(ep, state, batch)
    ref = reference(params, ref_state, batch)
    ep, state, params, ref_state = out.params, out.opt_state, ref.params, ref.opt_state
    assert out.load is None
    # Step 0: the same params (summation order only); later: params apart by the updates' tolerance.
    np.testing.assert_allclose(float(out.loss), float(ref.loss), rtol=1e-5 if i == 0 else 1e-3,
                               err_msg=f"loss of step {i}")
    if i == 0:  # the first update (LR times the gradient): later ones compound the first one's differences
      _check_update(block.merge_ep_params(ep), params, initial)
  # jitted: op by op, the model's forward costs about three times the CPU time of its compilation
  loss = jax.jit(functools.partial(block.loss_fn, config=config, implementation="reference"))
  assert float(loss(block.merge_ep_params(ep), batch)) < float(loss(initial, batch)), "the loss falls"
  if mesh.size > 1:
    for layer in ep.layers:
      assert layer.moe.w_gate.sharding.spec == P(expert_axis), "routed experts stay sharded"
      assert layer.moe.shared_gate.sharding.is_fully_replicated
      assert layer.mhc.fn.sharding.is_fully_replicated


def _check_update(got, want_params, initial):
  """Per param: the sharded update against the unsharded one, relative in norm (module docstring)."""
  leaves = jax.tree_util.tree_leaves_with_path(got)
  assert len(leaves) == len(jax.tree.leaves(want_params))
  errors = {}
  for (path, g), w, w0 in zip(leaves, jax.tree.leaves(want_params), jax.tree.leaves(initial)):
    name = jax.tree_util.keystr(path)
    assert g.shape == w.shape and g.dtype == w.dtype, name
    moved, want = np.asarray(g) - np.asarray(w0), np.asarray(w) - np.asarray(w0)
    if name.endswith("router_bias"):
      assert not np.any(moved) and not np.any(want), "the router bias is a buffer"
      continue
    norm = float(np.linalg.norm(want))
    assert norm > 0, f"{name}: no update, the comparison could not fail"
    errors[name] = float(np.linalg.norm(moved - want)) / norm
  assert max(errors.values()) < TOL, errors


def test_specs_and_round_trip():
  params = block.init_block_params(jax.random.key(0), CONFIG)
  ep = block.ep_params(params, CONFIG)
  layer = ep.layers[0].moe
  assert layer.w_gate.shape == (8, 256, 128) and layer.shared_gate.shape == (1, 256, 128)
  specs = block.block_param_specs(ep, "expert")
  assert specs.layers[0].moe.w_down == P("expert") and specs.layers[0].moe.shared_down == P()
  assert specs.embed == P() and specs.layers[0].engram.table == P() and specs.layers[0].moe.router == P()
  back = block.merge_ep_params(ep)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_step_one_device_mesh():
  """The sharded step on a one-device mesh (check_vma=False, the kernels' setting; the references)."""
  _check_step(_mesh((1,), ("data",)), "data", check_vma=False, steps=1)


def test_sharded_step_lowers_for_h100():
  """The sharded step with the compiled kernels (check_vma=False) lowers for an H100 (one-device abstract mesh with
  an Auto axis, as tests/modeling/test_block.py's lowering test: the kernels' model size, hidden 1024)."""
  from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh

  from jaxkern.testing.lowering import H100

  config = block.BlockConfig(num_layers=1, vocab_size=32, engram_table_size=61, engram_embed_dim=8)
  optimizer = optax.sgd(LR)
  mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H100)
  ep = jax.eval_shape(lambda: block.ep_params(block.init_block_params(jax.random.key(0), config), config))
  batch = block.Batch(*(jax.ShapeDtypeStruct((2, 64), jnp.int32),) * 2)
  shapes = (ep, jax.eval_shape(optimizer.init, ep), batch)
  step = block.sharded_train_step(config, optimizer, mesh, expert_axis="x", implementation="pallas")
  with use_abstract_mesh(mesh):
    text = jax.jit(lambda *a: step(*a).loss).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_errors():
  import dataclasses

  mesh = _mesh((1,), ("data",))
  with pytest.raises(ValueError, match="router_bias_rate"):
    block.sharded_train_step(dataclasses.replace(CONFIG, router_bias_rate=0.01), optax.sgd(0.1), mesh,
                             expert_axis="data")

  # 8 routed experts split over 16 / 3 / 2x3 devices: shard_params's check names the param (one device: no split)
  ep = block.ep_params(block.init_block_params(jax.random.key(0), CONFIG), CONFIG)
  specs = block.block_param_specs(ep, "data")
  _check_divisible(ep, {"data": 8}, specs)
  for sizes in ({"data": 16}, {"data": 3}):
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.moe\.w_gate: dimension 0 of shape \(8, 256, 128\)"):
      _check_divisible(ep, sizes, specs)
  two_axes = jax.tree.map(lambda spec: P(("data", "model")) if spec == P("data") else spec, specs,
                          is_leaf=lambda x: isinstance(x, P))
  _check_divisible(ep, {"data": 4, "model": 2}, two_axes)
  with pytest.raises(ValueError, match=r"axes \('data', 'model'\) \(6 devices\)"):
    _check_divisible(ep, {"data": 2, "model": 3}, two_axes)
  ep_on_mesh = shard_params(ep, mesh, specs)
  assert ep_on_mesh.layers[0].moe.w_gate.sharding.spec == P("data")


@needs_8
def test_shard_params_8dev_uneven():
  expected = r"params\['w'\]: dimension 0 of shape \(4, 2\) is split over mesh axes \('data',\) \(8 devices\)"
  with pytest.raises(ValueError, match=expected):
    shard_params({"w": jnp.zeros((4, 2))}, _mesh((8,), ("data",)), {"w": P("data")})


@needs_8
def test_step_8dev_reference():
  """8 devices, one axis: tokens and experts over "data"; check_vma=True (the custom_vjps' vary_like casts)."""
  _check_step(_mesh((8,), ("data",)), "data", check_vma=True)


@needs_8
def test_step_8dev_data_and_expert_axes():
  """A (2, 4) mesh: batch over both axes, experts over "expert"; check_vma=False (the kernels' setting)."""
  _check_step(_mesh((2, 4), ("data", "expert")), "expert", check_vma=False)


@pytest.mark.skipif(EIGHT, reason="this process has 8 devices: the 8dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``8dev`` tests in a child pytest with 8 simulated CPU devices."""
  run_8dev_tests(__file__)
