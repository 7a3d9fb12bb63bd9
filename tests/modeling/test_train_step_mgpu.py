"""``benchmarks.train_step``'s multi-device side: ``--devices 1,2`` with one global batch, the
strong-scaling efficiency, ``--check`` (loss and gradients of the 2-device sharded step against one device) and the
communication split (``collectives``, ``grad_allreduce``).

The ``*_2dev`` tests need 2 devices; :func:`test_two_device_tests_in_a_subprocess` reruns them in a child pytest with
``--xla_force_host_platform_device_count=2`` (tests/modeling/multi_device.py). They run the ``--small`` model on
the ``jnp`` references (``"auto"`` off a GPU).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import train_step
from jaxkern.modeling import block
from tests.modeling.multi_device import FAST_COMPILE_FLAGS, run_8dev_tests

TWO = jax.device_count() >= 2
needs_2 = pytest.mark.skipif(not TWO, reason="needs 2 devices (run by test_two_device_tests_in_a_subprocess)")


def test_parse_devices():
  assert train_step.parse_devices("1,2") == [1, 2]
  assert train_step.parse_devices("2") == [2]
  assert train_step.parse_devices("") == [] and train_step.parse_devices("0") == []
  assert train_step.parse_devices("1, 2,2") == [1, 2]


def _grads(rng):
  return {"embed": rng.normal(size=(4, 8)), "layers": [{"w": rng.normal(size=(3,)), "bias": np.zeros(2)}] * 2}


def test_compare_grads_passes_and_fails():
  """The check's comparison: within tolerance passes; a doubled gradient (a missing 1/N), a gradient on a buffer,
  a NaN or a loss off fail, and the report names the leaf group (layers pooled)."""
  rng = np.random.default_rng(0)
  g1 = _grads(rng)
  noisy = jax.tree.map(lambda a: a * (1 + 1e-3 * rng.normal(size=a.shape)), g1)
  ok, report = train_step.compare_grads(2.0, noisy, 2.0, g1, label="t", rtol=5e-2, loss_rtol=1e-3)
  assert ok, report
  assert "| layers.w | 2 |" in report and "| embed | 1 |" in report
  doubled = dict(noisy, embed=2 * noisy["embed"])
  ok, report = train_step.compare_grads(2.0, doubled, 2.0, g1, label="t", rtol=5e-2, loss_rtol=1e-3)
  assert not ok and "| embed | 1 | 1.00e+00" in report
  biased = dict(noisy, layers=[{"w": g1["layers"][0]["w"], "bias": np.ones(2)}] * 2)
  assert not train_step.compare_grads(2.0, biased, 2.0, g1, label="t", rtol=5e-2, loss_rtol=1e-3)[0]
  nan = dict(noisy, embed=np.full((4, 8), np.nan))
  assert not train_step.compare_grads(2.0, nan, 2.0, g1, label="t", rtol=5e-2, loss_rtol=1e-3)[0]
  assert not train_step.compare_grads(2.01, noisy, 2.0, g1, label="t", rtol=5e-2, loss_rtol=1e-3)[0]


@needs_2
def test_benchmark_2dev_check_and_scaling(tmp_path, capsys):
  """``--small --devices 1,2 --check --iterations 1 --ep-capacity-factor 1.5``: the check passes, the global batch is
  the same for both counts, the 2-device row has tokens/s and a scaling efficiency, the scaling table is printed;
  the capacity is the flag's (32 tokens, top-2 of 4 experts, alignment 8: 48 + 14 -> 64 rows, worst 64 + 14 -> 80)
  and the initial routing takes its path. (``--no-split``:
  the compute split of one device is the one-device test's, tests/modeling/test_block.py; the collectives are
  timed below; both at once would take this test past a minute of CPU.)"""
  out = tmp_path / "rows.jsonl"
  assert train_step.main(["--small", "--devices", "1,2", "--check", "--iterations", "1", "--implementations", "auto",
                          "--no-split", "--ep-capacity-factor", "1.5", "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "ep capacity auto 2 devices: factor 1.5, rows 64 (worst case 80, mean slots 32)" in printed
  assert ": capacity (initial params)" in printed
  assert "check auto 2 devices vs 1: loss" in printed and "check auto 2 devices: ok (largest" in printed
  assert "| layers.moe.w_gate | 1 |" in printed and "| layers.moe.router_bias |" in printed
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["component"], r["devices"]) for r in rows] == [("step", 1), ("step", 2)]
  assert rows[0]["shape"] == rows[1]["shape"] and rows[0]["shape"].startswith("T=32 ")  # batch 1 -> 2 sequences
  assert rows[0]["shape"].endswith(" ep_capacity=1.5") and all(r["ep_capacity_factor"] == 1.5 for r in rows)
  for r in rows:
    assert r["tokens_per_s"] == pytest.approx(32 / (1e-3 * r["wall_ms"])) and np.isfinite(r["loss"])
  assert rows[1]["scaling_efficiency"] == pytest.approx(rows[0]["wall_ms"] / (2 * rows[1]["wall_ms"]))
  assert "scaling_efficiency" not in rows[0]
  assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-3)
  assert "| auto | 2 |" in printed and "scaling efficiency (strong, same global batch)" in printed


@needs_2
def test_collectives_2dev():
  """The communication components on a 2-device mesh: the exchange's forward is psum_scatter(all_gather(x)) (= 2x
  for ones), its pullback of ones through all-gather / psum_scatter gives 2 per token; the all-reduce sums over the
  devices; the shapes are the step's."""
  config, b, s = train_step.small_config()
  params = block.init_block_params(jax.random.key(0), config)
  batch = block.synthetic_batch(np.random.default_rng(0), batch=2, seq_len=s, vocab_size=config.vocab_size)
  parts = train_step.collective_components(train_step.make_mesh(2), params, batch, config)
  assert set(parts) == {"collectives", "grad_allreduce"}
  fn, args, times = parts["collectives"]
  assert times == config.num_layers and args[0].shape == (32, config.hidden) and args[0].dtype == jnp.bfloat16
  (out, _), (dx, dw) = fn(*args)
  np.testing.assert_array_equal(np.asarray(out), 2.0)
  np.testing.assert_array_equal(np.asarray(dx, np.float32), 2.0)
  assert dw.shape == args[1].shape
  fn, (grads,), times = parts["grad_allreduce"]
  assert times == 1
  ep = block.ep_params(params, config)
  assert len(grads) == len(jax.tree.leaves(ep)) - 3  # all but the routed experts' three weights
  summed = fn([g + 1.5 for g in grads])
  assert all(np.all(np.asarray(x) == 3.0) for x in summed)
  for name, (fn, fargs, times) in parts.items():
    assert train_step.time_ms(fn, *fargs, iterations=1)["wall_ms"] > 0, name


