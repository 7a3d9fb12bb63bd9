"""A trainable DeepSeek-style mixture-of-experts layer built from the :mod:`jaxkern.moe` ops.

Forward (docs/moe.md, "The pipeline"), for ``T`` tokens of width ``H``, ``E`` routed and ``S`` shared
experts, ``K`` routed slots per token:

1. router logits ``x @ router`` in float32, then :func:`jaxkern.moe.top2_sum_gate`: scores, the
   balancing bias (ranking only), optional group-limited top-``K``, normalised weights times
   ``routed_scaling_factor``, and the ``S`` shared experts appended as slots ``E..E+S-1`` of weight 1;
2. :func:`jaxkern.moe.get_fused_mapping` with the static upper bound of fused rows
   (``force_no_sync=True``, so it runs under ``jax.jit``): every one of the ``E+S`` experts owns a
   contiguous segment of rows, its token count rounded up to ``alignment``;
3. :func:`jaxkern.moe.expand_to_fused` copies each token into its experts' rows (padding rows zero); with
   ``MoeConfig.fp8_expand`` the tokens are first cast per token to FP8 e4m3 (:func:`jaxkern.quant.per_token_cast`,
   groups of 128), the FP8 rows and their scales expanded (:func:`jaxkern.moe.expand_to_fused_with_sf`) and
   dequantised for the matmuls (:func:`jaxkern.quant.per_token_cast_back`), a straight-through ``custom_vjp``;
4. SwiGLU experts on the fused rows, one grouped matmul per projection (``jax.lax.ragged_dot``
   through :func:`jaxkern.modeling._grouped_matmul.grouped_matmul`): ``silu(x Wg) * (x Wu) @ Wd``, the activation
   in float32 or, with ``MoeConfig.fp8_swiglu``, :func:`jaxkern.modeling.swiglu` (fused FP8 kernels); with
   ``MoeConfig.fp8_gemm`` the matmuls are FP8 grouped GEMMs instead (:func:`jaxkern.modeling.fp8_grouped_linear`,
   gate and up in one, FP8 forward and backward; ``alignment=128``, the expert of each 128-row block from the
   mapping);
5. :func:`jaxkern.moe.reduce_fused` sums each token's expert outputs times its routing weights.

All functions are plain functions of a params pytree (:class:`MoeParams`) and a static
:class:`MoeConfig`: they compose with ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (e.g. over a batch
of token blocks with shared params). Each op runs the implementation chosen by ``implementation=``
or the active setting (:mod:`jaxkern._config`): the Pallas kernels on a GPU, the ``jnp`` references
with ``"auto"`` on a CPU. Gradients flow through the routing weights into the router and ``x``
(the expert choice itself has no derivative) and through the expert matmuls.

:func:`moe_layer_dense` computes the same function densely (every expert on every token, weighted
by the routing weights, zero for unrouted experts) from the same routing: the check for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from jaxkern import _checks, _config, moe, quant
from jaxkern.modeling._fp8_linear import fp8_grouped_linear
from jaxkern.modeling._grouped_matmul import grouped_matmul
from jaxkern.modeling._swiglu import swiglu
from jaxkern.moe._expand_to_fused import _sum_slots
from jaxkern.types import QuantTensor, TopkRouting

FP8_EXPAND_GROUP = 128  # columns per scale of the FP8 tokens (upstream's per-token activation cast)
FP8_GEMM_BLOCK = 128  # rows per expert block, K step and weight-scale block of the FP8 grouped GEMMs
# Recommended MoeConfig.ep_capacity_factor (the default is None, off: an opt-in, see the field's docstring): the
# expert-parallel layer's fast path sizes each device's fused rows for up to 1.25x the mean routed slots per device
# (plus alignment padding). With near-balanced routing the busiest device's load is within a few percent of the mean
# (the aux-loss-free bias of balance_router_bias keeps it so in training: it steers every expert towards the mean
# load), so 25% covers it with room for the fluctuations of a young router, while the rows every fused-row op walks
# stay at 1.25·K / (P·min(K, E/P)) of the worst case's (0.63 of it for K = 4, E/P = 4, P = 2). A step whose routing
# needs more takes the exact worst-case fallback (slower, same result), so the value trades speed only, never
# correctness.
EP_CAPACITY_FACTOR = 1.25
EP_COMBINE_DTYPES = ("float32", "bfloat16")  # MoeConfig.ep_combine_dtype
EP_EXCHANGES = ("all_gather", "all_to_all")  # MoeConfig.ep_exchange


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Static routing options of :func:`moe_layer` (the arguments of :func:`jaxkern.moe.top2_sum_gate`).

  Attributes:
    num_experts: routed experts ``E`` (a multiple of 4).
    num_topk: routed slots ``K`` per token.
    num_shared_experts: shared experts ``S`` (0, 1 or 2; with ``S > 0``, ``K % S == 0`` and
      ``E % (K / S) == 0``); every token uses them with weight 1.
    num_groups, num_topk_groups: group-limited routing (both 0: off).
    scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"``.
    routed_scaling_factor: multiplies the routed weights.
    alignment: rows per expert segment are rounded up to this (128 matches the GPU grouped GEMMs'
      tiles; small values waste fewer padding rows on a CPU).
    fp8_swiglu: the experts' activation is :func:`jaxkern.modeling.swiglu` (the fused FP8 forward and backward
      kernels, e4m3 numerics: the activation and its gradient carry e4m3 rounding errors of up to 2^-4 relative)
      instead of ``silu(gate) * up`` in float32; needs the intermediate width ``I % 128 == 0``.
    fp8_expand: the experts see FP8 e4m3 per-token activations: :func:`expand_fp8` (cast per token with groups
      of 128, expand data and scales, dequantise to the tokens' dtype) instead of :func:`jaxkern.moe.expand_to_fused`;
      each expanded element carries the e4m3 rounding of its group (relative error at most 2^-4); the backward
      is straight-through (the slot sums of ``expand_to_fused``'s backward). Needs ``H % 128 == 0``.
    fp8_gemm: the experts' matmuls run :func:`jaxkern.modeling.fp8_grouped_linear` (FP8 e4m3 forward and both
      backward GEMMs, DeepSeek-V3's recipe: per-token 1x128 activation and 128x128 weight scales, float32
      accumulation) on the fused rows instead of ``jax.lax.ragged_dot``: one GEMM for gate and up together
      (``[Wg | Wu]``, N = 2I) and one for down; see :func:`swiglu_experts`. Needs ``alignment == 128`` and
      ``H % 128 == 0``, ``I % 128 == 0`` (ValueError otherwise). Every GEMM operand carries e4m3 rounding (up to
      2^-4 relative per element); the gradients are straight-through (those of the unquantised product on the
      rounded operands). The params layout is unchanged: the GEMMs take the ``(G, K, N)`` weights as stored
      (``weight_layout="kn"``).
    ep_capacity_factor: only for the expert-parallel layer :func:`jaxkern.modeling.sharding.moe_layer_ep` (the
      unsharded layer ignores it): each device's fused rows are sized for ``ep_capacity_factor`` times the mean
      routed slots per device, ``T·K/P`` (plus alignment padding), instead of the worst case ``T·min(K, E/P)``
      (every token's slots on one device); a step whose routing needs more rows on some device runs the worst-case
      layout instead (an exact fallback: no token is dropped, the function is the same; see the module docstring
      of :mod:`jaxkern.modeling.sharding`). ``None`` (the default) or 0: always the worst case. Recommended:
      :data:`EP_CAPACITY_FACTOR` (1.25; the reason is beside it). Off by default, an opt-in: both branches compile
      (more compile time and reserved memory) and on GPUs XLA runs each ``lax.cond`` after copying its predicate to
      the host. Measured (2 H200s, 2026-11-27, the v3 benchmark step): 24.00 ms pipelined with 1.25 against 24.82 ms
      without (``benchmarks/NOTES.md``, expert-parallel scaling); 1.76x faster for the layer's gradient on 2 simulated
      CPU devices. Must be non-negative. With ``ep_exchange="all_to_all"`` it also sizes the per-destination send
      buffers (:mod:`jaxkern.modeling._ep_exchange`, "Capacity"), with the same exact fallback.
    ep_combine_dtype: only for :func:`jaxkern.modeling.sharding.moe_layer_ep`: the dtype of each device's routed
      partial sums, ``(T, H)``, that the ``psum_scatter`` adds over the devices (and of their cotangents, which the
      backward all-gathers). ``"float32"`` (the default): the experts' outputs are cast to float32 before
      :func:`jaxkern.moe.reduce_fused` and the devices' partials are summed in float32, one rounding to the tokens'
      dtype at the end. ``"bfloat16"``: :func:`jaxkern.moe.reduce_fused` sums each device's slots in float32 and
      rounds them to bfloat16 (float32 experts' outputs are rounded to bfloat16 first), and the exchange adds bfloat16
      partials (DeepSeek-V3's bf16 combine): half the exchanged bytes, and no float32 copy of the fused rows in either
      pass, for up to ``P`` more bfloat16 roundings (the partials and their sums; the shared experts' sum stays
      float32). The backward is unchanged in value for bfloat16 tokens (their cotangent is a bfloat16 value
      already). Measured: 0.9 ms off the v3 benchmark step on 2 H200s (``benchmarks/NOTES.md``, expert-parallel
      scaling; 2026-11-27).
    ep_exchange: only for :func:`jaxkern.modeling.sharding.moe_layer_ep`: how the tokens reach the devices of their
      experts. ``"all_gather"`` (the default): every token to every device, the partial sums back by a
      ``psum_scatter``. ``"all_to_all"``: each token once to each device that holds at least one of its experts, in
      per-destination buffers of a static capacity (``ep_capacity_factor``; the worst case, every token to every
      device, as the exact fallback), each device's routing-weighted sums of its slots back by the transposed
      ``all_to_all`` (:mod:`jaxkern.modeling._ep_exchange`). The same function (the per-device partial sums are the
      same; their sum over the devices is taken in another order).
    ep_exchange_chunks: only with ``ep_exchange="all_to_all"``: the local tokens are exchanged and computed in this
      many equal chunks, each with its own ``all_to_all`` pair, so that XLA can run one chunk's exchange while the
      experts work on another's; the tokens per device must be a multiple of it. The same function: the outputs and
      the tokens' gradients are bit-equal where the ops' arithmetic does not depend on the row count; with
      ``fp8_gemm`` the weight-gradient GEMMs quantise each chunk's rows on their own, so the expert weights' gradients
      carry other FP8 roundings (0.6% of the largest element apart from one chunk, references on a CPU,
      2026-11-29).
  """

  num_experts: int
  num_topk: int
  num_shared_experts: int = 0
  num_groups: int = 0
  num_topk_groups: int = 0
  scoring_func: str = "sigmoid"
  routed_scaling_factor: float = 1.0
  alignment: int = 128
  fp8_swiglu: bool = False
  fp8_expand: bool = False
  fp8_gemm: bool = False
  ep_capacity_factor: float | None = None
  ep_combine_dtype: str = "float32"
  ep_exchange: str = "all_gather"
  ep_exchange_chunks: int = 1

  def __post_init__(self):
    if self.ep_exchange not in EP_EXCHANGES:
      raise ValueError(f"MoeConfig.ep_exchange must be one of {EP_EXCHANGES}, got {self.ep_exchange!r}")
    c = self.ep_exchange_chunks
    if not (isinstance(c, int) and not isinstance(c, bool) and c >= 1):
      raise ValueError(f"MoeConfig.ep_exchange_chunks must be an int >= 1, got {c!r}")
    if self.ep_combine_dtype not in EP_COMBINE_DTYPES:
      raise ValueError(f"MoeConfig.ep_combine_dtype must be one of {EP_COMBINE_DTYPES}, got {self.ep_combine_dtype!r}")
    f = self.ep_capacity_factor
    if f is not None and not (isinstance(f, (int, float)) and 0 <= f < float("inf")):
      raise ValueError(f"MoeConfig.ep_capacity_factor must be None or a finite number >= 0, got {f!r}")
    if self.fp8_gemm and self.alignment != FP8_GEMM_BLOCK:
      raise ValueError(f"MoeConfig.alignment must be {FP8_GEMM_BLOCK} with fp8_gemm=True (the FP8 grouped GEMM "
                       f"takes one expert per {FP8_GEMM_BLOCK}-row block), got {self.alignment}")

  @property
  def num_all_experts(self) -> int:
    """``E + S``: the experts that own weights and fused-row segments."""
    return self.num_experts + self.num_shared_experts


