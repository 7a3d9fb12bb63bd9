import pytest

from jaxkern.testing.timing import _without


def test_flush_kernels_are_removed_by_name_wherever_they_run():
  run = [("iota_fusion", 0.001), ("loop_not_fusion", 0.125), ("mosaic_kernel", 0.010)]
  assert _without(run, ["loop_not_fusion"]) == pytest.approx(0.011)
  assert _without(run, []) == pytest.approx(0.136)


def test_only_one_kernel_per_flush_name_is_removed():
  run = [("loop_not_fusion", 0.125), ("loop_not_fusion", 0.004)]
  assert _without(run, ["loop_not_fusion"]) == pytest.approx(0.004)
  with pytest.raises(RuntimeError, match="not found"):
    _without(run[1:], ["loop_not_fusion", "other"])
