# Session 24, run 82 (one call on run 80-81's machine, still warm; run from the repository
# root, as sent): the graph build's time on that machine's CPU (failed: PYTHONPATH=../src
# replaced device_setup.sh's path to MLX, "No module named 'mlx'"), then the LoRA step at
# 8192, stub and patched (bench/device_run.sh's lora_8192 with shorter limits).
source bench/device_run.sh 82 a bc385b6 bc385b6 >/dev/null 2>&1; cd bench; PYTHONPATH=../src timeout 60 python3 graph_build.py --T 16384 --repeats 50 2>&1 | tail -2; cd ..; timeout 230 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$(cat bench/lora_4layer.json)" --timeout 220 --T 8192 --modes stub patched --json $OUT/lora_h200_8192.json 2>&1 | tail -4
