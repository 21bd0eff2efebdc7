#!/usr/bin/env bash
# Create .venv-llamacpp with llama.cpp for `swiftlite export --format gguf` and its tests:
#   - llama-cpp-python, built from its source distribution (cmake + g++; about two minutes on
#     2 cores, once per machine and CPU kind: the wheel is kept in swiftlite's cache): its
#     module runs GGUF files and quantizes them
#     (llama_model_quantize);
#   - llama.cpp's own converters from the same sdist (convert_hf_to_gguf.py,
#     convert_lora_to_gguf.py, conversion/, gguf-py/), unpacked under
#     .venv-llamacpp/share/llama.cpp: the installed package does not carry them;
#   - gguf (gguf-py on PyPI) and what the converters import (torch, transformers, ...).
# Versions are pinned: the converter, the runtime and the quantizer come from one llama.cpp.
# Run it again at any time: it skips what is already there.
#   bash scripts/setup_llamacpp.sh
# LLAMACPP_CMAKE_ARGS adds cmake options (e.g. -DGGML_NATIVE=OFF for a build that other
# CPUs can use); the default leaves out llama-cpp-python's multimodal library (mtmd/llava),
# which swiftlite does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=0.3.36
GGUF_VERSION=0.19.0
VENV=.venv-llamacpp
SHARE=$VENV/share/llama.cpp
STAMP=$VENV/share/llama.cpp.version
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV

sdist() {  # the source distribution, downloaded once into pip's cache
  local dir=$VENV/share/sdist
  mkdir -p $dir
  [ -f $dir/llama_cpp_python-$VERSION.tar.gz ] || \
    $VENV/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d $dir
  echo $dir/llama_cpp_python-$VERSION.tar.gz
}

if [ "$(cat $STAMP 2>/dev/null)" != "$VERSION" ] || [ ! -f $SHARE/convert_hf_to_gguf.py ]; then
  TARBALL=$(sdist)
  rm -rf $SHARE.tmp && mkdir -p $SHARE.tmp
  top=llama_cpp_python-$VERSION/vendor/llama.cpp
  tar -xzf "$TARBALL" -C $SHARE.tmp --strip-components=3 \
    $top/convert_hf_to_gguf.py $top/convert_lora_to_gguf.py $top/conversion $top/gguf-py $top/LICENSE
  rm -rf $SHARE && mv $SHARE.tmp $SHARE
fi

if ! $VENV/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION' or not hasattr(llama_cpp, 'llama_model_quantize'))" 2>/dev/null; then
  # The wheel is built once per machine and kept in swiftlite's cache, under a key of the
  # version, the cmake options and this CPU's flags (ggml builds for the CPU it is built on), so
  # a second clone installs it. pip's own wheel cache does not serve here: it keys a build from
  # a folder by the folder's path, a new temporary one each time.
  CMAKE="-DLLAVA_BUILD=OFF ${LLAMACPP_CMAKE_ARGS:-}"
  key=$(printf '%s\n' "$VERSION" "$CMAKE" "$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)" \
    | sha256sum | cut -c1-16)
  wheels=${SWIFTLITE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swiftlite}/llama-cpp-python/$key
  if ! ls $wheels/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then
    TARBALL=$(sdist)
    echo "building llama-cpp-python $VERSION from source (cmake; a few minutes on 2 cores)..."
    start=$(date +%s)
    # llama-cpp-python turns on llama.cpp's common library (argument parsing, chat and JSON
    # helpers for llama.cpp's own programs), which its Python package never loads: it binds
    # libllama and ggml through ctypes. Left out, the build takes a third of the time.
    src=$(mktemp -d)
    tar -xzf "$TARBALL" -C "$src"
    sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE/set(LLAMA_BUILD_COMMON OFF CACHE/' \
      "$src/llama_cpp_python-$VERSION/CMakeLists.txt"
    CMAKE_ARGS="$CMAKE" $VENV/bin/pip wheel -q --no-deps -w "$src/wheel" \
      "$src/llama_cpp_python-$VERSION"
    mkdir -p "$(dirname $wheels)" && rm -rf $wheels && mv "$src/wheel" $wheels  # whole or not at all
    rm -rf "$src"
    echo "llama-cpp-python built in $(( $(date +%s) - start )) s (kept in $wheels)"
  fi
  $VENV/bin/pip install -q $wheels/llama_cpp_python-$VERSION-*.whl
fi
# What the converter imports (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt;
# its torch and transformers pins are relaxed to the versions swiftlite's own venv uses, so the
# tokenizers swiftlite saves load the same way). After the build, so that scripts/test.sh can
# start the build before swiftlite's venv exists.
if ! $VENV/bin/python -c "
import importlib.metadata as m, importlib.util as u, sys
mods = ('torch', 'transformers', 'numpy', 'sentencepiece', 'google.protobuf', 'safetensors')
sys.exit(not all(u.find_spec(x) for x in mods) or m.version('gguf') != '$GGUF_VERSION')" 2>/dev/null; then
  want() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }
  TORCH=$(want torch || echo 2.13.0+cpu)
  TRANSFORMERS=$(want transformers || echo 5.25.0)
  $VENV/bin/pip install -q "torch==$TORCH" "transformers==$TRANSFORMERS" "gguf==$GGUF_VERSION" \
    numpy sentencepiece protobuf safetensors
fi

echo $VERSION > $STAMP
rm -rf $VENV/share/sdist
echo "llama.cpp $VERSION is installed in $(pwd)/$VENV (converters in $(pwd)/$SHARE)"
