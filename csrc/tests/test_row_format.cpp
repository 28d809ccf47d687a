// Unit tests of the row formats: hand-checked vectors against ggml's
// reference quantizers, IEEE fp16 / bf16 edge cases, and every SIMD path the
// CPU supports giving the same bytes as the scalar definition.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"

using namespace dspark;

namespace {

float from_bits(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
std::uint16_t u16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }
std::uint32_t f32_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }

std::vector<std::uint8_t> encode(const std::vector<float>& x, Storage s, std::size_t dim,
                                 NonFinite pol = NonFinite::Error, std::int64_t* bad = nullptr) {
    const std::size_t rows = x.size() / dim;
    std::vector<std::uint8_t> out(rows * row_bytes(s, dim));
    const std::int64_t r = encode_rows(x.data(), ElemType::F32, out.data(), s, rows, dim, pol);
    if (bad) *bad = r;
    return out;
}

std::uint16_t f16(float f) {
    std::uint16_t h;
    encode_rows(&f, ElemType::F32, &h, Storage::F16, 1, 1, NonFinite::Error);
    return h;
}
std::uint16_t bf16(float f) {
    std::uint16_t h;
    encode_rows(&f, ElemType::F32, &h, Storage::BF16, 1, 1, NonFinite::Error);
    return h;
}

// Every path of the registry's row-format family that this CPU runs.
std::vector<SimdPath> paths() {
    std::vector<SimdPath> v;
    for (int p = 0; p < kernel_path_count(KernelFamily::RowFormat); ++p)
        if (simd_supported(static_cast<SimdPath>(p))) v.push_back(static_cast<SimdPath>(p));
    return v;
}

struct PathGuard {
    SimdPath saved = active_simd_path();
    ~PathGuard() { set_simd_path(saved); }
};

// Random rows exercising every awkward case: gaussians at several scales,
// heavy tails, massive channels, zero blocks, ties, tiny and huge blocks, and
// non-finite values.
std::vector<float> nasty(std::size_t n, unsigned seed, bool nonfinite) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::uniform_int_distribution<int> kind(0, 11), idx(0, 31), k127(-127, 127), k8(-8, 7);
    std::vector<float> x(n);
    for (std::size_t b = 0; b < n / 32; ++b) {
        float* v = x.data() + b * 32;
        const int kd = kind(rng);
        for (int j = 0; j < 32; ++j) {
            switch (kd) {
                case 0: v[j] = g(rng) * 1e-4f; break;
                case 1: v[j] = g(rng); break;
                case 2: v[j] = g(rng) * 1e3f; break;
                case 3: v[j] = 0.0f; break;
                case 4: v[j] = 3.0f * static_cast<float>(k127(rng)) / 127.0f; break;  // grid
                case 5: v[j] = j == 0 ? 127.0f : static_cast<float>(k127(rng) % 127) + 0.5f; break;  // q8 ties: d = 1
                case 6: v[j] = g(rng) * 1e6f; break;     // fp16 d overflow
                case 7: v[j] = g(rng) * 1e-9f; break;    // fp16 d underflow
                case 8: v[j] = g(rng) * 1e-41f; break;   // f32 subnormals: id = inf
                case 9: v[j] = static_cast<float>(k8(rng)); break;  // q4 grid with ties on |max|
                case 10: v[j] = g(rng) * 6e4f; break;    // around fp16 max
                default: v[j] = from_bits(static_cast<std::uint32_t>(rng())); break;  // any bits
            }
        }
        if (kd == 1 && (b % 3 == 0)) v[idx(rng)] = 5e3f;  // massive activation
        if (kd == 9) { v[idx(rng)] = 8.0f; v[idx(rng)] = -8.0f; }
        if (nonfinite && b % 7 == 3) {
            const int j = idx(rng);
            v[j] = (b % 2) ? std::numeric_limits<float>::infinity() : std::nanf("");
        }
        if (!nonfinite) {
            for (int j = 0; j < 32; ++j)
                if (!std::isfinite(v[j])) v[j] = 1.0f;
        }
    }
    return x;
}

}  // namespace

TEST_CASE(enumerated_names_and_block_geometry) {
    // The Python tables enumerate these; each name is distinct and the
    // enumeration ends right after the last enum value.
    CHECK(std::string(nonfinite_name(NonFinite::Error)) == "error");
    CHECK(std::string(nonfinite_name(NonFinite::ClampF16)) == "clamp_f16");
    CHECK(nonfinite_name(static_cast<NonFinite>(200)) == nullptr);
    CHECK_EQ(storage_block_elems(Storage::F32), 1u);
    CHECK_EQ(storage_block_elems(Storage::BF16), 1u);
    CHECK_EQ(storage_block_elems(Storage::Q8_0), QK);
    CHECK_EQ(row_bytes(Storage::Q8_0, storage_block_elems(Storage::Q8_0)), Q8_0_BLOCK_BYTES);
    CHECK_EQ(row_bytes(Storage::Q4_0, storage_block_elems(Storage::Q4_0)), Q4_0_BLOCK_BYTES);
    CHECK_THROWS(storage_block_elems(static_cast<Storage>(STORAGE_COUNT)), TypeError);
}

