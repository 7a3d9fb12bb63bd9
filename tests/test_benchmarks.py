"""The benchmark runner's registry, its no-GPU correctness pass and its compile/timing exclusion."""

import json
import multiprocessing
import re
import threading
import time

import jax
import pytest

from benchmarks import run
from benchmarks.registry import REGISTRY, upstream_topk_idx


def test_registry_covers_the_spec_grids():
  assert len(REGISTRY["transpose"].cases()) == 2 * 2 * 7
  assert len(REGISTRY["batched_transpose"].cases()) == 3 * 2 * 2 * 7
  case = REGISTRY["batched_transpose"].cases()[0]
  assert case.label == "B=8 M=4032 N=576 e4m3" and case.nbytes == 2 * 8 * 4032 * 576


@pytest.mark.parametrize("experts, ranks", [(4, 64), (32, 8)])
def test_upstream_topk_idx_is_moe_topk_idx(experts, ranks):
  """The benchmark grids' routings, shared between ``K``s, are :func:`jaxkern.testing.moe_topk_idx`'s (bf16 scores
  over 256 experts tie often)."""
  from jaxkern.testing import moe_topk_idx

  for k in (1, 2, 6, 8, 9):
    want = moe_topk_idx(jax.random.key(0), 64, k, experts, ranks)
    got = upstream_topk_idx(64, k, experts, ranks)
    assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), k


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_runner_without_gpu(capsys, tmp_path):
  # topk_gate's registered callable takes no ``implementation`` argument: the pass must not pass one
  assert run.main(["--ops", "transpose,topk_gate"]) == 0
  out = capsys.readouterr().out
  assert "No GPU found" in out and "FAILED" not in out and "interpret" in out
  cases = len(REGISTRY["transpose"].small_cases()) + len(REGISTRY["topk_gate"].small_cases())
  assert out.splitlines()[-1] == f"{cases} ok, 0 failed, 0 skipped"
  with pytest.raises(SystemExit, match="unknown ops"):
    run.main(["--ops", "nope"])


def test_runner_runs_every_registered_op_by_default():
  """Without ``--ops`` the runner takes every registered op, and every op has small cases for the CPU pass."""
  assert run._select(None) == list(REGISTRY.values())
  assert all(op.small_cases() for op in REGISTRY.values())


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_runner_without_gpu_runs_every_registered_op(name, capsys, monkeypatch):
  """The README's main job on a CPU: every registered op's small cases run through the runner and match the
  reference. On the XLA paths, to stay fast (interpret mode takes minutes per mHC backward case on 2 cores); the
  kernels run in interpret mode in each op's own tests and in the two runner tests above. One op per test: all of
  them in one test took 403 CPU seconds (2026-11-29), one item that pytest-xdist cannot share between its workers."""
  monkeypatch.setattr(run, "CPU_PASS_IMPLEMENTATION", "xla")
  assert run.main(["--ops", name]) == 0
  lines = capsys.readouterr().out.splitlines()
  cases = len(REGISTRY[name].small_cases())
  assert [line.split()[0] for line in lines if line.endswith("  ok")] == [name] * cases
  assert lines[-1] == f"{cases} ok, 0 failed, 0 skipped"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_runner_without_gpu_honours_shapes_and_out(capsys, tmp_path):
  labels = [c.label for c in REGISTRY["transpose"].small_cases()]
  out_file = tmp_path / "rows.jsonl"
  assert run.main(["--ops", "transpose", "--shapes", f"^{re.escape(labels[0])}$", "--out", str(out_file)]) == 0
  rows = [json.loads(line) for line in out_file.read_text().splitlines()]
  assert [(r["op"], r["shape"], r["path"], r["correct"]) for r in rows] == [("transpose", labels[0], "interpret", True)]
  with pytest.raises(SystemExit, match="matches none"):
    run.main(["--ops", "transpose", "--shapes", "no such shape"])


SWIGLU_CHANNEL = "swiglu_forward_and_per_channel_cast_and_transpose_npt"


