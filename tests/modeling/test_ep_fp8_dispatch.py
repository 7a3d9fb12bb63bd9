"""FP8 token dispatch of the expert-parallel layer (``MoeConfig.fp8_expand``, jaxkern.modeling.sharding): each
device casts its own tokens to FP8 and the all-gather moves the FP8 data and scales instead of the tokens; the
gradient of the tokens comes through a zero-valued anchor whose backward is the all-gather's transpose.

Checked, on 2 simulated CPU devices (references): forward and gradients (w.r.t. x, the routed and shared expert
weights and the router) bit-equal to the previous scheme (written here as the oracle: the ``x.dtype`` tokens
all-gathered, then :func:`jaxkern.modeling.expand_fp8` casting all of them on every device), with the capacity off
(the worst-case layout), on (the fast path) and forced onto its fallback (test_ep_capacity.py's overloading bias),
for ``fp8_expand`` alone and with every FP8 option (``fp8_swiglu``, ``fp8_gemm``); that the oracle can tell the two
apart (a dispatch whose gathered scales are perturbed fails it); the compiled HLO of the layer's gradient: the
all-gather carries ``(T, H)`` float8_e4m3fn tokens and no ``(T, H)`` bfloat16 ones; the op
:func:`jaxkern.modeling.moe.expand_fp8_quantized` against ``expand_fp8`` (value and gradient) and its input checks;
the H100 lowering of the layer (tests/modeling/test_ep_capacity.py: ``test_lowers_for_h100_two_devices``).

The ``*_2dev`` tests need 2 devices: :func:`test_multi_device_tests_in_a_subprocess` reruns them in a child pytest
with 2 simulated CPU devices (tests/modeling/multi_device.py).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxkern import moe
from jaxkern.modeling import MoeConfig, expand_fp8, init_moe_params, route_tokens, sharding
from jaxkern.modeling.moe import expand_fp8_quantized, fp8_expand_cast
from jaxkern.modeling.sharding import (ep_fused_rows, merge_shared_experts, moe_layer_ep, moe_param_specs,
                                       split_shared_experts)
from jaxkern.types import QuantTensor
from tests.modeling.multi_device import mesh as _mesh, run_8dev_tests

H, I = 256, 128
TWO = jax.device_count() >= 2
needs_2 = pytest.mark.skipif(not TWO, reason="needs 2 devices (run by test_multi_device_tests_in_a_subprocess)")
# 64 tokens, 8 experts top-2 + 1 shared over 2 devices, alignment 8, capacity 1.25: 80 + 28 -> 112 rows, worst 160.
EXPAND = MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8,
                   fp8_expand=True, ep_capacity_factor=1.25)
T = 64
# Every FP8 option (test_ep_capacity.py's FP8 layer): 192 tokens, top-4, alignment 128, capacity 1.0: 896 rows, worst
# 1280.
ALL_FP8 = MoeConfig(num_experts=8, num_topk=4, num_shared_experts=1, alignment=128, fp8_expand=True, fp8_swiglu=True,
                    fp8_gemm=True, ep_capacity_factor=1.0)
T_ALL = 192


def _old_dispatch(x, *, config, mesh_axis, kw):
  """The previous scheme (the oracle): the tokens all-gathered in ``x.dtype``; ``expand_fp8`` casts them all."""
  del config, kw
  return lax.all_gather(x, mesh_axis, axis=0, tiled=True), None


def _inputs(key, config, tokens, overloaded=False):
  k_params, k_x = jax.random.split(key)
  params = init_moe_params(k_params, config, H, I, jnp.bfloat16)
  if overloaded:  # every token's routed slots on experts 0..K-1: all on the first device
    bias = jnp.where(jnp.arange(config.num_experts) < config.num_topk, 10.0, 0.0)
  else:
    bias = jax.random.normal(k_params, params.router_bias.shape) * 0.1
  x = jax.random.normal(k_x, (tokens, H), jnp.float32).astype(jnp.bfloat16)
  return params._replace(router_bias=jnp.asarray(bias, jnp.float32)), x


def _fits(params, x, config, num_ranks):
  idx = route_tokens(params, x, config=config, implementation="reference").topk_idx[:, :config.num_topk]
  need = sharding.device_rows_needed(idx, num_experts=config.num_experts, num_ranks=num_ranks,
                                     alignment=config.alignment)
  return bool(jnp.max(need) <= ep_fused_rows(config, x.shape[0], num_ranks)[0])


def _sharded(config, mesh, check_vma):
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="reference")
  specs = moe_param_specs(split_shared_experts(init_moe_params(jax.random.key(0), config, H, I), config), "d")
  return jax.shard_map(layer, mesh=mesh, in_specs=(specs, P("d")), out_specs=P("d"), check_vma=check_vma)


def _value_and_grads(config, params, x, check_vma):
  """The sharded layer's output and the gradients of ``sum(sin(y))`` w.r.t. params and x (one jit, 2 devices)."""
  f = _sharded(config, _mesh((2,), ("d",)), check_vma)

  @jax.jit
  def run(ep, x):
    y, pullback = jax.vjp(f, ep, x)
    return y, *pullback(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

  y, gp, gx = run(split_shared_experts(params, config), x)
  return [np.asarray(a) for a in (y, *merge_shared_experts(gp), gx)]


NAMES = ["y", "drouter", "drouter_bias", "dw_gate", "dw_up", "dw_down", "dx"]


def _check_against_old(config, params, x, monkeypatch, check_vma):
  new = _value_and_grads(config, params, x, check_vma)
  with monkeypatch.context() as m:
    m.setattr(sharding, "_dispatch_tokens", _old_dispatch)
    old = _value_and_grads(config, params, x, check_vma)
  for name, a, b in zip(NAMES, new, old):
    np.testing.assert_array_equal(a, b, err_msg=name)
  for name in ("y", "drouter", "dw_gate", "dw_down", "dx"):
    assert np.any(new[NAMES.index(name)].astype(np.float32)), name
  return new


CASES = [  # (config, tokens, path): the capacity off (worst case), on with the fast path, on with the fallback
    pytest.param(EXPAND, T, "worst", id="expand-worst"),
    pytest.param(EXPAND, T, "fast", id="expand-fast"),
    pytest.param(EXPAND, T, "fallback", id="expand-fallback"),
    pytest.param(ALL_FP8, T_ALL, "worst", id="all_fp8-worst"),
    pytest.param(ALL_FP8, T_ALL, "fast", id="all_fp8-fast"),
    pytest.param(ALL_FP8, T_ALL, "fallback", id="all_fp8-fallback"),
]


@needs_2
@pytest.mark.parametrize("config, tokens, path", CASES)
def test_equals_old_dispatch_2dev(config, tokens, path, monkeypatch):
  """Forward and gradients bit-equal to the bf16 all-gather of the tokens, on each path of the layer."""
  if path == "worst":
    config = dataclasses.replace(config, ep_capacity_factor=None)
  params, x = _inputs(jax.random.key(7), config, tokens, overloaded=path == "fallback")
  if path != "worst":
    assert _fits(params, x, config, 2) == (path == "fast")
  _check_against_old(config, params, x, monkeypatch, check_vma=path != "fast")
