"""The all-to-all token exchange of the expert-parallel MoE layer (``MoeConfig.ep_exchange="all_to_all"``).

Run by :func:`jaxkern.modeling.sharding.moe_layer_ep` inside ``jax.shard_map`` over a mesh axis of ``P`` devices,
device ``r`` holding ``T/P`` tokens and the routed experts ``[r E/P, (r+1) E/P)``. Per device, for each of
``MoeConfig.ep_exchange_chunks`` equal chunks of its ``Tc`` tokens:

1. **Destinations**: the device of each routed slot, ``idx // (E/P)``, with the repeats of a token's row removed
   (:func:`jaxkern.moe.unique_group_indices`): each token goes once to each device that holds at least one of its
   experts. :func:`jaxkern.moe.get_fused_mapping` over the ``P`` devices (alignment 1) ranks the tokens of each
   destination in token order; the rank ``j`` of a token for destination ``d`` puts it on row ``d C + j`` of a
   ``(P C, ...)`` send buffer (``C`` the static capacity per destination, below). :func:`destination_layout`.
2. **Dispatch**: :func:`jaxkern.moe.expand_to_fused` copies each token into its rows of the send buffer (with FP8
   dispatch, ``MoeConfig.fp8_expand``: the tokens are cast on their own device,
   :func:`jaxkern.modeling.moe.fp8_expand_cast`, and :func:`jaxkern.moe.expand_to_fused_with_sf` copies the e4m3 rows
   and their float32 scales); the token's
   routed ids and weights go to the same rows. One ``lax.all_to_all`` per array (split and concatenated on dim 0)
   sends block ``d`` of every device to device ``d``: device ``r`` receives, from each source ``s``, the rows
   ``s C .. s C + C - 1``.
3. **Experts**: :func:`jaxkern.moe.mask_indices_by_tp` keeps the received slots of this device's experts
   (renumbered ``0..E/P-1``); the fused-layout pipeline of the all-gather mode (expand, SwiGLU grouped matmuls,
   :func:`jaxkern.moe.reduce_fused` with the routing weights, in ``MoeConfig.ep_combine_dtype``) turns each received
   row into this device's routing-weighted sum of that token's slots: the same per-device partial sum as in the
   all-gather mode.
4. **Combine**: the transposed ``all_to_all`` returns each partial to the row it came from, and
   :func:`jaxkern.moe.reduce_fused` without weights sums each token's rows (one per destination, in device order,
   float32 accumulation, one rounding to ``ep_combine_dtype``).

The backward is the transposed exchange: JAX's transpose of ``all_to_all`` is the ``all_to_all`` back, the
expand's is the slot sum, and the combine's ``reduce_fused`` transposes into an expand. With FP8 dispatch the FP8
rows carry no gradient; the tokens' gradient comes through :func:`_received_anchor`, zeros of the received rows'
type whose backward sends the rows' cotangent back and sums it per token.

**Capacity** (``C``): the worst case is every token to every device, ``C = Tc`` (the all-gather's volume). With
``MoeConfig.ep_capacity_factor`` ``f``: ``C = round_up(ceil(f Tc D / P), 8)`` (at most ``Tc``), ``D = P (1 -
binom(E - E/P, K) / binom(E, K))`` the mean number of distinct devices a token's ``K`` experts fall on when they are
drawn uniformly (:func:`exchange_capacity`), and the fused rows of the received tokens are those of the all-gather
mode's capacity path (:func:`jaxkern.modeling.sharding.ep_fused_rows` of the chunk's tokens). Every device learns
every device's counts (rows per destination, slots per expert, per chunk) from one ``all_gather`` of a small int32
vector, so every device takes the same branch: the capacity layout where everything fits, else the worst case, an
exact fallback (no token dropped), through the same ``jax.custom_vjp`` with one ``lax.cond`` each way as the
all-gather mode's capacity (:func:`fast_or_fallback`). Unlike there, the exchange itself runs inside the branches.

Per device and layer the exchange moves ``P C`` rows each way (``(P-1) C`` of them leave the device): for the
dispatch ``H`` bytes of e4m3 and ``4 H/128`` of scales per row (``2H`` for bfloat16 tokens) plus ``8 K`` bytes of ids
and weights; for the combine ``H`` elements of ``ep_combine_dtype``. Against the all-gather's ``(P-1) Tc`` rows each
way, that is ``C / Tc``: 1 (no saving) where a token's experts cover almost every device (``K >= E/P`` for small
``P``, e.g. the v3 benchmark's ``K = 4``, ``E = 8`` on 2 or 4 GPUs), less where ``P`` grows past ``K``.

Chunks (``MoeConfig.ep_exchange_chunks``): each chunk's exchange, experts and combine are independent of the other
chunks', so XLA's scheduler may overlap them (the latency-hiding scheduler on GPUs); each chunk has its own
capacity and fused rows, sized for ``Tc = T/(P n)`` tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern import moe
from jaxkern._autodiff import vary_like
from jaxkern.modeling.moe import FP8_EXPAND_GROUP, MoeConfig, MoeParams
from jaxkern.moe._expand_to_fused import _sum_slots
from jaxkern.types import QuantTensor

CAPACITY_ROWS_MULTIPLE = 8  # a capacity below the worst case is rounded up to a multiple of this many rows


def _round_up(n: int, a: int) -> int:
  return -(-n // a) * a


def mean_destinations(num_experts: int, num_topk: int, num_ranks: int) -> float:
  """``P (1 - binom(E - E/P, K) / binom(E, K))``: the mean number of distinct devices holding a token's ``K``
  experts when the ``K`` distinct experts are drawn uniformly from ``E``, ``E/P`` consecutive ones a device."""
  e, k, p = num_experts, num_topk, num_ranks
  if k > e:
    return float(p)
  return p * (1.0 - math.comb(e - e // p, k) / math.comb(e, k))


def exchange_capacity(config: MoeConfig, chunk_tokens: int, num_ranks: int) -> tuple[int, int]:
  """``(C, worst)``: the rows per destination of one chunk's send buffer (static). ``worst = Tc`` (every token of
  the chunk to every device); ``C = min(Tc, round_up(ceil(f Tc D / P), 8))`` with ``f =
  config.ep_capacity_factor`` and ``D`` = :func:`mean_destinations`; ``C == worst`` when ``f`` is ``None`` / 0."""
  worst = chunk_tokens
  f = config.ep_capacity_factor
  if not f:
    return worst, worst
  mean = chunk_tokens * mean_destinations(config.num_experts, config.num_topk, num_ranks) / num_ranks
  return min(worst, _round_up(math.ceil(f * mean), CAPACITY_ROWS_MULTIPLE)), worst


def destination_devices(idx: jax.Array, *, num_experts: int, num_ranks: int, kw: dict) -> jax.Array:
  """``(T, K)`` int32: the device of each routed slot of ``idx`` (ids ``0..E-1``, -1 kept), a device repeated in a
  token's row replaced by -1 after its first slot (:func:`jaxkern.moe.unique_group_indices`)."""
  dev = jnp.where(idx >= 0, idx // (num_experts // num_ranks), -1).astype(jnp.int32)
  return moe.unique_group_indices(dev, num_ranks, **kw)


def destination_layout(dev: jax.Array, *, num_ranks: int, capacity: int,
                       kw: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(buf_pos, buf_dev, counts)`` of the send buffer (module docstring, step 1).

  Args:
    dev: ``(T, K)`` int32 destination of each slot (:func:`destination_devices`; -1: none).
    num_ranks: ``P``.
    capacity: ``C``, rows per destination.
    kw: the ops' ``implementation``.

  Returns:
    ``buf_pos`` ``(T, K)`` int32: the send-buffer row ``d C + j`` of each slot with a destination, ``j`` the token's
    rank among the tokens sent to ``d`` (token order), -1 for the other slots and for ranks ``>= C`` (dropped: the
    caller checks ``counts``); ``buf_dev`` ``(P C,)`` int32: the destination of each used row, -1 for the unused
    ones; ``counts`` ``(P,)`` int32: the tokens sent to each destination (not capped).
  """
  mapping = moe.get_fused_mapping(dev, num_ranks, 0, 1, force_no_sync=True, **kw)
  counts = mapping.num_tokens_per_expert  # alignment 1: the counts themselves
  safe = jnp.maximum(dev, 0)
  rank = mapping.token_topk_to_pos - mapping.expert_start[safe]
  buf_pos = jnp.where((dev >= 0) & (rank < capacity), safe * capacity + rank, -1).astype(jnp.int32)
  rows = jnp.arange(num_ranks * capacity, dtype=jnp.int32)
  buf_dev = jnp.where(rows % capacity < counts[rows // capacity], rows // capacity, -1).astype(jnp.int32)
  return buf_pos, buf_dev, counts


def _buffer_tokens(buf_pos: jax.Array, num_rows: int) -> jax.Array:
  """``(num_rows,)`` int32: the token of each send-buffer row, -1 for the unused rows."""
  tokens = jnp.broadcast_to(jnp.arange(buf_pos.shape[0], dtype=jnp.int32)[:, None], buf_pos.shape)
  target = jnp.where(buf_pos >= 0, buf_pos, num_rows).reshape(-1)
  return jnp.full((num_rows,), -1, jnp.int32).at[target].set(tokens.reshape(-1), mode="drop")


def _rows_of(values: jax.Array, buf_tok: jax.Array, fill) -> jax.Array:
  """``values[buf_tok]`` with ``fill`` on the unused rows (``buf_tok`` -1): the per-token metadata of the send
  buffer (a gather; its transpose, a scatter-add, carries the routing weights' gradient)."""
  used = buf_tok >= 0
  rows = values[jnp.maximum(buf_tok, 0)]
  return jnp.where(used[:, None], rows, jnp.asarray(fill, values.dtype))


def _exchange(x: jax.Array, axis: str) -> jax.Array:
  """Block ``d`` of the rows (``P`` equal blocks) to device ``d``; the received blocks in source order. Its own
  transpose (JAX's: the ``all_to_all`` back). FP8 arrays travel as their bytes."""
  if x.dtype == jnp.float8_e4m3fn:
    u = lax.all_to_all(lax.bitcast_convert_type(x, jnp.uint8), axis, 0, 0, tiled=True)
    return lax.bitcast_convert_type(u, x.dtype)
  return lax.all_to_all(x, axis, 0, 0, tiled=True)


def _received_anchor(x: jax.Array, buf_pos: jax.Array, num_rows: int, axis: str, implementation: str) -> jax.Array:
  """Zeros of the type of the received rows ``(P C, H)`` (``x.dtype``) whose backward is the transposed dispatch:
  the rows' cotangent exchanged back and summed per token over ``buf_pos`` (the expand's transpose): the
  differentiable stand-in for the received tokens when only their FP8 cast travels (never read)."""
  varying = tuple(sorted(jax.typeof(x).manual_axis_type.varying))

  @jax.custom_vjp
  def anchor(x, buf_pos):
    z = jnp.zeros((num_rows, *x.shape[1:]), x.dtype)
    return lax.pcast(z, varying, to="varying") if varying else z

  def fwd(x, buf_pos):
    return anchor(x, buf_pos), buf_pos

  def bwd(buf_pos, ct):
    back = _exchange(ct, axis)
    return _sum_slots("ep_exchange.dispatch.bwd", back, buf_pos, implementation), None

  anchor.defvjp(fwd, bwd)
  return anchor(x, buf_pos)


def exchange_chunk(params: MoeParams, x: jax.Array, idx: jax.Array, weights: jax.Array, x_fp8: QuantTensor | None, *,
                   capacity: int, rows: int, config: MoeConfig, axis: str, num_ranks: int, kw: dict,
                   experts_sum: Callable) -> jax.Array:
  """``(Tc, H)`` of ``config.ep_combine_dtype``: the routed experts' output of one chunk of this device's tokens
  (module docstring, steps 1-4), ``capacity`` rows per destination and ``rows`` fused rows on the receiving side.

  ``x`` ``(Tc, H)``, ``idx`` / ``weights`` ``(Tc, K)`` the routed slots; ``x_fp8`` the chunk's FP8 cast (with
  ``config.fp8_expand``) or ``None``; ``experts_sum`` the all-gather mode's fused-layout pipeline
  (:func:`jaxkern.modeling.sharding._experts_sum`)."""
  e = config.num_experts
  num_rows = num_ranks * capacity
  dev = destination_devices(idx, num_experts=e, num_ranks=num_ranks, kw=kw)
  buf_pos, buf_dev, _ = destination_layout(dev, num_ranks=num_ranks, capacity=capacity, kw=kw)
  buf_tok = _buffer_tokens(buf_pos, num_rows)
  recv_idx = _exchange(_rows_of(idx, buf_tok, -1), axis)
  recv_w = _exchange(_rows_of(weights, buf_tok, 0), axis)
  if x_fp8 is None:
    recv_x, recv_fp8 = _exchange(moe.expand_to_fused(x, buf_pos, buf_dev, **kw), axis), None
  else:
    sent = moe.expand_to_fused_with_sf(x_fp8, FP8_EXPAND_GROUP, buf_pos, buf_dev, **kw)
    recv_fp8 = QuantTensor(_exchange(sent[0], axis), _exchange(sent[1], axis))
    recv_x = _received_anchor(x, buf_pos, num_rows, axis, kw.get("implementation"))
  rank = lax.axis_index(axis).astype(jnp.int32)
  local_idx = moe.mask_indices_by_tp(recv_idx, e, num_ranks, rank, num_ranks, **kw)
  partial = experts_sum(params, recv_x, local_idx, recv_w, e // num_ranks, rows, config, kw, recv_fp8,
                        sum_dtype=config.ep_combine_dtype)  # (P C, H): this device's sum of each row's slots
  return moe.reduce_fused(_exchange(partial, axis), None, buf_pos, **kw)


def chunk_counts(idx: jax.Array, *, config: MoeConfig, num_ranks: int, chunks: int, kw: dict) -> jax.Array:
  """``(n (P + E),)`` int32 of this device's tokens: per chunk, the tokens sent to each destination and the routed
  slots of each expert (what :func:`fits_everywhere` needs from every device)."""
  e = config.num_experts
  out = []
  for c in jnp.split(idx, chunks, axis=0):
    dev = destination_devices(c, num_experts=e, num_ranks=num_ranks, kw=kw)
    per_dev = jnp.sum(dev.reshape(-1, 1) == jnp.arange(num_ranks, dtype=jnp.int32), axis=0, dtype=jnp.int32)
    per_expert = jnp.sum(c.reshape(-1, 1) == jnp.arange(e, dtype=c.dtype), axis=0, dtype=jnp.int32)
    out += [per_dev, per_expert]
  return jnp.concatenate(out)


def fits_everywhere(counts: jax.Array, *, config: MoeConfig, num_ranks: int, chunks: int, capacity: int,
                    rows: int) -> jax.Array:
  """Scalar bool, the same on every device: ``counts`` ``(P, n (P + E))`` (:func:`chunk_counts` of every device,
  all-gathered) fit the capacity: every chunk's tokens from every source to every destination ``<= capacity``, and
  every device's fused rows of every chunk (its experts' slot counts from all sources, each rounded up to the
  alignment) ``<= rows``. A function of its own so that a test can force either branch."""
  e, p, a = config.num_experts, num_ranks, config.alignment
  counts = counts.reshape(p, chunks, p + e)
  sent = counts[:, :, :p]  # (source, chunk, destination)
  load = jnp.sum(counts[:, :, p:], axis=0)  # (chunk, expert): slots from all sources
  need = jnp.sum(((load + a - 1) // a * a).reshape(chunks, p, e // p), axis=2)  # (chunk, device)
  return (jnp.max(sent) <= capacity) & (jnp.max(need) <= rows)


def fast_or_fallback(fast: Callable, slow: Callable, diff: tuple, nondiff, fits: jax.Array, *,
                     enter: Callable = lambda d: d, full: Callable = lambda o: o) -> jax.Array:
  """``fast(diff, nondiff)`` where ``fits`` (a scalar bool, the same on every device), else ``slow(diff, nondiff)``:
  a ``jax.custom_vjp`` whose forward and backward each run one ``lax.cond`` (module docstring of
  :mod:`jaxkern.modeling.sharding`, "Capacity").

  Forward: the fast branch runs ``jax.vjp`` of ``fast`` and returns its output and the leaves of its pullback (the
  residuals); the fallback runs ``slow`` without residuals and returns zeros of the fast residuals' types. Backward:
  the fast branch applies the saved pullback; the fallback recomputes ``slow``'s forward (``jax.vjp``) and pulls
  back through it. Pullback leaves that are inputs are not returned through the cond (the backward takes them from
  its own residuals).

  ``enter(diff)``: what of ``diff`` enters the conds (default all); ``full(ops)`` rebuilds the differentiable
  inputs inside a branch (e.g. zeros for an anchor whose value is never read). ``nondiff``: a pytree of operands
  without gradient (``None`` leaves allowed).
  """
  pullback = {}  # the fast pullback's treedef, which leaves are inputs, the other leaves' types (set while tracing)

  def fast_fwd(ops, nondiff):
    diff = full(ops)
    out, vjp_fn = jax.vjp(lambda *d: fast(d, nondiff), *diff)
    leaves, pullback["treedef"] = jax.tree.flatten(vjp_fn)
    inputs = [*diff, *jax.tree.leaves(nondiff)]
    pullback["forwarded"] = [next((j for j, a in enumerate(inputs) if leaf is a), None) for leaf in leaves]
    saved = [leaf for leaf, j in zip(leaves, pullback["forwarded"]) if j is None]
    pullback["types"] = [jax.typeof(leaf) for leaf in saved]
    return out, saved

  def slow_fwd(ops, nondiff):
    if "types" not in pullback:  # lax.cond traces the true branch first (jax 0.11); be safe if that changes
      jax.eval_shape(fast_fwd, ops, nondiff)
    zeros = [zeros_of_type(t) for t in pullback["types"]]
    return slow(full(ops), nondiff), zeros

  @jax.custom_vjp
  def f(diff, nondiff, fits):
    return lax.cond(fits, lambda o, n: fast(full(o), n), lambda o, n: slow(full(o), n), enter(diff), nondiff)

  def f_fwd(diff, nondiff, fits):
    ops = enter(diff)
    out, saved = lax.cond(fits, fast_fwd, slow_fwd, ops, nondiff)
    return out, (ops, nondiff, fits, saved)

  def f_bwd(res, ct):
    ops, nondiff, fits, saved = res

    def fast_bwd(ct, saved, ops, nondiff):
      inputs, saved = [*full(ops), *jax.tree.leaves(nondiff)], iter(saved)
      leaves = [next(saved) if j is None else inputs[j] for j in pullback["forwarded"]]
      return jax.tree.unflatten(pullback["treedef"], leaves)(ct)

    def slow_bwd(ct, saved, ops, nondiff):
      return jax.vjp(lambda *d: slow(d, nondiff), *full(ops))[1](ct)

    return lax.cond(fits, fast_bwd, slow_bwd, ct, saved, ops, nondiff), None, None

  f.defvjp(f_fwd, f_bwd)
  return f(diff, nondiff, fits)


def zeros_of_type(aval) -> jax.Array:
  """Zeros of ``aval``'s shape and dtype, varying over the same manual mesh axes (under ``shard_map``)."""
  z = jnp.zeros(aval.shape, aval.dtype)
  axes = tuple(sorted(aval.manual_axis_type.varying))
  return lax.pcast(z, axes, to="varying") if axes else z


def all_to_all_experts(params: MoeParams, x: jax.Array, idx: jax.Array, weights: jax.Array,
                       x_fp8: QuantTensor | None, *, config: MoeConfig, axis: str, num_ranks: int,
                       fused_rows: Callable, kw: dict, experts_sum: Callable) -> jax.Array:
  """``(T/P, H)`` of ``config.ep_combine_dtype``: the routed experts' output of this device's tokens through the
  all-to-all exchange (module docstring), chunk by chunk, the capacity layout where every device's counts fit and
  the worst case otherwise.

  Args:
    params: the routed experts of this device (``E/P``), router unused.
    x: ``(T/P, H)`` this device's tokens (with ``x_fp8``: only their type and the gradient are used).
    idx, weights: ``(T/P, K)`` the routed slots (ids ``0..E-1``) and their weights.
    x_fp8: the tokens' FP8 cast (:func:`jaxkern.modeling.moe.fp8_expand_cast`) with ``config.fp8_expand``, else
      ``None``.
    config: the layer's config (``ep_capacity_factor``, ``ep_exchange_chunks``, ``ep_combine_dtype``).
    axis: the mesh axis; ``num_ranks`` its size ``P``.
    fused_rows: ``(config, tokens, P) -> (rows, worst_rows)`` of the receiving side
      (:func:`jaxkern.modeling.sharding.ep_fused_rows`).
    kw: the ops' ``implementation``.
    experts_sum: the fused-layout pipeline (:func:`jaxkern.modeling.sharding._experts_sum`).

  Raises:
    ValueError: the local tokens not a multiple of ``config.ep_exchange_chunks``.
  """
  n, local = config.ep_exchange_chunks, x.shape[0]
  if local % n:
    raise ValueError(f"MoeConfig.ep_exchange_chunks={n} must divide the tokens per device, {local}")
  chunk = local // n
  capacity, worst = exchange_capacity(config, chunk, num_ranks)
  rows, worst_rows = fused_rows(config, chunk * num_ranks, num_ranks)
  # The received rows carry at most min(K, E/P) of this device's slots each: P C of them bound the fused rows too.
  local_e, a = config.num_experts // num_ranks, config.alignment
  rows = min(rows, _round_up(num_ranks * capacity * min(config.num_topk, local_e) + (a - 1) * local_e, a))

  def pipeline(cap, num_rows, diff, nondiff):
    x, weights, w_gate, w_up, w_down = diff
    idx, x_fp8 = nondiff
    p = MoeParams(params.router, params.router_bias, w_gate, w_up, w_down)
    run = functools.partial(exchange_chunk, p, capacity=cap, rows=num_rows, config=config, axis=axis,
                            num_ranks=num_ranks, kw=kw, experts_sum=experts_sum)
    outs = []
    for c in range(n):
      part = slice(c * chunk, (c + 1) * chunk)
      q = None if x_fp8 is None else QuantTensor(x_fp8[0][part], x_fp8[1][part])
      outs.append(run(x[part], idx[part], weights[part], q))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=0)

  diff = (x, weights, params.w_gate, params.w_up, params.w_down)
  nondiff = (idx, x_fp8)
  if capacity == worst and rows == worst_rows:
    return pipeline(worst, worst_rows, diff, nondiff)
  counts = lax.all_gather(chunk_counts(idx, config=config, num_ranks=num_ranks, chunks=n, kw=kw), axis)
  fits = fits_everywhere(counts, config=config, num_ranks=num_ranks, chunks=n, capacity=capacity, rows=rows)
  diff, nondiff, fits = vary_like(diff, nondiff, fits)  # one varying type under shard_map (check_vma=True)
  return fast_or_fallback(functools.partial(pipeline, capacity, rows), functools.partial(pipeline, worst, worst_rows),
                          diff, nondiff, fits)
