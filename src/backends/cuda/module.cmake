# CUDA backend flags: line info for compute-sanitizer / ncu reports (no effect on the code);
# PAGEDATTN_CUDA_VERBOSE=ON prints ptxas resource usage (registers, spills) per kernel.
option(PAGEDATTN_CUDA_VERBOSE "Print ptxas resource usage of the CUDA kernels" OFF)
target_compile_options(${PAGEDATTN_MODULE_TARGET} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
if(PAGEDATTN_CUDA_VERBOSE)
  target_compile_options(${PAGEDATTN_MODULE_TARGET} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()
