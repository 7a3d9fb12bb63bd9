"""Training-step benchmark of the model block: ``python -m benchmarks.train_step [--small] [--devices N] ...``.

Builds :mod:`jaxkern.modeling.block` (Engram -> mhc_pre -> MoE FFN with FP8 expand and FP8 SwiGLU -> mhc_post, L
layers, mhc_head, readout) and times the jitted :func:`jaxkern.modeling.block.train_step` (adam) with each
implementation in ``--implementations`` (default ``auto,xla``: on a GPU the compiled kernels where ``"auto"``
picks them, and the ops' XLA paths everywhere): wall-clock median of ``--iterations`` steps, each followed by
``jax.block_until_ready``, after two warm-up steps.

Then the time split: each component's forward + backward (``jax.vjp`` and the pullback of a ones cotangent, jitted
alone, same harness, same shapes as in the step: the layer inputs and the routing of the initial params):

* ``engram``: n-gram hash + table gather + key / value projections + ``engram_gate`` (per layer);
* ``mhc``: ``mhc_pre`` + ``mhc_post`` (per layer), plus ``expand_from_embedding`` and ``mhc_head`` once;
* ``gating``: router logits + ``top2_sum_gate`` (per layer);
* ``routing``: ``get_fused_mapping`` + ``expand_to_fused`` (bf16) + ``reduce_fused`` (per layer);
* ``casts``: the FP8 expand's extra work over the bf16 expand: ``per_token_cast`` of the tokens +
  ``per_token_cast_back`` of the fused rows (forward only; their backward is the straight-through slot sum,
  counted in ``routing``) (per layer);
* ``swiglu``: the fused FP8 SwiGLU (``modeling.swiglu``: forward + cast, backward + cast) (per layer);
* ``gemms``: the three expert grouped matmuls (``jax.lax.ragged_dot``) forward and backward (per layer);
* ``rest``: the step minus the components' sum (embedding, readout + loss, the optimiser, what XLA overlaps
  or fuses differently inside the whole step). Negative values mean the parts cost more alone than together.

On a GPU every timing also gets a CUPTI device time (``jaxkern.testing.timing.device_time_us``, warm L2: no flush,
as in a training step). Rows go to ``benchmarks/results/train_step/<date>_<device>.jsonl`` (a subfolder: the op
summariser reads only ``benchmarks/results/*.jsonl``) or ``--out``; the table is printed as markdown.

``--devices N``: the step runs under a ``jax.sharding.Mesh`` of N devices (axis ``"data"``). With N = 1 the
unsharded step runs with params and batch placed on the one-device mesh. With N > 1 it is
:func:`jaxkern.modeling.block.sharded_train_step`: data parallelism over the batch's sequences and expert
parallelism over the routed experts (``moe_layer_ep``, shared experts replicated) inside ``jax.shard_map``. ``--small``: a tiny model that runs in seconds on a CPU
(the ops' references there: ``"auto"`` off a GPU runs them).

``--fp8-gemm``: the block is built with ``BlockConfig(fp8_gemm=True)``: the experts' matmuls run
:func:`jaxkern.modeling.fp8_grouped_linear` (FP8 forward and both FP8 backward GEMMs, ``jaxkern.gemm``) instead of
``jax.lax.ragged_dot``, with ``alignment=128``; the ``gemms`` row of the split then times those FP8 GEMMs (gate+up
as one GEMM, down; forward + backward, including their casts and weight transposes). E.g.
``python -m benchmarks.train_step --fp8-gemm`` against the same command without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkern import moe, quant
from jaxkern.modeling import block, mhc_head, mhc_post, mhc_pre, expand_from_embedding, MoeConfig
from jaxkern.modeling import moe as moe_module
from jaxkern.modeling._fp8_linear import fp8_grouped_linear
from jaxkern.modeling._grouped_matmul import grouped_matmul
from jaxkern.modeling._swiglu import swiglu
from jaxkern.modeling.sharding import shard_params

RESULTS = pathlib.Path(__file__).parent / "results" / "train_step"
STATIC = ("config", "optimizer", "implementation", "moe_fn")


def gpu_config() -> tuple[block.BlockConfig, int, int]:
  """``(config, batch, seq_len)`` that fits one H100 (80 GB): H 2048, 4 layers, 16 experts top-4 + 1 shared,
  I 1024, 8192 tokens. (64 experts top-8 did not fit: ``jax.lax.ragged_dot`` densifies over the experts, and
  XLA's autotuning asked for a 20.3 GiB buffer on an H100, 2026-11-26.)"""
  moe_config = MoeConfig(num_experts=16, num_topk=4, num_shared_experts=1, alignment=128, fp8_swiglu=True,
                         fp8_expand=True)
  return (block.BlockConfig(vocab_size=8192, hidden=2048, intermediate=1024, num_layers=4, moe=moe_config,
                            engram_table_size=65521, engram_embed_dim=64), 4, 2048)


def small_config() -> tuple[block.BlockConfig, int, int]:
  """A tiny model for a CPU (the references: the kernels' size limits do not apply)."""
  moe_config = MoeConfig(num_experts=4, num_topk=2, num_shared_experts=1, alignment=8, fp8_swiglu=True,
                         fp8_expand=True)
  return (block.BlockConfig(vocab_size=32, hidden=256, intermediate=128, num_layers=1, moe=moe_config,
                            engram_table_size=31, engram_embed_dim=8), 1, 16)


def time_ms(f, *args, iterations: int) -> dict:
  """Wall-clock median (ms) of ``iterations`` calls of the jitted ``f(*args)``, each blocked on; on a GPU also the
  CUPTI device time (median, ms) of the same computation."""
  for _ in range(2):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  out = dict(wall_ms=statistics.median(times))
  if jax.default_backend() == "gpu":
    from jaxkern.testing import timing
    out["device_ms"] = 1e-3 * timing.device_time_us(f, *args, iterations=iterations, flush=False)
  return out


def _fwd_bwd(f):
  """``g(*args)``: ``f``'s outputs and the pullback of a ones cotangent (all args differentiated)."""
  def g(*args):
    out, pullback = jax.vjp(f, *args)
    return out, pullback(jax.tree.map(jnp.ones_like, out))
  return jax.jit(g)


def components(params, batch, config: block.BlockConfig, implementation: str) -> dict:
  """``{name: (fn, args, times)}``: each component's forward + backward (module docstring), ``times`` the
  multiplier (layers) that gives its share of one step."""
  impl = implementation
  t, m, h, L = batch.tokens.size, config.mhc_mult, config.hidden, config.num_layers
  mc = config.moe
  layer = params.layers[0]
  rows = block.engram_rows(batch.tokens, config=config, implementation=impl)
  x = params.embed.astype(jnp.bfloat16)[batch.tokens.reshape(t)]
  residual = expand_from_embedding(x, m, implementation=impl)
  p = layer.mhc
  y = mhc_pre(residual, p.fn, p.scale, p.base, norm_weight=p.norm_weight, implementation=impl)[0]
  routing = moe_module.route_tokens(layer.moe, y, config=mc, implementation=impl)
  mapping = moe.get_fused_mapping(routing.topk_idx, mc.num_all_experts, 0, mc.alignment, force_no_sync=True,
                                  implementation=impl)
  sizes = moe_module._group_sizes(mapping)
  pos, p2e = mapping.token_topk_to_pos, mapping.pos_to_expert
  n = p2e.shape[0]
  w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (layer.moe.w_gate, layer.moe.w_up, layer.moe.w_down))
  xf = moe.expand_to_fused(y, pos, p2e, implementation=impl)
  key = jax.random.key(0)
  gate_up = jax.random.normal(key, (n, 2 * config.intermediate), jnp.float32).astype(jnp.bfloat16)

  def engram_fn(e, r):
    rows_all = block.engram_rows(batch.tokens, config=config, implementation=impl)
    return block.engram_memory(e, r, rows_all[0], config=config, implementation=impl)

  def mhc_fn(mp, r, out):
    yy, (post, comb) = mhc_pre(r, mp.fn, mp.scale, mp.base, norm_weight=mp.norm_weight, implementation=impl)
    return mhc_post(out, r, post, comb, implementation=impl), yy

  def mhc_ends(xe, hp):
    r = expand_from_embedding(xe, m, implementation=impl)
    return mhc_head(r, hp.fn, hp.scale, hp.base, implementation=impl)

  def gating(router, yy):
    return moe_module.route_tokens(layer.moe._replace(router=router), yy, config=mc, implementation=impl).topk_weights

  def routing_fn(yy, yf, weights):
    mp = moe.get_fused_mapping(routing.topk_idx, mc.num_all_experts, 0, mc.alignment, force_no_sync=True,
                               implementation=impl)
    ex = moe.expand_to_fused(yy, mp.token_topk_to_pos, mp.pos_to_expert, implementation=impl)
    return ex, moe.reduce_fused(yf, weights, mp.token_topk_to_pos, implementation=impl)

  def casts(yy, xff):
    q = quant.per_token_cast(yy, "e4m3", moe_module.FP8_EXPAND_GROUP, implementation=impl)
    qf = quant.per_token_cast(xff, "e4m3", moe_module.FP8_EXPAND_GROUP, implementation=impl)
    return q.data, quant.per_token_cast_back(qf, "bf16", moe_module.FP8_EXPAND_GROUP, implementation=impl)

  def gemms(xff, wg, wu, wd):
    a = grouped_matmul(xff, wg, sizes)
    b = grouped_matmul(xff, wu, sizes)
    return grouped_matmul(jnp.maximum(a, b), wd, sizes)

  out = {
      "engram": (_fwd_bwd(engram_fn), (layer.engram, residual), L),
      "mhc": (_fwd_bwd(mhc_fn), (p, residual, y), L),
      "mhc_ends": (_fwd_bwd(mhc_ends), (x, params.head), 1),
      "gating": (_fwd_bwd(gating), (layer.moe.router, y), L),
      "routing": (_fwd_bwd(routing_fn), (y, xf, routing.topk_weights), L),
      "casts": (jax.jit(casts), (y, xf), L),
      "gemms": (_fwd_bwd(gemms), (xf, *w), L),
  }
  if mc.fp8_swiglu:
    out["swiglu"] = (_fwd_bwd(lambda gu: swiglu(gu, implementation=impl)), (gate_up,), L)
  if mc.fp8_gemm:  # --fp8-gemm: the step's FP8 grouped GEMMs (as swiglu_experts runs them) instead of ragged_dot
    block_expert = moe_module.fused_block_experts(p2e)

    def fp8_gemms(xff, wg, wu, wd):
      linear = functools.partial(fp8_grouped_linear, block_expert=block_expert, implementation=impl)
      a = linear(xff, jnp.swapaxes(jnp.concatenate([wg, wu], axis=2), 1, 2))
      i = wg.shape[2]
      return linear(jnp.maximum(a[:, :i], a[:, i:]), jnp.swapaxes(wd, 1, 2))

    out["gemms"] = (_fwd_bwd(fp8_gemms), (xf, *w), L)
  return out


