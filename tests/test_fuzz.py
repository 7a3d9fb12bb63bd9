"""The differential fuzz harness (jaxkern.testing.fuzz): every public op covered or skipped with a reason, and a
bounded run per op, the kernel (interpret mode off a GPU, compiled on one) against the reference on small random
shapes and special values. The long runs go through the command line (``python -m jaxkern.testing.fuzz``)."""

import jax
import numpy as np
import pytest

from jaxkern.testing import assert_bitwise_equal, fuzz

# One example per op keeps the whole file near two minutes of CPU in interpret mode (2 cores, 2026-11-29); the
# seed varies the examples between runs of the command line, not here: a CI failure reproduces as printed.
EXAMPLES_PER_OP = 1
SEED = 0


def test_every_public_op_is_fuzzed_or_skipped_with_a_reason():
  public = set(fuzz.public_ops())
  assert public == set(fuzz.OPS) | set(fuzz.SKIPPED)
  assert not set(fuzz.OPS) & set(fuzz.SKIPPED)
  assert all(len(why) > 20 for why in fuzz.SKIPPED.values())


@pytest.mark.parametrize("op", sorted(fuzz.OPS))
def test_kernel_agrees_with_reference(op):
  implementation = "pallas" if jax.default_backend() == "gpu" else "interpret"
  tally = fuzz.fuzz_op(op, EXAMPLES_PER_OP, SEED, implementation, "small", log=lambda _: None)
  assert not tally.failures, "\n".join(f"index {i} ({label}): {what}" for i, label, what in tally.failures)


def test_examples_are_reproducible():
  a, b = fuzz.make_example("quant.per_block_cast", 7, 3), fuzz.make_example("quant.per_block_cast", 7, 3)
  assert a.label == b.label and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs
  assert_bitwise_equal(a.args[0], b.args[0])


def test_special_values_reach_the_inputs():
  x = np.concatenate([fuzz.floats(fuzz.example_rng(0, "x", i), (64, 64), np.float32).ravel() for i in range(8)])
  assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
  assert (np.signbit(x) & (x == 0)).any()
  assert ((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)).any()
  assert (np.abs(x) == 448).any() and (np.abs(x) == np.finfo(np.float32).max).any()


def test_comparisons_catch_a_flipped_bit_and_a_misplaced_nan():
  x = np.arange(8, dtype=np.float32)
  y = x.copy()
  y.view(np.uint32)[3] ^= 1
  with pytest.raises(AssertionError):
    fuzz.bitwise(y, x)
  fuzz.close(rtol=1e-6, atol=0)(y, x)
  with pytest.raises(AssertionError, match="NaN"):
    fuzz.close(rtol=1.0, atol=1.0)(np.where(x == 2, np.nan, x), x)


def test_command_line_counts_and_exit_status(capsys):
  assert fuzz.main(["--examples", "1", "--ops", "transpose.transpose", "--seed", "1"]) == 0
  out = capsys.readouterr().out
  assert "transpose.transpose" in out and "disagreements   0" in out and "kernel runs" in out and out.splitlines()[-1].startswith("TOTAL")