TEST_CASE(names_and_row_bytes) {
    CHECK(std::string(storage_name(Storage::Q4_0)) == "q4_0");
    CHECK(storage_from_name("bf16") == Storage::BF16);
    CHECK_THROWS(storage_from_name("q5_0"), ConfigError);
    CHECK_EQ(row_bytes(Storage::F32, 7), 28u);
    CHECK_EQ(row_bytes(Storage::F16, 7), 14u);
    CHECK_EQ(row_bytes(Storage::Q8_0, 25600), 25600u / 32 * 34);
    CHECK_EQ(row_bytes(Storage::Q4_0, 64), 36u);
    CHECK_THROWS(row_bytes(Storage::Q8_0, 48), ConfigError);
    CHECK_THROWS(row_bytes(Storage::Q4_0, 0), ConfigError);
    CHECK_THROWS(row_bytes(static_cast<Storage>(9), 32), dspark::TypeError);
    CHECK_EQ(elem_bytes(ElemType::BF16), 2u);
    CHECK(std::string(simd_path_name(SimdPath::Avx512)) == "avx512");
    CHECK(simd_supported(SimdPath::Scalar));
    CHECK(simd_supported(best_simd_path()));
    CHECK(simd_supported(active_simd_path()));
}

TEST_CASE(f16_vectors) {
    CHECK_EQ(f16(1.0f), 0x3c00);
    CHECK_EQ(f16(-2.0f), 0xc000);
    CHECK_EQ(f16(65504.0f), 0x7bff);
    CHECK_EQ(f16(65519.99f), 0x7bff);
    CHECK_EQ(f16(65520.0f), 0x7c00);  // ties to even -> inf
    CHECK_EQ(f16(1e6f), 0x7c00);
    CHECK_EQ(f16(-INFINITY), 0xfc00);
    CHECK_EQ(f16(std::nanf("")), 0x7e00);
    CHECK_EQ(f16(5.9604644775390625e-08f), 0x0001);   // 2^-24, smallest subnormal
    CHECK_EQ(f16(2.98023223876953125e-08f), 0x0000);  // 2^-25: tie -> even (0)
    CHECK_EQ(f16(4.4703483581542969e-08f), 0x0001);   // 1.5 * 2^-25... rounds to 2^-24
    CHECK_EQ(f16(8.9406967163085938e-08f), 0x0002);   // 1.5 * 2^-24: tie -> even (2)
    CHECK_EQ(f16(6.103515625e-05f), 0x0400);          // 2^-14, smallest normal
    CHECK_EQ(f16(-0.0f), 0x8000);
    CHECK_EQ(f16(1.00048828125f), 0x3c00);            // 1 + 2^-11: tie -> even
    CHECK_EQ(f16(1.00146484375f), 0x3c02);            // 1 + 3 * 2^-11: tie -> even (up)
}

TEST_CASE(bf16_vectors) {
    CHECK_EQ(bf16(1.0f), 0x3f80);
    CHECK_EQ(bf16(from_bits(0x3f808000u)), 0x3f80);  // tie -> even (down)
    CHECK_EQ(bf16(from_bits(0x3f818000u)), 0x3f82);  // tie -> even (up)
    CHECK_EQ(bf16(from_bits(0x3f808001u)), 0x3f81);
    CHECK_EQ(bf16(from_bits(0x00000001u)), 0x0000);  // subnormal kept (not flushed): rounds to 0
    CHECK_EQ(bf16(from_bits(0x00018000u)), 0x0002);  // subnormal tie -> even
    CHECK_EQ(bf16(from_bits(0x7f7fffffu)), 0x7f80);  // FLT_MAX -> inf
    CHECK_EQ(bf16(from_bits(0x7f800001u)), 0x7fc0);  // sNaN -> quiet
    CHECK_EQ(bf16(from_bits(0xffc12345u)), 0xffc1);
}

TEST_CASE(q8_0_vectors) {
    // amax = 127 -> d = 1, id = 1: q = roundf(x), halves away from zero.
    std::vector<float> x(32, 0.0f);
    x[0] = 127.0f;
    x[1] = 0.5f;    // -> 1 (nearbyint would give 0)
    x[2] = -0.5f;   // -> -1
    x[3] = 2.5f;    // -> 3 (nearbyint: 2)
    x[4] = -3.5f;   // -> -4
    x[5] = 0.49999997f;  // just below the tie -> 0
    x[6] = -126.5f;      // -> -127
    x[7] = 1.4999999f;   // -> 1
    const auto out = encode(x, Storage::Q8_0, 32);
    CHECK_EQ(out.size(), 34u);
    CHECK_EQ(u16(out.data()), 0x3c00);  // d = 1.0
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(out.data() + 2);
    CHECK_EQ(q[0], 127);
    CHECK_EQ(q[1], 1);
    CHECK_EQ(q[2], -1);
    CHECK_EQ(q[3], 3);
    CHECK_EQ(q[4], -4);
    CHECK_EQ(q[5], 0);
    CHECK_EQ(q[6], -127);
    CHECK_EQ(q[7], 1);
    CHECK_EQ(q[8], 0);
    // All-zero block: d = 0 (+0), id = 0, q = 0.
    const auto z = encode(std::vector<float>(32, 0.0f), Storage::Q8_0, 32);
    for (auto byte : z) CHECK_EQ(byte, 0);
    // d overflows fp16 (1e6 / 127 > 65504): stored inf, the q stay exact.
    std::vector<float> big(32, 0.0f);
    big[3] = 1e7f;   // d = 1e7 / 127 = 78740 > 65504
    big[4] = -5e6f;
    const auto ob = encode(big, Storage::Q8_0, 32);
    CHECK_EQ(u16(ob.data()), 0x7c00);
    const float id = 1.0f / (1e7f / 127.0f);  // id uses the fp32 d
    CHECK_EQ(static_cast<std::int8_t>(ob[2 + 3]), 127);
    CHECK_EQ(static_cast<std::int8_t>(ob[2 + 4]), static_cast<int>(std::round(-5e6f * id)));
}

