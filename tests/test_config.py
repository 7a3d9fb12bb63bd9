import functools

import jax
import jax.numpy as jnp
import pytest

import jaxkern
from jaxkern import transpose
from jaxkern.testing import lower_for_h100


def test_precedence(monkeypatch):
  before = jaxkern.get_implementation()
  monkeypatch.setenv("JAXKERN_IMPLEMENTATION", "reference")
  jaxkern.set_implementation(None)
  try:
    assert jaxkern.get_implementation() == "reference"
    jaxkern.set_implementation("interpret")
    assert jaxkern.get_implementation() == "interpret"
    with jaxkern.use_implementation("xla"):
      assert jaxkern.get_implementation() == "xla"
      assert jaxkern.get_implementation("interpret") == "interpret"
    monkeypatch.setenv("JAXKERN_IMPLEMENTATION", "auto")
    jaxkern.set_implementation(None)
    assert jaxkern.get_implementation() == "auto"
  finally:
    jaxkern.set_implementation(before)


def test_unknown_name():
  with pytest.raises(ValueError, match="implementation must be one of"):
    jaxkern.set_implementation("triton")
  with pytest.raises(ValueError, match="implementation must be one of"):
    with jaxkern.use_implementation("gpu"):
      pass
  with pytest.raises(ValueError, match="implementation must be one of"):
    transpose.transpose(jnp.zeros((64, 64)), implementation="cuda")


def _paths(fn, *args):
  return [d.path for d in jaxkern.explain(fn, *args)]


def test_explain_reports_each_op_and_sees_through_jit_caches():
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  f = jax.jit(lambda v: transpose.transpose(transpose.transpose(v)))
  with jaxkern.use_implementation("interpret"):
    ds = jaxkern.explain(f, x)
    assert [(d.op, d.path) for d in ds] == [("transpose", "interpret")] * 2
    assert _paths(f, x) == ["interpret", "interpret"]  # traced again, not served from jit's cache
  with jaxkern.use_implementation("reference"):
    assert _paths(f, x) == ["reference", "reference"]
  assert _paths(lambda v: transpose.transpose(v, implementation="xla"), x) == ["xla"]
  empty = jax.ShapeDtypeStruct((0, 64), jnp.float32)
  assert _paths(lambda v: transpose.transpose(v, implementation="pallas"), empty) == ["xla"]


def test_auto_off_gpu_runs_the_reference():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU semantics")
  (d,) = jaxkern.explain(lambda v: transpose.transpose(v, implementation="auto"), jnp.zeros((64, 64)))
  assert d.path == "reference" and "off a GPU" in d.reason


def test_a_change_of_implementation_retraces_jitted_functions():
  """The setting is part of jax.jit's cache key: the same jitted function, and a new jit of the same
  Python function, trace again after a change."""
  traces = []

  def g(v):
    traces.append(jaxkern.get_implementation())
    return transpose.transpose(v)

  f = jax.jit(g)
  x = jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64)
  before = jaxkern.get_implementation()
  with jaxkern.use_implementation("xla"):
    f(x)
    f(x)
    jax.jit(g)(x)
  jaxkern.set_implementation("reference")
  try:
    f(x)
    jax.jit(g)(x)
    with jaxkern.use_implementation("xla"):
      jax.jit(g)(x)  # the trace made under "xla" serves again
  finally:
    jaxkern.set_implementation(before)
  assert traces == ["xla", "reference"]


def test_explicit_kernel_request_raises_when_the_kernel_cannot_run():
  x = jnp.zeros((64, 64), jnp.bool_)
  with pytest.raises(jaxkern.KernelUnavailableError, match="transpose: implementation='interpret' cannot run"):
    transpose.transpose(x, implementation="interpret")
  assert transpose.transpose(x, implementation="xla").dtype == jnp.bool_


