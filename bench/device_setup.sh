#!/usr/bin/env bash
# Set-up of THIS workplace's GPU machine only (no package registry there): unpack MLX's
# CUDA build packed by ../shared/tools/pack-mlx-cuda.sh (.mlxcuda/part.aa copied to
# /tmp/mlx by a first call, .mlxcuda/part.ab carried by the second) and install the
# carried wheels (.whl/: mlx-lm, fla-core) into /tmp/site. Source it:
#     source bench/device_setup.sh
# Anyone with a CUDA machine and pip needs none of this:
#     pip install -e '.[cuda,lm]' fla-core==0.6.0
set -e
if [ ! -d /tmp/mlx/mlx/core ] && [ ! -f /tmp/mlx/mlx/core.cpython-312-x86_64-linux-gnu.so ]; then
  cat /tmp/mlx/part.aa .mlxcuda/part.ab | xz -d -T8 | tar x -C /tmp/mlx
fi
if [ ! -d /tmp/site/mlx_lm ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  # mlx_lm/__init__.py imports its generate/convert stack; the benches need only
  # mlx_lm.models / mlx_lm.tuner, which import mlx alone.
  echo 'from ._version import __version__  # trimmed for the bench' > /tmp/site/mlx_lm/__init__.py
fi
export PYTHONPATH=/tmp/mlx:/tmp/site:$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
set +e
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
# MLX's PTX cache from an earlier call (a fresh machine otherwise compiles every kernel
# again: ~220 s for the LoRA model's first step): carry .mlxcuda/ptx.tgz, written by
# `bash bench/h200_suite.sh ... ptx_cache` into $OUT. First-step times measured with it
# are warm-cache times (bench/lora.py records ptx_cache_files_before).
PTX_DIR=/tmp/mlx/$(python3 -c 'import mlx.core as mx; print(mx.__version__)')/ptx
if [ -f .mlxcuda/ptx.tgz ] && [ ! -d "$PTX_DIR" ]; then
  mkdir -p "$PTX_DIR" && tar xzf .mlxcuda/ptx.tgz -C "$PTX_DIR"
  echo "PTX cache: $(find "$PTX_DIR" -name '*.ptx' | wc -l) kernels restored"
fi
