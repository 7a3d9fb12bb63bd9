"""The MoE layer (jaxkern.modeling.moe) against its dense formulation (every expert on every token, the same
routing): outputs, gradients, jit / vmap / grad, zero tokens, bf16, and a short training run."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxkern import moe
from jaxkern.modeling import (MoeConfig, balance_router_bias, init_moe_params, moe_layer, moe_layer_dense,
                              route_tokens)
from jaxkern.modeling.moe import _group_sizes
from jaxkern.testing import assert_diff_below
from tests.modeling import layer_calls

T, H, I = 32, 256, 128  # H: reduce_fused needs a multiple of 256
CONFIG = MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8)
GROUPED = MoeConfig(num_experts=16, num_topk=4, num_shared_experts=2, num_groups=4, num_topk_groups=2,
                    scoring_func="softmax", routed_scaling_factor=2.5, alignment=16)


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """GPUs multiply float32 matrices in TF32 by default; comparing against the dense layer needs float32."""
  with jax.default_matmul_precision("highest"):
    yield


def _inputs(key, config=CONFIG, tokens=T, dtype=jnp.float32):
  k_params, k_x = jax.random.split(key)
  return init_moe_params(k_params, config, H, I, dtype), jax.random.normal(k_x, (tokens, H), jnp.float32).astype(dtype)


def _assert_close(actual, expected):
  """Float32 tolerance, element by element, relative to the largest expected value."""
  expected = np.asarray(expected, np.float32)
  atol = 1e-5 * max(float(np.abs(expected).max(initial=0.0)), 1.0)
  np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=1e-4, atol=atol)


_forward, _loss, _grads = layer_calls.forward, layer_calls.loss, layer_calls.grads


@pytest.mark.parametrize("implementation, config", [
    ("reference", CONFIG), ("reference", GROUPED), ("interpret", CONFIG)], ids=["reference", "grouped", "interpret"])
def test_forward_matches_dense(key, implementation, config):
  params, x = _inputs(key, config)
  y = _forward(params, x, layer=moe_layer, config=config, implementation=implementation)
  assert y.shape == (T, H) and y.dtype == jnp.float32
  _assert_close(y, _forward(params, x, layer=moe_layer_dense, config=config, implementation="reference"))


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_gradients_match_dense(key, implementation):
  params, x = _inputs(key)
  grads = _grads(params, x, moe_layer, CONFIG, implementation)
  expected = _grads(params, x, moe_layer_dense, CONFIG, "reference")
  for name, g, e in zip(["router", "router_bias", "w_gate", "w_up", "w_down", "x"], jax.tree.leaves(grads),
                        jax.tree.leaves(expected)):
    assert g.shape == e.shape and g.dtype == e.dtype, name
    _assert_close(g, e)
  assert not np.any(grads[0].router_bias), "the balancing bias is a buffer: zero gradient"
  assert np.any(grads[0].router) and np.any(grads[1]), "the routing weights carry gradient into router and x"


def test_group_sizes_cover_every_fused_row_in_expert_order(key):
  params, x = _inputs(key)
  routing = route_tokens(params, x, config=CONFIG, implementation="reference")
  mapping = moe.get_fused_mapping(routing.topk_idx, CONFIG.num_all_experts, 0, CONFIG.alignment, force_no_sync=True)
  sizes = np.asarray(_group_sizes(mapping))
  rows = mapping.pos_to_expert.shape[0]
  assert sizes.sum() == rows > int(mapping.expert_end[-1]), "the tail of unused rows is covered"
  group_of_row = np.repeat(np.arange(CONFIG.num_all_experts), sizes)
  occupied = np.asarray(mapping.pos_to_expert) >= 0
  np.testing.assert_array_equal(group_of_row[occupied], np.asarray(mapping.pos_to_expert)[occupied])


def test_router_bias_shifts_the_choice_only(key):
  params, x = _inputs(key)
  favour = params._replace(router_bias=params.router_bias.at[3].set(10.0))
  routed = route_tokens(favour, x, config=CONFIG, implementation="reference")
  assert np.all(np.asarray(routed.topk_idx[:, 0]) == 3)
  assert np.all(np.asarray(routed.topk_idx[:, -1]) == CONFIG.num_experts), "the shared expert's slot"
  _assert_close(_forward(favour, x, layer=moe_layer, config=CONFIG, implementation="reference"),
                _forward(favour, x, layer=moe_layer_dense, config=CONFIG, implementation="reference"))


def _blocks(key, blocks=3):
  params, _ = _inputs(key)
  return params, jax.random.normal(key, (blocks, T, H), jnp.float32)


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_vmap_over_token_blocks(key, implementation):
  params, xb = _blocks(key)
  layer = functools.partial(moe_layer, config=CONFIG, implementation=implementation)
  yb = jax.jit(jax.vmap(layer, in_axes=(None, 0)))(params, xb)
  for x, y in zip(xb, yb):
    _assert_close(y, _forward(params, x, layer=moe_layer_dense, config=CONFIG, implementation="reference"))


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_grad_of_vmap_and_vmap_of_grad(key, implementation):
  params, xb = _blocks(key, blocks=2)
  per_block = [_grads(params, x, moe_layer_dense, CONFIG, "reference") for x in xb]
  summed = jax.jit(jax.grad(lambda p, xb: jnp.sum(jax.vmap(_loss, in_axes=(None, 0, None, None, None))(
      p, xb, moe_layer, CONFIG, implementation)), argnums=(0, 1)))(params, xb)
  for got, want in zip(jax.tree.leaves(summed[0]), jax.tree.leaves(jax.tree.map(lambda *g: sum(g), *per_block))):
    _assert_close(got, want)
  _assert_close(summed[1], jnp.stack([g[1] for g in per_block]))
  per_example = jax.jit(jax.vmap(_grads, in_axes=(None, 0, None, None, None)), static_argnums=(2, 3, 4))(
      params, xb, moe_layer, CONFIG, implementation)
  stacked = jax.tree.map(lambda *g: jnp.stack(g), *per_block)
  for got, want in zip(jax.tree.leaves(per_example), jax.tree.leaves(stacked)):
    _assert_close(got, want)


def test_nested_vmap(key):
  params, xb = _blocks(key, blocks=4)
  layer = functools.partial(moe_layer, config=CONFIG, implementation="reference")
  nested = jax.jit(jax.vmap(jax.vmap(layer, in_axes=(None, 0)), in_axes=(None, 0)))(params, xb.reshape(2, 2, T, H))
  _assert_close(nested.reshape(4, T, H), jax.jit(jax.vmap(layer, in_axes=(None, 0)))(params, xb))


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_zero_tokens(key, implementation):
  params, x = _inputs(key, tokens=0)
  assert _forward(params, x, layer=moe_layer, config=CONFIG, implementation=implementation).shape == (0, H)
  grads = _grads(params, x, moe_layer, CONFIG, implementation)
  assert grads[1].shape == (0, H)
  assert all(not np.any(g) for g in jax.tree.leaves(grads[0]))


def test_bfloat16_smoke(key):
  params, x = _inputs(key, dtype=jnp.bfloat16)
  y = _forward(params, x, layer=moe_layer, config=CONFIG, implementation="interpret")
  assert y.dtype == jnp.bfloat16 and y.shape == (T, H)
  assert_diff_below(y, _forward(params, x, layer=moe_layer_dense, config=CONFIG, implementation="reference"), 1e-4)
  grads = _grads(params, x, moe_layer, CONFIG, "interpret")
  expected = _grads(params, x, moe_layer_dense, CONFIG, "reference")
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert g.dtype == e.dtype and np.all(np.isfinite(np.asarray(g, np.float32)))
    assert_diff_below(g, e, 1e-3)


def test_balance_router_bias():
  bias = jnp.array([0.0, 1.0, -1.0, 0.5], jnp.float32)
  load = jnp.array([10, 2, 6, 6], jnp.int32)  # mean 6
  np.testing.assert_array_equal(balance_router_bias(bias, load, 0.25), [-0.25, 1.25, -1.0, 0.5])


# Interpret mode runs each kernel call for about a second at T = 32 on a CPU core: the training runs use 16
# tokens and alignment 1 (interpret mode copies the zero rows of segment padding slowly).
TRAIN_TOKENS = 16
TRAIN_CONFIG = dataclasses.replace(CONFIG, alignment=1)


def test_training_with_interpret_kernels(key):
  """Adam on an MSE regression of ``tanh(x A)``, every op in interpret mode: the loss falls over 30 steps."""
  params, x = _inputs(key, TRAIN_CONFIG, tokens=TRAIN_TOKENS)
  target = jnp.tanh(x @ jax.random.normal(jax.random.fold_in(key, 1), (H, H)) / H ** 0.5)
  optimizer = optax.adam(3e-3)

  def loss(params):
    return jnp.mean((moe_layer(params, x, config=TRAIN_CONFIG, implementation="interpret") - target) ** 2)

  @jax.jit
  def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state, losses = optimizer.init(params), []
  for _ in range(30):
    params, opt_state, value = step(params, opt_state)
    losses.append(float(value))
  assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < 0.5 * losses[0], losses
