#!/bin/bash
# Expert-parallel exchange, 2 H200s (kind nvidia-h200-x2), from the repo root with PYTHONPATH=$PWD; writes $OUT/a2a/.
# Two calls of < 600 s each (compiles dominate: 45-85 s per step, fewer with the persistent cache of the same call):
#   bash benchmarks/ep_scaling_2gpu.sh A   1-GPU baselines (8192 and 16384 tokens, on GPU 0 and GPU 1 side by side), then the
#                                2-GPU step at 16384 tokens (strong scaling at 16384; weak at 8192 per GPU) with the
#                                all-gather and the all-to-all exchange (--no-split)
#   bash benchmarks/ep_scaling_2gpu.sh P   the profile split (benchmarks/profile_step.py) of the all-to-all step at 16384
#                                tokens with 1 and 2 chunks: how much of the exchange the chunks hide
#   bash benchmarks/ep_scaling_2gpu.sh B   all-to-all in 2 chunks at 16384 tokens; the split of the all-to-all step (dispatch /
#                                combine GB/s, the NCCL all_to_all peak, 256 MB per device) with --check; then both
#                                modes at 32768 tokens (weak scaling at 16384 per GPU)
# Setup of every run: the v3 layer, FP8 GEMMs, capacity 1.1 (2 GPUs; benchmarks/NOTES.md), bf16 combine, bf16
# gradient all-reduce, --shard-optimizer, the latency-hiding scheduler. Weak scaling: t(1 GPU, T) / t(2 GPUs, 2T);
# strong: t(1, 16384) / (2 t(2, 16384)). Rows: $OUT/a2a/*.jsonl (copy them to benchmarks/results/train_step/).
CAPACITY=1.1
source "$(dirname "$0")/ep_scaling_common.sh"
if [ "$part" = A ]; then
  one_gpu_baselines
  wait
  run 2gpu_t16k_ag 170 --devices 2 --batch 8 --no-split
  run 2gpu_t16k_a2a 170 --devices 2 --batch 8 --no-split --ep-exchange all_to_all
elif [ "$part" = P ]; then  # how much of the exchange the chunks hide: the profile split, 1 and 2 chunks
  profile_chunks 2 8 250
else
  run 2gpu_t16k_a2a_c2 150 --devices 2 --batch 8 --no-split --ep-exchange all_to_all --ep-exchange-chunks 2
  run 2gpu_t16k_a2a_split 220 --devices 2 --batch 8 --ep-exchange all_to_all --check
  run 2gpu_t32k_ag 110 --devices 2 --batch 16 --no-split
  run 2gpu_t32k_a2a 110 --devices 2 --batch 16 --no-split --ep-exchange all_to_all
fi
grep -h "^step \|GB/s\|check .*: \(ok\|FAIL\)" $D/*.txt > $D/summary_$part.txt