def test_decide_on_a_gpu(monkeypatch):
  """The dispatch rules of "auto" on a GPU, tested without one."""
  from jaxkern import _dispatch

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  decide = _dispatch.decide
  assert decide("op", "auto").path == "pallas"
  assert decide("op", "auto", xla_faster="K = 6 (XLA_TOPK)").path == "xla"
  d = decide("op", "auto", unsupported="int64 ids")
  assert d.path == "xla" and "int64 ids" in d.reason
  assert decide("op", "auto", has_kernel=False).path == "xla"
  assert decide("op", "pallas", xla_faster="measured").path == "pallas"
  assert decide("op", "pallas", empty=True, unsupported="empty").path == "xla"
  assert decide("op", "xla").path == "xla"
  assert decide("op", "reference", unsupported="x").path == "reference"
  with pytest.raises(jaxkern.KernelUnavailableError, match="op: implementation='pallas' cannot run .*int64 ids"):
    decide("op", "pallas", unsupported="int64 ids")


def test_decisions_are_logged(caplog):
  with caplog.at_level("DEBUG", logger="jaxkern"):
    transpose.transpose(jnp.zeros((64, 64), jnp.float32), implementation="xla")
  assert "transpose: xla (implementation='xla')" in caplog.text


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the rule for a machine without a GPU")
def test_pallas_off_a_gpu_says_so():
  x = jnp.zeros((64, 64), jnp.float32)
  with pytest.raises(jaxkern.KernelUnavailableError, match="transpose: implementation='pallas' .*needs an NVIDIA "
                     "Hopper GPU; the JAX backend is 'cpu'.*'interpret'"):
    transpose.transpose(x, implementation="pallas")
  # zero-size problems and ops without a kernel take their XLA code, as on a GPU
  assert transpose.transpose(jnp.zeros((0, 64), jnp.float32), implementation="pallas").shape == (64, 0)
  # lowering for an abstract H100 counts as a GPU
  lowered = lower_for_h100(functools.partial(transpose.transpose, implementation="pallas"), x)
  assert "mosaic_gpu" in lowered.as_text()


def test_rank_checks_stay_on_when_chex_asserts_are_off():
  import chex
  chex.disable_asserts()
  try:
    with pytest.raises(ValueError, match="must have rank 2"):
      transpose.transpose(jnp.zeros((64,), jnp.float32), implementation="xla")
  finally:
    chex.enable_asserts()


def test_shape_checks_stay_on_when_chex_asserts_are_off():
  import chex
  wh, we = jnp.ones((4, 128), jnp.bfloat16), jnp.ones((2, 128), jnp.bfloat16)
  message = r"weight_embed must have shape \(4, 128\) \(the shape of weight_hidden\), got \(2, 128\)"
  with pytest.raises(ValueError, match=message):
    jaxkern.engram.fused_weight(wh, we, implementation="xla")
  chex.disable_asserts()
  try:
    with pytest.raises(ValueError, match=message):
      jaxkern.engram.fused_weight(wh, we, implementation="xla")
  finally:
    chex.enable_asserts()


def test_interpret_results_are_finished_when_called_eagerly(monkeypatch):
  # Interpret mode's host callbacks dispatch JAX operations; an eager caller gets a finished result (so its next
  # eager operations cannot interleave with the kernel's callbacks), a jitted caller its tracer untouched.
  from jaxkern import _dispatch
  waited = []
  monkeypatch.setattr(jax, "block_until_ready", lambda r: waited.append(r) or r)
  x = jnp.arange(8.0)
  run = functools.partial(_dispatch.run, "op", "interpret", xla=lambda: None)
  assert run(kernel=lambda interpret: (x * 2, x)) is waited[0]
  jax.jit(lambda y: run(kernel=lambda interpret: y * 2))(x)
  assert len(waited) == 1
  assert _dispatch.run("op", "reference", kernel=lambda interpret: x, xla=lambda: x) is x
  assert len(waited) == 1


def test_first_interpret_call_keeps_the_trace_context():
  """In a fresh process, a jitted function whose first call runs an op's first interpret-mode kernel is traced once
  over two calls: the Pallas interpreter's first import registers an option of JAX's trace context, which jaxkern
  makes sure exists before any trace (the option missing from the first trace made the second call trace again)."""
  import subprocess
  import sys
  script = """
import jax, jax.numpy as jnp
import jaxkern
from jaxkern import transpose
jaxkern.set_implementation("interpret")
traces = []
@jax.jit
def f(x):
  traces.append(1)
  return transpose.transpose(x)
x = jnp.ones((64, 128), jnp.bfloat16)
f(x).block_until_ready()
f(x * 2).block_until_ready()
assert len(traces) == 1, len(traces)
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
