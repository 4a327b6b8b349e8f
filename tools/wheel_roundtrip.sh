#!/usr/bin/env bash
# The package as users install it: build the wheel, install it into a fresh virtualenv (CPU
# torch from constraints.txt), then, from outside the checkout, build the C++ kernel ahead of
# time, run a conformance subset and the smoke calibration. Fails on any warning printed.
# Usage: tools/wheel_roundtrip.sh   (CI runs it from .ci/run)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log="$work/log"

# Build isolation: the backend comes from [build-system], not from whatever setuptools the host
# python has (65.5 on one CI machine, too old to build a wheel without the `wheel` package).
python3 -m pip wheel -qq --no-deps -w "$work/dist" "$root" >"$log" 2>&1 || { cat "$log"; exit 1; }
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -qq -c "$root/constraints.txt" "$work"/dist/kernel_variants-*.whl "pytest>=8" >"$log" 2>&1 \
  || { cat "$log"; exit 1; }

cd "$work"  # nothing of the checkout on sys.path
export KV_CACHE_DIR="$work/cache" KV_BUILD_DIR="$work/build"
"$py" - "$work/venv" <<'PY'
import sys
import kernel_variants
assert kernel_variants.__file__.startswith(sys.argv[1]), f"imported from {kernel_variants.__file__}, not the wheel"
PY
"$work/venv/bin/kv" --version
"$work/venv/bin/kv" build 2>"$work/err" || { cat "$work/err"; exit 1; }
"$work/venv/bin/kv" calibrate --sweep smoke --windows 2 --iters 20 -q 2>>"$work/err"
"$py" -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/test_conformance.py" \
  -k "reference or aten or cpu_native or torch_shift" 2>>"$work/err"
if grep -i "warning" "$work/err"; then
  echo "wheel round trip: warnings printed (above)" >&2
  exit 1
fi
echo "wheel round trip: ok"