TEST_CASE(q4_0_vectors) {
    std::vector<float> x(32, 0.0f);
    for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j % 8) - 4.0f;  // in [-4, 3]
    x[5] = 8.0f;
    x[20] = -8.0f;  // same magnitude, later: the FIRST (8.0) wins -> d = -1
    const auto out = encode(x, Storage::Q4_0, 32);
    CHECK_EQ(out.size(), 18u);
    CHECK_EQ(u16(out.data()), 0xbc00);  // d = 8 / -8 = -1
    // id = -1: q = min(15, trunc(-x + 8.5)); low nibble element j, high j + 16.
    for (int j = 0; j < 16; ++j) {
        const int q0 = std::min(15, static_cast<int>(-x[j] + 8.5f));
        const int q1 = std::min(15, static_cast<int>(-x[j + 16] + 8.5f));
        CHECK_EQ(out[2 + j], q0 | (q1 << 4));
    }
    CHECK_EQ(out[2 + 5] & 0x0f, 0);   // 8 -> trunc(0.5) = 0
    CHECK_EQ(out[2 + 4] >> 4, 15);    // x[20] = -8 -> 16.5 -> 16 -> min 15
    // Opposite order: -8 first -> d = +1.
    std::vector<float> y(32, 1.0f);
    y[2] = -8.0f;
    y[9] = 8.0f;
    CHECK_EQ(u16(encode(y, Storage::Q4_0, 32).data()), 0x3c00);
    // All-zero block: max = +0, d = 0 / -8 = -0.0 -> fp16 0x8000 (ggml's C
    // code; gguf-py's numpy agrees when x[0] is +0), id = 0, every q = 8.
    const auto z = encode(std::vector<float>(32, 0.0f), Storage::Q4_0, 32);
    CHECK_EQ(u16(z.data()), 0x8000);
    for (int j = 0; j < 16; ++j) CHECK_EQ(z[2 + j], 0x88);
    // Block of -0.0 too (C keeps max = +0; numpy's argmax would take -0.0).
    const auto nz = encode(std::vector<float>(32, -0.0f), Storage::Q4_0, 32);
    CHECK_EQ(u16(nz.data()), 0x8000);
}

