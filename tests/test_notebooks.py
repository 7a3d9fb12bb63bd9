"""The notebooks are stored executed: every code cell has its outputs, no cell stored an error, and each notebook
shows at least one plot when browsed (CI executes them again with nbmake, which checks they still run)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 7


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_outputs(path):
  cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
  unrun = [i for i, c in enumerate(cells) if c.get("execution_count") is None]
  assert not unrun, f"{path.name}: code cells {unrun} stored without being run"
  outputs = [o for c in cells for o in c.get("outputs", [])]
  assert not [o for o in outputs if o["output_type"] == "error"], f"{path.name} stored an error"
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} has no stored plot"
