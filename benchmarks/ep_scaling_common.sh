# Sourced by benchmarks/ep_scaling_2gpu.sh, ep_scaling_4gpu.sh and ep_scaling_8gpu.sh (set CAPACITY first): the
# call's part ($1, default A), the output folder $OUT/a2a, the GPU and XLA setup, run NAME TIMEOUT ARGS... (one
# benchmarks.train_step run with the common flags, rows in $D/NAME.jsonl, its output in $D/NAME.txt, a line in
# $D/log_$part.txt), one_gpu_baselines (the 1-GPU steps at 8192 and 16384 tokens on GPUs 0 and 1, in the background:
# the caller waits) and profile_chunks DEVICES BATCH TIMEOUT (the profile split of the all-to-all step with 1 and 2
# chunks).
part=${1:-A}
D=$OUT/a2a
mkdir -p $D
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export JAX_COMPILATION_CACHE_DIR=/tmp/a2a_jax_cache
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_all_reduce_combine_threshold_bytes=67108864"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $D/gpu_$part.txt 2>&1
COMMON="--config v3 --fp8-gemm --implementations auto --ep-capacity-factor $CAPACITY --ep-combine-dtype bfloat16 \
  --grad-reduce-dtype bfloat16 --shard-optimizer --iterations 20"
run() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >> $D/log_$part.txt
  timeout $limit python3 -m benchmarks.train_step $COMMON "$@" --out $D/$name.jsonl > $D/$name.txt 2>&1
  echo "   exit $? at $(date +%T)" >> $D/log_$part.txt
}
one_gpu_baselines() {  # the weak- and strong-scaling baselines, side by side on GPUs 0 and 1
  CUDA_VISIBLE_DEVICES=0 run 1gpu_t8k 200 --devices 1 --batch 4 --no-split &
  CUDA_VISIBLE_DEVICES=1 run 1gpu_t16k 200 --devices 1 --batch 8 --no-split &
}
profile_chunks() {  # devices, global batch, timeout: benchmarks/profile_step.py's split, rows in $D/profile.jsonl
  local devices=$1 batch=$2 limit=$3 chunks
  for chunks in 1 2; do
    timeout $limit python3 -m benchmarks.profile_step --config v3 --fp8-gemm --devices $devices --batch $batch \
      --ep-capacity-factor $CAPACITY --ep-combine-dtype bfloat16 --grad-reduce-dtype bfloat16 --shard-optimizer \
      --ep-exchange all_to_all --ep-exchange-chunks $chunks --rows $D/profile.jsonl > $D/profile_c$chunks.txt 2>&1
  done
}
