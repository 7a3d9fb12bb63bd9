"""The expert-parallel layer's all-to-all exchange (``MoeConfig.ep_exchange="all_to_all"``,
jaxkern.modeling._ep_exchange): each token once to each device holding one of its experts, in per-destination buffers
of a static capacity with the worst case as the exact fallback, the partial sums back by the transposed exchange.

Checked: the static capacity and the config checks; the send-buffer layout (each token once per distinct destination,
in token order, rows past the capacity dropped and counted); on 8 simulated CPU devices (references, FP8 dispatch),
forward and every gradient leaf against the all-gather mode, with the capacity path taken (balanced routing) and its
fallback (every token's slots on the first device), one compiled function for both; the exchange's own kernels in
interpret mode against their references and lowered for an H100; the exchanged types of the layer's gradient (FP8 as
bytes, a bfloat16 combine, no all-gather of tokens). Against the unsharded step, with two chunks, on 2 processes:
tests/modeling/test_multiprocess.py.

Cost (CI, 2026-11-29, an idle 2-core machine): about 35 CPU-seconds for the ``8dev`` tests' child pytest
(:func:`test_multi_device_tests_in_a_subprocess`: 8 simulated devices, XLA:CPU's backend optimisation off), 20 for
the rest.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxkern import moe
from jaxkern.modeling import MoeConfig, _ep_exchange, init_moe_params, route_tokens
from jaxkern.modeling.sharding import (ep_fused_rows, merge_shared_experts, moe_layer_ep, moe_param_specs,
                                       split_shared_experts)
from jaxkern.testing import lower_for_h100
from tests.modeling.multi_device import EIGHT, FAST_COMPILE_FLAGS, mesh as _mesh, needs_8, run_8dev_tests

H, I = 256, 128
# 8 devices, 32 tokens each: 16 experts top-2 (2 a device), FP8 dispatch, capacity 1.25: C = round_up(1.25 x 32 x
# 1.93 / 8, 8) = 16 of the worst case's 32 rows per destination. (Chunks: tests/modeling/test_multiprocess.py.)
CONFIG = MoeConfig(num_experts=16, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8,
                   fp8_expand=True, ep_capacity_factor=1.25, ep_exchange="all_to_all")
T = 256
NAMES = ["y", "drouter", "drouter_bias", "dw_gate", "dw_up", "dw_down", "dx"]


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def test_capacity_and_config():
  assert MoeConfig(num_experts=8, num_topk=4).ep_exchange == "all_gather"  # the default
  assert _ep_exchange.mean_destinations(16, 2, 8) == pytest.approx(8 * (1 - 91 / 120))
  assert _ep_exchange.mean_destinations(8, 4, 2) == pytest.approx(2 * (1 - 1 / 70))  # the v3 layer: ~every device
  assert _ep_exchange.exchange_capacity(CONFIG, 32, 8) == (16, 32)
  assert _ep_exchange.exchange_capacity(CONFIG, 16, 8) == (8, 16)
  assert _ep_exchange.exchange_capacity(dataclasses.replace(CONFIG, ep_capacity_factor=None), 32, 8) == (32, 32)
  v3 = MoeConfig(num_experts=8, num_topk=4, ep_capacity_factor=1.25)
  assert _ep_exchange.exchange_capacity(v3, 4096, 2) == (4096, 4096)  # no saving: a token reaches both GPUs
  assert _ep_exchange.exchange_capacity(v3, 2048, 4) == (2016, 2048)  # 1.25 x 0.786 x 2048 = 2012: 2% saved
  for bad in (dict(ep_exchange="ragged"), dict(ep_exchange_chunks=0), dict(ep_exchange_chunks=1.0)):
    with pytest.raises(ValueError, match="ep_exchange"):
      MoeConfig(num_experts=8, num_topk=2, **bad)


def test_destination_layout():
  """Each token once per distinct destination, ranked in token order inside its destination's ``C`` rows; ranks
  past ``C`` dropped (-1) and the counts uncapped."""
  rng = np.random.default_rng(0)
  e, p, k, t, cap = 16, 4, 3, 40, 12
  idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  idx[5] = [0, 1, 2]  # three slots on device 0: one row
  kw = dict(implementation="reference")
  dev = _ep_exchange.destination_devices(jnp.asarray(idx), num_experts=e, num_ranks=p, kw=kw)
  buf_pos, buf_dev, counts = _ep_exchange.destination_layout(dev, num_ranks=p, capacity=cap, kw=kw)
  buf_pos, buf_dev, counts = map(np.asarray, (buf_pos, buf_dev, counts))
  want_counts = np.zeros(p, int)
  seen = [[] for _ in range(p)]
  for i in range(t):
    dests = list(dict.fromkeys(idx[i] // (e // p)))
    for d in dests:
      if len(seen[d]) < cap:
        assert (d * cap + len(seen[d])) in buf_pos[i], (i, d)
      seen[d].append(i)
      want_counts[d] += 1
    assert np.sum(buf_pos[i] >= 0) == sum(seen[d].index(i) < cap for d in dests)
  np.testing.assert_array_equal(counts, want_counts)
  assert counts.max() > cap, "the test must drop ranks past the capacity"
  np.testing.assert_array_equal(buf_dev, [d if j < min(counts[d], cap) else -1 for d in range(p) for j in range(cap)])


def _inputs(key, config, overloaded=False, dtype=jnp.float32):
  k_params, k_x = jax.random.split(key)
  params = init_moe_params(k_params, config, H, I, dtype)
  if overloaded:  # every token's routed slots on experts 0..K-1: all on the first device
    bias = jnp.where(jnp.arange(config.num_experts) < config.num_topk, 10.0, 0.0)
  else:
    bias = jax.random.normal(k_params, params.router_bias.shape) * 0.1
  x = jax.random.normal(k_x, (T, H), jnp.float32).astype(dtype)
  return params._replace(router_bias=jnp.asarray(bias, jnp.float32)), x


def _fits(params, x, config, num_ranks):
  """Whether the routing of ``x`` takes the capacity path (the layer's predicate, from the unsharded routing)."""
  idx = route_tokens(params, x, config=config, implementation="reference").topk_idx[:, :config.num_topk]
  n, local = config.ep_exchange_chunks, T // num_ranks
  counts = jnp.stack([_ep_exchange.chunk_counts(idx[r * local:(r + 1) * local], config=config, num_ranks=num_ranks,
                                                chunks=n, kw={}) for r in range(num_ranks)])
  cap, worst = _ep_exchange.exchange_capacity(config, local // n, num_ranks)
  rows = ep_fused_rows(config, T // n, num_ranks)[0]
  assert cap < worst
  return bool(_ep_exchange.fits_everywhere(counts, config=config, num_ranks=num_ranks, chunks=n, capacity=cap,
                                           rows=rows))


_RUNNERS = {}  # (config, devices, implementation) -> the compiled layer and its pullback


def _value_and_grads(config, params, x, devices=8, implementation="reference"):
  """The sharded layer's output and its pullback of ``cos(y)`` (params merged back), one compilation per setup."""
  key = (config, devices, implementation)
  ep = split_shared_experts(params, config)
  if key not in _RUNNERS:
    layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation=implementation)
    f = jax.shard_map(layer, mesh=_mesh((devices,), ("d",)), in_specs=(moe_param_specs(ep, "d"), P("d")),
                      out_specs=P("d"), check_vma=False)

    def run(ep, x):
      y, pullback = jax.vjp(f, ep, x)
      return y, *pullback(jnp.cos(y.astype(jnp.float32)).astype(y.dtype))

    _RUNNERS[key] = jax.jit(run).lower(ep, x).compile()
  y, gp, gx = _RUNNERS[key](ep, x)
  return [np.asarray(a, np.float32) for a in (y, *merge_shared_experts(gp), gx)]


def _assert_near(actual, expected, rtol, what):
  """Elementwise within ``rtol`` of the largest magnitude of ``expected`` (the sums' order differs)."""
  top = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
  assert float(np.abs(actual - expected).max(initial=0.0)) <= rtol * top, what


@needs_8
@pytest.mark.parametrize("overloaded", [False, True], ids=["capacity", "fallback"])
def test_matches_all_gather_8dev(overloaded):
  """Forward and every gradient leaf (FP8 dispatch, float32 tokens): the all-to-all mode against the all-gather mode
  (worst-case layout: the same FP8 rows reach the same experts, the same per-device partial sums; with ``K = 2`` a
  token has at most two nonzero partials, whose sum does not depend on the order, but XLA:CPU compiles the branches
  of the capacity cond on their own and their results differed in the last float32 bits, 2026-11-29). The all-gather
  mode equals the unsharded layer in test_sharding.py / test_ep_capacity.py / test_ep_fp8_dispatch.py, and the
  all-to-all mode (two chunks) the unsharded step in test_multiprocess.py; one more compilation of the unsharded
  layer here would cost CI 5 CPU-seconds."""
  params, x = _inputs(jax.random.key(1), CONFIG, overloaded)  # a seed whose routing fits the capacity
  assert _fits(params, x, CONFIG, 8) == (not overloaded)
  got = _value_and_grads(CONFIG, params, x)
  gathered = _value_and_grads(dataclasses.replace(CONFIG, ep_exchange="all_gather", ep_capacity_factor=None), params, x)
  for name, a, b in zip(NAMES, got, gathered):
    _assert_near(a, b, 2e-6, name)
  assert not np.any(got[NAMES.index("drouter_bias")])
  for name in ("y", "drouter", "dw_gate", "dw_down", "dx"):
    assert np.any(got[NAMES.index(name)]), name


def test_exchange_kernels_interpret_and_h100_lowering():
  """The kernels of the exchange's own steps in interpret mode against their references, bit for bit, and lowered
  for an H100: the destinations (``unique_group_indices``), the send-buffer layout (``get_fused_mapping`` over ``P``
  devices, alignment 1), the FP8 dispatch (``expand_to_fused_with_sf``) and the combine (``reduce_fused`` without
  weights). The whole layer runs the references on 8 devices above and the kernels on a GPU (the interpreter runs
  the layer's other kernels in test_sharding.py / test_ep_capacity.py)."""
  rng = np.random.default_rng(4)
  e, p, k, t, cap = 8, 4, 2, 16, 8
  idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32))
  data = jnp.asarray(rng.standard_normal((t, H)), jnp.float32).astype(jnp.float8_e4m3fn)
  sf = jnp.asarray(rng.uniform(0.5, 2.0, (t, H // 128)), jnp.float32)

  def steps(idx, data, sf, implementation):
    kw = dict(implementation=implementation)
    dev = _ep_exchange.destination_devices(idx, num_experts=e, num_ranks=p, kw=kw)
    buf_pos, buf_dev, counts = _ep_exchange.destination_layout(dev, num_ranks=p, capacity=cap, kw=kw)
    sent = moe.expand_to_fused_with_sf((data, sf), 128, buf_pos, buf_dev, **kw)
    combined = moe.reduce_fused(sent[1].repeat(256 // sent[1].shape[1], axis=1), None, buf_pos, **kw)
    return dev, buf_pos, buf_dev, counts, *sent, combined

  got, want = steps(idx, data, sf, "interpret"), steps(idx, data, sf, "reference")
  for name, a, b in zip(["dev", "buf_pos", "buf_dev", "counts", "sent", "sent_sf", "combined"], got, want):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)
  assert int(jnp.sum(got[1] >= 0)) > t, "some token must go to two devices"
  text = lower_for_h100(functools.partial(steps, implementation="pallas"), idx, data, sf).as_text()
  assert text.count("mosaic_gpu") >= 4


def test_exchange_types():
  """The layer's gradient (FP8 dispatch, bfloat16 combine; a one-device mesh, traced only): the exchange is
  ``all_to_all``, FP8 tokens as bytes, the combine's partial sums and the backward's cotangents in bfloat16, no
  all-gather of tokens and no float32 ``(rows, H)`` exchange."""
  config = dataclasses.replace(CONFIG, num_experts=4, ep_capacity_factor=None, ep_combine_dtype="bfloat16")
  params = jax.eval_shape(lambda: split_shared_experts(init_moe_params(jax.random.key(0), config, H, I), config))
  x = jax.ShapeDtypeStruct((32, H), jnp.bfloat16)
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="reference")
  f = jax.shard_map(layer, mesh=_mesh((1,), ("d",)), in_specs=(moe_param_specs(params, "d"), P("d")),
                    out_specs=P("d"), check_vma=False)
  loss = lambda p, x: jnp.sum(f(p, x).astype(jnp.float32))
  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
  exchanged = [line for line in text.splitlines() if "all_to_all" in line and f",{H}]" in line]
  assert any("u8[" in line for line in exchanged), exchanged  # FP8 rows as bytes
  assert any("bf16[" in line for line in exchanged) and not any("f32[" in line.split("=")[0] for line in exchanged)
  assert "all_gather" not in text or not any("all_gather" in l and f",{H}]" in l for l in text.splitlines())


@pytest.mark.skipif(EIGHT, reason="this process has 8 devices: the 8dev tests run here")
def test_multi_device_tests_in_a_subprocess():
  """Runs this file's ``8dev`` tests in a child pytest with 8 simulated CPU devices, XLA:CPU's backend optimisation
  off (a quarter off the compile time of these tiny shapes; the comparisons are between programs compiled alike or
  within tolerances)."""
  run_8dev_tests(__file__, xla_flags=FAST_COMPILE_FLAGS)
