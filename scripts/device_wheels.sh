#!/usr/bin/env bash
# Download, into .whl/, the wheels that scripts/device_check.sh installs on a borrowed GPU
# machine: the packages the chapters need beyond what that machine's image holds (PyTorch,
# pandas, matplotlib, seaborn, ONNX, tokenizers and sacrebleu are there; the notebook kernel,
# Altair and num2words are not), for its Python (3.12 on x86-64), at requirements.txt's pins.
# That machine reaches no registry, so the wheels travel with the working tree (about 18 MB;
# .whl/ is git-ignored, so the device tool's `run` must name it in `carry`).
#
#   bash scripts/device_wheels.sh [python-version]      # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
abi="cp${version/./}"
pin() { grep -E "^$1==" requirements.txt; }
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux_2_28_x86_64 --platform any)
mkdir -p .whl
python3 -m pip download --quiet --dest .whl --only-binary=:all: --python-version "$version" \
    --implementation cp --abi "$abi" "${platforms[@]}" \
    "$(pin altair)" "$(pin ipykernel)" "$(pin nbclient)" "$(pin nbformat)"
# num2words needs docopt for its command line only, and docopt has no wheel.
python3 -m pip download --quiet --no-deps --dest .whl --only-binary=:all: \
    --python-version "$version" --platform any "$(pin num2words)"
du -sh .whl
