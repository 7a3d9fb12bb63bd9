"""Run-to-run determinism of the block's training step: ``python -m benchmarks.determinism [--config v3] ...``.

Builds the model of :mod:`benchmarks.train_step` (``--config``: its ``v3`` or ``gpu`` sizes, ``small`` for a CPU
with the references, or ``test``, the smallest model every kernel runs), compiles the jitted
:func:`jaxkern.modeling.block.train_step` (adamw, as the benchmark) once, and runs ``--steps`` steps (default 10)
twice with that one executable from the same seed: the same initial params (``jax.random.key(seed)``), optimiser
state and batches (one :func:`~jaxkern.modeling.block.synthetic_batch` per step from ``np.random.default_rng(seed)``).
After every step each leaf of the params and the optimiser state gets a fingerprint of its bits, on the device
(:func:`fingerprints`; NaN payloads and signed zeros count), and the two runs are compared bit for bit
(:func:`compare`): the loss of every step, the first step after which a leaf differs and which leaves differ there,
and for the leaves of at most ``--max-diff-mib`` (256) the number of differing elements and the largest difference
after step 1 and after the last step. After step 1 only the leaves whose gradient differed can differ (Adam is
elementwise); a loss that differs while the state before it did not points at the forward pass. Exit status 1 when
the runs differ.

``--compiler-option KEY=VALUE`` (repeatable) compiles with an XLA debug option, e.g. on a GPU
``xla_gpu_enable_scatter_determinism_expander=true`` (XLA rewrites scatters into a deterministic sort-based form) or
``xla_gpu_exclude_nondeterministic_ops=true`` (deterministic implementations of every op XLA knows to be
nondeterministic, and no autotuning by timing). The same options go in ``XLA_FLAGS`` as ``--KEY=VALUE`` or to
``jax.jit(..., compiler_options={KEY: VALUE})``.

``--scatters`` prints the scatter instructions left in the compiled program with the source line that made them: on a
GPU, XLA adds a float scatter's updates with atomics unless it is told otherwise, so rows that receive several updates
(an embedding row of a repeated token) sum them in a different order from run to run.

``--digest PATH`` writes the losses' bits and the per-step fingerprints as JSON; ``--compare A B`` compares two
digests, e.g. of two processes (whose compilations, autotuning included, are independent), and exits 1 when they
differ. ``--fresh-compile`` compiles the second run's executable again in the same process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkern.modeling import block

STEPS = 10
SNAPSHOT_MIB = 256  # leaves compared element by element (the v3 model's embedding, 235 MiB, is one; experts are not)
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def test_config() -> tuple[block.BlockConfig, int, int]:
  """The smallest model every kernel runs (``tests/modeling/test_block.py``'s): H 1024, one layer, vocabulary 32,
  16 tokens."""
  return block.BlockConfig(num_layers=1, vocab_size=32, engram_table_size=61, engram_embed_dim=8), 1, 16


def configs() -> dict:
  from benchmarks import train_step
  return {"test": test_config, "small": train_step.small_config, **train_step.CONFIGS}


def leaf_names(tree) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _bits(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as ``uint32`` (floats and ints of 1, 2 or 4 bytes, PRNG keys by their data)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


@jax.jit
def fingerprints(tree) -> jax.Array:
  """``(leaves, 2)`` uint32: two position-weighted sums (mod 2^32) of each leaf's bits. Integer sums, so the same in
  any summation order; any change of a single element changes the first (its weight ``2i + 1`` is odd, so
  invertible mod 2^32)."""
  out = []
  for x in jax.tree.leaves(tree):
    b = _bits(x).ravel()
    i = jnp.arange(b.size, dtype=jnp.uint32)
    mixed = (b ^ (b >> 16)) * jnp.uint32(0x9E3779B1)
    out.append(jnp.stack([jnp.sum(b * (2 * i + 1), dtype=jnp.uint32),
                          jnp.sum(mixed * ((i ^ (i >> 7)) | 1), dtype=jnp.uint32)]))
  return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


@jax.jit
def element_differences(a, b) -> jax.Array:
  """``(leaves, 2)`` float32 of two pytrees of the same structure: per leaf the number of elements whose bits
  differ and the largest ``|a - b|`` among them (inf where one of the two is not finite)."""
  out = []
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    ne = _bits(x) != _bits(y)
    diff = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    diff = jnp.where(jnp.isnan(diff), jnp.inf, diff)
    out.append(jnp.stack([jnp.sum(ne, dtype=jnp.float32), jnp.max(jnp.where(ne, diff, 0), initial=0.0)]))
  return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.float32)


def _small_leaves(tree, max_bytes: int) -> dict[int, jax.Array]:
  return {i: x for i, x in enumerate(jax.tree.leaves(tree)) if x.size * x.dtype.itemsize <= max_bytes}


@dataclasses.dataclass
class Trajectory:
  """One run: ``losses (steps,)`` float32 (step ``s``'s loss, of the state after step ``s - 1``), ``prints
  (steps, leaves, 2)`` uint32 (:func:`fingerprints` of ``(params, opt_state)`` after each step), and per step
  listed in ``elements`` (1-based) the :func:`element_differences` against the reference run's snapshot of that step,
  ``{leaf index: (count, max_abs)}``."""
  losses: np.ndarray
  prints: np.ndarray
  elements: dict[int, dict[int, tuple[float, float]]] = dataclasses.field(default_factory=dict)


def run_steps(step, init, *, snapshot_steps=(), max_bytes=0, reference: dict | None = None
              ) -> tuple[Trajectory, dict]:
  """Runs ``step(params, opt_state, batch) -> StepResult`` from ``init() -> (params, opt_state, batches)`` over the
  batches (a callable, so that nothing else holds the initial state once the first step has replaced it).

  Returns the :class:`Trajectory` and the snapshots ``{step: {leaf index: array}}`` of the leaves of at most
  ``max_bytes`` after each step in ``snapshot_steps`` (1-based); with ``reference`` (such snapshots of another run)
  the trajectory's ``elements`` compare against them instead of keeping its own."""
  params, opt_state, batches = init()
  losses, prints, snapshots, elements = [], [], {}, {}
  for s, batch in enumerate(batches, start=1):
    result = step(params, opt_state, batch)
    params, opt_state = result.params, result.opt_state
    losses.append(result.loss)
    prints.append(fingerprints((params, opt_state)))
    if s in snapshot_steps:
      small = _small_leaves((params, opt_state), max_bytes)
      if reference is None:
        snapshots[s] = small
      elif s in reference:
        keys = sorted(reference[s])
        diffs = np.asarray(element_differences([reference[s][k] for k in keys], [small[k] for k in keys]))
        elements[s] = {k: (float(c), float(m)) for k, (c, m) in zip(keys, diffs)}
  trajectory = Trajectory(np.asarray(jnp.stack(losses)), np.asarray(jnp.stack(prints)), elements)
  return trajectory, snapshots


@dataclasses.dataclass
class Comparison:
  """Two runs bit for bit: ``loss_steps`` (1-based) whose losses differ, ``leaf_steps[s]`` the leaves that differ
  after step ``s`` (only steps with any), ``elements`` as :class:`Trajectory`'s (of the second run)."""
  names: list[str]
  sizes: list[int] | None
  loss_steps: list[int]
  leaf_steps: dict[int, list[int]]
  elements: dict[int, dict[int, tuple[float, float]]]
  losses: tuple[np.ndarray, np.ndarray]

  @property
  def identical(self) -> bool:
    return not self.loss_steps and not self.leaf_steps

  @property
  def first_step(self) -> int | None:
    """The first step whose loss or resulting state differs (None if identical)."""
    steps = self.loss_steps + list(self.leaf_steps)
    return min(steps) if steps else None

  def report(self, label: str = "") -> str:
    head = f"determinism {label}: ".lstrip()
    steps = len(self.losses[0])
    if self.identical:
      return (head + f"bitwise identical: {steps} losses and all {len(self.names)} leaves of params and optimiser "
              f"state after every step (last loss {self.losses[0][-1]:.6f})")
    lines = [head + f"DIFFERENT from step {self.first_step} of {steps}"]
    for s in self.loss_steps[:3]:
      a, b = self.losses[0][s - 1], self.losses[1][s - 1]
      lines.append(f"  loss of step {s}: {float(a)!r} vs {float(b)!r} ({_hex(a)} vs {_hex(b)})"
                   + ("  <- the state before it was identical: the forward pass differs"
                      if s == self.first_step and s not in self.leaf_steps else ""))
    steps_with_leaves = list(self.leaf_steps)
    for s in dict.fromkeys(steps_with_leaves[:1] + steps_with_leaves[-1:]):
      idx = self.leaf_steps[s]
      lines.append(f"  after step {s}: {len(idx)} of {len(self.names)} leaves differ"
                   + (":" if s == steps_with_leaves[0] or s in self.elements else ""))
      listed = idx if s == steps_with_leaves[0] else [i for i in idx if i in self.elements.get(s, {})]
      for i in listed[:40]:
        extra = ""
        if i in self.elements.get(s, {}):
          count, top = self.elements[s][i]
          extra = f": {int(count)} of {self.sizes[i]} elements, largest |diff| {top:.3g}"
        lines.append(f"    {self.names[i]}{extra}")
      if len(listed) > 40:
        lines.append(f"    ... {len(listed) - 40} more")
    return "\n".join(lines)


def _hex(x) -> str:
  return f"0x{np.float32(x).view(np.uint32):08x}"


def compare(a: Trajectory, b: Trajectory, names: list[str], sizes: list[int] | None = None) -> Comparison:
  """Bitwise comparison of two trajectories of the same model (module docstring)."""
  loss_steps = [s + 1 for s in np.flatnonzero(a.losses.view(np.uint32) != b.losses.view(np.uint32))]
  leaf_steps = {}
  for s in range(a.prints.shape[0]):
    idx = np.flatnonzero(np.any(a.prints[s] != b.prints[s], axis=-1))
    if idx.size:
      leaf_steps[s + 1] = idx.tolist()
  return Comparison(names, sizes, [int(s) for s in loss_steps], leaf_steps, b.elements, (a.losses, b.losses))


_init_params = jax.jit(block.init_block_params, static_argnums=1)  # one compilation instead of one per op


def build_optimizer():
  """Adam with weight decay, as :mod:`benchmarks.train_step` (one instance per call: a static argument of the jit)."""
  return optax.adamw(1e-3)


def build(config: block.BlockConfig, batch_size: int, seq_len: int, steps: int, seed: int):
  """``(params, opt_state, batches, optimizer)``: the initial state from ``seed`` and one batch per step."""
  optimizer = build_optimizer()
  params = _init_params(jax.random.key(seed), config)
  rng = np.random.default_rng(seed)
  batches = [block.synthetic_batch(rng, batch=batch_size, seq_len=seq_len, vocab_size=config.vocab_size)
             for _ in range(steps)]
  return params, optimizer.init(params), batches, optimizer


def compile_step(config, optimizer, implementation, params, opt_state, batch, compiler_options=None):
  """The jitted :func:`~jaxkern.modeling.block.train_step`, lowered (from arrays or ``jax.ShapeDtypeStruct`` s) and
  compiled ahead of time: every call runs this one executable (an input of another type raises instead of
  compiling again)."""
  jitted = jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                     implementation=implementation))
  return jitted.lower(params, opt_state, batch).compile(compiler_options or None)


