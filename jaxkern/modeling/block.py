"""A small trainable model built only from public jaxkern ops and ``jax.lax.ragged_dot``, and its training step.

Per layer ``l`` (``L`` layers), on ``T = B·S`` tokens with ``M = 4`` mHC residual streams of width ``H``:

1. **Engram** (:func:`engram_memory`): the n-grams ending at each token (``N`` tokens, the current one first) are
   hashed into ``(N-1)·E`` rows of layer ``l``'s embedding table (:func:`jaxkern.engram.engram_hash` with
   :func:`jaxkern.engram.make_offsets`, x64 off); the fetched rows, concatenated, are projected to a key per stream
   ``k (T, M, H)`` and a value ``v (T, H)``, and :func:`jaxkern.modeling.engram_gate` adds the gated value to every
   stream: ``R <- R + σ(signed_sqrt(<RMSNorm(R), RMSNorm(k)>/√H))·v``.
2. :func:`jaxkern.modeling.mhc_pre`: the sublayer input ``x (T, H)`` and the mixes.
3. **MoE FFN** (:func:`moe_ffn`, i.e. :func:`jaxkern.modeling.moe_layer`): router logits ->
   :func:`jaxkern.moe.top2_sum_gate` -> :func:`jaxkern.moe.get_fused_mapping` -> FP8 per-token activations expanded
   to the fused layout (``MoeConfig(fp8_expand=True)``: :func:`jaxkern.modeling.moe.expand_fp8`) -> grouped
   matmuls (``jax.lax.ragged_dot``) -> the fused FP8 SwiGLU (``MoeConfig(fp8_swiglu=True)``:
   :func:`jaxkern.modeling.swiglu`) -> down projection -> :func:`jaxkern.moe.reduce_fused`.
4. :func:`jaxkern.modeling.mhc_post`: the new residual streams.

Below the layers the token embedding is copied into the streams (:func:`jaxkern.modeling.expand_from_embedding`);
above them :func:`jaxkern.modeling.mhc_head` mixes the streams into one hidden state, which is RMS-normalised (no
weight) and read out linearly to the logits. The model has no attention: the context a token sees is its n-gram memory (Engram), so a next-token
task on sequences with repeated phrases (:func:`synthetic_batch`) is one where Engram helps.

Everything is a plain function of a params pytree (NamedTuples of float32 master weights, cast to bfloat16 where
the kernels take bfloat16) and a static :class:`BlockConfig`. ``implementation=`` is passed to every jaxkern op,
forward and backward: ``"reference"`` is the same model with every jaxkern op replaced by its ``jnp`` reference
(:mod:`jaxkern.reference`), ``"xla"`` the ops' XLA paths, ``"interpret"`` the Pallas kernels in interpret mode
(ops without a kernel run their XLA code), ``"pallas"`` / ``"auto"`` the compiled kernels on a GPU. ``jax.lax.ragged_dot``
(the expert matmuls) and the plain ``jnp`` glue (embedding gathers, projections, readout, loss) are the same in
all of them. :func:`jaxkern.explain` lists what each op call runs.

``moe_fn`` (keyword of :func:`model_apply`, :func:`loss_fn`, :func:`train_step`) replaces the MoE FFN of every
layer: any ``moe_fn(params: MoeParams, x (T, H) bf16, *, config: MoeConfig, implementation) -> (T, H)`` with the
semantics of :func:`moe_ffn` (e.g. :func:`moe_ffn_ep`, the expert-parallel one, with ``mesh_axis`` bound).

**Sharded step** (:func:`sharded_train_step`): :func:`train_step` under a :class:`jax.sharding.Mesh`, data parallel
over the batch's sequences and expert parallel over each layer's routed experts (:func:`moe_ffn_ep` inside one
``jax.shard_map``, :mod:`jaxkern.modeling.sharding`); :func:`ep_params` / :func:`merge_ep_params` split the shared
experts from the routed ones and back, :func:`block_param_specs` gives the params' ``PartitionSpec`` s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxkern import _config, engram, moe
from jaxkern.modeling.engram import engram_gate
from jaxkern.modeling._optimizer import apply_updates, cross_entropy_with_integer_labels
from jaxkern.modeling.mhc import expand_from_embedding, mhc_head, mhc_post, mhc_pre
from jaxkern.modeling.moe import MoeConfig, MoeParams, balance_router_bias, init_moe_params, moe_layer, route_tokens
from jaxkern.modeling.sharding import (MoeEpParams, make_sharded_train_step, merge_shared_experts, moe_layer_ep,
                                       moe_param_specs, split_shared_experts)

MoeFn = Callable[..., jax.Array]
GradientTransformation = Any  # an ``optax.GradientTransformation`` (``init`` / ``update``); optax is not needed here


def _default_moe() -> MoeConfig:
  return MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, alignment=16, fp8_swiglu=True, fp8_expand=True)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static sizes and options of the model (hashable: a static argument of ``jax.jit``).

  Attributes:
    vocab_size: token ids ``[0, V)``.
    hidden: ``H``; the kernels need ``H % 256 == 0`` and (mHC stream kernels) ``H >= 1024``.
    intermediate: the experts' width ``I`` (``I % 128 == 0`` with ``moe.fp8_swiglu``).
    num_layers: ``L``.
    moe: the :class:`jaxkern.modeling.MoeConfig` of every layer's MoE FFN.
    mhc_mult: residual streams ``M`` (only 4 is supported by the mHC ops).
    sinkhorn_repeat: Sinkhorn iterations of ``mhc_pre``.
    norm_eps: RMSNorm epsilon of ``mhc_pre`` / ``mhc_head``.
    engram_max_ngram: ``N``: n-grams of orders 2..N (``N >= 2``).
    engram_tables: ``E``: hash tables per order and layer.
    engram_table_size: the tables' sizes are distinct primes from this value up.
    engram_embed_dim: ``De``, the width of one table row.
    engram_clamp, engram_eps: the Engram gate's signed-sqrt clamp and RMSNorm epsilon.
    engram_seed: seeds the hash multipliers (fixed per config: part of the model, not trained).
    router_bias_rate: the step of :func:`jaxkern.modeling.balance_router_bias` in :func:`train_step` (0: off;
      with a rate, :func:`train_step` routes each layer's input once more to count the load).
    fp8_gemm: the experts' matmuls run in FP8 (:func:`jaxkern.modeling.fp8_grouped_linear`, forward and backward):
      sets ``moe.fp8_gemm`` and ``moe.alignment = 128`` (see :class:`jaxkern.modeling.MoeConfig`); needs
      ``intermediate % 128 == 0``. False leaves ``moe`` as given.
  """

  vocab_size: int = 64
  hidden: int = 1024
  intermediate: int = 128
  num_layers: int = 2
  moe: MoeConfig = dataclasses.field(default_factory=_default_moe)
  mhc_mult: int = 4
  sinkhorn_repeat: int = 10
  norm_eps: float = 1e-6
  engram_max_ngram: int = 3
  engram_tables: int = 2
  engram_table_size: int = 257
  engram_embed_dim: int = 32
  engram_clamp: float = 1e-6
  engram_eps: float = 1e-6
  engram_seed: int = 0
  router_bias_rate: float = 0.0
  fp8_gemm: bool = False

  def __post_init__(self):
    if self.fp8_gemm and not self.moe.fp8_gemm:
      object.__setattr__(self, "moe", dataclasses.replace(self.moe, fp8_gemm=True, alignment=128))
    if self.engram_max_ngram < 2:
      raise ValueError(f"engram_max_ngram must be at least 2, got {self.engram_max_ngram}")
    if self.hidden % 256:
      raise ValueError(f"hidden must be a multiple of 256 (reduce_fused, the Engram gate), got {self.hidden}")
    for name in ("vocab_size", "intermediate", "num_layers", "engram_tables", "engram_table_size", "engram_embed_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

  @property
  def engram_columns(self) -> int:
    """``C = (N-1)·E``: table rows fetched per token and layer."""
    return (self.engram_max_ngram - 1) * self.engram_tables

  def engram_vocab_sizes(self) -> np.ndarray:
    """``(L, N-1, E)`` int32: distinct primes from ``engram_table_size`` up."""
    count = self.num_layers * self.engram_columns
    primes, n = [], max(self.engram_table_size, 2)
    while len(primes) < count:
      if all(n % p for p in range(2, int(n ** 0.5) + 1)):
        primes.append(n)
      n += 1
    return np.asarray(primes, np.int32).reshape(self.num_layers, self.engram_max_ngram - 1, self.engram_tables)

  def engram_multipliers(self) -> np.ndarray:
    """``(L, N)`` int64 odd hash multipliers from ``engram_seed``."""
    rng = np.random.default_rng(self.engram_seed)
    return rng.integers(1, 2 ** 62, size=(self.num_layers, self.engram_max_ngram), dtype=np.int64) | 1


class EngramParams(NamedTuple):
  """One layer's Engram memory (``R`` table rows, ``C = (N-1)·E`` rows fetched per token)."""

  table: jax.Array  # (R, De) float32: the layer's concatenated hash tables
  w_k: jax.Array  # (C·De, M·H) float32: fetched rows -> a key per stream
  w_v: jax.Array  # (C·De, H) float32: fetched rows -> the value
  weight_hidden: jax.Array  # (M, H) float32: RMSNorm weight of the residual streams in the gate
  weight_embed: jax.Array  # (M, H) float32: RMSNorm weight of the keys


class MhcParams(NamedTuple):
  """The mixes of one ``mhc_pre`` (``J = M(M+2)``)."""

  fn: jax.Array  # (J, M·H) float32
  scale: jax.Array  # (3,) float32
  base: jax.Array  # (J,) float32
  norm_weight: jax.Array  # (M·H,) float32


class HeadParams(NamedTuple):
  """``mhc_head``'s mix."""

  fn: jax.Array  # (M, M·H) float32
  scale: jax.Array  # (1,) float32
  base: jax.Array  # (M,) float32


class LayerParams(NamedTuple):
  engram: EngramParams
  mhc: MhcParams
  moe: MoeParams  # float32 master weights; the expert weights are cast to bfloat16 for the matmuls


class BlockParams(NamedTuple):
  embed: jax.Array  # (V, H) float32
  layers: tuple[LayerParams, ...]
  head: HeadParams
  readout: jax.Array  # (H, V) float32


class Batch(NamedTuple):
  tokens: jax.Array  # (B, S) int32 inputs
  targets: jax.Array  # (B, S) int32: the next token of each input


def init_block_params(key: jax.Array, config: BlockConfig) -> BlockParams:
  """Random float32 :class:`BlockParams`: normal weights scaled by ``1/sqrt(fan_in)``, mHC projections small
  (0.01), RMSNorm weights and mix scales 1, biases 0, router bias 0."""
  h, m, v = config.hidden, config.mhc_mult, config.vocab_size
  j, c_de = m * (m + 2), config.engram_columns * config.engram_embed_dim
  rows = [int(r) for r in config.engram_vocab_sizes().reshape(config.num_layers, -1).sum(axis=1)]
  k_embed, k_head, k_out, *k_layers = jax.random.split(key, 3 + config.num_layers)

  def normal(k, shape, std):
    return jax.random.normal(k, shape, jnp.float32) * std

  layers = []
  for k, r in zip(k_layers, rows):
    k_table, k_k, k_v, k_fn, k_moe = jax.random.split(k, 5)
    layers.append(LayerParams(
        engram=EngramParams(table=normal(k_table, (r, config.engram_embed_dim), 1.0),
                            w_k=normal(k_k, (c_de, m * h), c_de ** -0.5), w_v=normal(k_v, (c_de, h), c_de ** -0.5),
                            weight_hidden=jnp.ones((m, h), jnp.float32), weight_embed=jnp.ones((m, h), jnp.float32)),
        mhc=MhcParams(fn=normal(k_fn, (j, m * h), 0.01), scale=jnp.ones((3,), jnp.float32),
                      base=jnp.zeros((j,), jnp.float32), norm_weight=jnp.ones((m * h,), jnp.float32)),
        moe=init_moe_params(k_moe, config.moe, h, config.intermediate, jnp.float32)))
  return BlockParams(embed=normal(k_embed, (v, h), 1.0), layers=tuple(layers),
                     head=HeadParams(fn=normal(k_head, (m, m * h), 0.01), scale=jnp.ones((1,), jnp.float32),
                                     base=jnp.zeros((m,), jnp.float32)),
                     readout=normal(k_out, (h, v), h ** -0.5))


def ngram_token_ids(tokens: jax.Array, max_ngram: int, pad_id: int) -> jax.Array:
  """``(B·S, N)`` int32: row ``b·S + s`` is ``(tokens[b, s], tokens[b, s-1], ..., tokens[b, s-N+1])``, positions
  before the sequence start reading ``pad_id``."""
  b, s = tokens.shape
  padded = jnp.pad(tokens, ((0, 0), (max_ngram - 1, 0)), constant_values=pad_id)
  cols = [padded[:, max_ngram - 1 - n:max_ngram - 1 - n + s] for n in range(max_ngram)]
  return jnp.stack(cols, axis=-1).reshape(b * s, max_ngram).astype(jnp.int32)


def engram_rows(tokens: jax.Array, *, config: BlockConfig, implementation: str | None = None) -> jax.Array:
  """``(L, B·S, C)`` int32: the table row of every (layer, token, order·table), :func:`jaxkern.engram.engram_hash`
  of the n-grams (padding id ``V``, outside the vocabulary) with the config's multipliers and table sizes."""
  sizes = jnp.asarray(config.engram_vocab_sizes())
  offsets = engram.make_offsets(sizes, implementation=implementation)
  ids = ngram_token_ids(tokens, config.engram_max_ngram, config.vocab_size)
  return engram.engram_hash(ids, config.engram_multipliers(), sizes, offsets, implementation=implementation)


def engram_memory(params: EngramParams, residual: jax.Array, rows: jax.Array, *, config: BlockConfig,
                  implementation: str | None = None) -> jax.Array:
  """One layer's Engram: fetched rows -> ``k (T, M, H)``, ``v (T, H)`` (bfloat16) -> :func:`engram_gate` of
  ``residual (T, M, H)`` bfloat16 (returned, same shape)."""
  t, m, h = residual.shape
  fetched = params.table[rows].reshape(t, -1)  # (T, C·De) float32
  k = (fetched @ params.w_k).reshape(t, m, h).astype(jnp.bfloat16)
  v = (fetched @ params.w_v).astype(jnp.bfloat16)
  return engram_gate(residual, k, v, params.weight_hidden, params.weight_embed, clamp_value=config.engram_clamp,
                     eps=config.engram_eps, implementation=implementation)


def moe_ffn(params: MoeParams, x: jax.Array, *, config: MoeConfig, implementation: str | None = None) -> jax.Array:
  """The MoE FFN of a layer, unsharded: :func:`jaxkern.modeling.moe_layer` (gate, fused mapping, FP8 expand,
  grouped matmuls, FP8 SwiGLU, reduce per ``config``) with the expert weights cast to ``x.dtype``.

  Args:
    params: :class:`jaxkern.modeling.MoeParams` (float32 master weights).
    x: ``(T, H)`` bfloat16 sublayer input.
    config: :class:`jaxkern.modeling.MoeConfig`.
    implementation: passed to every op.

  Returns:
    ``(T, H)`` of ``x.dtype``.
  """
  return moe_layer(_cast_experts(params, x.dtype), x, config=config, implementation=implementation)


def _cast_experts(params, dtype):
  """``params`` (:class:`MoeParams` or :class:`~jaxkern.modeling.sharding.MoeEpParams`) with every expert weight
  cast to ``dtype`` (router and bias kept float32)."""
  names = [n for n in params._fields if n not in ("router", "router_bias")]
  return params._replace(**{n: getattr(params, n).astype(dtype) for n in names})


def moe_ffn_ep(params: Any, x: jax.Array, *, config: MoeConfig, mesh_axis: str,
               implementation: str | None = None) -> jax.Array:
  """The expert-parallel MoE FFN of a layer (call inside ``jax.shard_map``, as :func:`model_apply`'s ``moe_fn``
  with ``mesh_axis`` bound): :func:`jaxkern.modeling.sharding.moe_layer_ep` with the expert weights cast to
  ``x.dtype``, as :func:`moe_ffn` does unsharded.

  Args:
    params: this device's :class:`~jaxkern.modeling.sharding.MoeEpParams` (routed experts ``E/P`` of them, shared
      experts and router whole; :func:`ep_params` converts a :class:`BlockParams`), or with no shared experts a
      :class:`MoeParams` of the same local shapes.
    x: ``(T/P, H)`` bfloat16 tokens of this device.
    config, implementation: as :func:`moe_ffn`.
    mesh_axis: the mesh axis that splits the routed experts (and the tokens), as in ``moe_layer_ep``.

  Returns:
    ``(T/P, H)`` of ``x.dtype``.
  """
  return moe_layer_ep(_cast_experts(params, x.dtype), x, config=config, mesh_axis=mesh_axis,
                      implementation=implementation)


def _forward(params: BlockParams, tokens: jax.Array, config: BlockConfig, implementation: str | None,
             moe_fn: MoeFn | None, count_load: bool):
  """``(logits (B, S, V) float32, tokens per routed expert (L, E) int32 or None)``."""
  implementation = _config.get_implementation(implementation)
  moe_fn = moe_ffn if moe_fn is None else moe_fn
  b, s = tokens.shape
  t, m = b * s, config.mhc_mult
  rows = engram_rows(tokens, config=config, implementation=implementation)
  x = params.embed[tokens.reshape(t)].astype(jnp.bfloat16)  # gather, then cast: a float32 scatter-add
  residual = expand_from_embedding(x, m, implementation=implementation)  # (T, M, H) bf16
  loads = []
  for layer, layer_rows in zip(params.layers, rows):
    residual = engram_memory(layer.engram, residual, layer_rows, config=config, implementation=implementation)
    p = layer.mhc
    y, (post_mix, comb_mix) = mhc_pre(residual, p.fn, p.scale, p.base, norm_weight=p.norm_weight,
                                      norm_eps=config.norm_eps, mhc_mult=m, sinkhorn_repeat=config.sinkhorn_repeat,
                                      implementation=implementation)
    if count_load:
      routing = route_tokens(jax.lax.stop_gradient(layer.moe), jax.lax.stop_gradient(y), config=config.moe,
                             implementation=implementation)
      loads.append(moe.group_count(routing.topk_idx, config.moe.num_experts, implementation=implementation))
    out = moe_fn(layer.moe, y, config=config.moe, implementation=implementation)
    residual = mhc_post(out.astype(residual.dtype), residual, post_mix, comb_mix, implementation=implementation)
  head = params.head
  h = mhc_head(residual, head.fn, head.scale, head.base, norm_eps=config.norm_eps, mhc_mult=m,
               implementation=implementation)
  h = h.astype(jnp.float32)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + config.norm_eps)  # RMSNorm without weight
  logits = (h @ params.readout).reshape(b, s, config.vocab_size)
  return logits, (jnp.stack(loads) if count_load else None)


