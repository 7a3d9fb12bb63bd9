"""Data and expert parallelism for the MoE layer and a training step, with ``jax.shard_map`` around the kernels.

**Expert-parallel MoE layer** (:func:`moe_layer_ep`, the function of :func:`jaxkern.modeling.moe_layer`), run
inside ``jax.shard_map`` over a mesh axis ``mesh_axis`` of ``P`` devices. What each device holds:

* tokens: ``T / P`` rows of ``x`` (sharded over tokens, ``PartitionSpec(axis)`` on dim 0);
* routed experts: ``E / P`` consecutive experts of ``w_gate``, ``w_up``, ``w_down`` (device ``r`` holds experts
  ``[r E/P, (r+1) E/P)``; ``PartitionSpec(axis)`` on dim 0; ``E % P == 0``);
* shared experts: replicated. Every token uses them, so each device runs them on its own tokens: no exchange.
  They live in :class:`MoeEpParams` (``shared_gate``, ``shared_up``, ``shared_down``, ``(S, H, I)``), apart
  from the routed ones, because a ``PartitionSpec`` shards a whole array: the ``(E+S, H, I)`` arrays of
  :class:`~jaxkern.modeling.MoeParams` cannot be split over experts and replicated over shared experts at
  once. (Upstream's alternative, shared experts as physical experts ``E..E+S-1`` placed on EP ranks through
  ``top2_sum_gate``'s ``R = (E+X) / num_ep_ranks``, puts all shared-expert work of all tokens on the last ranks,
  and needs ``(E+S) % P == 0``, impossible for ``P = 4, 8`` with ``E % 4 == 0``, ``S`` in 1..2.)
  :func:`split_shared_experts` / :func:`merge_shared_experts` convert; with ``S = 0`` a plain
  :class:`~jaxkern.modeling.MoeParams` works too;
* router weights and bias: replicated.

The all-gather scheme, per device ``r`` (collectives over ``mesh_axis`` only):

1. route the local tokens (:func:`jaxkern.modeling.route_tokens`, router replicated): ``(T/P, K+S)`` ids/weights;
2. ``all_gather`` the tokens ``(T/P, H) -> (T, H)`` and their routed ids/weights ``(T/P, K) -> (T, K)``; with
   ``config.fp8_expand`` (FP8 dispatch) the tokens are first cast on their own device
   (:func:`jaxkern.modeling.moe.fp8_expand_cast`: :func:`jaxkern.quant.per_token_cast`, e4m3, one float32 scale
   per 128 columns) and the all-gather moves the FP8 data ``(T/P, H) -> (T, H)`` and the scales ``(T/P, H/128) ->
   (T, H/128)``: the scales are per token, so the gathered cast is the cast of the gathered tokens, bit for bit;
3. :func:`jaxkern.moe.mask_indices_by_tp` with ``n = E``, ``num_ep_ranks = num_tp_ranks = P`` and
   ``tp_rank = r`` (upstream's EP/TP masking, docs/moe.md, "top2_sum_gate": the TP rank keeps the experts of
   the EP ranks ``q`` with ``q % P == r``, i.e. only ``q = r``) keeps the slots of this device's experts,
   renumbered ``0..E/P-1``, and sets the others to -1;
4. the routed experts of this device on all tokens: :func:`jaxkern.moe.get_fused_mapping`,
   :func:`jaxkern.moe.expand_to_fused` (with ``config.fp8_expand``: :func:`jaxkern.modeling.moe.expand_fp8_quantized`
   of the gathered FP8 tokens, i.e. :func:`jaxkern.moe.expand_to_fused_with_sf` and
   :func:`jaxkern.quant.per_token_cast_back`, the second half of :func:`jaxkern.modeling.expand_fp8`), the SwiGLU
   grouped matmuls, :func:`jaxkern.moe.reduce_fused` in float32 (unused slots add nothing): a ``(T, H)`` partial
   sum, float32 or, with ``MoeConfig.ep_combine_dtype="bfloat16"``, rounded to bfloat16; the fused rows are the
   capacity's where every device's slots fit it, else the worst case's (below);
5. ``psum_scatter`` the partial sums back to the token shards: ``(T, H) -> (T/P, H)``, summed over devices (in
   ``ep_combine_dtype``);
6. the shared experts on the local tokens (the same four ops over ``S`` experts), added; one rounding to
   ``x.dtype``.

Equal to the unsharded layer up to the order of the float32 sums of one token's slots (the routed slots of
each device are summed on that device, then the devices' partials, then the shared slots) and, with
bfloat16 experts, the rounding of the routed partials (float32 by default, one bfloat16 rounding at the end; with
``ep_combine_dtype="bfloat16"`` each device's partial and the exchange's sums are rounded to bfloat16 too).
Gradients: ``jax.grad`` differentiates through the collectives (the transpose of ``all_gather`` is
``psum_scatter`` and vice versa); replicated params get their gradients summed over the devices of every
mesh axis they are replicated over (``jax.shard_map``'s default ``check_vma=True`` inserts the sums; with
``check_vma=False`` :func:`sharded_value_and_grad` adds them), sharded expert weights get the gradient of their
own experts from every device's tokens. Routing gradients flow into the router as in the unsharded layer (the
routing weights are all-gathered like the tokens). FP8 dispatch: the FP8 arrays have no gradient (``expand_fp8``'s
backward is straight-through anyway); the tokens' gradient comes through a ``jax.custom_vjp`` anchor, zeros of the
gathered tokens' type that nothing reads (XLA drops them), whose backward is the ``psum_scatter`` (the all-gather's
transpose) of the slot sums of the fused rows' cotangent: the same gradient as before, bit for bit. In the capacity
path the anchor does not enter the conds; each branch differentiates against zeros of its own.

Kernels under ``shard_map``: with ``check_vma=True``, ``pallas_call`` requires a ``manual_axis_type`` on every
output ``ShapeDtypeStruct`` (``ValueError: When `check_vma=True` on `jax.shard_map`, `manual_axis_type` on
`jax.ShapeDtypeStruct` must not be `None```), which jaxkern's kernels do not set: run the Pallas kernels (and
interpret mode) under ``check_vma=False``; the ``jnp`` references run under either. ``custom_vjp`` ops that mix
replicated and sharded inputs cast them to one varying type first (:func:`jaxkern._autodiff.vary_like`, done
in ``top2_sum_gate``, the grouped matmul, ``reduce_fused``, the FP8 ``swiglu``, the Engram gate and the mHC ops:
``pre_norm_fn``, ``pre_split_mixes``, ``head_compute_mix``, ``pre_apply_mix``, ``post``, ``mhc_pre``, ``mhc_block``). In Pallas' interpreter on several simulated CPU devices,
``expand_to_fused`` (Mosaic GPU) fails (``AssertionError: Barrier remains allocated at key
HostAllocationKey(...)``); ``top2_sum_gate``, ``mask_indices_by_tp``, ``reduce_fused`` and ``swiglu`` run.

**Capacity** (``MoeConfig.ep_capacity_factor``, off by default, recommended
:data:`jaxkern.modeling.moe.EP_CAPACITY_FACTOR` = 1.25;
:func:`ep_fused_rows`). The fused layout of step 4 has a static row count. Sized for the worst case, ``T·min(K,
E/P)`` slots on one device (routing may send every token to one device's experts) plus the alignment padding of
``E/P`` segments, it is as large on each of ``P`` devices as on one GPU for ``K >= E/P`` (e.g. ``K = 4``, ``E/P =
4``), although on average a device gets ``T·K/P`` slots. The FP8 GEMMs skip the unused 128-row blocks, but every op
that walks all fused rows (the expand, the casts, the SwiGLU, the float32 cast before ``reduce_fused``, their
backward passes, the per-channel cast for the weight gradient, the zero padding) would cost each device what it
costs one GPU. So the layer sizes the rows for ``rows = round_up(ceil(f·T·K/P) + (a-1)·E/P, a)`` (``f`` the
factor, ``a`` the alignment; at most the worst case) and runs that layout when every device's need fits: after the
all-gather of the routed ids every device sees every token's experts, so each computes every device's need
(:func:`device_rows_needed`: the sum over its experts of the slot counts rounded up to ``a``, the rows
``get_fused_mapping`` uses) and their maximum, the same predicate on every device, without a collective. Otherwise
it runs the worst-case layout: an exact fallback, no token is dropped. Both compute the same function: within the
used rows the layout is the same (segments start at the same offsets), the rows past the last segment are unused
(-1 in the maps, zero rows, -1 blocks for the FP8 GEMMs), and the casts and GEMMs work per row / per 128-row block,
so the results are bit-equal where each op's arithmetic does not depend on the row count (on a CPU, tested; a GPU
GEMM whose algorithm is chosen per shape, e.g. XLA's for ``ragged_dot``, may round differently). The collectives stay outside the branch (the all-gathers
before, the ``psum_scatter`` after). ``f = None`` or 0: always the worst case.

The branch is a ``jax.custom_vjp`` whose forward and backward each run one ``lax.cond`` (not a plain ``lax.cond``:
JAX's partial evaluation of a cond under ``jax.grad`` returns the union of both branches' residuals, the untaken
branch's filled with zeros, so every fast step would write zero-filled worst-case-sized residuals and keep them to
the backward, eating much of the saving). The fast branch saves exactly the residuals of plain autodiff of the
capacity layout (the leaves of its ``jax.vjp`` pullback; inputs among them are not copied through the cond); the
fallback saves nothing (it returns zeros of the fast residuals' capacity-sized types) and its backward recomputes
its forward before pulling back: an extra forward pass, only in steps that need the fallback. On a GPU each cond
reads its predicate on the host (XLA copies it back to choose the branch): two small synchronisations per layer
and step.

Memory and bandwidth, per device and layer (``B`` = bytes of an ``x`` element): the all-gather receives
``(P-1)/P * T * H * B`` bytes and holds the ``(T, H)`` gathered tokens (with ``config.fp8_expand``: ``(P-1)/P * T *
(H + 4 H/128)`` bytes, the FP8 data and float32 scales, 0.52 of bfloat16's, and holds those; each device casts its
``T/P`` tokens instead of all ``T``), and the ``psum_scatter`` moves
``(P-1)/P * T * H * 4`` bytes of float32 partials (twice the bfloat16 volume; the price of one rounding; the
backward all-gathers float32 cotangents of the same size), whatever the routing. ``ep_combine_dtype="bfloat16"``
halves both and drops the float32 copy of the fused rows (written before ``reduce_fused``, and its transpose in the
backward): on 2 H200s it took 0.9 ms off the v3 step (22.23 against 23.12 ms pipelined, same run; 2026-11-27,
``benchmarks/NOTES.md``). The fused rows, and the residuals kept from the forward to the backward, are
capacity-sized on the fast path (0.63 of the worst case for the v3 benchmark's ``K = 4``, ``E/P = 4``, ``P = 2``:
20992 rows against 33280 for 8192 tokens); the fallback's worst-case-sized temporaries live only inside its
branches (XLA still reserves them).

**All-to-all exchange** (``MoeConfig.ep_exchange="all_to_all"``, :mod:`jaxkern.modeling._ep_exchange`): in place of
steps 2-5, each device sends each of its tokens once to each device that holds at least one of the token's experts
(FP8 rows and scales with ``fp8_expand``, with the token's routed ids and weights), in per-destination buffers of a
static capacity (from ``ep_capacity_factor``; the worst case, every token to every device, as the exact fallback in
the same ``custom_vjp`` / ``lax.cond`` scheme as above, here with the exchange inside the branches), runs its experts
on the received rows (steps 3-4 on ``P C`` rows instead of ``T``), and returns each row's routing-weighted partial sum
by the transposed ``all_to_all``, where the sender adds a token's partials (``reduce_fused``). The per-device partial
sums are those of the all-gather scheme; their sum over devices is taken in another order. Bytes per device and
layer: ``(P-1) C`` rows each way against the all-gather's ``(P-1) T/P``, a saving only where a token's experts miss
some devices (``P`` larger than ``K``, or ``E/P`` small against ``K``); ``ep_exchange_chunks`` splits it into chunks
that XLA may overlap with the experts.

**Sharded training step** (:func:`sharded_value_and_grad`, :func:`make_sharded_train_step`): the loss, its
gradients and the optimiser update of a params pytree under a :class:`jax.sharding.Mesh`; the loss and its
gradients run under one ``jax.shard_map`` (batch sharded over tokens, expert weights over experts, everything
else replicated, as given by ``param_specs``), the optimiser update outside it under ``jax.jit`` (elementwise,
so XLA keeps the params' shardings). The loss is the mean of the per-device losses (``pmean``), which equals
the unsharded loss when ``loss_fn`` is a mean over equally sized token shards.

**Sharded storage of the replicated params** (``shard_replicated=axis``, off by default; ZeRO/FSDP-style): params
whose spec is ``PartitionSpec()`` keep a full copy on every device, so their Adam update and the casts around their
gradient all-reduce cost every device what they cost one. With ``shard_replicated`` every such param whose dim 0 is a
multiple of the size of ``axis`` (one of the batch axes) is *stored* split over ``axis`` on dim 0
(:func:`storage_specs`), its optimiser state too (:func:`init_optimizer_state` on the placed params). Inside the
``shard_map`` each is all-gathered over ``axis`` before ``loss_fn`` sees it, through a ``jax.custom_vjp`` whose
backward is the reduce-scatter of the cotangent over ``axis`` (in ``grad_reduce_dtype`` if given), then the ``psum``
over the other batch axes: each device gets the summed gradient of its shard only, and the optimiser outside the
``shard_map`` updates shards (elementwise: XLA keeps the shardings; the step returns params in storage layout).
Per device and step: an all-gather of the params (``(P-1)/P`` of their bytes) in place of nothing, and a
reduce-scatter in place of the all-reduce (half its bytes); the update, the optimiser state and the cast back from
``grad_reduce_dtype`` shrink to ``1/P`` (the cast to it, before the reduce-scatter, stays whole), and the gathered
params live only inside the step (kept as residuals for the backward, as the stored copies were). The gathered params
are the same values, so the loss and gradients equal those of the replicated storage up to the order of the
gradient sums (with ``grad_reduce_dtype``, the reduce-scatter's roundings in place of the all-reduce's).

**Sharded optimiser state of the replicated params** (``shard_optimizer=axis``, off by default; ZeRO-1/2-style): the
replicated params stay whole on every device (no all-gather before the loss), but the gradient of each one
:func:`storage_specs` would split is reduce-scattered over ``axis`` instead of all-reduced (in ``grad_reduce_dtype``
if given; half the bytes), cast back and updated on each device's ``1/P`` slice only, with optimiser state of that
slice (:func:`init_optimizer_state` with ``shard_over=axis``); the step then all-gathers the updated slices (float32:
``(P-1)/P`` of their bytes) at its end, where XLA can run the gather beside the routed experts' own update. Against
``shard_replicated``, the gather sits after the step's compute instead of before it (where the embedding waits for
it). Same values as the replicated step: the update is elementwise, and the gradient sums differ only in order (for
``P = 2``, not at all). On 2 H200s (the v3 benchmark step, 2026-11-27, ``benchmarks/NOTES.md``): 0.15-0.6 ms off the
blocked step, the pipelined step unchanged (the gather, 2.6 ms of NCCL time, is 75-81% overlapped and slows the
kernels under it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkern import moe
from jaxkern._autodiff import vary_like
from jaxkern.modeling._ep_exchange import all_to_all_experts, fast_or_fallback, zeros_of_type
from jaxkern.modeling._optimizer import apply_updates
from jaxkern.modeling.moe import (FP8_EXPAND_GROUP, MoeConfig, MoeParams, _group_sizes, expand_fp8,
                                  expand_fp8_quantized, fp8_expand_cast, fused_block_experts, route_tokens,
                                  swiglu_experts)
from jaxkern.types import QuantTensor


class MoeEpParams(NamedTuple):
  """:class:`~jaxkern.modeling.MoeParams` with the shared experts apart from the routed ones (see the module
  docstring): the routed experts can then be sharded over experts and the shared ones replicated."""

  router: jax.Array  # (H, E) float32, replicated
  router_bias: jax.Array  # (E,) float32, replicated (a buffer: zero gradient)
  w_gate: jax.Array  # (E, H, I) routed experts, sharded over experts
  w_up: jax.Array  # (E, H, I)
  w_down: jax.Array  # (E, I, H)
  shared_gate: jax.Array  # (S, H, I) shared experts, replicated
  shared_up: jax.Array  # (S, H, I)
  shared_down: jax.Array  # (S, I, H)


def split_shared_experts(params: MoeParams, config: MoeConfig) -> MoeEpParams:
  """:class:`MoeEpParams` of ``params``: experts ``0..E-1`` routed, ``E..E+S-1`` shared."""
  e = config.num_experts
  return MoeEpParams(params.router, params.router_bias, params.w_gate[:e], params.w_up[:e], params.w_down[:e],
                     params.w_gate[e:], params.w_up[e:], params.w_down[e:])


def merge_shared_experts(params: MoeEpParams) -> MoeParams:
  """The :class:`~jaxkern.modeling.MoeParams` of ``params`` (also of its gradients): the inverse of
  :func:`split_shared_experts`."""
  cat = lambda a, b: jnp.concatenate([a, b], axis=0)
  return MoeParams(params.router, params.router_bias, cat(params.w_gate, params.shared_gate),
                   cat(params.w_up, params.shared_up), cat(params.w_down, params.shared_down))


def moe_param_specs(params: MoeParams | MoeEpParams, expert_axis: str | None) -> MoeParams | MoeEpParams:
  """``PartitionSpec`` s of :func:`moe_layer_ep`'s params: routed experts ``PartitionSpec(expert_axis)`` on
  dim 0, everything else replicated (``expert_axis=None``: everything replicated, e.g. for pure data
  parallelism with :func:`jaxkern.modeling.moe_layer`)."""
  rep, split = PartitionSpec(), PartitionSpec(expert_axis)
  if isinstance(params, MoeEpParams):
    return MoeEpParams(rep, rep, split, split, split, rep, rep, rep)
  return MoeParams(rep, rep, split, split, split)


def _axis_size(axis: str) -> int:
  return lax.axis_size(axis)


def moe_layer_ep(params: MoeParams | MoeEpParams, x: jax.Array, *, config: MoeConfig, mesh_axis: str,
                 implementation: str | None = None) -> jax.Array:
  """The expert-parallel MoE layer on this device's shard (call inside ``jax.shard_map``).

  Computes :func:`jaxkern.modeling.moe_layer` of the full token batch, sharded over ``mesh_axis`` (module
  docstring: the scheme, its collectives, its cost).

  Args:
    params: this device's :class:`MoeEpParams` (``w_gate``, ``w_up`` ``(E/P, H, I)``, ``w_down``
      ``(E/P, I, H)``: this device's routed experts; router and shared experts whole), or, with
      ``config.num_shared_experts == 0``, a :class:`~jaxkern.modeling.MoeParams` of the same local shapes.
      Shard with :func:`moe_param_specs`.
    x: ``(T/P, H)`` float32 or bfloat16 tokens of this device (the experts' dtype), ``H`` a multiple of 256.
    config: :class:`~jaxkern.modeling.MoeConfig` of the whole layer (``E = config.num_experts``, a multiple
      of ``P``); ``config.ep_capacity_factor`` sizes this device's fused rows, with the worst case as the exact
      fallback (module docstring, "Capacity"); ``config.ep_exchange`` picks the exchange (module docstring,
      "All-to-all exchange").
    mesh_axis: the mesh axis (name) of size ``P`` that splits the tokens and the routed experts; other mesh
      axes of an enclosing ``shard_map`` are independent replicas of this exchange (e.g. data parallelism).
    implementation: passed to every :mod:`jaxkern.moe` op and to :func:`jaxkern.modeling.swiglu`.

  Returns:
    ``(T/P, H)`` of ``x.dtype``: this device's tokens' outputs.

  Raises:
    ValueError: ``E`` not a multiple of ``P``, local expert weights not holding ``E/P`` experts, shared
      experts with a :class:`~jaxkern.modeling.MoeParams`, or their count not ``S``.
  """
  num_ranks = _axis_size(mesh_axis)
  e, k, s = config.num_experts, config.num_topk, config.num_shared_experts
  if e % num_ranks:
    raise ValueError(f"config.num_experts={e} must be a multiple of the size {num_ranks} of mesh axis {mesh_axis!r}")
  local_e = e // num_ranks
  if s and not isinstance(params, MoeEpParams):
    raise ValueError("params: with shared experts, pass MoeEpParams (see split_shared_experts)")
  if params.w_gate.shape[0] != local_e:
    raise ValueError(f"params.w_gate holds {params.w_gate.shape[0]} experts on this device; expected "
                     f"E/P = {local_e} (shard the routed experts with moe_param_specs)")
  if isinstance(params, MoeEpParams):
    if params.shared_gate.shape[0] != s:
      raise ValueError(f"params.shared_gate holds {params.shared_gate.shape[0]} experts; expected "
                       f"config.num_shared_experts={s}")
    shared = MoeParams(params.router, params.router_bias, params.shared_gate, params.shared_up, params.shared_down)
  routed = MoeParams(params.router, params.router_bias, params.w_gate, params.w_up, params.w_down)
  kw = dict(implementation=implementation)

  routing = route_tokens(params, x, config=config, **kw)  # (T/P, K+S): routed slots, then shared ids E..E+S-1
  if config.ep_exchange == "all_to_all":
    out = _all_to_all_routed(routed, x, routing, config=config, mesh_axis=mesh_axis, num_ranks=num_ranks, kw=kw)
  else:
    out = _all_gather_routed(routed, x, routing, config=config, mesh_axis=mesh_axis, num_ranks=num_ranks, kw=kw)
  out = out.astype(jnp.float32)
  a = config.alignment
  if s:
    shared_idx = routing.topk_idx[:, k:] - e  # 0..S-1
    rows = _round_up(x.shape[0] * s + (a - 1) * s, a)
    out = out + _experts_sum(shared, x, shared_idx, routing.topk_weights[:, k:], s, rows, config, kw)
  return out.astype(x.dtype)


def _all_to_all_routed(routed: MoeParams, x: jax.Array, routing, *, config: MoeConfig, mesh_axis: str,
                       num_ranks: int, kw: dict) -> jax.Array:
  """``(T/P, H)`` of ``config.ep_combine_dtype``: the routed experts' output of this device's tokens through the
  all-to-all exchange (:mod:`jaxkern.modeling._ep_exchange`; ``config.ep_exchange="all_to_all"``)."""
  k = config.num_topk
  x_fp8 = None
  if config.fp8_expand:
    if x.ndim != 2 or x.shape[1] % FP8_EXPAND_GROUP:
      raise ValueError(f"x must be (T/P, H) with H % {FP8_EXPAND_GROUP} == 0 for the FP8 expand, got {tuple(x.shape)}")
    x_fp8 = fp8_expand_cast(lax.stop_gradient(x), **kw)  # the gradient flows through the exchange's anchor
  return all_to_all_experts(routed, x, routing.topk_idx[:, :k], routing.topk_weights[:, :k], x_fp8, config=config,
                            axis=mesh_axis, num_ranks=num_ranks, fused_rows=ep_fused_rows, kw=kw,
                            experts_sum=_experts_sum)


def _all_gather_routed(routed: MoeParams, x: jax.Array, routing, *, config: MoeConfig, mesh_axis: str,
                       num_ranks: int, kw: dict) -> jax.Array:
  """``(T/P, H)`` of ``config.ep_combine_dtype``: the routed experts' output of this device's tokens through the
  all-gather exchange (module docstring, steps 2-5)."""
  e, k = config.num_experts, config.num_topk
  local_e = e // num_ranks
  # Tokens and their routed slots from every device: (T, H), (T, K), rows in device order. With fp8_expand the
  # tokens travel as FP8 (x_all is then the gradient anchor, x_fp8 the gathered cast).
  x_all, x_fp8 = _dispatch_tokens(x, config=config, mesh_axis=mesh_axis, kw=kw)
  idx_all = lax.all_gather(routing.topk_idx[:, :k], mesh_axis, axis=0, tiled=True)
  w_all = lax.all_gather(routing.topk_weights[:, :k], mesh_axis, axis=0, tiled=True)
  rank = lax.axis_index(mesh_axis).astype(jnp.int32)
  local_idx = moe.mask_indices_by_tp(idx_all, e, num_ranks, rank, num_ranks, **kw)
  a = config.alignment
  rows, worst_rows = ep_fused_rows(config, idx_all.shape[0], num_ranks)
  if rows < worst_rows:  # the capacity layout, with the worst case as the exact fallback
    fits = _fits_capacity(idx_all, num_experts=e, num_ranks=num_ranks, alignment=a, rows=rows)
    partial = _capped_experts_sum(routed, x_all, local_idx, w_all, fits, local_e, rows, worst_rows, config, kw,
                                  x_fp8)
  else:
    partial = _experts_sum(routed, x_all, local_idx, w_all, local_e, worst_rows, config, kw, x_fp8,
                           sum_dtype=config.ep_combine_dtype)
  return lax.psum_scatter(partial, mesh_axis, scatter_dimension=0, tiled=True)  # (T/P, H) ep_combine_dtype


def _dispatch_tokens(x: jax.Array, *, config: MoeConfig, mesh_axis: str,
                     kw: dict) -> tuple[jax.Array, QuantTensor | None]:
  """``(x_all, x_fp8)``: the tokens of every device for the routed experts (module docstring, step 2).

  Without ``config.fp8_expand``: ``(all_gather(x), None)``, ``(T, H)`` of ``x.dtype`` (its transpose, the
  ``psum_scatter``, is the tokens' gradient). With it: this device's tokens cast to FP8 (:func:`fp8_expand_cast`,
  row-wise, so the gathered cast equals the cast of the gathered tokens bit for bit), their data ``(T/P, H)``
  float8_e4m3fn and scales ``(T/P, H/128)`` float32 all-gathered as ``x_fp8``, and ``x_all`` the gradient anchor
  (:func:`_gather_anchor`): zeros of the gathered tokens' type whose backward is that ``psum_scatter``, the ``x`` of
  :func:`jaxkern.modeling.moe.expand_fp8_quantized`."""
  gather = functools.partial(lax.all_gather, axis_name=mesh_axis, axis=0, tiled=True)
  if not config.fp8_expand:
    return gather(x), None
  if x.ndim != 2 or x.shape[1] % FP8_EXPAND_GROUP:
    raise ValueError(f"x must be (T/P, H) with H % {FP8_EXPAND_GROUP} == 0 for the FP8 expand, got {tuple(x.shape)}")
  q = fp8_expand_cast(lax.stop_gradient(x), **kw)  # the gradient flows through the anchor
  return _gather_anchor(x, mesh_axis), QuantTensor(gather(q.data), gather(q.sf))


def _gather_anchor(x: jax.Array, axis: str) -> jax.Array:
  """Zeros of the type of ``all_gather(x, axis, axis=0, tiled=True)`` whose backward is that all-gather's transpose,
  ``psum_scatter(ct, axis, scatter_dimension=0, tiled=True)``: the differentiable stand-in for the gathered tokens
  when only their FP8 cast travels (the zeros are never read, so XLA drops them)."""
  shape = (x.shape[0] * _axis_size(axis), *x.shape[1:])
  varying = tuple(sorted(jax.typeof(x).manual_axis_type.varying))  # all_gather's output varies as its input

  @jax.custom_vjp
  def anchor(x):
    z = jnp.zeros(shape, x.dtype)
    return lax.pcast(z, varying, to="varying") if varying else z

  def fwd(x):
    return anchor(x), None

  def bwd(_, ct):
    return (lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True),)

  anchor.defvjp(fwd, bwd)
  return anchor(x)


def _round_up(n: int, a: int) -> int:
  return -(-n // a) * a


def ep_fused_rows(config: MoeConfig, num_tokens: int, num_ranks: int) -> tuple[int, int]:
  """``(rows, worst_rows)``: the fused rows of one device's routed experts in :func:`moe_layer_ep` (static).

  ``worst_rows = round_up(T·min(K, E/P) + (a-1)·E/P, a)``: every token's slots on this device's experts (a token's
  ``K`` experts are distinct, so at most ``min(K, E/P)`` of its slots are here), each of the ``E/P`` segments
  padded to the alignment ``a``. ``rows = round_up(ceil(f·T·K/P) + (a-1)·E/P, a)`` with ``f =
  config.ep_capacity_factor``: ``f`` times the mean slots per device plus the worst padding, at most
  ``worst_rows``; ``rows == worst_rows`` when ``f`` is ``None`` / 0 (the capacity is off) or no smaller.

  Args:
    config: the layer's :class:`~jaxkern.modeling.MoeConfig`.
    num_tokens: ``T``, the tokens of all devices of the mesh axis.
    num_ranks: ``P``, the mesh axis' size.
  """
  e, k, a = config.num_experts, config.num_topk, config.alignment
  local_e = e // num_ranks
  worst = _round_up(num_tokens * min(k, local_e) + (a - 1) * local_e, a)
  f = config.ep_capacity_factor
  if not f:
    return worst, worst
  rows = _round_up(math.ceil(f * num_tokens * k / num_ranks) + (a - 1) * local_e, a)
  return min(rows, worst), worst


def device_rows_needed(topk_idx: jax.Array, *, num_experts: int, num_ranks: int, alignment: int) -> jax.Array:
  """``(P,)`` int32: the fused rows each of ``P`` devices needs for the routed slots ``topk_idx`` ``(T, K)`` (ids
  ``0..E-1``, device ``r`` holding experts ``[r E/P, (r+1) E/P)``): the sum over its experts of their slot counts
  rounded up to ``alignment`` (the layout of :func:`jaxkern.moe.get_fused_mapping`)."""
  # A compare-and-sum (XLA fuses it into one reduction) rather than a scatter-add: no atomics on E counters.
  counts = jnp.sum(topk_idx.reshape(-1, 1) == jnp.arange(num_experts, dtype=topk_idx.dtype), axis=0, dtype=jnp.int32)
  aligned = (counts + alignment - 1) // alignment * alignment
  return jnp.sum(aligned.reshape(num_ranks, num_experts // num_ranks), axis=1)


def _fits_capacity(idx_all, *, num_experts, num_ranks, alignment, rows) -> jax.Array:
  """The capacity predicate: every device's routed slots of ``idx_all`` (all tokens, so the same value on every
  device) fit ``rows`` fused rows. A function of its own so that a test can force either branch."""
  need = device_rows_needed(idx_all, num_experts=num_experts, num_ranks=num_ranks, alignment=alignment)
  return jnp.max(need) <= rows


def _experts_sum(params: MoeParams, x: jax.Array, idx: jax.Array, weights: jax.Array, num_experts: int, rows: int,
                 config: MoeConfig, kw: dict, x_fp8: QuantTensor | None = None,
                 sum_dtype: str = "float32") -> jax.Array:
  """``(T, H)`` of ``sum_dtype``: each token's slots of ``idx`` (-1: skipped) through the experts of ``params``,
  times ``weights``, summed in float32 and rounded to ``sum_dtype`` (the fused-layout pipeline of
  :func:`jaxkern.modeling.apply_experts` on a subset of experts, ``rows`` fused rows). With ``x_fp8`` (the tokens
  already cast, :func:`_dispatch_tokens`) the rows are expanded from it and ``x`` is the gradient anchor
  (:func:`jaxkern.modeling.moe.expand_fp8_quantized`)."""
  mapping = moe.get_fused_mapping(idx, num_experts, rows, config.alignment, force_no_sync=True, **kw)
  if x_fp8 is not None:
    xf = expand_fp8_quantized(x, x_fp8, mapping.token_topk_to_pos, mapping.pos_to_expert, **kw)
  else:
    expand = expand_fp8 if config.fp8_expand else moe.expand_to_fused  # as apply_experts
    xf = expand(x, mapping.token_topk_to_pos, mapping.pos_to_expert, **kw)
  block_expert = fused_block_experts(mapping.pos_to_expert) if config.fp8_gemm else None  # as apply_experts
  yf = swiglu_experts(xf, params, _group_sizes(mapping), fp8_swiglu=config.fp8_swiglu, fp8_gemm=config.fp8_gemm,
                      block_expert=block_expert, **kw)
  return moe.reduce_fused(yf.astype(sum_dtype), weights, mapping.token_topk_to_pos, **kw)


def _capped_experts_sum(params: MoeParams, x: jax.Array, idx: jax.Array, weights: jax.Array, fits: jax.Array,
                        num_experts: int, rows: int, worst_rows: int, config: MoeConfig, kw: dict,
                        x_fp8: QuantTensor | None = None) -> jax.Array:
  """:func:`_experts_sum` with ``rows`` fused rows where ``fits`` (a scalar bool, the same on every device), else
  with ``worst_rows``: a ``jax.custom_vjp`` whose forward and backward each run one ``lax.cond`` (module
  docstring, "Capacity").

  Forward: the fast branch runs ``jax.vjp`` of the ``rows`` pipeline and returns its output and the leaves of its
  pullback (the residuals, ``rows``-sized); the fallback runs the ``worst_rows`` pipeline without residuals and
  returns zeros of the fast residuals' types. Backward: the fast branch applies the saved pullback; the fallback
  recomputes the ``worst_rows`` forward (``jax.vjp``) and pulls back through it. So no worst-case-sized tensor
  crosses from the forward to the backward, and the fast path saves exactly what plain autodiff of the
  ``rows`` pipeline would. (A plain ``lax.cond`` under ``jax.grad`` would not: JAX's partial evaluation of a cond
  returns the union of both branches' residuals, the untaken branch's filled with zeros, so every fast step would
  write worst-case-sized zero residuals.)

  With ``x_fp8`` (the gathered FP8 tokens; ``x`` is then the gradient anchor of :func:`_dispatch_tokens`, zeros
  whose value nobody reads) the anchor does not enter the conds nor the residuals: each branch makes its own zeros of
  its type to differentiate against, and the backward returns the branch's cotangent for it. ``x_fp8`` enters the
  conds as an operand without a gradient, like ``idx``."""
  diff = (x, weights, params.w_gate, params.w_up, params.w_down)
  anchored = x_fp8 is not None
  x_type = jax.typeof(x)

  def operands(diff):  # what enters the conds: without the anchor, whose value is never read
    return diff[1:] if anchored else diff

  def full(ops):  # the pipeline's differentiable inputs inside a branch
    return (_zeros_of_type(x_type), *ops) if anchored else ops

  def pipeline(num_rows, diff, nondiff):
    x, weights, w_gate, w_up, w_down = diff
    p = MoeParams(params.router, params.router_bias, w_gate, w_up, w_down)
    idx, x_fp8 = nondiff
    return _experts_sum(p, x, idx, weights, num_experts, num_rows, config, kw, x_fp8,
                        sum_dtype=config.ep_combine_dtype)

  diff, nondiff, fits = vary_like(diff, (idx, x_fp8), fits)  # one varying type under shard_map (check_vma=True)
  return fast_or_fallback(functools.partial(pipeline, rows), functools.partial(pipeline, worst_rows), diff, nondiff,
                          fits, enter=operands, full=full)


_zeros_of_type = zeros_of_type


# --------------------------------------------------------------------------------------------------------------
# Sharded training step


def _batch_specs(batch, batch_axes) -> Any:
  return jax.tree.map(lambda _: PartitionSpec(batch_axes), batch)


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def _spec_axes(spec) -> set:
  """The mesh axis names a ``PartitionSpec`` shards over."""
  named = set()
  for entry in spec:
    named.update((entry,) if isinstance(entry, str) else (entry or ()))
  return named


def storage_specs(param_specs: Any, params: Any, mesh: Mesh, axis: str) -> Any:
  """The ``PartitionSpec`` s the params are *stored* with under ``shard_replicated=axis`` (module docstring, "Sharded
  storage of the replicated params").

  Every leaf whose spec names no mesh axis (``PartitionSpec()``, replicated) and whose dim 0 is a positive multiple of
  ``mesh.shape[axis]`` gets ``PartitionSpec(axis)``; every other leaf (sharded leaves, scalars, dim 0 not a multiple)
  keeps its spec. Place the params with ``shard_params(params, mesh, storage_specs(...))`` and make the optimiser
  state with :func:`init_optimizer_state` on the placed params (its params-shaped leaves are then sharded too).

  Args:
    param_specs: the params' compute ``PartitionSpec`` pytree (what ``loss_fn`` sees per device), e.g. from
      :func:`moe_param_specs` / :func:`jaxkern.modeling.block_param_specs`.
    params: the params, or anything with their shapes (``jax.ShapeDtypeStruct`` s, ``jax.eval_shape``'s output).
    mesh: the :class:`jax.sharding.Mesh`.
    axis: the mesh axis name to split the replicated params over.

  Raises:
    ValueError: ``axis`` not an axis of ``mesh``.
  """
  if axis not in mesh.axis_names:
    raise ValueError(f"axis={axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
  n = mesh.shape[axis]

  def one(spec, leaf):
    shape = tuple(leaf.shape)
    if not _spec_axes(spec) and len(shape) >= 1 and shape[0] > 0 and shape[0] % n == 0:
      return PartitionSpec(axis)
    return spec

  return jax.tree.map(one, param_specs, params, is_leaf=_is_spec)


def _gather_with_scatter_grad(axis: str, other_axes: tuple, reduce_dtype: Any) -> Callable:
  """``x -> all_gather(x, axis, axis=0, tiled=True)`` whose backward is the reduce-scatter of the cotangent over
  ``axis`` followed by its ``psum`` over ``other_axes`` (both in ``reduce_dtype`` when given): the gradient of a
  shard-stored param summed over every batch shard (:func:`sharded_value_and_grad` divides by their count)."""

  @jax.custom_vjp
  def gather(x):
    return lax.all_gather(x, axis, axis=0, tiled=True)

  def fwd(x):
    return gather(x), None

  def bwd(_, ct):
    dtype = ct.dtype
    if reduce_dtype is not None and dtype != reduce_dtype:
      ct = ct.astype(reduce_dtype)
    ct = lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True)
    if other_axes:
      ct = lax.psum(ct, other_axes)
    return (ct.astype(dtype),)

  gather.defvjp(fwd, bwd)
  return gather


def sharded_value_and_grad(loss_fn: Callable[[Any, Any], jax.Array], mesh: Mesh, param_specs: Any, *,
                           batch_axes: str | Sequence[str] | None = None, batch_specs: Any = None,
                           check_vma: bool = True, grad_reduce_dtype: Any = None,
                           shard_replicated: str | None = None, shard_optimizer: str | None = None) -> Callable:
  """``(params, batch) -> (loss, grads)`` of ``loss_fn`` run under ``jax.shard_map`` over ``mesh``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, called on each device with its shards (the local params
      of ``param_specs``, the local batch); a mean over the local tokens. Inside it, collectives may name the
      mesh axes (e.g. ``functools.partial(moe_layer_ep, mesh_axis="data")`` as a model's ``moe_fn``).
    mesh: the :class:`jax.sharding.Mesh`, with ``Auto`` axes (``jax.sharding.Mesh(devices, names)``, or
      ``jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)``; ``jax.make_mesh``'s default ``Explicit`` axes
      make ``shard_map`` demand inputs already sharded as its specs say).
    param_specs: a pytree of ``PartitionSpec`` matching ``params`` (e.g. from :func:`moe_param_specs`;
      ``PartitionSpec()`` = replicated).
    batch_axes: mesh axes that split the batch's leading dimension (default: all of ``mesh.axis_names``).
    batch_specs: explicit ``PartitionSpec`` pytree of the batch (overrides ``batch_axes``).
    check_vma: ``jax.shard_map``'s type check of replicated vs device-varying values. ``True``: JAX inserts
      the ``psum`` of the gradients of replicated params (the transpose of their implicit broadcast).
      ``False`` (needed by Pallas kernels: ``pallas_call`` under ``check_vma=True`` wants every output
      ``ShapeDtypeStruct`` to carry a ``manual_axis_type``, which jaxkern's kernels do not set): each device
      differentiates its own loss, and the gradient of a param is ``psum``-med over the batch axes its spec
      does not shard it over, then divided by the number of batch shards. Both give the same gradients.
    grad_reduce_dtype: ``None`` (default): those sums in each gradient's own dtype. A narrower float dtype
      (``jnp.bfloat16``): each device's gradient is rounded to it, summed in it and cast back (half the bytes of
      a float32 all-reduce, at a relative rounding of ``2**-8`` per summand and per partial sum; the usual
      trade of data-parallel training). Needs ``check_vma=False`` (with ``True`` JAX inserts the sums).
    shard_replicated: ``None`` (default): params are stored as ``param_specs`` says. A mesh axis name (one of
      ``batch_axes``): the replicated params are stored split over it (:func:`storage_specs` of ``param_specs``;
      ``params`` must come placed so, e.g. ``shard_params(params, mesh, storage_specs(...))``), all-gathered
      inside the ``shard_map`` before ``loss_fn`` sees them, their gradients reduce-scattered over the axis (in
      ``grad_reduce_dtype`` if given), ``psum`` -med over the other batch axes (module docstring, "Sharded storage
      of the replicated params"). ``loss_fn`` still sees ``param_specs``' local shapes. Needs
      ``check_vma=False``.
    shard_optimizer: ``None`` (default), or a mesh axis name (one of ``batch_axes``; not with ``shard_replicated``):
      ``params`` come as ``param_specs`` says, but the gradients of the leaves :func:`storage_specs` splits are
      reduce-scattered over the axis (module docstring, "Sharded optimiser state") and come back in that layout.
      Needs ``check_vma=False``.

  Returns:
    A function ``(params, batch) -> (loss, grads)``: ``loss`` the ``pmean`` of the devices' losses over
    ``batch_axes`` (the unsharded loss for a mean over equal shards), ``grads`` sharded like ``params`` (with
    ``shard_replicated`` or ``shard_optimizer``: like :func:`storage_specs`): the gradient of ``loss``. Not jitted
    itself.

  Raises:
    ValueError: ``grad_reduce_dtype``, ``shard_replicated`` or ``shard_optimizer`` with ``check_vma=True``;
      ``shard_replicated`` or ``shard_optimizer`` not one of ``batch_axes``; both given.
  """
  if grad_reduce_dtype is not None and check_vma:
    raise ValueError(f"grad_reduce_dtype={grad_reduce_dtype}: needs check_vma=False (with check_vma=True "
                     "jax.shard_map inserts the gradient sums itself)")
  if shard_replicated is not None and check_vma:
    raise ValueError(f"shard_replicated={shard_replicated!r}: needs check_vma=False (the gathered params' gradients "
                     "are reduce-scattered by a custom_vjp, outside jax.shard_map's replication types)")
  if shard_optimizer is not None and check_vma:
    raise ValueError(f"shard_optimizer={shard_optimizer!r}: needs check_vma=False (the gradients are "
                     "reduce-scattered by hand, outside jax.shard_map's replication types)")
  if shard_optimizer is not None and shard_replicated is not None:
    raise ValueError(f"shard_optimizer={shard_optimizer!r} and shard_replicated={shard_replicated!r}: give one "
                     "(shard_replicated already splits the optimiser state)")
  if batch_axes is None:
    batch_axes = tuple(mesh.axis_names)
  elif isinstance(batch_axes, str):
    batch_axes = (batch_axes,)
  else:
    batch_axes = tuple(batch_axes)
  for name, axis in (("shard_replicated", shard_replicated), ("shard_optimizer", shard_optimizer)):
    if axis is not None and axis not in batch_axes:
      raise ValueError(f"{name}={axis!r} must be one of the batch axes {batch_axes}")
  num_shards = 1
  for axis in batch_axes:
    num_shards *= mesh.shape[axis]

  def local(params, batch, gathered, scattered):
    if check_vma:
      return jax.value_and_grad(lambda p: lax.pmean(loss_fn(p, batch), batch_axes))(params)
    if shard_replicated is not None:
      others = tuple(a for a in batch_axes if a != shard_replicated)
      gather = _gather_with_scatter_grad(shard_replicated, others, grad_reduce_dtype)
      full = lambda p: jax.tree.map(lambda leaf, g: gather(leaf) if g else leaf, p, gathered)
    else:
      full = lambda p: p
    loss, grads = jax.value_and_grad(lambda p, b: loss_fn(full(p), b))(params, batch)

    def reduce(g, spec, is_gathered, is_scattered):
      if is_gathered:  # summed over every batch axis by the gather's backward
        return g / num_shards
      axes = tuple(a for a in batch_axes if a not in _spec_axes(spec))
      if not axes:
        return g / num_shards
      dtype = g.dtype
      if grad_reduce_dtype is not None and dtype != grad_reduce_dtype:
        g = g.astype(grad_reduce_dtype)
      if is_scattered:
        g = lax.psum_scatter(g, shard_optimizer, scatter_dimension=0, tiled=True)
        axes = tuple(a for a in axes if a != shard_optimizer)
      if axes:
        g = lax.psum(g, axes)
      return g.astype(dtype) / num_shards

    grads = jax.tree.map(reduce, grads, param_specs, gathered, scattered, is_leaf=_is_spec)
    return lax.pmean(loss, batch_axes), grads

  def run(params, batch):
    bspecs = batch_specs if batch_specs is not None else _batch_specs(batch, batch_axes)
    specs = grad_specs = param_specs
    if shard_replicated is not None:
      specs = grad_specs = storage_specs(param_specs, params, mesh, shard_replicated)
    if shard_optimizer is not None:
      grad_specs = storage_specs(param_specs, params, mesh, shard_optimizer)
    differs = lambda other: jax.tree.map(lambda spec, o: spec != o, param_specs, other, is_leaf=_is_spec)
    local_fn = functools.partial(local, gathered=differs(specs), scattered=differs(grad_specs))
    return jax.shard_map(local_fn, mesh=mesh, in_specs=(specs, bspecs), out_specs=(PartitionSpec(), grad_specs),
                         check_vma=check_vma)(params, batch)

  return run


def shard_params(params: Any, mesh: Mesh, param_specs: Any) -> Any:
  """``params`` placed on ``mesh`` with ``param_specs`` (``jax.device_put`` with ``NamedSharding``).

  Raises:
    ValueError: a param's dimension is not a multiple of the devices it is split over (e.g. routed experts on more
      devices than there are experts, or not a multiple of them); the message names the param.
  """
  _check_divisible(params, dict(mesh.shape), param_specs)
  return jax.tree.map(lambda p, spec: jax.device_put(p, NamedSharding(mesh, spec)), params, param_specs)


def _check_divisible(params: Any, axis_sizes: dict[str, int], param_specs: Any) -> None:
  """Raises ``ValueError`` naming the first leaf of ``params`` whose dimension is not a multiple of the devices
  (the product of ``axis_sizes`` over the mesh axes its ``PartitionSpec`` entry names) it is split over."""
  def check(path, p, spec):
    for dim, entry in enumerate(spec):
      axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
      ways = math.prod(axis_sizes[a] for a in axes)
      if ways > 1 and p.shape[dim] % ways:
        raise ValueError(f"params{jax.tree_util.keystr(path)}: dimension {dim} of shape {tuple(p.shape)} is split "
                         f"over mesh axes {axes} ({ways} devices) and is not a multiple of {ways}")

  jax.tree_util.tree_map_with_path(check, params, param_specs)


def init_optimizer_state(optimizer: Any, params: Any, mesh: Mesh, *,
                         shard_over: str | None = None) -> Any:
  """``optimizer.init(params)`` placed as the sharded step returns it, so that chained steps compile once.

  ``optimizer.init`` leaves some leaves off the mesh (optax's step count: a fresh single-device scalar), while the
  jitted step returns every leaf on the mesh: a step fed its own outputs then sees another input type and compiles
  again (measured: a second compilation of the DeepSeek-V3-like FP8 step, 50-80 s on an H200, 2026-11-27). Here
  every leaf not already placed on ``mesh`` is replicated on it (``NamedSharding(mesh, PartitionSpec())``);
  params-shaped leaves (Adam's moments of placed params) keep their sharding.

  Args:
    optimizer: an ``optax.GradientTransformation``.
    params: the params, placed (:func:`shard_params`).
    mesh: the step's :class:`jax.sharding.Mesh`.
    shard_over: ``None`` (default), or the mesh axis of a ``shard_optimizer=axis`` step: the state of every
      replicated param that :func:`storage_specs` splits is made split over it (module docstring, "Sharded
      optimiser state"), the params themselves untouched.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  if shard_over is not None:
    specs = jax.tree.map(lambda p: p.sharding.spec, params)
    params = shard_params(params, mesh, storage_specs(specs, params, mesh, shard_over))

  def place(leaf):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
      return leaf
    return jax.device_put(leaf, replicated)

  return jax.tree.map(place, optimizer.init(params))


def make_sharded_train_step(loss_fn: Callable[[Any, Any], jax.Array], optimizer: Any, mesh: Mesh,
                            param_specs: Any, *, batch_axes: str | Sequence[str] | None = None, batch_specs: Any = None,
                            check_vma: bool = True, grad_reduce_dtype: Any = None, shard_replicated: str | None = None,
                            shard_optimizer: str | None = None) -> Callable:
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

  The loss and gradients come from :func:`sharded_value_and_grad` (one ``jax.shard_map``), then
  ``optimizer`` (an ``optax.GradientTransformation``) updates the params outside the ``shard_map``, under
  the same ``jax.jit``: elementwise updates keep each param's sharding, so the optimiser state of sharded
  expert weights stays sharded. Equal to the unsharded step (to float32 rounding of the gradient sums) when
  ``loss_fn`` is a mean over the local tokens. Place ``params`` with :func:`shard_params` and make ``opt_state``
  with :func:`init_optimizer_state` (plain ``optimizer.init`` leaves optax's step count off the mesh, and the
  second step compiles again); ``batch`` may be any arrays (jit reshards them). With ``shard_replicated=axis`` place
  ``params`` with ``shard_params(params, mesh, storage_specs(param_specs, params, mesh, axis))`` instead: the
  gradients come in that layout, the optimiser updates (and keeps state for) each device's shard only, and the step
  returns the params in it. With ``shard_optimizer=axis`` place ``params`` with ``param_specs`` and make
  ``opt_state`` with ``init_optimizer_state(..., shard_over=axis)``: the optimiser updates each device's slice of the
  replicated params and the step all-gathers them (module docstring, "Sharded optimiser state"); it returns the params
  as placed. Arguments: those of :func:`sharded_value_and_grad`, and ``optimizer``.
  """
  value_and_grad = sharded_value_and_grad(loss_fn, mesh, param_specs, batch_axes=batch_axes, batch_specs=batch_specs,
                                          check_vma=check_vma, grad_reduce_dtype=grad_reduce_dtype,
                                          shard_replicated=shard_replicated, shard_optimizer=shard_optimizer)

  def constrain(tree, specs):
    return jax.tree.map(lambda spec, x: lax.with_sharding_constraint(x, NamedSharding(mesh, spec)), specs, tree,
                        is_leaf=_is_spec)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    if shard_optimizer is None:
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return apply_updates(params, updates), opt_state, loss
    slices = constrain(params, storage_specs(param_specs, params, mesh, shard_optimizer))  # no data moves
    updates, opt_state = optimizer.update(grads, opt_state, slices)
    return constrain(apply_updates(slices, updates), param_specs), opt_state, loss

  return step
