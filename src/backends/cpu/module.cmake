# CPU backend: per-file ISA flags. The AVX2 / AVX-512F / AVX-512 kernel files are compiled with their
# instruction sets (the AMX file with the AVX-512 ones: its tile instructions are inline
# assembly, so no -mamx flag lets the compiler emit them elsewhere); cpu_dispatch.cpp picks one
# at run time from CPUID, so the library still runs on any x86-64 (and the scalar file builds
# anywhere). On other architectures the ISA files report no kernel table and dispatch uses the
# scalar kernels.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$" AND
   CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(_cpu_dir ${CMAKE_CURRENT_LIST_DIR})
  set_source_files_properties(${_cpu_dir}/cpu_kernels_avx2.cpp
    PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
  set_source_files_properties(${_cpu_dir}/cpu_kernels_avx512f.cpp
    PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl")
  set_source_files_properties(${_cpu_dir}/cpu_kernels_avx512.cpp ${_cpu_dir}/cpu_kernels_amx.cpp
    PROPERTIES COMPILE_OPTIONS
      "-mavx2;-mfma;-mf16c;-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mavx512bf16")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12's avx512fintrin.h reductions start from _mm512_undefined_*: a known false
    # -Wmaybe-uninitialized inside the system header once inlined.
    set_property(SOURCE ${_cpu_dir}/cpu_kernels_avx512.cpp ${_cpu_dir}/cpu_kernels_amx.cpp
      ${_cpu_dir}/cpu_kernels_avx512f.cpp APPEND PROPERTY COMPILE_OPTIONS
      "-Wno-maybe-uninitialized")
  endif()
  if(PAGEDATTN_SANITIZE)
    # Sanitized builds compile the AVX-512 kernel files at -O0: at -O1 under ASan + UBSan they are
    # the slowest objects of the test build, which an AVX2 machine (CI's so far) compiles but never
    # runs; on an AVX-512 machine their sanitized tests run slower instead. The AVX2 file stays at
    # -O1: every x86 CI machine runs its tests. Figures: docs/perf/cpu.md (test build).
    set_property(SOURCE ${_cpu_dir}/cpu_kernels_avx512.cpp ${_cpu_dir}/cpu_kernels_avx512f.cpp APPEND PROPERTY
      COMPILE_OPTIONS "-O0")
  endif()
endif()