TEST_CASE(dequantize_vectors) {
    // q8_0: d = 0.5 (0x3800), q = -128..127 -> d * q exactly.
    std::vector<std::uint8_t> blk(34);
    blk[0] = 0x00; blk[1] = 0x38;
    for (int j = 0; j < 32; ++j) blk[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(j * 8 - 128));
    std::vector<float> out(32);
    decode_rows(blk.data(), Storage::Q8_0, out.data(), ElemType::F32, 1, 32);
    for (int j = 0; j < 32; ++j) CHECK(out[j] == static_cast<float>(j * 8 - 128) * 0.5f);
    // q4_0: d = -2 (0xc000); byte j = j | (15 - j) << 4.
    std::vector<std::uint8_t> b4(18);
    b4[0] = 0x00; b4[1] = 0xc0;
    for (int j = 0; j < 16; ++j) b4[2 + j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
    decode_rows(b4.data(), Storage::Q4_0, out.data(), ElemType::F32, 1, 32);
    for (int j = 0; j < 16; ++j) {
        CHECK(out[j] == static_cast<float>(j - 8) * -2.0f);
        CHECK(out[16 + j] == static_cast<float>(7 - j) * -2.0f);
    }
    // To f16: one RNE step of the f32 value.
    std::vector<std::uint16_t> h(32);
    decode_rows(b4.data(), Storage::Q4_0, h.data(), ElemType::F16, 1, 32);
    CHECK_EQ(h[0], 0x4c00);  // (0 - 8) * -2 = 16
}

TEST_CASE(nonfinite_policies) {
    std::vector<float> x(64, 1.0f);
    x[40] = std::nanf("");
    x[50] = INFINITY;
    std::int64_t bad = 0;
    encode(x, Storage::F16, 32, NonFinite::Error, &bad);
    CHECK_EQ(bad, 40);
    encode(x, Storage::Q8_0, 32, NonFinite::Zero, &bad);
    CHECK_EQ(bad, -1);
    CHECK_EQ(find_nonfinite(x.data(), ElemType::F32, 64), 40);
    CHECK_EQ(find_nonfinite(x.data(), ElemType::F32, 40), -1);
    const auto z = encode(x, Storage::F32, 32, NonFinite::Zero);
    float v[64];
    std::memcpy(v, z.data(), sizeof v);
    CHECK(v[40] == 0.0f && v[50] == 0.0f && v[0] == 1.0f);
    x[1] = 1e6f;
    x[2] = -1e6f;
    const auto c = encode(x, Storage::F32, 32, NonFinite::ClampF16);
    std::memcpy(v, c.data(), sizeof v);
    CHECK(v[40] == 0.0f && v[50] == 65504.0f && v[1] == 65504.0f && v[2] == -65504.0f);
    // f16 input: first non-finite reported by flat index.
    std::vector<std::uint16_t> h(32, 0x3c00);
    h[17] = 0xfc00;
    std::vector<std::uint8_t> o(34);
    CHECK_EQ(encode_rows(h.data(), ElemType::F16, o.data(), Storage::Q8_0, 1, 32, NonFinite::Error), 17);
    CHECK_EQ(find_nonfinite(h.data(), ElemType::F16, 32), 17);
    // NaN-holding blocks (kept, gguf-py style): d = NaN, every q = 0.
    std::vector<float> n(32, 2.0f);
    n[7] = std::nanf("");
    const auto q8 = encode(n, Storage::Q8_0, 32);
    CHECK_EQ(u16(q8.data()), 0x7e00);
    for (int j = 0; j < 32; ++j) CHECK_EQ(q8[2 + j], 0);
    const auto q4 = encode(n, Storage::Q4_0, 32);
    CHECK_EQ(u16(q4.data()), 0x7e00);
    for (int j = 0; j < 16; ++j) CHECK_EQ(q4[2 + j], 0);
}

TEST_CASE(errors_are_thrown_not_aborts) {
    std::vector<float> x(48, 1.0f);
    std::vector<std::uint8_t> o(200);
    CHECK_THROWS(encode_rows(x.data(), ElemType::F32, o.data(), Storage::Q8_0, 1, 48, NonFinite::Error), ConfigError);
    CHECK_THROWS(decode_rows(o.data(), Storage::Q4_0, x.data(), ElemType::F32, 1, 40), ConfigError);
    CHECK_THROWS(encode_rows(nullptr, ElemType::F32, o.data(), Storage::F16, 1, 4, NonFinite::Error),
                 std::invalid_argument);
    CHECK_THROWS(encode_rows(x.data(), static_cast<ElemType>(7), o.data(), Storage::F16, 1, 4, NonFinite::Error),
                 dspark::TypeError);
    CHECK_EQ(encode_rows(x.data(), ElemType::F32, o.data(), Storage::F16, 0, 4, NonFinite::Error), -1);
}

TEST_CASE(all_f16_bit_patterns_roundtrip) {
    // Every finite or infinite f16 widens exactly and narrows back to itself;
    // quiet NaNs too. On every path.
    PathGuard g;
    for (SimdPath p : paths()) {
        set_simd_path(p);
        std::vector<std::uint16_t> h(65536), back(65536);
        for (int i = 0; i < 65536; ++i) h[i] = static_cast<std::uint16_t>(i);
        std::vector<float> f(65536);
        decode_rows(h.data(), Storage::F16, f.data(), ElemType::F32, 1, 65536);
        encode_rows(f.data(), ElemType::F32, back.data(), Storage::F16, 1, 65536, NonFinite::Error);
        int bad = 0;
        for (int i = 0; i < 65536; ++i) {
            const bool snan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) && !(i & 0x200);
            const std::uint16_t want = snan ? static_cast<std::uint16_t>(i | 0x200) : static_cast<std::uint16_t>(i);
            if (back[i] != want) ++bad;
        }
        CHECK_EQ(bad, 0);
    }
}

