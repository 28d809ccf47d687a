/* glibc < 2.32 has no sys/single_threaded.h. libstdc++'s headers include it
 * when it exists (zig ships one that refuses glibc 2.28) to skip atomics in
 * single-threaded processes; "never single-threaded" keeps every atomic. */
#pragma once
static const char __libc_single_threaded = 0;
