# Install + export rules of the core (included by csrc/CMakeLists.txt when
# DSPARK_INSTALL is on): the public headers, the library (static, or shared
# with DSPARK_SHARED) and a CMake package config, so that
# find_package(dspark_core CONFIG) gives the target dspark_core::core. The
# destinations are DSPARK_INSTALL_{INCLUDE,LIB,CMAKE}DIR (relative to the
# install prefix): the GNU layout for `cmake --install`, the package folder for
# the wheel (set by the top-level CMakeLists).
include(CMakePackageConfigHelpers)

install(TARGETS dspark_core_lib EXPORT dspark_core_targets
        ARCHIVE DESTINATION ${DSPARK_INSTALL_LIBDIR} COMPONENT sdk
        LIBRARY DESTINATION ${DSPARK_INSTALL_LIBDIR} COMPONENT sdk
        INCLUDES DESTINATION ${DSPARK_INSTALL_INCLUDEDIR})
# Public headers only: dspark/*.hpp and dspark/dspark.h (src/ keeps the private ones).
install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/dspark DESTINATION ${DSPARK_INSTALL_INCLUDEDIR}
        COMPONENT sdk FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
install(EXPORT dspark_core_targets NAMESPACE dspark_core:: FILE dspark_coreTargets.cmake
        DESTINATION ${DSPARK_INSTALL_CMAKEDIR} COMPONENT sdk)

configure_package_config_file(${CMAKE_CURRENT_SOURCE_DIR}/dspark_coreConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/dspark_coreConfig.cmake
  INSTALL_DESTINATION ${DSPARK_INSTALL_CMAKEDIR})
# The C++ API may change between minor versions before 1.0: same minor only.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/dspark_coreConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dspark_coreConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/dspark_coreConfigVersion.cmake
        DESTINATION ${DSPARK_INSTALL_CMAKEDIR} COMPONENT sdk)