def model_apply(params: BlockParams, tokens: jax.Array, *, config: BlockConfig, implementation: str | None = None,
                moe_fn: MoeFn | None = None) -> jax.Array:
  """The model's next-token logits.

  Args:
    params: :class:`BlockParams` (:func:`init_block_params`).
    tokens: ``(B, S)`` int32 ids in ``[0, V)``; the ``T = B·S`` tokens are routed together.
    config: :class:`BlockConfig` (static).
    implementation: passed to every jaxkern op (module docstring); default the active setting.
    moe_fn: the MoE FFN of every layer (default :func:`moe_ffn`; module docstring).

  Returns:
    ``(B, S, V)`` float32 logits.
  """
  return _forward(params, tokens, config, implementation, moe_fn, count_load=False)[0]


def _loss_and_load(params, batch, config, implementation, moe_fn, count_load):
  logits, load = _forward(params, batch.tokens, config, implementation, moe_fn, count_load)
  losses = cross_entropy_with_integer_labels(logits, batch.targets)
  return jnp.mean(losses), load


def loss_fn(params: BlockParams, batch: Batch, *, config: BlockConfig, implementation: str | None = None,
            moe_fn: MoeFn | None = None) -> jax.Array:
  """Mean next-token cross entropy (float32 scalar) of :func:`model_apply` on ``batch`` (:class:`Batch`)."""
  return _loss_and_load(params, batch, config, implementation, moe_fn, False)[0]


