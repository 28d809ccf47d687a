// Row formats: the storage encodings of feature rows and the conversions
// between them. Bit-exact with ggml's reference quantizers (quantize_row_*_ref)
// on every SIMD path; see docs/design.md section 3.
//
// All functions take contiguous rows (row i of `dim` elements starts at
// element i * dim) and never allocate. They are thread-safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dspark/dispatch.hpp"

namespace dspark {

// Elements per quantization block (ggml's QK8_0 == QK4_0 == 32).
inline constexpr std::size_t QK = 32;
// Bytes of one block: fp16 scale + 32 int8 / 16 packed nibbles.
inline constexpr std::size_t Q8_0_BLOCK_BYTES = 2 + QK;
inline constexpr std::size_t Q4_0_BLOCK_BYTES = 2 + QK / 2;

// How rows are kept in the feature buffer.
enum class Storage : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4 };
inline constexpr int STORAGE_COUNT = 5;

// Plain float element types rows arrive in and are staged out in.
enum class ElemType : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2 };
inline constexpr int ELEM_TYPE_COUNT = 3;

// True when a stored row's bytes are already its staged values (f32 rows
// staged as float32, f16 as float16, bf16 as bfloat16): staging is then a
// view of the stored bytes, no decode.
inline constexpr bool staged_as_stored(Storage s, ElemType t) noexcept {
    return (s == Storage::F32 && t == ElemType::F32) || (s == Storage::F16 && t == ElemType::F16) ||
           (s == Storage::BF16 && t == ElemType::BF16);
}

// What encoding does with values it cannot encode as finite values: NaN,
// +-Inf, and finite values whose encoding overflows (|x| >= the bounds'
// limit, see EncodeBounds). Overflow is non-finite too: real models have
// "massive activation" channels near 1e5, above f16's 65,504.
//  Error:    convert as-is (NaN kept quiet) and report the first unencodable
//            element; the caller decides (the stager rejects the whole call).
//  Zero:     unencodable -> 0.
//  ClampF16: NaN -> 0, everything clamped to [-65504, 65504] (llama.cpp's
//            DFlash path for fp16 drafter caches), and to the bounds.
//  Clamp:    NaN -> 0, everything clamped to [-clamp_to, clamp_to].
enum class NonFinite : std::uint8_t { Error = 0, Zero = 1, ClampF16 = 2, Clamp = 3 };
inline constexpr int NONFINITE_COUNT = 4;

// Row-format kernel paths: the path numbers of the dispatch registry's
// RowFormat family (dspark/dispatch.hpp). Every path produces identical bytes.
enum class SimdPath : std::uint8_t { Scalar = 0, Avx2 = 1, Avx512 = 2, Neon = 3, NeonBf16 = 4 };

// Which values a conversion carries as finite values. |x| < limit encodes
// to a finite value; clamp_to is the largest magnitude that does (what the
// Clamp policy clamps to; its encoding is the format's largest value, e.g.
// 65504 for f16, 127 * 65504 for q8_0). Exactly derived by search over the
// scalar conversions, so every path and the reference agree on it.
struct EncodeBounds {
    float limit;
    float clamp_to;
};
// Bounds of storage `s` alone, or of `s` decoded to `staged` (rows a Stager
// stages as f16 must also stay finite after that last narrowing).
EncodeBounds encode_bounds(Storage s, ElemType staged = ElemType::F32);

// Bytes of one row of `dim` elements in `s`. Throws ConfigError when a q
// format gets dim % 32 != 0 or dim == 0, or when the byte count overflows.
std::size_t row_bytes(Storage s, std::size_t dim);
std::size_t elem_bytes(ElemType t) noexcept;

