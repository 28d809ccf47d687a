# Toolchain of the manylinux_2_28 wheels (.ci/wheels/build_wheel.sh): zig's
# clang targeting glibc 2.28 with GCC 12's libstdc++ (zig-c++). The target is
# DSPARK_ZIG_TARGET (x86_64-linux-gnu.2.28 or aarch64-linux-gnu.2.28).
set(CMAKE_C_COMPILER ${CMAKE_CURRENT_LIST_DIR}/zig-cc)
set(CMAKE_CXX_COMPILER ${CMAKE_CURRENT_LIST_DIR}/zig-c++)
if("$ENV{DSPARK_ZIG_TARGET}" MATCHES "^aarch64")
  set(CMAKE_SYSTEM_NAME Linux)
  set(CMAKE_SYSTEM_PROCESSOR aarch64)
endif()
if(CMAKE_SYSTEM_PROCESSOR STREQUAL "aarch64")
  # The host's binutils may not read aarch64 objects: the cross ones do.
  find_program(CMAKE_AR aarch64-linux-gnu-ar REQUIRED)
  find_program(CMAKE_RANLIB aarch64-linux-gnu-ranlib REQUIRED)
endif()