def test_swiglu_per_channel_grid():
  """Upstream's benchmark grid: tokens {4096, 8064} x 7 h x without_transpose x round_sf x clamp {None, 0.5}, per npt."""
  for npt in (32, 128):
    cases = REGISTRY[f"{SWIGLU_CHANNEL}{npt}"].cases()
    assert len(cases) == 2 * 7 * 2 * 2 * 2 and len({c.label for c in cases}) == len(cases)
    case = cases[-1]
    assert case.label == "M=8064 h=7168 no-transpose round clamp=0.5"
    assert case.nbytes == 8064 * 2 * 7168 * 2 + 8064 * 7168 + 8064 // npt * 7168 * 4
    assert case.kwargs == dict(round_sf=True, without_transpose=True, swiglu_clamp_value=0.5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_runner_without_gpu_swiglu_per_channel(tmp_path):
  out_file = tmp_path / "rows.jsonl"
  assert run.main(["--ops", f"{SWIGLU_CHANNEL}32,{SWIGLU_CHANNEL}128", "--out", str(out_file)]) == 0
  rows = [json.loads(line) for line in out_file.read_text().splitlines()]
  assert len(rows) == 4 and all(r["path"] == "interpret" and r["correct"] for r in rows)


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


def test_engram_spec_grid_and_byte_counts():
  assert [c.nbytes for c in REGISTRY["engram_hash"].cases()] == [140 * t + 304 for t in (4001, 8001)]
  fwd = REGISTRY["engram_gate_fwd"].cases()
  assert len(fwd) == 2 * 6 * 2 and fwd[0].label == "T=4001 D=2048 save=True"
  assert fwd[0].nbytes == 26 * 4001 * 2048 + 16 * 2048 + 64 * 4001
  assert fwd[1].nbytes == 26 * 4001 * 2048 + 16 * 2048
  assert REGISTRY["engram_gate_bwd"].cases()[-1].nbytes == 44 * 8001 * 7168 + 48 * 7168 + 64 * 8001


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_engram_small_cases_without_gpu(capsys):
  assert run.main(["--ops", "engram_hash,engram_gate_fwd,engram_gate_bwd,engram_gate:fwd+bwd"]) == 0
  out = capsys.readouterr().out
  assert "FAILED" not in out and out.count("ok") >= 5


# In interpret mode here. Not sinkhorn_normalize_bwd nor "mhc_pre->mhc_post:fwd+bwd": their small cases compile the
# Sinkhorn backward kernel at repeat = 10, a minute or more of CPU each in interpret mode; the runner runs them on
# the XLA path (test_runner_without_gpu_runs_every_registered_op); the kernel runs in interpret mode at repeat = 10
# in tests/mhc/test_sinkhorn.py, and inside mhc_pre's backward (repeat = 3) in tests/modeling/test_mhc_layers.py.
MHC_OPS = "expand_to_mhc,expand_to_mhc_bwd,pre_apply_mix,pre_apply_mix_bwd,post,post_bwd,sinkhorn_normalize"


def test_mhc_grid_and_byte_counts():
  post = REGISTRY["post"].cases()
  assert len(post) == 8 and post[-1].label == "T=8192 H=7168"
  t, h, m = 8192, 7168, 4
  assert post[-1].nbytes == 2 * t * h + 2 * t * m * h + 4 * t * m + 4 * t * m * m + 2 * t * m * h  # the bytes post reads and writes
  assert REGISTRY["post_bwd"].cases()[-1].nbytes == 2 * t * m * h + 2 * post[-1].nbytes
  assert REGISTRY["sinkhorn_normalize"].cases()[-1].nbytes == 2 * 4 * t * m * m


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_mhc_small_cases_without_gpu(capsys):
  assert run.main(["--ops", MHC_OPS]) == 0
  out = capsys.readouterr().out
  assert "FAILED" not in out and out.count("ok") >= 7
def test_pre_norm_fn_grid_and_byte_counts():
  k = 4 * 7168
  fwd = REGISTRY["pre_norm_fn"].cases()
  assert len(fwd) == 6 + 12 and fwd[2].label == "T=4096 H=7168"
  assert fwd[2].nbytes == 2 * 4096 * k + 4 * 24 * k + 4 * 4096 * 24
  assert REGISTRY["pre_norm_fn_bwd"].cases()[2].nbytes == 4 * 4096 * k + 8 * 24 * k + 8 * 4096 * 24 + 4 * 4096
  assert len(REGISTRY["pre_norm_fn:fwd+bwd"].cases()) == 6


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_pre_norm_fn_small_cases_without_gpu(capsys):
  assert run.main(["--ops", "pre_norm_fn,pre_norm_fn_bwd,pre_norm_fn:fwd+bwd"]) == 0
  out = capsys.readouterr().out
  assert "FAILED" not in out and out.count("ok") >= 4


def test_mhc_fused_grid_and_byte_counts():
  fuse = REGISTRY["pre_big_fuse"].cases()
  assert len(fuse) == 4 * 3 + 1 and fuse[-1].label == "T=8192 H=7168"
  t, h, m, j = 8192, 7168, 4, 24
  assert fuse[-1].nbytes == 2 * t * m * h + 4 * j * m * h + 12 + 4 * j + 4 * t * m + 4 * t * m * m + 2 * t * h
  pair = REGISTRY["mhc_pre->mhc_post:fwd+bwd"].cases()
  assert len(pair) == 4 and pair[-1].nbytes == 10 * t * m * h + 8 * j * m * h


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_mhc_fused_small_cases_without_gpu(capsys):
  assert run.main(["--ops", "pre_big_fuse"]) == 0  # not the pair: see MHC_OPS
  out = capsys.readouterr().out
  assert "FAILED" not in out and out.count("ok") >= 2


def test_multilayer_recompute_grid_and_byte_counts():
  cases = REGISTRY["multilayer_recompute"].cases()
  assert len(cases) == 8 and cases[-1].label == "L=10 Lp=10 S=8192 H=8192"
  n, h, m, l, lp = 8192, 8192, 4, 10, 10  # upstream's io_fused (its benchmark's byte count)
  assert cases[-1].nbytes == 2 * n * m * h + l * (4 * n * m + 2 * n * h) + lp * (
      2 * n * h + 4 * n * m + 4 * n * m * m + 2 * n * m * h)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_multilayer_recompute_small_cases_without_gpu(capsys):
  assert run.main(["--ops", "multilayer_recompute"]) == 0
  out = capsys.readouterr().out
  assert "FAILED" not in out and out.count("ok") >= 2


GEMM_OPS = "fp8_grouped_gemm,fp8_grouped_gemm_input_grad,fp8_grouped_gemm_input_grad:kn,fp8_grouped_gemm_weight_grad"


def test_gemm_grid_flops_and_byte_counts():
  m, n, k = 32768, 4096, 7168
  for op in GEMM_OPS.split(","):
    cases = REGISTRY[op].cases()
    assert [c.label.split()[0] for c in cases] == list("ABCD")
    assert cases[0].flops == 2 * m * n * k and cases[2].flops == 2 * 67584 * n * k
  wgrad = REGISTRY["fp8_grouped_gemm_weight_grad"].cases()[0]
  assert wgrad.nbytes == n * m + m * k + (m // 128) * (n + k) * 4 + (m // 128) * 4 + 8 * n * k * 2
  assert REGISTRY["fp8_grouped_gemm_input_grad:kn"].cases()[1].nbytes == REGISTRY[
      "fp8_grouped_gemm_input_grad"].cases()[1].nbytes


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the correctness-only pass is the no-GPU path")
def test_gemm_small_cases_without_gpu(capsys):
  assert run.main(["--ops", GEMM_OPS]) == 0
  out = capsys.readouterr().out
  assert "FAILED" not in out and sum(line.endswith("  ok") for line in out.splitlines()) == 4
  assert out.splitlines()[-1] == "4 ok, 0 failed, 0 skipped"
