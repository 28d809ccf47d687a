// The device step's kernel (csrc/cuda/step_cuda.hpp) on the emulated device,
// against the CPU twin (Stager::step_many) call for call: every output array
// and, after handing back, state(), stats() and snapshot bytes. And the step
// captured into a CUDA graph (the emulated capture refuses synchronizations,
// allocations and host copies) that replays for hundreds of steps with new
// accept counts in the same device array, one launch each.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "cuda_emulation/kernel_emulation.hpp"  // first: the kernels need its model of CUDA
#include "cuda_emulation/cuda_runtime.h"

#include "../cuda/row_format_cuda.cu"
#include "../cuda/cuda_graph.cu"
#include "../cuda/step_cuda.cu"
#include "check.hpp"
#include "dspark/stager.hpp"

using namespace dspark;
using i64 = std::int64_t;

namespace {

// Emulated device memory of n values of T.
template <class T>
struct DevArray {
    T* p = nullptr;
    std::size_t n = 0;
    explicit DevArray(std::size_t count, T fill = T(0)) : n(count) {
        p = static_cast<T*>(cuda_alloc((count ? count : 1) * sizeof(T), 0));
        for (std::size_t i = 0; i < count; ++i) p[i] = fill;  // emulated device memory is host memory
    }
    ~DevArray() { cuda_release(p); }
    DevArray(const DevArray&) = delete;
    DevArray& operator=(const DevArray&) = delete;
    void set(const std::vector<T>& v) {
        if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));  // (an empty vector's data() may be null)
    }
    std::vector<T> get() const { return std::vector<T>(p, p + n); }
};

// One step's answers, on the host or in emulated device memory.
struct HostAnswers {
    std::vector<std::int32_t> status, skip, flags, row_pos, block_pos;
    std::vector<i64> start, pos_base, crop_from, n_rows, row_slots, verify;
    HostAnswers(std::size_t n, std::size_t mr, std::size_t b)
        : status(n), skip(n), flags(n), row_pos(n * mr), block_pos(n * b), start(n), pos_base(n), crop_from(n),
          n_rows(n), row_slots(n * mr), verify(n * (b + 1)) {}
    device_step::Outputs out() {
        device_step::Outputs o;
        o.status = status.data();
        o.skip = skip.data();
        o.flags = flags.data();
        o.start = start.data();
        o.pos_base = pos_base.data();
        o.crop_from = crop_from.data();
        o.n_rows = n_rows.data();
        o.row_slots = row_slots.data();
        o.row_positions = row_pos.data();
        o.block_positions = block_pos.data();
        o.verify_slots = verify.data();
        return o;
    }
};

struct DeviceAnswers {
    DevArray<std::int32_t> status, skip, flags, row_pos, block_pos;
    DevArray<i64> start, pos_base, crop_from, n_rows, row_slots, verify;
    DeviceAnswers(std::size_t n, std::size_t mr, std::size_t b)
        : status(n, 99), skip(n, 99), flags(n, 99), row_pos(n * mr, 99), block_pos(n * b, 99), start(n, 99),
          pos_base(n, 99), crop_from(n, 99), n_rows(n, 99), row_slots(n * mr, 99), verify(n * (b + 1), 99) {}
    device_step::Outputs out() {
        device_step::Outputs o;
        o.status = status.p;
        o.skip = skip.p;
        o.flags = flags.p;
        o.start = start.p;
        o.pos_base = pos_base.p;
        o.crop_from = crop_from.p;
        o.n_rows = n_rows.p;
        o.row_slots = row_slots.p;
        o.row_positions = row_pos.p;
        o.block_positions = block_pos.p;
        o.verify_slots = verify.p;
        return o;
    }
    bool operator==(const HostAnswers& h) const {
        return status.get() == h.status && skip.get() == h.skip && flags.get() == h.flags &&
               row_pos.get() == h.row_pos && block_pos.get() == h.block_pos && start.get() == h.start &&
               pos_base.get() == h.pos_base && crop_from.get() == h.crop_from && n_rows.get() == h.n_rows &&
               row_slots.get() == h.row_slots && verify.get() == h.verify;
    }
};

StagerOptions options(i64 n, i64 b, i64 w) {
    StagerOptions o;
    o.feature_dim = 32;
    o.block_size = b;
    o.window = w;
    o.max_seqs = n;
    o.rows = RowMode::External;
    return o;
}