class StepResult(NamedTuple):
  params: BlockParams
  opt_state: Any
  loss: jax.Array  # () float32, before the update
  load: jax.Array | None  # (L, E) int32 routed tokens per expert (with config.router_bias_rate), else None


def train_step(params: BlockParams, opt_state: Any, batch: Batch, *, config: BlockConfig,
               optimizer: GradientTransformation, implementation: str | None = None,
               moe_fn: MoeFn | None = None) -> StepResult:
  """One optimiser step: ``jax.value_and_grad`` of :func:`loss_fn`, ``optimizer.update``, the updates added;
  with ``config.router_bias_rate > 0`` each layer's router bias then moves by
  :func:`jaxkern.modeling.balance_router_bias` (aux-loss-free balancing; the bias itself gets a zero gradient).

  Plain function: jit it with ``config``, ``optimizer``, ``implementation`` and ``moe_fn`` static, e.g.
  ``jax.jit(train_step, static_argnames=("config", "optimizer", "implementation", "moe_fn"))``.

  Returns:
    :class:`StepResult` ``(params, opt_state, loss, load)``.
  """
  count = config.router_bias_rate > 0
  (loss, load), grads = jax.value_and_grad(_loss_and_load, has_aux=True)(params, batch, config, implementation,
                                                                         moe_fn, count)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = apply_updates(params, updates)
  if count:
    layers = tuple(layer._replace(moe=layer.moe._replace(
        router_bias=balance_router_bias(layer.moe.router_bias, layer_load, config.router_bias_rate)))
                   for layer, layer_load in zip(params.layers, load))
    params = params._replace(layers=layers)
  return StepResult(params, opt_state, loss, load)


