#!/usr/bin/env bash
# Build nac_fast._C with its CUDA kernels HERE, for the GPU machine's Python and torch, so that a
# device run loads it instead of building it.  How (its venv, scratch build, stamp, carry):
# docs/gpu.md "Device-tool calls".
#
#   bash bench/prebuild_gpu_ext.sh [PYTHON_VERSION] [TORCH_VERSION] [ARCH]
#       defaults: 3.12 (pyenv's 3.12.x) 2.11.0 9.0 - the device image's Python 3.12 / torch 2.11
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYV=${1:-3.12}
TORCHV=${2:-2.11.0}
ARCH=${3:-9.0}
[[ "$PYV" =~ ^3\.[0-9]+$ ]] || { echo "PYTHON_VERSION must look like 3.12, got '$PYV'" >&2; exit 2; }
[[ "$TORCHV" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "TORCH_VERSION must look like 2.11.0, got '$TORCHV'" >&2; exit 2; }
[[ "$ARCH" =~ ^[0-9]+\.[0-9]+$ ]] || { echo "ARCH must look like 9.0, got '$ARCH'" >&2; exit 2; }
PYBIN=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYV".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
[ -x "$PYBIN" ] || { echo "no Python $PYV under pyenv (${PYENV_ROOT:-$HOME/.pyenv}/versions)" >&2; exit 2; }
VENV=$ROOT/.venv-gpu-ext
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCHV') else 1)" 2>/dev/null; then
  echo "== making $VENV (Python $PYV, torch $TORCHV)"
  rm -rf "$VENV"
  "$PYBIN" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==$TORCHV" numpy "setuptools>=64" wheel ninja
fi
TAG=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
SO=nac_fast/_C$TAG
STAMP=nac_fast/.gpu_ext_stamp
SUM=$(cat setup.py csrc/* | md5sum | cut -d' ' -f1)
WANT="$SUM torch=$TORCHV arch=$ARCH"
if [ -f "$SO" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  echo "== $SO is up to date ($WANT)"
  exit 0
fi
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
cp -r setup.py pyproject.toml README.md MANIFEST.in LICENSE csrc nac_fast kernels "$SCRATCH"/
find "$SCRATCH" -name "*.so" -delete
echo "== building $SO for torch $TORCHV, sm_${ARCH/./} (a few minutes)"
( cd "$SCRATCH" && PATH=/usr/local/cuda/bin:$PATH NAC_FAST_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" \
    MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1 ) || {
  tail -n 40 "$SCRATCH/build.log"; echo "build failed" >&2; exit 1; }
"$VENV/bin/python" - "$SCRATCH/$SO" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("nac_fast._C", sys.argv[1])
import torch  # noqa: F401  (the extension links against torch's libraries)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
if not m.built_with_cuda():
    sys.exit("the extension was built without its CUDA kernels")
print("== the extension loads under this torch and holds the CUDA kernels")
EOF
cp "$SCRATCH/$SO" "$SO.tmp" && mv "$SO.tmp" "$SO"
echo "$WANT" > "$STAMP"
echo "== wrote $SO; carry it: run(carry=[\"$SO\"], command=\"bash bench/gpu_suite.sh all\")"
