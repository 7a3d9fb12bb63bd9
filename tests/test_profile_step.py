"""benchmarks.profile_step: the trace parsing (kinds, busy time of overlapping kernels, per-step division) on a
synthetic perfetto trace, and a CPU smoke run of the small model."""

import json

import pytest

from benchmarks import profile_step


def _trace():
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
          dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU"))]
  kernels = [("body_mosaic_gpu_kernel", 0, 100), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50, 100),
             ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n", 200, 40), ("gemm_fusion_dot_6", 240, 20),
             ("loop_add_fusion_3", 300, 10), ("kernel_mosaic_gpu_kernel", 1000, 30)]
  events = [dict(ph="X", pid=1, name=n, ts=t, dur=d, args=dict(hlo_op=f"op{i}")) for i, (n, t, d) in enumerate(kernels)]
  events.append(dict(ph="X", pid=2, name="host work", ts=0, dur=5000))  # not a GPU: left out
  return dict(traceEvents=meta + events)


def test_kinds_and_times():
  per_gpu = profile_step.gpu_kernels(_trace())
  assert list(per_gpu) == ["/device:GPU:0"] and len(per_gpu["/device:GPU:0"]) == 6
  s = profile_step.summarize_gpu(per_gpu["/device:GPU:0"], steps=2)  # microseconds -> ms, per step
  assert s["mosaic"] == pytest.approx(0.065) and s["nccl"] == pytest.approx(0.05)
  assert s["gemm"] == pytest.approx(0.03) and s["xla"] == pytest.approx(0.005)
  assert s["kernel_sum"] == pytest.approx(0.15)
  assert s["busy"] == pytest.approx((150 + 60 + 10 + 30) / 2e3)  # the all-reduce overlaps the first kernel by 50
  assert s["span"] == pytest.approx(1030 / 2e3)
  assert next(iter(s["top"])) == "body_mosaic_gpu_kernel"
  labelled = profile_step.gpu_kernels(_trace(), sources={"op4": "adam @ optax.py:1"})
  assert "[op4] adam @ optax.py:1" in labelled["/device:GPU:0"][4][2]


def test_launches_without_their_instruction_take_their_kernels_label():
  trace = _trace()
  extra = [("loop_add_fusion_3", 400, 10, None), ("loop_add_fusion_3", 500, 10, "op9"),  # op9: no source line
           ("body_mosaic_gpu_kernel", 600, 20, None), ("body_mosaic_gpu_kernel", 700, 20, "op10"),
           ("input_reduce_fusion", 800, 5, None)]  # no launch of it names an instruction
  trace["traceEvents"] += [dict(ph="X", pid=1, name=n, ts=t, dur=d, args=dict(hlo_op=op) if op else {})
                           for n, t, d, op in extra]
  sources = {"op4": "adam @ optax.py:1", "op0": "expand @ moe.py:1", "op10": "swiglu @ moe.py:2"}
  labels = [label for _, _, label in profile_step.gpu_kernels(trace, sources)["/device:GPU:0"]]
  adam = "loop_add_fusion_3 [op4] adam @ optax.py:1"
  assert labels[4] == labels[6] == labels[7] == adam  # one label for every launch of the kernel
  assert labels[0] == "body_mosaic_gpu_kernel [op0] expand @ moe.py:1"  # a launch naming its own keeps it
  assert labels[9] == "body_mosaic_gpu_kernel [op10] swiglu @ moe.py:2"
  assert labels[8] == "body_mosaic_gpu_kernel [2 instructions]"  # a kernel shared by two: not guessed
  assert labels[10] == "input_reduce_fusion"
  s = profile_step.summarize_gpu(profile_step.gpu_kernels(trace, sources)["/device:GPU:0"], steps=1)
  assert s["top"][adam] == pytest.approx(0.03) and s["mosaic"] == pytest.approx(0.17)


def test_source_groups_and_kinds_by_kernel_name():
  group = profile_step.source_group
  assert group("loop_add_fusion_3 [fusion.3] jit(run)/jit(step)/add @ ") == "xla update add"
  assert group("wrapped_convert_5 [c.5] jit(run)/jit(step)/shard_map/transpose(jvp())/convert_element_type @ "
               ) == "xla backward convert_element_type"
  assert group("body_mosaic_gpu_kernel [m.1] p)/shard_map/jvp()/cond/branch_1_fun/jvp(jit(_ws2_kernel))/body/"
               "mpmd_map @ ") == "mosaic forward _ws2_kernel"
  assert group("loop_add_fusion_3") == "(no source)"
  # a source line naming a GEMM op does not make an elementwise fusion a GEMM
  fusion = [(0, 1000, "loop_convert_fusion [c.1] jit(step)/jvp(jit(fp8_grouped_gemm_weight_grad))/convert @ ")]
  assert profile_step.summarize_gpu(fusion, steps=1)["xla"] == pytest.approx(1.0)


def test_hlo_sources():
  text = ('  %fusion.3 = f32[8]{0} fusion(%a), kind=kLoop, metadata={op_name="jit(step)/add" '
          'source_file="/x/optax/update.py" source_line=12}\n')
  assert profile_step.hlo_sources(text) == {"fusion.3": "jit(step)/add @ update.py:12"}


def test_small_cpu_run(tmp_path, capsys):
  rows = tmp_path / "rows.jsonl"
  assert profile_step.main(["--small", "--devices", "1", "--steps", "1", "--implementation", "xla",
                            "--trace-dir", str(tmp_path / "trace"), "--rows", str(rows)]) == 0
  assert "1 device(s), T=16 H=256 " in capsys.readouterr().out
  assert not rows.exists()  # a CPU trace has no GPU kernels
