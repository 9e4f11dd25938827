#!/usr/bin/env bash
# The pure-Python (and cp312 binary) wheels a lent GPU machine lacks for benchmarks/gpu_session.sh:
# loguru and gguf for the package, fastapi / uvicorn / pydantic for its serving step. The machine has
# no package index; these travel in .whl/ (git-ignored through .git/info/exclude), which the device
# tool carries when a call names it. Run here, where pip reaches the index:
#     bash benchmarks/gpu_wheels.sh
set -eu
cd "$(dirname "$0")/.."
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
get loguru gguf fastapi starlette uvicorn h11 pydantic pydantic-core annotated-types typing-inspection \
    typing-extensions opentelemetry-api
ls -la .whl