def test_without_flags():
  argv = ["--config", "v3", "--devices", "1,2", "--check", "--out=x.jsonl", "--fp8-gemm", "--out", "y", "--no-split"]
  assert train_step._without_flags(argv, ("--devices", "--out", "--check")) == ["--config", "v3", "--fp8-gemm",
                                                                               "--no-split"]


@needs_2
def test_counts_in_processes_2dev(tmp_path, capsys):
  """Each count in a child process (the GPU path of ``--devices 1,2``): one global batch, the rows of both children,
  the scaling efficiency computed from them, the bf16 gradient reduce in the label of both."""
  out = tmp_path / "rows.jsonl"
  argv = ["--small", "--devices", "1,2", "--iterations", "1", "--implementations", "xla", "--no-split",
          "--grad-reduce-dtype", "bfloat16"]
  assert train_step.counts_in_processes(argv, [1, 2], check=False, out=out) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["component"], r["devices"]) for r in rows] == [("step", 1), ("step", 2)]
  assert rows[0]["shape"] == rows[1]["shape"] and rows[0]["shape"].startswith("T=32 ")  # batch 1 -> 2 sequences
  assert rows[0]["shape"].endswith(" grad_reduce=bfloat16")
  assert rows[1]["scaling_efficiency"] == pytest.approx(rows[0]["wall_ms"] / (2 * rows[1]["wall_ms"]))
  assert "| xla | 2 |" in capsys.readouterr().out