TEST_CASE(every_simd_path_gives_identical_bytes) {
    PathGuard g;
    const auto ps = paths();
    std::printf("  paths:");
    for (auto p : ps) std::printf(" %s", simd_path_name(p));
    std::printf("\n");
    const std::size_t dim = 32 * 37;  // odd block count: exercises the tails
    const std::size_t rows = 9;
    for (int nonfinite = 0; nonfinite < 2; ++nonfinite) {
        const auto x = nasty(rows * dim, 1234u + static_cast<unsigned>(nonfinite), nonfinite != 0);
        // Also a few raw bit patterns around every boundary for f16 / bf16.
        for (int s = 0; s < STORAGE_COUNT; ++s) {
            const auto st = static_cast<Storage>(s);
            for (int pol = 0; pol < 3; ++pol) {
                std::vector<std::uint8_t> ref;
                std::int64_t ref_bad = 0;
                for (SimdPath p : ps) {
                    set_simd_path(p);
                    std::int64_t bad = 0;
                    const auto out = encode(x, st, dim, static_cast<NonFinite>(pol), &bad);
                    if (p == SimdPath::Scalar) { ref = out; ref_bad = bad; continue; }
                    CHECK(out == ref);
                    CHECK_EQ(bad, ref_bad);
                    if (out != ref) {
                        for (std::size_t i = 0; i < out.size(); ++i)
                            if (out[i] != ref[i]) {
                                std::printf("  %s/%s pol %d: first diff at byte %zu: %d vs %d\n",
                                            simd_path_name(p), storage_name(st), pol, i, out[i], ref[i]);
                                break;
                            }
                    }
                }
                // Decode back on every path, to every element type.
                set_simd_path(SimdPath::Scalar);
                const auto enc = encode(x, st, dim, static_cast<NonFinite>(pol));
                for (int et = 0; et < 3; ++et) {
                    std::vector<std::uint8_t> dref;
                    for (SimdPath p : ps) {
                        set_simd_path(p);
                        std::vector<std::uint8_t> dec(rows * dim * elem_bytes(static_cast<ElemType>(et)));
                        decode_rows(enc.data(), st, dec.data(), static_cast<ElemType>(et), rows, dim);
                        if (p == SimdPath::Scalar) dref = dec;
                        else CHECK(dec == dref);
                    }
                }
            }
        }
        // f16 / bf16 inputs too.
        for (int et = 1; et < 3; ++et) {
            std::vector<std::uint16_t> in(rows * dim);
            std::mt19937 rng(99u + static_cast<unsigned>(et));
            for (auto& v : in) v = static_cast<std::uint16_t>(rng());
            for (int s = 0; s < STORAGE_COUNT; ++s) {
                const auto st = static_cast<Storage>(s);
                std::vector<std::uint8_t> ref;
                for (SimdPath p : ps) {
                    set_simd_path(p);
                    std::vector<std::uint8_t> out(rows * row_bytes(st, dim));
                    encode_rows(in.data(), static_cast<ElemType>(et), out.data(), st, rows, dim, NonFinite::Zero);
                    if (p == SimdPath::Scalar) ref = out;
                    else CHECK(out == ref);
                }
            }
        }
    }
}

TEST_CASE(first_nonfinite_index_is_exact_on_every_path) {
    // The NonFinite::Error check is fused into each conversion pass and the
    // index searched only in the chunk that had one: place lone +-Inf / NaN
    // values in later chunks, at tails, at the last element, and check the
    // reported index on every path, for every storage and input type.
    PathGuard g;
    const std::size_t n = 32 * 1000;  // several 4096-element chunks plus a tail
    const std::size_t spots[] = {0, 31, 4095, 4096, 8193, 12345, 31999};
    const float bads[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::nanf("")};
    for (SimdPath p : paths()) {
        set_simd_path(p);
        for (std::size_t spot : spots) {
            for (float bad : bads) {
                std::vector<float> x(n);
                for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(0.001f * static_cast<float>(i)) * 3.0f;
                x[spot] = bad;
                if (spot + 100 < n) x[spot + 100] = std::nanf("");  // a later one must not win
                for (int et = 0; et < 3; ++et) {
                    std::vector<std::uint8_t> in(n * elem_bytes(static_cast<ElemType>(et)));
                    if (et == 0) std::memcpy(in.data(), x.data(), in.size());
                    else encode_rows(x.data(), ElemType::F32, in.data(), static_cast<Storage>(et), 1, n, NonFinite::Error);
                    for (int s = 0; s < STORAGE_COUNT; ++s) {
                        std::vector<std::uint8_t> out(row_bytes(static_cast<Storage>(s), n));
                        const std::int64_t got = encode_rows(in.data(), static_cast<ElemType>(et), out.data(),
                                                             static_cast<Storage>(s), 1, n, NonFinite::Error);
                        if (got != static_cast<std::int64_t>(spot))
                            std::printf("  %s in=%d storage=%s spot=%zu: got %lld\n", simd_path_name(p), et,
                                        storage_name(static_cast<Storage>(s)), spot, static_cast<long long>(got));
                        CHECK_EQ(got, static_cast<std::int64_t>(spot));
                    }
                }
            }
        }
    }
}

TEST_CASE(large_copies_keep_every_bit_and_the_first_nonfinite_index) {
    // From 8 MiB on (STREAM_MIN_BYTES, row_format_kernels.hpp) the f32 -> f32
    // ingest copy and the same-type decode use non-temporal stores, peeled to
    // the store width: odd offsets of source and destination, a length that
    // is no multiple of anything, and non-finite values in the peel, the body
    // and the tail; every path must copy every bit and find the first one.
    PathGuard g;
    constexpr std::size_t STREAM_FLOATS = (std::size_t(8) << 20) / 4;
    const std::size_t sizes[] = {STREAM_FLOATS - 1, STREAM_FLOATS + 37};
    for (SimdPath p : paths()) {
        set_simd_path(p);
        for (std::size_t n : sizes) {
            const std::size_t spots[] = {0, 5, 13, n / 2 + 3, n - 1};
            std::vector<float> src_buf(n + 1), dst_buf(n + 3);
            float* src = src_buf.data() + 1;  // 4-byte aligned, not 32
            float* dst = dst_buf.data() + 3;
            for (std::size_t i = 0; i < n; ++i) src[i] = std::sin(0.0007f * static_cast<float>(i)) * 1.0e4f;
            src[7] = -0.0f;
            CHECK_EQ(encode_rows(src, ElemType::F32, dst, Storage::F32, 1, n, NonFinite::Error), -1);
            CHECK(std::memcmp(src, dst, n * 4) == 0);
            std::memset(dst_buf.data(), 0, dst_buf.size() * 4);
            decode_rows(src, Storage::F32, dst, ElemType::F32, 1, n);
            CHECK(std::memcmp(src, dst, n * 4) == 0);
            for (std::size_t spot : spots) {
                const float keep = src[spot];
                src[spot] = std::nanf("");
                if (spot + 1000 < n) src[spot + 1000] = std::numeric_limits<float>::infinity();
                std::memset(dst_buf.data(), 0, dst_buf.size() * 4);
                const std::int64_t got = encode_rows(src, ElemType::F32, dst, Storage::F32, 1, n, NonFinite::Error);
                if (got != static_cast<std::int64_t>(spot))
                    std::printf("  %s n=%zu spot=%zu: got %lld\n", simd_path_name(p), n, spot, static_cast<long long>(got));
                CHECK_EQ(got, static_cast<std::int64_t>(spot));
                CHECK(std::memcmp(src, dst, n * 4) == 0);  // the bad values copied too, bit for bit
                src[spot] = keep;
                if (spot + 1000 < n) src[spot + 1000] = std::sin(0.0007f * static_cast<float>(spot + 1000)) * 1.0e4f;
            }
        }
    }
}

