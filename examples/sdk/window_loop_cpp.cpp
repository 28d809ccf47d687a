// The window loop and a q4_0 round trip through the C++ API (dspark/stager.hpp,
// dspark/row_format.hpp), built with find_package(dspark_core) (CMakeLists.txt
// here). Prints the same lines as window_loop.py (the Python API) and window_loop_c.c.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <vector>

#include "demo_rows.h"
#include "dspark/stager.hpp"

namespace {

void window_loop(const char* name, dspark::Storage storage, std::int64_t dim) {
    dspark::StagerOptions o;
    o.feature_dim = dim;
    o.block_size = DEMO_BLOCK;
    o.window = DEMO_WINDOW;
    o.storage = storage;
    dspark::Stager st(o);
    const auto d = static_cast<std::size_t>(dim);
    std::vector<float> rows((DEMO_BLOCK + 1) * d);
    std::vector<std::int64_t> positions(DEMO_BLOCK + 1);
    std::int64_t n_past = DEMO_PROMPT;

    st.begin(0);
    std::iota(positions.begin(), positions.begin() + DEMO_PROMPT, 0);
    demo_rows(rows.data(), 0, DEMO_PROMPT, dim, 0);
    st.process(0, positions.data(), DEMO_PROMPT, rows.data(), dspark::ElemType::F32);
    for (int rnd = 0; rnd < DEMO_ROUNDS; ++rnd) {
        dspark::ByteVec encoded;
        const dspark::RoundPlan p = st.draft(0, n_past, encoded);
        // The staged rows as float32, like the C example's DSPARK_DTYPE_F32.
        std::vector<float> staged(static_cast<std::size_t>(p.n_rows) * d);
        dspark::decode_rows(encoded.data(), storage, staged.data(), dspark::ElemType::F32,
                            static_cast<std::size_t>(p.n_rows), d);
        std::printf("loop %s round=%d start=%" PRId64 " rebase=%d clear_cache=%d pos_base=%" PRId64
                    " first_row=%" PRId64 " n_rows=%" PRId64 " crop_from=%" PRId64 " rows_fnv=%016" PRIx64 "\n",
                    name, rnd, p.start, int(p.rebase), int(p.clear_cache), p.pos_base, p.first_row, p.n_rows,
                    p.crop_from, demo_fnv1a(staged.data(), staged.size() * sizeof(float)));
        st.commit(0);
        if (rnd == DEMO_ROUNDS - 1) break;
        std::iota(positions.begin(), positions.end(), n_past);
        demo_rows(rows.data(), n_past, DEMO_BLOCK + 1, dim, rnd + 1);
        st.process(0, positions.data(), DEMO_BLOCK + 1, rows.data(), dspark::ElemType::F32);
        st.accept(0, DEMO_ACCEPTS[rnd]);
        n_past += DEMO_ACCEPTS[rnd] + 1;
    }
    const dspark::SeqStats s = st.stats(0);
    std::printf("loop %s stats rounds=%" PRId64 " commits=%" PRId64 " rebases=%" PRId64 " staged_rows=%" PRId64
                " restaged_rows=%" PRId64 "\n",
                name, s.rounds, s.commits, s.rebases, s.staged_rows, s.restaged_rows);
    // Accepted drafts per verified round (the commit of the last round has no verify yet).
    std::printf("loop %s accepted", name);
    for (const std::int64_t n : st.accepted(0)) std::printf(" %" PRId64, n);
    std::printf(" verified_rounds=%" PRId64 "\n", s.verified_rounds);
}

void q4_0_round_trip() {
    constexpr std::size_t N = 6, DIM = 64;
    std::vector<float> rows(N * DIM), decoded(N * DIM);
    demo_rows(rows.data(), 0, N, DIM, 99);
    const std::size_t rb = dspark::row_bytes(dspark::Storage::Q4_0, DIM);
    std::vector<std::uint8_t> encoded(N * rb);
    const std::int64_t first_bad = dspark::encode_rows(rows.data(), dspark::ElemType::F32, encoded.data(),
                                                       dspark::Storage::Q4_0, N, DIM, dspark::NonFinite::Error);
    dspark::decode_rows(encoded.data(), dspark::Storage::Q4_0, decoded.data(), dspark::ElemType::F32, N, DIM);
    std::printf("q4_0 rows=%zu dim=%zu row_bytes=%zu encoded_fnv=%016" PRIx64 " decoded_fnv=%016" PRIx64
                " first_bad=%" PRId64 "\n",
                N, DIM, rb, demo_fnv1a(encoded.data(), encoded.size()),
                demo_fnv1a(decoded.data(), decoded.size() * sizeof(float)), first_bad);
    rows[2 * DIM + 17] = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t nan_first_bad = dspark::encode_rows(rows.data(), dspark::ElemType::F32, encoded.data(),
                                                           dspark::Storage::Q4_0, N, DIM, dspark::NonFinite::Error);
    std::printf("q4_0 nan first_bad=%" PRId64 "\n", nan_first_bad);
}

}  // namespace

int main() {
    try {
        window_loop("f32", dspark::Storage::F32, 32);
        window_loop("q4_0", dspark::Storage::Q4_0, 64);
        q4_0_round_trip();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
