# Sourced by scripts/demo and scripts/test: make (once) and activate .venv with condmem installed.
#
# Versions come from constraints.txt (the exact releases the test suite was last run with), so a
# new release of a dependency cannot change what a fresh clone installs. Knobs:
#   CONDMEM_VENV=DIR           the environment to make or reuse (default .venv)
#   CONDMEM_CONSTRAINTS=FILE   another constraints file; "none": the newest releases (scripts/test --latest)
#   CONDMEM_EXTRAS=LIST        the extras to install (default dev)
# Installs the pinned CPU build of PyTorch when none is present. On a GPU machine, install your CUDA
# torch first (or point CONDMEM_VENV at an environment that has it): a torch other than the pinned
# one is kept, and torch and triton (which goes with torch) are then left unpinned.
set -euo pipefail
VENV="${CONDMEM_VENV:-.venv}"
CONSTRAINTS="${CONDMEM_CONSTRAINTS:-constraints.txt}"
if [ "$CONSTRAINTS" != none ] && [ ! -f "$CONSTRAINTS" ]; then
  echo "scripts/_env.sh: constraints file '$CONSTRAINTS' not found (CONDMEM_CONSTRAINTS=none installs the newest releases)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
pinned_torch=""
if [ "$CONSTRAINTS" != none ]; then
  pinned_torch="$(sed -n 's/^torch==//p' "$CONSTRAINTS")"
fi
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "$pinned_torch" ]; then
    # The pinned version's CPU wheel when one is on disk or on the index (pip prefers 2.13.0+cpu to 2.13.0).
    python -m pip install -q "torch==$pinned_torch"
  else
    python -m pip install -q "torch>=2.4"
  fi
fi
if [ "$CONSTRAINTS" != none ]; then
  pins="$(cd "$(dirname "$CONSTRAINTS")" && pwd)/$(basename "$CONSTRAINTS")"
  have_torch="$(python -c "import torch; print(torch.__version__.split('+')[0])")"
  if [ -n "$pinned_torch" ] && [ "$have_torch" != "$pinned_torch" ]; then
    echo "scripts/_env.sh: keeping the installed torch $have_torch (constraints pin $pinned_torch): torch and triton unpinned" >&2
    grep -v -E '^(torch|triton)==' "$pins" > "$VENV/constraints-own-torch.txt"
    pins="$(cd "$VENV" && pwd)/constraints-own-torch.txt"
  fi
  # An environment variable, not -c: pip passes it on to the isolated build of condmem (setuptools, wheel).
  export PIP_CONSTRAINT="$pins"
fi
# Reinstalled when the build or the pins change: that also rebuilds the native extension (setup.py).
want="constraints: $CONSTRAINTS; extras: ${CONDMEM_EXTRAS:-dev}"
if [ "$CONSTRAINTS" != none ]; then want="$want; sha256 $(sha256sum < "$CONSTRAINTS" | cut -c1-16)"; fi
stale=0
if [ ! -f "$VENV/.condmem-installed" ] || [ "$(cat "$VENV/.condmem-installed")" != "$want" ]; then stale=1; fi
for f in pyproject.toml setup.py src/condmem/native/gather.c src/condmem/native/hash.c src/condmem/native/checksum.c; do
  if [ "$stale" = 0 ] && [ "$f" -nt "$VENV/.condmem-installed" ]; then stale=1; fi
done
if [ "$stale" = 1 ]; then
  python -m pip install -q -e ".[${CONDMEM_EXTRAS:-dev}]"
  echo "$want" > "$VENV/.condmem-installed"
fi
unset PIP_CONSTRAINT
