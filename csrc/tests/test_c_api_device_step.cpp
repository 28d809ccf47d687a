// The C ABI's device step (dspark_to_device / dspark_step_many / dspark_to_host
// / dspark_check_step) against the C++ Stager's, the oracle: the same steps
// give the same answers and the same states, and every refusal returns the
// C++ call's error (its status and message) and changes nothing.
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "c_api_common.hpp"
#include "check.hpp"
#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"
#include "step_answers.hpp"

namespace {

using c_api_test::D, c_api_test::Handle, c_api_test::snap, c_api_test::span;
constexpr std::int64_t B = 3, W = 14, SEQS = 5;

dspark_config config() {
    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = SEQS;
    c.rows_mode = DSPARK_ROWS_EXTERNAL;
    return c;
}

dspark::StagerOptions options() {
    dspark::StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = SEQS;
    o.rows = dspark::RowMode::External;
    return o;
}

// One step's answers (every output of dspark_step_out), B wide.
struct Answers : step_test::StepAnswers {
    Answers(std::size_t n, std::size_t max_rows) : StepAnswers(n, max_rows, B, 0) {}
};

// The C call's status and message equal the C++ call's exception.
template <class C, class Cpp>
bool same_error(C&& c_call, Cpp&& cpp_call, dspark_status want) {
    const dspark_status got = c_call();
    std::string what;
    try {
        cpp_call();
    } catch (const std::exception& e) {
        what = e.what();
    }
    if (got != want || what != dspark_last_error()) {
        std::printf("  status %d (want %d): '%s' vs '%s'\n", got, want, dspark_last_error(), what.c_str());
        return false;
    }
    return true;
}

void prompt(dspark_stager* st, dspark::Stager& core, std::int64_t seq, std::int64_t len) {
    const std::vector<std::int64_t> pos = span(0, len);
    std::vector<std::int64_t> a(pos.size()), b(pos.size());
    CHECK_EQ(dspark_begin(st, seq), DSPARK_OK);
    CHECK_EQ(dspark_process_external(st, seq, pos.data(), pos.size(), a.data()), DSPARK_OK);
    core.begin(seq);
    core.process_external(seq, pos.data(), pos.size(), b.data());
}

}  // namespace