def _mesh_step(args, config, optimizer, implementation):
  """The jitted step, and a function placing params / batch for it (``--devices``; module docstring)."""
  step = jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                   implementation=implementation))
  if not args.devices:
    return step, lambda tree: tree
  if args.devices > len(jax.devices()):
    print(f"--devices {args.devices}: only {len(jax.devices())} devices here", file=sys.stderr)
    raise SystemExit(2)
  # Auto axes: under an Explicit one (jax 0.11's default) ragged_dot has no sharding rule.
  mesh = jax.make_mesh((args.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:args.devices])
  if args.devices == 1:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return step, lambda tree: jax.device_put(tree, replicated)
  return sharded_step(mesh, config, optimizer, implementation)


def sharded_step(mesh, config, optimizer, implementation):
  """:func:`jaxkern.modeling.block.sharded_train_step` on mesh axis ``"data"``: the batch and the routed experts
  split over it (``B`` and ``E`` multiples of the devices), shared experts and everything else replicated
  (:func:`jaxkern.modeling.block.ep_params` / ``block_param_specs``), ``check_vma=False`` (the Pallas kernels).
  ``place`` turns :class:`~jaxkern.modeling.block.BlockParams` into the sharded EP params, a
  :class:`~jaxkern.modeling.block.Batch` into one sharded over sequences."""
  axis, P = "data", jax.sharding.PartitionSpec
  step = block.sharded_train_step(config, optimizer, mesh, expert_axis=axis, implementation=implementation)

  def place(tree):
    if isinstance(tree, block.BlockParams):
      ep = block.ep_params(tree, config)
      return shard_params(ep, mesh, block.block_param_specs(ep, axis))
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, P(axis)))

  return step, place


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="a tiny model (seconds on a CPU)")
  parser.add_argument("--devices", type=int, default=0, help="run the step under a mesh of N devices")
  parser.add_argument("--iterations", type=int, default=None, help="timed steps (median); default 20, --small 2")
  parser.add_argument("--implementations", default="auto,xla")
  parser.add_argument("--no-split", action="store_true", help="time the whole step only")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--fp8-gemm", action="store_true",
                      help="expert matmuls in FP8 (BlockConfig(fp8_gemm=True): fp8_grouped_linear, alignment 128)")
  args = parser.parse_args(argv)
  config, batch_size, seq_len = small_config() if args.small else gpu_config()
  if args.fp8_gemm:
    config = dataclasses.replace(config, fp8_gemm=True)
  iterations = args.iterations or (2 if args.small else 20)
  if args.devices > 1:  # the sharded step splits the batch's sequences over the devices
    batch_size = -(-batch_size // args.devices) * args.devices
  device = jax.devices()[0].device_kind.replace(" ", "-")
  if jax.default_backend() != "gpu" and not args.small:
    print("No GPU found: the H100-sized model would run the references on the CPU; use --small", file=sys.stderr)
    return 2
  params = block.init_block_params(jax.random.key(0), config)
  batch = block.synthetic_batch(np.random.default_rng(0), batch=batch_size, seq_len=seq_len,
                                vocab_size=config.vocab_size)
  optimizer = optax.adamw(1e-3)
  label = (f"T={batch.tokens.size} H={config.hidden} L={config.num_layers} E={config.moe.num_experts} "
           f"K={config.moe.num_topk} S={config.moe.num_shared_experts} I={config.intermediate} V={config.vocab_size}")
  label += " fp8_gemm" if args.fp8_gemm else ""
  print(f"{device}, jax {jax.__version__}: {label}, devices={args.devices or 'no mesh'}")
  rows = []
  stamp = datetime.datetime.now(datetime.timezone.utc)
  for impl in args.implementations.split(","):
    step, place = _mesh_step(args, config, optimizer, impl)
    p, b = place(params), place(batch)
    opt_state = optimizer.init(p)  # shaped and placed like the (possibly expert-parallel) params
    timed = time_ms(lambda p, o, b: step(p, o, b).loss, p, opt_state, b, iterations=iterations)
    loss = float(step(p, opt_state, b).loss)
    rows.append(dict(component="step", implementation=impl, times=1, loss=loss, **timed))
    if args.no_split:
      continue
    for name, (fn, fargs, times) in components(params, batch, config, impl).items():
      rows.append(dict(component=name, implementation=impl, times=times, **time_ms(fn, *fargs, iterations=iterations)))
  for r in rows:
    r.update(date=stamp.date().isoformat(), time=stamp.strftime("%H:%M:%S"), gpu=device, jax=jax.__version__,
             shape=label, devices=args.devices, iterations=iterations, bench="train_step")
  print(table(rows))
  out = args.out or RESULTS / f"{stamp.date().isoformat()}_{device}.jsonl"
  out.parent.mkdir(parents=True, exist_ok=True)
  with out.open("a") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  print(f"{len(rows)} rows appended to {out}")
  return 0


def table(rows) -> str:
  """Markdown: per component and implementation the step share (ms, per-layer figures times the layers) and % of
  the step; a ``rest`` row (the step minus the components)."""
  impls = list(dict.fromkeys(r["implementation"] for r in rows))
  key = "device_ms" if all("device_ms" in r for r in rows) else "wall_ms"
  share = {(r["component"], r["implementation"]): r[key] * r["times"] for r in rows}
  names = list(dict.fromkeys(r["component"] for r in rows))
  lines = [f"| component ({key}, per step) | " + " | ".join(impls) + " | " +
           " | ".join(f"% of {i} step" for i in impls) + (" | speed-up |" if len(impls) == 2 else " |"),
           "|---" * (1 + 2 * len(impls) + (len(impls) == 2)) + "|"]
  if any(r["component"] != "step" for r in rows):
    for i in impls:
      share[("rest", i)] = share[("step", i)] - sum(v for (c, j), v in share.items() if j == i and c != "step")
    names.append("rest")
  for c in names:
    vals = [share.get((c, i)) for i in impls]
    cells = [f"{v:.2f}" if v is not None else "—" for v in vals]
    pct = [f"{100 * v / share[('step', i)]:.0f}%" if v is not None else "—" for v, i in zip(vals, impls)]
    speed = ""
    if len(impls) == 2:
      speed = f" {vals[1] / vals[0]:.2f}× |" if vals[0] and vals[1] and c != "rest" else " — |"
    lines.append(f"| {c} | " + " | ".join(cells) + " | " + " | ".join(pct) + " |" + speed)
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
