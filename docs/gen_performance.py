"""MkDocs hook: the performance pages, generated at build time from ``benchmarks/results/*.jsonl``.

For every op family (its benchmark variants together, forward and backward apart:
:func:`benchmarks.summarize.family`) the newest H200 row of each shape gives a plot of the speed-up over
the XLA-compiled reference and, where TileKernels' H200 target for the shape exists
(:mod:`benchmarks.targets`), TileKernels' own speed-up over XLA on that shape; a table lists the rows.
Pages: ``performance/index.md`` (one line per family) and ``performance/<area>.md`` (one section and
one PNG per family of the area). Nothing is written into ``docs/``: the pages and images are added to
the build as generated files.

Run as a script to write the pages into a folder for a look: ``python docs/gen_performance.py OUT_DIR``.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import summarize, targets  # noqa: E402  (after the path set-up)

CARD = "NVIDIA H200"
AREAS = ("transpose", "moe", "quant", "engram", "mhc", "gemm", "modeling")
AREA_TITLES = {"transpose": "Transpose", "moe": "MoE routing", "quant": "Quantisation", "engram": "Engram",
               "mhc": "mHC", "gemm": "FP8 grouped GEMM", "modeling": "Layers"}
MAX_TICK_LABELS = 40  # above this many shapes a plot's x axis shows positions, not shape labels


def public_names(area: str) -> set[str]:
  """The ``__all__`` of ``jaxkern.<area>``, read from the source (no jax import)."""
  tree = ast.parse((ROOT / "jaxkern" / area / "__init__.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
      return set(ast.literal_eval(node.value))
  return set()


def area_of(family: str, names: dict[str, set[str]]) -> str:
  """The jaxkern area whose public op a family measures (``expand_to_fused.bwd`` -> ``moe``,
  ``engram_gate:fwd+bwd`` -> ``engram``); composites of several areas' ops go to ``modeling``."""
  name = re.split(r"[.:]|->", family)[0]
  for area in AREAS:
    if name in names[area] or any(n.startswith(name + "_") for n in names[area]):
      return area
  prefix = name.split("_")[0]
  return prefix if prefix in AREAS else "modeling"


def newest_rows(card: str = CARD) -> dict[str, list[dict]]:
  """``{family: [the newest row of each (benchmark op, shape) measured on card]}``, in file order."""
  rows = summarize._load(sorted(summarize.RESULTS.glob("*.jsonl")))
  measured = [r for r in rows if "skipped" not in r and r["gpu"] == card]
  families: dict[str, list[dict]] = {}
  for r in summarize._newest(measured, lambda r: (r["op"], r["shape"])).values():
    families.setdefault(summarize.family(r["op"]), []).append(r)
  return families


def families_without(card: str = CARD) -> list[str]:
  """Families measured on some card but never on ``card``."""
  rows = summarize._load(sorted(summarize.RESULTS.glob("*.jsonl")))
  measured = [r for r in rows if "skipped" not in r]
  on_card = {summarize.family(r["op"]) for r in measured if r["gpu"] == card}
  return sorted({summarize.family(r["op"]) for r in measured} - on_card)


def target_speedup(row: dict) -> float | None:
  anchor = targets.target(row["op"], row["shape"], row["gpu"])
  return anchor["target_speedup_over_xla"] if anchor else None


def _fmt(v, digits=2) -> str:
  return "—" if v is None else f"{v:.{digits}f}"


