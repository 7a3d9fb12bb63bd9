"""The runner's TileKernels targets, its device-memory sizing (fake device sizes, no GPU) and the
summary of RESULTS.md."""

import hashlib
import json
import pathlib
import subprocess
import sys
import types

import pytest

from benchmarks import memory, run, summarize, targets
from benchmarks.registry import REGISTRY

GiB = memory.GiB
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
WORKSPACE_ANCHORS = pathlib.Path(__file__).parents[2] / "shared" / "anchors"


# --- TileKernels targets ---------------------------------------------------------------------------

def test_every_target_maps_onto_a_registered_case():
  found, unmapped = targets.load()
  assert unmapped == () and len(found) == 261
  assert len(targets.TARGETS_FILE.read_text().splitlines()) == 261
  by_op = {}
  for op, label in found:
    by_op.setdefault(op, set()).add(label)
  assert set(by_op) <= set(REGISTRY)
  for op, labels in by_op.items():
    missing = labels - {c.label for c in REGISTRY[op].cases()}
    assert not missing, (op, sorted(missing)[:3])
  assert {row["device"] for row in found.values()} == {H100}


def test_every_h200_target_is_a_registered_case():
  found, unmapped = targets.load(targets.H200_TARGETS_FILE, runner_keys=True)
  assert unmapped == () and len(found) == 250
  assert {row["device"] for row in found.values()} == {H200}
  labels = {}  # each op's case list built once, not once per target
  for op, label in found:
    assert op in REGISTRY, op
    if op not in labels:
      labels[op] = {c.label for c in REGISTRY[op].cases()}
    assert label in labels[op], (op, label)
  cards, unmapped = targets.by_card()
  assert unmapped == () and set(cards) == {H100, H200} and len(cards[H200]) == 250


def test_tilekernels_selects_exactly_the_target_shapes():
  one_op = [REGISTRY["per_block_cast_32x32"]]  # cheap cases (others build routings on the CPU)
  todo = run._todo(one_op, None, tilekernels=True, gpu=H100)
  expected = {label for op, label in targets.load()[0] if op == "per_block_cast_32x32"}
  assert {label for _, label, _ in todo} == expected and len(todo) < len(run._todo(one_op, None, False))
  on_h200 = {label for _, label, _ in run._todo(one_op, None, tilekernels=True, gpu=H200)}
  assert on_h200 == {label for op, label in targets.by_card()[0][H200] if op == "per_block_cast_32x32"}
  anywhere = {label for _, label, _ in run._todo(one_op, None, tilekernels=True, gpu="NVIDIA B200")}
  assert anywhere == expected | on_h200  # a card without targets: the shapes with a target on any card
  # an op with targets on the H200 only
  assert len(run._todo([REGISTRY["engram_hash"]], None, tilekernels=True, gpu=H200)) == 2
  with pytest.raises(SystemExit, match="--tilekernels"):
    run._todo([REGISTRY["engram_hash"]], None, tilekernels=True, gpu=H100)
  narrowed = run._todo(one_op, "K=576", tilekernels=True)
  assert narrowed and all("K=576" in label for _, label, _ in narrowed) and len(narrowed) < len(todo)


@pytest.mark.parametrize("path", [targets.TARGETS_FILE, targets.H200_TARGETS_FILE], ids=["h100", "h200"])
def test_targets_copy_provenance(path):
  data = path.read_bytes()
  readme = (path.parent / "README.md").read_text()
  assert hashlib.sha256(data).hexdigest() in readme
  workspace = WORKSPACE_ANCHORS / path.name
  if workspace.exists():
    assert workspace.read_bytes() == data, "benchmarks/anchors/ is out of date with shared/anchors/"


