// Row formats: scalar (portable) kernels, which are the definition every SIMD
// path must match byte for byte on every CPU, the row-format family's kernel
// tables for the dispatch registry (dispatch.cpp chooses the path), and the
// public entry points of row_format.hpp. See docs/design.md section 3.
//
// Quantizers follow ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref
// (ggml-quants.c) exactly for finite input. For blocks holding a NaN (only
// reachable under NonFinite::Error, whose output the caller discards, or the
// Python "keep" policy) they follow gguf-py's numpy code on x86: the NaN is
// the block's max, so d is that NaN and every quant is 0.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dispatch_families.hpp"
#include "dspark/dispatch.hpp"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "row_format_kernels.hpp"

namespace dspark {
namespace detail {

// ----------------------------------------------------------------- scalar ---

static inline bool is_nonfinite_bits(float v) { return (f32_bits(v) & 0x7f800000u) == 0x7f800000u; }
// NaN compares false, so one compare catches NaN, +-Inf and overflow.
static inline bool unencodable(float v, float limit) { return !(std::fabs(v) < limit); }

// f32 -> f16 / bf16 with the fused check (NaN, Inf, or overflow to Inf).
template <std::uint16_t (*Narrow)(float), const float& Limit>
static bool s_f32_narrow(const float* src, std::uint16_t* dst, std::size_t n) {
    bool bad = false;
    for (std::size_t i = 0; i < n; ++i) {
        bad |= unencodable(src[i], Limit);
        dst[i] = Narrow(src[i]);
    }
    return bad;
}
static void s_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32_scalar(src[i]);
}
static void s_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32_scalar(src[i]);
}

static inline void store_u16(std::uint8_t* p, std::uint16_t v) {
    p[0] = static_cast<std::uint8_t>(v & 0xff);
    p[1] = static_cast<std::uint8_t>(v >> 8);
}
static inline std::uint16_t load_u16(const std::uint8_t* p) {
    return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

void quantize_block_q8_0_scalar(const float* x, std::uint8_t* out) {
    float amax = 0.0f;
    bool has_nan = false;
    float nan_abs = 0.0f;
    for (std::size_t j = 0; j < QK; ++j) {
        const float a = std::fabs(x[j]);
        if (a != a) {
            if (!has_nan) { has_nan = true; nan_abs = a; }
        } else if (a > amax) {
            amax = a;
        }
    }
    if (has_nan) amax = nan_abs;
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, f32_to_f16_scalar(d));
    for (std::size_t j = 0; j < QK; ++j) {
        const float x0 = x[j] * id;
        // roundf: half away from zero; NaN/Inf -> cvtt gives INT32_MIN -> low byte 0.
        out[2 + j] = static_cast<std::uint8_t>(cvtt_i32(std::round(x0)) & 0xff);
    }
}