def _small_sharded_loss(seed: int):
  """The small block on a 2-device mesh: ``(config, params, batch, mesh, ep_params, specs, loss)``, ``loss`` the
  per-device loss with the expert-parallel MoE (the XLA paths) that ``sharded_value_and_grad`` takes."""
  config, _, s = train_step.small_config()
  params = block.init_block_params(jax.random.key(seed), config)
  batch = block.synthetic_batch(np.random.default_rng(seed), batch=2, seq_len=s, vocab_size=config.vocab_size)
  mesh = train_step.make_mesh(2)
  ep = block.ep_params(params, config)
  specs = block.block_param_specs(ep, train_step.AXIS)
  moe_fn = functools.partial(block.moe_ffn_ep, mesh_axis=train_step.AXIS)
  loss = functools.partial(block.loss_fn, config=config, implementation="xla", moe_fn=moe_fn)
  return config, params, batch, mesh, ep, specs, loss


@needs_2
def test_grad_reduce_dtype_2dev():
  """sharded_value_and_grad(grad_reduce_dtype=bfloat16): the replicated params' gradients summed in bfloat16 (close
  to the float32 sums, not equal to them), the sharded ones untouched; check_vma=True refuses it."""
  from jaxkern.modeling.sharding import sharded_value_and_grad

  config, params, batch, mesh, ep, specs, loss = _small_sharded_loss(seed=0)
  place = train_step._placer(mesh, config)
  results = {}
  for dtype in (None, jnp.bfloat16):
    vg = jax.jit(sharded_value_and_grad(loss, mesh, specs, check_vma=False, grad_reduce_dtype=dtype))
    results[dtype] = jax.tree.map(np.asarray, vg(place(params), place(batch)))
  (l32, g32), (l16, g16) = results[None], results[jnp.bfloat16]
  assert l32 == l16
  replicated = [spec == jax.sharding.PartitionSpec() for spec in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))]
  differs = []
  for is_replicated, a, b in zip(replicated, jax.tree.leaves(g32), jax.tree.leaves(g16)):
    if not is_replicated:
      np.testing.assert_array_equal(a, b)
      continue
    # bfloat16 rounds each device's gradient (2**-8 relative) and the sum: in norm, for leaves of many elements (a
    # one-element gradient whose two device parts nearly cancel, e.g. head.scale, is off by more relative to itself)
    if a.size >= 64:
      assert np.linalg.norm(b - a) <= 2 ** -7 * np.linalg.norm(a), (a.shape, np.linalg.norm(b - a) / np.linalg.norm(a))
    differs.append(not np.array_equal(a, b))
  assert any(differs), "the bfloat16 reduce took effect"
  with pytest.raises(ValueError, match="grad_reduce_dtype=.*check_vma=False"):
    sharded_value_and_grad(loss, mesh, specs, check_vma=True, grad_reduce_dtype=jnp.bfloat16)


@needs_2
def test_shard_replicated_2dev():
  """sharded_value_and_grad(shard_replicated="data") on the small block: the gradients come in the storage layout
  (storage_specs: embedding, Engram, mHC, router, readout split over the devices), equal to the replicated storage's
  (a sum of two is the same sum either way) up to rounding; with grad_reduce_dtype=bfloat16 the reduce-scatter's
  rounding, close in norm; merge_ep_params works on the gathered host arrays."""
  from jaxkern.modeling.sharding import sharded_value_and_grad, storage_specs

  config, params, batch, mesh, ep, specs, loss = _small_sharded_loss(seed=1)
  stored = storage_specs(specs, ep, mesh, train_step.AXIS)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  split = [a != b for a, b in zip(jax.tree.leaves(stored, is_leaf=is_spec), jax.tree.leaves(specs, is_leaf=is_spec))]
  assert sum(split) >= 10 and stored.embed == jax.sharding.PartitionSpec(train_step.AXIS)
  results = {}
  for dtype, axis in [(None, None), (None, train_step.AXIS), (jnp.bfloat16, train_step.AXIS)]:
    vg = jax.jit(sharded_value_and_grad(loss, mesh, specs, check_vma=False, grad_reduce_dtype=dtype,
                                        shard_replicated=axis))
    place = train_step._placer(mesh, config, shard_replicated=axis is not None)
    value, grads = vg(place(params), place(batch))
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(stored if axis else specs, is_leaf=is_spec)):
      assert g.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), g.ndim), (g.shape, g.sharding, spec)
    results[dtype, axis] = float(value), jax.tree.map(np.asarray, grads)
  (l0, g0), (l1, g1), (l2, g2) = results.values()
  assert l0 == l1 == l2
  assert jax.tree.structure(block.merge_ep_params(g1)) == jax.tree.structure(params)
  differs = []
  for is_split, a, b, c in zip(split, jax.tree.leaves(g0), jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * float(np.abs(a).max(initial=0.0)))
    if not is_split:
      continue
    if a.size >= 64:  # as test_grad_reduce_dtype_2dev: bfloat16 rounding of each device's part and of the sum
      assert np.linalg.norm(c - a) <= 2 ** -7 * np.linalg.norm(a), (a.shape, np.linalg.norm(c - a) / np.linalg.norm(a))
    differs.append(not np.array_equal(a, c))
  assert any(differs), "the bfloat16 reduce-scatter took effect"


