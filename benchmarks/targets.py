"""TileKernels' per-shape targets, one file per card (``benchmarks/anchors/``, provenance in
``benchmarks/anchors/README.md``), keyed by card and the runner's own ``(op, shape label)``.

* ``tilekernels_targets.jsonl`` (NVIDIA H100 80GB HBM3, 2026-11-25): each row names an upstream op
  (``per_block_cast``) and a shape as ``key=value`` fields (``M=4001 K=576 in=bf16 fmt=e4m3
  block=32x32``); :func:`runner_key` turns that into the registered benchmark op and case label that
  measure the same call (``per_block_cast_32x32``, ``M=4001 K=576 bf16``).
* ``tilekernels_targets_h200.jsonl`` (NVIDIA H200, 2026-11-28): rows already name the runner's op and
  case label.

A row's ``target_speedup_over_xla`` is TileKernels' speed-up over the XLA-compiled reference on the
row's card; a kernel's measured speed-up over XLA divided by it, ``vs_tilekernels``, is above 1 where
the kernel is faster than TileKernels (within ~3% of 1: a tie). The ratio is only compared with the
target of the card the kernel ran on (:func:`vs_tilekernels`).
No jaxkern or JAX import: the summary uses it without building benchmark cases.
"""

from __future__ import annotations

import functools
import json
import pathlib

ANCHORS = pathlib.Path(__file__).parent / "anchors"
TARGETS_FILE = ANCHORS / "tilekernels_targets.jsonl"  # H100, upstream op and shape fields
H200_TARGETS_FILE = ANCHORS / "tilekernels_targets_h200.jsonl"  # H200, the runner's op names and case labels
TIE = 0.03  # |vs_tilekernels - 1| below this counts as a tie (anchors/README.md)

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _moe(f):
  return f"E={f['E']}x{f['R']} K={f['K']} T={f['T']}"


def _reduce_fused(f):
  name = _DTYPE_NAMES[f["in"]]
  if f["out"] not in (f["in"], "e4m3"):
    raise ValueError(f"reduce_fused: no registered case writes {f['out']} from {f['in']}")
  out = "e4m3" if f["out"] == "e4m3" else "same"
  op = f"reduce_fused:{out}{':x_sf' if f['x_sf'] == 'True' else ''}"
  return op, f"{_moe(f)} H={f['H']} {name}->{'e4m3' if out == 'e4m3' else name}"


def _per_token_cast(f):
  width = "row" if f["npc"] in ("row", f["K"]) else f"npc{f['npc']}"
  return f"per_token_cast_{'e2m1_' if f['fmt'] == 'e2m1' else ''}{width}", f"M={f['M']} K={f['K']} {f['in']}"


def _per_channel_cast(f):
  if f["npt"] != "128" or f["round"] != "False":
    raise ValueError("per_channel_cast: the registered cases have npt=128 and round=False only")
  return "per_channel_cast", f"M={f['M']} K={f['K']} {f['in']}"


# upstream op -> (its anchors fields, in order; (fields) -> (benchmark op, case label))
_MAPS = {
    "topk_gate": ("T E K", lambda f: ("topk_gate", f"T={f['T']} E={f['E']} K={f['K']}")),
    "top2_sum_gate": ("T E G NTG S K func", lambda f: (
        "top2_sum_gate", f"T={f['T']} E={f['E']} G={f['G']}/{f['NTG']} S={f['S']} K={f['K']} {f['func']}")),
    "transpose": ("M N dtype", lambda f: ("transpose", f"M={f['M']} N={f['N']} {f['dtype']}")),
    "batched_transpose": ("B M N dtype", lambda f: (
        "batched_transpose", f"B={f['B']} M={f['M']} N={f['N']} {f['dtype']}")),
    "expand_to_fused": ("E R K T H dtype", lambda f: ("expand_to_fused", f"{_moe(f)} H={f['H']} {f['dtype']}")),
    "reduce_fused": ("E R K T H in out x_sf", _reduce_fused),
    "normalize_weight": ("E R K T", lambda f: ("normalize_weight", _moe(f))),
    "per_token_cast": ("M K in fmt npc", _per_token_cast),
    "per_block_cast": ("M K in fmt block", lambda f: (
        f"per_block_cast_{'e2m1_' if f['fmt'] == 'e2m1' else ''}{f['block']}", f"M={f['M']} K={f['K']} {f['in']}")),
    "cast_back": ("M K out block round", lambda f: (
        f"cast_back_{f['block']}_{f['out']}",
        f"M={f['M']} K={f['K']} {f['out']}{' round' if f['round'] == 'True' else ''}")),
    "per_channel_cast": ("M K in npt round", _per_channel_cast),
}