void quantize_block_q4_0_scalar(const float* x, std::uint8_t* out) {
    float amax = 0.0f;
    float max = 0.0f;
    for (std::size_t j = 0; j < QK; ++j) {
        const float v = x[j];
        if (v != v) { max = v; amax = -1.0f; break; }  // first NaN is "the max" (numpy argmax)
        if (amax < std::fabs(v)) {
            amax = std::fabs(v);
            max = v;
        }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, f32_to_f16_scalar(d));
    for (std::size_t j = 0; j < QK / 2; ++j) {
        const float x0 = x[j] * id + 8.5f;
        const float x1 = x[QK / 2 + j] * id + 8.5f;
        const std::uint32_t q0 = std::min<std::uint32_t>(15u, static_cast<std::uint32_t>(cvtt_i32(x0)) & 0xffu);
        const std::uint32_t q1 = std::min<std::uint32_t>(15u, static_cast<std::uint32_t>(cvtt_i32(x1)) & 0xffu);
        out[2 + j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
    }
}

static std::int64_t s_find_unencodable_f32(const float* src, std::size_t n, float limit) {
    for (std::size_t i = 0; i < n; ++i)
        if (unencodable(src[i], limit)) return static_cast<std::int64_t>(i);
    return -1;
}
static bool s_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) quantize_block_q8_0_scalar(src + b * QK, dst + b * Q8_0_BLOCK_BYTES);
    return s_find_unencodable_f32(src, nb * QK, Q8_0_LIMIT) >= 0;
}
static bool s_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) quantize_block_q4_0_scalar(src + b * QK, dst + b * Q4_0_BLOCK_BYTES);
    return s_find_unencodable_f32(src, nb * QK, Q4_0_LIMIT) >= 0;
}
void dequantize_block_q8_0_scalar(const std::uint8_t* blk, float* y) {
    const float d = f16_to_f32_scalar(load_u16(blk));
    for (std::size_t j = 0; j < QK; ++j) y[j] = mul_x86_nan(static_cast<float>(static_cast<std::int8_t>(blk[2 + j])), d);
}
void dequantize_block_q4_0_scalar(const std::uint8_t* blk, float* y) {
    const float d = f16_to_f32_scalar(load_u16(blk));
    for (std::size_t j = 0; j < QK / 2; ++j) {
        const int lo = (blk[2 + j] & 0x0f) - 8;
        const int hi = (blk[2 + j] >> 4) - 8;
        y[j] = mul_x86_nan(static_cast<float>(lo), d);
        y[QK / 2 + j] = mul_x86_nan(static_cast<float>(hi), d);
    }
}
static void s_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) dequantize_block_q8_0_scalar(src + b * Q8_0_BLOCK_BYTES, dst + b * QK);
}
static void s_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) dequantize_block_q4_0_scalar(src + b * Q4_0_BLOCK_BYTES, dst + b * QK);
}

// Copy in L2-sized pieces and check each piece while it is cache-hot.
static std::int64_t s_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    constexpr std::size_t PIECE = std::size_t(1) << 14;
    std::int64_t first_bad = -1;
    for (std::size_t off = 0; off < n; off += PIECE) {
        const std::size_t len = std::min(PIECE, n - off);
        std::memcpy(dst + off, src + off, len * 4);
        if (first_bad < 0) {
            const std::int64_t i = s_find_unencodable_f32(dst + off, len, NO_LIMIT);
            if (i >= 0) first_bad = static_cast<std::int64_t>(off) + i;
        }
    }
    return first_bad;
}

// No portable non-temporal store: a plain copy.
void scalar_copy_stream(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }

const Kernels kScalarKernels = {
    s_f32_narrow<f32_to_f16_scalar, F16_LIMIT>,
    s_f32_narrow<f32_to_bf16_scalar, BF16_LIMIT>,
    s_f16_to_f32,
    s_bf16_to_f32,
    s_quantize_q8_0,
    s_quantize_q4_0,
    s_dequantize_q8_0,
    s_dequantize_q4_0,
    s_find_unencodable_f32,
    s_copy_find_nonfinite_f32,
    scalar_copy_stream,
};

}  // namespace detail

// --------------------------------------------------------------- dispatch ---

namespace {

using detail::Kernels;

const Kernels* kernels_for(SimdPath p) noexcept {
    switch (p) {
        case SimdPath::Scalar: return &detail::kScalarKernels;
#if defined(DSPARK_X86)
        case SimdPath::Avx2: return &detail::kAvx2Kernels;
        case SimdPath::Avx512: return &detail::kAvx512Kernels;
#endif
#if defined(DSPARK_AARCH64)
        case SimdPath::Neon: return &detail::kNeonKernels;
        case SimdPath::NeonBf16: return &detail::kNeonBf16Kernels;
#endif
        default: return nullptr;
    }
}

// The registry only ever activates a path whose table this build has.
const Kernels& active_kernels() noexcept { return *kernels_for(active_simd_path()); }

}  // namespace