@needs_2
def test_benchmark_2dev_shard_replicated(tmp_path, capsys):
  """``--small --devices 2 --shard-replicated --no-split --iterations 1 --implementations xla`` runs; the label says
  so."""
  out = tmp_path / "rows.jsonl"
  assert train_step.main(["--small", "--devices", "2", "--shard-replicated", "--no-split", "--iterations", "1",
                          "--implementations", "xla", "--out", str(out)]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["component"], r["devices"]) for r in rows] == [("step", 2)]
  assert rows[0]["shape"].endswith(" shard_replicated") and np.isfinite(rows[0]["loss"])
  assert "step xla devices=2" in capsys.readouterr().out


@needs_2
def test_benchmark_2dev_shard_optimizer(tmp_path, capsys):
  """``--shard-optimizer --check`` on 2 devices runs: the check passes, the chained steps keep the params whole and
  the label says so; with ``--shard-replicated`` it is refused."""
  out = tmp_path / "rows.jsonl"
  assert train_step.main(["--small", "--devices", "2", "--shard-optimizer", "--check", "--no-split", "--iterations",
                          "1", "--implementations", "xla", "--out", str(out)]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["component"], r["devices"]) for r in rows] == [("step", 2)]
  assert rows[0]["shape"].endswith(" shard_optimizer") and np.isfinite(rows[0]["loss"])
  printed = capsys.readouterr().out
  assert "step xla devices=2" in printed and "check " in printed
  with pytest.raises(SystemExit):
    train_step.main(["--small", "--devices", "2", "--shard-optimizer", "--shard-replicated"])


@needs_2
def test_sharded_step_shard_optimizer_2dev():
  """block.sharded_train_step(shard_optimizer=...) with Adam: two chained steps bit-equal to the step without (two
  devices: the reduce-scatter adds the same two partials), params whole, Adam's moments of the split leaves split."""
  config, params, batch, mesh, ep, specs, loss = _small_sharded_loss(seed=2)
  optimizer = optax.adam(1e-3)
  outs = []
  for flag in (False, True):
    step, place = train_step._mesh_step(2, config, optimizer, "xla", None, False, flag)
    p, b = place(params), place(batch)
    state = train_step.init_state(optimizer, p, 2, flag)
    for _ in range(2):
      result = step(p, state, b)
      p, state = result.params, result.opt_state
    outs.append((float(result.loss), jax.tree.map(np.asarray, p), state))
  (l0, p0, _), (l1, p1, s1) = outs
  assert l0 == l1
  jax.tree.map(np.testing.assert_array_equal, p1, p0)
  assert s1[0].mu.embed.sharding.spec == jax.sharding.PartitionSpec(train_step.AXIS)
  assert result.params.embed.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                                       2)


def test_shard_replicated_flag_passes_to_children():
  argv = ["--small", "--devices", "1,2", "--shard-replicated", "--out", "x"]
  assert train_step._without_flags(argv, ("--devices", "--out", "--check")) == ["--small", "--shard-replicated"]


@pytest.mark.skipif(TWO, reason="this process has 2 devices: the 2dev tests run here")
def test_two_device_tests_in_a_subprocess():
  """Runs this file's ``2dev`` tests in a child pytest with 2 simulated CPU devices, XLA:CPU's backend optimisation
  off (tests/modeling/multi_device.py; the checks compare within tolerances or programs compiled alike)."""
  run_8dev_tests(__file__, devices=2, keyword="2dev", xla_flags=FAST_COMPILE_FLAGS)
