# Finds NCCL for the decode-context-parallel communicator (pagedattn/dcp_nccl.h, src/dcp/nccl/),
# with the CUDA backend only. PAGEDATTN_NCCL: AUTO (default) uses NCCL when found, ON requires it,
# OFF leaves it out. Header and library come from the first of these roots that has both: NCCL_ROOT
# (CMake or environment), the project's .venv and then python3's `nvidia-nccl-cu13` wheel
# (site-packages/nvidia/nccl: the one PyTorch ships with; `scripts/install-deps --nccl` installs it
# into .venv), the CUDA toolkit; else the system's. Sets PAGEDATTN_HAS_NCCL, NCCL_INCLUDE_DIR and
# NCCL_LIBRARY (cache: set them to choose).
set(PAGEDATTN_NCCL "AUTO" CACHE STRING "Build the NCCL DCP communicator: AUTO (when found), ON, OFF")
set_property(CACHE PAGEDATTN_NCCL PROPERTY STRINGS AUTO ON OFF)
set(PAGEDATTN_HAS_NCCL OFF)
if(PAGEDATTN_HAS_CUDA AND NOT PAGEDATTN_NCCL STREQUAL "OFF")
  set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT})
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
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  # The first root holding both nccl.h and libnccl gives both (a header and a library of one
  # release); without one, CMake's default search.
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    foreach(_root IN LISTS _nccl_hints)
      file(GLOB _nccl_libs ${_root}/lib/libnccl.so ${_root}/lib/libnccl.so.2 ${_root}/lib64/libnccl.so ${_root}/lib64/libnccl.so.2)
      if(EXISTS ${_root}/include/nccl.h AND _nccl_libs)
        list(GET _nccl_libs 0 _nccl_lib)
        set(NCCL_INCLUDE_DIR ${_root}/include CACHE PATH "nccl.h" FORCE)
        set(NCCL_LIBRARY ${_nccl_lib} CACHE FILEPATH "libnccl" FORCE)
        break()
      endif()
    endforeach()
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(PAGEDATTN_HAS_NCCL ON)
  elseif(PAGEDATTN_NCCL STREQUAL "ON")
    message(FATAL_ERROR "PAGEDATTN_NCCL=ON but NCCL was not found (nccl.h: ${NCCL_INCLUDE_DIR}, "
                        "libnccl: ${NCCL_LIBRARY}); set NCCL_ROOT or run scripts/install-deps --nccl")
  endif()
endif()
message(STATUS "pagedattn: NCCL ${PAGEDATTN_HAS_NCCL} ${NCCL_LIBRARY}")
