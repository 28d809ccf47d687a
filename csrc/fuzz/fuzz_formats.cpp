// libFuzzer target over the row formats and the snapshot parser.
//
// The first byte picks a mode:
//  0 decode_rows of arbitrary bytes, every storage, every output type: every
//    SIMD path gives the scalar path's bytes (NaN payloads included), and the
//    f16 / bf16 outputs are one RNE step of the f32 output;
//  1 encode_rows of arbitrary float bytes (f32 / f16 / bf16 input, every
//    storage and non-finite policy): every SIMD path gives the scalar bytes
//    and the same first-non-finite index; find_nonfinite agrees;
//  2 Stager::restore of arbitrary bytes (raw, or behind a valid header with
//    a correct checksum so the field checks are reached): it succeeds or
//    throws std::invalid_argument; a rejected restore leaves the slot's
//    snapshot unchanged; a restored slot keeps the invariants through a few
//    rounds and snapshots again.
// Any other exception, crash or sanitizer report is a finding.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"
#include "fuzz_common.hpp"

using namespace dspark;
using dspark_fuzz::Reader;

namespace {

std::vector<SimdPath> paths() {
    std::vector<SimdPath> v;
    for (int p = 0; p < kernel_path_count(KernelFamily::RowFormat); ++p)
        if (simd_supported(static_cast<SimdPath>(p))) v.push_back(static_cast<SimdPath>(p));
    return v;
}

std::size_t dim_for(Storage s, std::uint8_t b) {
    if (s == Storage::Q8_0 || s == Storage::Q4_0) return QK * (1 + b % 3);
    return 1 + b % 80;
}

void fuzz_decode(Reader& r) {
    const Storage s = static_cast<Storage>(r.u8() % STORAGE_COUNT);
    const std::size_t dim = dim_for(s, r.u8());
    const std::size_t rb = row_bytes(s, dim);
    std::vector<std::uint8_t> src = r.rest();
    const std::size_t n = src.size() / rb;
    if (n == 0) return;
    src.resize(n * rb);
    std::vector<std::uint8_t> f32_ref;
    for (int t = 0; t < 3; ++t) {
        const ElemType out = static_cast<ElemType>(t);
        const std::size_t ob = n * dim * elem_bytes(out);
        std::vector<std::uint8_t> ref;
        for (SimdPath p : paths()) {
            set_simd_path(p);
            std::vector<std::uint8_t> dst(ob + 64, 0xA5);  // canary after the output
            decode_rows(src.data(), s, dst.data(), out, n, dim);
            for (std::size_t i = ob; i < dst.size(); ++i) FUZZ_CHECK(dst[i] == 0xA5);
            dst.resize(ob);
            if (p == SimdPath::Scalar) ref = dst;
            else FUZZ_CHECK(dst == ref);  // identical bytes on every path, NaN payloads included
        }
        set_simd_path(SimdPath::Scalar);
        if (out == ElemType::F32) {
            f32_ref = ref;
        } else {
            // f16 / bf16 output is one round-to-nearest-even step of the f32 value.
            std::vector<std::uint8_t> via(ob);
            encode_rows(f32_ref.data(), ElemType::F32, via.data(), out == ElemType::F16 ? Storage::F16 : Storage::BF16, n,
                        dim, NonFinite::Error);
            // NaN payloads are not specified here (an f16 -> f16 decode may keep a
            // signalling NaN that the f32 step quiets): a NaN must stay a NaN.
            const std::size_t m = n * dim;
            for (std::size_t i = 0; i < m; ++i) {
                std::uint32_t f;
                std::uint16_t a, b;
                std::memcpy(&f, f32_ref.data() + 4 * i, 4);
                std::memcpy(&a, ref.data() + 2 * i, 2);
                std::memcpy(&b, via.data() + 2 * i, 2);
                const bool f_nan = (f & 0x7F800000u) == 0x7F800000u && (f & 0x7FFFFFu);
                const bool a_nan = out == ElemType::F16 ? ((a & 0x7C00u) == 0x7C00u && (a & 0x3FFu))
                                                         : ((a & 0x7F80u) == 0x7F80u && (a & 0x7Fu));
                if (f_nan) FUZZ_CHECK(a_nan);
                else FUZZ_CHECK(a == b);
            }
        }
    }
}

void fuzz_encode(Reader& r) {
    const ElemType in = static_cast<ElemType>(r.u8() % 3);
    const Storage s = static_cast<Storage>(r.u8() % STORAGE_COUNT);
    const NonFinite pol = static_cast<NonFinite>(r.u8() % NONFINITE_COUNT);
    const std::size_t dim = dim_for(s, r.u8());
    std::vector<std::uint8_t> src = r.rest();
    const std::size_t ib = dim * elem_bytes(in);
    const std::size_t n = src.size() / ib;
    if (n == 0) return;
    src.resize(n * ib);
    const std::size_t ob = n * row_bytes(s, dim);
    std::vector<std::uint8_t> ref;
    std::int64_t ref_bad = 0, ref_find = 0;
    for (SimdPath p : paths()) {
        set_simd_path(p);
        std::vector<std::uint8_t> dst(ob + 64, 0x5A);
        const std::int64_t bad = encode_rows(src.data(), in, dst.data(), s, n, dim, pol);
        // Overflow is non-finite too: the first value the storage cannot carry.
        const std::int64_t found = find_unencodable(src.data(), in, n * dim, encode_bounds(s).limit);
        for (std::size_t i = ob; i < dst.size(); ++i) FUZZ_CHECK(dst[i] == 0x5A);
        dst.resize(ob);
        FUZZ_CHECK(bad >= -1 && bad < static_cast<std::int64_t>(n * dim));
        FUZZ_CHECK(pol != NonFinite::Error || bad == found);
        FUZZ_CHECK(pol == NonFinite::Error || bad == -1);
        if (p == SimdPath::Scalar) {
            ref = dst, ref_bad = bad, ref_find = found;
        } else {
            FUZZ_CHECK(dst == ref);
            FUZZ_CHECK(bad == ref_bad && found == ref_find);
        }
    }
    set_simd_path(SimdPath::Scalar);
}

void put_le(std::vector<std::uint8_t>& v, std::size_t at, std::uint64_t x, int width) {
    for (int k = 0; k < width; ++k) v[at + k] = static_cast<std::uint8_t>(x >> (8 * k));
}

void fuzz_restore(Reader& r) {
    StagerOptions o;
    const std::uint8_t b0 = r.u8(), b1 = r.u8(), mode = r.u8();
    o.storage = static_cast<Storage>(b0 % STORAGE_COUNT);
    o.feature_dim = (b0 >> 3) & 1 ? 64 : 32;
    o.block_size = 1 + b1 % 8;
    o.window = 2 * o.block_size + 1 + (b1 >> 3);
    o.max_seqs = 2;
    Stager st(o);
    // Seq 1 gets some real state first, so restores replace something.
    {
        const std::size_t n = o.window + 3;
        std::vector<float> x(n * o.feature_dim, 0.5f);
        std::vector<std::int64_t> pos(n);
        for (std::size_t i = 0; i < n; ++i) pos[i] = static_cast<std::int64_t>(i) + 5;
        st.process(1, pos.data(), n, x.data(), ElemType::F32);
    }
    const std::int64_t seq = mode & 1;
    std::vector<std::uint8_t> data;
    if (mode % 4 < 2) {
        data = r.rest();  // raw bytes
        if (mode & 0x80) dspark_fuzz::fix_crc(data);
    } else {
        // A header that passes magic, version, size and fingerprint; fields from the input.
        const std::uint64_t n_rows = r.u8() % (o.window + o.block_size + 4);
        data.assign(96 + n_rows * st.row_bytes(), 0);
        std::memcpy(data.data(), "DSPK", 4);
        put_le(data, 4, 2, 2);
        put_le(data, 6, 96, 2);
        put_le(data, 8, static_cast<std::uint64_t>(o.feature_dim), 4);
        put_le(data, 12, static_cast<std::uint8_t>(o.storage), 1);
        put_le(data, 13, static_cast<std::uint8_t>(o.nonfinite), 1);
        put_le(data, 16, static_cast<std::uint64_t>(o.window), 4);
        put_le(data, 20, static_cast<std::uint64_t>(o.block_size), 4);
        put_le(data, 24, st.row_bytes(), 4);
        put_le(data, 28, r.u8() & (mode & 0x40 ? 0xFF : 0x1F), 4);
        // Small signed fields (so that the consistency checks pass often), or raw 64-bit ones.
        for (int f = 0; f < 5; ++f) {
            const std::uint64_t v = (mode & 0x20) ? r.u64() : static_cast<std::uint64_t>(static_cast<std::int64_t>(r.u8()) - 8);
            put_le(data, 32 + 8 * f, v, 8);
        }
        put_le(data, 72, r.u8() % 5, 4);
        put_le(data, 80, (mode & 0x10) ? r.u64() : n_rows, 8);
        for (std::size_t i = 96; i < data.size(); ++i) data[i] = r.u8();
        dspark_fuzz::fix_crc(data);
    }
    const auto before = st.snapshot(seq);
    try {
        st.restore(seq, data.data(), data.size());
    } catch (const std::invalid_argument&) {
        FUZZ_CHECK(st.snapshot(seq) == before);  // a rejected restore changes nothing
        return;
    }
    // Accepted: the slot must stay consistent through ordinary use, starting
    // with what a server does after restoring mid-verify: accept.
    const std::int64_t B = o.block_size;
    try {
        st.accept(seq, 0);
    } catch (const std::invalid_argument&) {
    }
    for (int round = 0; round < 4; ++round) {
        const SeqState x = st.state(seq);
        FUZZ_CHECK(!x.started || (0 <= x.horizon && x.horizon <= x.end && x.pos_base <= x.n_cache && x.n_cache <= x.end));
        FUZZ_CHECK(st.stats(seq).peak_rows <= o.window + TRIM_CHUNK + B + 1);
        (void)st.snapshot(seq);
        ByteVec out;
        try {
            const RoundPlan p = st.draft(seq, x.end, out);
            if (p.skip == Skip::None) {
                FUZZ_CHECK(p.crop_from + B <= o.window && p.first_row >= p.pos_base);
                if (round % 2) st.fail(seq, FailStage::Decode);
                else st.commit(seq);
            }
            std::vector<float> rows(static_cast<std::size_t>((B + 1) * o.feature_dim), 1.0f);
            std::vector<std::int64_t> pos(static_cast<std::size_t>(B + 1));
            for (std::int64_t i = 0; i <= B; ++i) pos[static_cast<std::size_t>(i)] = x.end + i;
            st.process(seq, pos.data(), pos.size(), rows.data(), ElemType::F32);
            st.accept(seq, round % (B + 1));
            const std::int64_t back = st.state(seq).end - 2;
            if (round == 2 && back >= 0) st.rollback(seq, back);
        } catch (const std::invalid_argument&) {
        } catch (const StateError&) {
        }
    }
    const auto again = st.snapshot(seq);
    st.restore(1 - seq, again.data(), again.size());  // its own snapshot always restores
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    Reader r(data, size);
    switch (r.u8() % 3) {
        case 0: fuzz_decode(r); break;
        case 1: fuzz_encode(r); break;
        default: fuzz_restore(r); break;
    }
    return 0;
}
