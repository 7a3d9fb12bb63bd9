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

``--devices 1,2`` (a list; ``--devices N`` is a list of one): each count ``N`` runs the step under a
``jax.sharding.Mesh`` of the first ``N`` devices (axis ``"data"``), all with the **same global batch** (the batch
rounded up once to a multiple of the largest count). With N = 1 the unsharded step runs with params and batch placed
on the one-device mesh. With N > 1 it is :func:`jaxkern.modeling.block.sharded_train_step`: data parallelism over the
batch's sequences and expert parallelism over the routed experts (``moe_layer_ep``, shared experts replicated) inside
``jax.shard_map``. Step rows get ``tokens_per_s`` (global tokens / wall-clock step time) and, for N > 1 when 1 is
in the list, ``scaling_efficiency = t(1) / (N * t(N))``: *strong* scaling (same global batch, so ideal is
t(N) = t(1)/N and efficiency 1). Step rows also get ``pipelined_ms`` (:func:`pipelined_ms`: chained steps as in a
training loop, blocked on once at the end, so the host's dispatch overlaps the previous step) and, for N > 1,
``scaling_efficiency_pipelined`` from it. A scaling table (devices, step ms, tokens/s, both efficiencies;
wall-clock) is printed.

For N > 1 the time split is the communication only, timed alone on the N-device mesh with the step's shapes
(wall-clock: CUPTI device times would add up the N GPUs' kernels):

* ``collectives``: the token exchange of ``moe_layer_ep`` per layer, forward + backward: all-gather of the tokens
  ``(T/N, H)`` bf16, their top-k ids ``(T/N, K)`` int32 (stood in by float32, no backward) and weights
  ``(T/N, K)`` float32, and the ``psum_scatter`` of the float32 partial sums ``(T, H) -> (T/N, H)``; their
  transposes in the backward (``psum_scatter`` of the bf16 token cotangents, all-gather of the float32 output
  cotangents, ``psum_scatter`` of the weights' cotangents) (per layer, times L);
* ``grad_allreduce``: the ``psum`` over the N devices of the gradients of every replicated (float32) param, as
  ``sharded_value_and_grad`` does (once per step);
* ``rest``: the step minus the two: the per-device compute (the compute split is the N = 1 table's) and whatever
  of the communication overlaps with it.

``--check``: before timing, for every N > 1 the loss and gradients of the N-device sharded loss
(``jaxkern.modeling.sharding.sharded_value_and_grad`` of ``loss_fn`` with ``moe_ffn_ep``, as in the sharded step)
against ``jax.value_and_grad`` of the unsharded loss on one device, same params and global batch, gathered to the host,
the expert-parallel gradients merged back to the unsharded layout (``merge_ep_params``). Printed per leaf group
(layers pooled): the largest ``|g_N - g_1| / |g_1|`` (Frobenius norms, per leaf) and the largest elementwise
difference relative to the leaf's largest ``|g_1|``. Fails (exit status 1, after the timing) when a loss differs
by more than ``--check-loss-rtol`` (1e-3) relative or a leaf by more than ``--check-rtol`` (5e-2) in norm. Why
these: the sharded step changes the order of float32 sums (a token's MoE slots per device, then over devices; the
replicated params' gradients per device, then ``psum``), and the activations are bf16 / FP8, so a changed sum can
flip a bf16 or FP8 rounding of an activation, which moves the gradients more than the summation order alone. On 8
simulated CPU devices with FP8 expand and SwiGLU this was 0.6% of a gradient's norm for most params and 1.2% at most
(tests/modeling/test_block_sharding.py, tolerance 3e-2, float32 matmuls at "highest"); ``--small --devices 1,2``
(32 tokens, default precision) gives 0.2-0.4% for most leaves and 2.1% for ``head.scale``, a one-element gradient
that is a sum with cancellation; the kernels against the references differ by 2e-3 in the loss
(tests/modeling/test_block.py). A missing or doubled gradient sum (a factor N), a wrong expert shard or a
misrouted token block moves a gradient by O(1); a dropped single token among thousands is below any usable
tolerance of this check (the 8-device tests compare the step with the references at small sizes).

``--ep-capacity-factor F`` sets ``MoeConfig.ep_capacity_factor`` of every layer (default: the config's, off; 1.25 is
the recommended value): the
expert-parallel layer (N > 1) sizes each device's fused rows for ``F`` times the mean routed slots per device and
falls back to the worst-case layout, exactly, when the routing needs more; ``0`` always runs the worst case (the
layer before the capacity existed). Rows get ``ep_capacity_factor``; the shape label gets ``ep_capacity=F`` when the
flag is given. With ``--check`` a line per N > 1 (``ep capacity ...``) gives the capacity and worst-case rows and the
rows the initial params' routing needs on the busiest device, per layer, and so which path the step takes.

``--ep-combine-dtype bfloat16`` (N > 1) sets ``MoeConfig.ep_combine_dtype``: the expert-parallel layer adds the
devices' routed partial sums in bfloat16 (half the exchanged bytes, no float32 copy of the fused rows); the label gets
``ep_combine=bfloat16``.

``--ep-exchange all_to_all`` (N > 1) sets ``MoeConfig.ep_exchange``: each token goes once to each device holding one of
its experts, in per-destination buffers of a static capacity (``--ep-capacity-factor``; without it the worst case, every
token to every device), the partial sums back by the transposed exchange (:mod:`jaxkern.modeling._ep_exchange`);
``--ep-exchange-chunks N`` splits it into ``N`` chunks that XLA may overlap with the experts. The label gets
``ep_exchange=all_to_all`` (and ``ep_chunks=N``). The split's communication rows are then ``dispatch`` (the send
buffers' ``all_to_all``: e4m3 tokens and scales with FP8 dispatch, else bfloat16, plus ids and weights) and
``combine`` (the partial sums), forward only (the backward moves their transposes, as many bytes but bfloat16 tokens),
and ``a2a_peak`` (a plain ``all_to_all`` of ``--a2a-peak-mb`` MB per device, ``times`` 0: a reference, not part of the
step); each gets ``bytes_sent`` (what one device sends to the others per call) and ``gb_per_s`` (DeepEP's measure:
those bytes per second), printed as they are timed.

``--grad-reduce-dtype bfloat16`` (N > 1): the replicated params' gradients are all-reduced in bfloat16 (half the
bytes; :func:`jaxkern.modeling.sharded_value_and_grad`'s ``grad_reduce_dtype``); the label gets
``grad_reduce=bfloat16``. Rows record ``XLA_FLAGS`` (e.g. the latency-hiding scheduler) and ``first_call_s`` (the
compilation and one step). A line per step count is printed as soon as it is timed.

On a GPU, several counts (``--devices 1,2``) run one process per count (:func:`counts_in_processes`), then the scaling
table of their rows. The optimiser state is made with :func:`jaxkern.modeling.init_optimizer_state`, so the chained
steps of ``pipelined_ms`` do not compile the step again. ``python -m benchmarks.profile_step`` profiles one count.

``--config v3``: a DeepSeek-V3-like layer size that fits one H100 (:func:`v3_config`: H 7168, I 2048, 8 experts
top-4 + 1 shared, 8192 tokens, one layer); ``--experts`` / ``--topk`` / ``--layers`` / ``--batch`` (sequences)
override a config's sizes; ``--memory`` prints the unsharded step's compiled memory estimate on this backend and
exits. ``--small``: a tiny model that runs in seconds on a CPU (the ops' references there: ``"auto"`` off a GPU runs
them).

``--shard-replicated`` (N > 1): the replicated params (embedding, Engram, mHC, shared experts, router, readout: those
whose dim 0 is a multiple of N) and their Adam state are stored split over ``"data"``
(``block.sharded_train_step(shard_replicated="data")``, :func:`jaxkern.modeling.storage_specs`; ZeRO/FSDP-style):
all-gathered inside the ``shard_map`` before the loss, their gradients reduce-scattered (in ``--grad-reduce-dtype``)
instead of all-reduced, so each device updates 1/N of them; ``--check`` runs the sharded loss the same way. The shape
label gets ``shard_replicated``; the ``grad_allreduce`` row of the split still times the all-reduce of the
replicated layout.

``--shard-optimizer`` (N > 1; not with ``--shard-replicated``): the replicated params stay whole on every device, but
their Adam state and update are split over ``"data"`` (``block.sharded_train_step(shard_optimizer="data")``;
ZeRO-1/2-style): their gradients reduce-scattered, each device updates 1/N of them, and the step all-gathers the
updated params at its end. The shape label gets ``shard_optimizer``.

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
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkern import moe, quant
from jaxkern.modeling import block, mhc_head, mhc_post, mhc_pre, expand_from_embedding, MoeConfig
from jaxkern.modeling import moe as moe_module
from jaxkern.modeling.moe import EP_COMBINE_DTYPES, EP_EXCHANGES
from jaxkern.modeling._ep_exchange import exchange_capacity
from jaxkern.modeling._fp8_linear import fp8_grouped_linear
from jaxkern.modeling._grouped_matmul import grouped_matmul
from jaxkern.modeling._swiglu import swiglu
from jaxkern.modeling.sharding import (ep_fused_rows, init_optimizer_state, shard_params, sharded_value_and_grad,
                                       storage_specs)

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


V3_EXPERTS, V3_TOPK, V3_LAYERS = 8, 4, 1


def v3_config() -> tuple[block.BlockConfig, int, int]:
  """``(config, batch, seq_len)``: a DeepSeek-V3-like layer that fits one H100 with ``jax.lax.ragged_dot``: hidden
  7168, expert intermediate 2048 (V3's sizes), 8 routed experts top-4 + 1 shared, 8192 tokens (4 x 2048), one
  layer, vocabulary 8192.

  DeepSeek-V3 routes top-8 of 256 experts. Here the limit is ``ragged_dot``, which XLA densifies over the experts:
  its temporaries grow with ``E x T x K x H``. XLA:CPU's ``memory_analysis`` of the unsharded adam step compiled
  with the ops' XLA paths (:func:`memory_estimate`, ``--memory``; 2026-11-26), total of arguments, outputs and
  temporaries: E16 top-8 134.5 GiB, E16 top-4 86.9 GiB, E8 top-4 50.6 GiB (one layer each; E8 top-4 with two
  layers 83.2 GiB). The same estimate for
  :func:`gpu_config`, which runs on an H100, is 72.0 GiB, so the CPU figure is not an underestimate; E8 top-4 is
  the largest of these under ~60 GB (by the E x K scaling, top-2 of 16 would be about as large, with a quarter of
  V3's routed width per token;
  top-4 of 8 keeps half of it: 4 x 2048). ``--experts`` / ``--topk`` / ``--layers`` override it, ``--memory``
  prints the estimate on the GPU itself. E = 8 splits evenly over 2, 4 and 8 GPUs."""
  moe_config = MoeConfig(num_experts=V3_EXPERTS, num_topk=V3_TOPK, num_shared_experts=1, alignment=128,
                         fp8_swiglu=True, fp8_expand=True)
  return (block.BlockConfig(vocab_size=8192, hidden=7168, intermediate=2048, num_layers=V3_LAYERS, moe=moe_config,
                            engram_table_size=65521, engram_embed_dim=64), 4, 2048)


CONFIGS = {"gpu": gpu_config, "v3": v3_config}


def memory_estimate(config: block.BlockConfig, batch_size: int, seq_len: int, implementation: str = "xla") -> dict:
  """Bytes of the jitted unsharded adam step compiled for the default backend (no arrays allocated):
  ``compile().memory_analysis()``'s argument, output, temporary and generated-code sizes, and their ``total``
  (arguments and outputs both: the step donates nothing, so both are live at its end)."""
  optimizer = optax.adamw(1e-3)
  params = jax.eval_shape(lambda: block.init_block_params(jax.random.key(0), config))
  state = jax.eval_shape(optimizer.init, params)
  batch = block.Batch(*(jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32),) * 2)
  step = jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                   implementation=implementation))
  m = step.lower(params, state, batch).compile().memory_analysis()
  out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
             code=m.generated_code_size_in_bytes)
  out["total"] = sum(out.values())
  return out


def time_ms(f, *args, iterations: int, device_time: bool = True) -> dict:
  """Wall-clock median (ms) of ``iterations`` calls of the jitted ``f(*args)``, each blocked on; on a GPU (and
  ``device_time``) also the CUPTI device time (median, ms) of the same computation."""
  for _ in range(2):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  out = dict(wall_ms=statistics.median(times))
  if device_time and jax.default_backend() == "gpu":
    from jaxkern.testing import timing
    out["device_ms"] = 1e-3 * timing.device_time_us(f, *args, iterations=iterations, flush=False)
  return out


def pipelined_ms(step, params, opt_state, batch, *, iterations: int) -> float:
  """Wall-clock ms per step of ``iterations`` chained steps (each takes the params and optimiser state the one
  before returned, as a training loop does), blocked on once at the end: the host dispatches step ``i + 1`` while
  step ``i`` runs, so the host's per-step dispatch (and, with several devices, its launches on each) is hidden
  behind the GPU work instead of added to every step."""
  def run(count, params, opt_state):
    out = None
    for _ in range(count):
      out = step(params, opt_state, batch)
      params, opt_state = out.params, out.opt_state
    jax.block_until_ready(out)
    return params, opt_state

  params, opt_state = run(2, params, opt_state)
  t0 = time.perf_counter()
  run(iterations, params, opt_state)
  return 1e3 * (time.perf_counter() - t0) / iterations


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
  x = params.embed[batch.tokens.reshape(t)].astype(jnp.bfloat16)
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


AXIS = "data"


def make_mesh(n: int):
  """A mesh of the first ``n`` devices, one ``Auto`` axis ``"data"`` (under an Explicit one, jax 0.11's default,
  ragged_dot has no sharding rule)."""
  return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def _mesh_step(n: int, config, optimizer, implementation, grad_reduce_dtype=None, shard_replicated=False,
               shard_optimizer=False):
  """The jitted step on ``n`` devices (0: no mesh), and a function placing params / batch for it (module
  docstring; ``shard_replicated`` and ``shard_optimizer`` apply to ``n > 1`` only)."""
  step = jax.jit(functools.partial(block.train_step, config=config, optimizer=optimizer,
                                   implementation=implementation))
  if not n:
    return step, lambda tree: tree
  mesh = make_mesh(n)
  if n == 1:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return step, lambda tree: jax.device_put(tree, replicated)
  return sharded_step(mesh, config, optimizer, implementation, grad_reduce_dtype, shard_replicated, shard_optimizer)


def init_state(optimizer, params, n: int, shard_optimizer=False):
  """The optimiser state of the placed ``params`` for :func:`_mesh_step`'s step on ``n`` devices
  (:func:`jaxkern.modeling.init_optimizer_state`; with ``shard_optimizer`` and ``n > 1`` split over ``"data"``)."""
  if not n:
    return optimizer.init(params)
  shard_over = AXIS if shard_optimizer and n > 1 else None
  return init_optimizer_state(optimizer, params, make_mesh(n), shard_over=shard_over)


def _placer(mesh, config, shard_replicated=False):
  """``place(tree)``: :class:`~jaxkern.modeling.block.BlockParams` -> the sharded EP params (``shard_replicated``:
  the replicated ones stored split over ``"data"``, :func:`jaxkern.modeling.storage_specs`), a
  :class:`~jaxkern.modeling.block.Batch` -> one sharded over sequences."""
  P = jax.sharding.PartitionSpec

  def place(tree):
    if isinstance(tree, block.BlockParams):
      ep = block.ep_params(tree, config)
      specs = block.block_param_specs(ep, AXIS)
      if shard_replicated:
        specs = storage_specs(specs, ep, mesh, AXIS)
      return shard_params(ep, mesh, specs)
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, P(AXIS)))

  return place


