"""The benchmark runner's registry, its no-GPU correctness pass and its compile/timing exclusion."""

import multiprocessing
import threading
import time

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


@pytest.mark.parametrize("shared", ["threads", "processes"])
def test_quiet_times_only_after_running_compiles(shared):
  ctx = multiprocessing.get_context("spawn")
  state = () if shared == "threads" else (ctx.Condition(), ctx.Value("i", 0, lock=False), ctx.Value("b", 0, lock=False))
  quiet, events = run._Quiet(*state), []

  class SlowCompile:
    def compile(self):
      events.append("compile")
      time.sleep(0.3)
      events.append("compiled")

  t = threading.Thread(target=quiet.compile, args=(SlowCompile(),))
  t.start()
  time.sleep(0.05)
  with quiet.timing():
    events.append("timing")
    late = threading.Thread(target=quiet.compile, args=(SlowCompile(),))
    late.start()
    time.sleep(0.1)
    events.append("timed")
  t.join()
  late.join()
  assert events == ["compile", "compiled", "timing", "timed", "compile", "compiled"]
