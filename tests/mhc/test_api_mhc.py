"""The API pattern (tests/test_api.py) for the jaxkern.mhc ops of this module set: a reference of the same name
and signature, keyword-only implementation switch, return annotations."""

import inspect

import pytest

from jaxkern import mhc
from jaxkern.reference import mhc as ref

MINE = ["expand_to_mhc", "expand_to_mhc_bwd", "head_compute_mix", "head_compute_mix_bwd", "post", "post_bwd",
        "pre_apply_mix", "pre_apply_mix_bwd", "pre_split_mixes", "pre_split_mixes_bwd", "sinkhorn_normalize",
        "sinkhorn_normalize_bwd"]


@pytest.mark.parametrize("name", MINE)
def test_op_signature(name):
  op, reference = getattr(mhc, name), getattr(ref, name)
  sig = inspect.signature(op)
  params = dict(sig.parameters)
  impl = params.pop("implementation")
  assert impl.kind is inspect.Parameter.KEYWORD_ONLY and impl.default is None
  assert sig.return_annotation is not inspect.Signature.empty
  assert [(p.name, p.kind, p.default) for p in params.values()] == \
         [(p.name, p.kind, p.default) for p in inspect.signature(reference).parameters.values()], name
  assert op.__doc__ and "Raises" in op.__doc__ and "Differentiation" in op.__doc__
