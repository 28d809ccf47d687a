// The index-driven batches (csrc/cuda/row_batch_cuda.hpp) on the emulated
// device, against the CPU path.
//
// This test compiles the CUDA library's host code and kernels as C++ against
// the emulated runtime (csrc/tests/cuda_emulation/: host memory as device
// memory, kernels under the lock-step warp model, stream capture recorded
// and replayed), so it runs on any machine. Every batch must give exactly
// the bytes of dspark::encode_rows / decode_rows (scalar path) row by row at
// the rows' slots, leave skipped slots alone, report what the CPU reports,
// take one launch, and be capturable into a graph (no synchronization,
// allocation or host copy inside) that replays with new slot values.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "cuda_emulation/kernel_emulation.hpp"  // first: the kernels need its model of CUDA
#include "cuda_emulation/cuda_runtime.h"

#include "../cuda/row_format_cuda.cu"
#include "../cuda/row_batch_cuda.cu"
#include "../cuda/cuda_graph.cu"
#include "check.hpp"
#include "row_types.hpp"

using namespace dspark;
using dspark_test::as_type;

namespace {

struct ScalarPath {
    SimdPath saved = active_simd_path();
    ScalarPath() { set_simd_path(SimdPath::Scalar); }
    ~ScalarPath() { set_simd_path(saved); }
};

// Emulated device memory holding a copy of `bytes`.
struct Dev {
    void* p = nullptr;
    std::size_t n = 0;
    explicit Dev(std::size_t bytes, int fill = 0) : n(bytes) {
        p = cuda_alloc(bytes, 0);
        std::memset(p, fill, bytes == 0 ? 1 : bytes);  // emulated device memory is host memory
    }
    template <class T>
    explicit Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
        std::memcpy(p, v.data(), n);
    }
    ~Dev() { cuda_release(p); }
    Dev(const Dev&) = delete;
    Dev& operator=(const Dev&) = delete;
    template <class T>
    T* as() const { return static_cast<T*>(p); }
    std::vector<std::uint8_t> bytes() const {
        std::vector<std::uint8_t> b(n);
        std::memcpy(b.data(), p, n);
        return b;
    }
};

// Activations with a few massive channels (up to ~1e5) and, when asked, a
// huge-norm first row and NaN / Inf / values past every storage's limit.
std::vector<float> activations(std::size_t rows, std::size_t dim, unsigned seed, bool bad) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> x(rows * dim);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < dim; ++c) {
            float v = g(rng);
            if (c == 1) v *= 1e3f;
            if (c == dim / 3) v *= 2e4f;
            if (r == 0 && bad) v *= 300.0f;
            x[r * dim + c] = v;
        }
    if (bad) {
        x[3 * dim + 5] = std::numeric_limits<float>::infinity();
        x[5 * dim + dim - 1] = std::nanf("");
        x[7 * dim + 2] = 1e6f;  // past f16's and q4_0's limits
    }
    return x;
}

// Slots of a batch: rows land out of order and across the table's end, some
// skipped (-1); a table of 2 * rows + 3 rows.
std::vector<std::int64_t> batch_slots(std::size_t rows) {
    std::vector<std::int64_t> s(rows);
    const auto table = static_cast<std::int64_t>(2 * rows + 3);
    for (std::size_t r = 0; r < rows; ++r)
        s[r] = r % 4 == 2 ? -1 : (table - 2 + 2 * static_cast<std::int64_t>(r)) % table;
    return s;
}

constexpr std::size_t ROWS = 11;

std::vector<std::size_t> dims_for(Storage st) {
    // Odd float rows (a partial last chunk, unaligned rows) and a row of two
    // 1024-element segments, the second partial.
    if (st == Storage::Q8_0 || st == Storage::Q4_0) return {96, 1056};
    return {37, 1030};
}

std::uint64_t none() { return BATCH_STATUS_NONE; }

}  // namespace

