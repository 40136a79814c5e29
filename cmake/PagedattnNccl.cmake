# Finds NCCL for the decode-context-parallel communicator (pagedattn/dcp_nccl.h, src/dcp/nccl/),
# with the CUDA backend only. PAGEDATTN_NCCL: AUTO (default) uses NCCL when found, ON requires it,
# OFF leaves it out. Looked for, in order: NCCL_ROOT (CMake or environment), the CUDA toolkit, and
# the Python environment's `nvidia-nccl-cu13` wheel (site-packages/nvidia/nccl: the one PyTorch
# ships with; `scripts/install-deps --nccl` installs it into .venv). Sets PAGEDATTN_HAS_NCCL,
# NCCL_INCLUDE_DIR and NCCL_LIBRARY.
set(PAGEDATTN_NCCL "AUTO" CACHE STRING "Build the NCCL DCP communicator: AUTO (when found), ON, OFF")
set_property(CACHE PAGEDATTN_NCCL PROPERTY STRINGS AUTO ON OFF)
set(PAGEDATTN_HAS_NCCL OFF)
if(PAGEDATTN_HAS_CUDA AND NOT PAGEDATTN_NCCL STREQUAL "OFF")
  set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  foreach(_py IN ITEMS ${PROJECT_SOURCE_DIR}/.venv/bin/python3 python3)
    find_program(_nccl_python NAMES ${_py} NO_CACHE)
    if(_nccl_python)
      execute_process(
        COMMAND ${_nccl_python} -c "import nvidia.nccl as m; print(';'.join(m.__path__))"
        OUTPUT_VARIABLE _nccl_py_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _nccl_rc)
      if(_nccl_rc EQUAL 0)
        list(APPEND _nccl_hints ${_nccl_py_dirs})
      endif()
    endif()
    unset(_nccl_python)
  endforeach()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(PAGEDATTN_HAS_NCCL ON)
  elseif(PAGEDATTN_NCCL STREQUAL "ON")
    message(FATAL_ERROR "PAGEDATTN_NCCL=ON but NCCL was not found (nccl.h: ${NCCL_INCLUDE_DIR}, "
                        "libnccl: ${NCCL_LIBRARY}); set NCCL_ROOT or run scripts/install-deps --nccl")
  endif()
endif()
message(STATUS "pagedattn: NCCL ${PAGEDATTN_HAS_NCCL} ${NCCL_LIBRARY}")
