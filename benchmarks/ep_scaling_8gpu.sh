#!/bin/bash
# Expert-parallel exchange, 8 H200s of one host (kind nvidia-h200-x8), from the repo root with PYTHONPATH=$PWD; writes
# $OUT/a2a/. Four calls of < 600 s each (compiles dominate: 45-85 s per step, fewer with the persistent cache of the
# same call). The v3 layer has 8 routed experts: one a GPU.
#   bash benchmarks/ep_scaling_8gpu.sh A   1-GPU baselines at 8192 and 16384 tokens (GPUs 0 and 1 side by side); then 8 GPUs
#                                at 65536 tokens (weak scaling at 8192 per GPU, goal 85%; strong scaling at 65536 in all)
#                                with both exchanges
#   bash benchmarks/ep_scaling_8gpu.sh B   8 GPUs at 131072 tokens (weak scaling at 16384 per GPU) with both exchanges, and the
#                                all-to-all in 2 chunks at 65536 tokens
#   bash benchmarks/ep_scaling_8gpu.sh C   the split of the all-to-all step at 65536 tokens (dispatch / combine GB/s beside the
#                                NCCL all_to_all peak of 256 MB per device); --check of 8 GPUs against 1 at 16384 tokens
#   bash benchmarks/ep_scaling_8gpu.sh P   the profile split (benchmarks/profile_step.py) of the all-to-all step at 65536 tokens
# The unsharded step at 65536 tokens does not fit one GPU (`--memory --implementations xla`, XLA:CPU's compiled
# estimate, 2026-11-30: 89 GiB at 16384 tokens, 320 GiB at 65536, against 141 GB), so the strong-scaling baseline at
# 65536 tokens is four 16384-token steps on one GPU (the same tokens as 4 micro-batches): 4 t(1, 16384) / (8 t(8, 65536)). Setup of every run: the v3 layer, FP8 GEMMs, capacity 1.25 (from 4 GPUs up;
# benchmarks/NOTES.md), bf16 combine, bf16 gradient all-reduce, --shard-optimizer, the latency-hiding scheduler.
# Rows: $OUT/a2a/*.jsonl (copy them to benchmarks/results/train_step/).
CAPACITY=1.25
source "$(dirname "$0")/ep_scaling_common.sh"
if [ "$part" = A ]; then
  one_gpu_baselines
  wait
  run 8gpu_t64k_ag 180 --devices 8 --batch 32 --no-split
  run 8gpu_t64k_a2a 180 --devices 8 --batch 32 --no-split --ep-exchange all_to_all
elif [ "$part" = B ]; then
  run 8gpu_t128k_ag 190 --devices 8 --batch 64 --no-split
  run 8gpu_t128k_a2a 190 --devices 8 --batch 64 --no-split --ep-exchange all_to_all
  run 8gpu_t64k_a2a_c2 180 --devices 8 --batch 32 --no-split --ep-exchange all_to_all --ep-exchange-chunks 2
elif [ "$part" = C ]; then
  run 8gpu_t64k_a2a_split 260 --devices 8 --batch 32 --ep-exchange all_to_all
  run 8gpu_t16k_a2a_check 280 --devices 8 --batch 8 --no-split --ep-exchange all_to_all --check
else  # how much of the exchange the chunks hide: the profile split, 1 and 2 chunks
  profile_chunks 8 32 270
fi
grep -h "^step \|GB/s\|check .*: \(ok\|FAIL\)" $D/*.txt > $D/summary_$part.txt