TEST_CASE(batch_write_is_the_cpu_encode_at_every_slot) {
    ScalarPath sp;
    for (int st = 0; st < STORAGE_COUNT; ++st)
        for (std::size_t dim : dims_for(static_cast<Storage>(st))) {
            const auto x = activations(ROWS, dim, static_cast<unsigned>(st * 7 + dim), true);
            const auto slots = batch_slots(ROWS);
            const std::size_t table_rows = 2 * ROWS + 3, rb = row_bytes(static_cast<Storage>(st), dim);
            for (int in = 0; in < 3; ++in)
                for (int staged = 0; staged < 3; ++staged)
                    for (int pol = 1; pol < NONFINITE_COUNT; ++pol) {  // the policies that write everything
                        const auto src = as_type(x, static_cast<ElemType>(in));
                        const EncodeBounds b = encode_bounds(static_cast<Storage>(st), static_cast<ElemType>(staged));
                        std::vector<std::uint8_t> want(table_rows * rb, 0x5a);
                        for (std::size_t r = 0; r < ROWS; ++r)
                            if (slots[r] >= 0)
                                encode_rows(src.data() + r * dim * elem_bytes(static_cast<ElemType>(in)),
                                            static_cast<ElemType>(in), want.data() + slots[r] * rb,
                                            static_cast<Storage>(st), 1, dim, static_cast<NonFinite>(pol), b);
                        Dev d_src(src), d_slots(slots), table(table_rows * rb, 0x5a), status(16);
                        batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
                        const std::size_t before = dspark_emu::launch_count();
                        scatter_rows_cuda(d_src.p, static_cast<ElemType>(in), ROWS, dim, d_slots.as<std::int64_t>(),
                                          table.p, static_cast<Storage>(st), table_rows, static_cast<NonFinite>(pol),
                                          static_cast<ElemType>(staged), status.as<std::uint64_t>(), false, nullptr);
                        CHECK_EQ(dspark_emu::launch_count() - before, 1u);
                        const bool same = table.bytes() == want;
                        if (!same)
                            std::printf("  write in=%d storage=%s dim=%zu staged=%d policy=%d differs\n", in,
                                        storage_name(static_cast<Storage>(st)), dim, staged, pol);
                        CHECK(same);
                        CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_SLOT], none());
                    }
        }
}

TEST_CASE(batch_gather_is_the_cpu_decode_and_zeros_for_skipped_rows) {
    ScalarPath sp;
    for (int st = 0; st < STORAGE_COUNT; ++st)
        for (std::size_t dim : dims_for(static_cast<Storage>(st))) {
            const std::size_t table_rows = 2 * ROWS + 3, rb = row_bytes(static_cast<Storage>(st), dim);
            const auto x = activations(table_rows, dim, static_cast<unsigned>(st + dim), false);
            std::vector<std::uint8_t> enc(table_rows * rb);
            encode_rows(x.data(), ElemType::F32, enc.data(), static_cast<Storage>(st), table_rows, dim, NonFinite::Clamp);
            const auto slots = batch_slots(ROWS);
            Dev table(enc), d_slots(slots);
            for (int out = 0; out < 3; ++out) {
                const std::size_t eb = elem_bytes(static_cast<ElemType>(out));
                std::vector<std::uint8_t> want(ROWS * dim * eb, 0);  // zeros: +0.0 in every type
                for (std::size_t r = 0; r < ROWS; ++r)
                    if (slots[r] >= 0)
                        decode_rows(enc.data() + slots[r] * rb, static_cast<Storage>(st), want.data() + r * dim * eb,
                                    static_cast<ElemType>(out), 1, dim);
                Dev dst(ROWS * dim * eb, 0x77);
                const std::size_t before = dspark_emu::launch_count();
                gather_rows_cuda(table.p, static_cast<Storage>(st), table_rows, dim, d_slots.as<std::int64_t>(), ROWS,
                                 dst.p, static_cast<ElemType>(out), nullptr, nullptr);
                CHECK_EQ(dspark_emu::launch_count() - before, 1u);
                const bool same = dst.bytes() == want;
                if (!same)
                    std::printf("  gather storage=%s dim=%zu out=%d differs\n", storage_name(static_cast<Storage>(st)),
                                dim, out);
                CHECK(same);
            }
        }
}