def twice(config, batch_size, seq_len, *, steps=STEPS, seed=0, implementation=None, compiler_options=None,
          fresh_compile=False, max_bytes=SNAPSHOT_MIB << 20, on_compiled=None):
  """Compiles the step and runs it twice from ``seed`` (module docstring). Each run builds its initial state and
  batches from the seed again (so that is checked too, and only one run's state is alive at a time); the first
  run's is built, and the fingerprints compiled on it, while the step compiles. ``on_compiled(compiled, seconds,
  param shapes)`` is called before the runs.

  Returns ``(comparison, the first run's trajectory, {"compile_s", "total_s"})``."""
  t0 = time.perf_counter()
  shapes = jax.eval_shape(lambda: build(config, batch_size, seq_len, 1, seed)[:3])
  optimizer = build_optimizer()
  compile_args = config, optimizer, implementation, shapes[0], shapes[1], shapes[2][0], compiler_options
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(compile_step, *compile_args)
    pending = [build(config, batch_size, seq_len, steps, seed)[:3]]
    state = pending[0][:2]
    fingerprints(state).block_until_ready()  # compiled for every later call
    small = list(_small_leaves(state, max_bytes).values())  # in index order, as run_steps passes them
    element_differences(small, small).block_until_ready()
    del state, small
    compiled = future.result()
  compile_s = time.perf_counter() - t0
  if on_compiled is not None:
    on_compiled(compiled, compile_s, shapes[0])
  keep = (1, steps)
  first, snapshots = run_steps(compiled, pending.pop, snapshot_steps=keep, max_bytes=max_bytes)
  if fresh_compile:
    compiled = compile_step(*compile_args)
  second, _ = run_steps(compiled, lambda: build(config, batch_size, seq_len, steps, seed)[:3], snapshot_steps=keep,
                        max_bytes=max_bytes, reference=snapshots)
  del snapshots
  tree = shapes[:2]
  comparison = compare(first, second, leaf_names(tree), [x.size for x in jax.tree.leaves(tree)])
  return comparison, first, dict(compile_s=compile_s, total_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------------------
# The compiled program's scatters, digests of a run for another process


_SCATTER = re.compile(r"^\s*(?:ROOT )?(%?[\w.\-]+) = (\S+) scatter\((.*)$")


def scatter_lines(hlo_text: str, leaves: dict[str, list[str]] | None = None) -> list[str]:
  """One line per scatter instruction of an HLO module's text: its result type, ``unique_indices`` /
  ``indices_are_sorted``, the combiner, the op name of its metadata (a ``transpose(...)`` is in a backward pass)
  and the leaves of ``leaves`` (``{"f32[a,b]": names}``) of the result's shape, the gradient it likely is."""
  out = []
  for line in hlo_text.splitlines():
    m = _SCATTER.match(line)
    if not m:
      continue
    rest = m.group(3)
    attrs = [a for a in ("unique_indices=true", "indices_are_sorted=true") if a in rest]
    apply = re.search(r"to_apply=(%?[\w.\-]+)", rest)
    combiner = _combiner(hlo_text, apply.group(1)) if apply else "?"
    op = re.search(r'op_name="([^"]*)"', rest)
    shape = m.group(2).split("{")[0]
    names = (leaves or {}).get(shape, [])
    out.append(f"{shape} {' '.join(attrs) or 'indices neither unique nor sorted'}, combiner {combiner}, "
               f"{op.group(1)[-80:] if op else '?'}"
               + (f"; shape of {', '.join(names[:3])}" if names else ""))
  return out


def _combiner(hlo_text: str, name: str) -> str:
  """The root op of the computation ``name`` (a scatter's ``to_apply``): ``add``, ``minimum``, a parameter (an
  overwrite), or ``name`` itself when not found."""
  body = re.search(rf"^\s*{re.escape(name)} [^\n]*\{{\n(.*?)\n\s*\}}", hlo_text, re.M | re.S)
  root = re.search(r"ROOT \S+ = \S+ ([\w\-]+)\(", body.group(1)) if body else None
  return root.group(1) if root else name


def hlo_shapes(tree) -> dict[str, list[str]]:
  """``{"f32[a,b]": leaf names}`` of a pytree of arrays (or shape structs)."""
  short = {"float32": "f32", "bfloat16": "bf16", "int32": "s32", "float16": "f16"}
  out: dict[str, list[str]] = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    key = f"{short.get(str(x.dtype), str(x.dtype))}[{','.join(map(str, x.shape))}]"
    out.setdefault(key, []).append(jax.tree_util.keystr(path))
  return out


def program_summary(compiled, params=None) -> str:
  """Scatters, sorts and custom calls of a compiled program (``--scatters``); ``params`` (arrays or shape structs)
  names the scatters of a param's shape."""
  text = compiled.as_text()
  scatters = scatter_lines(text, hlo_shapes(params) if params is not None else None)
  calls = re.findall(r'custom_call_target="([^"]+)"', text)
  kinds = re.findall(r'"kind":"(__triton\w*|__cudnn\w*|__cublas\w*)"', text)
  counts = {c: calls.count(c) for c in dict.fromkeys(calls)}
  lines = [f"compiled program: {len(scatters)} scatter(s), {len(re.findall(r' sort[(]', text))} sort(s), "
           f"custom calls {counts}, fusion kinds {dict((k, kinds.count(k)) for k in dict.fromkeys(kinds))}"]
  lines += [f"  scatter {s}" for s in scatters]
  return "\n".join(lines)


def digest(trajectory: Trajectory, names: list[str], label: str, options: dict) -> dict:
  return dict(label=label, compiler_options=options, leaves=names,
              loss_bits=[_hex(x) for x in trajectory.losses], losses=[float(x) for x in trajectory.losses],
              fingerprints=trajectory.prints.tolist())


def from_digest(d: dict) -> Trajectory:
  losses = np.array([int(h, 16) for h in d["loss_bits"]], np.uint32).view(np.float32)
  return Trajectory(losses, np.asarray(d["fingerprints"], np.uint32))


def compare_digests(path_a: pathlib.Path, path_b: pathlib.Path) -> Comparison:
  a, b = (json.loads(pathlib.Path(p).read_text()) for p in (path_a, path_b))
  if a["leaves"] != b["leaves"] or len(a["loss_bits"]) != len(b["loss_bits"]):
    raise SystemExit(f"{path_a} and {path_b} are runs of different models or step counts")
  return compare(from_digest(a), from_digest(b), a["leaves"])


def _option(text: str) -> tuple[str, Any]:
  key, _, value = text.partition("=")
  if value.lower() in ("true", "false"):
    return key, value.lower() == "true"
  try:
    return key, int(value)
  except ValueError:
    return key, value


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", choices=sorted(configs()), default="v3")
  parser.add_argument("--fp8-gemm", action="store_true", help="BlockConfig(fp8_gemm=True), as the benchmark's flag")
  parser.add_argument("--layers", type=int, default=None)
  parser.add_argument("--batch", type=int, default=None, help="sequences per batch (the config's length each)")
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--implementation", default="auto")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--fresh-compile", action="store_true", help="compile the second run's executable again")
  parser.add_argument("--max-diff-mib", type=float, default=SNAPSHOT_MIB)
  parser.add_argument("--scatters", action="store_true", help="print the compiled program's scatters")
  parser.add_argument("--digest", type=pathlib.Path, default=None, help="write the first run's digest (JSON)")
  parser.add_argument("--compare", nargs=2, type=pathlib.Path, default=None, metavar=("A", "B"),
                      help="compare two digests and exit")
  args = parser.parse_args(argv)
  if args.compare:
    comparison = compare_digests(*args.compare)
    print(comparison.report(f"{args.compare[0].name} vs {args.compare[1].name}"))
    return 0 if comparison.identical else 1
  config, batch_size, seq_len = configs()[args.config]()
  config = dataclasses.replace(config, num_layers=args.layers or config.num_layers, fp8_gemm=args.fp8_gemm)
  batch_size = args.batch or batch_size
  options = dict(_option(o) for o in args.compiler_option)
  device = jax.devices()[0].device_kind
  label = (f"{args.config}{' fp8_gemm' if args.fp8_gemm else ''} T={batch_size * seq_len} L={config.num_layers} "
           f"{args.implementation} seed={args.seed} options={options or 'default'}")
  print(f"{device}, jax {jax.__version__}: {label}", flush=True)

  def on_compiled(compiled, seconds, param_shapes):
    print(f"compiled in {seconds:.1f} s", flush=True)
    if args.scatters:
      print(program_summary(compiled, param_shapes), flush=True)

  comparison, first, timing = twice(config, batch_size, seq_len, steps=args.steps, seed=args.seed,
                                    implementation=args.implementation, compiler_options=options,
                                    fresh_compile=args.fresh_compile, max_bytes=int(args.max_diff_mib * (1 << 20)),
                                    on_compiled=on_compiled)
  print(f"total {timing['total_s']:.1f} s; losses {first.losses.tolist()}", flush=True)
  print(comparison.report(label), flush=True)
  if args.digest:
    args.digest.parent.mkdir(parents=True, exist_ok=True)
    args.digest.write_text(json.dumps(digest(first, comparison.names, label, options)))
  return 0 if comparison.identical else 1


if __name__ == "__main__":
  sys.exit(main())