class MoeParams(NamedTuple):
  """Parameters of :func:`moe_layer` (``H`` hidden, ``I`` intermediate width, ``E + S`` experts).

  ``router_bias`` is a buffer, not a trained parameter: it only shifts which experts are picked
  (aux-loss-free load balancing, updated by :func:`balance_router_bias`), so :func:`moe_layer` stops
  its gradient and ``jax.grad`` returns zeros for it (an optimiser then leaves it unchanged).
  """

  router: jax.Array  # (H, E) float32
  router_bias: jax.Array  # (E,) float32
  w_gate: jax.Array  # (E+S, H, I)
  w_up: jax.Array  # (E+S, H, I)
  w_down: jax.Array  # (E+S, I, H)


def init_moe_params(key: jax.Array, config: MoeConfig, hidden: int, intermediate: int,
                    dtype: jax.typing.DTypeLike = jnp.bfloat16) -> MoeParams:
  """Random :class:`MoeParams`: normal weights scaled by ``1/sqrt(fan_in)`` (router float32, experts
  ``dtype``), zero bias. ``hidden`` must be a multiple of 256 for :func:`jaxkern.moe.reduce_fused`."""
  k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
  e = config.num_all_experts

  def normal(k, shape, fan_in, dtype):
    return (jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)

  return MoeParams(router=normal(k_router, (hidden, config.num_experts), hidden, jnp.float32),
                   router_bias=jnp.zeros((config.num_experts,), jnp.float32),
                   w_gate=normal(k_gate, (e, hidden, intermediate), hidden, dtype),
                   w_up=normal(k_up, (e, hidden, intermediate), hidden, dtype),
                   w_down=normal(k_down, (e, intermediate, hidden), intermediate, dtype))


