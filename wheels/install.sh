#!/bin/sh
# Offline install of xgrammar 0.2.8 (CPython 3.12, Linux x86-64) and what it and treegen need beyond a torch +
# transformers image (greenlet: the batch's program coroutines), from the wheels beside this script, each only where it is missing:
#   sh wheels/install.sh            (PYTHON=python3.12 sh wheels/install.sh for another interpreter)
# The wheels are not committed (git ignores wheels/*.whl); fetch them on a machine with the registry:
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 -d wheels \
#       xgrammar==0.2.8 apache-tvm-ffi pydantic annotated-types typing-inspection lark interegular greenlet
#   and pydantic's pydantic-core pin (see its METADATA; `--platform manylinux_2_17_x86_64`: under 2_28 the
#   registry offers only an empty 0.0.1 placeholder, which breaks `import pydantic`), e.g.
#   pip download ... --platform manylinux_2_17_x86_64 -d wheels pydantic-core==2.50.5
set -e
cd "$(dirname "$0")"
PY=${PYTHON:-python}
$PY -c "import pydantic, sys; sys.exit(not pydantic.VERSION.startswith('2'))" 2>/dev/null ||
    $PY -m pip install -q --no-deps pydantic-*.whl pydantic_core-*.whl annotated_types-*.whl typing_inspection-*.whl
$PY -c "import xgrammar" 2>/dev/null || $PY -m pip install -q --no-deps xgrammar-*.whl apache_tvm_ffi-*.whl
$PY -c "import lark" 2>/dev/null || $PY -m pip install -q --no-deps lark-*.whl  # the .tg parser (tests import it)
$PY -c "import interegular" 2>/dev/null || $PY -m pip install -q --no-deps interegular-*.whl  # regex automata
$PY -c "import greenlet" 2>/dev/null || $PY -m pip install -q --no-deps greenlet-*.whl  # the batch's program coroutines
$PY -c "import importlib.metadata, xgrammar; print('xgrammar', importlib.metadata.version('xgrammar'))"