TEST_CASE(c_steps_equal_cpp_steps) {
    Handle h(config());
    dspark::Stager core(options());
    std::int64_t fields = 0, max_rows = 0;
    CHECK_EQ(dspark_step_layout(h.st, &fields, &max_rows), DSPARK_OK);
    CHECK_EQ(fields, dspark::device_step::FIELD_COUNT + B + 1);  // the fields, then the histogram
    CHECK_EQ(max_rows, W - B);
    // The step's constants: the core's, field by field (and the C struct's tail
    // past a smaller struct_size untouched, as for the other records).
    dspark_step_config cfg;
    dspark_step_config_init(&cfg);
    CHECK_EQ(dspark_step_config_get(h.st, &cfg), DSPARK_OK);
    const dspark::device_step::Config want = core.step_config();
    CHECK(cfg.block == want.block && cfg.window == want.window && cfg.w_keep == want.w_keep &&
          cfg.ring_rows == want.ring_rows && cfg.max_seqs == want.max_seqs && cfg.max_rows == want.max_rows &&
          cfg.trim_chunk == want.trim_chunk && cfg.max_position == want.max_position);
    CHECK(cfg.block == B && cfg.window == W && cfg.max_rows == W - B);
    dspark_step_config small;
    std::memset(&small, 0x5A, sizeof small);
    small.struct_size = static_cast<std::uint32_t>(offsetof(dspark_step_config, window));
    CHECK_EQ(dspark_step_config_get(h.st, &small), DSPARK_OK);
    CHECK(small.block == B && small.window == 0x5A5A5A5A5A5A5A5A);
    CHECK_EQ(dspark_step_config_get(h.st, nullptr), DSPARK_E_NULL_POINTER);
    const std::vector<std::int64_t> seqs = {3, 0, 1};
    for (std::int64_t q : seqs) prompt(h.st, core, q, 4 + q);
    std::int32_t on = 7;
    CHECK_EQ(dspark_on_device(h.st, 3, &on), DSPARK_OK);
    CHECK_EQ(on, 0);
    CHECK_EQ(dspark_to_device(h.st, seqs.data(), seqs.size()), DSPARK_OK);
    core.to_device(seqs.data(), seqs.size());
    CHECK_EQ(dspark_on_device(h.st, 3, &on), DSPARK_OK);
    CHECK_EQ(on, 1);
    CHECK_EQ(dspark_on_device(h.st, 3, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_on_device(h.st, 99, &on), DSPARK_E_INVALID_ARGUMENT);
    std::int64_t* state = nullptr;
    CHECK_EQ(dspark_step_state(h.st, &state), DSPARK_OK);
    CHECK(state != nullptr);
    std::mt19937_64 rng(7);
    for (int t = 0; t < 200; ++t) {
        std::vector<std::int64_t> counts;
        for (std::size_t i = 0; i < seqs.size(); ++i) counts.push_back(static_cast<std::int64_t>(rng() % (B + 2)) - 1);
        Answers x(seqs.size(), static_cast<std::size_t>(max_rows)), y(seqs.size(), static_cast<std::size_t>(max_rows));
        const dspark_step_out out = x.c();
        CHECK_EQ(dspark_step_many(h.st, seqs.data(), counts.data(), seqs.size(), &out), DSPARK_OK);
        core.step_many(seqs.data(), counts.data(), seqs.size(), y.cpp());
        CHECK(x == y);
        CHECK_EQ(dspark_check_step(h.st, seqs.data(), x.status.data(), seqs.size()), DSPARK_OK);
        // The CSR rows of the step: the C++ call's, and the padded rows concatenated.
        const std::size_t cap = seqs.size() + static_cast<std::size_t>(t % 3), mr = static_cast<std::size_t>(max_rows);
        std::vector<std::int64_t> offsets(cap + 1, -5), slots(cap * mr, -5), offsets_b(cap + 1, -5),
            slots_b(cap * mr, -5);
        std::vector<std::int32_t> pos(cap * mr, -5), pos_b(cap * mr, -5);
        CHECK_EQ(dspark_step_rows(h.st, seqs.data(), seqs.size(), &out, cap, offsets.data(), slots.data(), pos.data()),
                 DSPARK_OK);
        dspark::device_step::CsrRows rows;
        rows.row_offsets = offsets_b.data();
        rows.row_slots = slots_b.data();
        rows.row_positions = pos_b.data();
        core.step_rows(seqs.data(), seqs.size(), y.cpp(), cap, rows);
        CHECK(offsets == offsets_b && slots == slots_b && pos == pos_b);
        std::int64_t at = 0;
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            CHECK_EQ(offsets[i], at);
            const std::int64_t m = x.status[i] == DSPARK_STEP_OK ? x.n_rows[i] : 0;
            for (std::int64_t j = 0; j < m; ++j, ++at) {
                CHECK_EQ(slots[static_cast<std::size_t>(at)], x.row_slots[i * mr + static_cast<std::size_t>(j)]);
                CHECK_EQ(pos[static_cast<std::size_t>(at)], x.row_positions[i * mr + static_cast<std::size_t>(j)]);
            }
        }
        CHECK_EQ(offsets[cap], at);
        // Refusals: nothing written.
        std::vector<std::int64_t> untouched(cap + 1, -5);
        CHECK(same_error(
            [&] { return dspark_step_rows(h.st, seqs.data(), seqs.size(), &out, seqs.size() - 1, untouched.data(),
                                          nullptr, nullptr); },
            [&] {
                dspark::device_step::CsrRows r;
                r.row_offsets = untouched.data();
                core.step_rows(seqs.data(), seqs.size(), y.cpp(), seqs.size() - 1, r);
            },
            DSPARK_E_INVALID_ARGUMENT));
        CHECK(untouched == std::vector<std::int64_t>(cap + 1, -5));
        CHECK_EQ(dspark_step_rows(h.st, seqs.data(), seqs.size(), &out, cap, nullptr, nullptr, nullptr),
                 DSPARK_E_NULL_POINTER);
        CHECK_EQ(dspark_step_rows(h.st, seqs.data(), seqs.size(), nullptr, cap, untouched.data(), nullptr, nullptr),
                 DSPARK_E_NULL_POINTER);
        dspark_step_out no_plan = out;
        no_plan.n_rows = nullptr;
        CHECK_EQ(dspark_step_rows(h.st, seqs.data(), seqs.size(), &no_plan, cap, untouched.data(), nullptr, nullptr),
                 DSPARK_E_NULL_POINTER);
        CHECK_EQ(dspark_step_rows(h.st, seqs.data(), seqs.size(), &out, cap,
                                  reinterpret_cast<std::int64_t*>(reinterpret_cast<char*>(untouched.data()) + 1),
                                  nullptr, nullptr),
                 DSPARK_E_INVALID_ARGUMENT);
        CHECK(untouched == std::vector<std::int64_t>(cap + 1, -5));
    }
    const std::vector<std::int32_t> outcomes = {-1, DSPARK_FAIL_DECODE, -1};
    std::vector<std::int64_t> da(3, 9), db(3, 9);
    CHECK_EQ(dspark_to_host(h.st, seqs.data(), seqs.size(), outcomes.data(), da.data()), DSPARK_OK);
    core.to_host(seqs.data(), seqs.size(), outcomes.data(), db.data());
    CHECK(da == db);
    for (std::int64_t q : seqs) {
        CHECK_EQ(dspark_confirm(h.st, q), DSPARK_OK);
        core.confirm(q);
        CHECK(snap(h.st, q) == core.snapshot(q));
    }
}

