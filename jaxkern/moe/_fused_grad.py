"""The backward pass of ``reduce_fused``: scale each token's cotangent into its slots' fused rows.

For ``out[t] = sum_k c[t, k] * x[p]`` (``p = token_topk_to_pos[t, k]``) the cotangent of ``x`` is
``dx[p] = c[t, k] * g[t]`` on the row of every used slot and 0 on rows no slot names, and the
cotangent of each slot's scale needs ``dots[t, k] = <g[t], x[p]>``. :func:`scatter_grad` computes
both in one pass.

Mosaic GPU kernel with the grid and register scheme of the forward kernel (``_reduce_fused``): a
CTA owns ``BT`` tokens and a chunk of ``W`` hidden elements; it loads each token's cotangent chunk
into registers once (16-byte loads), then for every used slot stores ``c * g`` into the slot's
fused row and, when the dots are needed, loads that row of ``x`` and reduces ``x * g`` across the
warpgroup. Extra CTAs write the zero rows (``used[p] == 0``, an XLA scatter of the ``T*K``
positions), 32 rows each, as the padding CTAs of ``expand_to_fused`` do. Chunked rows
(``H > 8192``) give one partial dot per chunk, summed by XLA.

Positions outside ``[0, N)`` are unused slots (as in the forward). Two slots naming one fused row
(a mapping ``get_fused_mapping`` never makes) race in the kernel: the row gets one slot's value,
where the XLA path adds both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _config, _dispatch

CHUNK = 256  # H must be a multiple (as for the forward kernel)
_MAX_WIDTH = 8192  # hidden elements per CTA
_TOKEN_BLOCK = 2
_ZERO_ROWS = 32  # fused rows checked per zero-row CTA
_DTYPES = (jnp.float32, jnp.bfloat16)


def _width(h: int) -> int:
  return max(w for w in range(CHUNK, min(h, _MAX_WIDTH) + 1, CHUNK) if h % w == 0)


def _unsupported(g, x, out_dtype) -> str | None:
  dtypes = [g.dtype, jnp.dtype(out_dtype)] + ([] if x is None else [x.dtype])
  if any(d not in _DTYPES for d in dtypes):
    return f"dtypes {sorted({str(d) for d in dtypes})} (the kernel handles float32 and bfloat16)"
  if g.shape[1] % CHUNK:
    return f"H = {g.shape[1]} is not a multiple of {CHUNK}"
  return None


def _used_rows(pos, n: int):
  """``(n,)`` int32: 1 on fused rows some slot names, else 0."""
  flat = pos.reshape(-1)
  return jnp.zeros((n,), jnp.int32).at[jnp.where((flat >= 0) & (flat < n), flat, n)].set(1, mode="drop")


@functools.partial(jax.jit, static_argnames=("n", "out_dtype", "interpret"))
def _scatter_grad_kernel(g, x, pos, c, used, *, n: int, out_dtype, interpret=None):
  t, h = g.shape
  k = pos.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  width = _width(h)
  chunks = h // width
  bt = min(_TOKEN_BLOCK, t)
  gt, gz = pl.cdiv(t, bt), pl.cdiv(n, _ZERO_ROWS)
  itemsize = max([g.dtype.itemsize, out_dtype.itemsize] + ([] if x is None else [x.dtype.itemsize]))
  vec = 16 // itemsize  # 16-byte accesses for the widest dtype, one layout for all
  while width % (vec * 128):
    vec //= 2
  layout = plgpu.Layout.WG_STRIDED((width,), vec_size=vec)
  out_type = [jax.ShapeDtypeStruct((n, h), out_dtype)]
  if x is not None:
    out_type.append(jax.ShapeDtypeStruct((t, k, chunks), jnp.float32))

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(chunks, gt + gz), grid_names=("j", "i"),
                     interpret=interpret)
  def kernel(*refs):
    if x is None:
      g_g, pos_g, c_g, used_g, dx_g = refs
      x_g = dots_g = None
    else:
      g_g, x_g, pos_g, c_g, used_g, dx_g, dots_g = refs
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * width, width)

    @pl.when(i < gt)
    def _():
      t0 = jnp.minimum(i * bt, t - bt)  # the last block ends at T; it skips the rows of the one before
      positions = [pos_g[t0 + s // k, s % k] for s in range(bt * k)]
      scales = [c_g[t0 + s // k, s % k] for s in range(bt * k)]
      for row in range(bt):

        @pl.when(t0 + row >= i * bt)
        def _():
          gv = plgpu.load(g_g.at[t0 + row, cols], layout=layout).astype(jnp.float32)
          for s in range(row * k, (row + 1) * k):
            p, used_slot = positions[s], (positions[s] >= 0) & (positions[s] < n)

            @pl.when(used_slot)
            def _():
              if x_g is not None:
                xv = plgpu.load(x_g.at[p, cols], layout=layout).astype(jnp.float32)
                dots_g[t0 + row, s % k, j] = jnp.sum(xv * gv)
              dx_g[p, cols] = (gv * scales[s]).astype(out_dtype)

            if dots_g is not None:

              @pl.when(~used_slot)
              def _():
                dots_g[t0 + row, s % k, j] = jnp.float32(0)

    @pl.when(i >= gt)
    def _():
      p0 = (i - gt) * _ZERO_ROWS
      flags = [used_g[jnp.minimum(p0 + q, n - 1)] for q in range(_ZERO_ROWS)]
      zeros = plgpu.layout_cast(jnp.zeros((width,), out_dtype), layout)
      for q, flag in enumerate(flags):

        @pl.when((p0 + q < n) & (flag == 0))
        def _():
          dx_g[p0 + q, cols] = zeros

  args = [g] + ([] if x is None else [x]) + [pos, c, used]
  out = kernel(*args)
  return (out[0], None) if x is None else (out[0], jnp.sum(out[1], axis=-1))


def _scatter_grad_xla(g, x, pos, c, n: int, out_dtype):
  valid = (pos >= 0) & (pos < n)
  g32 = g.astype(jnp.float32)
  rows = g32[:, None, :] * c[:, :, None]
  dx = jnp.zeros((n, g.shape[1]), jnp.float32).at[jnp.where(valid, pos, n)].add(rows, mode="drop")
  if x is None:
    return dx.astype(out_dtype), None
  picked = x[jnp.where(valid, pos, 0)].astype(jnp.float32) if n else jnp.zeros(rows.shape, jnp.float32)
  return dx.astype(out_dtype), jnp.where(valid, jnp.sum(picked * g32[:, None, :], axis=-1), 0)


def scatter_grad(op: str, g, x, pos, c, *, n: int, out_dtype, implementation: str):
  """``(dx, dots)``: ``dx[p] = cast(c[t, k] * g[t])`` on every used slot's row ``p`` (zeros elsewhere),
  ``(n, H)`` of ``out_dtype``; ``dots[t, k] = <g[t], x[p]>`` (0 for unused slots), or None if ``x`` is
  None. ``g`` ``(T, H)``, ``x`` ``(n, H)`` or None, ``pos`` ``(T, K)`` int32, ``c`` ``(T, K)`` float32.

  The kernel needs float32 / bfloat16 data and ``H`` a multiple of 256; ``"auto"`` takes the XLA path
  otherwise, ``"pallas"`` / ``"interpret"`` raise :class:`jaxkern.KernelUnavailableError`.
  """
  unsupported = _unsupported(g, x, out_dtype)
  return _dispatch.run(
      op, implementation,
      kernel=lambda interpret: _scatter_grad_kernel(g, x, pos, c, _used_rows(pos, n), n=n, out_dtype=out_dtype,
                                                    interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: _scatter_grad_xla(g, x, pos, c, n, out_dtype), unsupported=unsupported,
      empty=g.shape[0] == 0 or n == 0 or g.shape[1] == 0)
