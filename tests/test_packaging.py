"""The package imports with only its declared runtime dependencies, and ``import jaxkern`` reaches every subpackage."""

import os
import pkgutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern.modeling import _optimizer

# What the dev / docs extras add; none may be needed to import the library.
EXTRAS_ONLY = ("optax", "matplotlib", "hypothesis", "pytest", "nbmake", "mkdocs")


def test_every_module_imports_without_the_extras():
  script = textwrap.dedent(f"""
      import importlib, pkgutil, sys
      for name in {EXTRAS_ONLY!r}:
        sys.modules[name] = None  # any import of it raises ImportError
      import jaxkern
      names = [m.name for m in pkgutil.walk_packages(jaxkern.__path__, "jaxkern.")]
      for name in names:
        importlib.import_module(name)
      print(len(names))
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert int(out.stdout.split()[-1]) > 40


def test_import_jaxkern_reaches_every_subpackage():
  subpackages = {m.name for m in pkgutil.iter_modules(jaxkern.__path__) if m.ispkg}
  assert subpackages >= {"engram", "gemm", "mhc", "modeling", "moe", "quant", "reference", "transpose"}
  for name in subpackages:
    assert getattr(jaxkern, name).__name__ == f"jaxkern.{name}"


def test_training_helpers_match_optax_bitwise():
  optax = pytest.importorskip("optax")
  logits = jax.random.normal(jax.random.key(1), (3, 5, 37)) * 4
  labels = jax.random.randint(jax.random.key(2), (3, 5), 0, 37)
  for f in (jax.jit, lambda fn: fn):
    ours = f(_optimizer.cross_entropy_with_integer_labels)(logits, labels)
    theirs = f(optax.softmax_cross_entropy_with_integer_labels)(logits, labels)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint32), np.asarray(theirs).view(np.uint32))
  grad = jax.grad(lambda x: _optimizer.cross_entropy_with_integer_labels(x, labels).sum())(logits)
  grad_optax = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).sum())(logits)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad_optax))
  params = {"w": jnp.ones((4,), jnp.bfloat16), "b": jnp.arange(3.0), "none": None}
  updates = {"w": jnp.full((4,), 0.3, jnp.float32), "b": jnp.ones(3), "none": None}
  ours, theirs = _optimizer.apply_updates(params, updates), optax.apply_updates(params, updates)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
