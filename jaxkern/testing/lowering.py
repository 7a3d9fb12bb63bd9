"""Lowering a kernel for an H100 on a machine without a GPU.

Tracing under an abstract CUDA device and lowering for ``cuda`` runs the real
Pallas GPU lowering (Mosaic GPU and Triton) and raises the errors the GPU would:
unsupported primitives, layout inference, SMEM budget, TMA limits. It does not run
ptxas or the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

if TYPE_CHECKING:  # pytest is a dev extra: the annotation only
  import pytest

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def lower_for_h100(f: Callable, *args: Any) -> jax.stages.Lowered:
  """Lowers ``jax.jit(f)(*args)`` for CUDA (H100); ``args`` may be ``jax.ShapeDtypeStruct``s.

  Returns the ``Lowered`` object; raises whatever the GPU lowering raises.
  """
  with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H100)):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def capture_mosaic_modules(monkeypatch: pytest.MonkeyPatch, keep: Callable[[Any], Any] = str) -> list:
  """``keep(module)`` (default: its text) of every Mosaic GPU module serialised for the compiler while the test runs
  (appended to the returned list), e.g. to check which multiplies feed adds (FMA contraction) after
  :func:`lower_for_h100`."""
  import jax.experimental.mosaic.gpu.core as mgpu_core

  modules = []
  serde = mgpu_core._run_serde_pass

  def spy(module, serialize, ir_version):
    if serialize:
      modules.append(keep(module))
    return serde(module, serialize=serialize, ir_version=ir_version)

  monkeypatch.setattr(mgpu_core, "_run_serde_pass", spy)
  return modules
