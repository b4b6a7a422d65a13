# Sourced by scripts/demo and scripts/test: make (once) and activate .venv with condmem installed.
# Installs a CPU build of PyTorch when none is present: the package runs on CPU; on a GPU
# machine, install your CUDA torch first (or set CONDMEM_VENV to an environment that has it).
set -euo pipefail
VENV="${CONDMEM_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  # 2.13.0 is the CPU wheel this workplace keeps on disk; elsewhere fall back to any torch.
  python -m pip install -q "torch==2.13.0" 2>/dev/null || python -m pip install -q "torch>=2.4"
fi
# Reinstalled when the build changes: that also rebuilds the native extension (setup.py).
stale=0
for f in pyproject.toml setup.py src/condmem/native/gather.c src/condmem/native/hash.c src/condmem/native/checksum.c; do
  if [ ! -f "$VENV/.condmem-installed" ] || [ "$f" -nt "$VENV/.condmem-installed" ]; then stale=1; fi
done
if [ "$stale" = 1 ]; then
  python -m pip install -q -e ".[${CONDMEM_EXTRAS:-dev}]"
  touch "$VENV/.condmem-installed"
fi