def expert_load(params: BlockParams, tokens: jax.Array, *, config: BlockConfig,
                implementation: str | None = None) -> jax.Array:
  """``(L, E)`` int32: the routed tokens of every expert of every layer in a forward pass over ``tokens``."""
  return _forward(params, tokens, config, implementation, None, count_load=True)[1]


# --------------------------------------------------------------------------------------------------------------
# The sharded step: data parallelism over the batch, expert parallelism over the routed experts


def ep_params(params: BlockParams, config: BlockConfig) -> BlockParams:
  """``params`` with every layer's :class:`MoeParams` split into a
  :class:`~jaxkern.modeling.sharding.MoeEpParams` (routed experts apart from the shared ones, so that the former
  can be sharded over experts and the latter replicated: :func:`jaxkern.modeling.sharding.split_shared_experts`);
  unchanged without shared experts. Works on gradients and optimiser-state pytrees of the same structure."""
  if not config.moe.num_shared_experts:
    return params
  layers = tuple(layer._replace(moe=split_shared_experts(layer.moe, config.moe)) for layer in params.layers)
  return params._replace(layers=layers)


def merge_ep_params(params: BlockParams) -> BlockParams:
  """The inverse of :func:`ep_params` (also of its gradients): plain :class:`MoeParams` in every layer."""
  layers = tuple(layer._replace(moe=merge_shared_experts(layer.moe)) if isinstance(layer.moe, MoeEpParams) else layer
                 for layer in params.layers)
  return params._replace(layers=layers)