def sharded_step(mesh, config, optimizer, implementation, grad_reduce_dtype=None, shard_replicated=False,
                 shard_optimizer=False):
  """:func:`jaxkern.modeling.block.sharded_train_step` on mesh axis ``"data"``: the batch and the routed experts
  split over it (``B`` and ``E`` multiples of the devices), shared experts and everything else replicated
  (:func:`jaxkern.modeling.block.ep_params` / ``block_param_specs``), ``check_vma=False`` (the Pallas kernels).
  ``place`` turns :class:`~jaxkern.modeling.block.BlockParams` into the sharded EP params, a
  :class:`~jaxkern.modeling.block.Batch` into one sharded over sequences. ``grad_reduce_dtype``: the dtype of the
  replicated params' gradient all-reduce (``None``: float32). ``shard_replicated``: the replicated params stored
  split over ``"data"`` (``block.sharded_train_step(shard_replicated="data")``), placed so by ``place``.
  ``shard_optimizer``: their optimiser state split over ``"data"`` (make it with :func:`init_state`)."""
  step = block.sharded_train_step(config, optimizer, mesh, expert_axis=AXIS, implementation=implementation,
                                  grad_reduce_dtype=grad_reduce_dtype,
                                  shard_replicated=AXIS if shard_replicated else None,
                                  shard_optimizer=AXIS if shard_optimizer else None)
  return step, _placer(mesh, config, shard_replicated)


