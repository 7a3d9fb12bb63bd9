"""Where the training step's GPU time goes: ``python -m benchmarks.profile_step --config v3 --fp8-gemm --devices 1``.

Runs the step of :mod:`benchmarks.train_step` (same model flags: ``--config``, ``--small``, ``--fp8-gemm``,
``--ep-capacity-factor``, ``--ep-combine-dtype``, ``--ep-exchange``, ``--ep-exchange-chunks``, ``--grad-reduce-dtype``,
``--shard-replicated``, ``--shard-optimizer``, ``--batch``) on one device
count at a time (``--devices N``: 1 the unsharded step on a one-device mesh, N > 1 the expert-parallel sharded
step), as a training loop runs it: ``--steps`` chained steps (each takes the params and optimiser state the one
before returned), blocked on once. Then it traces the same number of chained steps with ``jax.profiler`` (a perfetto
trace) and sums the GPU kernels' durations per GPU, by kind:

* ``mosaic``: jaxkern's Pallas Mosaic GPU kernels (routing, casts, expand / reduce, SwiGLU, the FP8 GEMMs, mHC,
  Engram: the trace names them all ``*_mosaic_gpu_kernel``, so they are one kind here);
* ``gemm``: XLA's GEMMs (cuBLAS, e.g. the float32 readout's TF32 GEMMs, and Triton ``gemm_fusion`` kernels);
* ``nccl``: the collectives (the MoE token exchange, the gradient all-reduce);
* ``xla``: the other XLA kernels (the optimiser's fusions, casts, elementwise and reductions, copies);

plus ``kernel_sum`` (all kernels), ``busy`` (the union of the kernels' intervals: kernels on several streams
overlap, communication with compute included), ``span`` (first kernel start to last kernel end) per step, and the
untraced ``pipelined`` wall-clock ms per step. ``--top K`` prints the K kernels of most time; ``--sources`` labels
them with their HLO instruction's source line (this compiles the step a second time) and also prints the K groups of
most time by kind, phase and op (:func:`source_group`: e.g. ``xla update add`` for Adam, ``xla backward
convert_element_type``). ``--rows FILE`` appends one row per GPU (``component="profile"``) that ``python -m
benchmarks.summarize`` renders below the step tables when the file is under ``benchmarks/results/train_step/``.

One device count per process (``--devices 2``, not ``1,2``): see :func:`benchmarks.train_step.counts_in_processes`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import train_step as ts
from jaxkern.modeling import block

KINDS = (("mosaic", r"mosaic_gpu"), ("nccl", r"nccl"), ("gemm", r"^gemm_fusion|xmma_gemm|cublas|cutlass|nvjet|gemm_"))


def kind(name: str) -> str:
  """The kind of a kernel by its trace name (module docstring); of a :func:`gpu_kernels` label, by the kernel name
  before its source (a source line naming a GEMM op does not make an elementwise fusion a GEMM)."""
  name = name.split(" [", 1)[0]
  for label, pattern in KINDS:
    if re.search(pattern, name, re.I):
      return label
  return "xla"


def hlo_sources(text: str) -> dict:
  """HLO instruction name -> ``op_name tail @ file:line`` from a compiled module's text."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", text, re.M):
    md = m.group(2)
    op = re.search(r'op_name="([^"]*)"', md)
    sf = re.search(r'source_file="([^"]*)"', md)
    sl = re.search(r"source_line=(\d+)", md)
    where = (sf.group(1).split("/")[-1] + ":" + sl.group(1)) if sf and sl else ""
    out[m.group(1)] = (op.group(1)[-70:] if op else "") + " @ " + where
  return out


