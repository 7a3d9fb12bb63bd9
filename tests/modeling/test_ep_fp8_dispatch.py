"""FP8 token dispatch of the expert-parallel layer (``MoeConfig.fp8_expand``, jaxkern.modeling.sharding): each
device casts its own tokens to FP8 and the all-gather moves the FP8 data and scales instead of the tokens; the
gradient of the tokens comes through a zero-valued anchor whose backward is the all-gather's transpose.

Checked, on 2 simulated CPU devices (references): forward and gradients (w.r.t. x, the routed and shared expert
weights and the router) bit-equal to the previous scheme (written here as the oracle: the ``x.dtype`` tokens
all-gathered, then :func:`jaxkern.modeling.expand_fp8` casting all of them on every device), with the capacity off
(the worst-case layout), on (the fast path) and forced onto its fallback (test_ep_capacity.py's overloading bias),
for ``fp8_expand`` alone and with every FP8 option (``fp8_swiglu``, ``fp8_gemm``); the HLO of the layer's gradient: the
all-gather carries ``(T, H)`` float8_e4m3fn tokens and no ``(T, H)`` bfloat16 ones (lowered; XLA:CPU's compiled HLO
moves them as f16, the old bf16 ones as f32); the op
:func:`jaxkern.modeling.moe.expand_fp8_quantized` against ``expand_fp8`` (value and gradient) and its input checks;
the kernels in interpret mode on a one-device mesh; the H100 lowering of the layer with the FP8 all-gather
(tests/modeling/test_ep_capacity.py: ``test_lowers_for_h100_two_devices``).

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


_RUNNERS = {}  # (config, check_vma, old) -> the jitted layer and its pullback: the fast and fallback cases share it


def _value_and_grads(config, params, x, check_vma, old=False):
  """The sharded layer's output and the gradients of ``sum(sin(y))`` w.r.t. params and x (one jit, 2 devices);
  ``old``: with the oracle's dispatch."""
  key = (config, check_vma, old)
  if key not in _RUNNERS:
    f = _sharded(config, _mesh((2,), ("d",)), check_vma)

    def run(ep, x):
      y, pullback = jax.vjp(f, ep, x)
      return y, *pullback(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

    _RUNNERS[key] = jax.jit(run).lower(split_shared_experts(params, config), x).compile()  # traced here
  y, gp, gx = _RUNNERS[key](split_shared_experts(params, config), x)
  return [np.asarray(a) for a in (y, *merge_shared_experts(gp), gx)]


NAMES = ["y", "drouter", "drouter_bias", "dw_gate", "dw_up", "dw_down", "dx"]


def _check_against_old(config, params, x, monkeypatch, check_vma):
  new = _value_and_grads(config, params, x, check_vma)
  with monkeypatch.context() as m:
    m.setattr(sharding, "_dispatch_tokens", _old_dispatch)
    old = _value_and_grads(config, params, x, check_vma, old=True)
  for name, a, b in zip(NAMES, new, old):
    np.testing.assert_array_equal(a, b, err_msg=name)
  for name in ("y", "drouter", "dw_gate", "dw_down", "dx"):
    assert np.any(new[NAMES.index(name)].astype(np.float32)), name


CASES = [  # (config, tokens, path, check_vma): the capacity off (worst case), on with the fast path, on with the
  # fallback (one compiled function for both); the FP8 GEMM reference runs under check_vma=False only (its scan carry
  # is not varying)
    pytest.param(EXPAND, T, "worst", True, id="expand-worst"),
    pytest.param(EXPAND, T, "fast", True, id="expand-fast"),
    pytest.param(EXPAND, T, "fallback", True, id="expand-fallback"),
    pytest.param(ALL_FP8, T_ALL, "worst", False, id="all_fp8-worst"),
    pytest.param(ALL_FP8, T_ALL, "fast", False, id="all_fp8-fast"),
    pytest.param(ALL_FP8, T_ALL, "fallback", False, id="all_fp8-fallback"),
]


@needs_2
@pytest.mark.parametrize("config, tokens, path, check_vma", CASES)
def test_equals_old_dispatch_2dev(config, tokens, path, check_vma, monkeypatch):
  """Forward and gradients bit-equal to the bf16 all-gather of the tokens, on each path of the layer."""
  if path == "worst":
    config = dataclasses.replace(config, ep_capacity_factor=None)
  params, x = _inputs(jax.random.key(7), config, tokens, overloaded=path == "fallback")
  if path != "worst":
    assert _fits(params, x, config, 2) == (path == "fast")
  _check_against_old(config, params, x, monkeypatch, check_vma=check_vma)


def test_interpret_one_device(monkeypatch):
  """The kernels in interpret mode (the per-token cast of the local tokens, the expand of the gathered FP8 rows, the
  cast back, the backward's slot sums) on a one-device mesh, check_vma off (one device: the capacity is not below the
  worst case, so no cond): bit-equal to the old dispatch (the interpreter's multi-device limits:
  tests/modeling/test_sharding.py)."""
  config = dataclasses.replace(EXPAND, num_experts=4)
  params, x = _inputs(jax.random.key(5), config, 16)
  mesh = _mesh((1,), ("d",))
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="interpret")
  specs = moe_param_specs(split_shared_experts(params, config), "d")

  def run_with(dispatch):
    with monkeypatch.context() as m:
      m.setattr(sharding, "_dispatch_tokens", dispatch)
      f = jax.shard_map(layer, mesh=mesh, in_specs=(specs, P("d")), out_specs=P("d"), check_vma=False)

      @jax.jit
      def run(ep, x):
        y, pullback = jax.vjp(f, ep, x)
        return y, *pullback(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

      return [np.asarray(a, np.float32) for a in jax.tree.leaves(run(split_shared_experts(params, config), x))]

  new, old = run_with(sharding._dispatch_tokens), run_with(_old_dispatch)
  for a, b in zip(new, old):
    np.testing.assert_array_equal(a, b)
  assert np.any(new[-1]) and np.any(new[0])


def _cond_inputs(jaxpr):
  """The ``(shape, dtype)`` operands of every ``cond`` in ``jaxpr`` and its sub-jaxprs (one list per cond)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      found.append([(tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars[1:]])
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += _cond_inputs(sub)
  return found


def _all_gathers(text, op):
  """The ``(shape, dtype)`` results of the all-gathers in ``text``: StableHLO (``op="stablehlo.all_gather"``:
  ``-> tensor<64x256xf8E4M3FN>``) or compiled HLO (``op="all-gather("``: ``f16[64,256]{1,0} all-gather(``)."""
  found = []
  for line in text.splitlines():
    if op not in line:
      continue
    if op.startswith("stablehlo"):
      m = re.search(r"->\s*\(?tensor<([0-9x]+)x(\w+)>", line)
      found.append((tuple(int(d) for d in m.group(1).split("x")), m.group(2)))
    else:
      m = re.search(r"= (\w+)\[([0-9,]*)\]\S* all-gather\(", line)
      found.append((tuple(int(d) for d in m.group(2).split(",") if d), m.group(1)))
  return found


@needs_2
@pytest.mark.parametrize("capacity", [None, 1.25], ids=["worst", "capacity"])
def test_hlo_gathers_fp8_tokens_2dev(capacity, monkeypatch):
  """``jax.grad`` of the layer (bf16 tokens, 2 devices): the tokens' all-gather is ``(T, H)`` float8_e4m3fn (with
  the ``(T, H/128)`` float32 scales) in the lowered StableHLO, and no ``(T, H)`` bf16 all-gather remains there nor in
  XLA:CPU's compiled HLO (which widens FP8 collectives to f16: the CPU has no FP8 types; a GPU keeps them). The
  oracle's dispatch (the previous scheme) has the bf16 one: the check can fail. With the capacity, the two conds
  (forward, backward) take the FP8 tokens and no ``(T, H)`` bf16 operand (the anchor stays out)."""
  config = dataclasses.replace(EXPAND, ep_capacity_factor=capacity)
  params, x = _inputs(jax.random.key(0), config, T)

  def texts():
    f = _sharded(config, _mesh((2,), ("d",)), True)
    loss = lambda p, x: jnp.sum(f(p, x).astype(jnp.float32))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(split_shared_experts(params, config), x)
    return _all_gathers(lowered.as_text(), "stablehlo.all_gather"), _all_gathers(lowered.compile().as_text(),
                                                                                 "all-gather(")

  tokens_bf16, tokens_fp8, scales = ((T, H), "bf16"), ((T, H), "f8E4M3FN"), ((T, H // 128), "f32")
  token_dtypes = lambda gathers: {dtype for shape, dtype in gathers if shape == (T, H)}
  lowered, compiled = texts()
  # Lowered, the float32 (T, H) all-gather is the backward of the output's psum_scatter (the loss' constant
  # cotangent: XLA folds it away in the compiled HLO).
  assert tokens_fp8 in lowered and scales in lowered, lowered
  assert token_dtypes(lowered) == {"f8E4M3FN", "f32"}, lowered
  # XLA:CPU moves FP8 collectives as f16 (no FP8 collectives on the host) and bf16 ones as f32.
  assert token_dtypes(compiled) and token_dtypes(compiled) <= {"f8e4m3fn", "f16"}, compiled
  if capacity:  # the anchor does not enter the conds (nor their residuals): only the FP8 tokens and scales do
    f = _sharded(config, _mesh((2,), ("d",)), True)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(f(p, x).astype(jnp.float32)), argnums=(0, 1)))(
        split_shared_experts(params, config), x).jaxpr
    inputs = _cond_inputs(jaxpr)
    assert len(inputs) == 2 and all(((T, H), "float8_e4m3fn") in i for i in inputs), inputs
    assert not any(((T, H), "bfloat16") in i for i in inputs), inputs
  with monkeypatch.context() as m:
    m.setattr(sharding, "_dispatch_tokens", _old_dispatch)
    lowered, compiled = texts()
  assert token_dtypes(lowered) == {"bf16", "f32"}, lowered
  assert token_dtypes(compiled) and not token_dtypes(compiled) <= {"f8e4m3fn", "f16"}, compiled


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_expand_fp8_quantized(dtype):
  """The op against :func:`expand_fp8` (bit-equal value and gradient, one device), its anchor's value unread, its
  input checks."""
  t, e, k = 24, 4, 2
  kx, ki, kc = jax.random.split(jax.random.key(1), 3)
  x = (jax.random.normal(kx, (t, H)) * 3).astype(dtype)
  idx = jnp.argsort(jax.random.uniform(ki, (t, e)), axis=1)[:, :k].astype(jnp.int32)
  idx = idx.at[3, 1].set(-1)  # an unused slot
  mapping = moe.get_fused_mapping(idx, e, 0, 8, force_no_sync=True, implementation="reference")
  maps = (mapping.token_topk_to_pos, mapping.pos_to_expert)
  ct = jax.random.normal(kc, (mapping.pos_to_expert.shape[0], H)).astype(dtype)

  @jax.jit
  def both(x):
    want, pull_want = jax.vjp(lambda x: expand_fp8(x, *maps, implementation="reference"), x)
    q = fp8_expand_cast(lax.stop_gradient(x), implementation="reference")
    anchor = jnp.full_like(x, jnp.nan)  # its value must not matter
    got, pull_got = jax.vjp(lambda a: expand_fp8_quantized(a, q, *maps, implementation="reference"), anchor)
    return want, got, pull_want(ct)[0], pull_got(ct)[0]

  want, got, dwant, dgot = both(x)
  assert got.dtype == dtype and got.shape == (mapping.pos_to_expert.shape[0], H)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  np.testing.assert_array_equal(np.asarray(dgot, np.float32), np.asarray(dwant, np.float32))
  assert np.any(np.asarray(dgot, np.float32)) and not np.any(np.isnan(np.asarray(got, np.float32)))
  q = fp8_expand_cast(x, implementation="reference")
  with pytest.raises(ValueError, match="anchor"):
    expand_fp8_quantized(x[:, :H - 64], QuantTensor(q.data[:, :H - 64], q.sf), *maps)
  with pytest.raises(ValueError, match="x_fp8"):
    expand_fp8_quantized(x, QuantTensor(q.data[:-1], q.sf[:-1]), *maps)
  with pytest.raises(ValueError, match="x_fp8"):
    expand_fp8_quantized(x, q.data, *maps)


@pytest.mark.skipif(TWO, reason="this process has 2 devices: the 2dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``2dev`` tests in a child pytest with 2 simulated CPU devices."""
  run_8dev_tests(__file__, devices=2, keyword="2dev")