void detail::copy_bytes(void* dst, const void* src, std::size_t n) noexcept {
    if (n >= detail::STREAM_MIN_BYTES) active_kernels().copy_stream(dst, src, n);
    else if (n != 0) std::memcpy(dst, src, n);
}

namespace {

bool is_q(Storage s) noexcept { return s == Storage::Q8_0 || s == Storage::Q4_0; }

void check_storage(Storage s) {
    if (static_cast<unsigned>(s) >= static_cast<unsigned>(STORAGE_COUNT))
        throw TypeError("dspark: unknown storage format code " + std::to_string(static_cast<unsigned>(s)));
}
void check_elem(ElemType t) {
    if (static_cast<unsigned>(t) > 2u)
        throw TypeError("dspark: unknown element type code " + std::to_string(static_cast<unsigned>(t)));
}

std::size_t checked_elems(std::size_t n_rows, std::size_t dim) {
    if (dim != 0 && n_rows > std::numeric_limits<std::size_t>::max() / dim / 4)
        throw std::invalid_argument("dspark: n_rows * dim overflows");
    return n_rows * dim;
}

// Bytes of `n` elements (a multiple of 32 for q formats) in storage s: a
// row's size (row_bytes, after its checks) and an element's byte offset.
std::size_t storage_bytes(Storage s, std::size_t n) noexcept {
    switch (s) {
        case Storage::F32: return n * 4;
        case Storage::F16:
        case Storage::BF16: return n * 2;
        case Storage::Q8_0: return n / QK * Q8_0_BLOCK_BYTES;
        case Storage::Q4_0: return n / QK * Q4_0_BLOCK_BYTES;
    }
    return 0;
}

// The kernels read `src` and write `dst` chunk by chunk (through restrict
// pointers): a `dst` overlapping `src`, even partly, would read values it had
// already overwritten (a q4_0 decode in place got 3,737 of 4,096 values wrong).
void check_disjoint(const void* src, std::size_t src_bytes, const void* dst, std::size_t dst_bytes, const char* fn) {
    const auto a = reinterpret_cast<std::uintptr_t>(src), b = reinterpret_cast<std::uintptr_t>(dst);
    if (a < b + dst_bytes && b < a + src_bytes)
        throw std::invalid_argument(std::string("dspark: ") + fn +
                                    ": the output overlaps the input; conversions are not done in place");
}

// Elements per conversion chunk: small enough to stay in L1/L2 between the
// widen / check / policy / encode steps, a multiple of QK.
constexpr std::size_t CHUNK = 4096;

// The largest half: ClampF16's bound whatever the storage.
constexpr float F16_MAX = 65504.0f;

void apply_policy(const float* src, float* dst, std::size_t n, NonFinite policy, EncodeBounds b) noexcept {
    if (policy == NonFinite::Zero) {
        for (std::size_t i = 0; i < n; ++i) {
            const float v = src[i];
            dst[i] = std::fabs(v) < b.limit ? v : 0.0f;
        }
        return;
    }
    const float hi = policy == NonFinite::ClampF16 ? std::min(F16_MAX, b.clamp_to) : b.clamp_to;
    for (std::size_t i = 0; i < n; ++i) {
        float v = src[i];
        if (v != v) v = 0.0f;
        v = v < -hi ? -hi : v;
        v = v > hi ? hi : v;
        dst[i] = v;
    }
}

// Whether 32 copies of x, encoded in s and decoded to `staged`, stay finite
// (by the scalar kernels, the definition every path matches). Monotone in
// |x|: every step of the round trip is.
bool round_trip_finite(Storage s, ElemType staged, float x) {
    const Kernels& k = detail::kScalarKernels;
    alignas(64) float blk[QK], back[QK];
    alignas(64) std::uint8_t enc[QK * 4];
    std::fill(blk, blk + QK, x);
    switch (s) {
        case Storage::F32: std::memcpy(back, blk, sizeof blk); break;
        case Storage::F16:
            k.f32_to_f16(blk, reinterpret_cast<std::uint16_t*>(enc), QK);
            k.f16_to_f32(reinterpret_cast<const std::uint16_t*>(enc), back, QK);
            break;
        case Storage::BF16:
            k.f32_to_bf16(blk, reinterpret_cast<std::uint16_t*>(enc), QK);
            k.bf16_to_f32(reinterpret_cast<const std::uint16_t*>(enc), back, QK);
            break;
        case Storage::Q8_0:
            k.quantize_q8_0(blk, enc, 1);
            k.dequantize_q8_0(enc, back, 1);
            break;
        case Storage::Q4_0:
            k.quantize_q4_0(blk, enc, 1);
            k.dequantize_q4_0(enc, back, 1);
            break;
    }
    std::uint16_t narrow[QK];
    for (std::size_t i = 0; i < QK; ++i) {
        if (detail::is_nonfinite_bits(back[i])) return false;
        if (staged == ElemType::F16) k.f32_to_f16(back + i, narrow + i, 1);
        else if (staged == ElemType::BF16) k.f32_to_bf16(back + i, narrow + i, 1);
        else continue;
        const std::uint16_t e = staged == ElemType::F16 ? 0x7c00u : 0x7f80u;
        if ((narrow[i] & e) == e) return false;
    }
    return true;
}

EncodeBounds search_bounds(Storage s, ElemType staged) {
    std::uint32_t lo = 0, hi = 0x7f800000u;  // +0 stays finite, +inf does not
    while (hi - lo > 1) {
        const std::uint32_t mid = lo + (hi - lo) / 2;
        (round_trip_finite(s, staged, detail::bits_f32(mid)) ? lo : hi) = mid;
    }
    return {detail::bits_f32(hi), detail::bits_f32(lo)};
}

// Encodes one chunk; returns whether it held a NaN / +-Inf (checked in the
// same pass, except for f32 storage, which copies bytes).
bool encode_chunk(const Kernels& k, const float* p, std::size_t len, Storage out, std::uint8_t* dst) {
    switch (out) {
        case Storage::F32:
            std::memcpy(dst, p, len * 4);
            return k.find_unencodable_f32(p, len, detail::NO_LIMIT) >= 0;
        case Storage::F16: return k.f32_to_f16(p, reinterpret_cast<std::uint16_t*>(dst), len);
        case Storage::BF16: return k.f32_to_bf16(p, reinterpret_cast<std::uint16_t*>(dst), len);
        case Storage::Q8_0: return k.quantize_q8_0(p, dst, len / QK);
        case Storage::Q4_0: return k.quantize_q4_0(p, dst, len / QK);
    }
    return false;
}

}  // namespace