void prompt(Stager& st, i64 seq, i64 p0, i64 len) {
    std::vector<i64> pos(static_cast<std::size_t>(len)), slots(pos.size());
    for (i64 k = 0; k < len; ++k) pos[static_cast<std::size_t>(k)] = p0 + k;
    st.begin(seq);
    st.process_external(seq, pos.data(), pos.size(), slots.data());
}

// The device owner's copies of the handed sequences' step state columns
// (step_columns_to_device_cuda / step_columns_to_host_cuda, on the stream the steps use).
void upload(Stager& st, i64* dev_state, const std::vector<i64>& seqs) {
    step_columns_to_device_cuda(st.step_config(), dev_state, st.step_state(), seqs.data(), seqs.size(), nullptr);
}
void download(Stager& st, const i64* dev_state, const std::vector<i64>& seqs) {
    step_columns_to_host_cuda(st.step_config(), dev_state, st.step_state(), seqs.data(), seqs.size(), nullptr);
}

// Snapshots compared by same_seq (a test checks that some were).
int snapshots_compared = 0;

// A sequence back on the host: the same state, stats and histogram, and the same
// snapshot bytes. A snapshot needs no reservation open, so one open on both is
// settled alike first (confirmed, or cancelled for an odd end), as a server
// settles it before it moves a sequence.
bool same_seq(Stager& a, Stager& b, i64 q) {
    const SeqState x = a.state(q), y = b.state(q);
    const SeqStats u = a.stats(q), v = b.stats(q);
    bool ok = std::memcmp(&u, &v, sizeof u) == 0 && a.accepted(q) == b.accepted(q) && x.end == y.end && x.horizon == y.horizon &&
              x.n_cache == y.n_cache && x.pos_base == y.pos_base && x.reservation_open == y.reservation_open &&
              x.tentative_rows == y.tentative_rows && x.restage_owed == y.restage_owed &&
              x.consecutive_failures == y.consecutive_failures && x.disabled == y.disabled;
    if (!ok) return false;
    if (x.reservation_open) {
        if (x.end % 2) {
            a.cancel(q);
            b.cancel(q);
        } else {
            a.confirm(q);
            b.confirm(q);
        }
    }
    ++snapshots_compared;
    return a.snapshot(q) == b.snapshot(q);
}

// The CSR rows of a step (capacity cap >= k entries): the kernel's
// (device_step_rows_cuda) equal the CPU twin's (Stager::step_rows), and both
// the padded rows of the step concatenated.
bool csr_rows_agree(Stager& cpu, const device_step::Config& c, const i64* dev_state, const std::vector<i64>& seqs,
                    HostAnswers& h, DeviceAnswers& d, std::size_t cap) {
    const std::size_t k = seqs.size(), mr = static_cast<std::size_t>(c.max_rows);
    std::vector<i64> offsets(cap + 1, -5), slots(cap * mr, -5);
    std::vector<std::int32_t> pos(cap * mr, -5);
    device_step::CsrRows hr;
    hr.row_offsets = offsets.data();
    hr.row_slots = slots.data();
    hr.row_positions = pos.data();
    cpu.step_rows(seqs.data(), k, h.out(), cap, hr);
    DevArray<i64> d_seqs(k), d_offsets(cap + 1, -5), d_slots(cap * mr, -5);
    DevArray<std::int32_t> d_pos(cap * mr, -5);
    d_seqs.set(seqs);
    device_step::CsrRows dr;
    dr.row_offsets = d_offsets.p;
    dr.row_slots = d_slots.p;
    dr.row_positions = d_pos.p;
    device_step_rows_cuda(c, dev_state, d_seqs.p, k, d.out(), cap, dr, nullptr);
    bool ok = d_offsets.get() == offsets && d_slots.get() == slots && d_pos.get() == pos;
    i64 at = 0;
    for (std::size_t i = 0; i < k; ++i) {
        const i64 m = h.status[i] == device_step::STATUS_OK ? h.n_rows[i] : 0;
        ok = ok && offsets[i] == at;
        for (i64 j = 0; j < m; ++j, ++at)
            ok = ok && slots[static_cast<std::size_t>(at)] == h.row_slots[i * mr + static_cast<std::size_t>(j)] &&
                 pos[static_cast<std::size_t>(at)] == h.row_pos[i * mr + static_cast<std::size_t>(j)];
    }
    for (std::size_t i = k; i <= cap; ++i) ok = ok && offsets[i] == at;
    for (std::size_t j = static_cast<std::size_t>(at); j < slots.size(); ++j) ok = ok && slots[j] == -5 && pos[j] == -5;
    return ok;
}

}  // namespace