TEST_CASE(batch_check_reports_what_the_cpu_rejects_and_gates_the_write) {
    ScalarPath sp;
    const std::size_t dim = 96, table_rows = 2 * ROWS + 3;
    const auto x = activations(ROWS, dim, 5, true);  // bad values in rows 3 (Inf), 5 (NaN), 7 (1e6)
    for (int st = 0; st < STORAGE_COUNT; ++st)
        for (int staged = 0; staged < 3; ++staged) {
            const EncodeBounds b = encode_bounds(static_cast<Storage>(st), static_cast<ElemType>(staged));
            auto slots = batch_slots(ROWS);
            for (int skip_first_bad = 0; skip_first_bad < 2; ++skip_first_bad) {
                if (skip_first_bad) slots[3] = -1;  // a skipped row is not checked (padding)
                std::int64_t want = -1;
                for (std::size_t r = 0; r < ROWS && want < 0; ++r) {
                    if (slots[r] < 0) continue;
                    const std::int64_t at = find_unencodable(x.data() + r * dim, ElemType::F32, dim, b.limit);
                    if (at >= 0) want = static_cast<std::int64_t>(r * dim) + at;
                }
                const std::size_t rb = row_bytes(static_cast<Storage>(st), dim);
                Dev d_src(x), d_slots(slots), status(16), table(table_rows * rb, 0x33);
                batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
                check_rows_cuda(d_src.p, ElemType::F32, ROWS, dim, d_slots.as<std::int64_t>(), table_rows,
                                static_cast<Storage>(st), static_cast<ElemType>(staged), status.as<std::uint64_t>(),
                                nullptr);
                const std::uint64_t got = status.as<std::uint64_t>()[BATCH_BAD_VALUE];
                CHECK_EQ(got == none() ? -1 : static_cast<std::int64_t>(got), want);
                // The gated write changes nothing when the check reported.
                scatter_rows_cuda(d_src.p, ElemType::F32, ROWS, dim, d_slots.as<std::int64_t>(), table.p,
                                  static_cast<Storage>(st), table_rows, NonFinite::Error,
                                  static_cast<ElemType>(staged), status.as<std::uint64_t>(), true, nullptr);
                const auto t = table.bytes();
                const bool untouched = t == std::vector<std::uint8_t>(t.size(), 0x33);
                CHECK_EQ(untouched, want >= 0);
            }
        }
    // Without slots every row is checked; a clean batch passes the gate.
    const auto clean = activations(ROWS, dim, 6, false);
    Dev d_src(clean), status(16), table(table_rows * row_bytes(Storage::BF16, dim), 0x33);
    const auto slots = batch_slots(ROWS);
    Dev d_slots(slots);
    batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
    check_rows_cuda(d_src.p, ElemType::F32, ROWS, dim, nullptr, 0, Storage::BF16, ElemType::F32,
                    status.as<std::uint64_t>(), nullptr);
    CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_VALUE], none());
    scatter_rows_cuda(d_src.p, ElemType::F32, ROWS, dim, d_slots.as<std::int64_t>(), table.p, Storage::BF16,
                      table_rows, NonFinite::Error, ElemType::F32, status.as<std::uint64_t>(), true, nullptr);
    CHECK(table.bytes() != std::vector<std::uint8_t>(table.n, 0x33));
}