EncodeBounds encode_bounds(Storage s, ElemType staged) {
    check_storage(s);
    check_elem(staged);
    // 15 searches of 31 steps each, once per process.
    static const auto table = [] {
        std::array<std::array<EncodeBounds, 3>, STORAGE_COUNT> t{};
        for (int i = 0; i < STORAGE_COUNT; ++i)
            for (int j = 0; j < 3; ++j) t[i][j] = search_bounds(static_cast<Storage>(i), static_cast<ElemType>(j));
        return t;
    }();
    return table[static_cast<int>(s)][static_cast<int>(staged)];
}

// Row-format paths are the registry's RowFormat family (dspark/dispatch.hpp);
// SimdPath values are its path numbers.
bool simd_supported(SimdPath p) noexcept {
    return kernel_path_supported(KernelFamily::RowFormat, static_cast<int>(p));
}
SimdPath best_simd_path() noexcept {
    return static_cast<SimdPath>(best_kernel_path(KernelFamily::RowFormat));
}
SimdPath active_simd_path() noexcept {
    return static_cast<SimdPath>(active_kernel_path(KernelFamily::RowFormat));
}
void set_simd_path(SimdPath p) { set_kernel_path(KernelFamily::RowFormat, static_cast<int>(p)); }
const char* simd_path_name(SimdPath p) noexcept {
    const char* n = kernel_path_name(KernelFamily::RowFormat, static_cast<int>(p));
    return n != nullptr ? n : "?";
}
SimdEnv simd_env_status() noexcept { return kernel_env_status(); }