// Random steps: the kernel (int32 and int64 counts) against the CPU twin.
void kernel_equals_cpu_twin(i64 n, i64 b, i64 w, Storage storage, std::uint64_t seed, int n_steps) {
    StagerOptions o = options(n, b, w);
    o.storage = storage;
    Stager cpu(o), gpu(o);
    const auto c = gpu.step_config();
    const auto mr = static_cast<std::size_t>(c.max_rows);
    DevArray<i64> state(static_cast<std::size_t>(device_step::columns(c) * n));
    std::mt19937_64 rng(seed);
    auto pick = [&](i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); };
    for (i64 q = 0; q < n; ++q) {
        const i64 p0 = pick(0, 40), len = pick(1, 3 * w);
        prompt(cpu, q, p0, len);
        prompt(gpu, q, p0, len);
    }
    std::vector<bool> on(static_cast<std::size_t>(n), false);
    int mismatches = 0, stepped = 0;
    for (int t = 0; t < n_steps; ++t) {
        std::vector<i64> go, back;
        for (i64 q = 0; q < n; ++q) {
            if (!on[static_cast<std::size_t>(q)] && pick(0, 9) == 0) go.push_back(q);
            else if (on[static_cast<std::size_t>(q)] && pick(0, 49) == 0) back.push_back(q);
        }
        if (!back.empty()) {
            download(gpu, state.p, back);
            bool a = false, g = false;
            try {
                cpu.to_host(back.data(), back.size());
            } catch (const std::invalid_argument&) {
                a = true;
            }
            try {
                gpu.to_host(back.data(), back.size());
            } catch (const std::invalid_argument&) {
                g = true;
            }
            if (a != g) ++mismatches;
            upload(gpu, state.p, back);  // their columns on the device: not live any more
            for (i64 q : back) {
                on[static_cast<std::size_t>(q)] = false;
                if (!same_seq(cpu, gpu, q)) ++mismatches;
            }
        }
        if (!go.empty()) {
            cpu.to_device(go.data(), go.size());
            gpu.to_device(go.data(), go.size());
            upload(gpu, state.p, go);
            for (i64 q : go) on[static_cast<std::size_t>(q)] = true;
        }
        std::vector<i64> seqs, counts;
        for (i64 q = 0; q < n; ++q)
            if (on[static_cast<std::size_t>(q)] || pick(0, 99) == 0) {  // now and then a host sequence
                seqs.push_back(q);
                counts.push_back(pick(0, 99) == 0 ? pick(-2, b + 1) : pick(0, b));  // now and then a fault
            }
        std::shuffle(seqs.begin(), seqs.end(), rng);
        if (!seqs.empty() && pick(0, 9) == 0) {
            seqs.push_back(seqs.front());
            counts.push_back(0);
        }
        if (pick(0, 19) == 0) {
            seqs.push_back(n + pick(0, 5));
            counts.push_back(0);
        }
        const std::size_t k = seqs.size();
        HostAnswers h(k, mr, static_cast<std::size_t>(b));
        DeviceAnswers d(k, mr, static_cast<std::size_t>(b));
        cpu.step_many(seqs.data(), counts.data(), k, h.out());
        DevArray<i64> d_seqs(k);
        d_seqs.set(seqs);
        if (t % 2) {
            DevArray<i64> d_counts(k);
            d_counts.set(counts);
            device_step_cuda(c, state.p, d_seqs.p, d_counts.p, 8, k, d.out(), nullptr);
        } else {
            std::vector<std::int32_t> c32(counts.begin(), counts.end());
            DevArray<std::int32_t> d_counts(k);
            d_counts.set(c32);
            device_step_cuda(c, state.p, d_seqs.p, d_counts.p, 4, k, d.out(), nullptr);
        }
        if (!(d == h)) ++mismatches;
        if (!csr_rows_agree(cpu, c, state.p, seqs, h, d, k + static_cast<std::size_t>(t % 3))) ++mismatches;
        for (std::int32_t s : h.status) stepped += s == device_step::STATUS_OK;
    }
    std::vector<i64> all;
    for (i64 q = 0; q < n; ++q)
        if (on[static_cast<std::size_t>(q)]) all.push_back(q);
    download(gpu, state.p, all);
    bool a = false, g = false;
    try {
        cpu.to_host(all.data(), all.size());
    } catch (const std::invalid_argument&) {
        a = true;
    }
    try {
        gpu.to_host(all.data(), all.size());
    } catch (const std::invalid_argument&) {
        g = true;
    }
    CHECK_EQ(a, g);
    const int compared_before = snapshots_compared;
    for (i64 q = 0; q < n; ++q) CHECK(same_seq(cpu, gpu, q));
    CHECK_EQ(snapshots_compared - compared_before, int(n));  // every sequence's snapshot compared
    CHECK_EQ(mismatches, 0);
    CHECK(stepped * 2 > n_steps);  // most entries really stepped
}