@pytest.mark.parametrize("op, shape, key", [
    ("top2_sum_gate", "T=36 E=108 G=0 NTG=0 S=2 K=6 func=softmax", ("top2_sum_gate", "T=36 E=108 G=0/0 S=2 K=6 softmax")),
    ("reduce_fused", "E=4 R=64 K=6 T=26991 H=2048 in=bf16 out=e4m3 x_sf=True",
     ("reduce_fused:e4m3:x_sf", "E=4x64 K=6 T=26991 H=2048 bfloat16->e4m3")),
    ("reduce_fused", "E=9 R=8 K=6 T=18506 H=7168 in=fp32 out=fp32 x_sf=False",
     ("reduce_fused:same", "E=9x8 K=6 T=18506 H=7168 float32->float32")),
    ("per_block_cast", "M=8001 K=576 in=bf16 fmt=e4m3 block=32x32", ("per_block_cast_32x32", "M=8001 K=576 bf16")),
    ("per_block_cast", "M=8001 K=576 in=fp32 fmt=e2m1 block=128x32", ("per_block_cast_e2m1_128x32", "M=8001 K=576 fp32")),
    ("per_token_cast", "M=4001 K=576 in=bf16 fmt=e4m3 npc=576", ("per_token_cast_row", "M=4001 K=576 bf16")),
    ("cast_back", "M=4001 K=2048 out=fp32 block=128x1 round=True", ("cast_back_128x1_fp32", "M=4001 K=2048 fp32 round")),
    ("batched_transpose", "B=8 M=4032 N=576 dtype=bf16", ("batched_transpose", "B=8 M=4032 N=576 bf16")),
])
def test_runner_key(op, shape, key):
  assert targets.runner_key(op, shape) == key


@pytest.mark.parametrize("op, shape, match", [
    ("nope", "M=1", "no benchmark mapping"),
    ("transpose", "M=4032 N=576", "expected"),
    ("transpose", "M=4032 dtype=bf16 N=576", "expected"),
    ("transpose", "M=4032 N576 dtype=bf16", "key=value"),
    ("reduce_fused", "E=9 R=8 K=6 T=18506 H=7168 in=fp32 out=bf16 x_sf=False", "writes bf16 from fp32"),
    ("per_channel_cast", "M=4096 K=576 in=bf16 npt=32 round=False", "npt=128"),
])
def test_runner_key_rejects(op, shape, match):
  with pytest.raises(ValueError, match=match):
    targets.runner_key(op, shape)


def test_load_reports_unmapped_and_duplicate_rows(tmp_path):
  row = dict(op="transpose", shape="M=64 N=64 dtype=bf16", device=H100, target_speedup_over_xla=1.5)
  path = tmp_path / "t.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in (row, row, dict(row, op="nope"))) + "\n")
  found, unmapped = targets.load(path)
  assert list(found) == [("transpose", "M=64 N=64 bf16")]
  assert [reason.split(" ")[0] for _, reason in unmapped] == ["a", "no"]
  assert targets.load(tmp_path / "absent.jsonl") == ({}, ())


def test_row_fields_only_on_the_targets_card():
  assert targets.fields("transpose", "M=4032 N=576 e4m3", 1.2, H100) == dict(
      tilekernels_target_speedup=1.131, vs_tilekernels=round(1.2 / 1.131, 3))
  h200 = targets.target("transpose", "M=4032 N=576 e4m3", H200)["target_speedup_over_xla"]
  assert h200 != 1.131
  assert targets.fields("transpose", "M=4032 N=576 e4m3", 1.2, H200) == dict(
      tilekernels_target_speedup=h200, vs_tilekernels=round(1.2 / h200, 3))
  assert targets.fields("transpose", "M=4032 N=576 e4m3", 1.2, "NVIDIA B200") == dict(
      tilekernels_target_speedup=None, vs_tilekernels=None)
  assert targets.fields("transpose", "M=4032 N=576 fp32", 1.2, H100) == dict(
      tilekernels_target_speedup=None, vs_tilekernels=None)
  assert targets.fields("engram_hash", "T=4001 N=3 L=2 E=8", 1.2, H100) == dict(  # an H200-only target
      tilekernels_target_speedup=None, vs_tilekernels=None)


# --- device-memory sizing ---------------------------------------------------------------------------