def _group(path) -> str:
  """A leaf's group: its path's names with the layer index dropped (``.layers[0].moe.w_gate`` ->
  ``layers.moe.w_gate``)."""
  names = []
  for entry in path:
    if isinstance(entry, jax.tree_util.SequenceKey):
      continue
    names.append(str(getattr(entry, "name", getattr(entry, "key", entry))))
  return ".".join(names)


def check_devices(params, batch, config: block.BlockConfig, implementation: str, n: int, *, rtol: float,
                  loss_rtol: float, grad_reduce_dtype=None, shard_replicated=False,
                  shard_optimizer=False) -> tuple[bool, str]:
  """``(ok, report)``: loss and gradients of the ``n``-device sharded loss (its replicated params' gradients summed in
  ``grad_reduce_dtype``; with ``shard_replicated`` stored split over ``"data"``) against the unsharded one on one
  device (``--check``; module docstring)."""
  dev0 = jax.devices()[0]
  loss1 = functools.partial(block.loss_fn, config=config, implementation=implementation)
  l1, g1 = jax.jit(jax.value_and_grad(loss1))(jax.device_put(params, dev0), jax.device_put(batch, dev0))
  l1, g1 = float(l1), jax.tree.map(np.asarray, g1)
  mesh = make_mesh(n)
  moe_fn = functools.partial(block.moe_ffn_ep, mesh_axis=AXIS)
  lossn = functools.partial(block.loss_fn, config=config, implementation=implementation, moe_fn=moe_fn)
  ep = block.ep_params(params, config)
  specs = block.block_param_specs(ep, AXIS)
  vg = jax.jit(sharded_value_and_grad(lossn, mesh, specs, check_vma=False, grad_reduce_dtype=grad_reduce_dtype,
                                      shard_replicated=AXIS if shard_replicated else None,
                                      shard_optimizer=AXIS if shard_optimizer else None))
  place = _placer(mesh, config, shard_replicated)
  ln, gn = vg(place(params), place(batch))
  ln = float(ln)
  gn = jax.tree.map(np.asarray, block.merge_ep_params(jax.tree.map(np.asarray, gn)))
  del vg
  return compare_grads(ln, gn, l1, g1, label=f"{implementation} {n} devices", rtol=rtol, loss_rtol=loss_rtol)