def plot(family: str, rows: list[dict]) -> bytes:
  """PNG: per shape the speed-up over XLA (bars) and TileKernels' target speed-up (markers)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n = len(rows)
  xs = range(n)
  fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.28 * n + 2.0)), 3.6), dpi=100)
  ax.bar(xs, [r["speedup"] for r in rows], width=0.8, color="#3f7fbf", label="jaxkern / XLA")
  tk = [(i, t) for i, r in enumerate(rows) if (t := target_speedup(r)) is not None]
  if tk:
    ax.scatter([i for i, _ in tk], [t for _, t in tk], marker="_", s=160, linewidths=2.5, color="#d9534f",
               zorder=3, label="TileKernels / XLA (target)")
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_ylabel("speed-up over XLA")
  ax.set_title(f"{family}: {n} shapes, newest H200 rows")
  if n <= MAX_TICK_LABELS:
    ax.set_xticks(list(xs))
    ax.set_xticklabels([_short_label(r) for r in rows], rotation=90, fontsize=6)
  else:
    ax.set_xlabel("shape (in the order of the table below)")
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  out = io.BytesIO()
  fig.savefig(out, format="png")
  plt.close(fig)
  return out.getvalue()


def _short_label(row: dict) -> str:
  variant = row["op"].removeprefix(summarize.family(row["op"])).strip("_:.")
  return f"{variant} {row['shape']}".strip()


def family_summary(rows: list[dict]) -> dict:
  speedups = [r["speedup"] for r in rows]
  vs = [v for r in rows if (v := summarize.vs_tilekernels(r)) is not None]
  return dict(shapes=len(rows), xla_min=min(speedups), xla_median=statistics.median(speedups),
              xla_max=max(speedups), vs_median=statistics.median(vs) if vs else None,
              vs_min=min(vs) if vs else None, vs_max=max(vs) if vs else None, vs_count=len(vs),
              behind=sum(v < 1 - targets.TIE for v in vs), dates=sorted({r["date"] for r in rows}))


def family_section(family: str, rows: list[dict], image: str) -> list[str]:
  s = family_summary(rows)
  lines = [f"## `{family}`", "",
           f"{s['shapes']} shapes (measured {', '.join(s['dates'])}); speed-up over XLA "
           f"{s['xla_min']:.2f} / {s['xla_median']:.2f} / {s['xla_max']:.2f} (min / median / max)."]
  if s["vs_count"]:
    lines[-1] += (f" Against TileKernels on the {s['vs_count']} shapes with a target: median "
                  f"{s['vs_median']:.2f}×, min {s['vs_min']:.2f}×, max {s['vs_max']:.2f}× "
                  f"({s['behind']} behind by more than 3%).")
  else:
    lines[-1] += " No TileKernels target on this card for these shapes."
  lines += ["", f"![{family}]({image})", "", '??? note "Per-shape rows"', "",
            "    | benchmark op | shape | path | µs | GB/s | % copy | XLA µs | × XLA | TileKernels × XLA | vs TileKernels |",
            "    |---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"    | `{r['op']}` | {r['shape']} | {r.get('path', '—')} | {r['device_us']:.2f} | {r['gbps']:.0f} | "
                 f"{r['pct_copy']:.1f} | {r['xla_us']:.2f} | {r['speedup']:.2f} | {_fmt(target_speedup(r))} | "
                 f"{_fmt(summarize.vs_tilekernels(r))} |")
  return lines + [""]


INTRO = [
    "Generated at build time from `benchmarks/results/*.jsonl` by `docs/gen_performance.py`: for every",
    "shape, the newest row measured on an NVIDIA H200. Device time with CUPTI, cold L2 (a 256 MiB flush",
    "before every call), median of the run's iterations; the baseline is the op's `jnp` reference",
    "compiled by XLA in the same run. The red marks are TileKernels' speed-up over the same XLA",
    "reference on the same shape and card (`benchmarks/anchors/tilekernels_targets_h200.jsonl`): a bar",
    "above its mark means faster than TileKernels; within 3% counts as a tie. `python -m benchmarks.run`",
    "appends new rows; `python -m benchmarks.summarize` writes the full tables (every card) to",
    "`benchmarks/RESULTS.md`.",
]


def pages() -> dict[str, bytes | str]:
  """``{path under docs/: content}`` of every generated file."""
  names = {area: public_names(area) for area in AREAS}
  families = newest_rows()
  by_area: dict[str, list[str]] = {area: [] for area in AREAS}
  for family in sorted(families):
    by_area[area_of(family, names)].append(family)
  out: dict[str, bytes | str] = {}
  index = ["# Performance on an H200", "", *INTRO, "",
           "| area | op family | shapes | × XLA median (min–max) | vs TileKernels median (min–max) | behind > 3% |",
           "|---|---|---:|---|---|---|"]
  for area in AREAS:
    page = [f"# {AREA_TITLES[area]}: performance on an H200", "", *INTRO, ""]
    if not by_area[area]:
      page += ["No H200 rows for this area's ops yet: see `benchmarks/RESULTS.md` for other cards.", ""]
    for family in by_area[area]:
      rows = families[family]
      image = f"{area}/{re.sub(r'[^A-Za-z0-9_.+-]', '_', family)}.png"
      out[f"performance/{image}"] = plot(family, rows)
      page += family_section(family, rows, image)
      s = family_summary(rows)
      vs = f"{s['vs_median']:.2f} ({s['vs_min']:.2f}–{s['vs_max']:.2f})" if s["vs_count"] else "—"
      behind = f"{s['behind']} of {s['vs_count']}" if s["vs_count"] else "—"
      index.append(f"| [{AREA_TITLES[area]}]({area}.md) | `{family}` | {s['shapes']} | {s['xla_median']:.2f} "
                   f"({s['xla_min']:.2f}–{s['xla_max']:.2f}) | {vs} | {behind} |")
    out[f"performance/{area}.md"] = "\n".join(page) + "\n"
  missing = families_without()
  if missing:
    index += ["", "Measured on other cards only (see `benchmarks/RESULTS.md`): "
              + ", ".join(f"`{f}`" for f in missing) + "."]
  out["performance/index.md"] = "\n".join(index) + "\n"
  return out


def on_files(files, config):
  """MkDocs event: add the generated pages and images to the build."""
  from mkdocs.structure.files import File

  for path, content in pages().items():
    files.append(File.generated(config, path, content=content))
  return files


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print("usage: python docs/gen_performance.py OUT_DIR", file=sys.stderr)
    return 2
  out = pathlib.Path(argv[0])
  for path, content in pages().items():
    target = out / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
