#!/usr/bin/env bash
# Builds native/ in place on a machine without pip access (the lent GPU
# host): installs carried cffi/pycparser wheels from .whl/ into /tmp/site and
# compiles the cffi extension with the system python3.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("build_ffi", "native/build_ffi.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
mod.ffibuilder.compile(tmpdir=".", verbose=False)
PY