namespace detail {

// The kernels of a path table, by slot (the Kernels members in order), and
// which path's table first holds the same function: the path whose code runs.
namespace {
constexpr const char* kKernelNames[] = {
    "f32->f16",    "f32->bf16",   "f16->f32",    "bf16->f32",        "q8_0 encode",
    "q4_0 encode", "q8_0 decode", "q4_0 decode", "unencodable scan", "f32 copy+scan",
    "stream copy",
};
constexpr int KERNEL_SLOTS = static_cast<int>(sizeof kKernelNames / sizeof kKernelNames[0]);

bool same_slot(const Kernels& a, const Kernels& b, int k) noexcept {
    switch (k) {
        case 0: return a.f32_to_f16 == b.f32_to_f16;
        case 1: return a.f32_to_bf16 == b.f32_to_bf16;
        case 2: return a.f16_to_f32 == b.f16_to_f32;
        case 3: return a.bf16_to_f32 == b.bf16_to_f32;
        case 4: return a.quantize_q8_0 == b.quantize_q8_0;
        case 5: return a.quantize_q4_0 == b.quantize_q4_0;
        case 6: return a.dequantize_q8_0 == b.dequantize_q8_0;
        case 7: return a.dequantize_q4_0 == b.dequantize_q4_0;
        case 8: return a.find_unencodable_f32 == b.find_unencodable_f32;
        case 9: return a.copy_find_nonfinite_f32 == b.copy_find_nonfinite_f32;
        case 10: return a.copy_stream == b.copy_stream;
    }
    return false;
}
}  // namespace

const char* row_format_kernel_name(int k) noexcept { return k >= 0 && k < KERNEL_SLOTS ? kKernelNames[k] : nullptr; }

const char* row_format_kernel_origin(int k, int path) noexcept {
    const Kernels* mine = kernels_for(static_cast<SimdPath>(path));
    if (mine == nullptr || row_format_kernel_name(k) == nullptr) return nullptr;
    for (int p = 0; p <= path; ++p) {
        const Kernels* t = kernels_for(static_cast<SimdPath>(p));
        if (t != nullptr && same_slot(*t, *mine, k)) return simd_path_name(static_cast<SimdPath>(p));
    }
    return nullptr;
}

}  // namespace detail

// ------------------------------------------------------------ public API ---

std::size_t elem_bytes(ElemType t) noexcept {
    switch (t) {
        case ElemType::F32: return 4;
        case ElemType::F16:
        case ElemType::BF16: return 2;
    }
    return 0;
}

const char* storage_name(Storage s) noexcept {
    switch (s) {
        case Storage::F32: return "f32";
        case Storage::F16: return "f16";
        case Storage::BF16: return "bf16";
        case Storage::Q8_0: return "q8_0";
        case Storage::Q4_0: return "q4_0";
    }
    return "?";
}

std::size_t storage_block_elems(Storage s) {
    check_storage(s);
    return is_q(s) ? QK : 1;
}

const char* nonfinite_name(NonFinite p) noexcept {
    switch (p) {
        case NonFinite::Error: return "error";
        case NonFinite::Zero: return "zero";
        case NonFinite::ClampF16: return "clamp_f16";
        case NonFinite::Clamp: return "clamp";
    }
    return nullptr;
}

const char* elem_name(ElemType t) noexcept {
    switch (t) {
        case ElemType::F32: return "float32";
        case ElemType::F16: return "float16";
        case ElemType::BF16: return "bfloat16";
    }
    return "?";
}

Storage storage_from_name(std::string_view name) {
    for (int i = 0; i < STORAGE_COUNT; ++i) {
        const auto s = static_cast<Storage>(i);
        if (name == storage_name(s)) return s;
    }
    throw ConfigError("dspark: unknown storage '" + std::string(name) +
                      "' (expected one of f32, f16, bf16, q8_0, q4_0)");
}

