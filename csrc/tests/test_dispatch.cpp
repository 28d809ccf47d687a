// The dispatch registry (dspark/dispatch.hpp): its tables, the typed views of
// the row-format and CRC-32C families, DSPARK_SIMD parsing, and the dispatch
// table itself, printed (ctest -V, or run the program: .ci/aarch64.sh shows
// it under each emulated CPU).
#include <cstdio>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>

#include "check.hpp"
#include "dspark/crc32c.hpp"
#include "dspark/dispatch.hpp"
#include "dspark/row_format.hpp"

using namespace dspark;

namespace {

const KernelFamily kFamilies[] = {KernelFamily::RowFormat, KernelFamily::Crc32c};

struct EnvGuard {
    std::string saved;
    bool had;
    EnvGuard() : had(std::getenv(KERNEL_ENV) != nullptr) {
        if (had) saved = std::getenv(KERNEL_ENV);
    }
    ~EnvGuard() {
        if (had) setenv(KERNEL_ENV, saved.c_str(), 1);
        else unsetenv(KERNEL_ENV);
    }
};

KernelEnv status_of(const char* value) {
    setenv(KERNEL_ENV, value, 1);
    return kernel_env_status();
}

}  // namespace

TEST_CASE(the_environment_forces_the_first_paths) {
    // Runs first, before any switch. DSPARK_TEST_EXPECT_ACTIVE, when set,
    // names the path each family must have started on (in family order,
    // comma-separated): ctest's test_dispatch_forced sets it next to
    // DSPARK_SIMD, and .ci/aarch64.sh for every path it forces.
    const char* want = std::getenv("DSPARK_TEST_EXPECT_ACTIVE");
    if (want == nullptr) return;
    std::string got;
    for (KernelFamily f : kFamilies) got += std::string(got.empty() ? "" : ",") + kernel_path_name(f, active_kernel_path(f));
    std::printf("%s=%s: active %s\n", KERNEL_ENV, std::getenv(KERNEL_ENV) ? std::getenv(KERNEL_ENV) : "", got.c_str());
    CHECK(got == want);
}

TEST_CASE(prints_the_dispatch_table) {
    const CpuFeatures& c = cpu_features();
    std::printf("cpu: sse4.2=%d avx2=%d f16c=%d avx512=%d asimd=%d crc32=%d bf16=%d\n", c.sse42, c.avx2, c.f16c,
                c.avx512, c.asimd, c.crc32, c.bf16);
    for (KernelFamily f : kFamilies) {
        std::printf("%s: supported", kernel_family_name(f));
        for (int p = 0; p < kernel_path_count(f); ++p)
            if (kernel_path_supported(f, p)) std::printf(" %s", kernel_path_name(f, p));
        const int active = active_kernel_path(f);
        std::printf("; best %s; active %s\n", kernel_path_name(f, best_kernel_path(f)), kernel_path_name(f, active));
        for (int k = 0; kernel_name(f, k) != nullptr; ++k) {
            const char* origin = kernel_origin(f, k, active);
            CHECK(origin != nullptr);
            std::printf("  %-18s %s\n", kernel_name(f, k), origin ? origin : "?");
        }
    }
}

TEST_CASE(the_vendor_is_the_kernels_own) {
    // CpuFeatures::amd against Linux's own reading of cpuid's vendor string (an
    // independent oracle); never set off x86, where the probe has no vendor.
#if defined(__x86_64__) || defined(__i386__)
    std::FILE* f = std::fopen("/proc/cpuinfo", "r");
    if (f == nullptr) return;  // not Linux: nothing to compare with
    char line[256];
    std::string vendor;
    while (vendor.empty() && std::fgets(line, sizeof line, f))
        if (std::string(line).rfind("vendor_id", 0) == 0) {
            const std::string l(line);
            const auto colon = l.find(':');
            vendor = l.substr(l.find_first_not_of(" \t", colon + 1));
            vendor = vendor.substr(0, vendor.find_first_of(" \t\r\n"));
        }
    std::fclose(f);
    std::printf("vendor_id %s, amd=%d\n", vendor.c_str(), cpu_features().amd);
    if (!vendor.empty()) CHECK(cpu_features().amd == (vendor == "AuthenticAMD" || vendor == "HygonGenuine"));
#else
    CHECK(!cpu_features().amd);
#endif
}

