"""The one dispatch path of every jaxkern op: kernel, interpret mode, XLA path or reference.

An op checks its arguments, then calls :func:`run` with its implementations and two named,
per-op predicates, each a reason string or ``None``:

* ``unsupported``: why the Pallas kernel cannot run these arguments;
* ``xla_faster``: why ``"auto"`` takes the XLA path on a GPU although the kernel could run
  (a measured threshold; the op's docstring and the constant it names give the figures).

Semantics of the requested implementation (:mod:`jaxkern._config`):

* ``"reference"``: the ``jnp`` reference.
* ``"auto"``: off a GPU the reference; on a GPU the XLA path where the kernel is unsupported or
  measured slower, else the kernel.
* ``"pallas"`` / ``"interpret"``: the kernel, compiled or interpreted; if it cannot run these
  arguments, a :class:`KernelUnavailableError` saying why. ``"pallas"`` off a GPU raises it too (lowering
  for an abstract CUDA device, as :mod:`jaxkern.testing.lowering` does, counts as a GPU).
* ``"xla"``: the XLA path.

Two cases take the XLA path under every implementation but ``"reference"``, stated in the
op's docstring: zero-size problems (nothing for a kernel to do; the result is an empty or
constant array) and ops that have no Pallas kernel (their XLA code is the implementation).

Every decision is logged to the ``"jaxkern"`` logger at DEBUG level and recorded by
:func:`explain`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxkern import _config

logger = logging.getLogger("jaxkern")

PATHS = ("pallas", "interpret", "xla", "reference")


class KernelUnavailableError(ValueError):
  """``implementation="pallas"`` or ``"interpret"`` asked for a kernel that cannot run these arguments."""


@dataclasses.dataclass(frozen=True)
class Decision:
  """What one op call ran: ``path`` is one of ``pallas``, ``interpret``, ``xla``, ``reference``."""

  op: str
  requested: str
  path: str
  reason: str


_recorders = threading.local()
_explain_token = jax.make_user_context(default_value=None)  # a fresh value makes jax.jit trace again


def _targets_gpu() -> bool:
  """True on a GPU backend, and while lowering for an abstract CUDA device (:mod:`jaxkern.testing.lowering`)."""
  if jax.default_backend() == "gpu":
    return True
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device is not None and device.platform in ("cuda", "gpu")


def decide(op: str, implementation: str | None, *, has_kernel: bool = True, unsupported: str | None = None,
           xla_faster: str | None = None, empty: bool = False) -> Decision:
  """The path of one call (see the module docstring); raises :class:`KernelUnavailableError`."""
  requested = _config.get_implementation(implementation)
  on_gpu = jax.default_backend() == "gpu"

  def made(path, reason):
    return Decision(op, requested, path, reason)

  if requested == "reference":
    return made("reference", "implementation='reference'")
  if requested == "auto" and not on_gpu:
    return made("reference", f"'auto' off a GPU (backend {jax.default_backend()!r}) runs the reference")
  if empty:
    return made("xla", "zero-size problem: no kernel launch")
  if not has_kernel:
    return made("xla", "the op has no Pallas kernel: its XLA code is the implementation")
  if requested == "xla":
    return made("xla", "implementation='xla'")
  if requested in ("pallas", "interpret"):
    if unsupported:
      raise KernelUnavailableError(
          f"{op}: implementation={requested!r} cannot run the Pallas kernel: {unsupported}. "
          "Use implementation='auto' or 'xla' for these arguments.")
    if requested == "pallas" and not _targets_gpu():
      raise KernelUnavailableError(
          f"{op}: implementation='pallas' compiles a Mosaic GPU kernel, which needs an NVIDIA Hopper GPU; the JAX "
          f"backend is {jax.default_backend()!r}. Use implementation='interpret' to run the kernel on this backend, "
          "or 'auto' / 'xla'.")
    return made(requested, f"implementation={requested!r}")
  if unsupported:
    return made("xla", f"the kernel cannot run these arguments: {unsupported}")
  if xla_faster:
    return made("xla", f"XLA measured faster: {xla_faster}")
  return made("pallas", "'auto' on a GPU: the kernel")


def run(op: str, implementation: str | None, *, kernel: Callable[[bool], Any] | None, xla: Callable[[], Any],
        reference: Callable[[], Any] | None = None, unsupported: str | None = None,
        xla_faster: str | None = None, empty: bool = False):
  """Decides (:func:`decide`), records and runs one op call.

  Args:
    op: the public op's name.
    implementation: the op's ``implementation=`` argument.
    kernel: ``kernel(interpret)`` runs the Pallas kernel (``interpret`` a bool); None if the op has none.
    xla: runs the XLA path.
    reference: runs the ``jnp`` reference (default: ``xla``, for ops whose XLA path is the reference).
    unsupported, xla_faster, empty: see the module docstring.
  """
  d = decide(op, implementation, has_kernel=kernel is not None, unsupported=unsupported, xla_faster=xla_faster,
             empty=empty)
  logger.debug("%s: %s (%s)", op, d.path, d.reason)
  for record in getattr(_recorders, "stack", ()):
    record.append(d)
  if d.path == "pallas":
    return kernel(False)
  if d.path == "interpret":
    return _finished_if_eager(kernel(True))
  if d.path == "reference" and reference is not None:
    return reference()
  return xla()


def _finished_if_eager(result):
  """``result`` of an interpret-mode kernel, waited for when it is concrete (called outside ``jax.jit``).

  Pallas interpret mode runs a Mosaic GPU kernel's threads in host callbacks that dispatch JAX operations
  themselves. If the caller dispatches more eager operations while those callbacks still run, the CPU client can
  deadlock: on a 2-core CI machine (2026-11-30) a test hung for over 15 minutes, one callback thread waiting in
  ``apply_primitive`` and the main thread in an eager comparison on the kernel's output. Waiting for the result
  before returning it keeps eager calls in order. Under ``jax.jit`` the result is a tracer and is returned as is.
  """
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(result)):
    return result
  return jax.block_until_ready(result)


@contextlib.contextmanager
def recording() -> Iterator[list[Decision]]:
  """Collects the :class:`Decision` of every op traced inside the block (this thread) into the list
  it yields. Functions traced inside are traced anew even if ``jax.jit`` has a trace of them."""
  stack = _recorders.__dict__.setdefault("stack", [])
  record: list[Decision] = []
  stack.append(record)
  try:
    with _explain_token(object()):
      yield record
  finally:
    stack.pop()


def explain(fn: Callable, *args, **kwargs) -> list[Decision]:
  """The :class:`Decision` of every jaxkern op that ``fn(*args, **kwargs)`` calls, in call order.

  ``fn`` is traced abstractly (``jax.eval_shape``: nothing runs on a device), and traced anew even
  if it is a ``jax.jit`` function that has run before. Array arguments (also ``jax.ShapeDtypeStruct``)
  are traced, so checks that need concrete values are skipped; every other argument is passed as is.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  traced = [isinstance(v, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for v in leaves]

  def call(*arrays):
    it = iter(arrays)
    a, k = jax.tree.unflatten(tree, [next(it) if t else v for v, t in zip(leaves, traced)])
    return fn(*a, **k)

  with recording() as record:
    jax.eval_shape(call, *(v for v, t in zip(leaves, traced) if t))
  return record
