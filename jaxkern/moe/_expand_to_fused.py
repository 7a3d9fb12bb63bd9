"""``expand_to_fused`` and ``expand_to_fused_with_sf``: scatter token rows into the fused layout.

Mosaic GPU kernel, one CTA per block of ``BT`` tokens or of ``BN`` fused rows. Rows are
viewed as ``(R, C)`` (``row_tiling``) so that one 2-D TMA copy moves a whole hidden row.
A token CTA loads its ``BT`` rows with one TMA copy and, meanwhile, the ``BT*K``
positions (scalar loads issued back to back, before any store), then issues one TMA store per valid
slot ``token_topk_to_pos[t, k] = p >= 0`` into fused row ``p`` (all stores in flight at
once). A padding CTA TMA-loads one zero row (a tiny constant input: a register store of
zeros would need the row size to fit a warpgroup register layout) and TMA-stores it into
every row of its block with ``pos_to_expert[p] < 0``. The last token block starts at ``T - BT`` and skips the
tokens already owned by the previous block, so ragged ``T`` needs no masking.

``expand_to_fused_with_sf``: when a scale row is TMA-copyable (row-major output, ``Hs`` a multiple of
4 words and at most 256) the same kernel moves it: each token's scale row is TMA-loaded into its
own 128-byte aligned SMEM row and TMA-stored with every data row of the token (and a zero row for
every padding row). On an H200 (E=9x8 K=6, H=7168, npc=32, ``Hs`` = 224 float32 words) this took
94.4 µs against 120.1 µs for the kernel plus an XLA scatter of the scale rows, and 81.6 µs for the
data alone. Row-major rows that are not TMA-copyable (``Hs`` not a multiple of 4) stay an XLA
scatter next to the kernel.

Column-major ``out_sf`` (``use_tma_aligned_col_major_sf``) is written per fused row, not per token:
a token's scale words land ``align(N, 4)`` words apart, and per-word GMEM stores from the expand
kernel (a warpgroup stores scalars with every thread; a word is below the 16 bytes of a TMA copy)
measured 4-16x slower than an XLA scatter (521 µs at ``Hs`` = 56, 1926 µs at ``Hs`` = 224 against
94 / 120 µs). :func:`_col_major_sf` instead inverts ``token_topk_to_pos`` into the source token of
every fused row (an XLA scatter of ``T*K`` words), then a Pallas-Triton kernel gathers, per block of
fused rows, a tile of whole scale rows and stores it transposed (coalesced on both sides). H200,
E=9x8 K=6 (T = 18506, N = 25136), whole op, this path against the expand kernel + XLA scatter and
transpose of the scale rows (data alone 81.4-81.6 / 17.9 / 30.2 µs): int32 ``Hs`` = 56 (H = 7168,
npc = 32) 90.7 vs 106.2 µs; ``Hs`` = 14 (H = 7168, npc = 128) 88.7 vs 91.1; ``Hs`` = 5 (H = 576,
npc = 32) 24.3 vs 24.7, (H = 2560, npc = 128) 37.0 vs 37.2; float32 ``Hs`` = 224 98.3 vs 177.7 µs,
all with 8192-word tiles. The scale part alone, same mapping: ``Hs`` = 5 / 14 took 5.3 / 5.9 µs with
4096-word tiles (used since; 512 / 256 rows per program), 6.2 / 6.7 with 8192-word tiles, 7.1 / 9.9
for the XLA scatter and 5.2 / 6.9 for an XLA gather from the inverse map (2.7 µs of every
inverse-map variant is the scatter building that map). ``Hs`` = 56 with 4096-word tiles (64 rows
instead of 128) was not measured. At ``Hs`` <= 2 (H = 576, npc = 128) the XLA scatter is kept: 4.1
against 5.0 µs.

Bad mappings (:func:`expand_to_fused` states them for users): a position outside ``[0, N)`` is
an unused slot, like -1: the token CTA's ``pl.when`` that guards each slot's TMA store compares the
position (already loaded as a scalar) against ``N`` as well as 0, and :func:`_source_tokens` drops
such slots. Fused rows that no slot references and that ``pos_to_expert`` does not mark as padding
(impossible for a mapping made by ``get_fused_mapping``) are left unwritten by the kernel; the
reference writes zeros there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

from jaxkern import _checks, _config, _dispatch
from jaxkern.moe import _reduce_fused, _routing
from jaxkern.reference import moe as ref
from jaxkern.types import QuantTensor

_TOKEN_BLOCK_BYTES = 56 << 10  # SMEM for the token rows of one CTA (about 4 CTAs per SM)
_MAX_TOKEN_BLOCK = 16
# Slots (tokens x K) per token CTA at most (None: no limit, 16 tokens). Each slot is a scalar position load and a
# guarded single-thread TMA store issue, serial within a CTA; with narrow rows (H = 576) and K = 8 / 9 a 16-token CTA
# had 128-144 of them. 64 (7-8 tokens at K = 8 / 9; K <= 4 and rows wider than 1792 bf16 values keep
# their blocks): H100, 2026-11-26, H=576 K=8/9 1.07-1.20x faster than no limit (E=4x64 K=9: 42.1 -> 35.1 µs), 32
# no better, 16 and 9 1.5-3.5x slower (CUPTI, cold L2).
_MAX_SLOTS = 64
_ROW_BLOCK = 32  # fused rows checked for padding per CTA (a timing script may change it)
_TMA_ALIGN = 128  # bytes; SMEM address alignment of a TMA copy
_SF_TILE_WORDS = 4096  # scale words per program of _col_major_sf (see the module docstring)
_SF_MAX_ROWS = 1024  # fused rows per program of _col_major_sf
_SF_WARPS = 4
_SF_XLA_MAX_WORDS = 2  # column-major scale rows this short stay an XLA scatter (faster there)


def _token_block(t: int, k: int, row_bytes: int, max_slots) -> int:
  """Tokens per token CTA."""
  if row_bytes % _TMA_ALIGN:  # a TMA copy needs a 128-byte aligned SMEM address: several rows only if each keeps it
    return 1
  bt = min(_MAX_TOKEN_BLOCK, t, _TOKEN_BLOCK_BYTES // row_bytes)
  if max_slots is not None:
    bt = min(bt, max_slots // k)
  return max(1, bt)


def sf_in_kernel(hs: int, col_major: bool) -> bool:
  """Whether :func:`_expand_kernel` can move ``hs``-word scale rows: row-major rows that one TMA
  copy can move (16-byte multiple, at most 256 words)."""
  return not col_major and hs % 4 == 0 and hs <= _routing.TMA_MAX_BOX


def _expand_kernel(x, x_sf, token_topk_to_pos, pos_to_expert, interpret=None):
  """:func:`_expand_kernel_jit` with the token block of :data:`_MAX_SLOTS` and :data:`_ROW_BLOCK`."""
  return _expand_kernel_jit(x, x_sf, token_topk_to_pos, pos_to_expert, interpret=interpret, max_slots=_MAX_SLOTS,
                            row_block=_ROW_BLOCK)


@functools.partial(jax.jit, static_argnames=("interpret", "max_slots", "row_block"))
def _expand_kernel_jit(x, x_sf, token_topk_to_pos, pos_to_expert, interpret=None, max_slots=None, row_block=32):
  """``out``, and ``(out, out_sf)`` with row-major ``out_sf`` if ``x_sf`` (int32 ``(T, Hs)``,
  :func:`sf_in_kernel`) is given."""
  t, h = x.shape
  k = token_topk_to_pos.shape[1]
  n = pos_to_expert.shape[0]
  r, c = _routing.row_tiling(h, x.dtype.itemsize, "x")
  row_bytes = h * x.dtype.itemsize
  bt = _token_block(t, k, row_bytes, max_slots)
  gt, gn = pl.cdiv(t, bt), pl.cdiv(n, row_block)
  hs = 0 if x_sf is None else x_sf.shape[1]
  out_type = [jax.ShapeDtypeStruct((n, r, c), x.dtype)]
  scratch = dict(x_s=plgpu.SMEM((bt, r, c), x.dtype), bar=plgpu.Barrier(num_arrivals=1))
  if hs:
    # One scale row per 128-byte aligned SMEM row, each loaded by its own TMA copy.
    out_type.append(jax.ShapeDtypeStruct((n, hs), jnp.int32))
    scratch.update(sf_s=plgpu.SMEM((bt, -(-hs // 32) * 32), jnp.int32),
                   sf_bar=plgpu.Barrier(num_arrivals=1, num_barriers=bt))

  @functools.partial(
      plgpu.kernel,
      out_type=tuple(out_type),
      grid=(gt + gn,),
      grid_names=("i",),
      scratch_types=scratch,
      interpret=interpret,
  )
  def kernel(*refs, x_s, bar, sf_s=None, sf_bar=None):
    if hs:
      x_g, sf_g, pos_g, expert_g, zero_g, zero_sf_g, o_g, o_sf_g = refs
    else:
      x_g, pos_g, expert_g, zero_g, o_g = refs
    i = lax.axis_index("i")

    def load_sf(row_of):  # scale row row_of(j) into SMEM row j
      for j in range(bt):
        plgpu.copy_gmem_to_smem(row_of(j), sf_s.at[j, pl.ds(0, hs)], sf_bar.at[j])

    def wait_sf():
      for j in range(bt):
        plgpu.barrier_wait(sf_bar.at[j])

    @pl.when(i < gt)
    def _():
      t0 = jnp.minimum(i * bt, t - bt)
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(t0, bt)], x_s, bar)
      if hs:
        load_sf(lambda j: sf_g.at[t0 + j])
      positions = [pos_g[t0 + j // k, j % k] for j in range(bt * k)]  # independent loads, all in flight
      plgpu.barrier_wait(bar)
      if hs:
        wait_sf()
      for j, p in enumerate(positions):
        row = j // k

        @pl.when((p >= 0) & (p < n) & (t0 + row >= i * bt))  # a position outside [0, N) is an unused slot
        def _():
          plgpu.copy_smem_to_gmem(x_s.at[row], o_g.at[p])
          if hs:
            plgpu.copy_smem_to_gmem(sf_s.at[row, pl.ds(0, hs)], o_sf_g.at[p])

    @pl.when(i >= gt)
    def _():
      p0 = (i - gt) * row_block
      plgpu.copy_gmem_to_smem(zero_g, x_s.at[pl.ds(0, 1)], bar)
      if hs:
        load_sf(lambda j: zero_sf_g.at[0])
      experts = [expert_g[jnp.minimum(p0 + q, n - 1)] for q in range(row_block)]
      plgpu.barrier_wait(bar)
      if hs:
        wait_sf()
      for q, e in enumerate(experts):

        @pl.when((p0 + q < n) & (e < 0))
        def _():
          plgpu.copy_smem_to_gmem(x_s.at[0], o_g.at[p0 + q])
          if hs:
            plgpu.copy_smem_to_gmem(sf_s.at[0, pl.ds(0, hs)], o_sf_g.at[p0 + q])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  zero = jnp.zeros((1, r, c), x.dtype)
  if not hs:
    return kernel(x.reshape(t, r, c), token_topk_to_pos, pos_to_expert, zero)[0].reshape(n, h)
  out, out_sf = kernel(x.reshape(t, r, c), x_sf, token_topk_to_pos, pos_to_expert, zero,
                       jnp.zeros((1, hs), jnp.int32))
  return out.reshape(n, h), out_sf


def _source_tokens(token_topk_to_pos, rows: int, n: int):
  """``(rows,)`` int32 (``rows >= n``): the token each of the ``n`` fused rows copies, ``-1`` for rows
  no slot references; positions outside ``[0, n)`` are unused slots."""
  t, k = token_topk_to_pos.shape
  pos = token_topk_to_pos.reshape(-1)
  return jnp.full((rows,), -1, jnp.int32).at[jnp.where((pos >= 0) & (pos < n), pos, rows)].set(
      jnp.arange(t * k, dtype=jnp.int32) // k, mode="drop")


def _col_major_sf_kernel(src_ref, x_ref, o_ref, *, block_rows: int, width: int):
  hs, rows = o_ref.shape
  p = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  src = plt.load(src_ref.at[jnp.minimum(p, rows - 1)], mask=p < rows, other=-1)
  j = jnp.arange(width)
  # Gathered (block_rows, width) tile of whole scale rows, stored transposed: coalesced on both sides.
  tile = plt.load(x_ref.at[jnp.maximum(src, 0)[:, None], jnp.minimum(j, hs - 1)[None, :]],
                  mask=(src >= 0)[:, None] & (j < hs)[None, :], other=0)
  # Masked-off lanes keep out-of-range indices: the interpreter drops those, clipped ones would collide.
  plt.store(o_ref.at[j[:, None], p[None, :]], tile.T, mask=(j < hs)[:, None] & (p < rows)[None, :])


def _col_major_sf(x_sf, token_topk_to_pos, n: int, interpret: bool = False):
  """The ``(Hs, align(n, 4))`` int32 column-major scale buffer of :func:`expand_to_fused_with_sf` for
  int32 ``x_sf`` ``(T, Hs)``: column ``p`` holds the scale row of the token copied into fused row
  ``p``, zeros elsewhere (padding rows and columns). Pallas-Triton kernel, one program per block
  of fused rows, after an XLA scatter of the source token of every fused row."""
  hs = x_sf.shape[1]
  rows = -(-n // 4) * 4
  src = _source_tokens(token_topk_to_pos, rows, n)
  width = pl.next_power_of_2(hs)
  block_rows = max(32, min(_SF_MAX_ROWS, _SF_TILE_WORDS // width))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  return pl.pallas_call(
      functools.partial(_col_major_sf_kernel, block_rows=block_rows, width=width),
      out_shape=jax.ShapeDtypeStruct((hs, rows), jnp.int32), grid=(pl.cdiv(rows, block_rows),),
      in_specs=[whole(src), whole(x_sf)], out_specs=whole(jax.ShapeDtypeStruct((hs, rows), jnp.int32)),
      compiler_params=plt.CompilerParams(num_warps=_SF_WARPS, num_stages=1), interpret=interpret)(src, x_sf)


def _check(x, token_topk_to_pos, pos_to_expert, x_name="x"):
  """Checks the arguments; returns ``(x, token_topk_to_pos, pos_to_expert)`` as arrays."""
  x = _checks.as_array(x_name, x)
  _checks.check_rank(x_name, x, 2)
  token_topk_to_pos = _routing.check_index("token_topk_to_pos", token_topk_to_pos, 2, (jnp.int32,))
  pos_to_expert = _routing.check_index("pos_to_expert", pos_to_expert, 1, (jnp.int32,))
  if token_topk_to_pos.shape[0] != x.shape[0]:
    raise ValueError(f"token_topk_to_pos must have {x.shape[0]} rows (one per token of {x_name}), "
                     f"got shape {tuple(token_topk_to_pos.shape)}")
  if x.dtype.itemsize not in (1, 2, 4):
    raise ValueError(f"{x_name} must have a 1-, 2- or 4-byte dtype, got {x.dtype}")
  _routing.row_tiling(x.shape[1], x.dtype.itemsize, x_name)
  _routing.check_values_below("token_topk_to_pos", token_topk_to_pos, pos_to_expert.shape[0])
  return x, token_topk_to_pos, pos_to_expert


def _check_distinct_rows(token_topk_to_pos, n: int) -> None:
  """Raises if a concrete ``token_topk_to_pos`` names one fused row from two slots (the rows' stores would race)."""
  if not _routing.is_concrete(token_topk_to_pos) or not token_topk_to_pos.size:
    return
  flat = np.asarray(token_topk_to_pos).reshape(-1)
  slots = np.flatnonzero((flat >= 0) & (flat < n))
  _, first = np.unique(flat[slots], return_index=True)
  repeated = np.setdiff1d(np.arange(slots.size), first)
  if repeated.size:
    k = token_topk_to_pos.shape[1]
    slot = int(slots[repeated[0]])
    earlier = int(slots[np.flatnonzero(flat[slots] == flat[slot])[0]])
    raise ValueError(f"token_topk_to_pos must name each fused row at most once; token_topk_to_pos[{slot // k}, "
                     f"{slot % k}] = {flat[slot]} repeats the row of slot [{earlier // k}, {earlier % k}] "
                     "(the first such entry)")


def _names_padding(token_topk_to_pos, pos_to_expert):
  """Per slot: whether it names a fused row in ``[0, N)`` that ``pos_to_expert`` marks as padding (negative); numpy
  or jax arrays (both of one kind)."""
  xp = np if isinstance(token_topk_to_pos, np.ndarray) else jnp
  n = pos_to_expert.shape[0]
  named = (token_topk_to_pos >= 0) & (token_topk_to_pos < n)
  return named & (pos_to_expert[xp.where(named, token_topk_to_pos, 0)] < 0)


def _check_named_rows_not_padding(op: str, token_topk_to_pos, pos_to_expert) -> None:
  """No slot names a padding row (the kernel stores zeros and the token's row there, in either order): concrete
  ``ValueError`` / traced checkify report, naming the slot (or, for a concrete ``token_topk_to_pos`` with a traced
  ``pos_to_expert``, the padding row)."""
  if not pos_to_expert.shape[0]:
    return
  requirement = "-1 or a fused row that pos_to_expert does not mark as padding (pos_to_expert[row] >= 0)"
  if not _checks.is_traced(pos_to_expert):
    pte = np.asarray(pos_to_expert)
    _checks.check_and_debug_check(
        op, "token_topk_to_pos", token_topk_to_pos,
        lambda v: _names_padding(v, pte if isinstance(v, np.ndarray) else jnp.asarray(pte)), requirement)
  elif _checks.is_traced(token_topk_to_pos):
    _checks.debug_check_entries(op, "token_topk_to_pos", token_topk_to_pos,
                                lambda v: _names_padding(v, pos_to_expert), requirement)
  else:  # only pos_to_expert traced: report the padding row a slot names
    flat = np.asarray(token_topk_to_pos).reshape(-1)
    n = pos_to_expert.shape[0]
    named = np.zeros((n,), bool)
    named[flat[(flat >= 0) & (flat < n)]] = True
    _checks.debug_check_entries(op, "pos_to_expert", pos_to_expert, lambda v: jnp.asarray(named) & (v < 0),
                                "an expert id (>= 0) for a fused row that token_topk_to_pos names")


def _unsupported(x) -> str | None:
  """Why the expand kernel cannot move the rows of ``x``, or None."""
  if x.dtype == jnp.bool_:
    return "bool data (no 1-bit element type in Mosaic GPU; expand x.view(jnp.uint8) for the kernel)"
  return None


def expand_to_fused(x: jax.Array, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array, *,
                    implementation: str | None = None) -> jax.Array:
  """Copies each token row into its fused rows; padding rows become zero (bit copy).

  Args:
    x: ``(T, H)`` array (or nested list) of a 1-, 2- or 4-byte dtype (bool included); a row of
      ``H`` elements a multiple of 16 bytes and at most 65536 elements.
    token_topk_to_pos: ``(T, K)`` int32 fused row of each slot, -1 = unused (see below).
    pos_to_expert: ``(N,)`` int32; a negative entry marks a padding row.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`).

  Returns:
    ``(N, H)`` array of ``x.dtype`` with ``out[token_topk_to_pos[t, k]] = x[t]`` and zeros where
    ``pos_to_expert < 0``.

  Raises:
    ValueError: a rank, dtype or shape above not met (``token_topk_to_pos`` needs ``T`` rows), or a
      concrete ``token_topk_to_pos`` holding a value below -1 or ``>= N``, naming one fused row twice or naming
      a row that a concrete ``pos_to_expert`` marks as padding.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with bool data.

  XLA instead of a kernel: bool data and zero-size problems (``T = 0`` or ``N = 0``).

  Bad mappings (identical in the kernel, interpret mode included, and the reference, under ``jit``):
  an entry of ``token_topk_to_pos`` outside ``[0, N)`` is an unused slot, exactly like -1 (concrete,
  non-traced arrays are range-checked instead: ``ValueError``). Several slots naming one fused row
  (concrete arrays: ``ValueError``):
  the reference and interpret mode store one of their tokens' rows whole (which one is unspecified);
  on a GPU the TMA stores of those tokens race, and the row may mix pieces of their rows (no
  guarantee beyond that). A fused row that no slot names and that ``pos_to_expert`` does not mark as
  padding is zero in the reference and left unwritten (whatever the output buffer held) by the
  kernel (not checked: no slot of the mapping reads such a row back); a row both named by a slot and
  marked as padding (concrete arrays: ``ValueError``) is the token's row in the reference and the
  token's row, zeros or a mix of both in the kernel. ``get_fused_mapping`` makes none of these.

  Checked mode: inside ``checkify.checkify(f, errors=checkify.user_checks)`` (``from
  jax.experimental import checkify``) the first slot (flat order ``t*K + k``) holding an entry
  outside ``{-1} ∪ [0, N)``, a fused row already named by an earlier slot or a row that
  ``pos_to_expert`` marks as padding is reported with its position and value (with a concrete
  ``token_topk_to_pos`` and a traced ``pos_to_expert``, the padding row is). Without checkify the
  check costs nothing: it is dropped, and XLA removes its predicate from the compiled program.

  Differentiation (``jax.custom_vjp``, floating-point ``x``): ``dx[t] = sum_k dy[token_topk_to_pos[t, k]]``
  over the used slots, summed in float32 in slot order and rounded once to ``x.dtype``: the
  :func:`reduce_fused` kernel without weights. That kernel needs ``H`` a multiple of 256 and float32 /
  bfloat16 data; other cases take the XLA path under ``"auto"`` and raise
  :class:`jaxkern.KernelUnavailableError` under ``"pallas"`` / ``"interpret"`` (op ``expand_to_fused.bwd``).
  """
  x, token_topk_to_pos, pos_to_expert = _check(x, token_topk_to_pos, pos_to_expert)
  n = pos_to_expert.shape[0]
  _check_distinct_rows(token_topk_to_pos, n)
  _routing.debug_check_positions("expand_to_fused", token_topk_to_pos, n)
  _check_named_rows_not_padding("expand_to_fused", token_topk_to_pos, pos_to_expert)
  implementation = _config.get_implementation(implementation)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return _expand_vjp(x, token_topk_to_pos, pos_to_expert, implementation)
  return _expand(x, token_topk_to_pos, pos_to_expert, implementation)


def _expand(x, token_topk_to_pos, pos_to_expert, implementation: str):
  return _dispatch.run(
      "expand_to_fused", implementation,
      kernel=lambda interpret: _expand_kernel(x, None, token_topk_to_pos, pos_to_expert,
                                              interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: ref.expand_to_fused(x, token_topk_to_pos, pos_to_expert),
      unsupported=_unsupported(x), empty=x.shape[0] == 0 or pos_to_expert.shape[0] == 0)


def _sum_slots(op: str, d_out, token_topk_to_pos, implementation: str):
  """The cotangent of an expand: ``dx[t] = sum_k d_out[token_topk_to_pos[t, k]]`` over used slots, fp32
  sums cast to ``d_out``'s dtype: :func:`reduce_fused` without weights (its kernel or XLA path)."""
  return _reduce_fused.accumulate(op, d_out, None, None, token_topk_to_pos, None, d_out.dtype, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand_vjp(x, token_topk_to_pos, pos_to_expert, implementation):
  return _expand(x, token_topk_to_pos, pos_to_expert, implementation)


def _expand_fwd(x, token_topk_to_pos, pos_to_expert, implementation):
  return _expand(x, token_topk_to_pos, pos_to_expert, implementation), token_topk_to_pos


def _expand_bwd(implementation, token_topk_to_pos, d_out):
  return _sum_slots("expand_to_fused.bwd", d_out, token_topk_to_pos, implementation), None, None


_expand_vjp.defvjp(_expand_fwd, _expand_bwd)


def expand_to_fused_with_sf(x: QuantTensor | tuple[jax.Array, jax.Array], num_per_channels: int,
                            token_topk_to_pos: jax.Array, pos_to_expert: jax.Array, *,
                            use_tma_aligned_col_major_sf: bool = False,
                            implementation: str | None = None) -> QuantTensor:
  """:func:`expand_to_fused` of quantised data with its per-token scale factors.

  Args:
    x: ``QuantTensor(data, sf)`` (or a 2-tuple): ``(T, H)`` data (e.g. float8_e4m3fn; any 1-, 2- or
      4-byte dtype, ``H`` as in :func:`expand_to_fused`) and row-major ``(T, Hs)`` scales, float32
      (``Hs = ceil(H / num_per_channels)``) or int32 packed UE8M0 (``Hs = ceil(ceil(H /
      num_per_channels) / 4)``, requires ``use_tma_aligned_col_major_sf``).
    num_per_channels: channels per scale block (static, positive).
    token_topk_to_pos, pos_to_expert: as in :func:`expand_to_fused`.
    use_tma_aligned_col_major_sf: return the scales as the physical ``(Hs, align(N, 4))`` buffer of
      a TMA-aligned column-major layout (padding columns zero) instead of ``(N, Hs)``.
    implementation: see :func:`expand_to_fused`.

  Returns:
    ``QuantTensor(data, sf)``: the expanded ``(N, H)`` data and the scale rows moved (bit copies)
    with their tokens, ``(N, Hs)`` or ``(Hs, align(N, 4))`` of ``x.sf``'s dtype.

  Raises:
    ValueError: as :func:`expand_to_fused`; ``x`` not a pair, ``num_per_channels`` not positive,
      ``x.sf`` of another dtype or shape, int32 scales without ``use_tma_aligned_col_major_sf``.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with bool data.

  XLA instead of a kernel: bool data and zero-size problems. On the kernel path, row-major scale rows
  of ``Hs`` words not a multiple of 4 or above 256, and column-major rows of at most 2 words, are
  moved by an XLA scatter next to the data kernel (module docstring: measured faster there).

  Bad mappings and the checked mode: as :func:`expand_to_fused` (the scale rows follow the data rows).

  Differentiation (``jax.custom_vjp``): w.r.t. floating-point data as :func:`expand_to_fused`, and w.r.t.
  float32 scales (either layout) by the same slot sums in XLA (rows of a few words); packed UE8M0
  (int32) scales and integer data have no derivative.
  """
  if not isinstance(x, tuple) or len(x) != 2:
    raise ValueError(f"x must be a QuantTensor (data, sf) or a 2-tuple, got {type(x).__name__}")
  x_sf = _checks.as_array("x.sf", x[1])
  x_data, token_topk_to_pos, pos_to_expert = _check(x[0], token_topk_to_pos, pos_to_expert, "x.data")
  _checks.check_rank("x.sf", x_sf, 2)
  _checks.check_dtype("x.sf", x_sf, (jnp.float32, jnp.int32))
  if num_per_channels <= 0:
    raise ValueError(f"num_per_channels must be positive, got {num_per_channels}")
  blocks = -(-x_data.shape[1] // num_per_channels)
  hs = -(-blocks // 4) if x_sf.dtype == jnp.int32 else blocks
  _routing.check_shape("x.sf", x_sf, (x_data.shape[0], hs))
  if x_sf.dtype == jnp.int32 and not use_tma_aligned_col_major_sf:
    raise ValueError("x.sf holding packed UE8M0 (int32) requires use_tma_aligned_col_major_sf=True")
  _check_distinct_rows(token_topk_to_pos, pos_to_expert.shape[0])
  _routing.debug_check_positions("expand_to_fused_with_sf", token_topk_to_pos, pos_to_expert.shape[0])
  _check_named_rows_not_padding("expand_to_fused_with_sf", token_topk_to_pos, pos_to_expert)
  return QuantTensor(*_expand_with_sf_vjp(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels,
                                          use_tma_aligned_col_major_sf, _config.get_implementation(implementation)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _expand_with_sf_vjp(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels, col_major, implementation):
  return _expand_with_sf(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels, col_major, implementation)


def _expand_with_sf_fwd(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels, col_major, implementation):
  out = _expand_with_sf(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels, col_major, implementation)
  return out, token_topk_to_pos


def _expand_with_sf_bwd(num_per_channels, col_major, implementation, token_topk_to_pos, d_out):
  d_data, d_sf = d_out
  n = d_data.shape[0]
  d_x_data = d_x_sf = None
  if jnp.issubdtype(d_data.dtype, jnp.inexact):
    d_x_data = _sum_slots("expand_to_fused_with_sf.bwd", d_data, token_topk_to_pos, implementation)
  if d_sf.dtype == jnp.float32:  # rows of a few scale words: XLA sums them (packed UE8M0 has no derivative)
    d_x_sf = ref.reduce_fused(d_sf[:, :n].T if col_major else d_sf, None, token_topk_to_pos)
  return d_x_data, d_x_sf, None, None


_expand_with_sf_vjp.defvjp(_expand_with_sf_fwd, _expand_with_sf_bwd)


def _expand_with_sf(x_data, x_sf, token_topk_to_pos, pos_to_expert, num_per_channels: int, col_major: bool,
                    implementation: str) -> tuple[jax.Array, jax.Array]:
  n = pos_to_expert.shape[0]
  hs = x_sf.shape[1]

  def kernel(interpret):
    mosaic = _config.mosaic_interpret(interpret)
    if not sf_in_kernel(hs, col_major):
      out = _expand_kernel(x_data, None, token_topk_to_pos, pos_to_expert, interpret=mosaic)
      if col_major and hs > _SF_XLA_MAX_WORDS:
        out_sf = _col_major_sf(lax.bitcast_convert_type(x_sf, jnp.int32), token_topk_to_pos, n, interpret=interpret)
        return QuantTensor(out, lax.bitcast_convert_type(out_sf, x_sf.dtype))
      return QuantTensor(out, ref.expand_sf(x_sf, token_topk_to_pos, pos_to_expert, col_major))
    out, out_sf = _expand_kernel(x_data, lax.bitcast_convert_type(x_sf, jnp.int32), token_topk_to_pos,
                                 pos_to_expert, interpret=mosaic)
    return QuantTensor(out, lax.bitcast_convert_type(out_sf, x_sf.dtype))

  return _dispatch.run(
      "expand_to_fused_with_sf", implementation, kernel=kernel,
      xla=lambda: ref.expand_to_fused_with_sf((x_data, x_sf), num_per_channels, token_topk_to_pos, pos_to_expert,
                                              use_tma_aligned_col_major_sf=col_major),
      unsupported=_unsupported(x_data), empty=x_data.shape[0] == 0 or n == 0)