std::size_t row_bytes(Storage s, std::size_t dim) {
    check_storage(s);
    if (is_q(s) && (dim == 0 || dim % QK != 0))
        throw ConfigError(std::string("dspark: storage ") + storage_name(s) +
                          " needs feature_dim % 32 == 0, got feature_dim " +
                          std::to_string(dim) + " (a positive multiple of 32: whole blocks)");
    // storage_bytes multiplies: a dim whose byte count wraps around is refused.
    const std::size_t units = is_q(s) ? dim / QK : dim;
    const std::size_t unit_bytes = storage_bytes(s, is_q(s) ? QK : 1);
    if (units > std::numeric_limits<std::size_t>::max() / unit_bytes)
        throw ConfigError(std::string("dspark: a row of ") + std::to_string(dim) + " elements in " + storage_name(s) +
                          " is too large: its byte count overflows size_t");
    return storage_bytes(s, dim);
}

namespace {
// An fp16 value (a stored f16 element or a q block's scale) is Inf or NaN:
// its exponent bits are all ones.
inline bool f16_bits_nonfinite(std::uint16_t h) noexcept { return (h & 0x7c00u) == 0x7c00u; }
}  // namespace

std::int64_t find_nonfinite(const void* src, ElemType in, std::size_t n_elems) {
    check_elem(in);
    if (n_elems == 0) return -1;
    if (src == nullptr) throw std::invalid_argument("dspark: find_nonfinite: null source");
    switch (in) {
        case ElemType::F32:
            return active_kernels().find_unencodable_f32(static_cast<const float*>(src), n_elems, detail::NO_LIMIT);
        case ElemType::F16: {
            const auto* h = static_cast<const std::uint16_t*>(src);
            for (std::size_t i = 0; i < n_elems; ++i)
                if (f16_bits_nonfinite(h[i])) return static_cast<std::int64_t>(i);
            return -1;
        }
        case ElemType::BF16: {
            const auto* b = static_cast<const std::uint16_t*>(src);
            for (std::size_t i = 0; i < n_elems; ++i)
                if ((b[i] & 0x7f80u) == 0x7f80u) return static_cast<std::int64_t>(i);
            return -1;
        }
    }
    return -1;
}

std::int64_t find_unstageable_encoded(const void* rows, Storage s, std::size_t n_rows, std::size_t dim, float limit) {
    const std::size_t rb = row_bytes(s, dim);  // checks s (and whole q blocks)
    if (n_rows == 0) return -1;
    if (rows == nullptr) throw std::invalid_argument("dspark: find_unstageable_encoded: null source");
    const auto* data = static_cast<const std::uint8_t*>(rows);
    if (limit < detail::NO_LIMIT) {
        // A narrower staged type: decode each row and check its values.
        std::vector<float> row(dim);
        for (std::size_t r = 0; r < n_rows; ++r) {
            decode_rows(data + r * rb, s, row.data(), ElemType::F32, 1, dim);
            const std::int64_t i = find_unencodable(row.data(), ElemType::F32, dim, limit);
            if (i >= 0) return static_cast<std::int64_t>(r * dim) + i;
        }
        return -1;
    }
    switch (s) {
        case Storage::F32: return find_nonfinite(data, ElemType::F32, n_rows * dim);
        case Storage::F16: return find_nonfinite(data, ElemType::F16, n_rows * dim);
        case Storage::BF16: return find_nonfinite(data, ElemType::BF16, n_rows * dim);
        case Storage::Q8_0:
        case Storage::Q4_0: {
            // A q block decodes to scale * quant: non-finite exactly when its fp16 scale is.
            const std::size_t block = storage_bytes(s, QK);
            for (std::size_t r = 0; r < n_rows; ++r)
                for (std::size_t off = 0; off < rb; off += block) {
                    std::uint16_t d;
                    std::memcpy(&d, data + r * rb + off, 2);
                    if (f16_bits_nonfinite(d)) return static_cast<std::int64_t>(r * dim + off / block * QK);
                }
            return -1;
        }
    }
    return -1;
}