def block_param_specs(params: BlockParams, expert_axis: str | None) -> BlockParams:
  """``PartitionSpec`` pytree of ``params`` (of :func:`ep_params`): every layer's routed expert weights split over
  ``expert_axis`` on dim 0 (:func:`jaxkern.modeling.sharding.moe_param_specs`), everything else replicated."""
  specs = jax.tree.map(lambda _: PartitionSpec(), params)
  layers = tuple(spec._replace(moe=moe_param_specs(layer.moe, expert_axis))
                 for spec, layer in zip(specs.layers, params.layers))
  return specs._replace(layers=layers)


def sharded_train_step(config: BlockConfig, optimizer: GradientTransformation, mesh: Mesh, *, expert_axis: str,
                       batch_axes: str | Sequence[str] | None = None, implementation: str | None = None,
                       check_vma: bool = False, grad_reduce_dtype: jax.typing.DTypeLike | None = None,
                       shard_replicated: str | None = None, shard_optimizer: str | None = None):
  """:func:`train_step` under ``mesh``: a jitted ``step(params, opt_state, batch) -> StepResult``.

  One ``jax.shard_map`` (:func:`jaxkern.modeling.sharding.make_sharded_train_step`) runs :func:`loss_fn` and its
  gradients with the MoE FFN of every layer replaced by :func:`moe_ffn_ep` over ``expert_axis``: the batch's
  sequences split over ``batch_axes`` (default: every mesh axis; ``B`` a multiple of their product), each
  layer's routed expert weights over ``expert_axis`` (``E`` a multiple of its size), everything else (embedding,
  Engram, mHC, shared experts, router, readout) replicated. The optimiser update runs outside the ``shard_map``
  in the same jit, keeping each param's sharding. Equal to :func:`train_step` up to float32 summation order
  (of the MoE slot sums and of the replicated params' gradients over the shards).

  Args:
    config: :class:`BlockConfig` (``router_bias_rate`` must be 0: the load count is not sharded).
    optimizer: an ``optax.GradientTransformation``.
    mesh: a :class:`jax.sharding.Mesh` with ``Auto`` axes (``Mesh(devices, names)``).
    expert_axis: the mesh axis splitting the routed experts (tokens are exchanged over it).
    batch_axes: mesh axes splitting the batch (a name or a sequence; default all, ``expert_axis`` included).
    implementation: passed to every op.
    check_vma: ``jax.shard_map``'s replication check; the Pallas kernels (and interpret mode) need ``False``,
      the references run under either (the gradients are the same).
    grad_reduce_dtype: the dtype the replicated params' gradients are summed over the devices in (``None``: their
      own, float32; ``jnp.bfloat16`` halves the all-reduce's bytes; :func:`jaxkern.modeling.sharded_value_and_grad`).
    shard_replicated: ``None`` (default), or a mesh axis among ``batch_axes``: the replicated params (embedding,
      Engram, mHC, shared experts, router, readout) whose dim 0 is a multiple of its size are stored split over it,
      with their optimiser state, all-gathered for the loss, their gradients reduce-scattered (ZeRO/FSDP-style;
      :func:`jaxkern.modeling.storage_specs`, :func:`jaxkern.modeling.sharded_value_and_grad`). Needs
      ``check_vma=False``.
    shard_optimizer: ``None`` (default), or a mesh axis among ``batch_axes`` (not with ``shard_replicated``): the
      replicated params stay whole, but the optimiser state and update of those whose dim 0 is a multiple of its
      size are split over it: their gradients reduce-scattered, the updated slices all-gathered at the end of the
      step (ZeRO-1/2-style; :func:`jaxkern.modeling.make_sharded_train_step`). Needs ``check_vma=False``.

  Params and optimiser state: ``ep = ep_params(params, config)``, ``specs = block_param_specs(ep, expert_axis)``,
  ``params = shard_params(ep, mesh, specs)`` (:func:`jaxkern.modeling.sharding.shard_params`); with
  ``shard_replicated=axis``, ``params = shard_params(ep, mesh, storage_specs(specs, ep, mesh, axis))``
  (:func:`jaxkern.modeling.storage_specs`; the step returns them in that layout). Then ``opt_state =
  init_optimizer_state(optimizer, params, mesh)`` (with ``shard_optimizer=axis``: ``shard_over=axis``;
  :func:`jaxkern.modeling.init_optimizer_state`: plain
  ``optimizer.init`` leaves the step count off the mesh and the second step compiles again).
  :func:`merge_ep_params` turns them back into :class:`BlockParams` (on host arrays too: ``np.asarray`` of a sharded
  ``jax.Array`` is the whole array). ``StepResult.load`` is ``None``.
  """
  if config.router_bias_rate:
    raise ValueError(f"config.router_bias_rate={config.router_bias_rate}: the sharded step does not balance the "
                     "router bias (use 0)")
  moe_fn = functools.partial(moe_ffn_ep, mesh_axis=expert_axis)
  loss = functools.partial(loss_fn, config=config, implementation=implementation, moe_fn=moe_fn)
  shapes = jax.eval_shape(lambda: ep_params(init_block_params(jax.random.key(0), config), config))
  specs = block_param_specs(shapes, expert_axis)
  step = make_sharded_train_step(loss, optimizer, mesh, specs, batch_axes=batch_axes, check_vma=check_vma,
                                 grad_reduce_dtype=grad_reduce_dtype, shard_replicated=shard_replicated,
                                 shard_optimizer=shard_optimizer)

  def run(params, opt_state, batch):
    params, opt_state, loss_value = step(params, opt_state, batch)
    return StepResult(params, opt_state, loss_value, None)

  return run