TEST_CASE(encode_bounds_are_the_hand_derived_thresholds) {
    // f16: 65520 is the rounding midpoint above 65504 and ties to even (+inf);
    // bf16: 0x7f7f8000 rounds up to 0x7f80; q8_0: d = amax / 127 reaches 65520
    // at amax = 127 * 65520; q4_0: d = max / -8 at |max| = 8 * 65520.
    const float inf = std::numeric_limits<float>::infinity();
    const float lim[] = {inf, 65520.0f, from_bits(0x7f7f8000u), 127.0f * 65520.0f, 8.0f * 65520.0f};
    for (int s = 0; s < STORAGE_COUNT; ++s) {
        const EncodeBounds b = encode_bounds(static_cast<Storage>(s));
        CHECK(b.limit == lim[s]);
        CHECK(b.clamp_to == std::nextafter(lim[s], 0.0f));
    }
    // Staged as f16, nothing at or above 65520 may pass, whatever the storage;
    // bf16 storage rounds 65408 up to 65536 (+inf once staged as f16).
    CHECK(encode_bounds(Storage::F32, ElemType::F16).limit == 65520.0f);
    CHECK(encode_bounds(Storage::BF16, ElemType::F16).limit == 65408.0f);
    CHECK(encode_bounds(Storage::Q8_0, ElemType::F16).limit <= 65520.0f);
    CHECK(encode_bounds(Storage::F16, ElemType::BF16).limit == 65520.0f);
}

TEST_CASE(overflow_is_unencodable_on_every_path) {
    // A finite value whose encoding overflows is flagged like a NaN: at the
    // limit it is, just below it it is not, at SIMD-group, chunk and tail
    // positions, on every path.
    PathGuard g;
    const std::size_t n = 32 * 300;
    const std::size_t spots[] = {0, 31, 255, 4096, 9000, 9599};
    for (SimdPath p : paths()) {
        set_simd_path(p);
        for (int s = 1; s < STORAGE_COUNT; ++s) {
            const auto st = static_cast<Storage>(s);
            const EncodeBounds b = encode_bounds(st);
            for (std::size_t spot : spots) {
                for (float sign : {1.0f, -1.0f}) {
                    std::vector<float> x(n);
                    for (std::size_t i = 0; i < n; ++i) x[i] = std::cos(0.01f * static_cast<float>(i));
                    std::vector<std::uint8_t> out(row_bytes(st, n));
                    x[spot] = sign * b.clamp_to;
                    CHECK_EQ(encode_rows(x.data(), ElemType::F32, out.data(), st, 1, n, NonFinite::Error), -1);
                    x[spot] = sign * b.limit;
                    CHECK_EQ(encode_rows(x.data(), ElemType::F32, out.data(), st, 1, n, NonFinite::Error),
                             static_cast<std::int64_t>(spot));
                    CHECK_EQ(find_unencodable(x.data(), ElemType::F32, n, b.limit), static_cast<std::int64_t>(spot));
                    // Zero and Clamp leave nothing unencodable behind.
                    for (NonFinite pol : {NonFinite::Zero, NonFinite::Clamp, NonFinite::ClampF16}) {
                        encode_rows(x.data(), ElemType::F32, out.data(), st, 1, n, pol);
                        std::vector<float> back(n);
                        decode_rows(out.data(), st, back.data(), ElemType::F32, 1, n);
                        CHECK_EQ(find_nonfinite(back.data(), ElemType::F32, n), -1);
                        const float want = pol == NonFinite::Zero       ? 0.0f
                                           : pol == NonFinite::ClampF16 ? std::min(65504.0f, b.clamp_to)
                                                                        : b.clamp_to;
                        if (st == Storage::F16 || st == Storage::BF16) {  // element formats: exactly want, encoded
                            std::uint16_t h;
                            float w;
                            const float v = sign * want;
                            encode_rows(&v, ElemType::F32, &h, st, 1, 1, NonFinite::Error);
                            decode_rows(&h, st, &w, ElemType::F32, 1, 1);
                            CHECK(back[spot] == w);
                        }
                    }
                }
            }
        }
    }
}