TEST_CASE(slots_outside_the_table_are_skipped_and_reported) {
    const std::size_t dim = 64, table_rows = 6, rb = row_bytes(Storage::Q8_0, dim);
    const auto x = activations(4, dim, 9, false);
    const std::vector<std::int64_t> slots{2, 6, -1, -7};  // 6 = table_rows and -7: outside
    Dev d_src(x), d_slots(slots), status(16), table(table_rows * rb, 0x11), dst(4 * dim * 4, 0x22);
    batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
    scatter_rows_cuda(d_src.p, ElemType::F32, 4, dim, d_slots.as<std::int64_t>(), table.p, Storage::Q8_0, table_rows,
                      NonFinite::Clamp, ElemType::F32, status.as<std::uint64_t>(), false, nullptr);
    CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_SLOT], 1u);
    const auto t = table.bytes();
    for (std::size_t r = 0; r < table_rows; ++r)  // only slot 2 was written
        CHECK_EQ(std::vector<std::uint8_t>(t.begin() + r * rb, t.begin() + (r + 1) * rb) ==
                     std::vector<std::uint8_t>(rb, 0x11),
                 r != 2);
    batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
    gather_rows_cuda(table.p, Storage::Q8_0, table_rows, dim, d_slots.as<std::int64_t>(), 4, dst.p, ElemType::F32,
                     status.as<std::uint64_t>(), nullptr);
    CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_SLOT], 1u);
    const auto o = dst.bytes();
    CHECK(std::vector<std::uint8_t>(o.begin() + dim * 4, o.end()) == std::vector<std::uint8_t>(3 * dim * 4, 0));
    // A bad slot closes the gate too: the checked write of the batch changes nothing.
    Dev fresh(table_rows * rb, 0x11);
    batch_status_reset_cuda(status.as<std::uint64_t>(), nullptr);
    check_rows_cuda(d_src.p, ElemType::F32, 4, dim, d_slots.as<std::int64_t>(), table_rows, Storage::Q8_0,
                    ElemType::F32, status.as<std::uint64_t>(), nullptr);
    CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_VALUE], none());
    CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_SLOT], 1u);
    scatter_rows_cuda(d_src.p, ElemType::F32, 4, dim, d_slots.as<std::int64_t>(), fresh.p, Storage::Q8_0, table_rows,
                      NonFinite::Error, ElemType::F32, status.as<std::uint64_t>(), true, nullptr);
    CHECK(fresh.bytes() == std::vector<std::uint8_t>(table_rows * rb, 0x11));
}

TEST_CASE(a_captured_batch_replays_with_new_slots) {
    ScalarPath sp;
    const std::size_t dim = 128, rows = 6, table_rows = 16, rb = row_bytes(Storage::Q4_0, dim);
    const auto x = activations(rows, dim, 21, false);
    Dev d_src(x), d_slots(std::vector<std::int64_t>(rows, -1)), status(16), table(table_rows * rb, 0),
        dst(rows * dim * 2, 0x77);
    void* s = cuda_stream_create(0);
    // Captured: reset the status, check, gated write, gather (3 kernels, 1 memset).
    cuda_graph_begin_capture(s, 0);
    batch_status_reset_cuda(status.as<std::uint64_t>(), s);
    check_rows_cuda(d_src.p, ElemType::F32, rows, dim, d_slots.as<std::int64_t>(), table_rows, Storage::Q4_0,
                    ElemType::BF16, status.as<std::uint64_t>(), s);
    scatter_rows_cuda(d_src.p, ElemType::F32, rows, dim, d_slots.as<std::int64_t>(), table.p, Storage::Q4_0,
                      table_rows, NonFinite::Error, ElemType::BF16, status.as<std::uint64_t>(), true, s);
    gather_rows_cuda(table.p, Storage::Q4_0, table_rows, dim, d_slots.as<std::int64_t>(), rows, dst.p,
                     ElemType::BF16, status.as<std::uint64_t>(), s);
    const std::size_t captured = dspark_emu::launch_count();
    void* graph = cuda_graph_end_capture(s, 0);
    CHECK_EQ(dspark_emu::launch_count(), captured);                           // recorded, not run
    CHECK(table.bytes() == std::vector<std::uint8_t>(table_rows * rb, 0));   // nothing ran yet
    std::vector<std::uint8_t> enc(rows * rb);
    encode_rows(x.data(), ElemType::F32, enc.data(), Storage::Q4_0, rows, dim, NonFinite::Error,
                encode_bounds(Storage::Q4_0, ElemType::BF16));
    for (int step = 0; step < 3; ++step) {
        // New slot values in the same device array (what a server does between replays).
        std::vector<std::int64_t> slots(rows);
        for (std::size_t r = 0; r < rows; ++r) slots[r] = r == static_cast<std::size_t>(step) ? -1 : static_cast<std::int64_t>((r * 3 + static_cast<std::size_t>(step) * 5) % table_rows);
        std::memcpy(d_slots.p, slots.data(), rows * sizeof(std::int64_t));
        const std::size_t before = dspark_emu::launch_count();
        cuda_graph_launch(graph, s, 0);
        CHECK_EQ(dspark_emu::launch_count() - before, 3u);
        const auto t = table.bytes(), o = dst.bytes();
        for (std::size_t r = 0; r < rows; ++r) {
            if (slots[r] < 0) continue;
            CHECK(std::memcmp(t.data() + slots[r] * rb, enc.data() + r * rb, rb) == 0);
            std::vector<std::uint16_t> want(dim);
            decode_rows(enc.data() + r * rb, Storage::Q4_0, want.data(), ElemType::BF16, 1, dim);
            CHECK(std::memcmp(o.data() + r * dim * 2, want.data(), dim * 2) == 0);
        }
        CHECK_EQ(status.as<std::uint64_t>()[BATCH_BAD_VALUE], none());
    }
    cuda_graph_destroy(graph);
    // What cannot be captured fails, and so does the capture.
    cuda_graph_begin_capture(s, 0);
    CHECK_THROWS(cuda_stream_synchronize(s, 0), std::runtime_error);
    CHECK_THROWS(cuda_alloc(16, 0), std::runtime_error);
    CHECK_THROWS(cuda_graph_end_capture(s, 0), std::runtime_error);
    // The run conversion's nonfinite="error" report synchronizes: not capturable either.
    Dev out(rows * rb);
    cuda_graph_begin_capture(s, 0);
    CHECK_THROWS(encode_rows_cuda(d_src.p, ElemType::F32, out.p, Storage::Q4_0, rows, dim, NonFinite::Error, s, true),
                 std::runtime_error);
    CHECK_THROWS(cuda_graph_end_capture(s, 0), std::runtime_error);
    cuda_stream_destroy(s);
}

