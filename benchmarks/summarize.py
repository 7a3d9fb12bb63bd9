"""Writes ``benchmarks/RESULTS.md`` from the JSONL files in ``benchmarks/results/``.

``python -m benchmarks.summarize [FILES...]``: the newest row of each shape wins, by its ``time``
(UTC, written by the runner; rows measured before that field existed carry the time of the commit
that added them) and then by file order. RESULTS.md opens with one table: per op (its benchmark
variants — dtypes, block sizes, layouts — together, forward and backward apart) and card, over the
newest row of each shape: the shape count, median GB/s and % of copy, the speed-ups over XLA (min /
median / max) and, on the cards TileKernels' targets were measured on (H100, H200), against TileKernels
(median, min, shapes behind by more than 3%). ``vs_tilekernels`` is taken from the row or, for rows
measured before the runner wrote it for their card, computed from the row's speed-up and the target of
its card in ``benchmarks/anchors/``. Per-shape
tables per (benchmark op, card) follow. The narrative of experiments is ``benchmarks/NOTES.md``.
Builds no benchmark case (no op module is imported).
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys

from benchmarks import targets

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
OUT = HERE / "RESULTS.md"

# The ceiling reported beside each FP8 grouped GEMM row: XLA's dense FP8 dot_general (cuBLASLt) of the
# same FLOPs, TF/s at the benchmark shapes A / B / C / D (H100, warm L2; benchmarks/NOTES.md, "FP8 grouped GEMM").
DENSE_FP8_TFLOPS = {"A": 1587, "B": 1552, "C": 1576, "D": 1535}

# variant suffixes of benchmark op names: (group width / block / layout / dtype) variants of one public op
_VARIANT = re.compile(r"_(npc\d+|row|npt\d+|\d+x\d+|e2m1|packed|bf16|fp32|quant_input)$")


def family(op: str) -> str:
  """The public op a benchmark op measures, its variants folded: ``per_token_cast_e2m1_npc32`` and
  ``per_token_cast_quant_input`` -> ``per_token_cast``, ``reduce_fused:e4m3:x_sf`` -> ``reduce_fused``;
  backward and composite benchmarks (``_bwd``, ``.bwd``, ``:fwd+bwd``) stay apart."""
  if op.endswith(":fwd+bwd"):
    return op
  op = op.split(":")[0]
  while (shorter := _VARIANT.sub("", op)) != op:
    op = shorter
  return op


def card(gpu: str) -> str:
  """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
  return gpu.removeprefix("NVIDIA ").split()[0]


def vs_tilekernels(row: dict) -> float | None:
  if row.get("vs_tilekernels") is not None:
    return row["vs_tilekernels"]
  return targets.vs_tilekernels(row.get("speedup"), targets.target(row["op"], row["shape"], row["gpu"]), row["gpu"])


