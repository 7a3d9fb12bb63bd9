import jax
import pytest

import jaxkern


def test_precedence(monkeypatch):
  before = jaxkern.get_implementation()
  monkeypatch.setenv("JAXKERN_IMPLEMENTATION", "reference")
  jaxkern.set_implementation(None)
  try:
    assert jaxkern.get_implementation() == "reference"
    jaxkern.set_implementation("interpret")
    assert jaxkern.get_implementation() == "interpret"
    with jaxkern.use_implementation("reference"):
      assert jaxkern.get_implementation() == "reference"
      assert jaxkern.get_implementation("interpret") == "interpret"
    monkeypatch.setenv("JAXKERN_IMPLEMENTATION", "auto")
    jaxkern.set_implementation(None)
    assert jaxkern.get_implementation() == ("pallas" if jax.default_backend() == "gpu" else "reference")
  finally:
    jaxkern.set_implementation(before)


def test_unknown_name():
  with pytest.raises(ValueError, match="implementation must be one of"):
    jaxkern.set_implementation("triton")
  with pytest.raises(ValueError, match="implementation must be one of"):
    with jaxkern.use_implementation("gpu"):
      pass