def _shared_expert_tables(config: MoeConfig) -> dict:
  """``top2_sum_gate``'s identity replica map (``S + 1`` columns, one replica each) for shared experts."""
  if not config.num_shared_experts:
    return {}
  e, s = config.num_all_experts, config.num_shared_experts
  return dict(use_shared_as_routed=True, num_shared_experts=s,
              to_physical_map=jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32)[:, None], (e, s + 1)),
              logical_count=jnp.ones((e,), jnp.int32))


def route_tokens(params: MoeParams, x: jax.Array, *, config: MoeConfig,
                 implementation: str | None = None) -> TopkRouting:
  """The experts of each token and their weights.

  Args:
    params: :class:`MoeParams`.
    x: ``(T, H)`` float32 or bfloat16 tokens.
    config: :class:`MoeConfig`.
    implementation: passed to :func:`jaxkern.moe.top2_sum_gate`.

  Returns:
    :class:`jaxkern.types.TopkRouting`: ``topk_idx`` ``(T, K+S)`` int32 (routed experts best first,
    then the shared experts ``E..E+S-1``) and ``topk_weights`` ``(T, K+S)`` float32 (differentiable
    in ``params.router`` and ``x``; 1 for the shared slots).
  """
  logits = x.astype(jnp.float32) @ params.router
  return moe.top2_sum_gate(
      logits, lax.stop_gradient(params.router_bias), config.num_topk, scoring_func=config.scoring_func,
      num_groups=config.num_groups, num_topk_groups=config.num_topk_groups,
      routed_scaling_factor=config.routed_scaling_factor, **_shared_expert_tables(config),
      implementation=implementation)


