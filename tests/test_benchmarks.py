"""The benchmark runner's registry and its no-GPU correctness pass."""

import jax
import pytest

from benchmarks import run
from benchmarks.registry import REGISTRY


def test_registry_covers_the_spec_grids():
  assert len(REGISTRY["transpose"].cases()) == 2 * 2 * 7
  assert len(REGISTRY["batched_transpose"].cases()) == 3 * 2 * 2 * 7
  case = REGISTRY["batched_transpose"].cases()[0]
  assert case.label == "B=8 M=4032 N=576 e4m3" and case.nbytes == 2 * 8 * 4032 * 576


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_runner_without_gpu(capsys):
  assert run.main(["--ops", "transpose"]) == 0
  out = capsys.readouterr().out
  assert "No GPU found" in out and "ok" in out and "FAILED" not in out
  with pytest.raises(SystemExit, match="unknown ops"):
    run.main(["--ops", "nope"])
