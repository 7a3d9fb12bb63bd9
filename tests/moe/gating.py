"""Input generators shared by the gating tests."""

import hypothesis.extra.numpy as hnp
import numpy as np
from hypothesis import strategies as st

# Few distinct values (ties everywhere), infinities, NaN, signed zeros and huge magnitudes.
SPECIAL = [-np.inf, np.inf, np.nan, -1e30, 1e30, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0]


def tricky_rows(shape):
  """A strategy of float32 arrays mixing repeated values, special values and random ones."""
  elems = st.one_of(st.sampled_from(SPECIAL), st.floats(-4, 4, width=32))
  return hnp.arrays(np.float32, shape, elements=elems)