def _group_sizes(mapping: moe.FusedMapping) -> jax.Array:
  """``(E+S,)`` int32 rows per expert covering all ``N`` fused rows in order: each expert's aligned
  segment, and the unused rows past the last segment (zeros, read by no slot) added to the last
  expert, so that the group sizes sum to ``N`` as ``ragged_dot`` expects."""
  tail = mapping.pos_to_expert.shape[0] - mapping.expert_end[-1]
  return mapping.num_tokens_per_expert.at[-1].add(tail)


def fused_block_experts(pos_to_expert: jax.Array) -> jax.Array:
  """``(N/128,)`` int32 expert of each 128-row block of a fused mapping with ``alignment=128``, -1 for the unused
  blocks past the last segment (the ``block_expert`` of :func:`jaxkern.modeling.fp8_grouped_linear`): each
  segment starts on a block boundary with a real row, so the first row of a block names its expert."""
  n = pos_to_expert.shape[0]
  if n % FP8_GEMM_BLOCK:
    raise ValueError(f"pos_to_expert must have a multiple of {FP8_GEMM_BLOCK} rows (alignment {FP8_GEMM_BLOCK}), "
                     f"got {n}")
  return pos_to_expert[::FP8_GEMM_BLOCK].astype(jnp.int32)


def _block_experts_from_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """``(N/128,)`` expert of each 128-row block of rows grouped by ``group_sizes`` (each a multiple of 128
  but the last); blocks past the sizes' sum are -1."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = jnp.arange(0, num_rows, FP8_GEMM_BLOCK, dtype=jnp.int32)
  ids = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
  return jnp.where(ids < group_sizes.shape[0], ids, -1)


def _check_fp8_gemm_widths(xf, params):
  h, i = xf.shape[1], params.w_gate.shape[2]
  if h % FP8_GEMM_BLOCK or i % FP8_GEMM_BLOCK:
    raise ValueError(f"fp8_gemm needs the hidden width H and the intermediate width I to be multiples of "
                     f"{FP8_GEMM_BLOCK}, got H={h}, I={i}")
  if xf.shape[0] % FP8_GEMM_BLOCK:
    raise ValueError(f"fp8_gemm needs a multiple of {FP8_GEMM_BLOCK} fused rows (alignment {FP8_GEMM_BLOCK}), "
                     f"got {xf.shape[0]}")


def _fp8_experts(xf, params, block_expert, fp8_swiglu, implementation):
  """The FP8 GEMM path of :func:`swiglu_experts` (see there)."""
  i = params.w_gate.shape[2]
  # The params' (G, K, N) layout as it is (no bf16 transposes of the weights or their gradients).
  linear = functools.partial(fp8_grouped_linear, weight_layout="kn", implementation=implementation)
  x16, w_gate, w_up, w_down = xf.astype(jnp.bfloat16), params.w_gate, params.w_up, params.w_down
  w_gate_up = jnp.concatenate([w_gate, w_up], axis=2)  # (G, H, 2I)
  gate_up = linear(x16, w_gate_up, block_expert)  # (N, 2I) bf16: [gate | up]
  if fp8_swiglu:
    act = swiglu(gate_up, implementation=implementation)
  else:
    g32, u32 = gate_up[:, :i].astype(jnp.float32), gate_up[:, i:].astype(jnp.float32)
    act = jax.nn.silu(g32) * u32
  out = linear(act.astype(jnp.bfloat16), w_down, block_expert)  # (N, H)
  return out.astype(xf.dtype)


def _check_group_sizes(group_sizes, num_rows: int, *, aligned: bool) -> None:
  """The preconditions of :func:`swiglu_experts` on ``group_sizes`` (see there)."""
  op = "swiglu_experts"
  _checks.check_and_debug_check(op, "group_sizes", group_sizes, lambda v: v < 0, "a row count >= 0")
  if aligned and group_sizes.shape[0] > 1:
    _checks.check_and_debug_check(
        op, "group_sizes", group_sizes[:-1], lambda v: v % FP8_GEMM_BLOCK != 0,
        f"a multiple of {FP8_GEMM_BLOCK} (every segment but the last; fp8_gemm derives block_expert from them)")
  want = f"group_sizes must sum to N = xf.shape[0] = {num_rows}"
  if _checks.is_traced(group_sizes):
    total = jnp.sum(group_sizes)
    checkify.debug_check(total == num_rows, f"{op}: {want}, got {{}}", total)
  elif (total := int(np.asarray(group_sizes).sum())) != num_rows:  # on the host: also inside a jit that closes over it
    raise ValueError(f"{want}, got {total}")


def swiglu_experts(xf: jax.Array, params: MoeParams, group_sizes: jax.Array, *, fp8_swiglu: bool = False,
                   fp8_gemm: bool = False, block_expert: jax.Array | None = None,
                   implementation: str | None = None) -> jax.Array:
  """``silu(x Wg) * (x Wu) @ Wd`` of each fused row with its expert's weights.

  Args:
    xf: ``(N, H)`` fused rows, expert-major.
    params: :class:`MoeParams` (the expert weights, of ``xf.dtype``).
    group_sizes: ``(E+S,)`` int32 rows of each expert's segment, summing to ``N``.
    fp8_swiglu: the activation is :func:`jaxkern.modeling.swiglu` of ``[x Wg | x Wu]`` (FP8 e4m3 numerics, fused
      kernels; ``I % 128 == 0``); otherwise the SwiGLU product in float32.
    fp8_gemm: the matmuls are :func:`jaxkern.modeling.fp8_grouped_linear` (FP8 e4m3 GEMMs forward and backward)
      instead of ``jax.lax.ragged_dot``: ``[gate | up] = linear(x, [Wg | Wu])`` (one GEMM, N = 2I, the weights
      concatenated per call, ``weight_layout="kn"``: the stored ``(G, K, N)`` layout) and ``linear(act, Wd)``; the
      operands are bfloat16
      (a float32 ``xf`` is rounded to bfloat16 first), the result is cast to ``xf.dtype``. Needs ``N``, ``H``,
      ``I`` multiples of 128 and every expert segment starting on a 128-row boundary (``alignment=128``).
    block_expert: with ``fp8_gemm``, the ``(N/128,)`` int32 expert of each 128-row block, -1 to skip
      (:func:`fused_block_experts` of the mapping); by default derived from ``group_sizes`` (then the rows past
      the last segment, zeros, run as the last expert's).
    implementation: passed to :func:`jaxkern.modeling.swiglu` and :func:`jaxkern.modeling.fp8_grouped_linear`.

  Returns:
    ``(N, H)`` of ``xf.dtype``.

  Preconditions: ``group_sizes`` non-negative and summing to ``N``; with ``fp8_gemm`` and no ``block_expert``,
  every size but the last a multiple of 128. Concrete sizes that break one raise ``ValueError``; traced ones
  give rows computed with the wrong expert's weights (or none), and ``checkify.checkify(f,
  errors=checkify.user_checks)`` reports them (docs/usage.md, "Bad values under jit").

  Raises:
    ValueError: with ``fp8_gemm``, ``N``, ``H`` or ``I`` not multiples of 128; concrete ``group_sizes`` outside the
      preconditions.
  """
  if fp8_gemm:
    _check_fp8_gemm_widths(xf, params)
  _check_group_sizes(group_sizes, xf.shape[0], aligned=fp8_gemm and block_expert is None)
  if fp8_gemm:
    if block_expert is None:
      block_expert = _block_experts_from_sizes(group_sizes, xf.shape[0])
    return _fp8_experts(xf, params, block_expert, fp8_swiglu, implementation)
  gate = grouped_matmul(xf, params.w_gate, group_sizes)
  up = grouped_matmul(xf, params.w_up, group_sizes)
  if fp8_swiglu:
    act = swiglu(jnp.concatenate([gate, up], axis=1), implementation=implementation)
  else:
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(xf.dtype)
  return grouped_matmul(act, params.w_down, group_sizes)


def fp8_expand_cast(x: jax.Array, *, implementation: str | None = None) -> QuantTensor:
  """The per-token cast of :func:`expand_fp8`'s forward: :func:`jaxkern.quant.per_token_cast` of ``x`` ``(T, H)``
  to e4m3 with one float32 scale per 128 columns, ``QuantTensor((T, H) float8_e4m3fn, (T, H/128) float32)``. Row-wise:
  the rows of a cast of stacked tokens are the casts of their rows. Not differentiable (cast ``lax.stop_gradient(x)``
  and carry the gradient as :func:`expand_fp8_quantized` does)."""
  return quant.per_token_cast(x, "e4m3", FP8_EXPAND_GROUP, implementation=implementation)


def _expand_quantized(q, dtype, token_topk_to_pos, pos_to_expert, implementation):
  qf = moe.expand_to_fused_with_sf(q, FP8_EXPAND_GROUP, token_topk_to_pos, pos_to_expert,
                                   implementation=implementation)
  fmt = "bf16" if dtype == jnp.bfloat16 else "fp32"
  return quant.per_token_cast_back(QuantTensor(*qf), fmt, FP8_EXPAND_GROUP, implementation=implementation)


def _fp8_expanded(x, token_topk_to_pos, pos_to_expert, implementation):
  q = fp8_expand_cast(x, implementation=implementation)
  return _expand_quantized(q, x.dtype, token_topk_to_pos, pos_to_expert, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand_fp8(x, token_topk_to_pos, pos_to_expert, implementation):
  return _fp8_expanded(x, token_topk_to_pos, pos_to_expert, implementation)


def _expand_fp8_fwd(x, token_topk_to_pos, pos_to_expert, implementation):
  return _fp8_expanded(x, token_topk_to_pos, pos_to_expert, implementation), token_topk_to_pos


def _expand_fp8_bwd(implementation, token_topk_to_pos, d_out):
  return _sum_slots("expand_fp8.bwd", d_out, token_topk_to_pos, implementation), None, None


_expand_fp8.defvjp(_expand_fp8_fwd, _expand_fp8_bwd)


def expand_fp8(x: jax.Array, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array, *,
               implementation: str | None = None) -> jax.Array:
  """The fused rows of FP8 e4m3 per-token activations, dequantised: a trainable ``expand_to_fused``.

  Forward: :func:`jaxkern.quant.per_token_cast` of ``x`` (e4m3, one float32 scale per 128 columns), then
  :func:`jaxkern.moe.expand_to_fused_with_sf` (the FP8 rows and their scale rows copied to the fused rows,
  padding rows zero), then :func:`jaxkern.quant.per_token_cast_back` to ``x.dtype``: the matmul input an FP8
  grouped GEMM would see, in ``x``'s dtype (``jax.lax.ragged_dot`` has no FP8 path here). Each element is
  ``RN(e4m3(x / s) · s)``: relative error at most 2^-4 (plus underflow below 2^-9 of its group's scale).

  Backward (``jax.custom_vjp``): straight-through, the cotangent of :func:`jaxkern.moe.expand_to_fused`
  (``dx[t] = Σ_k dy[token_topk_to_pos[t, k]]``, float32 sums rounded once: its ``reduce_fused`` kernel).

  Args:
    x: ``(T, H)`` bfloat16 or float32, ``H % 128 == 0``.
    token_topk_to_pos, pos_to_expert: as :func:`jaxkern.moe.expand_to_fused`.
    implementation: passed to every op, forward and backward.

  Returns:
    ``(N, H)`` of ``x.dtype``.

  Raises:
    ValueError: ``H % 128 != 0``, and as the ops.
  """
  if x.ndim != 2 or x.shape[1] % FP8_EXPAND_GROUP:
    raise ValueError(f"x must be (T, H) with H % {FP8_EXPAND_GROUP} == 0 for the FP8 expand, got {tuple(x.shape)}")
  return _expand_fp8(x, token_topk_to_pos, pos_to_expert, _config.get_implementation(implementation))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _expand_fp8_quantized(anchor, data, sf, token_topk_to_pos, pos_to_expert, implementation):
  return _expand_quantized(QuantTensor(data, sf), anchor.dtype, token_topk_to_pos, pos_to_expert, implementation)


def _expand_fp8_quantized_fwd(anchor, data, sf, token_topk_to_pos, pos_to_expert, implementation):
  out = _expand_quantized(QuantTensor(data, sf), anchor.dtype, token_topk_to_pos, pos_to_expert, implementation)
  return out, token_topk_to_pos


def _expand_fp8_quantized_bwd(implementation, token_topk_to_pos, d_out):
  return _sum_slots("expand_fp8.bwd", d_out, token_topk_to_pos, implementation), None, None, None, None


_expand_fp8_quantized.defvjp(_expand_fp8_quantized_fwd, _expand_fp8_quantized_bwd)


def expand_fp8_quantized(anchor: jax.Array, x_fp8: QuantTensor, token_topk_to_pos: jax.Array,
                         pos_to_expert: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """:func:`expand_fp8` of tokens already cast (:func:`fp8_expand_cast`), with the gradient carried by ``anchor``.

  Forward: :func:`jaxkern.moe.expand_to_fused_with_sf` of ``x_fp8`` and :func:`jaxkern.quant.per_token_cast_back`
  to ``anchor.dtype``: the value of ``expand_fp8(x, ...)`` when ``x_fp8 = fp8_expand_cast(x)``. ``anchor``'s value is
  never read (only its shape and dtype): it stands for the unquantised tokens ``x`` in the backward, which is
  :func:`expand_fp8`'s (straight-through: ``d anchor[t] = Σ_k d_out[token_topk_to_pos[t, k]]``, float32 sums rounded
  once to ``d_out``'s dtype); ``x_fp8`` gets no gradient. Used by the expert-parallel layer
  (:func:`jaxkern.modeling.sharding.moe_layer_ep`) to all-gather FP8 tokens, ``anchor`` the zeros whose backward is the
  ``psum_scatter`` of the all-gather it replaces.

  Args:
    anchor: ``(T, H)`` bfloat16 or float32, ``H % 128 == 0``: the dtype of the result; its gradient is the tokens'.
    x_fp8: ``QuantTensor((T, H) float8_e4m3fn, (T, H/128) float32)`` (:func:`fp8_expand_cast`).
    token_topk_to_pos, pos_to_expert: as :func:`jaxkern.moe.expand_to_fused`.
    implementation: passed to every op, forward and backward.

  Returns:
    ``(N, H)`` of ``anchor.dtype``.

  Raises:
    ValueError: ``anchor`` not ``(T, H)`` with ``H % 128 == 0``, ``x_fp8.data`` of another shape, and as the ops.
  """
  if anchor.ndim != 2 or anchor.shape[1] % FP8_EXPAND_GROUP:
    raise ValueError(f"anchor must be (T, H) with H % {FP8_EXPAND_GROUP} == 0 for the FP8 expand, "
                     f"got {tuple(anchor.shape)}")
  if not isinstance(x_fp8, tuple) or len(x_fp8) != 2 or tuple(x_fp8[0].shape) != tuple(anchor.shape):
    raise ValueError(f"x_fp8 must be a QuantTensor (data, sf) with data of anchor's shape {tuple(anchor.shape)}")
  return _expand_fp8_quantized(anchor, x_fp8[0], x_fp8[1], token_topk_to_pos, pos_to_expert,
                               _config.get_implementation(implementation))


def apply_experts(params: MoeParams, x: jax.Array, routing: TopkRouting, *, config: MoeConfig,
                  implementation: str | None = None) -> jax.Array:
  """The routing-weighted sum of each token's expert outputs, through the fused layout.

  Args:
    params: :class:`MoeParams`.
    x: ``(T, H)`` float32 or bfloat16 tokens (the dtype of the expert weights), ``H`` a multiple of 256.
    routing: :class:`jaxkern.types.TopkRouting` of :func:`route_tokens`.
    config: :class:`MoeConfig`.
    implementation: passed to every :mod:`jaxkern.moe` op.

  Returns:
    ``(T, H)`` of ``x.dtype``.
  """
  mapping = moe.get_fused_mapping(routing.topk_idx, config.num_all_experts, 0, config.alignment,
                                  force_no_sync=True, implementation=implementation)
  expand = expand_fp8 if config.fp8_expand else moe.expand_to_fused
  xf = expand(x, mapping.token_topk_to_pos, mapping.pos_to_expert, implementation=implementation)
  block_expert = fused_block_experts(mapping.pos_to_expert) if config.fp8_gemm else None
  yf = swiglu_experts(xf, params, _group_sizes(mapping), fp8_swiglu=config.fp8_swiglu, fp8_gemm=config.fp8_gemm,
                      block_expert=block_expert, implementation=implementation)
  return moe.reduce_fused(yf, routing.topk_weights, mapping.token_topk_to_pos, implementation=implementation)


def moe_layer(params: MoeParams, x: jax.Array, *, config: MoeConfig, implementation: str | None = None) -> jax.Array:
  """The MoE layer: :func:`route_tokens`, then :func:`apply_experts`.

  Args:
    params: :class:`MoeParams` (experts of ``x.dtype``).
    x: ``(T, H)`` float32 or bfloat16 tokens, ``H`` a multiple of 256; ``T = 0`` allowed.
    config: :class:`MoeConfig` (static).
    implementation: passed to every :mod:`jaxkern.moe` op (see :mod:`jaxkern._config`).

  Returns:
    ``(T, H)`` of ``x.dtype``.
  """
  routing = route_tokens(params, x, config=config, implementation=implementation)
  return apply_experts(params, x, routing, config=config, implementation=implementation)


def apply_experts_dense(params: MoeParams, x: jax.Array, routing: TopkRouting, *, config: MoeConfig) -> jax.Array:
  """:func:`apply_experts` computed densely: every expert on every token, summed with the routing
  weights scattered into a ``(T, E+S)`` matrix (zero for the experts a token does not use). Costs
  ``E+S`` times the expert compute of a token: for tests."""
  weights = jnp.einsum("tk,tke->te", routing.topk_weights,
                       jax.nn.one_hot(routing.topk_idx, config.num_all_experts, dtype=jnp.float32))
  f32 = dict(preferred_element_type=jnp.float32)
  gate = jnp.einsum("th,ehi->eti", x, params.w_gate, **f32).astype(x.dtype).astype(jnp.float32)
  up = jnp.einsum("th,ehi->eti", x, params.w_up, **f32).astype(x.dtype).astype(jnp.float32)
  out = jnp.einsum("eti,eih->eth", (jax.nn.silu(gate) * up).astype(x.dtype), params.w_down, **f32)
  return jnp.einsum("te,eth->th", weights, out.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def moe_layer_dense(params: MoeParams, x: jax.Array, *, config: MoeConfig,
                    implementation: str | None = None) -> jax.Array:
  """:func:`moe_layer` with :func:`apply_experts_dense`: the same routing, the same function."""
  routing = route_tokens(params, x, config=config, implementation=implementation)
  return apply_experts_dense(params, x, routing, config=config)


def balance_router_bias(router_bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free load balancing (DeepSeek-V3): ``bias + rate * sign(mean load - load)``.

  Args:
    router_bias: ``(E,)`` float32, :attr:`MoeParams.router_bias`.
    tokens_per_expert: ``(E,)`` routed tokens of each expert in the last step (e.g.
      ``jaxkern.moe.group_count(routing.topk_idx, E)``).
    rate: the bias step.

  Returns:
    ``(E,)`` float32: overloaded experts ranked lower, underloaded ones higher.
  """
  load = tokens_per_expert.astype(jnp.float32)
  return router_bias + rate * jnp.sign(jnp.mean(load) - load)