TEST_CASE(c_refusals_are_the_cores) {
    Handle h(config());
    dspark::Stager core(options());
    prompt(h.st, core, 0, 6);
    const std::int64_t zero = 0, one = 1, bad_count = B + 1;
    // Sequence 1 holds no rows; 9 is unknown.
    CHECK(same_error([&] { return dspark_to_device(h.st, &one, 1); }, [&] { core.to_device(&one, 1); },
                     DSPARK_E_STATE));
    const std::int64_t unknown = 9;
    CHECK(same_error([&] { return dspark_to_device(h.st, &unknown, 1); }, [&] { core.to_device(&unknown, 1); },
                     DSPARK_E_INVALID_ARGUMENT));
    CHECK(same_error([&] { return dspark_to_host(h.st, &zero, 1, nullptr, nullptr); },
                     [&] { core.to_host(&zero, 1); }, DSPARK_E_STATE));
    CHECK_EQ(dspark_to_device(h.st, nullptr, 1), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_step_many(h.st, &zero, &zero, 1, nullptr), DSPARK_E_NULL_POINTER);
    const std::vector<std::uint8_t> before = snap(h.st, 0);
    CHECK_EQ(dspark_to_device(h.st, &zero, 1), DSPARK_OK);
    core.to_device(&zero, 1);
    // Host calls refuse a handed-over sequence with the core's message.
    CHECK(same_error([&] { return dspark_accept(h.st, 0, 0); }, [&] { core.accept(0, 0); }, DSPARK_E_STATE));
    std::size_t size = 0;
    CHECK(same_error([&] { return dspark_snapshot_size(h.st, 0, &size); }, [&] { (void)core.snapshot_size(0); },
                     DSPARK_E_STATE));
    // A bad count: a status word, raised by check_step and by to_host.
    Answers x(1, W - B), y(1, W - B);
    const dspark_step_out out = x.c();
    CHECK_EQ(dspark_step_many(h.st, &zero, &bad_count, 1, &out), DSPARK_OK);
    core.step_many(&zero, &bad_count, 1, y.cpp());
    CHECK(x == y);
    CHECK_EQ(x.status[0], DSPARK_STEP_BAD_COUNT);
    CHECK(same_error([&] { return dspark_check_step(h.st, &zero, x.status.data(), 1); },
                     [&] { core.check_step(&zero, y.status.data(), 1); }, DSPARK_E_INVALID_ARGUMENT));
    CHECK(same_error([&] { return dspark_to_host(h.st, &zero, 1, nullptr, nullptr); },
                     [&] { core.to_host(&zero, 1); }, DSPARK_E_INVALID_ARGUMENT));
    // Back on the host, unchanged by the faulted step.
    CHECK(snap(h.st, 0) == before);
}

