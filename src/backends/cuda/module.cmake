# CUDA backend flags: line info for compute-sanitizer / ncu reports (no effect on the code);
# PAGEDATTN_CUDA_VERBOSE=ON prints ptxas resource usage (registers, spills) per kernel.
option(PAGEDATTN_CUDA_VERBOSE "Print ptxas resource usage of the CUDA kernels" OFF)
target_compile_options(${PAGEDATTN_MODULE_TARGET} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
if(PAGEDATTN_CUDA_VERBOSE)
  target_compile_options(${PAGEDATTN_MODULE_TARGET} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()
# mla/mla_device_ops.cu: mla::cuda_batched_gemm runs on cuBLAS. The `pagedattn` library target is
# created after the modules (src/CMakeLists.txt), so its link is deferred to the end of this
# directory.
if(PAGEDATTN_HAS_CUDA)
  target_link_libraries(${PAGEDATTN_MODULE_TARGET} PUBLIC CUDA::cublas)
  cmake_language(DEFER DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} CALL target_link_libraries pagedattn PUBLIC CUDA::cublas)
endif()