// Names used across the Python API: "f32", "f16", "bf16", "q8_0", "q4_0".
const char* storage_name(Storage s) noexcept;
// Elements per block of a storage: QK for the block-quantised formats, 1 for
// the float ones. A row of `dim` elements (a multiple of it) takes
// dim / storage_block_elems(s) blocks of row_bytes(s, storage_block_elems(s))
// bytes. Throws TypeError for a value that is not a Storage.
std::size_t storage_block_elems(Storage s);
// Name of a non-finite policy ("error", "zero", "clamp_f16", "clamp"), or nullptr for
// a value past the last policy: the binding enumerates the policies with it,
// so the Python tables follow this enum without a copy.
const char* nonfinite_name(NonFinite p) noexcept;
// numpy's names: "float32", "float16", "bfloat16".
const char* elem_name(ElemType t) noexcept;
// Throws ConfigError naming the bad value and the allowed ones.
Storage storage_from_name(std::string_view name);

// Encode n_rows rows from `src` (element type `in`) into `dst` (row_bytes(out,
// dim) bytes per row). Under NonFinite::Error every row is still fully
// converted; the return value is the flat element index (row * dim + col) of
// the first unencodable input element (NaN, +-Inf, |x| >= bounds.limit), or
// -1 when there was none. Under the other policies the return value is
// always -1. `bounds` defaults to encode_bounds(out); tighter bounds (a
// narrower staged type) cost a second, cache-hot look at each chunk.
std::int64_t encode_rows(const void* src, ElemType in, void* dst, Storage out,
                         std::size_t n_rows, std::size_t dim, NonFinite policy);
std::int64_t encode_rows(const void* src, ElemType in, void* dst, Storage out,
                         std::size_t n_rows, std::size_t dim, NonFinite policy, EncodeBounds bounds);

// Flat index of the first non-finite element of n_elems elements, or -1.
std::int64_t find_nonfinite(const void* src, ElemType in, std::size_t n_elems);
// Flat index of the first element with !(|x| < limit) (NaN included), or -1.
std::int64_t find_unencodable(const void* src, ElemType in, std::size_t n_elems, float limit);
// Flat index of the first element of n_rows rows already in storage `s`
// (`dim` elements each) whose value, decoded to f32, is not below `limit` in
// magnitude (NaN never is), or -1. With limit = +inf that is a non-finite
// stored value: the element for f32 / f16 / bf16, the block scale for q8_0 /
// q4_0 (reported at the block's first element); a finite limit (rows staged
// as a narrower type: encode_bounds(F32, staged).limit) decodes each row.
std::int64_t find_unstageable_encoded(const void* rows, Storage s, std::size_t n_rows, std::size_t dim, float limit);
// Element `i` of `src` widened to f32 (exact): error messages quote it.
float element_value(const void* src, ElemType in, std::size_t i) noexcept;

// Decode n_rows rows stored as `in` into `dst` (element type `out`). Exact to
// f32; to f16 / bf16 it is one round-to-nearest-even step of the f32 value.
// encode_rows and decode_rows throw std::invalid_argument when `dst`
// overlaps `src` (not in place, not even partly).
void decode_rows(const void* src, Storage in, void* dst, ElemType out,
                 std::size_t n_rows, std::size_t dim);

// Runtime dispatch of the row formats: the RowFormat family of the dispatch
// registry (dspark/dispatch.hpp), typed. The active path starts as the best
// one this CPU supports unless DSPARK_SIMD names another (e.g.
// DSPARK_SIMD=scalar|avx2|avx512|neon|neon-bf16; an unsupported or unknown
// name is ignored). set_simd_path throws std::invalid_argument for an
// unsupported path. simd_env_status() says what DSPARK_SIMD holds, so that
// the caller can warn about a value that was not used (the core does not log).
using SimdEnv = KernelEnv;
SimdEnv simd_env_status() noexcept;
bool simd_supported(SimdPath p) noexcept;
SimdPath best_simd_path() noexcept;
SimdPath active_simd_path() noexcept;
void set_simd_path(SimdPath p);
const char* simd_path_name(SimdPath p) noexcept;

}  // namespace dspark