TEST_CASE(f32_to_f16_random_bits_match_across_paths) {
    PathGuard g;
    std::mt19937 rng(7);
    std::vector<float> x(1 << 20);
    for (auto& v : x) v = from_bits(static_cast<std::uint32_t>(rng()));
    // Dense coverage of the subnormal / overflow boundaries.
    for (std::size_t i = 0; i < 4096; ++i) {
        x[i] = from_bits(0x33000000u + static_cast<std::uint32_t>(i) * 977u);
        x[4096 + i] = from_bits(0x477fe000u + static_cast<std::uint32_t>(i));
        x[8192 + i] = from_bits(0x38800000u - 2048u + static_cast<std::uint32_t>(i));
    }
    std::vector<std::uint16_t> ref(x.size()), out(x.size());
    set_simd_path(SimdPath::Scalar);
    encode_rows(x.data(), ElemType::F32, ref.data(), Storage::F16, 1, x.size(), NonFinite::Error);
    for (SimdPath p : paths()) {
        set_simd_path(p);
        encode_rows(x.data(), ElemType::F32, out.data(), Storage::F16, 1, x.size(), NonFinite::Error);
        CHECK(out == ref);
        encode_rows(x.data(), ElemType::F32, out.data(), Storage::BF16, 1, x.size(), NonFinite::Error);
        std::vector<std::uint16_t> rb(x.size());
        set_simd_path(SimdPath::Scalar);
        encode_rows(x.data(), ElemType::F32, rb.data(), Storage::BF16, 1, x.size(), NonFinite::Error);
        CHECK(out == rb);
    }
}

TEST_CASE(row_bytes_refuses_sizes_that_wrap_around) {
    const std::size_t max = std::numeric_limits<std::size_t>::max();
    CHECK_THROWS(row_bytes(Storage::F32, (std::size_t(1) << 62) + 1), ConfigError);  // was 4
    CHECK_THROWS(row_bytes(Storage::F16, std::size_t(1) << 63), ConfigError);
    CHECK_THROWS(row_bytes(Storage::BF16, max), ConfigError);
    CHECK_THROWS(row_bytes(Storage::Q8_0, max / 32 * 32), ConfigError);
    CHECK_EQ(row_bytes(Storage::F32, max / 4), max / 4 * 4);
    CHECK_EQ(row_bytes(Storage::F16, max / 2), max / 2 * 2);
    CHECK_EQ(row_bytes(Storage::Q8_0, max / 34 / 32 * 32), max / 34 / 32 * 34);
    CHECK_EQ(row_bytes(Storage::Q4_0, max / 32 * 32), max / 32 * 18);  // 18 bytes per 32: never wraps
}

TEST_CASE(conversions_refuse_an_output_overlapping_the_input) {
    std::vector<std::uint8_t> buf(4096, 0);
    auto* f = reinterpret_cast<float*>(buf.data());
    for (int i = 0; i < 256; ++i) f[i] = 0.5f * float(i - 100);
    const std::vector<std::uint8_t> before = buf;
    // 256 f32 (1024 bytes at 0): into itself, starting inside it, ending inside it.
    CHECK_THROWS(encode_rows(f, ElemType::F32, f, Storage::F32, 8, 32, NonFinite::Error), std::invalid_argument);
    CHECK_THROWS(encode_rows(f, ElemType::F32, buf.data() + 1020, Storage::Q8_0, 8, 32, NonFinite::Error),
                 std::invalid_argument);
    CHECK_THROWS(encode_rows(f + 64, ElemType::F32, buf.data() + 2, Storage::F16, 4, 32, NonFinite::Zero),
                 std::invalid_argument);  // output [2, 258) ends inside the input [256, 768)
    CHECK(buf == before);
    // Decoding 8 q4_0 rows (144 bytes at 2048) into f32 at 2048 - 1024 + 4: ends inside them.
    encode_rows(f, ElemType::F32, buf.data() + 2048, Storage::Q4_0, 8, 32, NonFinite::Error);
    const std::vector<std::uint8_t> enc = buf;
    CHECK_THROWS(decode_rows(buf.data() + 2048, Storage::Q4_0, buf.data() + 1028, ElemType::F32, 8, 32),
                 std::invalid_argument);
    CHECK_THROWS(decode_rows(buf.data() + 2048, Storage::Q4_0, buf.data() + 2048 + 143, ElemType::F16, 8, 32),
                 std::invalid_argument);
    CHECK(buf == enc);
    // Adjacent on both sides is fine.
    decode_rows(buf.data() + 2048, Storage::Q4_0, buf.data() + 1024, ElemType::F32, 8, 32);
    decode_rows(buf.data() + 2048, Storage::Q4_0, buf.data() + 2048 + 144, ElemType::F16, 8, 32);
    CHECK_EQ(encode_rows(f, ElemType::F32, buf.data() + 1024, Storage::F32, 8, 32, NonFinite::Error), -1);
}