def synthetic_batch(rng: np.random.Generator, *, batch: int, seq_len: int, vocab_size: int, num_phrases: int = 8,
                    phrase_len: int = 6, phrase_prob: float = 0.8, phrase_seed: int = 0) -> Batch:
  """Next-token prediction on sequences with repeated n-grams (host-side numpy data).

  ``num_phrases`` fixed phrases of ``phrase_len`` tokens (drawn from ``phrase_seed``, shared by every batch) are
  written one after another, each preceded with probability ``1 - phrase_prob`` by one random token. Inside a phrase
  the next token follows from the last two: the n-gram memory can learn it; the random tokens cannot be predicted.

  Returns:
    :class:`Batch` of ``(batch, seq_len)`` int32 ``tokens`` and ``targets`` (the next token).
  """
  phrases = np.random.default_rng(phrase_seed).integers(0, vocab_size, size=(num_phrases, phrase_len))
  out = np.empty((batch, seq_len + 1), np.int32)
  for b in range(batch):
    seq: list[int] = []
    while len(seq) < seq_len + 1:
      if rng.random() > phrase_prob:
        seq.append(int(rng.integers(0, vocab_size)))
      seq.extend(phrases[rng.integers(0, num_phrases)].tolist())
    out[b] = seq[:seq_len + 1]
  return Batch(tokens=jnp.asarray(out[:, :-1]), targets=jnp.asarray(out[:, 1:]))
