#!/usr/bin/env bash
# GPU check: the reference engine's tiny model on CUDA through the client, against CPU.
#
# For a machine with an NVIDIA GPU, Python 3.12 and a CUDA build of torch preinstalled,
# and no network. Everything else arrives as wheels in a local directory, made on a
# machine WITH network (same OS family and CPU architecture; Python 3.12 wheels):
#
#   git clone ... trio-vllm && cd trio-vllm            # or this checkout
#   mkdir -p wheels
#   pip wheel --no-deps -w wheels .                    # trio-vllm itself (no deps)
#   pip download -d wheels --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       trio anyio pyzmq msgspec numpy attrs sortedcontainers outcome sniffio idna \
#       typing_extensions
#   # copy wheels/ and bench/gpu_check.{sh,py} to the GPU machine
#
# Then, there:   bash bench/gpu_check.sh [WHEELS_DIR] [-- extra gpu_check.py args]
#
# It makes a virtual environment that sees the system's torch (--system-site-packages),
# installs the wheels with --no-index, checks that torch sees CUDA, and runs
# gpu_check.py: the tiny model on cpu, then on cuda (one fresh engine each), greedy
# tokens compared request by request (any difference reported), steps/s, the client's
# CPU per step and its lag behind the engine ("client keeps up: yes/no"). Under 3
# minutes on any GPU (the model is 2 layers of width 64; the CPU half dominates).
#
# Without a GPU, the CPU half alone (the same code path, cpu both times):
#   bash bench/gpu_check.sh WHEELS_DIR -- --devices cpu,cpu
# or in a development checkout:  python bench/gpu_check.py --devices cpu,cpu
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
wheels="${1:-$here/../wheels}"
shift || true
[[ "${1:-}" == "--" ]] && shift
python="${PYTHON:-python3.12}"
command -v "$python" >/dev/null || python=python3

venv="${GPU_CHECK_VENV:-/tmp/trio-vllm-gpu-check}"
if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv --system-site-packages "$venv"
fi
# The client's runtime dependencies only: the text frontend's (tokenizers, jinja2) are
# imported lazily and not needed here, so trio-vllm itself goes in with --no-deps.
"$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" \
    trio anyio pyzmq msgspec numpy
"$venv/bin/python" -m pip install -q --no-index --no-deps --find-links "$wheels" trio-vllm
"$venv/bin/python" - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"cuda available: {torch.cuda.is_available()}")
EOF
cd /tmp  # import trio_vllm from the venv, not from a checkout's src/
exec timeout 600 "$venv/bin/python" "$here/gpu_check.py" --json /tmp/gpu_check.json "$@"
