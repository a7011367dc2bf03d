# torchdp_prepare_torch_cuda([WITHOUT_CUDA] [HINTS <dir>...]): call before find_package(Torch).
#
# Note [A CUDA build of torch without the CUDA toolkit]
# pip's default torch wheel is a CUDA build, and torch's CMake package then insists on the CUDA
# toolkit: its public/cuda.cmake runs FindCUDA and enable_language(CUDA), which need nvcc, and
# without one Caffe2Config stops with "Your installed Caffe2 version uses CUDA but I cannot find the
# CUDA libraries". torchdp compiles no CUDA kernels: its CUDA code is plain C++ on the ATen/c10
# CUDA API, which needs only the CUDA runtime's headers and library. So, when torch is a CUDA build
# and no nvcc is found where torch's FindCUDA looks, this defines the one CUDA target torch's
# exported targets name, torch::cudart, before find_package(Torch); cuda.cmake returns at once when
# that target exists (its include guard), and Caffe2Config goes on. The target carries
#   - the headers and libcudart of pip's nvidia-* packages next to torch, when they are complete
#     (cuda_runtime_api.h and crt/host_defines.h; the crt headers come with `nvidia-cuda-crt`,
#     which torch's wheel does not install): TORCHDP_TORCH_CUDA_SOURCE is "pip";
#   - nothing otherwise: TORCHDP_TORCH_CUDA_SOURCE is "none", the caller builds without its CUDA
#     fast paths, and TORCHDP_TORCH_CUDA_HINT says how to get them.
# With a toolkit, or a CPU build of torch, nothing is defined and torch's own CMake code runs
# (TORCHDP_TORCH_CUDA_SOURCE "toolkit" or "").
# WITHOUT_CUDA: the caller builds without CUDA anyway; without a toolkit the target stays empty
# (TORCHDP_TORCH_CUDA_SOURCE "none", no hint).
# HINTS: folders that hold TorchConfig.cmake, searched after Torch_DIR and CMAKE_PREFIX_PATH.
function(torchdp_prepare_torch_cuda)
  cmake_parse_arguments(PARSE_ARGV 0 _arg "WITHOUT_CUDA" "" "HINTS")
  set(TORCHDP_TORCH_CUDA_SOURCE "" PARENT_SCOPE)
  set(TORCHDP_TORCH_CUDA_HINT "" PARENT_SCOPE)
  if(TARGET torch::cudart)
    return() # torch's package is loaded already, or a parent project prepared it
  endif()

  # The torch package find_package(Torch) will load: its folder is <torch>/share/cmake/Torch.
  set(_candidates)
  if(Torch_DIR)
    list(APPEND _candidates "${Torch_DIR}")
  endif()
  set(_prefixes ${CMAKE_PREFIX_PATH})
  if(DEFINED ENV{CMAKE_PREFIX_PATH})
    string(REPLACE ":" ";" _env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
    list(APPEND _prefixes ${_env_prefixes})
  endif()
  foreach(_prefix IN LISTS _prefixes)
    list(APPEND _candidates "${_prefix}/Torch" "${_prefix}/share/cmake/Torch")
  endforeach()
  list(APPEND _candidates ${_arg_HINTS})
  set(_torch_root "")
  foreach(_dir IN LISTS _candidates)
    if(EXISTS "${_dir}/TorchConfig.cmake")
      get_filename_component(_torch_root "${_dir}/../../.." ABSOLUTE)
      break()
    endif()
  endforeach()
  if(NOT _torch_root OR NOT EXISTS "${_torch_root}/lib/libc10_cuda.so")
    return() # not found here (find_package reports it) or a CPU build of torch
  endif()

  # A CUDA toolkit where torch's FindCUDA looks for one (an explicit compiler or root, the CUDA_*
  # environment variables, PATH, /usr/local/cuda, /opt/cuda): torch's own CMake code handles it.
  if(CMAKE_CUDA_COMPILER OR CUDA_TOOLKIT_ROOT_DIR OR DEFINED ENV{CUDACXX})
    set(TORCHDP_TORCH_CUDA_SOURCE "toolkit" PARENT_SCOPE)
    return()
  endif()
  find_program(TORCHDP_NVCC nvcc
    HINTS ENV CUDA_TOOLKIT_ROOT ENV CUDA_PATH ENV CUDA_BIN_PATH ENV CUDA_HOME
    PATH_SUFFIXES bin bin64
    PATHS /opt/cuda/bin /usr/local/cuda/bin)
  mark_as_advanced(TORCHDP_NVCC)
  if(TORCHDP_NVCC)
    set(TORCHDP_TORCH_CUDA_SOURCE "toolkit" PARENT_SCOPE)
    return()
  endif()

  if(_arg_WITHOUT_CUDA)
    add_library(torch::cudart INTERFACE IMPORTED)
    set(TORCHDP_TORCH_CUDA_SOURCE "none" PARENT_SCOPE)
    return()
  endif()

  # No toolkit: the CUDA runtime of pip's nvidia-* packages, next to torch in site-packages
  # (CUDA 13: nvidia/cu13/{include,lib}; CUDA 12: nvidia/<component>/{include,lib}).
  get_filename_component(_site "${_torch_root}/.." ABSOLUTE)
  file(GLOB _pip_includes LIST_DIRECTORIES true "${_site}/nvidia/*/include")
  file(GLOB _pip_libs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  find_path(TORCHDP_CUDART_INCLUDE_DIR cuda_runtime_api.h PATHS ${_pip_includes} NO_DEFAULT_PATH)
  find_path(TORCHDP_CUDA_CRT_INCLUDE_DIR crt/host_defines.h PATHS ${_pip_includes} NO_DEFAULT_PATH)
  find_library(TORCHDP_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12
    PATHS ${_pip_libs} NO_DEFAULT_PATH)
  mark_as_advanced(TORCHDP_CUDART_INCLUDE_DIR TORCHDP_CUDA_CRT_INCLUDE_DIR TORCHDP_CUDART_LIBRARY)

  # The CUDA release of the runtime headers, for the hint (CUDART_VERSION 13020 is 13.2).
  set(_cuda_release "<torch.version.cuda>")
  if(TORCHDP_CUDART_INCLUDE_DIR)
    file(STRINGS "${TORCHDP_CUDART_INCLUDE_DIR}/cuda_runtime_api.h" _line
      REGEX "^#define CUDART_VERSION +[0-9]+" LIMIT_COUNT 1)
    if(_line MATCHES "([0-9]+)$")
      math(EXPR _major "${CMAKE_MATCH_1} / 1000")
      math(EXPR _minor "(${CMAKE_MATCH_1} % 1000) / 10")
      set(_cuda_release "${_major}.${_minor}")
    endif()
  endif()

  add_library(torch::cudart INTERFACE IMPORTED)
  if(TORCHDP_CUDART_INCLUDE_DIR AND TORCHDP_CUDA_CRT_INCLUDE_DIR AND TORCHDP_CUDART_LIBRARY)
    # cudart's folder first; the others hold cuBLAS, cuSPARSE, ... (ATen's CUDA headers use them).
    set_target_properties(torch::cudart PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES
        "${TORCHDP_CUDART_INCLUDE_DIR};${TORCHDP_CUDA_CRT_INCLUDE_DIR};${_pip_includes}"
      INTERFACE_LINK_LIBRARIES "${TORCHDP_CUDART_LIBRARY}")
    set(TORCHDP_TORCH_CUDA_SOURCE "pip" PARENT_SCOPE)
    message(STATUS "torchdp: torch in ${_torch_root} is a CUDA build and no CUDA toolkit (nvcc) was "
      "found; using the CUDA ${_cuda_release} runtime of pip's nvidia packages "
      "(${TORCHDP_CUDART_LIBRARY})")
    return()
  endif()

  set(_missing)
  if(NOT TORCHDP_CUDART_INCLUDE_DIR)
    list(APPEND _missing "cuda_runtime_api.h")
  endif()
  if(NOT TORCHDP_CUDA_CRT_INCLUDE_DIR)
    list(APPEND _missing "crt/host_defines.h")
  endif()
  if(NOT TORCHDP_CUDART_LIBRARY)
    list(APPEND _missing "libcudart")
  endif()
  string(REPLACE ";" ", " _missing "${_missing}")
  set(TORCHDP_TORCH_CUDA_SOURCE "none" PARENT_SCOPE)
  string(CONCAT _hint
    "torch in ${_torch_root} is a CUDA build, but no CUDA toolkit (nvcc) was found and pip's "
    "nvidia packages in ${_site}/nvidia lack ${_missing}. For the CUDA fast paths, install the "
    "CUDA headers that match torch: `pip install \"nvidia-cuda-crt==${_cuda_release}.*\"` (or the "
    "CUDA ${_cuda_release} toolkit, nvcc on PATH or CUDA_HOME set), then rebuild. "
    "-DTORCHDP_WITH_CUDA=OFF builds without them and says nothing")
  set(TORCHDP_TORCH_CUDA_HINT "${_hint}" PARENT_SCOPE)
endfunction()