def capacity_report(params, batch, config: block.BlockConfig, implementation: str, n: int) -> str:
  """One line (``--check``): the expert-parallel layer's fused rows per device on ``n`` devices (capacity and worst
  case, :func:`jaxkern.modeling.sharding.ep_fused_rows`) and the rows the routing of ``params`` on ``batch`` needs
  on the busiest device, per layer: whether the step's first iterations take the capacity path or the fallback."""
  mc = config.moe
  load = jax.jit(functools.partial(block.expert_load, config=config, implementation=implementation))(
      jax.device_put(params, jax.devices()[0]), jax.device_put(batch.tokens, jax.devices()[0]))
  load = np.asarray(load)  # (L, E)
  aligned = -(-load // mc.alignment) * mc.alignment
  need = aligned.reshape(load.shape[0], n, -1).sum(axis=2).max(axis=1)  # busiest device per layer
  rows, worst = ep_fused_rows(mc, batch.tokens.size, n)
  if rows < worst:
    paths = ["capacity" if m <= rows else "worst-case fallback" for m in need]
  else:
    paths = ["worst case (the capacity is not below it: no branch)"] * len(need)
  return (f"ep capacity {implementation} {n} devices: factor {mc.ep_capacity_factor}, rows {rows} (worst case {worst}, "
          f"mean slots {batch.tokens.size * mc.num_topk // n}); busiest device needs {need.tolist()} per layer: "
          f"{', '.join(paths)} (initial params)")


def compare_grads(loss_n: float, grads_n, loss_1: float, grads_1, *, label: str, rtol: float,
                  loss_rtol: float) -> tuple[bool, str]:
  """``(ok, report)`` of ``--check``: host-side (numpy) gradient pytrees of the same structure, compared per leaf
  and reported per leaf group (module docstring)."""
  groups: dict[str, list] = {}
  ok = abs(loss_n - loss_1) <= loss_rtol * abs(loss_1)
  lines = [f"check {label} vs 1: loss {loss_n:.6f} vs {loss_1:.6f} (rel {abs(loss_n - loss_1) / abs(loss_1):.1e}, "
           f"tol {loss_rtol:g}) {'ok' if ok else 'FAIL'}",
           f"| leaf group | leaves | max norm rel diff | max elementwise diff / max abs | (tol {rtol:g} in norm) |",
           "|---|---|---|---|---|"]
  leaves_n = jax.tree_util.tree_leaves_with_path(grads_n)
  leaves_1 = jax.tree.leaves(grads_1)
  if len(leaves_n) != len(leaves_1):
    return False, f"check {label}: {len(leaves_n)} gradient leaves vs {len(leaves_1)}"
  for (path, a), b in zip(leaves_n, leaves_1):
    name = _group(path)
    if a.shape != b.shape:
      return False, f"check {label}: {name} shape {a.shape} vs {b.shape}"
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm, top = float(np.linalg.norm(b)), float(np.abs(b).max(initial=0.0))
    diff = float(np.linalg.norm(a - b))
    if norm == 0:  # the router bias: a buffer, no gradient on either side
      rel = rel_el = 0.0 if diff == 0 else float("inf")
    else:
      rel, rel_el = diff / norm, float(np.abs(a - b).max()) / top
    if not np.isfinite(a).all():
      rel = float("inf")
    g = groups.setdefault(name, [0, 0.0, 0.0])
    g[0] += 1
    g[1], g[2] = max(g[1], rel), max(g[2], rel_el)
  for name, (count, rel, rel_el) in groups.items():
    bad = not rel <= rtol
    ok &= not bad
    lines.append(f"| {name} | {count} | {rel:.2e} | {rel_el:.2e} | {'FAIL' if bad else 'ok'} |")
  worst = max(groups, key=lambda k: groups[k][1])
  lines.append(f"check {label}: {'ok' if ok else 'FAILED'} (largest norm rel diff {groups[worst][1]:.2e}, "
               f"{worst})")
  return ok, "\n".join(lines)


EXCHANGE_BYTES: dict = {}  # component -> bytes one device sends to the others per call (set by collective_components)


def _all_to_all_components(mesh, t: int, h: int, config: block.BlockConfig, peak_mb: float) -> dict:
  """The all-to-all exchange's pieces timed alone (module docstring, ``--ep-exchange all_to_all``), forward only, per
  layer, at the step's capacity ``C`` rows per destination and chunk: ``dispatch`` (the tokens, e4m3 bytes + float32
  scales with FP8 dispatch, else bfloat16, and their ids and weights), ``combine`` (the partial sums in
  ``ep_combine_dtype``), and ``a2a_peak``: a plain ``lax.all_to_all`` of ``peak_mb`` MB per device, the peak the
  exchange is measured against. Sets :data:`EXCHANGE_BYTES`: ``(P-1)/P`` of each buffer leaves the device."""
  P = jax.sharding.PartitionSpec
  mc, n = config.moe, mesh.shape[AXIS]
  chunks = mc.ep_exchange_chunks
  cap = exchange_capacity(mc, t // n // chunks, n)[0]
  rows = n * cap * chunks  # send-buffer rows per device per layer
  k = mc.num_topk
  split = jax.sharding.NamedSharding(mesh, P(AXIS))
  a2a = lambda a: jax.lax.all_to_all(a, AXIS, 0, 0, tiled=True)
  put = lambda shape, dtype: jax.device_put(jnp.ones((n * shape[0], *shape[1:]), dtype), split)
  if mc.fp8_expand:
    tokens = [put((rows, h), jnp.uint8), put((rows, h // 128), jnp.float32)]
  else:
    tokens = [put((rows, h), jnp.bfloat16)]
  meta = [put((rows, k), jnp.int32), put((rows, k), jnp.float32)]
  partial = put((rows, h), jnp.dtype(mc.ep_combine_dtype))
  peak_rows = max(n, int(peak_mb * 2 ** 20) // (2 * h) // n * n)
  peak = put((peak_rows, h), jnp.bfloat16)
  spec = P(AXIS)
  many = lambda f, count: jax.jit(jax.shard_map(lambda *a: [f(b) for b in a], mesh=mesh, in_specs=(spec,) * count,
                                                out_specs=[spec] * count, check_vma=False))
  nbytes = lambda arrays: sum(a.nbytes for a in arrays) // n * (n - 1) // n  # per device, leaving it
  EXCHANGE_BYTES.update(dispatch=nbytes(tokens + meta), combine=nbytes([partial]), a2a_peak=nbytes([peak]))
  return {"dispatch": (many(a2a, 4 if mc.fp8_expand else 3), (*tokens, *meta), config.num_layers),
          "combine": (many(a2a, 1), (partial,), config.num_layers),
          "a2a_peak": (many(a2a, 1), (peak,), 0)}


def collective_components(mesh, params, batch, config: block.BlockConfig, peak_mb: float = 256.0) -> dict:
  """``{name: (fn, args, times)}`` for N > 1 (module docstring): the MoE token exchange's forward + backward (per
  layer; with ``--ep-exchange all_to_all`` its dispatch and combine forward and an ``all_to_all`` peak instead,
  :func:`_all_to_all_components`) and the gradient all-reduce of the replicated params (per step), on ``mesh`` with
  the step's shapes."""
  P = jax.sharding.PartitionSpec
  t, h, k = batch.tokens.size, config.hidden, config.moe.num_topk
  split = jax.sharding.NamedSharding(mesh, P(AXIS))
  x = jax.device_put(jnp.ones((t, h), jnp.bfloat16), split)
  w = jax.device_put(jnp.ones((t, k), jnp.float32), split)
  ids = jax.device_put(jnp.ones((t, k), jnp.float32), split)  # stands in for the int32 ids: same bytes

  def exchange(x, w, ids):  # moe_layer_ep's collectives, on this device's shard
    x_all = jax.lax.all_gather(x, AXIS, axis=0, tiled=True)
    ids_all = jax.lax.all_gather(jax.lax.stop_gradient(ids), AXIS, axis=0, tiled=True)
    w_all = jax.lax.all_gather(w, AXIS, axis=0, tiled=True)
    out = jax.lax.psum_scatter(x_all.astype(jnp.float32), AXIS, scatter_dimension=0, tiled=True)
    return out, w_all + ids_all  # whole: a slice could let XLA gather less

  exchange = jax.shard_map(exchange, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=(P(AXIS), P()),
                           check_vma=False)

  ep = block.ep_params(params, config)
  specs = block.block_param_specs(ep, AXIS)
  flat, spec_flat = jax.tree.leaves(ep), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  replicated = [jax.device_put(jnp.zeros(a.shape, jnp.float32), jax.sharding.NamedSharding(mesh, P()))
                for a, spec in zip(flat, spec_flat) if spec == P()]

  allreduce = jax.jit(jax.shard_map(lambda g: [jax.lax.psum(a, AXIS) for a in g], mesh=mesh,
                                    in_specs=([P()] * len(replicated),), out_specs=[P()] * len(replicated),
                                    check_vma=False))
  out = {"collectives": (_fwd_bwd_partial(exchange, 2), (x, w, ids), config.num_layers)}
  if config.moe.ep_exchange == "all_to_all":
    out = _all_to_all_components(mesh, t, h, config, peak_mb)
  out["grad_allreduce"] = (allreduce, (replicated,), 1)
  return out


def _fwd_bwd_partial(f, num_diff: int):
  """:func:`_fwd_bwd` differentiating only the first ``num_diff`` args."""
  def g(*args):
    out, pullback = jax.vjp(lambda *d: f(*d, *args[num_diff:]), *args[:num_diff])
    return out, pullback(jax.tree.map(jnp.ones_like, out))
  return jax.jit(g)


def with_moe_options(config: block.BlockConfig, ep_capacity_factor: float | None, ep_combine_dtype: str,
                     ep_exchange: str = "all_gather", ep_exchange_chunks: int = 1) -> block.BlockConfig:
  """``config`` with the expert-parallel layer's options of the command line (``--ep-capacity-factor``, unchanged
  when ``None``; ``--ep-combine-dtype``, ``--ep-exchange``, ``--ep-exchange-chunks``), shared with
  :mod:`benchmarks.profile_step`."""
  moe_config = dataclasses.replace(config.moe, ep_combine_dtype=ep_combine_dtype, ep_exchange=ep_exchange,
                                   ep_exchange_chunks=ep_exchange_chunks)
  if ep_capacity_factor is not None:
    moe_config = dataclasses.replace(moe_config, ep_capacity_factor=ep_capacity_factor)
  return dataclasses.replace(config, moe=moe_config)


def step_label(config: block.BlockConfig, tokens: int, fp8_gemm: bool, ep_capacity_factor: float | None,
               grad_reduce_dtype: str, shard_replicated: bool = False, shard_optimizer: bool = False) -> str:
  """The rows' ``shape``: the model's sizes and the options that change the step (also
  :mod:`benchmarks.profile_step`'s, so that both group together)."""
  label = (f"T={tokens} H={config.hidden} L={config.num_layers} E={config.moe.num_experts} "
           f"K={config.moe.num_topk} S={config.moe.num_shared_experts} I={config.intermediate} V={config.vocab_size}")
  label += " fp8_gemm" if fp8_gemm else ""
  if ep_capacity_factor is not None:
    label += f" ep_capacity={ep_capacity_factor:g}"
  if config.moe.ep_combine_dtype != "float32":
    label += f" ep_combine={config.moe.ep_combine_dtype}"
  if config.moe.ep_exchange != "all_gather":
    label += f" ep_exchange={config.moe.ep_exchange}"
  if config.moe.ep_exchange_chunks != 1:
    label += f" ep_chunks={config.moe.ep_exchange_chunks}"
  if grad_reduce_dtype != "float32":
    label += f" grad_reduce={grad_reduce_dtype}"
  if shard_replicated:
    label += " shard_replicated"
  if shard_optimizer:
    label += " shard_optimizer"
  return label


def parse_devices(text: str) -> list[int]:
  """``"1,2"`` -> ``[1, 2]``; ``""`` / ``"0"`` -> ``[]`` (no mesh)."""
  counts = [int(c) for c in text.replace(" ", "").split(",") if c]
  if any(c < 0 for c in counts):
    raise SystemExit(f"--devices {text}: counts must be positive")
  return list(dict.fromkeys(c for c in counts if c))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="a tiny model (seconds on a CPU)")
  parser.add_argument("--config", choices=sorted(CONFIGS), default="gpu",
                      help="the model size off --small: gpu (default, H 2048, 4 layers) or v3 (H 7168, E8 top-4, 1 layer)")
  parser.add_argument("--devices", default="",
                      help="device counts, e.g. 1,2: the step under a mesh of each count, same global batch")
  parser.add_argument("--check", action="store_true",
                      help="compare loss and gradients of each N > 1 against one device first (exit 1 if off)")
  parser.add_argument("--check-rtol", type=float, default=5e-2)
  parser.add_argument("--check-loss-rtol", type=float, default=1e-3)
  parser.add_argument("--iterations", type=int, default=None, help="timed steps (median); default 20, --small 2")
  parser.add_argument("--implementations", default="auto,xla")
  parser.add_argument("--no-split", action="store_true", help="time the whole step only")
  parser.add_argument("--experts", type=int, default=None, help="override the config's routed experts")
  parser.add_argument("--topk", type=int, default=None, help="override the config's top-k")
  parser.add_argument("--layers", type=int, default=None, help="override the config's layers")
  parser.add_argument("--batch", type=int, default=None,
                      help="override the config's global batch (sequences of its length; v3: 4 x 2048 tokens)")
  parser.add_argument("--memory", action="store_true",
                      help="print the unsharded step's compiled memory estimate (GiB) for this backend and exit")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--ep-capacity-factor", type=float, default=None,
                      help="MoeConfig.ep_capacity_factor of the expert-parallel layer (N > 1): fused rows per device "
                           "for this many times the mean routed slots, the worst case as the exact fallback; 0 = "
                           "always the worst case; default the config's (off; 1.25 recommended)")
  parser.add_argument("--ep-combine-dtype", choices=EP_COMBINE_DTYPES, default="float32",
                      help="MoeConfig.ep_combine_dtype (N > 1): the dtype of the routed partial sums the expert-parallel "
                           "layer adds over the devices (bfloat16: half the bytes, no float32 copy of the fused rows)")
  parser.add_argument("--ep-exchange", choices=EP_EXCHANGES, default="all_gather",
                      help="MoeConfig.ep_exchange (N > 1): all_gather (every token to every device) or all_to_all "
                           "(each token once to each device holding one of its experts, static per-destination "
                           "capacity from --ep-capacity-factor, exact fallback)")
  parser.add_argument("--ep-exchange-chunks", type=int, default=1,
                      help="MoeConfig.ep_exchange_chunks (with --ep-exchange all_to_all): exchange and compute the "
                           "tokens in this many chunks, so that XLA can overlap one chunk's exchange with another's "
                           "experts")
  parser.add_argument("--a2a-peak-mb", type=float, default=256.0,
                      help="N > 1, with the split: MB per device of the plain lax.all_to_all timed as the exchange's "
                           "peak (the a2a_peak row)")
  parser.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="N > 1: the dtype the replicated params' gradients are all-reduced in (bfloat16: half the "
                           "bytes, each device's gradient rounded to bfloat16 first)")
  parser.add_argument("--shard-replicated", action="store_true",
                      help="N > 1: store the replicated params (and their Adam state) split over the devices, "
                           "all-gathered for the loss, gradients reduce-scattered (ZeRO/FSDP-style)")
  parser.add_argument("--shard-optimizer", action="store_true",
                      help="N > 1: the replicated params whole, their Adam state and update split over the devices, "
                           "gradients reduce-scattered, updated params all-gathered (ZeRO-1/2-style)")
  parser.add_argument("--fp8-gemm", action="store_true",
                      help="expert matmuls in FP8 (BlockConfig(fp8_gemm=True): fp8_grouped_linear, alignment 128)")
  parser.add_argument("--batch-multiple", type=int, default=None, help=argparse.SUPPRESS)  # counts_in_processes
  args = parser.parse_args(argv)
  if args.shard_optimizer and args.shard_replicated:
    parser.error("--shard-optimizer and --shard-replicated: give one (--shard-replicated splits the Adam state too)")
  counts = parse_devices(args.devices)
  if len(counts) > 1 and not args.small and not args.memory:
    return counts_in_processes(sys.argv[1:] if argv is None else list(argv), counts, check=args.check, out=args.out)
  config, batch_size, seq_len = small_config() if args.small else CONFIGS[args.config]()
  batch_size = args.batch or batch_size
  config = dataclasses.replace(
      config, num_layers=args.layers or config.num_layers,
      moe=dataclasses.replace(config.moe, num_experts=args.experts or config.moe.num_experts,
                              num_topk=args.topk or config.moe.num_topk))
  config = with_moe_options(config, args.ep_capacity_factor, args.ep_combine_dtype, args.ep_exchange,
                            args.ep_exchange_chunks)
  if args.fp8_gemm:
    config = dataclasses.replace(config, fp8_gemm=True)
  if args.memory:
    for impl in args.implementations.split(","):
      m = memory_estimate(config, batch_size, seq_len, impl)
      print(f"memory {impl}: " + ", ".join(f"{k} {v / 2 ** 30:.2f} GiB" for k, v in m.items()))
    return 0
  iterations = args.iterations or (2 if args.small else 20)
  if counts and max(counts) > len(jax.devices()):
    print(f"--devices {args.devices}: only {len(jax.devices())} devices here", file=sys.stderr)
    raise SystemExit(2)
  uneven = [n for n in counts if config.moe.num_experts % n]
  if uneven:  # the routed experts are split over the devices
    parser.error(f"--devices {args.devices}: {config.moe.num_experts} routed experts do not split over {uneven[0]} "
                 f"devices (give --experts, a multiple of every count)")
  if counts:  # the sharded step splits the batch's sequences over the devices: one global batch for all counts
    multiple = args.batch_multiple or max(counts)
    batch_size = -(-batch_size // multiple) * multiple
  device = jax.devices()[0].device_kind.replace(" ", "-")
  if jax.default_backend() != "gpu" and not args.small:
    print("No GPU found: the H100-sized model would run the references on the CPU; use --small", file=sys.stderr)
    return 2
  params = block.init_block_params(jax.random.key(0), config)
  batch = block.synthetic_batch(np.random.default_rng(0), batch=batch_size, seq_len=seq_len,
                                vocab_size=config.vocab_size)
  tokens = batch.tokens.size
  optimizer = optax.adamw(1e-3)
  label = step_label(config, tokens, args.fp8_gemm, args.ep_capacity_factor, args.grad_reduce_dtype,
                     bool(args.shard_replicated), bool(args.shard_optimizer))
  grad_reduce_dtype = None if args.grad_reduce_dtype == "float32" else jnp.dtype(args.grad_reduce_dtype)
  print(f"{device}, jax {jax.__version__}: {label}, devices={args.devices or 'no mesh'}")
  rows, failed = [], False
  stamp = datetime.datetime.now(datetime.timezone.utc)
  for impl in args.implementations.split(","):
    if args.check:
      for n in counts:
        if n > 1:
          print(capacity_report(params, batch, config, impl, n), flush=True)
          ok, report = check_devices(params, batch, config, impl, n, rtol=args.check_rtol,
                                     loss_rtol=args.check_loss_rtol, grad_reduce_dtype=grad_reduce_dtype,
                                     shard_replicated=args.shard_replicated,
                                     shard_optimizer=args.shard_optimizer)
          print(report, flush=True)
          failed |= not ok
    for n in counts or [0]:
      step, place = _mesh_step(n, config, optimizer, impl, grad_reduce_dtype, args.shard_replicated,
                               args.shard_optimizer)
      p, b = place(params), place(batch)
      # shaped and placed like the (possibly expert-parallel) params, its step count too: chained steps compile once
      opt_state = init_state(optimizer, p, n, args.shard_optimizer)
      t0 = time.perf_counter()
      jax.block_until_ready(step(p, opt_state, b))
      first_call_s = time.perf_counter() - t0  # compilation and one step
      # the whole result: the CUPTI time jits what it is given, and a function returning only the loss would let
      # XLA drop the backward and the update (measured: 10.4 of the whole step's 34.7 ms on an H200, the v3 step,
      # 2026-11-27)
      timed = time_ms(step, p, opt_state, b, iterations=iterations, device_time=n <= 1)
      loss = float(step(p, opt_state, b).loss)
      timed["pipelined_ms"] = pipelined_ms(step, p, opt_state, b, iterations=iterations)
      rows.append(dict(component="step", implementation=impl, devices=n, times=1, loss=loss,
                       tokens_per_s=tokens / (1e-3 * timed["wall_ms"]), first_call_s=first_call_s, **timed))
      print(f"step {impl} devices={n}: {timed['wall_ms']:.2f} ms wall, {timed['pipelined_ms']:.2f} ms pipelined, "
            f"loss {loss:.6f}, first call {first_call_s:.1f} s", flush=True)
      del p, b, opt_state, step
      if args.no_split:
        continue
      if n <= 1:
        parts = components(params, batch, config, impl)
      else:
        parts = collective_components(make_mesh(n), params, batch, config, peak_mb=args.a2a_peak_mb)
      for name, (fn, fargs, times) in parts.items():
        row = dict(component=name, implementation=impl, devices=n, times=times,
                   **time_ms(fn, *fargs, iterations=iterations, device_time=n <= 1))
        sent = EXCHANGE_BYTES.get(name)
        if sent:  # the exchange's bandwidth as DeepEP reports it: bytes a device sends to the others, per second
          row.update(bytes_sent=sent, gb_per_s=sent / (1e-3 * row["wall_ms"]) / 1e9)
          print(f"{name} devices={n}: {row['wall_ms']:.3f} ms, {sent / 1e6:.3f} MB sent per device, "
                f"{row['gb_per_s']:.1f} GB/s", flush=True)
        rows.append(row)
  add_scaling(rows)
  for r in rows:
    r.update(ep_capacity_factor=config.moe.ep_capacity_factor)
    r.update(xla_flags=os.environ.get("XLA_FLAGS", ""))  # e.g. the latency-hiding scheduler's: part of the setup
    r.update(date=stamp.date().isoformat(), time=stamp.strftime("%H:%M:%S"), gpu=device, jax=jax.__version__,
             shape=label, iterations=iterations, bench="train_step", config="small" if args.small else args.config)
  for n in dict.fromkeys(r["devices"] for r in rows):
    if len(counts) > 1 or n > 1:
      print(f"\n{n} device{'s' if n != 1 else ''}:")
    print(table([r for r in rows if r["devices"] == n]))
  if len(counts) > 1:
    print("\n" + scaling_table(rows))
  out = args.out or RESULTS / f"{stamp.date().isoformat()}_{device}.jsonl"
  out.parent.mkdir(parents=True, exist_ok=True)
  with out.open("a") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  print(f"{len(rows)} rows appended to {out}")
  if failed:
    print("--check FAILED (see above)", file=sys.stderr)
    return 1
  return 0


COMMUNICATION = ("collectives", "dispatch", "combine", "grad_allreduce")  # a2a_peak: a reference, not the step's


def add_scaling(rows) -> None:
  """Sets ``scaling_efficiency`` (wall-clock) and ``scaling_efficiency_pipelined`` of the N > 1 step rows that have a
  one-device step row of the same implementation."""
  for impl in dict.fromkeys(r["implementation"] for r in rows):
    steps = {r["devices"]: r for r in rows if r["component"] == "step" and r["implementation"] == impl}
    if 1 in steps:
      for n, r in steps.items():
        if n > 1:
          r["scaling_efficiency"] = steps[1]["wall_ms"] / (n * r["wall_ms"])
          r["scaling_efficiency_pipelined"] = steps[1]["pipelined_ms"] / (n * r["pipelined_ms"])


def _without_flags(argv, flags) -> list[str]:
  """``argv`` without the options ``flags`` (``--flag value``, ``--flag=value``; ``--check`` takes no value)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=", 1)[0]
    if name in flags:
      skip = "=" not in a and name != "--check"
      continue
    out.append(a)
  return out


def counts_in_processes(argv, counts, *, check: bool, out: pathlib.Path | None) -> int:
  """``--devices`` with several counts off ``--small``: each count's step in a process of its own (this module,
  ``--devices N``, the same global batch), then the scaling table of their rows. In one process a CUPTI-timed
  one-GPU step followed by the 2-GPU step crashed (segmentation fault) or hung (4 H200s, 2026-11-27, twice); each
  count alone ran. ``--check`` goes to the counts N > 1 (one against N devices inside that process)."""
  rest = _without_flags(argv, ("--devices", "--out", "--check", "--batch-multiple"))
  rows, status = [], 0
  with tempfile.TemporaryDirectory() as tmp:
    for n in counts:
      path = pathlib.Path(tmp) / f"{n}.jsonl"
      cmd = [sys.executable, "-m", "benchmarks.train_step", *rest, "--devices", str(n),
             "--batch-multiple", str(max(counts)), "--out", str(path)] + (["--check"] if check and n > 1 else [])
      print("$", " ".join(cmd[1:]), flush=True)
      code = subprocess.run(cmd, cwd=pathlib.Path(__file__).parent.parent).returncode
      status = status or code
      if path.exists():
        rows += [json.loads(line) for line in path.read_text().splitlines()]
  add_scaling(rows)
  if rows:
    print("\n" + scaling_table(rows))
    out = out or RESULTS / f"{rows[0]['date']}_{rows[0]['gpu']}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} rows appended to {out}")
  return 1 if status else 0


def scaling_table(rows) -> str:
  """Markdown: per implementation and device count the step (wall-clock ms), tokens/s and the strong-scaling
  efficiency ``t(1) / (N t(N))`` (same global batch), and the communication's share where timed."""
  lines = ["| implementation | devices | step ms (wall) | tokens/s | scaling efficiency (strong, same global batch) "
           "| pipelined step ms | pipelined efficiency | communication ms (% of step) |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["component"] != "step":
      continue
    comm = [c["wall_ms"] * c["times"] for c in rows if c["component"] in COMMUNICATION
            and c["devices"] == r["devices"] and c["implementation"] == r["implementation"]]
    eff = f"{100 * r['scaling_efficiency']:.1f}%" if "scaling_efficiency" in r else "—"
    comm_cell = f"{sum(comm):.2f} ({100 * sum(comm) / r['wall_ms']:.0f}%)" if comm else "—"
    piped = f"{r['pipelined_ms']:.2f}" if "pipelined_ms" in r else "—"
    piped_eff = (f"{100 * r['scaling_efficiency_pipelined']:.1f}%" if "scaling_efficiency_pipelined" in r
                 else "—")
    lines.append(f"| {r['implementation']} | {r['devices']} | {r['wall_ms']:.2f} | {r['tokens_per_s']:.0f} | {eff} "
                 f"| {piped} | {piped_eff} | {comm_cell} |")
  return "\n".join(lines)


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
