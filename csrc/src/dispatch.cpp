// The dispatch registry (dspark/dispatch.hpp): the one list of kernel
// families and their paths, the CPU feature probe, DSPARK_SIMD and the
// active path of each family.
#include "dspark/dispatch.hpp"

#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatch_families.hpp"

#if defined(DSPARK_X86)
#include <cpuid.h>
#elif defined(DSPARK_AARCH64)
#include <sys/auxv.h>
#endif

namespace dspark {

namespace {

// ------------------------------------------------------------------ probe ---

#if defined(DSPARK_X86)
// Straight from cpuid / xgetbv: __builtin_cpu_supports("f16c") is rejected
// by clang < 18, and the OS must have enabled the YMM / ZMM state.
CpuFeatures probe() noexcept {
    CpuFeatures f;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    char vendor[12];  // ebx, edx, ecx
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    f.amd = std::memcmp(vendor, "AuthenticAMD", 12) == 0 || std::memcmp(vendor, "HygonGenuine", 12) == 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    f.sse42 = c & (1u << 20);
    const bool osxsave = c & (1u << 27);
    const bool f16c = c & (1u << 29);
    if (!osxsave) return f;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const bool ymm = (lo & 0x6u) == 0x6u;           // XMM + YMM state
    const bool zmm = ymm && (lo & 0xE0u) == 0xE0u;  // opmask + ZMM state
    unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
    if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return f;
    f.f16c = ymm && f16c;
    f.avx2 = ymm && (b7 & (1u << 5));
    // AVX-512 F (16), DQ (17), BW (30), VL (31).
    const unsigned need512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    f.avx512 = zmm && (b7 & need512) == need512;
    return f;
}
#elif defined(DSPARK_AARCH64)
// Linux's hwcap bits (asm/hwcap.h; spelled out for older headers).
constexpr unsigned long HWCAP_ASIMD_BIT = 1ul << 1;
constexpr unsigned long HWCAP_CRC32_BIT = 1ul << 7;
constexpr unsigned long HWCAP2_BF16_BIT = 1ul << 14;

CpuFeatures probe() noexcept {
    CpuFeatures f;
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    f.asimd = hw & HWCAP_ASIMD_BIT;
    f.crc32 = hw & HWCAP_CRC32_BIT;
    f.bf16 = f.asimd && (hw2 & HWCAP2_BF16_BIT);
    return f;
}
#else
CpuFeatures probe() noexcept { return {}; }
#endif

// --------------------------------------------------------------- registry ---

struct PathSpec {
    const char* name;
    bool (*supported)(const CpuFeatures&);
};

bool always(const CpuFeatures&) { return true; }

// Row formats, in preference order within each architecture (the values of
// dspark::SimdPath). AVX-512 and AVX2 both need F16C.
constexpr PathSpec kRowFormatPaths[] = {
    {"scalar", always},
    {"avx2", [](const CpuFeatures& c) { return c.avx2 && c.f16c; }},
    {"avx512", [](const CpuFeatures& c) { return c.avx512 && c.avx2 && c.f16c; }},
    {"neon", [](const CpuFeatures& c) { return c.asimd; }},
    {"neon-bf16", [](const CpuFeatures& c) { return c.asimd && c.bf16; }},
};
// CRC-32C (the values of dspark::CrcPath).
constexpr PathSpec kCrcPaths[] = {
    {"portable", always},
    {"sse4.2", [](const CpuFeatures& c) { return c.sse42; }},
    {"armv8-crc", [](const CpuFeatures& c) { return c.crc32; }},
};

struct Family {
    const char* name;
    const PathSpec* paths;
    int n_paths;
    const char* (*kernel_name)(int k);
    const char* (*kernel_origin)(int k, int path);
};

template <std::size_t N>
constexpr Family family(const char* name, const PathSpec (&paths)[N], const char* (*kname)(int),
                        const char* (*korigin)(int, int)) {
    return {name, paths, static_cast<int>(N), kname, korigin};
}

const std::array<Family, KERNEL_FAMILY_COUNT> kFamilies = {
    family("row_format", kRowFormatPaths, detail::row_format_kernel_name, detail::row_format_kernel_origin),
    family("crc32c", kCrcPaths, detail::crc32c_kernel_name, detail::crc32c_kernel_origin),
};

const Family* find(KernelFamily f) noexcept {
    const auto i = static_cast<unsigned>(f);
    return i < kFamilies.size() ? &kFamilies[i] : nullptr;
}

std::string lower(std::string_view s) {
    std::string r(s);
    for (auto& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return r;
}

// ------------------------------------------------------------ environment ---

// The path DSPARK_SIMD (then DSPARK_CRC32C, for CRC-32C) names for family f,
// or -1; `status` gets what DSPARK_SIMD holds.
int env_path(KernelFamily f, KernelEnv& status) {
    status = KernelEnv::Unset;
    int want = -1;
    const char* env = std::getenv(KERNEL_ENV);
    if (env != nullptr && *env != '\0') {
        status = KernelEnv::Used;
        const std::string_view all(env);
        for (std::size_t pos = 0; pos <= all.size();) {
            std::size_t end = all.find(',', pos);
            if (end == std::string_view::npos) end = all.size();
            std::string_view tok = all.substr(pos, end - pos);
            pos = end + 1;
            while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.front()))) tok.remove_prefix(1);
            while (!tok.empty() && std::isspace(static_cast<unsigned char>(tok.back()))) tok.remove_suffix(1);
            if (tok.empty()) continue;
            bool known = false;
            for (int g = 0; g < KERNEL_FAMILY_COUNT; ++g) {
                const auto fam = static_cast<KernelFamily>(g);
                const int p = kernel_path_from_name(fam, tok);
                if (p < 0) continue;
                known = true;
                if (!kernel_path_supported(fam, p)) {
                    if (status == KernelEnv::Used) status = KernelEnv::Unsupported;
                } else if (fam == f) {
                    want = p;
                }
            }
            if (!known) status = KernelEnv::Unknown;
        }
    }
    if (want < 0 && f == KernelFamily::Crc32c) {
        const char* old = std::getenv(KERNEL_ENV_DEPRECATED);
        const int p = old != nullptr ? kernel_path_from_name(f, old) : -1;
        if (p >= 0 && kernel_path_supported(f, p)) want = p;
    }
    return want;
}

