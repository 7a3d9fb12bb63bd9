"""Sharded optimiser state of the replicated params (``shard_optimizer``, jaxkern.modeling.sharding): the step whose
replicated params stay whole but whose gradients are reduce-scattered, updated per slice and all-gathered, against the
step without and the unsharded step; the shardings it returns and keeps; chained steps compiling once; the argument
checks; ``init_optimizer_state(shard_over=...)``.

The ``*_8dev`` tests need 8 devices; :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest
with 8 simulated CPU devices. The model is test_shard_replicated.py's (every kind of leaf: split, replicated,
expert-sharded).
"""

import jax
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkern.modeling import (init_optimizer_state, make_sharded_train_step, shard_params, sharded_value_and_grad,
                              storage_specs)
from tests.modeling.multi_device import EIGHT, mesh as _mesh, needs_8, run_8dev_tests
from tests.modeling.test_shard_replicated import _setup, chained_adam_steps_compile_once, run_beside_plain_and_unsharded

IS_SPEC = lambda s: isinstance(s, P)  # noqa: E731


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def test_errors(key):
  mesh = _mesh((1,), ("data",))
  _, _, specs, loss, _ = _setup(key, mesh, "data")
  with pytest.raises(ValueError, match="shard_optimizer='data'.*check_vma=False"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=True, shard_optimizer="data")
  with pytest.raises(ValueError, match="shard_optimizer='data'.*check_vma=False"):
    make_sharded_train_step(loss, optax.sgd(0.1), mesh, specs, shard_optimizer="data")  # check_vma defaults True
  with pytest.raises(ValueError, match="shard_optimizer='expert' must be one of the batch axes"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=False, shard_optimizer="expert")
  with pytest.raises(ValueError, match="shard_optimizer='data' and shard_replicated='data': give one"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=False, shard_optimizer="data", shard_replicated="data")


def test_init_optimizer_state_shard_over(key):
  """``shard_over`` splits the state of the leaves storage_specs splits and leaves the params as placed."""
  mesh = _mesh((1,), ("data",))
  _, ep, specs, _, _ = _setup(key, mesh, "data")
  p = shard_params(ep, mesh, specs)
  state = init_optimizer_state(optax.adam(1e-3), p, mesh, shard_over="data")
  stored = storage_specs(specs, ep, mesh, "data")
  for mu, spec in zip(jax.tree.leaves(state[0].mu), jax.tree.leaves(stored, is_leaf=IS_SPEC)):
    assert mu.sharding.spec == spec
  assert p["w_in"].sharding.spec == P(), "the params keep their placement"
  assert state[0].count.sharding.spec == P()


def _check_step(key, mesh, expert_axis, axis, *, optimizer, steps=2, bit_equal=False):
  """The step with ``shard_optimizer=axis`` against the step without and the unsharded step
  (:func:`run_beside_plain_and_unsharded`; bit-equal to the step without when ``bit_equal``); the returned params
  keep ``specs`` (whole on every device), the optimiser state is split as storage_specs says."""
  p_z, s_z, specs, ep = run_beside_plain_and_unsharded(key, mesh, expert_axis, optimizer, steps=steps,
                                                       store=lambda specs, ep: specs, state_kw=dict(shard_over=axis),
                                                       bit_equal=bit_equal, shard_optimizer=axis)
  stored = storage_specs(specs, ep, mesh, axis)
  n = mesh.shape[axis]
  adam = s_z[0]  # adam's and adamw's first state: ScaleByAdamState
  for (path, leaf), spec, stored_spec, mu, nu in zip(
      jax.tree_util.tree_flatten_with_path(p_z)[0], jax.tree.leaves(specs, is_leaf=IS_SPEC),
      jax.tree.leaves(stored, is_leaf=IS_SPEC), jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)):
    name = jax.tree_util.keystr(path)
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (name, leaf.sharding, spec)
    for s in (mu, nu):
      assert s.sharding.is_equivalent_to(NamedSharding(mesh, stored_spec), s.ndim), (name, s.sharding, stored_spec)
      if stored_spec != spec:
        assert s.addressable_shards[0].data.shape[0] == s.shape[0] // n, name
  if n > 1:
    assert {jax.tree_util.keystr(k) for (k, a), b in zip(
        jax.tree_util.tree_flatten_with_path(stored, is_leaf=IS_SPEC)[0], jax.tree.leaves(specs, is_leaf=IS_SPEC))
        if a != b} == {"['w_in']", "['moe'].router", "['moe'].router_bias"}


def test_step_one_device(key):
  """On a one-device mesh the scatter and gather are identities: bit-equal to the step without."""
  _check_step(key, _mesh((1,), ("data",)), "data", "data", optimizer=optax.adam(1e-3, eps=1e-3), bit_equal=True)


@needs_8
def test_step_2dev_bit_equal_8dev(key):
  """Two devices: the reduce-scatter adds the same two partials as the all-reduce, so the step is bit-equal."""
  _check_step(key, _mesh((2,), ("data",)), "data", "data", optimizer=optax.adam(1e-3, eps=1e-3), bit_equal=True)


@needs_8
def test_step_8dev(key):
  _check_step(key, _mesh((8,), ("data",)), "data", "data", optimizer=optax.adamw(1e-3, eps=1e-3))


@needs_8
def test_step_8dev_data_and_expert_axes(key):
  """A (2, 4) mesh, batch over both axes, experts over "expert", optimiser state split over "data": the gradient is
  reduce-scattered over "data" and psum-med over "expert"."""
  _check_step(key, _mesh((2, 4), ("data", "expert")), "expert", "data", optimizer=optax.adam(1e-3, eps=1e-3))


@needs_8
def test_chained_adam_steps_compile_once_8dev(key):
  """The step fed its own outputs (whole params, split moments) does not compile again."""
  p, _ = chained_adam_steps_compile_once(key, lambda specs, ep, mesh: specs, dict(shard_over="data"),
                                        shard_optimizer="data")
  whole = NamedSharding(p["w_in"].sharding.mesh, P())
  assert p["w_in"].sharding.is_equivalent_to(whole, 2), "the params come back whole"


@pytest.mark.skipif(EIGHT, reason="this process has 8 devices: the 8dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``8dev`` tests in a child pytest with 8 simulated CPU devices."""
  run_8dev_tests(__file__)