def test_peak_bytes_check_and_timing_phases():
  pool = 40 * GiB
  # check: arguments + both output sets + the larger temporary (live = 2 GiB: one call at a time)
  assert memory.peak_bytes(GiB, (2 * GiB, 3 * GiB), (GiB, 0), 8 * GiB) == GiB + 5 * GiB + GiB
  # timing: live = pool / 4 = 10 GiB holds 5 calls' 2 GiB outputs
  assert memory.peak_bytes(GiB, (2 * GiB, 0), (0, 0), pool) == GiB + 10 * GiB
  # outputs larger than live: one call at a time
  assert memory.peak_bytes(GiB, (12 * GiB, 12 * GiB), (0, 0), pool) == 25 * GiB
  # at most `iterations` calls, at most 16 GiB live
  assert memory.peak_bytes(0, (GiB // 8, 0), (0, 0), 400 * GiB, iterations=30) == 30 * GiB // 8
  assert memory.peak_bytes(0, (GiB, 0), (0, 0), 400 * GiB) == 16 * GiB


@pytest.mark.parametrize("pool", [4 * GiB, 11 * GiB, 70 * GiB])
def test_estimate_bounds_every_split_of_the_registry_bytes(pool):
  for n in (0, 10**6, 3 * 10**8, 3 * GiB, 9 * GiB):
    for out in (0, n // 3, n // 2, n):
      exact = memory.peak_bytes(memory.FLUSH_BYTES + n - out, (memory.FLUSH_BYTES + out,) * 2, (0, 0), pool)
      assert memory.lower_bound(n) <= exact <= memory.estimate_peak(n, pool)


def test_pools_from_a_fake_80gb_device():
  total, parent = 80 * GiB, int(memory.PARENT_FRACTION * 80 * GiB)
  worker, big = memory.pools(total, parent, 6)
  usable = int(0.95 * total) - parent - GiB
  assert worker == (usable - 6 * GiB) // 6 and 10 * GiB < worker < 11 * GiB
  assert big == usable - GiB
  # the pools and the processes' contexts stay inside the device, each phase
  assert parent + GiB + 6 * (worker + GiB) <= 0.95 * total and parent + GiB + big + GiB <= 0.95 * total
  assert float(memory.fraction(worker, total)) * total <= worker


def test_too_many_workers_for_the_device():
  with pytest.raises(SystemExit, match="--workers 6 leaves .* per worker on this 16.0 GiB device.*fewer workers"):
    memory.pools(16 * GiB, GiB, 6)


def test_plan_assigns_small_large_and_skipped_cases():
  total = 80 * GiB
  nbytes = [GiB, 10 * GiB, 2 * GiB, 14 * GiB, 100 * GiB, 10**6, 3 * 10**8]
  plan = memory.plan(total, int(0.04 * total), 3, nbytes)
  assert 22 * GiB < plan.worker_pool < 23 * GiB and 70 * GiB < plan.big_pool < 71 * GiB
  # phase 1: 2 n + 3 flush within 90% of a worker's pool (10 GiB: 20.75 GiB > 20.6 GiB), round-robin
  assert plan.shares == ((0, 6), (2,), (5,))
  assert plan.big == (1, 3) and list(plan.skipped) == [4]
  assert "needs 100.5 GiB of device memory (inputs and outputs alone)" in plan.skipped[4]
  assert f"of the {memory.gib(plan.big_pool)} its process can use" in plan.skipped[4]


def test_out_of_memory_errors():
  assert memory.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.3GiB"))
  assert not memory.is_out_of_memory(ValueError("bad shape"))


ENV = dict(gpu=H100, date="2026-11-26", copy_gbps=3000.0)


def test_single_process_skips_what_cannot_fit(monkeypatch):
  seen = []
  monkeypatch.setattr(run, "_pool_bytes", lambda: 8 * GiB)

  def fake_rows(todo, *args):
    seen.extend(todo)
    yield from ()

  monkeypatch.setattr(run, "_rows", fake_rows)
  items = [("a", "small", 0, 2), ("b", "huge", 1, 2)]
  rows = list(run._single_rows(items, [GiB, 9 * GiB], 30, 1, ENV))
  assert seen == items[:1]
  assert [(r["op"], r["shape"], r["bytes"]) for r in rows] == [("b", "huge", 9 * GiB)]
  assert rows[0]["skipped"].startswith("needs 9.5 GiB of device memory (inputs and outputs alone), more than 90% of the 8.0 GiB")


def test_phased_run_sizes_pools_and_runs_deferred_cases_in_the_large_pool(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(run, "_pool_bytes", lambda: int(memory.PARENT_FRACTION * 80 * GiB))

  def fake_parallel(shares, iterations, jobs, env, mem_fraction, deferred=None):
    calls.append(([list(s) for s in shares], jobs, mem_fraction, deferred is not None))
    if deferred is not None:
      deferred.append(run._Deferred(shares[0][0], "too large once compiled"))
    for share in shares:
      yield from (dict(op=item[0], shape=item[1]) for item in share)

  monkeypatch.setattr(run, "_parallel_rows", fake_parallel)
  items = [(f"op{i}", f"s{i}", i, 5) for i in range(5)]
  nbytes = [GiB, 2 * GiB, 20 * GiB, 200 * GiB, GiB]  # pools of ~35 GiB: 20 GiB goes to phase 2
  rows = list(run._phased_rows(items, nbytes, 30, 12, 2, ENV, None))
  total = int(int(memory.PARENT_FRACTION * 80 * GiB) / memory.PARENT_FRACTION)  # the device size the parent's pool implies
  assert abs(total - 80 * GiB) < 100
  worker, big = memory.pools(total, int(memory.PARENT_FRACTION * 80 * GiB), 2)
  assert calls[0] == ([[items[0], items[4]], [items[1]]], 6, memory.fraction(worker, total), True)
  assert calls[1] == ([[items[0], items[2]]], 12, memory.fraction(big, total), False)
  assert rows[0]["skipped"] and rows[0]["op"] == "op3"
  assert [r["op"] for r in rows[1:]] == ["op0", "op4", "op1", "op0", "op2"]
  assert "device memory 80.0 GiB: 2 workers with" in capsys.readouterr().out
  # --device-memory 24: pools sized from 24 GiB, fractions of the device XLA sees
  calls.clear()
  list(run._phased_rows(items, nbytes, 30, 12, 2, ENV, 24 * GiB))
  worker, big = memory.pools(24 * GiB, int(memory.PARENT_FRACTION * 80 * GiB), 2)
  assert float(calls[0][2]) * total <= worker < (float(calls[0][2]) + 2e-4) * total
  assert float(calls[1][2]) * total <= big < (float(calls[1][2]) + 2e-4) * total


class _Compiled:
  def __init__(self, args, out, temp):
    self.stats = types.SimpleNamespace(argument_size_in_bytes=args, output_size_in_bytes=out, temp_size_in_bytes=temp)

  def memory_analysis(self):
    return self.stats


def test_compiled_case_too_large_for_the_pool(monkeypatch):
  monkeypatch.setattr(run, "_pool_bytes", lambda: 10 * GiB)
  run._check_fits(_Compiled(GiB, 2 * GiB, 0), _Compiled(GiB, 2 * GiB, GiB), 30)  # 6 GiB: fits
  run._check_fits(_Compiled(GiB, 2 * GiB, 0), _Compiled(GiB, 2 * GiB, 4 * GiB), 30)  # 9 GiB: just fits
  with pytest.raises(run._TooLarge, match=r"needs 10.0 GiB of device memory \(its compiled buffers\), more than 90% "
                                          r"of the 10.0 GiB"):
    run._check_fits(_Compiled(GiB, 2 * GiB, 0), _Compiled(GiB, 2 * GiB, 5 * GiB), 30)


def test_out_of_memory_while_measuring_is_too_large(monkeypatch):
  monkeypatch.setattr(run, "_pool_bytes", lambda: 0)  # no pool figure: no compiled check

  def oom(*args):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4617089024 bytes.\nmore")

  monkeypatch.setattr(run, "_check_and_time", oom)
  with pytest.raises(run._TooLarge, match=r"^ran out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying "
                                          r"to allocate 4617089024 bytes.$"):
    run._measure(*[None] * 10)
  monkeypatch.setattr(run, "_check_and_time", lambda *args: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    run._measure(*[None] * 10)


@pytest.mark.parametrize("defer", [False, True])
def test_rows_defer_or_skip_cases_too_large(monkeypatch, defer):
  op = REGISTRY["transpose"]
  labels = [c.label for c in op.cases()[:3]]
  items = [("transpose", label, i, 3) for i, label in enumerate(labels)]

  def fake_compile_all(todo, jobs, quiet):
    (op0, case0, _, item0), *rest = todo
    yield run._TooLargeCase(op0, case0, item0, "ran out of device memory: compiling")
    for op_, case, key, item in rest:
      yield op_, case, key, item, None, [], "kernel", "ref"

  def fake_measure(op_, case, *args):
    if case.label == labels[1]:
      raise run._TooLarge("needs 99 GiB")
    return dict(op=op_.name, shape=case.label)

  monkeypatch.setattr(run, "_compile_all", fake_compile_all)
  monkeypatch.setattr(run, "_measure", fake_measure)
  rows = list(run._rows(items, 30, 1, run._Quiet(), ENV, defer))
  assert rows[2] == dict(op="transpose", shape=labels[2])
  if defer:
    assert rows[:2] == [run._Deferred(items[0], "ran out of device memory: compiling"),
                        run._Deferred(items[1], "needs 99 GiB")]
  else:
    assert [(r["shape"], r["skipped"], r["gpu"]) for r in rows[:2]] == [
        (labels[0], "ran out of device memory: compiling", H100), (labels[1], "needs 99 GiB", H100)]


def test_benchmark_table_and_skipped_rows(monkeypatch, tmp_path, capsys):
  from jaxkern.testing import timing

  monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda: 3000.0)
  measured = dict(op="transpose", shape="M=4032 N=576 e4m3", path="pallas", device_us=3.9, gbps=1200.0,
                  pct_copy=40.0, xla_us=4.4, speedup=1.128, tilekernels_target_speedup=1.131, vs_tilekernels=0.997,
                  correct=True)

  def fake_single(items, nbytes, iterations, jobs, env):
    assert [i[:2] for i in items] == [("transpose", "M=4032 N=576 e4m3")]
    yield measured
    yield run._skipped_row("transpose", "M=4032 N=576 e4m3", nbytes[0], "needs 1 GiB", env)

  monkeypatch.setattr(run, "_single_rows", fake_single)
  out = tmp_path / "rows.jsonl"
  assert run._benchmark([REGISTRY["transpose"]], out, 30, "^M=4032 N=576 e4m3$", 1, 1) == 1
  text = capsys.readouterr().out
  assert "vs TK" in text and "  1.00" in text and "SKIPPED: needs 1 GiB" in text and "1 case(s) skipped" in text
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert rows[0] == measured and rows[1]["skipped"] == "needs 1 GiB"


# --- summary ----------------------------------------------------------------------------------------

def test_family():
  assert summarize.family("per_token_cast_e2m1_npc32") == "per_token_cast"
  assert summarize.family("per_token_cast_quant_input") == "per_token_cast"
  assert summarize.family("per_token_cast_back_e2m1_npc128_packed_bf16") == "per_token_cast_back"
  assert summarize.family("reduce_fused:e4m3:x_sf") == "reduce_fused"
  assert summarize.family("expand_to_fused_with_sf:npc32:row_fp32") == "expand_to_fused_with_sf"
  assert summarize.family("cast_back_128x1_fp32") == "cast_back"
  assert summarize.family("per_block_cast_lossless_128x128") == "per_block_cast_lossless"
  assert summarize.family("unpack_from_e2m1fn_x2_bf16") == "unpack_from_e2m1fn_x2"
  assert summarize.family("reduce_fused.bwd") == "reduce_fused.bwd"
  assert summarize.family("pre_norm_fn:fwd+bwd") == "pre_norm_fn:fwd+bwd"


def _row(op, shape, speedup, gpu=H100, time="2026-11-25T10:00:00+00:00", **kw):
  return dict(op=op, shape=shape, path="pallas", device_us=10.0, gbps=1000.0, pct_copy=33.0, xla_us=10 * speedup,
              speedup=speedup, correct=True, bytes=10**7, copy_gbps=3000.0, gpu=gpu, date=time[:10], jax="0.11.2",
              iterations=30, time=time, **kw)


def test_summary(tmp_path):
  rows = [
      _row("per_block_cast_32x32", "M=4001 K=576 bf16", 2.0, time="2026-11-24T10:00:00+00:00"),  # superseded
      _row("per_block_cast_32x32", "M=4001 K=576 bf16", 3.0),  # target 3.48: 0.86
      _row("per_block_cast_128x128", "M=8001 K=7168 bf16", 2.0, vs_tilekernels=1.5),  # the row's own field wins
      _row("per_block_cast_e2m1_32x32", "M=4001 K=576 bf16", 1.0),  # no target
      _row("per_block_cast_32x32", "M=4001 K=576 bf16", 5.0, gpu=H200, vs_tilekernels=None),  # vs its card's target
      _row("per_block_cast_e2m1_32x32", "M=4001 K=576 bf16", 1.0, gpu=H200),  # no target on the H200 either
      dict(op="per_block_cast_32x32", shape="M=8001 K=576 bf16", skipped="needs 99 GiB", gpu=H100, date="2026-11-26",
           time="2026-11-26T00:00:00+00:00"),
  ]
  path = tmp_path / "r.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  text = summarize.summarize([path])
  table = text.split("\n\n## Method")[0]
  assert len(table.splitlines()) <= 40
  h100 = [line for line in table.splitlines() if line.startswith("| per_block_cast | H100")]
  target = targets.target("per_block_cast_32x32", "M=4001 K=576 bf16", H100)["target_speedup_over_xla"]
  h200 = targets.target("per_block_cast_32x32", "M=4001 K=576 bf16", H200)["target_speedup_over_xla"]
  vs_h200 = round(5.0 / h200, 3)
  vs = round(3.0 / target, 3)
  assert h100 == [f"| per_block_cast | H100 | 3 | 1000 | 33 | 1.00 / 2.00 / 3.00 | {(vs + 1.5) / 2:.2f} / {vs:.2f} | "
                  "1 of 2 |"]
  assert (f"| per_block_cast | H200 | 2 | 1000 | 33 | 1.00 / 3.00 / 5.00 | {vs_h200:.2f} / {vs_h200:.2f} | "
          f"{int(vs_h200 < 0.97)} of 1 |") in table
  assert f"| M=4001 K=576 bf16 | pallas | 10.00 | 1000 | 33.0 | 50.00 | 5.00 | {h200:.2f} | {vs_h200:.2f} |" in text
  assert f"| M=4001 K=576 bf16 | pallas | 10.00 | 1000 | 33.0 | 30.00 | 3.00 | {target:.2f} | {vs:.2f} |" in text
  assert "Skipped in its newest run: M=8001 K=576 bf16 (needs 99 GiB)." in text


def test_summary_gemm_columns(tmp_path):
  rows = [_row("fp8_grouped_gemm", "A G=8 M=32768 N=4096 K=7168", 20.0, tflops=1200.4, xla_tflops=60.0),
          _row("fp8_grouped_gemm", "small G=2 M=256 N=128 K=256", 2.0, tflops=1.0, xla_tflops=0.5)]
  path = tmp_path / "r.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  text = summarize.summarize([path])
  assert "| shape | path | µs | GB/s | % copy | XLA µs | speed-up | TF/s | XLA TF/s | dense FP8 ceiling |" in text
  assert "| A G=8 M=32768 N=4096 K=7168 | pallas | 10.00 | 1000 | 33.0 | 200.00 | 20.00 | 1200 | 60 | 1587 |" in text
  assert "| small G=2 M=256 N=128 K=256 | pallas | 10.00 | 1000 | 33.0 | 20.00 | 2.00 | 1 | 0 | — |" in text


def test_train_step_tables(tmp_path):
  common = dict(gpu="NVIDIA-H200", shape="T=8 H=256", date="2026-11-26", time="10:00:00")
  rows = [dict(component="step", implementation="auto", devices=1, times=1, wall_ms=100.0, device_ms=30.0,
               tokens_per_s=80.0, loss=2.5, **common),
          dict(component="step", implementation="auto", devices=2, times=1, wall_ms=62.5, tokens_per_s=128.0,
               scaling_efficiency=0.8, pipelined_ms=50.0, scaling_efficiency_pipelined=0.9, loss=2.5,
               xla_flags="--xla_a=true", **common),
          dict(component="gemms", implementation="auto", devices=1, times=4, wall_ms=20.0, device_ms=19.0, **common),
          dict(component="collectives", implementation="auto", devices=2, times=4, wall_ms=1.0, **common)]
  path = tmp_path / "s.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  text = "\n".join(summarize.train_step_tables([path]))
  assert "| auto | 1 | 100.00 | 80 | — | — | — | 2.5000 |" in text
  assert "| auto | 2 | 62.50 | 128 | 80.0% | 50.00 | 90.0% | 2.5000 |" in text and "XLA_FLAGS: `--xla_a=true`" in text
  assert "| gemms | 80.00 | 76.00 |" in text and "| rest (wall) | 20.00 | — |" in text
  assert "collectives" not in text  # the split is the one-device one
  assert summarize.train_step_tables([]) == []
  profile = dict(component="profile", devices=2, gpu_index=1, mosaic=1.0, gemm=2.0, xla=3.0, nccl=4.0, busy=8.0,
                 kernel_sum=10.0, span=9.0, pipelined=9.5, note="a trace", **common)
  other_run = dict(profile, devices=1, gpu_index=0, mosaic=5.0, note="another trace")
  path.write_text("\n".join(json.dumps(r) for r in rows + [profile, other_run]) + "\n")
  text = "\n".join(summarize.train_step_tables([path]))
  assert "### Where the step's time goes: T=8 H=256 — NVIDIA-H200, 2026-11-26" in text
  assert "1. another trace\n2. a trace" in text  # each run's note once, numbered in the rows' order (devices first)
  assert "| 1 | 1 | 0 | 5.00 |" in text
  assert "| 2 | 2 | 1 | 1.00 | 2.00 | 3.00 | 4.00 | 10.00 | 8.00 | 9.00 | 9.50 |" in text
  assert "| auto | 2 | 62.50 | 128 | 80.0% | 50.00 | 90.0% | 2.5000 |" in text  # the step rows unchanged


def test_scaling_tables():
  """Weak scaling against the 1-GPU step of T/P tokens, strong against T (the exchange options dropped from the
  label), same card and day only; the exchange's GB/s rows."""
  step = lambda devices, shape, wall, piped, date="2026-11-29": dict(
      component="step", implementation="auto", devices=devices, wall_ms=wall, pipelined_ms=piped, gpu="H200",
      shape=shape, date=date)
  rows = [step(1, "T=8 H=4 cap", 40.0, 36.0), step(1, "T=16 H=4 cap", 70.0, 64.0),
          step(2, "T=16 H=4 cap ep_exchange=all_to_all ep_chunks=2", 50.0, 40.0),
          step(2, "T=32 H=4 cap", 80.0, 72.0),  # no 1-GPU step of 32 tokens: weak only
          step(2, "T=16 H=4 other", 10.0, 10.0),  # no 1-GPU step of this model: no row
          step(2, "T=16 H=4 cap", 35.0, 32.0, date="2026-11-30"),  # another day: no row
          dict(component="combine", devices=2, wall_ms=0.5, bytes_sent=8e7, gb_per_s=160.0, gpu="H200",
               shape="T=16 H=4 cap ep_exchange=all_to_all", date="2026-11-29")]
  text = "\n".join(summarize.scaling_tables(rows))
  assert ("| H200 | 2 | T=16 H=4 cap ep_exchange=all_to_all ep_chunks=2 | 2026-11-29 | 50.00 | 40.00 | 80.0% | 90.0% "
          "| 70.0% | 80.0% |") in text
  assert "| H200 | 2 | T=32 H=4 cap | 2026-11-29 | 80.00 | 72.00 | 87.5% | 88.9% | — | — |" in text
  assert "other" not in text and "2026-11-30" not in text
  assert "| H200 | 2 | T=16 H=4 cap ep_exchange=all_to_all | 2026-11-29 | combine | 0.500 | 80.0 | 160.0 |" in text
  assert summarize.scaling_tables([]) == []


def test_summarize_builds_no_benchmark_case():
  code = "import sys, benchmarks.summarize; print(sorted(m for m in sys.modules if m.startswith(('benchmarks.', 'jax'))))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=pathlib.Path(__file__).parents[1]).stdout
  assert out.strip() == "['benchmarks.summarize', 'benchmarks.targets']"


def test_deepgemm_tables(tmp_path):
  rows = [dict(device="NVIDIA H200", date="2026-11-30", shape="G=4 M=256 N=256 K=256", who=who, flush256_tflops=v)
          for who, v in (("deepgemm", 100.0), ("deepgemm", 110.0), ("jaxkern", 84.0), ("jaxkern", 84.0))]
  path = tmp_path / "x_gemm-vs-deepgemm-same-run.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  lines = summarize.deepgemm_tables([path])
  assert lines[-2] == "| NVIDIA H200 | 2026-11-30 | G=4 M=256 N=256 K=256 | 100.0, 110.0 | 84.0, 84.0 | 0.800 |"
  later = tmp_path / "y_gemm-vs-deepgemm-same-run-later.jsonl"
  later.write_text("".join(json.dumps(dict(r, run="faster loads", flush256_tflops=r["flush256_tflops"] + 10)) + "\n"
                           for r in rows))
  lines = summarize.deepgemm_tables([path, later])
  assert lines[-3:-1] == [
      "| NVIDIA H200 | 2026-11-30 | G=4 M=256 N=256 K=256 | 100.0, 110.0 | 84.0, 84.0 | 0.800 |",
      "| NVIDIA H200 | 2026-11-30, faster loads | G=4 M=256 N=256 K=256 | 110.0, 120.0 | 94.0, 94.0 | 0.817 |"]
  assert summarize.deepgemm_tables([]) == []
