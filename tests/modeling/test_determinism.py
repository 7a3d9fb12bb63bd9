"""Run-to-run determinism of the block's training step (:func:`jaxkern.modeling.block.train_step`, adamw): two runs of
10 steps from one seed give bitwise the same losses, params and optimiser state (NaN payloads and signed zeros
included). ``python -m benchmarks.determinism`` runs the same check at the benchmark's sizes and names the leaves that
differ."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import determinism
from jaxkern.modeling import block
from jaxkern.testing.lowering import capture_mosaic_modules

ON_GPU = jax.default_backend() == "gpu"
STEPS = 10
# Interpret mode takes about 40 s per step of this model on a 2-core CPU (2026-11-29), so the CPU run takes the ops'
# XLA paths (the same jnp glue, scatters and optimiser); on a GPU, the conftest's default: the compiled kernels.
IMPLEMENTATION = None if ON_GPU else "xla"


def _jitted_step(config, optimizer, implementation):
  return jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                   implementation=implementation))


def _train(step, config, batch, seq_len, seed):
  """``(losses (STEPS,), (params, opt_state))`` as numpy, every run building its state from ``seed`` again."""
  params, opt_state, batches, _ = determinism.build(config, batch, seq_len, STEPS, seed)
  losses = []
  for b in batches:
    params, opt_state, loss, _ = step(params, opt_state, b)
    losses.append(loss)
  return np.asarray(jnp.stack(losses)), jax.tree.map(np.asarray, (params, opt_state))


def _bits(a: np.ndarray) -> np.ndarray:
  return a if a.dtype == np.bool_ else a.view(f"u{a.dtype.itemsize}")


def assert_bitwise_equal(a, b):
  paths = jax.tree_util.tree_leaves_with_path(a)
  leaves_b = jax.tree.leaves(b)
  assert len(paths) == len(leaves_b)
  for (path, x), y in zip(paths, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    same = _bits(x) == _bits(y)
    assert same.all(), (f"{jax.tree_util.keystr(path)}: {np.size(same) - np.count_nonzero(same)} of {np.size(same)} "
                        "elements differ in their bits")


# jaxlib stamps every Mosaic GPU module it lowers with ``mosaic_gpu.dump_basename = "<name>_<n>"``, ``n`` a
# process-wide count of the modules lowered so far (the name of its dump files), so a second trace of the same kernel
# serialises another module and kernel hash (seen on an H200 and in a lowering for an H100 on a CPU, jax 0.11.2,
# 2026-11-29: that attribute is the only difference). The programs are compared with the Mosaic custom calls'
# payloads masked, and the kernels' modules as text with that attribute masked.
_MOSAIC_PAYLOAD = re.compile(r'\b(kernel_hash|module) = "[^"]*"')
_DUMP_BASENAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def _program_text(lowered) -> str:
  return _MOSAIC_PAYLOAD.sub(r'\1 = "<mosaic payload>"', lowered.as_text())


def test_two_runs_from_one_seed_are_bitwise_identical(monkeypatch):
  """Two traces lower to the same program (the same kernels), and its executable run twice from one seed gives the
  same bits."""
  config, batch, seq_len = determinism.test_config()
  optimizer = determinism.build_optimizer()
  shapes = jax.eval_shape(lambda: determinism.build(config, batch, seq_len, 1, 0)[:3])
  args = shapes[0], shapes[1], shapes[2][0]
  kernels = capture_mosaic_modules(monkeypatch, keep=lambda module: _DUMP_BASENAME.sub("", str(module)))
  # a fresh jit per trace: nothing cached between them
  lowered, modules = [], []
  for _ in range(2):
    lowered.append(_jitted_step(config, optimizer, IMPLEMENTATION).trace(*args).lower())
    modules.append(list(kernels))
    kernels.clear()
  assert _program_text(lowered[0]) == _program_text(lowered[1]), "tracing the step twice gave two programs"
  assert modules[0] == modules[1], "tracing the step twice gave other Mosaic GPU kernels"
  # on a GPU with XLA's deterministic scatter: the embedding gather's backward adds the rows of repeated tokens with
  # atomics otherwise (test_fp8_step_is_bitwise_deterministic_on_gpu[default])
  step = lowered[0].compile(GPU_CASES["scatter_determinism_expander"] if ON_GPU else None)
  losses_a, state_a = _train(step, config, batch, seq_len, seed=0)
  losses_b, state_b = _train(step, config, batch, seq_len, seed=0)
  assert_bitwise_equal((losses_a, state_a), (losses_b, state_b))
  assert np.isfinite(losses_a).all() and len(set(losses_a.tolist())) == STEPS, losses_a  # it trained
  initial = jax.tree.map(np.asarray, determinism.build(config, batch, seq_len, 1, 0)[0])
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state_a[0]), jax.tree.leaves(initial))]
  assert sum(moved) >= len(moved) - 1, moved  # every param but the router bias (a buffer: adamw decays a zero)


def test_bitwise_comparison_sees_one_bit_and_nan_payloads():
  """The comparison the test above relies on: a flipped lowest bit, -0 against 0 and two NaN payloads differ."""
  a = np.array([1.0, 0.0, np.nan], np.float32)
  for i, other in enumerate([np.nextafter(np.float32(1), np.float32(2)), np.float32(-0.0),
                             np.uint32(0x7FC00001).view(np.float32)]):
    b = a.copy()
    b[i] = other
    with pytest.raises(AssertionError, match="1 of 3 elements differ"):
      assert_bitwise_equal({"x": a}, {"x": b})
  assert_bitwise_equal({"x": a, "y": a.astype(jnp.bfloat16)}, {"x": a.copy(), "y": a.astype(jnp.bfloat16)})


# The step's float scatter-adds (the backward of the embedding and Engram table gathers) add rows of repeated ids;
# XLA's GPU scatter adds them with atomics unless told otherwise. 1024 tokens over 64 ids: about 16 rows per id.
GPU_CASES = {"default": None, "scatter_determinism_expander": {"xla_gpu_enable_scatter_determinism_expander": True}}


@pytest.mark.gpu
@pytest.mark.parametrize("options", list(GPU_CASES))
def test_fp8_step_is_bitwise_deterministic_on_gpu(options):
  """The benchmark's op mix (FP8 expand, SwiGLU and grouped GEMMs) with the compiled kernels, 2 layers, 1024 tokens,
  one executable run twice; ``python -m benchmarks.determinism --scatters`` names what differs."""
  config = block.BlockConfig(num_layers=2, vocab_size=64, fp8_gemm=True)
  batch, seq_len = 4, 256
  optimizer = determinism.build_optimizer()
  shapes = jax.eval_shape(lambda: determinism.build(config, batch, seq_len, 1, 0)[:3])
  step = determinism.compile_step(config, optimizer, None, shapes[0], shapes[1], shapes[2][0], GPU_CASES[options])
  first = _train(step, config, batch, seq_len, seed=0)
  assert_bitwise_equal(first, _train(step, config, batch, seq_len, seed=0))


def test_fingerprints_comparison_and_digests(tmp_path):
  """benchmarks.determinism's pieces on small pytrees: a one-ulp change, -0 for 0 or another NaN payload changes
  exactly that leaf's fingerprint; compare() names the leaf and the step; digests round-trip through JSON."""
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([0.0, np.nan]), "c": jnp.ones(3, jnp.bfloat16),
          "n": jnp.int32(3)}
  names = determinism.leaf_names(tree)
  base = np.asarray(determinism.fingerprints(tree))
  one_ulp = tree["a"].at[1, 2].set(np.nextafter(np.float32(5), np.float32(6)))
  changes = [("a", one_ulp), ("b", jnp.array([-0.0, np.nan])), ("c", tree["c"].at[0].set(1.0078125)),
             ("b", jnp.asarray(np.array([0, 0x7FC00001], np.uint32).view(np.float32)))]  # another NaN payload
  for key, value in changes:
    changed = np.asarray(determinism.fingerprints({**tree, key: value}))
    assert [names[i] for i in np.flatnonzero(np.any(changed != base, axis=1))] == [f"['{key}']"], key

  losses = np.array([1.5, 1.25], np.float32)
  same = determinism.Trajectory(losses, np.stack([base, base]))
  other = determinism.Trajectory(losses, np.stack([base, np.asarray(determinism.fingerprints(
      {**tree, "a": one_ulp}))]))
  assert determinism.compare(same, same, names).identical
  comparison = determinism.compare(same, other, names)
  assert comparison.first_step == 2 and comparison.leaf_steps == {2: [0]}
  assert "['a']" in comparison.report() and "DIFFERENT from step 2" in comparison.report()

  paths = []
  for name, trajectory in (("same", same), ("other", other)):
    paths.append(tmp_path / f"{name}.json")
    paths[-1].write_text(json.dumps(determinism.digest(trajectory, names, name, {})))
  assert determinism.main(["--compare", str(paths[0]), str(paths[0])]) == 0
  assert determinism.main(["--compare", str(paths[0]), str(paths[1])]) == 1


def test_scatter_lines_name_the_gradient_leaf():
  embed = jnp.zeros((8, 4))
  compiled = jax.jit(jax.grad(lambda e, i: jnp.sum(e[i] ** 2))).lower(embed, jnp.zeros(5, jnp.int32)).compile()
  lines = determinism.scatter_lines(compiled.as_text(), determinism.hlo_shapes({"embed": embed}))
  assert len(lines) == 1 and lines[0].startswith("f32[8,4]"), lines
  assert "combiner add" in lines[0] and "shape of ['embed']" in lines[0], lines