float element_value(const void* src, ElemType in, std::size_t i) noexcept {
    switch (in) {
        case ElemType::F16: return detail::f16_to_f32_scalar(static_cast<const std::uint16_t*>(src)[i]);
        case ElemType::BF16: return detail::bf16_to_f32_scalar(static_cast<const std::uint16_t*>(src)[i]);
        default: return static_cast<const float*>(src)[i];
    }
}

std::int64_t find_unencodable(const void* src, ElemType in, std::size_t n_elems, float limit) {
    check_elem(in);
    if (n_elems == 0) return -1;
    if (src == nullptr) throw std::invalid_argument("dspark: find_unencodable: null source");
    if (in == ElemType::F32)
        return active_kernels().find_unencodable_f32(static_cast<const float*>(src), n_elems, limit);
    // Half-width input: widen a chunk at a time (exact) and search that.
    const Kernels& k = active_kernels();
    alignas(64) float tmp[CHUNK];
    const auto* h = static_cast<const std::uint16_t*>(src);
    for (std::size_t off = 0; off < n_elems; off += CHUNK) {
        const std::size_t len = std::min(CHUNK, n_elems - off);
        (in == ElemType::F16 ? k.f16_to_f32 : k.bf16_to_f32)(h + off, tmp, len);
        const std::int64_t i = k.find_unencodable_f32(tmp, len, limit);
        if (i >= 0) return static_cast<std::int64_t>(off) + i;
    }
    return -1;
}

std::int64_t encode_rows(const void* src, ElemType in, void* dst, Storage out, std::size_t n_rows,
                         std::size_t dim, NonFinite policy) {
    check_storage(out);
    return encode_rows(src, in, dst, out, n_rows, dim, policy, encode_bounds(out));
}

std::int64_t encode_rows(const void* src, ElemType in, void* dst, Storage out, std::size_t n_rows,
                         std::size_t dim, NonFinite policy, EncodeBounds bounds) {
    check_elem(in);
    check_storage(out);
    if (static_cast<unsigned>(policy) >= static_cast<unsigned>(NONFINITE_COUNT))
        throw std::invalid_argument("dspark: unknown non-finite policy code");
    (void)row_bytes(out, dim);  // validates dim for q formats
    const std::size_t n = checked_elems(n_rows, dim);
    if (n == 0) return -1;
    if (src == nullptr || dst == nullptr) throw std::invalid_argument("dspark: encode_rows: null pointer");
    check_disjoint(src, n * elem_bytes(in), dst, storage_bytes(out, n), "encode_rows");

    const Kernels& k = active_kernels();
    auto* out_bytes = static_cast<std::uint8_t*>(dst);
    std::int64_t first_bad = -1;
    // The kernels' fused check knows only the storage's own limit; tighter
    // bounds (a narrower staged type) are checked per chunk as well.
    const bool tighter = bounds.limit < encode_bounds(out).limit;

    // Fast paths without a temporary: same type in and out under Error.
    if (policy == NonFinite::Error && !tighter && in == ElemType::F32 && out == Storage::F32)
        return k.copy_find_nonfinite_f32(static_cast<const float*>(src), static_cast<float*>(dst), n);
    if (policy == NonFinite::Error && !tighter &&
        ((in == ElemType::F16 && out == Storage::F16) || (in == ElemType::BF16 && out == Storage::BF16))) {
        // Copy in L2-sized pieces and check each piece while it is cache-hot
        // (one pass over memory, not two).
        constexpr std::size_t PIECE = 1u << 16;  // elements
        const std::size_t eb = elem_bytes(in);
        for (std::size_t off = 0; off < n; off += PIECE) {
            const std::size_t len = std::min(PIECE, n - off);
            const auto* s = static_cast<const std::uint8_t*>(src) + off * eb;
            std::memcpy(out_bytes + off * eb, s, len * eb);
            if (first_bad < 0) {
                const std::int64_t i = find_nonfinite(out_bytes + off * eb, in, len);
                if (i >= 0) first_bad = static_cast<std::int64_t>(off) + i;
            }
        }
        return first_bad;
    }

    alignas(64) float tmp[CHUNK];
    for (std::size_t off = 0; off < n; off += CHUNK) {
        const std::size_t len = std::min(CHUNK, n - off);
        const float* p;
        switch (in) {
            case ElemType::F32: p = static_cast<const float*>(src) + off; break;
            case ElemType::F16:
                k.f16_to_f32(static_cast<const std::uint16_t*>(src) + off, tmp, len);
                p = tmp;
                break;
            default:
                k.bf16_to_f32(static_cast<const std::uint16_t*>(src) + off, tmp, len);
                p = tmp;
                break;
        }
        if (policy == NonFinite::Error) {
            // The check rides on the conversion pass; the index is looked
            // for only in a chunk that had an unencodable value.
            const bool any = encode_chunk(k, p, len, out, out_bytes + storage_bytes(out, off));
            if ((any || tighter) && first_bad < 0) {
                const std::int64_t i = k.find_unencodable_f32(p, len, bounds.limit);
                if (i >= 0) first_bad = static_cast<std::int64_t>(off) + i;
            }
            continue;
        }
        apply_policy(p, tmp, len, policy, bounds);
        encode_chunk(k, tmp, len, out, out_bytes + storage_bytes(out, off));
    }
    return first_bad;
}

