#!/usr/bin/env bash
# Build Horovod, the peer, into the active virtualenv, against its torch and its MPI
# (the mpich wheel's, or the cluster's MPI on PATH): MPI and PyTorch only.
#
#   jobs/peers/horovod.sh            # Horovod 0.28.1 (the latest release)
#
# Horovod 0.28.1 compiles its PyTorch extension as C++14, and torch 2.1 and later need
# C++17: the build fails with "C++17 or later compatible compiler is required to use
# PyTorch". The script raises the standard to 17 in its two CMakeLists.txt, and builds
# Release (-O3, as Horovod's own RelWithDebInfo, without the debug information that
# makes the compiler and linker slower). About 2 minutes on 2 cores (3.5 with debug
# information). Needs cmake and a C++ compiler.
set -euo pipefail
version=${HOROVOD_VERSION:-0.28.1}
python -c "import torch, mpi4py" || { echo "horovod.sh: install torch and mpi4py first" >&2; exit 2; }
command -v mpicxx > /dev/null || { echo "horovod.sh: no mpicxx on PATH (pip install mpich, or load your MPI)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$work"
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"
python -m pip install -q cffi cloudpickle psutil pyyaml packaging
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)" \
    python -m pip install -q --no-build-isolation "$src"
python -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '', 'built: MPI', hvd.mpi_built())"
