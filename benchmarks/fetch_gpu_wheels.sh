#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (benchmarks/gpu_wheels.txt) into .whl/, for its
# Python 3.12 on x86-64. Needs pip and network here; the GPU machine has neither registry nor
# internet. .whl/ is git-ignored; name it in the device call's carry list: [".whl"].
#   bash benchmarks/fetch_gpu_wheels.sh [PYTHON]
# The device already has torch, torchvision, timm, numpy, scipy, pyyaml, pillow, tqdm,
# opencv-python-headless, huggingface-hub, safetensors and torchmetrics (KINDS.md), so only
# segmentation-models-pytorch, albumentations and their missing requirements are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
mkdir -p .whl
rm -f .whl/*.whl
grep -v '^\s*\(#\|$\)' benchmarks/gpu_wheels.txt | while read -r spec; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$spec"
done
ls -l .whl
du -ch .whl/*.whl | tail -1
