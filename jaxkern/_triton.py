"""Correctly rounded float32 arithmetic inside Pallas-Triton kernels.

Triton's float32 ``/`` and ``sqrt`` are approximate on the GPU; the kernels issue the PTX
``div.rn`` / ``sqrt.rn`` instructions through inline assembly. Interpret mode has no PTX: there the
same results come from :mod:`jaxkern._ieee` (integer-checked, correctly rounded on every backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from jaxkern import _ieee


def asm(op: str, *args):
  """One float32 PTX instruction ``op`` applied elementwise to ``args`` (broadcast)."""
  args = jnp.broadcast_arrays(*args)
  regs = ", ".join(f"${i}" for i in range(len(args) + 1))
  out = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
  return plt.elementwise_inline_asm(f"{op} {regs};", args=args, constraints="=r" + ",r" * len(args), pack=1,
                                    result_shape_dtypes=[out])[0]


def div(a, b, interpret: bool):
  """Correctly rounded ``a / b`` (``a >= 0``, ``b > 0``)."""
  return _ieee.div(a, b) if interpret else asm("div.rn.f32", a, b)


def sqrt(x, interpret: bool):
  """Correctly rounded ``sqrt(x)`` (``x >= 0``)."""
  return _ieee.sqrt(x) if interpret else asm("sqrt.rn.f32", x)