TEST_CASE(bad_arguments_throw_before_any_launch) {
    const std::size_t dim = 64;
    const auto x = activations(2, dim, 1, false);
    const std::vector<std::int64_t> slots{0, 1};
    Dev d_src(x), d_slots(slots), status(16), table(4 * dim * 4);
    std::vector<std::int64_t> host_slots(slots);
    const std::size_t before = dspark_emu::launch_count();
    CHECK_THROWS(scatter_rows_cuda(d_src.p, ElemType::F32, 2, dim, host_slots.data(), table.p, Storage::F32, 4,
                                   NonFinite::Zero, ElemType::F32, nullptr, false, nullptr),
                 std::invalid_argument);  // host memory
    CHECK_THROWS(scatter_rows_cuda(d_src.p, ElemType::F32, 2, dim, nullptr, table.p, Storage::F32, 4, NonFinite::Zero,
                                   ElemType::F32, nullptr, false, nullptr),
                 std::invalid_argument);
    CHECK_THROWS(scatter_rows_cuda(d_src.p, ElemType::F32, 2, dim, d_slots.as<std::int64_t>(), table.p, Storage::F32,
                                   4, NonFinite::Error, ElemType::F32, nullptr, true, nullptr),
                 std::invalid_argument);  // gated without a status
    CHECK_THROWS(gather_rows_cuda(table.p, Storage::Q8_0, 4, 60, d_slots.as<std::int64_t>(), 2, d_src.p,
                                  ElemType::F32, nullptr, nullptr),
                 ConfigError);  // q rows of 60 elements
    CHECK_THROWS(gather_rows_cuda(table.p, Storage::F32, 4, dim,
                                  reinterpret_cast<const std::int64_t*>(d_slots.as<char>() + 4), 1, d_src.p,
                                  ElemType::F32, nullptr, nullptr),
                 std::invalid_argument);  // misaligned slots
    CHECK_THROWS(check_rows_cuda(d_src.p, ElemType::F32, 2, dim, nullptr, 0, Storage::F32, ElemType::F32, nullptr,
                                 nullptr),
                 std::invalid_argument);  // no status
    CHECK_EQ(dspark_emu::launch_count(), before);
}

TEST_MAIN()
