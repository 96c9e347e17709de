#!/usr/bin/env bash
# Run on the CPU machine from the repository root: builds .gpu-sglang/ (git-ignore it) for
# benchmarks/gpu_sglang.sh on the lent GPU host, which has torch 2.11, triton 3.6 and Python 3.12
# but no SGLang and no network.
#   .gpu-sglang/sglang_py.zip  SGLang 0.5.23's Python tree and its JIT sources (.py, .cpp, .h, .cu; 18 MB)
#   .gpu-sglang/whl/           cp312 wheels the linker path imports that the device lacks (30 MB)
#   .gpu-sglang/hdr/include/   Python 3.12 and OpenSSL 3.0 headers (4 MB): SGLang's page hashes come from
#                              a C++ extension it compiles at first use (hash_binding.cpp, SHA-256 from
#                              libcrypto), in case the device lacks the headers
# sglang-kernel (373 MB, cannot load on torch 2.11), flashinfer and the other CUDA packages do not travel.
set -euo pipefail
out=.gpu-sglang
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p $out/whl
tags="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64"
# SGLang 0.5.23 is published for CPython 3.11 only (its Rust extensions); the linker path needs none
# of them, and its .py files run on the device's 3.12.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_34_x86_64 -d "$tmp" sglang==0.5.23
(cd "$tmp" && mkdir x && cd x && unzip -q ../sglang-0.5.23-*.whl &&
  find sglang sglang-0.5.23.dist-info -type f \( -name '*.py' -o -name METADATA -o -name RECORD \
    -o -name entry_points.txt -o -name '*.cpp' -o -name '*.h' -o -name '*.cuh' -o -name '*.cu' \) |
    zip -q -9 ../sglang_py.zip -@)
cp "$tmp/sglang_py.zip" $out/
# What SGLang's memory pools, tree, scheduler and server-args modules import (their versions as in
# the CPU test session), IPython's own needs, and cattrs for cacheon. transformers and
# huggingface_hub travel too: SGLang 0.5.23 pins transformers 5.19 (the device has 5.17).
python3 -m pip download -q --no-deps $tags -d $out/whl \
  annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cattrs==26.2.1 compressed-tensors==0.20.1 dill==0.4.1 \
  distro==1.9.0 gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 jiter==0.19.0 \
  loguru==0.7.3 msgspec==0.23.0 openai==3.57.0 opentelemetry-api==1.45.2 orjson==3.13.0 \
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 \
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 transformers==5.19.0 truststore==0.10.5 \
  typing-inspection==0.4.5 ipython==9.18.1 asttokens==3.0.2 executing==2.3.0 \
  ipython-pygments-lexers==1.1.1 jedi==0.20.1 matplotlib-inline==0.2.2 parso==0.8.7 pexpect==4.9.0 \
  prompt-toolkit==3.0.53 ptyprocess==0.7.0 pure-eval==0.2.4 stack-data==0.6.3 traitlets==5.16.1 \
  wcwidth==0.9.4
# Headers from this machine: a Python 3.12 (pyenv) and Debian's libssl-dev (OpenSSL 3.0, the ABI
# of the device's libcrypto.so.3).
py312=$(ls -d /root/.pyenv/versions/3.12*/include/python3.12 2>/dev/null | head -1)
rm -rf $out/hdr && mkdir -p $out/hdr/include/openssl
cp -r "$py312" $out/hdr/include/
cp /usr/include/openssl/*.h /usr/include/x86_64-linux-gnu/openssl/*.h $out/hdr/include/openssl/
du -sh $out $out/whl $out/hdr