def _load(paths) -> list[dict]:
  found = [json.loads(line) for path in sorted(paths)
           for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
  return sorted(found, key=lambda r: (r["date"], r.get("time", "")))  # stable: file order breaks ties


def _newest(rows, key) -> dict:
  newest = {}
  for r in rows:
    newest[key(r)] = r
  return newest


def _median(xs):
  return statistics.median(xs) if xs else None


def summary_table(measured: list[dict]) -> list[str]:
  """One line per (op family, card) over that card's newest row of each (benchmark op, shape); a card
  gets a line where it ran the newest row of at least one of the family's shapes."""
  shown = {(family(r["op"]), card(r["gpu"])) for r in _newest(measured, lambda r: (r["op"], r["shape"])).values()}
  groups = {}
  for r in _newest(measured, lambda r: (r["op"], r["shape"], r["gpu"])).values():
    if (key := (family(r["op"]), card(r["gpu"]))) in shown:
      groups.setdefault(key, []).append(r)
  lines = ["| op | card | shapes | GB/s | % copy | × XLA min / median / max | vs TileKernels median / min | "
           "behind TileKernels > 3% |", "|---|---|---:|---:|---:|---|---|---|"]
  for (op, gpu), rs in sorted(groups.items()):
    speedups = [r["speedup"] for r in rs]
    vs = [v for r in rs if (v := vs_tilekernels(r)) is not None]
    wrong = sum(not r["correct"] for r in rs)
    shapes = f"{len(rs)}" + (f" ({wrong} wrong)" if wrong else "")
    tk = ("—", "—")
    if vs:
      tk = (f"{_median(vs):.2f} / {min(vs):.2f}", f"{sum(v < 1 - targets.TIE for v in vs)} of {len(vs)}")
    lines.append(f"| {op} | {gpu} | {shapes} | {_median([r['gbps'] for r in rs]):.0f} | "
                 f"{_median([r['pct_copy'] for r in rs]):.0f} | {min(speedups):.2f} / {_median(speedups):.2f} / "
                 f"{max(speedups):.2f} | {tk[0]} | {tk[1]} |")
  return lines


def summarize(paths) -> str:
  rows = _load(paths)
  measured = [r for r in rows if "skipped" not in r]
  gpus = sorted({r["gpu"] for r in measured})
  anchor_gpus = sorted(targets.by_card()[0])
  lines = ["# Benchmark results", "",
           "Per op (its benchmark variants together) and card, the newest row of each shape; GB/s and % of",
           "copy: medians over shapes; × XLA: speed-up over the XLA-compiled `jnp` reference; vs TileKernels:",
           "that speed-up / TileKernels' on the same shape ([anchors](anchors/README.md); > 1: faster, within",
           f"3%: a tie), on {', '.join(card(g) for g in anchor_gpus) or 'no'} rows only, against the targets "
           "measured on the row's card. Cards: " + "; ".join(f"{card(g)} = {g}" for g in gpus) + ".",
           "Method and per-shape tables below; experiments and their narrative in [NOTES.md](NOTES.md); the",
           "training step (step time, multi-GPU scaling, time split) in the last section.", ""]
  lines += summary_table(measured)
  lines += ["", "## Method", "",
            "Device time measured with CUPTI (`jax.experimental.mosaic.gpu.profiler`), cold L2 (a 256 MiB",
            "flush before every call), median of the stated iterations. GB/s counts each input read and",
            "each output written once; % copy is against the device-to-device copy bandwidth measured in",
            "the same run; speed-up is over the XLA-compiled `jnp` reference; vs TK is the speed-up over",
            "TileKernels' speed-up on the same shape and card. Generated by `python -m benchmarks.summarize`",
            "from `benchmarks/results/*.jsonl`. Path: what the op call ran (`pallas` kernel or `xla` path,",
            "recorded from 2026-11-25's API rework on; — in older rows). Below, per benchmark op and card,",
            "the newest row of each shape measured on that card.", ""]
  newest = _newest(rows, lambda r: (r["op"], r["shape"], r["gpu"]))
  by_op = {}
  for r in _newest(measured, lambda r: (r["op"], r["shape"], r["gpu"])).values():
    by_op.setdefault((r["op"], r["gpu"]), []).append(r)
  for (op, gpu), rs in sorted(by_op.items()):
    dates = sorted({r["date"] for r in rs})
    vs = [vs_tilekernels(r) for r in rs]
    with_tk = any(targets.target(op, r["shape"], gpu) for r in rs)
    lines += [f"## {op} — {gpu}, {', '.join(dates)}, jax {rs[0]['jax']}, copy {rs[0]['copy_gbps']:.0f} GB/s", "",
              f"Median over shapes: {statistics.median(r['gbps'] for r in rs):.0f} GB/s, "
              f"speed-up over XLA {statistics.median(r['speedup'] for r in rs):.2f}× "
              f"(min {min(r['speedup'] for r in rs):.2f}×); all correct: {all(r['correct'] for r in rs)}; "
              f"{len(rs)} shapes measured.", ""]
    skipped = [r for (o, _, g), r in newest.items() if o == op and g == gpu and "skipped" in r]
    for r in skipped:
      lines += [f"Skipped in its newest run: {r['shape']} ({r['skipped']}).", ""]
    head = "| shape | path | µs | GB/s | % copy | XLA µs | speed-up |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    gemm = all("tflops" in r for r in rs)
    if gemm:
      lines += ["TF/s = 2·M·N·K / time; dense FP8 ceiling: XLA's cuBLASLt FP8 `dot_general` of the same FLOPs at the "
                "shape's letter (H100, warm L2; NOTES.md, \"FP8 grouped GEMM\").", ""]
      head, rule = head + " TF/s | XLA TF/s | dense FP8 ceiling |", rule + "---:|---:|---:|"
    if with_tk:
      head, rule = head + " TK target | vs TK |", rule + "---:|---:|"
    lines += [head, rule]
    for r, v in zip(rs, vs):
      line = (f"| {r['shape']} | {r.get('path', '—')} | {r['device_us']:.2f} | {r['gbps']:.0f} | "
              f"{r['pct_copy']:.1f} | {r['xla_us']:.2f} | {r['speedup']:.2f} |")
      if gemm:
        ceiling = DENSE_FP8_TFLOPS.get(r["shape"].split()[0])
        line += f" {r['tflops']:.0f} | {r['xla_tflops']:.0f} | {ceiling or '—'} |"
      if with_tk:
        anchor = targets.target(op, r["shape"], gpu)
        line += f" {anchor['target_speedup_over_xla']:.2f} |" if anchor else " — |"
        line += f" {v:.2f} |" if v else " — |"
      lines.append(line)
    lines.append("")
  return "\n".join(lines)


def deepgemm_tables(paths) -> list[str]:
  """Markdown for ``benchmarks/results/variants/*_gemm-vs-deepgemm-same-run*.jsonl``: the FP8 grouped GEMM forward
  and DeepGEMM's, timed in alternating processes of one call on the same inputs; per shape the TF/s of each round
  by the runner's timer (CUPTI, 256 MiB flush before each call) and the ratio of the medians. A row's ``run`` (where
  given) names what changed in our kernel since the day's earlier runs; it follows the date."""
  rows = [json.loads(line) for p in paths for line in pathlib.Path(p).read_text().splitlines() if line.strip()]
  if not rows:
    return []
  lines = ["## fp8_grouped_gemm forward against DeepGEMM in the same run", "",
           "TF/s by CUPTI with a 256 MiB L2 flush before each call, one value per round; both read the same inputs "
           "(DeepGEMM's casts of `randn`), both outputs bit-identical (NOTES.md, \"DeepGEMM in the same run\").", "",
           "| card | date | shape | DeepGEMM | jaxkern | jaxkern / DeepGEMM |", "|---|---|---|---|---|---:|"]
  by_shape = {}
  for r in rows:
    when = f'{r["date"]}, {r["run"]}' if r.get("run") else r["date"]
    by_shape.setdefault((r["device"], when, r["shape"]), {}).setdefault(r["who"], []).append(r["flush256_tflops"])
  for (device, date, shape), who in sorted(by_shape.items()):
    dg, jk = who.get("deepgemm", []), who.get("jaxkern", [])
    ratio = f"{statistics.median(jk) / statistics.median(dg):.3f}" if dg and jk else "—"
    lines.append(f"| {device} | {date} | {shape} | {', '.join(f'{v:.1f}' for v in dg)} | "
                 f"{', '.join(f'{v:.1f}' for v in jk)} | {ratio} |")
  return lines + [""]


def train_step_tables(paths) -> list[str]:
  """Markdown for ``benchmarks/results/train_step/*.jsonl`` (``python -m benchmarks.train_step``): per card and
  model, the newest step rows by device count and implementation (wall-clock, tokens/s, strong-scaling
  efficiency), then the one-device time split (each component's forward + backward alone, wall and CUPTI, times
  the layers it runs in)."""
  rows = [json.loads(line) for p in paths for line in pathlib.Path(p).read_text().splitlines() if line.strip()]
  if not rows:
    return []
  profiles = [r for r in rows if r["component"] == "profile"]
  rows = [r for r in rows if r["component"] != "profile"]
  lines = ["## Training step (`python -m benchmarks.train_step`)", "",
           "Wall-clock median per step (each followed by `block_until_ready`), the same global batch for every",
           "device count; scaling efficiency = t(1) / (N·t(N)); pipelined: chained steps as a training loop runs",
           "them, blocked on once at the end (the host's dispatch overlaps the step before). The whole step's CUPTI",
           "time is left out: the rows' `device_ms` of the step written before a fix of 2026-11-27 timed a",
           "function returning only the loss, which XLA pruned to the forward (10.4 ms against the whole step's",
           "34.7 ms, the v3 step on an H200), and they are not re-measured. Split: each component's",
           "forward + backward jitted alone with the step's shapes, times the layers it runs in; `rest` = step -",
           "components (what XLA fuses or overlaps inside the step, embedding, loss, optimiser).", ""]
  newest = _newest(rows, lambda r: (r["gpu"], r["shape"], r["devices"], r["implementation"], r["component"]))
  models = sorted({(r["gpu"], r["shape"]) for r in newest.values()})
  for gpu, shape in models:
    rs = [r for r in newest.values() if r["gpu"] == gpu and r["shape"] == shape]
    steps = sorted((r for r in rs if r["component"] == "step"), key=lambda r: (r["implementation"], r["devices"]))
    lines += [f"### {shape} — {gpu}, {', '.join(sorted({r['date'] for r in rs}))}", ""]
    flags = sorted({r.get("xla_flags", "") for r in steps} - {""})
    if flags:
      lines += ["XLA_FLAGS: " + "; ".join(f"`{f}`" for f in flags), ""]
    lines += ["| implementation | GPUs | step ms | tokens/s | scaling efficiency | pipelined step ms | pipelined efficiency "
              "| loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in steps:
      eff, piped_eff = r.get("scaling_efficiency"), r.get("scaling_efficiency_pipelined")
      piped = f"{r['pipelined_ms']:.2f}" if "pipelined_ms" in r else "—"
      lines.append(f"| {r['implementation']} | {r['devices'] or 1} | {r['wall_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                   f"{f'{100 * eff:.1f}%' if eff else '—'} | {piped} | "
                   f"{f'{100 * piped_eff:.1f}%' if piped_eff else '—'} | {r['loss']:.4f} |")
    parts = [r for r in rs if r["component"] != "step" and r["devices"] in (0, 1)]
    if parts:
      impls = sorted({r["implementation"] for r in parts})
      step = {r["implementation"]: r["wall_ms"] for r in steps if r["devices"] in (0, 1)}
      lines += ["", "| component (1 GPU, ms per step) | " + " | ".join(f"{i} wall | {i} CUPTI" for i in impls) + " |",
                "|---" + "|---:" * 2 * len(impls) + "|"]
      names = list(dict.fromkeys(r["component"] for r in parts))
      for name in names:
        cells = []
        for i in impls:
          r = next((r for r in parts if r["component"] == name and r["implementation"] == i), None)
          cells += [f"{r['wall_ms'] * r['times']:.2f}", f"{r['device_ms'] * r['times']:.2f}" if r and "device_ms" in r
                    else "—"] if r else ["—", "—"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
      rest = [f"{step[i] - sum(r['wall_ms'] * r['times'] for r in parts if r['implementation'] == i):.2f}"
              if i in step else "—" for i in impls]
      lines.append("| rest (wall) | " + " | ".join(f"{v} | —" for v in rest) + " |")
    lines.append("")
  return lines + scaling_tables(list(newest.values())) + profile_tables(profiles)


def _one_gpu_label(shape: str, devices: int, weak: bool) -> str:
  """The 1-GPU step's label that a ``devices``-GPU step's ``shape`` is compared with: no exchange options (one GPU
  exchanges nothing); for weak scaling ``T`` divided by the GPU count."""
  label = re.sub(r" ep_(exchange|chunks)=\S+", "", shape)
  if weak:
    label = re.sub(r"T=(\d+)", lambda m: f"T={int(m.group(1)) // devices}", label)
  return label


def scaling_tables(rows) -> list[str]:
  """Markdown: the expert-parallel steps' weak scaling (t(1 GPU, T/P) / t(P GPUs, T), the same tokens per GPU) and
  strong scaling (t(1, T) / (P t(P, T))) against the newest 1-GPU step of the matching label on the same card, and
  the all-to-all exchange's bandwidth per GPU (``dispatch`` / ``combine`` / ``a2a_peak`` rows: bytes one GPU sends
  to the others per second, as DeepEP reports it)."""
  steps = [r for r in rows if r["component"] == "step" and r["implementation"] == "auto"]
  one = {(r["gpu"], r["shape"]): r for r in steps if r["devices"] in (0, 1)}
  lines = []
  multi = sorted((r for r in steps if r["devices"] > 1 and "pipelined_ms" in r), key=lambda r: (r["gpu"], r["devices"], r["shape"]))
  table = []
  for r in multi:
    weak, strong = (one.get((r["gpu"], _one_gpu_label(r["shape"], r["devices"], w))) for w in (True, False))
    weak, strong = (b if b and b["date"] == r["date"] else None for b in (weak, strong))
    if not (weak or strong):
      continue
    cell = lambda base, key, n: f"{100 * base[key] / (n * r[key]):.1f}%" if base and key in base and key in r else "—"
    table.append(f"| {r['gpu']} | {r['devices']} | {r['shape']} | {r['date']} | {r['wall_ms']:.2f} | "
                 f"{r['pipelined_ms']:.2f} | {cell(weak, 'wall_ms', 1)} | "
                 f"{cell(weak, 'pipelined_ms', 1)} | {cell(strong, 'wall_ms', r['devices'])} | "
                 f"{cell(strong, 'pipelined_ms', r['devices'])} |")
  if table:
    lines += ["## Expert-parallel scaling (`python -m benchmarks.train_step`)", "",
              "Weak: t(1 GPU, T/P) / t(P GPUs, T), the same tokens per GPU; strong: t(1, T) / (P·t(P, T)); each",
              "against the newest 1-GPU step of the same model on the same card and day (wall / pipelined ms per step).", "",
              "| card | GPUs | step (T: all tokens) | date | step ms | pipelined ms | weak | weak, pipelined | strong "
              "| strong, pipelined |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|", *table, ""]
  bandwidth = sorted((r for r in rows if r.get("gb_per_s") is not None), key=lambda r: (r["gpu"], r["shape"]))
  if bandwidth:
    lines += ["### The exchange's bandwidth per GPU", "",
              "| card | GPUs | step | date | part | ms per call | MB sent per GPU | GB/s |",
              "|---|---:|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['gpu']} | {r['devices']} | {r['shape']} | {r['date']} | {r['component']} | {r['wall_ms']:.3f} | "
              f"{r['bytes_sent'] / 1e6:.1f} | {r['gb_per_s']:.1f} |" for r in bandwidth]
    lines.append("")
  return lines


def profile_tables(rows) -> list[str]:
  """Markdown for the ``component == "profile"`` rows: the step's kernel time per GPU by kind, from a profiler trace
  of chained steps (ms per step; kernels on several streams overlap, so busy <= kernel sum)."""
  lines = []
  for gpu, shape, date in sorted({(r["gpu"], r["shape"], r["date"]) for r in rows}):
    rs = sorted((r for r in rows if (r["gpu"], r["shape"], r["date"]) == (gpu, shape, date)),
                key=lambda r: (r["devices"], r["gpu_index"]))
    notes = list(dict.fromkeys(r.get("note", "") for r in rs))  # one per run: a row's "run" is its note's number
    lines += [f"### Where the step's time goes: {shape} — {gpu}, {date}", ""]
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)] + [""]
    lines += ["| run | GPUs | GPU | jaxkern kernels (Mosaic GPU: routing, casts, expand / reduce, SwiGLU, FP8 GEMMs, "
              "mHC, Engram) | XLA GEMMs (float32 readout on cuBLAS TF32, Triton) | other XLA fusions (Adam, casts, "
              "elementwise) | NCCL | kernel sum | busy | span | pipelined step (untraced) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
      lines.append(f"| {notes.index(r.get('note', '')) + 1} | {r['devices']} | {r['gpu_index']} | {r['mosaic']:.2f} | "
                   f"{r['gemm']:.2f} | {r['xla']:.2f} | {r['nccl']:.2f} | {r['kernel_sum']:.2f} | {r['busy']:.2f} | "
                   f"{r['span']:.2f} | {r['pipelined']:.2f} |")
    lines.append("")
  return lines


def main(argv=None) -> int:
  paths = (argv if argv is not None else sys.argv[1:]) or sorted(RESULTS.glob("*.jsonl"))
  text = summarize(paths)
  if argv is None or not argv:  # the default files: also the training-step rows
    text += "\n" + "\n".join(deepgemm_tables(sorted((RESULTS / "variants").glob("*_gemm-vs-deepgemm-same-run*.jsonl"))))
    text += "\n" + "\n".join(train_step_tables(sorted((RESULTS / "train_step").glob("*.jsonl"))))
  OUT.write_text(text)
  print(f"wrote {OUT}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
