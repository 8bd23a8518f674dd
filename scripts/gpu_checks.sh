#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one command per part, each within 10 minutes on an H200 (DEVELOPERS.md).
#
#   scripts/gpu_checks.sh prepare          # on a machine with network: the corpus and the wheels the GPU machine lacks
#   scripts/gpu_checks.sh learner OUT      # on the GPU machine: the CUDA tests, then what the learner costs a loop
#   scripts/gpu_checks.sh overhead OUT     # on the GPU machine: tokens/s with and without the learner, compiled too
#   scripts/gpu_checks.sh quality OUT      # on the GPU machine: dp against decoupled at 20 tokens per parameter
#
# The GPU machine needs no network: `prepare` builds runs/corpus and fetches runs/wheels (grpcio, protobuf and
# zstandard for the machine's Python), which travel with the checkout. Every part writes its figures under OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
out=${2:-runs/gpu}

gpu_python() {  # a CUDA device, the wheels the package's generated code needs, then the checkout's own package
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this part on a GPU machine')"
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pydeps runs/wheels/*.whl
    export PYTHONPATH="/tmp/pydeps:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

case "$part" in
prepare)
    python -m benchmarks.gpu.corpus runs/corpus
    python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d runs/wheels grpcio==1.85.3 protobuf==7.36.2 zstandard==0.25.0
    ;;
learner)
    gpu_python
    mkdir -p "$out"
    python3 -m pytest -q -m cuda -p no:cacheprovider
    for model in "35m --batch 16" "124m --batch 8"; do
        name=${model%% *}
        # shellcheck disable=SC2086  # the model's flags are words
        python3 -m benchmarks.gpu.learner_profile --device cuda --model $model --out "$out/profile-$name"
        # shellcheck disable=SC2086
        python3 -m benchmarks.gpu.learner_profile --device cuda --model $model --split-tensors \
            --out "$out/profile-$name-split"
        # shellcheck disable=SC2086  # Δ and int4 on the device
        python3 -m benchmarks.gpu.learner_profile --device cuda --model $model --device-codec \
            --out "$out/profile-$name-device-codec"
    done
    ;;
overhead)
    gpu_python
    mkdir -p "$out"
    for run in "default:" "device-codec:--device-codec" "compiled:--overhead-compile" \
               "compiled-device-codec:--overhead-compile --device-codec"; do
        # shellcheck disable=SC2086  # the flags are words
        python3 -m benchmarks.gpu.scale --device cuda --corpus runs/corpus --parts overhead --overhead-repeats 5 \
            --budget 150 ${run#*:} --out "$out/overhead-${run%%:*}"
    done
    ;;
quality)
    gpu_python
    python3 -m benchmarks.gpu.quality --corpus runs/corpus --out "$out/quality" --budget 480
    ;;
*)
    echo "usage: scripts/gpu_checks.sh prepare | learner OUT | overhead OUT | quality OUT" >&2
    exit 2
    ;;
esac
