# Prepared in session 14 for the next machine (not run yet): `bash <this> <part> <commit>`.
# part a: fla and chunkscan side by side at 65536 (not run in session 14); `output` and
#   `state_grads` with 32 columns of Dv per block (CHUNKSCAN_GDN_TV=32: 87 KiB of shared
#   memory for state_grads, two blocks per multiprocessor, against one at 64; measured
#   slower in run 13, before the tensor-core products and the cp.async copies) against the
#   default, the op at 16384 and Nsight Compute's kernel times; gpu_gaps under
#   CHUNKSCAN_GDN_NT=256 and =512 (every kernel at that many threads per block; the
#   per-kernel choice of run 13 predates the tensor-core products and the copies):
#   Nsight Compute's time of each kernel under both; gpu_gaps under
#   MLX_MAX_OPS_PER_BUFFER=20 against the default (MLX commits its first command graph
#   after 100 ops: does eager's first kernel start sooner?).
# part b: the LoRA step at 8192 under the defaults and under docs/mlx_lm.md's settings
#   (MLX_MAX_MB_PER_BUFFER=64, a memory limit 1024 MiB above the model, 256 MiB groups).
# Outputs in $OUT/run50<part>.tgz.
source bench/device_run.sh 50 "$1" "$2" "$2"  # st, $S, pack, ncu_kernels (no base/)
if [ "$1" = a ]; then
  cd bench
  st fla65k
  timeout 200 python3 gdn_vs_fla.py --T 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_65536_h200.json | grep -E "fla|chunkscan|rror"
  pack
  st tv32
  for tv in 64 32; do
    CHUNKSCAN_GDN_TV=$tv timeout 60 python3 gdn_vs_fla.py --T 16384 --impls chunkscan \
      --modes compiled eager --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_tv${tv}_h200.json \
      | grep -E "chunkscan|rror"
  done
  for tv in 64 32; do ncu_kernels tv$tv CHUNKSCAN_GDN_TV=$tv; done
  pack
  st nt
  for nt in 256 512; do ncu_kernels nt$nt CHUNKSCAN_GDN_NT=$nt; done
  pack
  st ops20
  for ops in 100 20 100 20; do
    MLX_MAX_OPS_PER_BUFFER=$ops timeout 60 python3 gpu_gaps.py --T 16384 2>&1 \
      | grep -E "^(eager|compiled)" | sed "s/^/ops $ops /"
  done | tee $S/gpu_gaps_ops.txt
  pack
else
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 250 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 230 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack
  MLX_MAX_MB_PER_BUFFER=64 CHUNKSCAN_GDN_GROUP_MIB=256 timeout 250 python3 bench/lora.py \
    --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 230 --T 8192 --modes stub patched \
    --memory-limit-mib 1024 --json $S/lora_h200_8192_bounded.json 2>&1 | tail -3
  pack
fi
st done
