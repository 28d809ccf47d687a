# Cross build for 64-bit Arm Linux with Debian's / Ubuntu's cross toolchain
# (apt-get install g++-aarch64-linux-gnu):
#   cmake -S . -B build/aarch64 -G Ninja \
#     -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake
# Test programs run through CMAKE_CROSSCOMPILING_EMULATOR (qemu-aarch64 from
# qemu-user, with the cross toolchain's sysroot), so ctest runs them as is.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(DSPARK_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "cross toolchain prefix")
set(CMAKE_C_COMPILER ${DSPARK_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${DSPARK_CROSS_PREFIX}g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# QEMU_CPU (e.g. "max", "cortex-a72") picks the emulated CPU at run time.
find_program(DSPARK_QEMU_AARCH64 qemu-aarch64)
if(DSPARK_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${DSPARK_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
endif()