// A chain drafter's Stager hands its ids over by slot: the _tokens forms
// equal the C++ calls (the table they write, the ids they bring back), the
// plain forms refuse it with the core's message (naming the _tokens forms), and a block drafter's
// Stager refuses a table.
TEST_CASE(c_chain_ids_travel_by_slot) {
    dspark_config cc = config();
    cc.kind = DSPARK_KIND_CHAIN;
    Handle h(cc);
    dspark::StagerOptions oc = options();
    oc.kind = dspark::DrafterKind::Chain;
    dspark::Stager core(oc);
    const std::int64_t seq = 2;
    const auto pos = span(0, 7);
    std::vector<std::int32_t> ids;
    for (std::int64_t p : pos) ids.push_back(static_cast<std::int32_t>(500 + p));
    std::vector<std::int64_t> a(pos.size()), b(pos.size());
    CHECK_EQ(dspark_begin(h.st, seq), DSPARK_OK);
    core.begin(seq);
    CHECK_EQ(dspark_process_external_tokens(h.st, seq, pos.data(), pos.size(), a.data(), ids.data()), DSPARK_OK);
    core.process_external(seq, pos.data(), pos.size(), b.data(), ids.data());
    const std::size_t n_tab = static_cast<std::size_t>(SEQS * core.ring_rows());
    std::vector<std::int32_t> tc(n_tab, 3), tp(n_tab, 3);
    CHECK(same_error([&] { return dspark_to_device(h.st, &seq, 1); }, [&] { core.to_device(&seq, 1); },
                     DSPARK_E_INVALID_ARGUMENT));
    // In words a C caller reads too: the C forms to call, not a Python argument.
    CHECK(std::string(dspark_last_error()).find("in C, the dspark_to_device_tokens / dspark_to_host_tokens forms") !=
          std::string::npos);
    CHECK(std::string(dspark_last_error()).find("kind=") == std::string::npos);
    CHECK(same_error([&] { return dspark_to_device_tokens(h.st, &seq, 1, tc.data(), n_tab - 1); },
                     [&] { core.to_device(&seq, 1, tp.data(), n_tab - 1); }, DSPARK_E_INVALID_ARGUMENT));
    CHECK_EQ(dspark_to_device_tokens(h.st, &seq, 1, nullptr, n_tab), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_to_device_tokens(h.st, &seq, 1, tc.data(), n_tab), DSPARK_OK);
    core.to_device(&seq, 1, tp.data(), n_tab);
    CHECK(tc == tp);
    for (std::size_t k = 0; k < pos.size(); ++k) CHECK_EQ(tc[static_cast<std::size_t>(a[k])], ids[k]);
    Answers x(1, W - B), y(1, W - B);
    const std::int64_t zero = 0;
    const dspark_step_out out = x.c();
    CHECK_EQ(dspark_step_many(h.st, &seq, &zero, 1, &out), DSPARK_OK);
    core.step_many(&seq, &zero, 1, y.cpp());
    CHECK(x == y);
    for (std::size_t k = 0; k <= static_cast<std::size_t>(B); ++k)  // the verify batch's ids at its slots
        tc[static_cast<std::size_t>(x.verify_slots[k])] = tp[static_cast<std::size_t>(y.verify_slots[k])] =
            static_cast<std::int32_t>(900 + k);
    CHECK(same_error([&] { return dspark_to_host(h.st, &seq, 1, nullptr, nullptr); }, [&] { core.to_host(&seq, 1); },
                     DSPARK_E_INVALID_ARGUMENT));
    CHECK_EQ(dspark_to_host_tokens(h.st, &seq, 1, nullptr, nullptr, tc.data(), n_tab), DSPARK_OK);
    core.to_host(&seq, 1, nullptr, nullptr, tp.data(), n_tab);
    CHECK_EQ(dspark_confirm(h.st, seq), DSPARK_OK);
    core.confirm(seq);
    CHECK(snap(h.st, seq) == core.snapshot(seq));
    std::vector<std::int32_t> got(pos.size() + B + 1), want(got.size());
    CHECK_EQ(dspark_tokens(h.st, seq, 0, static_cast<std::int64_t>(got.size()), got.data()), DSPARK_OK);
    core.tokens(seq, 0, static_cast<std::int64_t>(want.size()), want.data());
    CHECK(got == want);
    CHECK_EQ(got.back(), 900 + B);
    // A block drafter's Stager takes no table.
    Handle hb(config());
    dspark::Stager block(options());
    prompt(hb.st, block, 0, 4);
    const std::int64_t first = 0;
    CHECK(same_error([&] { return dspark_to_device_tokens(hb.st, &first, 1, tc.data(), n_tab); },
                     [&] { block.to_device(&first, 1, tp.data(), n_tab); }, DSPARK_E_INVALID_ARGUMENT));
}