// N = 1 .. 256, every storage, thousands of steps in all.
TEST_CASE(kernel_equals_cpu_twin_all_storages) {
    kernel_equals_cpu_twin(1, 1, 3, Storage::F32, 91, 800);
    kernel_equals_cpu_twin(7, 4, 16, Storage::F16, 92, 600);
    kernel_equals_cpu_twin(48, 3, 13, Storage::BF16, 99, 400);
    kernel_equals_cpu_twin(33, 2, 9, Storage::Q4_0, 93, 400);
    kernel_equals_cpu_twin(256, 8, 40, Storage::Q8_0, 94, 150);
}

// accept -> plan -> reserve of a batch, captured once and replayed for 300
// steps with the sampler's new counts written into the same device array:
// one launch per step, the CPU twin's answers every time.
TEST_CASE(captured_step_replays) {
    const i64 n = 16, b = 4, w = 20;
    Stager cpu(options(n, b, w)), gpu(options(n, b, w));
    const auto c = gpu.step_config();
    const auto mr = static_cast<std::size_t>(c.max_rows);
    std::vector<i64> seqs;
    for (i64 q = 0; q < n; ++q) {
        prompt(cpu, q, 3 * q, 5 + q);
        prompt(gpu, q, 3 * q, 5 + q);
        seqs.push_back(n - 1 - q);
    }
    cpu.to_device(seqs.data(), seqs.size());
    gpu.to_device(seqs.data(), seqs.size());
    DevArray<i64> state(static_cast<std::size_t>(device_step::columns(c) * n)), d_seqs(seqs.size());
    DevArray<std::int32_t> d_counts(seqs.size(), 0);
    upload(gpu, state.p, seqs);
    d_seqs.set(seqs);
    DeviceAnswers d(seqs.size(), mr, static_cast<std::size_t>(b));
    void* s = cuda_stream_create(0);
    cuda_graph_begin_capture(s, 0);
    device_step_cuda(c, state.p, d_seqs.p, d_counts.p, 4, seqs.size(), d.out(), s);
    const std::size_t captured = dspark_emu::launch_count();
    void* graph = cuda_graph_end_capture(s, 0);  // throws had the step synchronized, allocated or copied
    CHECK_EQ(dspark_emu::launch_count(), captured);  // recorded, not run
    std::mt19937_64 rng(5);
    int mismatches = 0;
    for (int t = 0; t < 300; ++t) {
        std::vector<std::int32_t> c32(seqs.size());
        for (auto& v : c32) v = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(b + 1));
        d_counts.set(c32);  // the sampler's write, between replays
        const std::size_t before = dspark_emu::launch_count();
        cuda_graph_launch(graph, s, 0);
        CHECK_EQ(dspark_emu::launch_count() - before, 1u);
        const std::vector<i64> counts(c32.begin(), c32.end());
        HostAnswers h(seqs.size(), mr, static_cast<std::size_t>(b));
        cpu.step_many(seqs.data(), counts.data(), seqs.size(), h.out());
        if (!(d == h)) ++mismatches;
    }
    CHECK_EQ(mismatches, 0);
    cuda_graph_destroy(graph);
    cuda_stream_destroy(s);
    download(gpu, state.p, seqs);
    cpu.to_host(seqs.data(), seqs.size());
    gpu.to_host(seqs.data(), seqs.size());
    for (i64 q = 0; q < n; ++q) CHECK(same_seq(cpu, gpu, q));
    CHECK(cpu.stats(0).rebases > 0);
}