void decode_rows(const void* src, Storage in, void* dst, ElemType out, std::size_t n_rows, std::size_t dim) {
    check_storage(in);
    check_elem(out);
    (void)row_bytes(in, dim);
    const std::size_t n = checked_elems(n_rows, dim);
    if (n == 0) return;
    if (src == nullptr || dst == nullptr) throw std::invalid_argument("dspark: decode_rows: null pointer");
    check_disjoint(src, storage_bytes(in, n), dst, n * elem_bytes(out), "decode_rows");

    if ((in == Storage::F32 && out == ElemType::F32) || (in == Storage::F16 && out == ElemType::F16) ||
        (in == Storage::BF16 && out == ElemType::BF16)) {
        detail::copy_bytes(dst, src, n * elem_bytes(out));
        return;
    }
    const Kernels& k = active_kernels();
    const auto* in_bytes = static_cast<const std::uint8_t*>(src);
    alignas(64) float tmp[CHUNK];
    for (std::size_t off = 0; off < n; off += CHUNK) {
        const std::size_t len = std::min(CHUNK, n - off);
        const std::uint8_t* s = in_bytes + storage_bytes(in, off);
        float* f = out == ElemType::F32 ? static_cast<float*>(dst) + off : tmp;
        const float* p = f;
        switch (in) {
            case Storage::F32: p = reinterpret_cast<const float*>(s); break;
            case Storage::F16: k.f16_to_f32(reinterpret_cast<const std::uint16_t*>(s), f, len); break;
            case Storage::BF16: k.bf16_to_f32(reinterpret_cast<const std::uint16_t*>(s), f, len); break;
            case Storage::Q8_0: k.dequantize_q8_0(s, f, len / QK); break;
            case Storage::Q4_0: k.dequantize_q4_0(s, f, len / QK); break;
        }
        switch (out) {
            case ElemType::F32:
                if (p != f) std::memcpy(f, p, len * 4);
                break;
            case ElemType::F16: k.f32_to_f16(p, static_cast<std::uint16_t*>(dst) + off, len); break;
            case ElemType::BF16: k.f32_to_bf16(p, static_cast<std::uint16_t*>(dst) + off, len); break;
        }
    }
}

}  // namespace dspark
