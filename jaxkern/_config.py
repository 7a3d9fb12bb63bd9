"""The implementation switch shared by every jaxkern op.

Three implementations exist for each op:

* ``"pallas"``: the compiled Pallas kernel (needs an NVIDIA Hopper GPU);
* ``"interpret"``: the same kernel run by Pallas' interpreter (any backend, slow);
* ``"reference"``: the plain ``jnp`` reference from :mod:`jaxkern.reference`.

``"auto"`` (the default) picks ``"pallas"`` when JAX's default backend is a GPU and
``"reference"`` otherwise. The choice is made at trace time: a function already
compiled by ``jax.jit`` keeps the implementation it was traced with.

Precedence: the ``implementation=`` keyword of an op, then the innermost
:func:`use_implementation` context, then :func:`set_implementation`, then the
``JAXKERN_IMPLEMENTATION`` environment variable, then ``"auto"``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = ("auto", "pallas", "interpret", "reference")
ENV_VAR = "JAXKERN_IMPLEMENTATION"

_global: str | None = None
_local = threading.local()


def _validate(name: str) -> str:
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {name!r}")
  return name


def set_implementation(name: str | None) -> None:
  """Sets the process-wide implementation (``None`` restores the default)."""
  global _global
  _global = None if name is None else _validate(name)


@contextlib.contextmanager
def use_implementation(name: str) -> Iterator[None]:
  """Context manager selecting the implementation of ops traced inside it."""
  stack = _local.__dict__.setdefault("stack", [])
  stack.append(_validate(name))
  try:
    yield
  finally:
    stack.pop()


def get_implementation(name: str | None = None) -> str:
  """Resolves ``name`` (or the active setting) to ``pallas``, ``interpret`` or ``reference``."""
  if name is None:
    stack = _local.__dict__.get("stack")
    name = stack[-1] if stack else _global or os.environ.get(ENV_VAR, "auto")
  name = _validate(name)
  if name == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return name


def mosaic_interpret(name: str) -> plgpu.InterpretGPUParams | None:
  """The ``interpret=`` argument of a Mosaic GPU kernel for a resolved implementation."""
  return plgpu.InterpretGPUParams() if name == "interpret" else None


def num_sms() -> int:
  """SMs of the GPU that persistent kernels size their grid for (132 on an H100 / H200 SXM, the
  value used when tracing elsewhere, e.g. when lowering for an H100 on a CPU machine)."""
  dev = jax.devices()[0]
  return getattr(dev, "core_count", 132) if dev.platform == "gpu" else 132
