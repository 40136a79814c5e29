# The NCCL communicator (nccl/nccl_communicator.cpp, pagedattn/dcp_nccl.h) when CMake found NCCL
# (cmake/PagedattnNccl.cmake). PAGEDATTN_HAS_NCCL is public: the header's declarations follow it.
if(PAGEDATTN_HAS_NCCL)
  target_sources(${PAGEDATTN_MODULE_TARGET} PRIVATE ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_communicator.cpp)
  target_include_directories(${PAGEDATTN_MODULE_TARGET} SYSTEM PRIVATE ${NCCL_INCLUDE_DIR})
  target_compile_definitions(${PAGEDATTN_MODULE_TARGET} PUBLIC PAGEDATTN_HAS_NCCL=1)
  cmake_language(DEFER DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} CALL target_link_libraries pagedattn PUBLIC ${NCCL_LIBRARY})
  cmake_language(DEFER DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} CALL target_compile_definitions pagedattn PUBLIC PAGEDATTN_HAS_NCCL=1)
endif()
