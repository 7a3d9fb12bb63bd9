#!/bin/bash
# Expert-parallel exchange, 4 H200s (kind nvidia-h200-x4), from the repo root with PYTHONPATH=$PWD; writes $OUT/a2a/.
# Three calls of < 600 s each (compiles dominate: 45-85 s per step, fewer with the persistent cache of the same call):
#   bash benchmarks/ep_scaling_4gpu.sh A   1-GPU baselines at 8192 and 16384 tokens (GPUs 0 and 1) beside the 2-GPU strong
#                                step at 16384 tokens, all-to-all (GPUs 2,3); then 4 GPUs at 16384 tokens (strong
#                                scaling, goal 85%) with both exchanges
#   bash benchmarks/ep_scaling_4gpu.sh B   4 GPUs at 32768 tokens (weak scaling at 8192 per GPU, goal 90%) with both exchanges,
#                                and the all-to-all in 2 chunks
#   bash benchmarks/ep_scaling_4gpu.sh C   4 GPUs at 65536 tokens (weak at 16384 per GPU) with both exchanges; the split of the
#                                all-to-all step at 32768 tokens (dispatch / combine GB/s beside the NCCL all_to_all peak
#                                of 256 MB per device) with --check
# Setup of every run: the v3 layer, FP8 GEMMs, capacity 1.25 (from 4 GPUs up; benchmarks/NOTES.md), bf16 combine,
# bf16 gradient all-reduce, --shard-optimizer, the latency-hiding scheduler. Rows: $OUT/a2a/*.jsonl.
CAPACITY=1.25
source "$(dirname "$0")/ep_scaling_common.sh"
if [ "$part" = A ]; then
  one_gpu_baselines
  CUDA_VISIBLE_DEVICES=2,3 run 2gpu_t16k_a2a 200 --devices 2 --batch 8 --no-split --ep-exchange all_to_all &
  wait
  run 4gpu_t16k_ag 170 --devices 4 --batch 8 --no-split
  run 4gpu_t16k_a2a 170 --devices 4 --batch 8 --no-split --ep-exchange all_to_all
elif [ "$part" = B ]; then
  run 4gpu_t32k_ag 180 --devices 4 --batch 16 --no-split
  run 4gpu_t32k_a2a 180 --devices 4 --batch 16 --no-split --ep-exchange all_to_all
  run 4gpu_t32k_a2a_c2 180 --devices 4 --batch 16 --no-split --ep-exchange all_to_all --ep-exchange-chunks 2
else
  run 4gpu_t64k_ag 170 --devices 4 --batch 32 --no-split
  run 4gpu_t64k_a2a 170 --devices 4 --batch 32 --no-split --ep-exchange all_to_all
  run 4gpu_t32k_a2a_split 230 --devices 4 --batch 16 --ep-exchange all_to_all --check
fi
grep -h "^step \|GB/s\|check .*: \(ok\|FAIL\)" $D/*.txt > $D/summary_$part.txt