TEST_CASE(bytes_do_not_depend_on_the_cpu) {
    // Where x86 and Arm differ, every path on every CPU gives x86's bytes
    // (row_format_kernels.hpp), pinned here by value so an Arm run checks it.
    PathGuard g;
    // Blocks so small that id = 1 / d overflows to +-inf: x * id is +-inf (or
    // NaN for 0), which x86 converts to INT32_MIN (low byte 0) and Arm's
    // FCVTZS would saturate (+inf -> 0xff; q4_0: min(15, 0xff) = 15).
    std::vector<float> tiny(64);
    for (int j = 0; j < 64; ++j) tiny[j] = (j % 3 == 0 ? 0.0f : 1e-40f) * (j % 2 ? -1.0f : 1.0f);
    // Decoding a block whose scale is +-inf: quant 0 gives inf * 0, x86's
    // default NaN 0xffc00000 (Arm's would be 0x7fc00000).
    std::uint8_t q8[2 * Q8_0_BLOCK_BYTES] = {}, q4[2 * Q4_0_BLOCK_BYTES] = {};
    q8[1] = 0x7c;                     // block 0: d = +inf, quants 0 / 1 / -1 below
    q8[Q8_0_BLOCK_BYTES + 1] = 0xfc;  // block 1: d = -inf
    for (std::size_t b = 0; b < 2; ++b) {
        q8[b * Q8_0_BLOCK_BYTES + 2 + 1] = 1;
        q8[b * Q8_0_BLOCK_BYTES + 2 + 2] = 0xff;
    }
    q4[1] = 0x7c;                     // d = +inf; low nibbles 8 (0), high 9 (1)
    q4[Q4_0_BLOCK_BYTES] = 0x00;
    q4[Q4_0_BLOCK_BYTES + 1] = 0x3c;  // d = 1
    for (int i = 2; i < 18; ++i) q4[i] = q4[Q4_0_BLOCK_BYTES + i] = 0x98;
    for (SimdPath p : paths()) {
        set_simd_path(p);
        const auto e8 = encode(tiny, Storage::Q8_0, 64);
        const auto e4 = encode(tiny, Storage::Q4_0, 64);
        for (int b = 0; b < 2; ++b) {
            CHECK_EQ(u16(&e8[b * Q8_0_BLOCK_BYTES]), 0);
            for (std::size_t j = 0; j < QK; ++j) CHECK_EQ(e8[b * Q8_0_BLOCK_BYTES + 2 + j], 0);
            for (std::size_t j = 0; j < QK / 2; ++j) CHECK_EQ(e4[b * Q4_0_BLOCK_BYTES + 2 + j], 0);
        }
        float y8[64], y4[64];
        decode_rows(q8, Storage::Q8_0, y8, ElemType::F32, 1, 64);
        decode_rows(q4, Storage::Q4_0, y4, ElemType::F32, 1, 64);
        for (int b = 0; b < 2; ++b) {
            const float inf = b == 0 ? INFINITY : -INFINITY;
            CHECK_EQ(f32_bits(y8[32 * b]), 0xffc00000u);
            CHECK(y8[32 * b + 1] == inf && y8[32 * b + 2] == -inf);
        }
        for (int j = 0; j < 32; ++j) {
            CHECK_EQ(f32_bits(y4[j]), j < 16 ? 0xffc00000u : 0x7f800000u);
            CHECK(y4[32 + j] == (j < 16 ? 0.0f : 1.0f));
        }
    }
}

TEST_CASE(simd_env_status_reports_what_dspark_simd_holds) {
    // The core does not log: it reports, and the Python layer warns.
    const char* saved = std::getenv("DSPARK_SIMD");
    const std::string keep = saved ? saved : "";
    unsetenv("DSPARK_SIMD");
    CHECK(simd_env_status() == SimdEnv::Unset);
    setenv("DSPARK_SIMD", "bogus", 1);
    CHECK(simd_env_status() == SimdEnv::Unknown);
    setenv("DSPARK_SIMD", "", 1);
    CHECK(simd_env_status() == SimdEnv::Unset);
    setenv("DSPARK_SIMD", "Scalar", 1);
    CHECK(simd_env_status() == SimdEnv::Used);
    setenv("DSPARK_SIMD", "avx-512", 1);
    CHECK(simd_env_status() == (simd_supported(SimdPath::Avx512) ? SimdEnv::Used : SimdEnv::Unsupported));
    setenv("DSPARK_SIMD", "avx2", 1);
    CHECK(simd_env_status() == (simd_supported(SimdPath::Avx2) ? SimdEnv::Used : SimdEnv::Unsupported));
    setenv("DSPARK_SIMD", "NEON-bf16", 1);
    CHECK(simd_env_status() == (simd_supported(SimdPath::NeonBf16) ? SimdEnv::Used : SimdEnv::Unsupported));
    if (saved) setenv("DSPARK_SIMD", keep.c_str(), 1);
    else unsetenv("DSPARK_SIMD");
}

TEST_CASE(set_simd_path_rejects_unsupported) {
    PathGuard g;
    for (int i = 0; i < kernel_path_count(KernelFamily::RowFormat); ++i) {
        const auto p = static_cast<SimdPath>(i);
        if (simd_supported(p)) {
            set_simd_path(p);
            CHECK(active_simd_path() == p);
        } else {
            CHECK_THROWS(set_simd_path(p), std::invalid_argument);
        }
    }
}

TEST_MAIN()