std::array<std::atomic<int>, KERNEL_FAMILY_COUNT> g_active = {-1, -1};

}  // namespace

const CpuFeatures& cpu_features() noexcept {
    static const CpuFeatures f = probe();
    return f;
}

const char* kernel_family_name(KernelFamily f) noexcept {
    const Family* fam = find(f);
    return fam ? fam->name : nullptr;
}

const char* kernel_path_name(KernelFamily f, int path) noexcept {
    const Family* fam = find(f);
    return fam && path >= 0 && path < fam->n_paths ? fam->paths[path].name : nullptr;
}

int kernel_path_count(KernelFamily f) noexcept {
    const Family* fam = find(f);
    return fam ? fam->n_paths : 0;
}

int kernel_path_from_name(KernelFamily f, std::string_view name) noexcept {
    const Family* fam = find(f);
    if (fam == nullptr) return -1;
    const std::string s = lower(name);
    // "scalar" is every family's portable path; "avx-512" an old spelling.
    if (s == "scalar") return 0;
    const std::string want = f == KernelFamily::RowFormat && s == "avx-512" ? "avx512" : s;
    for (int p = 0; p < fam->n_paths; ++p)
        if (want == fam->paths[p].name) return p;
    return -1;
}

bool kernel_path_supported(KernelFamily f, int path) noexcept {
    const Family* fam = find(f);
    return fam && path >= 0 && path < fam->n_paths && fam->paths[path].supported(cpu_features());
}

int best_kernel_path(KernelFamily f) noexcept {
    for (int p = kernel_path_count(f) - 1; p > 0; --p)
        if (kernel_path_supported(f, p)) return p;
    return 0;
}

int active_kernel_path(KernelFamily f) noexcept {
    const auto i = static_cast<unsigned>(f);
    if (i >= g_active.size()) return 0;
    int v = g_active[i].load(std::memory_order_acquire);
    if (v < 0) {
        KernelEnv status;
        const int want = env_path(f, status);
        int expected = -1;
        g_active[i].compare_exchange_strong(expected, want >= 0 ? want : best_kernel_path(f),
                                            std::memory_order_acq_rel);
        v = g_active[i].load(std::memory_order_acquire);
    }
    return v;
}

void set_kernel_path(KernelFamily f, int path) {
    const Family* fam = find(f);
    if (fam == nullptr)
        throw std::invalid_argument("dspark: unknown kernel family code " + std::to_string(static_cast<unsigned>(f)));
    if (path < 0 || path >= fam->n_paths)
        throw std::invalid_argument(std::string("dspark: ") + fam->name + " has no path number " +
                                    std::to_string(path));
    if (!kernel_path_supported(f, path))
        throw std::invalid_argument(std::string("dspark: ") + fam->name + " path '" + fam->paths[path].name +
                                    "' is not supported on this CPU/build");
    g_active[static_cast<unsigned>(f)].store(path, std::memory_order_release);
}

const char* kernel_name(KernelFamily f, int k) noexcept {
    const Family* fam = find(f);
    return fam ? fam->kernel_name(k) : nullptr;
}

const char* kernel_origin(KernelFamily f, int k, int path) noexcept {
    const Family* fam = find(f);
    if (fam == nullptr || kernel_name(f, k) == nullptr || !kernel_path_supported(f, path)) return nullptr;
    return fam->kernel_origin(k, path);
}

KernelEnv kernel_env_status() noexcept {
    KernelEnv status;
    (void)env_path(KernelFamily::RowFormat, status);
    return status;
}

bool kernel_env_deprecated() noexcept {
    const char* old = std::getenv(KERNEL_ENV_DEPRECATED);
    return old != nullptr && *old != '\0';
}

}  // namespace dspark
