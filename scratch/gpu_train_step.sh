#!/bin/bash
# GPU checks of the train branch (issue 22 parts 1, 2, 4d): run from the repo root on one H100 / H200.
set -x
python -m pytest -p no:cacheprovider -q -x -m gpu tests/modeling/test_block.py
python -m benchmarks.train_step --iterations 10                # H100 size: step + component split, auto vs xla
python -m benchmarks.train_step --iterations 10 --devices 1 --no-split   # the same step under a one-device mesh
