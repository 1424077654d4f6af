# ---- install: `cmake --install <build> --prefix P` (or `make install PREFIX=P`)
#   P/bin/fp4moe                              the CLI (component cli)
#   P/lib/libfp4moe.so.X.Y.Z + SONAME link    the shared library (runtime)
#   P/share/fp4moe/configs/*.json             the shipped tuned configs (runtime)
#   P/lib/libfp4moe.a, libfp4moe.so link,     the static library, the header,
#   P/include/fp4moe.h, P/include/fp4moe/*.h  pkg-config and CMake package
#   P/lib/pkgconfig/fp4moe.pc,                files (dev)
#   P/lib/cmake/fp4moe/*.cmake
# (lib is CMAKE_INSTALL_LIBDIR: lib/<multiarch> for a /usr prefix.)
include(CMakePackageConfigHelpers)
set(FM_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/fp4moe)
set(FM_CONFIGS_INSTALL_DIR ${CMAKE_INSTALL_DATADIR}/fp4moe/configs)

install(FILES ${FM_SHIPPED_CONFIGS} DESTINATION ${FM_CONFIGS_INSTALL_DIR} COMPONENT runtime)
install(FILES ${CMAKE_SOURCE_DIR}/include/fp4moe.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
# the sections fp4moe.h includes (it is the only header a user names)
file(GLOB FM_SECTION_HEADERS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/include/fp4moe/*.h)
install(FILES ${FM_SECTION_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/fp4moe COMPONENT dev)
install(TARGETS fp4moe EXPORT fp4moeStaticTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(EXPORT fp4moeStaticTargets NAMESPACE fp4moe:: DESTINATION ${FM_CMAKE_INSTALL_DIR} COMPONENT dev)
if(FM_BUILD_SHARED)
  install(TARGETS fp4moe_shared EXPORT fp4moeSharedTargets
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
  install(EXPORT fp4moeSharedTargets NAMESPACE fp4moe:: DESTINATION ${FM_CMAKE_INSTALL_DIR} COMPONENT dev)
endif()
if(FM_BUILD_CLI)
  install(TARGETS fp4moe_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT cli)
endif()

# CMake package
set(FM_HAVE_CUPTI_BOOL OFF)
set(FM_CONFIG_CUDA_NOTE "")
if(FM_HAVE_CUDA)
  set(FM_CONFIG_CUDA_NOTE ", the CUDA toolkit's static runtime")
  if(TARGET CUDA::cupti)
    set(FM_HAVE_CUPTI_BOOL ON)
    set(FM_CONFIG_CUDA_NOTE "${FM_CONFIG_CUDA_NOTE} and CUPTI")
  endif()
endif()
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/fp4moeConfig.cmake.in
  ${CMAKE_BINARY_DIR}/cmake/fp4moeConfig.cmake
  INSTALL_DESTINATION ${FM_CMAKE_INSTALL_DIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR FM_CONFIGS_INSTALL_DIR)
# 0.y releases may break the API at every y.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(FM_COMPAT SameMinorVersion)
else()
  set(FM_COMPAT SameMajorVersion)
endif()
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cmake/fp4moeConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY ${FM_COMPAT})
install(FILES ${CMAKE_BINARY_DIR}/cmake/fp4moeConfig.cmake ${CMAKE_BINARY_DIR}/cmake/fp4moeConfigVersion.cmake
  DESTINATION ${FM_CMAKE_INSTALL_DIR} COMPONENT dev)

# pkg-config: the private libraries are what a static link needs beyond the
# Requires.private packages
set(FM_PC_LIBS_PRIVATE "-lm -pthread")
if(CMAKE_DL_LIBS)
  set(FM_PC_LIBS_PRIVATE "-lm -l${CMAKE_DL_LIBS} -pthread")
endif()
set(FM_PC_DESC_CUDA "")
if(FM_HAVE_CUDA)
  set(FM_PC_DESC_CUDA " (CPU and CUDA)")
  get_filename_component(FM_CUDART_DIR "${CUDA_cudart_static_LIBRARY}" DIRECTORY)
  string(APPEND FM_PC_LIBS_PRIVATE " -L${FM_CUDART_DIR} -lcudart_static -lrt -lstdc++")
  if(TARGET CUDA::cupti)
    get_filename_component(FM_CUPTI_DIR "${CUDA_cupti_LIBRARY}" DIRECTORY)
    if(NOT FM_CUPTI_DIR STREQUAL FM_CUDART_DIR)
      string(APPEND FM_PC_LIBS_PRIVATE " -L${FM_CUPTI_DIR}")
    endif()
    string(APPEND FM_PC_LIBS_PRIVATE " -lcupti")
  endif()
endif()
file(RELATIVE_PATH FM_PC_REL_PREFIX ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" FM_PC_REL_PREFIX "${FM_PC_REL_PREFIX}")
configure_file(${CMAKE_SOURCE_DIR}/cmake/fp4moe.pc.in ${CMAKE_BINARY_DIR}/cmake/fp4moe.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/cmake/fp4moe.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)
