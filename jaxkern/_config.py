"""The implementation setting shared by every jaxkern op.

Each op can run one of these implementations (how an op chooses: :mod:`jaxkern._dispatch`):

* ``"pallas"``: the compiled Pallas kernel (needs an NVIDIA Hopper GPU);
* ``"interpret"``: the same kernel run by Pallas' interpreter (any backend, slow);
* ``"xla"``: the op's XLA path: XLA code that ``"auto"`` takes where it measured faster than the kernel;
* ``"reference"``: the plain ``jnp`` reference from :mod:`jaxkern.reference`;
* ``"auto"`` (the default): on a GPU the faster of kernel and XLA path as measured for these
  arguments, elsewhere the reference.

Precedence: the ``implementation=`` keyword of an op, then the innermost :func:`use_implementation`
context, then :func:`set_implementation`, then the ``JAXKERN_IMPLEMENTATION`` environment variable,
then ``"auto"``.

The choice is made when an op is traced. The setting lives in a JAX user context
(``jax.make_user_context``), which is part of ``jax.jit``'s cache key: after a change made with
:func:`use_implementation` or :func:`set_implementation`, calling a jitted function again (or a new
``jax.jit`` of the same function) traces it anew with the new implementation. The environment
variable is read when jaxkern is imported and by ``set_implementation(None)``; changing it at any
other time has no effect.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
# Pallas' interpreter imports the Pallas fuser on the first interpret-mode kernel call, and that import registers an
# option of JAX's trace context (``pallas_fuser_disable_nested_fuse``), so a function jitted around that first call
# was traced again on its next call. Imported here, the option exists before any trace of a jaxkern op.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = ("auto", "pallas", "interpret", "xla", "reference")
ENV_VAR = "JAXKERN_IMPLEMENTATION"

_setting = jax.make_user_context(default_value=None)  # in jax.jit's cache key


def _validate(name: str) -> str:
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {name!r}")
  return name


def set_implementation(name: str | None) -> None:
  """Sets the process-wide implementation; ``None`` restores the default (the environment variable
  ``JAXKERN_IMPLEMENTATION``, read now, or ``"auto"``)."""
  if name is None:
    name = os.environ.get(ENV_VAR) or "auto"
  _setting.set_global(_validate(name))


@contextlib.contextmanager
def use_implementation(name: str) -> Iterator[None]:
  """Context manager selecting the implementation of the ops traced inside it (this thread)."""
  with _setting(_validate(name)):
    yield


def get_implementation(name: str | None = None) -> str:
  """The implementation an op called with ``implementation=name`` asks for: ``name`` itself, or
  the active setting (see the module docstring). ``"auto"`` is returned unresolved."""
  return _validate(name if name is not None else _setting.value or "auto")


def mosaic_interpret(interpret: bool) -> plgpu.InterpretGPUParams | None:
  """The ``interpret=`` argument of a Mosaic GPU kernel."""
  return plgpu.InterpretGPUParams() if interpret else None


def num_sms() -> int:
  """SMs of the GPU that persistent kernels size their grid for (132 on an H100 / H200 SXM, the
  value used when tracing elsewhere, e.g. when lowering for an H100 on a CPU machine)."""
  dev = jax.devices()[0]
  return getattr(dev, "core_count", 132) if dev.platform == "gpu" else 132


set_implementation(None)
