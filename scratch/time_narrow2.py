"""Issue 21 part 1, round 2: times every variant of the shapes still behind TileKernels (H100).

  python scratch/time_narrow2.py [--iterations N] [--only REGEX] [--out FILE]   # GPU: CUPTI, cold L2
  python scratch/time_narrow2.py --tiny                                          # CPU: small shapes, interpret
                                                                                 # mode, bit-exactness only

For each (op, shape) it times the XLA reference once and each variant (the module overrides below, set
in-process: the runner can only time the defaults) with jaxkern.testing.timing (as benchmarks/run.py:
CUPTI, 256 MiB L2 flush before each call, median of N), checks each variant bitwise against the
reference, and prints: op, shape, variant, µs, GB/s, speed-up over XLA, TileKernels' target speed-up,
vs TK (> 1: faster than TileKernels). All executables are lowered first (serially: the overrides are
module globals read at trace time; jax.clear_caches() between variants) and compiled in threads.
``code`` is a short hash of the lowered text: two variants with the same hash ran the same code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import re
import sys
import time

import jax

sys.path.insert(0, ".")
from benchmarks import targets  # noqa: E402
from benchmarks.registry import REGISTRY  # noqa: E402
import benchmarks.run  # noqa: E402,F401  (registers the ops)
from jaxkern.quant import _per_block_cast as pbc  # noqa: E402
from jaxkern.quant import _per_channel_cast as pcc  # noqa: E402
from jaxkern.moe import _expand_to_fused as etf  # noqa: E402
from jaxkern.transpose import _transpose as tr  # noqa: E402


@contextlib.contextmanager
def overrides(*settings):
  """Sets ``(module, name, value)`` for the duration; restores the old values."""
  old = [(mod, name, getattr(mod, name)) for mod, name, _ in settings]
  try:
    for mod, name, value in settings:
      setattr(mod, name, value)
    yield
  finally:
    for mod, name, value in old:
      setattr(mod, name, value)


def _ring_for(nbytes_lo):
  return {**tr._RING_BYTES, 1: (nbytes_lo, None)}


# op -> (labels (regexes over the registered case labels), [(variant name, settings)])
# The default of bf16 32x32 is the wide kernel with 256 columns, of 128x128 the per-block kernel ("blocks").
PBC32 = [("default", ())] + [(f"wide{c}", ((pbc, "_VARIANT_OVERRIDE", ("wide", c)),)) for c in (128, 64)] + [
    (f"wide_direct{c}", ((pbc, "_VARIANT_OVERRIDE", ("wide_direct", c)),)) for c in (256, 128, 64)] + [
    ("blocks", ((pbc, "_VARIANT_OVERRIDE", "blocks"),))]
PBC128 = [("default", ()),
          ("split32", ((pbc, "_VARIANT_OVERRIDE", ("split", 32)),)),
          ("split64", ((pbc, "_VARIANT_OVERRIDE", ("split", 64)),)),
          ("split_direct32", ((pbc, "_VARIANT_OVERRIDE", ("split_direct", 32)),)),
          ("split_direct64", ((pbc, "_VARIANT_OVERRIDE", ("split_direct", 64)),)),
          ("wide128", ((pbc, "_VARIANT_OVERRIDE", ("wide", 128)),))]
ETF = [("default", ())] + [
    (f"slots{s}_rows{r}", ((etf, "_MAX_SLOTS", s), (etf, "_ROW_BLOCK", r)))
    for s, r in ((None, 128), (64, 32), (32, 32), (32, 128), (16, 128), (9, 128))]  # 9: one token per CTA (K = 8, 9)
PCC = [("default", ()), ("cols64", ((pcc, "_COLS", 64),))]  # cols64 = default where 128 does not divide K
TR = [("default", ()),
      ("tile64x64", ((tr, "_TILING_OVERRIDE", (64, 64, "bij")),)),
      ("tile64x64_bji", ((tr, "_TILING_OVERRIDE", (64, 64, "bji")),)),
      ("tile128x64_bji", ((tr, "_TILING_OVERRIDE", (128, 64, "bji")),)),
      ("ring", ((tr, "_RING_BYTES", _ring_for(0)),))]

PLAN = {
    "per_block_cast_32x32": (r"K=(576|2048) bf16$", PBC32),
    "per_block_cast_128x128": (r"K=(576|2048) bf16$", PBC128),  # 2560 / 3072 (0.91-0.94): --only
    # behind: E=4x64 K=8 / 9 and E=9x8 K=9 (E=32x8 K=8 / 9 were ahead)
    "expand_to_fused": (r"(E=4x64 K=(8|9)|E=9x8 K=9) .*H=576 bf16$", ETF),
    "per_channel_cast": (r"K=(576|2048) bf16$", PCC),
    "transpose": (r"N=576 e4m3$", TR),
}
# --tiny: small shapes (interpret mode on the CPU); None: the op's small cases
TINY = {
    "per_block_cast_32x32": [((33, 576), "bfloat16"), ((70, 320), "bfloat16")],
    "per_block_cast_128x128": [((130, 576), "bfloat16"), ((257, 384), "bfloat16")],
}


def _tiny_cases(name):
  from benchmarks.registry import Case
  import jax.numpy as jnp
  if name not in TINY:
    return list(REGISTRY[name].small_cases())
  out = []
  for (m, k), dt in TINY[name]:
    make = functools.partial(lambda key, m, k, dt: (jax.random.normal(key, (m, k), jnp.float32) * 3).astype(dt),
                             m=m, k=k, dt=dt)
    base = REGISTRY[name].small_cases()[0]
    out.append(Case(label=f"M={m} K={k} tiny", make_args=lambda key, make=make: (make(key),),
                    nbytes=m * k * 3, kwargs=base.kwargs))
  return out


def _valid(label, settings) -> bool:
  """A transpose tiling applies only where its tile height divides M; 64-column per-channel tiles are
  the default where 128 does not divide K."""
  for mod, name, value in settings or ():
    if name == "_COLS" and int(re.search(r"K=(\d+)", label)[1]) % 128:
      return False
    if name == "_TILING_OVERRIDE" and int(re.search(r"M=(\d+)", label)[1]) % value[0]:
      return False
  return True


def _avals(case, key):
  """Shapes of ``case.make_args(key)`` (as benchmarks/run.py: some generators need concrete values)."""
  try:
    return jax.eval_shape(case.make_args, key)
  except Exception:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), case.make_args(key))


def _code_hash(lowered) -> str:
  return hashlib.sha1(lowered.as_text().encode()).hexdigest()[:8]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--only", default=None, help="regex over 'op shape variant'")
  p.add_argument("--tiny", action="store_true", help="CPU: small shapes, interpret mode, no timing")
  p.add_argument("--jobs", type=int, default=12)
  p.add_argument("--out", default=None, help="JSONL rows")
  p.add_argument("--dry-lower", action="store_true",
                 help="CPU: lower every GPU-sized variant for an H100 (no timing): code hashes and lowering time")
  p.add_argument("--budget", type=float, default=270, help="seconds; later rows are left out once past it")
  a = p.parse_args(argv)
  on_gpu = (jax.default_backend() == "gpu" or a.dry_lower) and not a.tiny
  t_start = time.time()
  if a.dry_lower:
    import jaxkern
    from jaxkern.testing import lower_for_h100

    def lower_timed(f, *avals):
      with jaxkern.use_implementation("pallas"):
        return lower_for_h100(f, *avals)
  elif on_gpu:
    from jaxkern.testing.timing import device_time_us, flush_buffer, lower_timed
    gpu = jax.devices()[0].device_kind
    import jaxkern
    impl = contextlib.nullcontext
  else:
    import jaxkern
    gpu = "cpu"
    impl = lambda: jaxkern.use_implementation("interpret")  # noqa: E731

  todo = []  # (op, case, key, variant, settings)
  key = jax.random.key(0)
  for name, (labels, variants) in PLAN.items():
    op = REGISTRY[name]
    cases = [c for c in op.cases() if re.search(labels, c.label)] if on_gpu else _tiny_cases(name)
    for case in cases:
      key, sub = jax.random.split(key)
      for vname, settings in [("xla", None)] + variants:
        if not _valid(case.label, settings):
          continue
        if a.only and not re.search(a.only, f"{name} {case.label} {vname}") and vname != "xla":
          continue
        todo.append((op, case, sub, vname, settings))
  if a.only:  # drop XLA rows of cases with no variant left
    keep = {(op.name, case.label) for op, case, _, v, _ in todo if v != "xla"}
    todo = [t for t in todo if (t[0].name, t[1].label) in keep]

  # Lower serially (overrides are globals read at trace time), grouped by variant so that the caches are
  # cleared once per variant; compile in threads.
  lowered, hashes = [None] * len(todo), ["-"] * len(todo)
  if on_gpu:
    groups = {}
    for n, (op, case, sub, vname, settings) in enumerate(todo):
      groups.setdefault((op.name, vname), []).append(n)
    for members in groups.values():
      jax.clear_caches()
      for n in members:
        op, case, sub, vname, settings = todo[n]
        f = functools.partial(op.reference if settings is None else op.fn, **case.kwargs)
        with overrides(*(settings or ())):
          lowered[n] = lower_timed(f, *_avals(case, sub))
        hashes[n] = _code_hash(lowered[n])
  print(f"lowered {len(todo)} executables in {time.time() - t_start:.0f}s", flush=True)
  if a.dry_lower:
    for (op, case, _, vname, _), h in zip(todo, hashes):
      print(f"{op.name:24s} {case.label:30s} {vname:18s} {h}")
    same = {}
    for (op, case, _, vname, _), h in zip(todo, hashes):
      same.setdefault((op.name, case.label, h), []).append(vname)
    dup = {k: v for k, v in same.items() if len(v) > 1}
    print(f"variants with identical code: {dup or 'none'}")
    return 0
  if on_gpu:
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
      compiled = list(pool.map(lambda low: low.compile(), lowered))
    print(f"compiled in {time.time() - t_start:.0f}s", flush=True)
  else:
    compiled = [None] * len(todo)

  rows, xla_us, ref_out, args_of = [], {}, {}, {}
  hdr = f"{'op':24s} {'shape':30s} {'variant':16s} {'code':8s} {'us':>8s} {'GB/s':>7s} {'xXLA':>6s} {'TK':>6s} {'vsTK':>6s}"
  print(hdr)
  failures = 0
  for (op, case, sub, vname, settings), exe, h in zip(todo, compiled, hashes):
    if time.time() - t_start > a.budget:
      print(f"budget of {a.budget:.0f}s spent: the remaining rows are left out (use --only)")
      break
    ck = (op.name, case.label)
    if ck not in args_of:
      args_of = {ck: case.make_args(sub)}  # one case's inputs alive at a time
    args = args_of[ck]
    if settings is None:
      if on_gpu:
        ref_out[ck] = exe(flush_buffer(), *args)[1]
        xla_us[ck] = device_time_us(None, *args, iterations=a.iterations, compiled=exe)
      else:
        ref_out[ck] = jax.jit(functools.partial(op.reference, **case.kwargs))(*args)
      t = xla_us.get(ck)
    else:
      try:
        if on_gpu:
          out = exe(flush_buffer(), *args)[1]
        else:
          jax.clear_caches()
          with overrides(*settings), impl():
            out = jax.jit(functools.partial(op.fn, **case.kwargs))(*args)
        op.check(out, ref_out[ck])
        ok = "ok"
      except AssertionError as e:
        ok, failures = f"WRONG: {str(e)[:80]}", failures + 1
      t = device_time_us(None, *args, iterations=a.iterations, compiled=exe) if on_gpu else None
    anchor = targets.target(op.name, case.label)
    tgt = anchor and anchor["target_speedup_over_xla"]
    sp = xla_us.get(ck) / t if (t and xla_us.get(ck)) else None
    vs = targets.vs_tilekernels(sp, anchor, gpu) if sp else None
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    line = (f"{op.name:24s} {case.label:30s} {vname:16s} {h:8s} {fmt(t, '8.2f')} "
            f"{fmt(t and case.nbytes / t / 1e3, '7.0f')} {fmt(sp, '6.3f')} {fmt(tgt, '6.3f')} {fmt(vs, '6.3f')}")
    print(line + ("" if settings is None else f"  {ok}"), flush=True)
    rows.append(dict(op=op.name, shape=case.label, variant=vname, code=h, device_us=t and round(t, 3),
                     xla_us=xla_us.get(ck), speedup=sp and round(sp, 3), tilekernels_target_speedup=tgt,
                     vs_tilekernels=vs, gpu=gpu, correct=None if settings is None else ok == "ok"))
  if a.out:
    with open(a.out, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"done in {time.time() - t_start:.0f}s, {failures} variant(s) not bit-exact")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
