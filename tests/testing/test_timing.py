import pytest

from jaxkern.testing.timing import MEASURE_ATTEMPTS, _measured, _without


def test_flush_kernels_are_removed_by_name_wherever_they_run():
  run = [("iota_fusion", 0.001), ("loop_not_fusion", 0.125), ("mosaic_kernel", 0.010)]
  assert _without(run, ["loop_not_fusion"]) == pytest.approx(0.011)
  assert _without(run, []) == pytest.approx(0.136)


def test_only_one_kernel_per_flush_name_is_removed():
  run = [("loop_not_fusion", 0.125), ("loop_not_fusion", 0.004)]
  assert _without(run, ["loop_not_fusion"]) == pytest.approx(0.004)
  with pytest.raises(RuntimeError, match="not found"):
    _without(run[1:], ["loop_not_fusion", "other"])


def _flaky(failures: int, message: str = "The number of kernel launches is not divisible by the number of iterations"):
  calls = []

  def measure():
    calls.append(1)
    if len(calls) <= failures:
      raise RuntimeError(message)
    return [("mosaic_kernel", 0.01)]

  return measure, calls


def test_uneven_launch_counts_are_measured_again():
  measure, calls = _flaky(MEASURE_ATTEMPTS - 1)
  assert _measured(measure) == [("mosaic_kernel", 0.01)] and len(calls) == MEASURE_ATTEMPTS


def test_uneven_launch_counts_give_up_after_the_last_attempt():
  measure, calls = _flaky(MEASURE_ATTEMPTS)
  with pytest.raises(RuntimeError, match="not divisible"):
    _measured(measure)
  assert len(calls) == MEASURE_ATTEMPTS


def test_other_measurement_errors_are_not_retried():
  measure, calls = _flaky(1, "CUPTI profiling is not supported on this platform")
  with pytest.raises(RuntimeError, match="not supported"):
    _measured(measure)
  assert len(calls) == 1
