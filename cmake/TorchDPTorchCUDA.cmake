# torchdp_prepare_torch_cuda([WITHOUT_CUDA] [HINTS <dir>...]): call before find_package(Torch).
#
# Note [A CUDA build of torch and the CUDA toolkit]
# pip's default torch wheel is a CUDA build, and torch's CMake package then insists on a complete
# CUDA toolkit of its own: its public/cuda.cmake runs FindCUDA, enable_language(CUDA) and
# find_package(CUDAToolkit) (nvcc, cudart, nvrtc, the driver stub, ...), and on any failure
# Caffe2Config stops with "Your installed Caffe2 version uses CUDA but I cannot find the CUDA
# libraries". Machines often have something else: no toolkit, an nvcc alone (conda, pip's
# nvidia-cuda-nvcc), a toolkit without nvrtc, or one of another CUDA release than torch's.
# torchdp compiles no CUDA kernels: its CUDA code is plain C++ on the ATen/c10 CUDA API, which needs
# only the CUDA runtime's headers and library of torch's release. So, for a CUDA build of torch:
#   1. A toolkit (an explicit CMAKE_CUDA_COMPILER / CUDA_TOOLKIT_ROOT_DIR / CUDACXX, or an nvcc where
#      torch's FindCUDA looks) is used when its release is torch's and torch's own CUDA config
#      succeeds with it, tried first in a separate CMake run (its result cached per nvcc and torch):
#      TORCHDP_TORCH_CUDA_SOURCE "toolkit", and torch's CMake code runs as usual.
#   2. Otherwise this defines the one CUDA target torch's exported targets name, torch::cudart,
#      before find_package(Torch); cuda.cmake returns at once when that target exists (its include
#      guard), and Caffe2Config goes on. The target carries the CUDA runtime of torch's release:
#      the headers and libcudart of pip's nvidia-* packages next to torch, or of the skipped
#      toolkit when its release is torch's (TORCHDP_TORCH_CUDA_SOURCE "pip" or "toolkit-runtime").
#      The crt headers come with `nvidia-cuda-crt`, which torch's wheel does not install.
#   3. Without a complete runtime the target stays empty: TORCHDP_TORCH_CUDA_SOURCE "none", the
#      caller builds without its CUDA fast paths, and TORCHDP_TORCH_CUDA_HINT says why and how to
#      get them. torch's own CMake errors never reach the user for a toolkit problem.
# WITHOUT_CUDA: the caller builds without CUDA; the empty target is always defined, so that no
# toolkit, whole or partial, is looked at (TORCHDP_TORCH_CUDA_SOURCE "none", no hint).
# A CPU build of torch: nothing is defined (TORCHDP_TORCH_CUDA_SOURCE "").
# HINTS: folders that hold TorchConfig.cmake, searched after Torch_DIR and CMAKE_PREFIX_PATH.