def runner_key(op: str, shape: str) -> tuple[str, str]:
  """``(benchmark op, case label)`` of an anchors row's upstream ``op`` and ``shape`` fields;
  ValueError for an op or a field set this module does not know."""
  if op not in _MAPS:
    raise ValueError(f"no benchmark mapping for upstream op {op!r}")
  names, to_key = _MAPS[op]
  try:
    fields = dict(item.split("=", 1) for item in shape.split())
  except ValueError:
    raise ValueError(f"{op}: shape {shape!r} is not key=value fields") from None
  if list(fields) != names.split():
    raise ValueError(f"{op}: shape fields {list(fields)} are not the expected {names.split()}")
  return to_key(fields)


@functools.cache
def load(path: pathlib.Path = TARGETS_FILE, *, runner_keys: bool = False) -> tuple[dict, tuple]:
  """``({(benchmark op, label): anchors row}, unmapped rows as (row, reason))``; empty if the file is absent.
  ``runner_keys``: the rows' ``op`` and ``shape`` are the benchmark op and case label themselves."""
  targets, unmapped = {}, []
  if not path.exists():
    return targets, ()
  for line in path.read_text().splitlines():
    if not line.strip():
      continue
    row = json.loads(line)
    try:
      key = (row["op"], row["shape"]) if runner_keys else runner_key(row["op"], row["shape"])
    except (ValueError, KeyError) as e:
      unmapped.append((row, str(e)))
      continue
    if key in targets:
      unmapped.append((row, f"a second target for {key}"))
      continue
    targets[key] = row
  return targets, tuple(unmapped)


@functools.cache
def by_card() -> tuple[dict, tuple]:
  """``({card name: {(benchmark op, label): anchors row}}, unmapped rows of every file)``: both files, each
  row under its own ``device``."""
  cards, unmapped = {}, []
  for found, bad in (load(TARGETS_FILE), load(H200_TARGETS_FILE, runner_keys=True)):
    unmapped += bad
    for key, row in found.items():
      cards.setdefault(row["device"], {})[key] = row
  return cards, tuple(unmapped)


def target(op: str, label: str, gpu: str) -> dict | None:
  """The anchors row of a benchmark op's case measured on card ``gpu``, or None."""
  return by_card()[0].get(gpu, {}).get((op, label))


def has_target(op: str, label: str, gpu: str | None = None) -> bool:
  """Whether the case has a target on card ``gpu``, or, where that card has no targets at all (or ``gpu`` is
  None), on any card."""
  cards = by_card()[0]
  return any((op, label) in cards[c] for c in ([gpu] if gpu in cards else cards))


def target_ops() -> set[str]:
  """The benchmark ops with a target on some card."""
  return {op for found in by_card()[0].values() for op, _ in found}


def vs_tilekernels(speedup: float | None, anchor: dict | None, gpu: str) -> float | None:
  """Measured speed-up over XLA / TileKernels' (> 1: faster than TileKernels); None without a target
  or on another card than the one the target was measured on."""
  if speedup is None or anchor is None or gpu != anchor["device"]:
    return None
  return round(speedup / anchor["target_speedup_over_xla"], 3)


def fields(op: str, label: str, speedup: float | None, gpu: str) -> dict:
  """The row fields ``tilekernels_target_speedup`` and ``vs_tilekernels`` of a case measured on ``gpu``."""
  anchor = target(op, label, gpu)
  return dict(tilekernels_target_speedup=anchor and anchor["target_speedup_over_xla"],
              vs_tilekernels=vs_tilekernels(speedup, anchor, gpu))
