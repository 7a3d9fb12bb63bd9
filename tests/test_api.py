"""The API pattern every public op follows: a reference of the same name and signature,
keyword-only flags, return annotations, references independent of the kernels."""

import ast
import inspect
import pathlib
import types

import pytest

import jaxkern
from jaxkern import engram, gemm, mhc, moe, quant, reference, transpose
from jaxkern.reference import mhc_norm
from jaxkern.testing import fuzz, generators, lowering, numeric, timing

# jaxkern.mhc's references live in two modules: reference.mhc and (the RMS-normalised projection) reference.mhc_norm.
MHC_REFERENCES = types.SimpleNamespace(**{n: getattr(m, n) for m in (reference.mhc, mhc_norm) for n in dir(m)
                                          if not n.startswith("_")})
AREAS = {"engram": (engram, reference.engram), "gemm": (gemm, reference.gemm), "mhc": (mhc, MHC_REFERENCES), "moe": (moe, reference.moe),
         "quant": (quant, reference.quant), "transpose": (transpose, reference.transpose)}
# Public utilities that are not ops (no kernel, no implementation switch).
NOT_OPS = {"sf_logical", "sf_to_float", "split_multipliers"}
# Flags whose upstream default is True (kept: upstream's signature).
TRUE_FLAGS = {("engram_gate_fwd", "save_for_backward"), ("pre_norm_fn", "fuse_grad_acc")}
OPS = [(area, name) for area, (mod, _) in AREAS.items() for name in mod.__all__
       if callable(getattr(mod, name)) and not isinstance(getattr(mod, name), type) and name not in NOT_OPS]


def test_every_area_has_ops():
  assert {area for area, _ in OPS} == set(AREAS) and len(OPS) == 38 + 19 + 4


@pytest.mark.parametrize("area, name", OPS, ids=lambda v: v)
def test_op_signature(area, name):
  op = getattr(AREAS[area][0], name)
  ref = getattr(AREAS[area][1], name, None)
  assert ref is not None, f"jaxkern.reference.{area}.{name} is missing"
  sig = inspect.signature(op)
  params = dict(sig.parameters)
  impl = params.pop("implementation")
  assert impl.kind is inspect.Parameter.KEYWORD_ONLY and impl.default is None
  assert sig.return_annotation is not inspect.Signature.empty, f"{name} has no return annotation"
  for p in params.values():
    if isinstance(p.default, bool) and (name, p.name) not in TRUE_FLAGS:
      assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is False, f"{name}({p.name}=...)"
  ref_params = inspect.signature(ref).parameters
  assert [(p.name, p.kind, p.default) for p in params.values()] == \
         [(p.name, p.kind, p.default) for p in ref_params.values()], f"reference.{area}.{name} signature"


def test_references_import_no_kernel_code():
  for path in pathlib.Path(reference.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxkern"):
        assert node.module.startswith(("jaxkern.reference", "jaxkern.types")), f"{path.name}: {node.module}"
      if isinstance(node, ast.Import):
        assert not any(a.name.startswith("jaxkern") and not a.name.startswith("jaxkern.reference")
                       for a in node.names), path.name


def test_public_names():
  assert jaxkern.QuantTensor is jaxkern.types.QuantTensor is quant.QuantTensor
  assert moe.FusedMapping is jaxkern.types.FusedMapping
  assert "explain" in jaxkern.__all__ and "KernelUnavailableError" in jaxkern.__all__


def _public_callables():
  """(qualified name, callable) for every public callable: the ``__all__`` names of jaxkern and its areas (classes
  with their public methods), and every public function defined in a reference module or a module of
  jaxkern.testing."""
  areas = (jaxkern, engram, gemm, mhc, moe, quant, transpose, jaxkern.modeling, jaxkern.testing)
  seen = {}
  for mod in areas:
    for name in mod.__all__:
      obj = getattr(mod, name)
      if isinstance(obj, types.ModuleType):
        continue
      seen[f"{mod.__name__}.{name}"] = obj
      if isinstance(obj, type):
        for attr, member in vars(obj).items():
          if not attr.startswith("_") and inspect.isfunction(member):
            seen[f"{mod.__name__}.{name}.{attr}"] = member
  testing_modules = [numeric, generators, lowering, fuzz, timing]
  for mod in [getattr(reference, n) for n in reference.__all__] + [mhc_norm] + testing_modules:
    for name, obj in vars(mod).items():
      if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == mod.__name__:
        seen[f"{mod.__name__}.{name}"] = obj
  return sorted(seen.items())


def test_every_public_parameter_is_annotated():
  missing = []
  for qualname, obj in _public_callables():
    try:
      sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a class or builtin without a Python signature
      continue
    for p in sig.parameters.values():
      if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("self", "cls"):
        continue
      if p.annotation is inspect.Parameter.empty:
        missing.append(f"{qualname}({p.name})")
  assert not missing, "parameters without an annotation: " + ", ".join(missing)