# The CUDA release torch was built with ("13.0"), or "" when the package does not say.
function(_torchdp_torch_cuda_release torch_root out)
  set(_release "")
  if(EXISTS "${torch_root}/version.py") # the Python package
    file(STRINGS "${torch_root}/version.py" _line REGEX "^cuda[:=]" LIMIT_COUNT 1)
    if(_line MATCHES "'([0-9]+\\.[0-9]+)")
      set(_release "${CMAKE_MATCH_1}")
    endif()
  elseif(EXISTS "${torch_root}/build-version") # a LibTorch archive: 2.14.1+cu130
    file(STRINGS "${torch_root}/build-version" _line LIMIT_COUNT 1)
    if(_line MATCHES "\\+cu([0-9]+)([0-9])$")
      set(_release "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
    endif()
  endif()
  set(${out} "${_release}" PARENT_SCOPE)
endfunction()

# The CUDA release of a folder of CUDA headers, from CUDART_VERSION (13020 is 13.2), or "".
function(_torchdp_cudart_release include_dir out)
  set(_release "")
  if(EXISTS "${include_dir}/cuda_runtime_api.h")
    file(STRINGS "${include_dir}/cuda_runtime_api.h" _line
      REGEX "^#define CUDART_VERSION +[0-9]+" LIMIT_COUNT 1)
    if(_line MATCHES "([0-9]+)$")
      math(EXPR _major "${CMAKE_MATCH_1} / 1000")
      math(EXPR _minor "(${CMAKE_MATCH_1} % 1000) / 10")
      set(_release "${_major}.${_minor}")
    endif()
  endif()
  set(${out} "${_release}" PARENT_SCOPE)
endfunction()

# The nvcc torch's FindCUDA would take, its toolkit folder and its release ("" when none).
function(_torchdp_find_nvcc nvcc_out root_out release_out)
  set(_nvcc "")
  if(CMAKE_CUDA_COMPILER)
    set(_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(DEFINED ENV{CUDACXX})
    set(_nvcc "$ENV{CUDACXX}")
  elseif(CUDA_TOOLKIT_ROOT_DIR AND EXISTS "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
    set(_nvcc "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
  else()
    find_program(TORCHDP_NVCC nvcc
      HINTS ENV CUDA_TOOLKIT_ROOT ENV CUDA_PATH ENV CUDA_BIN_PATH ENV CUDA_HOME
      PATH_SUFFIXES bin bin64
      PATHS /opt/cuda/bin /usr/local/cuda/bin)
    mark_as_advanced(TORCHDP_NVCC)
    if(TORCHDP_NVCC)
      set(_nvcc "${TORCHDP_NVCC}")
    endif()
  endif()
  set(_root "")
  set(_release "")
  if(_nvcc)
    execute_process(COMMAND "${_nvcc}" --version OUTPUT_VARIABLE _out ERROR_QUIET
      RESULT_VARIABLE _rc TIMEOUT 60)
    if(_rc EQUAL 0 AND _out MATCHES "release ([0-9]+\\.[0-9]+)")
      set(_release "${CMAKE_MATCH_1}")
    endif()
    # nvcc may be a wrapper script (/usr/local/bin/nvcc): its dry run names the real bin folder.
    execute_process(COMMAND "${_nvcc}" --dryrun -E -x cu /dev/null
      OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 60)
    if("${_out}${_err}" MATCHES "#\\$ _HERE_=([^\r\n]+)")
      get_filename_component(_root "${CMAKE_MATCH_1}/.." ABSOLUTE)
    else()
      get_filename_component(_root "${_nvcc}" REALPATH)
      get_filename_component(_root "${_root}/../.." ABSOLUTE)
    endif()
  endif()
  set(${nvcc_out} "${_nvcc}" PARENT_SCOPE)
  set(${root_out} "${_root}" PARENT_SCOPE)
  set(${release_out} "${_release}" PARENT_SCOPE)
endfunction()

# Does torch's own CUDA config succeed with the toolkit in `root`? A separate CMake run of a project
# that only finds torch answers it, so that its errors stay out of this configure (its output is
# kept in torchdp-torch-cuda-probe.log). When it fails, `why` names what the toolkit lacks of what
# torch's config looks for. Cached per nvcc, torch and CUDA environment.
function(_torchdp_probe_torch_cuda torch_dir nvcc root ok_out why_out)
  set(_key "${torch_dir}|${nvcc}|${CMAKE_CUDA_COMPILER}|${CUDA_TOOLKIT_ROOT_DIR}|$ENV{CUDA_HOME}|$ENV{PATH}")
  if(DEFINED TORCHDP_TORCH_CUDA_PROBE_KEY AND TORCHDP_TORCH_CUDA_PROBE_KEY STREQUAL _key)
    set(${ok_out} "${TORCHDP_TORCH_CUDA_PROBE_OK}" PARENT_SCOPE)
    set(${why_out} "${TORCHDP_TORCH_CUDA_PROBE_WHY}" PARENT_SCOPE)
    return()
  endif()
  set(_dir "${CMAKE_BINARY_DIR}/torchdp-torch-cuda-probe")
  set(_log "${CMAKE_BINARY_DIR}/torchdp-torch-cuda-probe.log")
  file(REMOVE_RECURSE "${_dir}")
  file(WRITE "${_dir}/src/CMakeLists.txt"
    "cmake_minimum_required(VERSION 3.18)\n"
    "project(torchdp_torch_cuda_probe LANGUAGES CXX)\n"
    "find_package(Torch REQUIRED)\n")
  set(_args "-DTorch_DIR=${torch_dir}")
  foreach(_var CMAKE_CXX_COMPILER CMAKE_CUDA_COMPILER CUDA_TOOLKIT_ROOT_DIR CMAKE_CUDA_HOST_COMPILER)
    if(${_var})
      list(APPEND _args "-D${_var}=${${_var}}")
    endif()
  endforeach()
  if(CMAKE_GENERATOR)
    list(APPEND _args -G "${CMAKE_GENERATOR}")
  endif()
  message(STATUS "torchdp: checking that torch's CUDA config accepts the CUDA toolkit of ${nvcc}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${_dir}/src" -B "${_dir}/build" ${_args}
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out TIMEOUT 600)
  file(WRITE "${_log}" "${_out}")
  file(REMOVE_RECURSE "${_dir}")
  set(_ok OFF)
  set(_why "")
  if(_rc EQUAL 0)
    set(_ok ON)
  else()
    set(_lacks)
    foreach(_item "include/cuda_runtime_api.h" "include/cuda.h" "lib/libcudart.so"
        "lib/libnvrtc.so" "lib/stubs/libcuda.so")
      get_filename_component(_name "${_item}" NAME)
      get_filename_component(_sub "${_item}" DIRECTORY)
      string(REPLACE "lib" "lib64" _sub64 "${_sub}")
      file(GLOB _hits "${root}/${_item}" "${root}/${_sub64}/${_name}"
        "${root}/targets/*/${_item}")
      if(NOT _hits)
        list(APPEND _lacks "${_name}")
      endif()
    endforeach()
    string(REPLACE ";" ", " _lacks "${_lacks}")
    if(_lacks)
      set(_why "it lacks ${_lacks}")
    else()
      set(_why "torch's CMake config does not accept it: ${_log}")
    endif()
  endif()
  set(TORCHDP_TORCH_CUDA_PROBE_KEY "${_key}" CACHE INTERNAL "")
  set(TORCHDP_TORCH_CUDA_PROBE_OK "${_ok}" CACHE INTERNAL "")
  set(TORCHDP_TORCH_CUDA_PROBE_WHY "${_why}" CACHE INTERNAL "")
  set(${ok_out} "${_ok}" PARENT_SCOPE)
  set(${why_out} "${_why}" PARENT_SCOPE)
endfunction()

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
      get_filename_component(_torch_dir "${_dir}" ABSOLUTE)
      get_filename_component(_torch_root "${_dir}/../../.." ABSOLUTE)
      break()
    endif()
  endforeach()
  if(NOT _torch_root OR NOT EXISTS "${_torch_root}/lib/libc10_cuda.so")
    return() # not found here (find_package reports it) or a CPU build of torch
  endif()

  if(_arg_WITHOUT_CUDA)
    add_library(torch::cudart INTERFACE IMPORTED)
    set(TORCHDP_TORCH_CUDA_SOURCE "none" PARENT_SCOPE)
    return()
  endif()

  _torchdp_torch_cuda_release("${_torch_root}" _want)
  set(_want_text "${_want}")
  if(NOT _want_text)
    set(_want_text "<torch.version.cuda>")
  endif()

  # 1. A toolkit of torch's release that torch's own CUDA config accepts.
  _torchdp_find_nvcc(_nvcc _toolkit _nvcc_release)
  set(_skipped "")
  set(_toolkit_matches OFF)
  if(_nvcc)
    if(_want AND NOT _nvcc_release STREQUAL _want)
      set(_nvcc_text "${_nvcc_release}")
      if(NOT _nvcc_text)
        set(_nvcc_text "of an unknown release")
      endif()
      set(_skipped "the CUDA toolkit of ${_nvcc} (${_toolkit}) is CUDA ${_nvcc_text}, torch is "
        "built with CUDA ${_want}")
    else()
      set(_toolkit_matches ON)
      _torchdp_probe_torch_cuda("${_torch_dir}" "${_nvcc}" "${_toolkit}" _ok _why)
      if(_ok)
        set(TORCHDP_TORCH_CUDA_SOURCE "toolkit" PARENT_SCOPE)
        return()
      endif()
      set(_skipped "the CUDA ${_nvcc_release} toolkit of ${_nvcc} (${_toolkit}) is incomplete for "
        "torch's CMake config: ${_why}")
    endif()
    string(CONCAT _skipped ${_skipped})
    message(STATUS "torchdp: not using the CUDA toolkit: ${_skipped}")
  endif()

  # 2. The CUDA runtime of torch's release: pip's nvidia packages next to torch in site-packages
  # (CUDA 13: nvidia/cu13/{include,lib}; CUDA 12: nvidia/<component>/{include,lib}), then the
  # skipped toolkit's own headers and libcudart when its release is torch's.
  get_filename_component(_site "${_torch_root}/.." ABSOLUTE)
  file(GLOB _includes LIST_DIRECTORIES true "${_site}/nvidia/*/include")
  file(GLOB _libs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  if(_toolkit_matches)
    file(GLOB _toolkit_includes LIST_DIRECTORIES true "${_toolkit}/include"
      "${_toolkit}/targets/*/include")
    file(GLOB _toolkit_libs LIST_DIRECTORIES true "${_toolkit}/lib64" "${_toolkit}/lib"
      "${_toolkit}/targets/*/lib")
    list(APPEND _includes ${_toolkit_includes})
    list(APPEND _libs ${_toolkit_libs})
  endif()
  unset(TORCHDP_CUDART_INCLUDE_DIR CACHE)
  unset(TORCHDP_CUDA_CRT_INCLUDE_DIR CACHE)
  unset(TORCHDP_CUDART_LIBRARY CACHE)
  find_path(TORCHDP_CUDART_INCLUDE_DIR cuda_runtime_api.h PATHS ${_includes} NO_DEFAULT_PATH)
  find_path(TORCHDP_CUDA_CRT_INCLUDE_DIR crt/host_defines.h PATHS ${_includes} NO_DEFAULT_PATH)
  find_library(TORCHDP_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12
    PATHS ${_libs} NO_DEFAULT_PATH)
  mark_as_advanced(TORCHDP_CUDART_INCLUDE_DIR TORCHDP_CUDA_CRT_INCLUDE_DIR TORCHDP_CUDART_LIBRARY)
  # Headers of another release than torch's do not count.
  if(TORCHDP_CUDART_INCLUDE_DIR AND _want)
    _torchdp_cudart_release("${TORCHDP_CUDART_INCLUDE_DIR}" _found)
    if(NOT _found STREQUAL _want)
      set(TORCHDP_CUDART_INCLUDE_DIR "TORCHDP_CUDART_INCLUDE_DIR-NOTFOUND")
    endif()
  endif()
  if(NOT _want AND TORCHDP_CUDART_INCLUDE_DIR)
    _torchdp_cudart_release("${TORCHDP_CUDART_INCLUDE_DIR}" _want_text)
  endif()

  add_library(torch::cudart INTERFACE IMPORTED)
  if(TORCHDP_CUDART_INCLUDE_DIR AND TORCHDP_CUDA_CRT_INCLUDE_DIR AND TORCHDP_CUDART_LIBRARY)
    # cudart's folder first; the others hold cuBLAS, cuSPARSE, ... (ATen's CUDA headers use them).
    list(REMOVE_DUPLICATES _includes)
    set_target_properties(torch::cudart PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES
        "${TORCHDP_CUDART_INCLUDE_DIR};${TORCHDP_CUDA_CRT_INCLUDE_DIR};${_includes}"
      INTERFACE_LINK_LIBRARIES "${TORCHDP_CUDART_LIBRARY}")
    string(FIND "${TORCHDP_CUDART_LIBRARY}" "${_site}/nvidia/" _in_site)
    if(_in_site EQUAL 0)
      set(TORCHDP_TORCH_CUDA_SOURCE "pip" PARENT_SCOPE)
      set(_from "pip's nvidia packages")
    else()
      set(TORCHDP_TORCH_CUDA_SOURCE "toolkit-runtime" PARENT_SCOPE)
      set(_from "the CUDA toolkit in ${_toolkit}")
    endif()
    set(_why " and no CUDA toolkit (nvcc) was found")
    if(_skipped)
      set(_why "")
    endif()
    message(STATUS "torchdp: torch in ${_torch_root} is a CUDA build${_why}; using the CUDA "
      "${_want_text} runtime of ${_from} (${TORCHDP_CUDART_LIBRARY})")
    return()
  endif()

  set(_missing)
  if(NOT TORCHDP_CUDART_INCLUDE_DIR)
    list(APPEND _missing "cuda_runtime_api.h of CUDA ${_want_text}")
  endif()
  if(NOT TORCHDP_CUDA_CRT_INCLUDE_DIR)
    list(APPEND _missing "crt/host_defines.h")
  endif()
  if(NOT TORCHDP_CUDART_LIBRARY)
    list(APPEND _missing "libcudart")
  endif()
  string(REPLACE ";" ", " _missing "${_missing}")
  set(TORCHDP_TORCH_CUDA_SOURCE "none" PARENT_SCOPE)
  set(_why "no CUDA toolkit (nvcc) was found")
  if(_skipped)
    set(_why "${_skipped}")
  endif()
  string(CONCAT _hint
    "torch in ${_torch_root} is a CUDA build, but ${_why}, and pip's nvidia packages in "
    "${_site}/nvidia lack ${_missing}. For the CUDA fast paths, install the CUDA headers that "
    "match torch: `pip install \"nvidia-cuda-crt==${_want_text}.*\"` (or a complete CUDA "
    "${_want_text} toolkit, nvcc on PATH or CUDA_HOME set), then rebuild. "
    "-DTORCHDP_WITH_CUDA=OFF builds without them and says nothing")
  set(TORCHDP_TORCH_CUDA_HINT "${_hint}" PARENT_SCOPE)
endfunction()