TEST_MAIN()

// What a careless server hands the C ABI: a damaged step state is a sticky
// DSPARK_STEP_DAMAGED with nothing written (and to_host refuses it, end frees
// it), misaligned typed buffers are refused, and a NULL buffer's message
// counts its entries.
TEST_CASE(c_damaged_states_and_misaligned_buffers) {
    Handle h(config());
    dspark::Stager core(options());
    prompt(h.st, core, 0, 6);
    const std::int64_t zero = 0, one = 1;
    CHECK_EQ(dspark_to_device(h.st, nullptr, 2), DSPARK_E_NULL_POINTER);
    CHECK(std::string(dspark_last_error()) == "seqs is NULL but 2 entries were given");
    CHECK_EQ(dspark_to_device(h.st, &zero, 1), DSPARK_OK);
    std::int64_t fields = 0, max_rows = 0;
    CHECK_EQ(dspark_step_layout(h.st, &fields, &max_rows), DSPARK_OK);
    Answers x(1, static_cast<std::size_t>(max_rows));
    dspark_step_out out = x.c();
    // Misaligned: seqs, counts, an output.
    alignas(8) unsigned char raw[32] = {};
    const auto* odd = reinterpret_cast<const std::int64_t*>(raw + 1);
    CHECK_EQ(dspark_step_many(h.st, odd, &zero, 1, &out), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::string(dspark_last_error()).find("seqs is not aligned to 8 bytes") != std::string::npos);
    CHECK_EQ(dspark_step_many(h.st, &zero, odd, 1, &out), DSPARK_E_INVALID_ARGUMENT);
    out.start = reinterpret_cast<std::int64_t*>(raw + 4);
    CHECK_EQ(dspark_step_many(h.st, &zero, &zero, 1, &out), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::string(dspark_last_error()).find("out->start is not aligned") != std::string::npos);
    out = x.c();
    // A damaged state: the reported one (200,000 rows for a plan max_rows wide).
    std::int64_t* state = nullptr;
    CHECK_EQ(dspark_step_state(h.st, &state), DSPARK_OK);
    namespace step = dspark::device_step;
    state[step::F_end * SEQS + 0] = state[step::F_count * SEQS + 0] = 200000;
    state[step::F_pos_base * SEQS + 0] = 200000 - 1;
    CHECK_EQ(dspark_step_many(h.st, &zero, &zero, 1, &out), DSPARK_OK);
    CHECK_EQ(x.status[0], DSPARK_STEP_DAMAGED);
    CHECK_EQ(x.n_rows[0], 0);
    for (std::int64_t v : x.row_slots) CHECK_EQ(v, -1);
    CHECK_EQ(dspark_check_step(h.st, &zero, x.status.data(), 1), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::string(dspark_last_error()).find("the step state is damaged (a rule is broken)") !=
          std::string::npos);
    CHECK_EQ(dspark_to_host(h.st, &zero, 1, nullptr, nullptr), DSPARK_E_INVALID_ARGUMENT);
    std::int32_t on = 0;
    CHECK_EQ(dspark_on_device(h.st, 0, &on), DSPARK_OK);
    CHECK_EQ(on, 1);
    // end frees it; the slot serves the next request.
    CHECK_EQ(dspark_end(h.st, 0), DSPARK_OK);
    CHECK_EQ(dspark_on_device(h.st, 0, &on), DSPARK_OK);
    CHECK_EQ(on, 0);
    CHECK_EQ(dspark_step_many(h.st, &zero, &zero, 1, &out), DSPARK_OK);
    CHECK_EQ(x.status[0], DSPARK_STEP_NOT_ON_DEVICE);
    prompt(h.st, core, 0, 4);
    const std::int64_t both[] = {0, 1};
    prompt(h.st, core, 1, 4);
    CHECK_EQ(dspark_to_device(h.st, both, 2), DSPARK_OK);
    CHECK_EQ(dspark_end_many(h.st, both, 2), DSPARK_OK);
    CHECK_EQ(dspark_on_device(h.st, 1, &on), DSPARK_OK);
    CHECK_EQ(on, 0);
    (void)one;
}