TEST_CASE(bad_arguments_throw_before_any_launch) {
    Stager gpu(options(2, 2, 9));
    const auto c = gpu.step_config();
    DevArray<i64> state(static_cast<std::size_t>(device_step::columns(c) * 2)), seqs(1), counts(1);
    DevArray<std::int32_t> status(1);
    device_step::Outputs out;
    out.status = status.p;
    std::vector<i64> host(1);
    const std::size_t before = dspark_emu::launch_count();
    CHECK_THROWS(device_step_cuda(c, state.p, seqs.p, counts.p, 3, 1, out, nullptr), std::invalid_argument);
    CHECK_THROWS(device_step_cuda(c, state.p, host.data(), counts.p, 8, 1, out, nullptr), std::invalid_argument);
    CHECK_THROWS(device_step_cuda(c, nullptr, seqs.p, counts.p, 8, 1, out, nullptr), std::invalid_argument);
    device_step::Outputs none;
    CHECK_THROWS(device_step_cuda(c, state.p, seqs.p, counts.p, 8, 1, none, nullptr), std::invalid_argument);
    CHECK_EQ(dspark_emu::launch_count(), before);
}

// The column copies move the named sequences' columns and nothing else (runs of
// consecutive ids, repeats and any order alike), and refuse bad arguments
// before copying anything.
TEST_CASE(column_copies_move_the_handed_sequences_alone) {
    const i64 n = 9;
    Stager st(options(n, 3, 13));
    const auto c = st.step_config();
    const i64 cols = device_step::columns(c);
    const auto total = static_cast<std::size_t>(cols * n);
    DevArray<i64> dev(total);
    std::vector<i64> host(total), dev_before(total);
    for (std::size_t k = 0; k < total; ++k) {
        host[k] = 1000 + static_cast<i64>(k);
        dev.p[k] = dev_before[k] = -1 - static_cast<i64>(k);
    }
    const std::vector<i64> seqs = {5, 2, 3, 8, 3};  // runs 2..3, 5, 8; 3 twice
    auto handed = [&](i64 q) { return std::find(seqs.begin(), seqs.end(), q) != seqs.end(); };
    step_columns_to_device_cuda(c, dev.p, host.data(), seqs.data(), seqs.size(), nullptr);
    for (i64 f = 0; f < cols; ++f)
        for (i64 q = 0; q < n; ++q) {
            const auto k = static_cast<std::size_t>(f * n + q);
            CHECK_EQ(dev.p[k], handed(q) ? host[k] : dev_before[k]);
        }
    std::vector<i64> back(total, 7);
    const std::vector<i64> one = {0};
    step_columns_to_host_cuda(c, dev.p, back.data(), one.data(), one.size(), nullptr);
    for (i64 f = 0; f < cols; ++f)
        for (i64 q = 0; q < n; ++q) {
            const auto k = static_cast<std::size_t>(f * n + q);
            CHECK_EQ(back[k], q == 0 ? dev_before[k] : 7);
        }
    const std::vector<i64> outside = {1, n}, negative = {-1};
    const std::vector<i64> after(dev.p, dev.p + total);
    CHECK_THROWS(step_columns_to_device_cuda(c, dev.p, host.data(), outside.data(), 2, nullptr), std::invalid_argument);
    CHECK_THROWS(step_columns_to_host_cuda(c, dev.p, back.data(), negative.data(), 1, nullptr), std::invalid_argument);
    CHECK_THROWS(step_columns_to_device_cuda(c, host.data(), host.data(), one.data(), 1, nullptr),
                 std::invalid_argument);  // the device state in host memory
    CHECK_THROWS(step_columns_to_device_cuda(c, dev.p, dev.p, one.data(), 1, nullptr),
                 std::invalid_argument);  // the host state in device memory
    CHECK_THROWS(step_columns_to_device_cuda(c, reinterpret_cast<i64*>(reinterpret_cast<char*>(dev.p) + 4),
                                             host.data(), one.data(), 1, nullptr),
                 std::invalid_argument);  // misaligned
    CHECK_THROWS(step_columns_to_device_cuda(c, dev.p, nullptr, one.data(), 1, nullptr), std::invalid_argument);
    CHECK(std::vector<i64>(dev.p, dev.p + total) == after);
    CHECK(std::all_of(back.begin() + 1, back.begin() + n, [](i64 v) { return v == 7; }));
}

TEST_MAIN()
