"""The expert-parallel layer's combine dtype (``MoeConfig.ep_combine_dtype``, jaxkern.modeling.sharding): the
devices' routed partial sums added in bfloat16 instead of float32.

Checked on 2 simulated CPU devices (references), bfloat16 tokens and experts, the capacity path and the worst-case
layout: the forward is within the documented extra roundings of the float32 combine (a few bfloat16 ulps) and differs
from it (the option takes effect); the gradients for a fixed cotangent equal the float32 combine's bit for bit (the
backward moves the same bfloat16 values, in half the bytes); the lowered layer (FP8 tokens dispatched) all-gathers and
reduce-scatters its other ``(T, H)`` arrays in bfloat16 and none in float32 (H100 lowering, compiled kernels); the
config check.

The ``2dev`` tests need 2 devices: :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxkern.modeling import MoeConfig, init_moe_params
from jaxkern.modeling.sharding import merge_shared_experts, moe_layer_ep, moe_param_specs, split_shared_experts
from tests.modeling.multi_device import mesh as _mesh, run_8dev_tests

H, I, T = 256, 128, 96
TWO = jax.device_count() >= 2
needs_2 = pytest.mark.skipif(not TWO, reason="needs 2 devices (run by test_multi_device_tests_in_a_subprocess)")
BASE = MoeConfig(num_experts=8, num_topk=4, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8)


def test_config_check():
  assert MoeConfig(num_experts=8, num_topk=4).ep_combine_dtype == "float32"
  for bad in ("float16", "bf16", None, jnp.bfloat16):
    with pytest.raises(ValueError, match="ep_combine_dtype"):
      MoeConfig(num_experts=8, num_topk=4, ep_combine_dtype=bad)


def _inputs(key):
  k_params, k_x, k_ct = jax.random.split(key, 3)
  params = init_moe_params(k_params, BASE, H, I, jnp.float32)
  params = params._replace(router_bias=jax.random.normal(k_params, params.router_bias.shape) * 0.1,
                           **{n: getattr(params, n).astype(jnp.bfloat16) for n in ("w_gate", "w_up", "w_down")})
  x = jax.random.normal(k_x, (T, H), jnp.float32).astype(jnp.bfloat16)
  return params, x, jax.random.normal(k_ct, (T, H), jnp.float32).astype(jnp.bfloat16)


def _value_and_grads(config, params, x, ct):
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="reference")
  ep = split_shared_experts(params, config)
  f = jax.shard_map(layer, mesh=_mesh((2,), ("d",)), in_specs=(moe_param_specs(ep, "d"), P("d")), out_specs=P("d"),
                    check_vma=False)

  @jax.jit
  def run(ep, x, ct):
    y, pullback = jax.vjp(f, ep, x)
    return y, *pullback(ct)

  y, gp, gx = run(ep, x, ct)
  return y, merge_shared_experts(gp), gx


@needs_2
@pytest.mark.parametrize("capacity", [None, 2.0], ids=["worst_case", "capacity"])
def test_bf16_combine_2dev(capacity):
  config = dataclasses.replace(BASE, ep_capacity_factor=capacity)
  params, x, ct = _inputs(jax.random.key(7))
  y32, g32, gx32 = _value_and_grads(config, params, x, ct)
  y16, g16, gx16 = _value_and_grads(dataclasses.replace(config, ep_combine_dtype="bfloat16"), params, x, ct)
  assert y16.dtype == y32.dtype == jnp.bfloat16
  a, b = np.asarray(y16, np.float32), np.asarray(y32, np.float32)
  # Two bfloat16 roundings of partials of about |y| plus the final one: within 4 ulps (2^-8 relative each) of the
  # larger of |y| and the routed partials' size.
  scale = np.maximum(np.abs(b), np.abs(b).max(axis=1, keepdims=True) * 0.25)
  assert np.all(np.abs(a - b) <= 4 * 2.0 ** -8 * scale), np.max(np.abs(a - b) / scale)
  assert np.mean(a != b) > 0.01, "the bfloat16 combine changed nothing: the option did not take effect"
  for name, u, v in zip(["router", "router_bias", "w_gate", "w_up", "w_down", "x"], [*g16, gx16], [*g32, gx32]):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=name)
  assert np.any(np.asarray(g16.w_down)) and np.any(np.asarray(gx16))


def test_lowered_exchange_is_bf16():
  """The layer with the compiled kernels (FP8 options, v3-like) on a 2-device abstract H100 mesh: with the bfloat16
  combine every ``(T, H)`` collective but the FP8 token dispatch moves bfloat16; with the default float32 combine
  the partials' reduce-scatter and their cotangents' all-gather are float32."""
  from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh

  from jaxkern.testing.lowering import H100

  fp8 = MoeConfig(num_experts=8, num_topk=4, num_shared_experts=1, alignment=128, fp8_expand=True, fp8_swiglu=True,
                  fp8_gemm=True, ep_capacity_factor=1.25)
  mesh = AbstractMesh((2,), ("d",), axis_types=(AxisType.Auto,), abstract_device=H100)
  params = jax.eval_shape(lambda: split_shared_experts(init_moe_params(jax.random.key(0), fp8, H, I), fp8))
  tokens = 256
  x = jax.ShapeDtypeStruct((tokens, H), jnp.bfloat16)  # global: T/2 rows on each device

  def collectives(config):
    layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="pallas")
    f = jax.shard_map(layer, mesh=mesh, in_specs=(moe_param_specs(params, "d"), P("d")), out_specs=P("d"),
                      check_vma=False)
    loss = lambda p, x: jnp.sum(jnp.sin(f(p, x).astype(jnp.float32)))  # the forward output is used
    with use_abstract_mesh(mesh):
      text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(params, x).lower(
          lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # The (T, H) exchanges: the all-gathers' and reduce-scatters' results of T or T/2 rows and H columns.
    found = set()
    for op in re.finditer(r'"stablehlo\.(all_gather|reduce_scatter)"', text):
      result = re.compile(r"-> tensor<([^>]*)>").search(text, op.end())  # the op's result type (after its body)
      m = re.fullmatch(rf"(?:{tokens}|{tokens // 2})x{H}x(\w+)", result.group(1))
      if m:
        found.add((op.group(1), m.group(1)))
    return sorted(found)

  # The tokens travel as FP8 (fp8_expand's dispatch); the partials' reduce-scatter and, in the backward, their
  # cotangents' all-gather in the combine dtype; the tokens' gradient reduce-scattered in bfloat16.
  assert collectives(fp8) == [("all_gather", "f32"), ("all_gather", "f8E4M3FN"), ("reduce_scatter", "bf16"),
                              ("reduce_scatter", "f32")]
  assert collectives(dataclasses.replace(fp8, ep_combine_dtype="bfloat16")) == [
      ("all_gather", "bf16"), ("all_gather", "f8E4M3FN"), ("reduce_scatter", "bf16")]


@pytest.mark.skipif(TWO, reason="this process has 2 devices: the 2dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``2dev`` tests in a child pytest with 2 simulated CPU devices."""
  run_8dev_tests(__file__, devices=2, keyword="2dev")