def gpu_kernels(trace: dict, sources: dict | None = None) -> dict:
  """``{gpu name: [(start_us, duration_us, label)]}``: the complete events of the trace's GPU processes.

  With ``sources`` (:func:`hlo_sources`) a kernel whose event names its HLO instruction is labelled with it. Not
  every launch does: in traces of 3 chained v3 steps on H200s (2026-11-27) many kernels had a third of their launches
  named and two thirds not (likely the launches XLA replays from a command buffer, a CUDA graph; not verified), so
  ``--top`` listed such a kernel twice. A launch without its own instruction takes the label its kernel name has
  elsewhere in the trace when that is one label; a kernel name shared by several instructions (XLA reuses one
  kernel for identical fusions; every Mosaic GPU kernel is ``body_`` / ``kernel_mosaic_gpu_kernel``) gets
  ``[N instructions]`` instead."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  out = collections.defaultdict(list)
  labels = collections.defaultdict(set)  # kernel name -> the source labels of its launches that name an instruction
  for e in events:
    process = names.get(e.get("pid"), "")
    if e.get("ph") != "X" or "dur" not in e or "gpu" not in process.lower():
      continue
    label = e["name"]
    op = e.get("args", {}).get("hlo_op", "")
    if sources and op in sources:
      label = f"{label[:40]} [{op}] {sources[op]}"
      labels[e["name"]].add(label)
    out[process].append((e["ts"], e["dur"], label))
  attributed = {name: next(iter(known)) if len(known) == 1 else f"{name[:40]} [{len(known)} instructions]"
                for name, known in labels.items()}
  return {process: [(t, d, attributed.get(label, label)) for t, d, label in kernels] for process, kernels in out.items()}


def source_group(label: str) -> str:
  """``kind phase name`` of a kernel label from :func:`gpu_kernels` with sources: ``phase`` ``backward`` where the
  op_name (its last 70 characters) has a ``transpose(``, ``forward`` where it has a ``jvp(``, else ``update``
  (outside the differentiated function: the optimiser, the gradients' casts around their reduction); ``name`` the
  innermost ``jit(...)`` that is not the step's own (a jaxkern kernel or helper) or else the op_name's last
  primitive (``add``, ``convert_element_type``, ...). ``(no source)`` for a label without one."""
  if "] " not in label:
    return "(no source)"
  source = label.split("] ", 1)[1].rsplit(" @ ", 1)[0]
  phase = "backward" if "transpose(" in source else "forward" if "jvp(" in source else "update"
  jits = [j for j in re.findall(r"jit\((\w+)\)", source) if j not in ("run", "step", "train_step")]
  return f"{kind(label)} {phase} {jits[-1] if jits else source.rsplit('/', 1)[-1]}"


def summarize_gpu(kernels, steps: int) -> dict:
  """Per step (ms): the kernel time by kind, ``kernel_sum``, ``busy`` (union of the intervals) and ``span``, and
  ``top`` (label -> ms) of one GPU's ``(start, duration, label)`` kernels."""
  kernels = sorted(kernels)
  by_label = collections.Counter()
  for _, duration, label in kernels:
    by_label[label] += duration
  busy, end = 0.0, -float("inf")
  for start, duration, _ in kernels:
    lo, hi = max(start, end), start + duration
    busy += max(0.0, hi - lo)
    end = max(end, hi)
  span = kernels[-1][0] + kernels[-1][1] - kernels[0][0] if kernels else 0.0
  out = {k: 0.0 for k, _ in KINDS} | {"xla": 0.0}
  for label, duration in by_label.items():
    out[kind(label)] += duration / 1e3 / steps
  out.update(kernel_sum=sum(by_label.values()) / 1e3 / steps, busy=busy / 1e3 / steps, span=span / 1e3 / steps,
             top={label: d / 1e3 / steps for label, d in by_label.most_common()})
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the tiny model (a CPU: no GPU kernels in the trace)")
  parser.add_argument("--config", choices=sorted(ts.CONFIGS), default="v3")
  parser.add_argument("--devices", type=int, default=1, help="one device count")
  parser.add_argument("--fp8-gemm", action="store_true")
  parser.add_argument("--ep-capacity-factor", type=float, default=None)
  parser.add_argument("--ep-combine-dtype", choices=ts.EP_COMBINE_DTYPES, default="float32")
  parser.add_argument("--ep-exchange", choices=ts.EP_EXCHANGES, default="all_gather")
  parser.add_argument("--ep-exchange-chunks", type=int, default=1)
  parser.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--shard-replicated", action="store_true", help="N > 1: the replicated params stored split")
  parser.add_argument("--shard-optimizer", action="store_true",
                      help="N > 1: the replicated params' Adam state and update split (ZeRO-1/2-style)")
  parser.add_argument("--batch", type=int, default=None,
                      help="override the config's global batch (sequences of its length; v3: 4 x 2048 tokens)")
  parser.add_argument("--implementation", default="auto")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--sources", action="store_true")
  parser.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary folder)")
  parser.add_argument("--rows", type=pathlib.Path, default=None, help="append one profile row per GPU here")
  args = parser.parse_args(argv)
  config, batch_size, seq_len = ts.small_config() if args.small else ts.CONFIGS[args.config]()
  if args.fp8_gemm:
    config = dataclasses.replace(config, fp8_gemm=True)
  config = ts.with_moe_options(config, args.ep_capacity_factor, args.ep_combine_dtype, args.ep_exchange,
                               args.ep_exchange_chunks)
  n = args.devices
  if n > len(jax.devices()):
    print(f"--devices {n}: only {len(jax.devices())} devices here", file=sys.stderr)
    return 2
  batch_size = -(-(args.batch or batch_size) // n) * n
  params = block.init_block_params(jax.random.key(0), config)
  batch = block.synthetic_batch(np.random.default_rng(0), batch=batch_size, seq_len=seq_len,
                                vocab_size=config.vocab_size)
  optimizer = optax.adamw(1e-3)
  reduce_dtype = None if args.grad_reduce_dtype == "float32" else jnp.dtype(args.grad_reduce_dtype)
  step, place = ts._mesh_step(n, config, optimizer, args.implementation, reduce_dtype, args.shard_replicated,
                              args.shard_optimizer)
  p, b = place(params), place(batch)
  state = ts.init_state(optimizer, p, n, args.shard_optimizer)

  def chained(count, p, state):
    for _ in range(count):
      out = step(p, state, b)
      p, state = out.params, out.opt_state
    jax.block_until_ready(out.loss)
    return p, state

  p, state = chained(2, p, state)
  t0 = time.perf_counter()
  p, state = chained(args.steps, p, state)
  pipelined = 1e3 * (time.perf_counter() - t0) / args.steps
  sources = None
  if args.sources:
    sources = hlo_sources(jax.jit(step).lower(p, state, b).compile().as_text())
  trace_dir = args.trace_dir or tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  p, state = chained(args.steps, p, state)
  jax.profiler.stop_trace()
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  device = jax.devices()[0].device_kind
  label = ts.step_label(config, batch.tokens.size, args.fp8_gemm, args.ep_capacity_factor, args.grad_reduce_dtype,
                        args.shard_replicated, args.shard_optimizer)
  print(f"{device}, {n} device(s), {label}: pipelined {pipelined:.2f} ms/step (untraced); trace {files[-1:]}")
  if not files:
    return 1
  with gzip.open(files[-1]) as f:
    per_gpu = gpu_kernels(json.load(f), sources)
  stamp = datetime.datetime.now(datetime.timezone.utc)
  rows = []
  for index, name in enumerate(sorted(per_gpu)):
    s = summarize_gpu(per_gpu[name], args.steps)
    print(f"  {name}: busy {s['busy']:.2f}, kernel sum {s['kernel_sum']:.2f}, span {s['span']:.2f} ms/step; "
          + ", ".join(f"{k} {s[k]:.2f}" for k in ("mosaic", "gemm", "xla", "nccl")))
    for top_label, ms in list(s["top"].items())[:args.top]:
      print(f"    {ms:8.3f} ms  {top_label[:200]}")
    if sources:
      groups = collections.Counter()
      for top_label, ms in s["top"].items():
        groups[source_group(top_label)] += ms
      print("    by source (kind, phase, op):")
      for group, ms in groups.most_common(args.top):
        print(f"    {ms:8.3f} ms  {group}")
    rows.append(dict(component="profile", bench="train_step_profile", devices=n, gpu_index=index,
                     **{k: round(v, 4) for k, v in s.items() if k != "top"}, pipelined=round(pipelined, 4),
                     shape=label, gpu=device.replace(" ", "-"), date=stamp.date().isoformat(),
                     time=stamp.strftime("%H:%M:%S"), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                     note=f"python -m benchmarks.profile_step: {args.steps} chained steps traced"))
  if args.rows and rows:
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    with args.rows.open("a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