TEST_CASE(every_family_lists_unique_named_paths_portable_first) {
    std::set<std::string> all;
    for (KernelFamily f : kFamilies) {
        CHECK(kernel_family_name(f) != nullptr);
        CHECK(kernel_path_count(f) >= 2);
        CHECK(kernel_path_supported(f, 0));
        CHECK(kernel_path_name(f, kernel_path_count(f)) == nullptr);
        CHECK(kernel_path_name(f, -1) == nullptr);
        for (int p = 0; p < kernel_path_count(f); ++p) {
            const std::string name = kernel_path_name(f, p);
            // A DSPARK_SIMD name picks one family's path: names never repeat.
            CHECK(all.insert(name).second);
            CHECK_EQ(kernel_path_from_name(f, name), p);
        }
        CHECK_EQ(kernel_path_from_name(f, "scalar"), 0);
        CHECK_EQ(kernel_path_from_name(f, "sve"), -1);
        CHECK(kernel_path_supported(f, best_kernel_path(f)));
        CHECK(kernel_path_supported(f, active_kernel_path(f)));
        for (int p = best_kernel_path(f) + 1; p < kernel_path_count(f); ++p) CHECK(!kernel_path_supported(f, p));
    }
    CHECK(kernel_family_name(static_cast<KernelFamily>(KERNEL_FAMILY_COUNT)) == nullptr);
    CHECK_EQ(kernel_path_count(static_cast<KernelFamily>(KERNEL_FAMILY_COUNT)), 0);
}

TEST_CASE(typed_views_are_the_registry) {
    CHECK(std::string(simd_path_name(SimdPath::Neon)) == "neon");
    CHECK(std::string(simd_path_name(SimdPath::NeonBf16)) == "neon-bf16");
    CHECK(std::string(crc_path_name(CrcPath::ArmCrc)) == "armv8-crc");
    for (int p = 0; p < kernel_path_count(KernelFamily::RowFormat); ++p)
        CHECK_EQ(simd_supported(static_cast<SimdPath>(p)), kernel_path_supported(KernelFamily::RowFormat, p));
    for (int p = 0; p < kernel_path_count(KernelFamily::Crc32c); ++p)
        CHECK_EQ(crc_path_supported(static_cast<CrcPath>(p)), kernel_path_supported(KernelFamily::Crc32c, p));
    CHECK_EQ(static_cast<int>(best_simd_path()), best_kernel_path(KernelFamily::RowFormat));
    CHECK_EQ(static_cast<int>(best_crc_path()), best_kernel_path(KernelFamily::Crc32c));
}

TEST_CASE(set_kernel_path_switches_and_rejects_without_change) {
    for (KernelFamily f : kFamilies) {
        const int before = active_kernel_path(f);
        for (int p = 0; p < kernel_path_count(f); ++p) {
            if (kernel_path_supported(f, p)) {
                set_kernel_path(f, p);
                CHECK_EQ(active_kernel_path(f), p);
            } else {
                const int now = active_kernel_path(f);
                CHECK_THROWS(set_kernel_path(f, p), std::invalid_argument);
                CHECK_EQ(active_kernel_path(f), now);
            }
        }
        CHECK_THROWS(set_kernel_path(f, kernel_path_count(f)), std::invalid_argument);
        CHECK_THROWS(set_kernel_path(f, -1), std::invalid_argument);
        set_kernel_path(f, before);
    }
    CHECK_THROWS(set_kernel_path(static_cast<KernelFamily>(KERNEL_FAMILY_COUNT), 0), std::invalid_argument);
}

TEST_CASE(kernel_env_parses_lists_and_reports_the_worst_name) {
    EnvGuard g;
    const bool has_neon = kernel_path_supported(KernelFamily::RowFormat, 3);
    const bool has_avx2 = kernel_path_supported(KernelFamily::RowFormat, 1);
    CHECK(status_of("") == KernelEnv::Unset);
    CHECK(status_of("scalar") == KernelEnv::Used);
    CHECK(status_of(" Scalar , portable ") == KernelEnv::Used);
    CHECK(status_of("portable") == KernelEnv::Used);
    CHECK(status_of("scalar,bogus") == KernelEnv::Unknown);
    // x86 and Arm names in one value: one of them is unsupported anywhere.
    CHECK(status_of("avx2,neon") == KernelEnv::Unsupported);
    CHECK(status_of("neon,bogus,avx2") == KernelEnv::Unknown);
    CHECK(status_of("avx2") == (has_avx2 ? KernelEnv::Used : KernelEnv::Unsupported));
    CHECK(status_of("neon,portable") == (has_neon ? KernelEnv::Used : KernelEnv::Unsupported));
    unsetenv(KERNEL_ENV);
    CHECK(kernel_env_status() == KernelEnv::Unset);
}

TEST_MAIN()
