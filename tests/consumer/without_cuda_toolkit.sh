#!/usr/bin/env bash
# Runs a command as on a machine without the CUDA toolkit: a laptop, a CPU CI runner or a pip-only
# GPU image, where pip's default (CUDA) build of torch is all there is of CUDA.
#   tests/consumer/without_cuda_toolkit.sh COMMAND [ARG...]
# In a private mount namespace (unshare; root, or user namespaces), an empty folder covers every
# toolkit folder (/usr/local/cuda*, /opt/cuda*, CUDA_HOME, CUDA_PATH), every folder on PATH that
# holds an nvcc is replaced by one without it, and the CUDA_* variables are unset. So CMake, torch's FindCUDA and
# anything else see no toolkit wherever they look. Fails when nvcc can still be found.
set -euo pipefail
if [ "${TORCHDP_TOOLKIT_HIDDEN:-}" != 1 ]; then
  user_ns=$([ "$(id -u)" = 0 ] || echo --map-root-user)
  exec unshare --mount $user_ns env TORCHDP_TOOLKIT_HIDDEN=1 bash "$0" "$@"
fi

empty_dir=$(mktemp -d)
for dir in /usr/local/cuda* /opt/cuda* ${CUDA_HOME:-} ${CUDA_PATH:-}; do
  if [ -d "$dir" ] && [ ! -L "$dir" ]; then
    mount --bind "$empty_dir" "$dir"
  fi
done
# A folder on PATH that holds nvcc (with other programs, as /usr/local/bin) is covered by a copy
# made of links to everything else in it, through a second view of the original.
IFS=: read -r -a path_dirs <<<"$PATH"
for dir in "${path_dirs[@]}"; do
  if [ -e "$dir/nvcc" ] && [ ! -e "$empty_dir.orig$dir/nvcc" ]; then
    mkdir -p "$empty_dir.orig$dir" "$empty_dir.shadow$dir"
    mount --bind "$dir" "$empty_dir.orig$dir"
    for entry in "$empty_dir.orig$dir"/* "$empty_dir.orig$dir"/.[!.]*; do
      if [ -e "$entry" ] && [ "$(basename "$entry")" != nvcc ]; then
        ln -s "$entry" "$empty_dir.shadow$dir/$(basename "$entry")"
      fi
    done
    mount --bind "$empty_dir.shadow$dir" "$dir"
  fi
done
unset CUDA_HOME CUDA_PATH CUDA_BIN_PATH CUDA_ROOT CUDA_TOOLKIT_ROOT CUDA_TOOLKIT_ROOT_DIR CUDACXX \
  CUDAToolkit_ROOT

for dir in "${path_dirs[@]}" /usr/local/cuda*/bin /opt/cuda*/bin; do
  if [ -e "$dir/nvcc" ]; then
    echo "without_cuda_toolkit.sh: $dir/nvcc is still visible" >&2
    exit 1
  fi
done
echo "== without the CUDA toolkit (no nvcc, no /usr/local/cuda): $*"
exec "$@"
