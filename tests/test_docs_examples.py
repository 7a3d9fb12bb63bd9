"""Every ```python block of README.md and docs/*.md runs.

The blocks of one file run in order in one namespace (a page may build on its earlier blocks), in this
process, on whatever backend it has. An HTML comment on the line right before a block's fence marks it:

* ``<!-- docs-test: gpu -->``: needs a GPU; a test of its own, skipped where jax has no GPU backend.
* ``<!-- docs-test: devices=8 -->``: a test of its own, run in a fresh Python process with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` (a multi-device example on
  simulated CPU devices: the flag must be set before jax starts, so not in this process).

A marked block is self-contained: it does not see the names of the page's other blocks.

Blocks of other languages (```bash, ```text) are not run. The examples run with the implementation a user gets
by default (``"auto"``: the ``jnp`` references on a CPU, the kernels on a GPU), not the test suite's process-wide
``"interpret"``; keep them small.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import jaxkern

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*docs-test:\s*(?P<marker>[^>]*?)\s*-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```\s*$",
                    re.MULTILINE | re.DOTALL)
MARKERS = ("gpu", "devices=8")
ON_GPU = jax.default_backend() == "gpu"


def blocks(path: pathlib.Path) -> list[tuple[int, str | None, str]]:
  """``(line, marker or None, code)`` of every python block of a Markdown file."""
  text = path.read_text()
  found = []
  for m in _BLOCK.finditer(text):
    marker = m["marker"]
    if marker is not None and marker not in MARKERS:
      raise ValueError(f"{path.name}: unknown docs-test marker {marker!r} (known: {MARKERS})")
    found.append((text.count("\n", 0, m.start("code")) + 1, marker, m["code"]))
  return found


def test_every_page_is_collected():
  assert (ROOT / "README.md") in FILES and len(FILES) > 5
  assert any(blocks(path) for path in FILES)


def test_markers_are_parsed():
  assert blocks(ROOT / "README.md"), "README.md has python examples"


def _run_on_8_devices(code: str, where: str) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
  assert result.returncode == 0, f"{where}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def _cases(marker):
  return [pytest.param(path, line, code, id=f"{path.relative_to(ROOT).as_posix()}:{line}")
          for path in FILES for line, m, code in blocks(path) if m == marker]


@pytest.fixture
def default_implementation():
  """The user's default implementation for the duration of a test (conftest sets another one process-wide)."""
  suite = jaxkern.get_implementation()
  jaxkern.set_implementation(None)
  yield
  jaxkern.set_implementation(suite)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_run(path, default_implementation):
  """The unmarked blocks of a file, in order, in one namespace."""
  namespace = {"__name__": f"docs_example_{path.stem}"}
  for line, marker, code in blocks(path):
    if marker is None:
      exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102  (the docs' examples)


@pytest.mark.parametrize("path, line, code", _cases("devices=8"))
def test_multi_device_examples_run(path, line, code):
  _run_on_8_devices(code, f"{path.relative_to(ROOT)}:{line}")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("path, line, code", _cases("gpu"))
def test_gpu_examples_run(path, line, code, default_implementation):
  exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), {"__name__": "docs_example_gpu"})  # noqa: S102
