/* Linked into every binary built for glibc 2.28 by zig-c++: the two glibc
 * symbols newer than 2.28 that GCC 12's prebuilt libstdc++.a refers to, with
 * internal visibility (nothing is exported). */
#include <sys/random.h>

/* glibc 2.32: "is the process single-threaded?"; 0 keeps every atomic. */
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

/* glibc 2.36: std::random_device's default source; getrandom is 2.25. */
__attribute__((visibility("hidden"))) unsigned int arc4random(void) {
    unsigned int r;
    while (getrandom(&r, sizeof r, 0) != (long)sizeof r) {
    }
    return r;
}
