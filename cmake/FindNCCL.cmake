# FindNCCL: NCCL_INCLUDE_DIRS, NCCL_LIBRARIES, NCCL_FOUND.
# Search order: NCCL_ROOT / NCCL_HOME (variable or environment), the pip `nvidia.nccl` package of the
# Python interpreter that holds torch, then the CUDA toolkit folders and the system.
set(_nccl_hints)
foreach(_v NCCL_ROOT NCCL_HOME)
  if(DEFINED ${_v})
    list(APPEND _nccl_hints ${${_v}})
  endif()
  if(DEFINED ENV{${_v}})
    list(APPEND _nccl_hints $ENV{${_v}})
  endif()
endforeach()

if(NOT Python3_EXECUTABLE)
  find_program(Python3_EXECUTABLE NAMES python3 python)
endif()
if(Python3_EXECUTABLE)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import os, nvidia.nccl as m; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])"
    OUTPUT_VARIABLE _nccl_pip OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _nccl_rc)
  if(_nccl_rc EQUAL 0 AND _nccl_pip)
    list(APPEND _nccl_hints ${_nccl_pip})
  endif()
endif()
if(DEFINED CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
list(APPEND _nccl_hints /usr/local/cuda $ENV{CUDA_HOME})

find_path(NCCL_INCLUDE_DIR NAMES nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL DEFAULT_MSG NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS ${NCCL_INCLUDE_DIR})
  set(NCCL_LIBRARIES ${NCCL_LIBRARY})
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
