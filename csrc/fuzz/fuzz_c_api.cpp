// libFuzzer target over the C ABI (dspark/dspark.h): configurations with any
// struct_size and field values, then calls in any order (the batch calls,
// reservations and end among them) with NULL pointers,
// wrong byte counts, small buffers, bad codes and out-of-range values, in
// both row modes. Each well-formed call also runs on a C++ Stager built from
// the same configuration, which is the oracle: the same status as the C++
// outcome (ValueError-like -> DSPARK_E_INVALID_ARGUMENT, StateError ->
// DSPARK_E_STATE, ...), the same plans, rows, moves, slots, snapshots and
// states. (docs/c_api.md: "both APIs reject the same calls".)
//
// Findings (the process aborts, libFuzzer saves the input):
//  * a crash or sanitizer report, an exception escaping the C boundary;
//  * DSPARK_E_INTERNAL, or a status other than the documented one for a
//    malformed call (NULL pointer, short buffer, bad struct_size);
//  * a rejected call that changed a sequence (state and snapshot bytes), or
//    an output written by a call that failed;
//  * dspark_last_error() empty after a failure, or not empty after success;
//  * any difference from the C++ API on a well-formed call.
//
// Build: cmake -DDSPARK_FUZZ=ON with clang (csrc/fuzz/CMakeLists.txt).
// Run:   ./fuzz_c_api -max_total_time=60 CORPUS_DIR
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"
#include "fuzz_common.hpp"
#include "../tests/step_answers.hpp"

using namespace dspark;
using dspark_fuzz::Reader;

namespace {

constexpr std::int64_t MAXP = MAX_POSITION;

// The status the C ABI maps a C++ outcome to (c_api.cpp's guarded()).
template <class Fn>
dspark_status expect_of(Fn&& fn) {
    try {
        fn();
    } catch (const ConfigError&) {
        return DSPARK_E_CONFIG;
    } catch (const TypeError&) {
        return DSPARK_E_TYPE;
    } catch (const StateError&) {
        return DSPARK_E_STATE;
    } catch (const std::invalid_argument&) {
        return DSPARK_E_INVALID_ARGUMENT;
    }
    return DSPARK_OK;
}

// Every call leaves dspark_last_error() consistent with its status.
void check_status(dspark_status s) {
    const char* e = dspark_last_error();
    FUZZ_CHECK(e != nullptr);
    FUZZ_CHECK((s == DSPARK_OK) == (e[0] == '\0'));
    FUZZ_CHECK(s != DSPARK_E_INTERNAL);
    FUZZ_CHECK(std::strcmp(dspark_status_name(s), "DSPARK_E_UNKNOWN") != 0);
}

void check_same(dspark_status got, dspark_status want, const char* call) {
    check_status(got);
    if (got != want) {
        std::fprintf(stderr, "%s: C ABI %s (%s), C++ API %s\n", call, dspark_status_name(got), dspark_last_error(),
                     dspark_status_name(want));
        FUZZ_CHECK(got == want);
    }
}

std::int64_t pick(Reader& r, std::initializer_list<std::int64_t> values) {
    const std::uint8_t b = r.u8();
    return *(values.begin() + b % values.size());
}

struct Fixture {
    dspark_stager* st = nullptr;
    Stager* cpp = nullptr;  // the oracle, same configuration
    dspark_config c{};
    std::size_t rb = 0;
    std::int64_t ring = 0;
    bool external = false;
    std::vector<std::vector<std::uint8_t>> snaps;

    bool valid(std::int64_t s) const { return s >= 0 && s < c.max_seqs; }
    // The sequences the calls can name (seq_of yields ids below 14): what the checks after
    // each call look at, so a config with 65,536 sequences costs what one with 14 does.
    std::int64_t checked() const { return std::min<std::int64_t>(c.max_seqs, 14); }
    std::int64_t seq_of(std::uint8_t b) const {
        const int v = b % 16;
        if (v == 14) return -1;
        if (v == 15) return c.max_seqs + (b >> 4);
        return v % c.max_seqs;
    }
    std::int64_t end_of(std::int64_t s) const { return valid(s) ? cpp->state(s).end : 0; }

    // Every sequence as the C ABI reports it: state and snapshot bytes.
    std::vector<std::uint8_t> fingerprint() const {
        std::vector<std::uint8_t> out;
        for (std::int64_t s = 0; s < checked(); ++s) {
            dspark_state x;
            dspark_state_init(&x);
            FUZZ_CHECK(dspark_state_get(st, s, &x) == DSPARK_OK);
            out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&x),
                       reinterpret_cast<const std::uint8_t*>(&x) + sizeof x);
            dspark_stats t;
            dspark_stats_init(&t);
            FUZZ_CHECK(dspark_stats_get(st, s, &t) == DSPARK_OK);
            out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&t),
                       reinterpret_cast<const std::uint8_t*>(&t) + sizeof t);
            for (std::int64_t v : accepted_of(s))
                out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&v),
                           reinterpret_cast<const std::uint8_t*>(&v) + sizeof v);
            std::size_t n = 0;
            if (x.open_round || x.reservation_open) continue;
            FUZZ_CHECK(dspark_snapshot_size(st, s, &n) == DSPARK_OK);
            std::vector<std::uint8_t> snap(n);
            std::size_t w = 0;
            FUZZ_CHECK(dspark_snapshot(st, s, snap.data(), n, &w) == DSPARK_OK && w == n);
            out.insert(out.end(), snap.begin(), snap.end());
        }
        return out;
    }
    // The sequence's acceptance histogram through the C ABI.
    std::vector<std::int64_t> accepted_of(std::int64_t s) const {
        std::vector<std::int64_t> h(static_cast<std::size_t>(c.block_size) + 1, -1);
        FUZZ_CHECK(dspark_accepted_get(st, s, h.data(), h.size()) == DSPARK_OK);
        return h;
    }
    // The Stager's totals through the C ABI: the stats record's bytes and the histogram.
    std::vector<std::int64_t> totals_of() const {
        dspark_stats t;
        dspark_stats_init(&t);
        std::vector<std::int64_t> h(static_cast<std::size_t>(c.block_size) + 1, -1);
        std::int64_t started = -1;
        FUZZ_CHECK(dspark_totals_get(st, &t, h.data(), h.size(), &started) == DSPARK_OK);
        std::vector<std::int64_t> out = h;
#define DSPARK_PUSH_STAT(type, name) out.push_back(t.name);
        DSPARK_SEQ_STATS_FIELDS(DSPARK_PUSH_STAT)
#undef DSPARK_PUSH_STAT
        out.push_back(started);
        return out;
    }
    // The C ABI's and the C++ oracle's sequences agree.
    void check_twins() const {
        for (std::int64_t s = 0; s < checked(); ++s) {
            dspark_state x;
            dspark_state_init(&x);
            FUZZ_CHECK(dspark_state_get(st, s, &x) == DSPARK_OK);
            const SeqState y = cpp->state(s);
            FUZZ_CHECK(x.started == y.started && x.end == y.end && x.horizon == y.horizon && x.n_cache == y.n_cache &&
                       x.pos_base == y.pos_base && x.open_round == y.open_round && x.disabled == y.disabled &&
                       x.restage_owed == y.restage_owed && x.first_round == y.first_round &&
                       x.n_retained == y.n_retained && x.n_pending == y.n_pending &&
                       x.consecutive_failures == y.consecutive_failures && x.tentative_rows == y.tentative_rows &&
                       x.tree_nodes == y.tree_nodes);
            dspark_stats t;
            dspark_stats_init(&t);
            FUZZ_CHECK(dspark_stats_get(st, s, &t) == DSPARK_OK);
            const SeqStats u = cpp->stats(s);
            bool same = true;
#define DSPARK_SAME_STAT(type, name) same = same && t.name == u.name;
            DSPARK_SEQ_STATS_FIELDS(DSPARK_SAME_STAT)
#undef DSPARK_SAME_STAT
            FUZZ_CHECK(same);
            FUZZ_CHECK(accepted_of(s) == cpp->accepted(s));
            std::int64_t first[2], count[2];
            FUZZ_CHECK(dspark_live_slots(st, s, first, count) == DSPARK_OK);
            SlotRun runs[2];
            cpp->live_slots(s, runs);
            for (int k = 0; k < 2; ++k) FUZZ_CHECK(first[k] == runs[k].first && count[k] == runs[k].count);
            FUZZ_CHECK(x.reservation_open == y.reservation_open);
            if (!y.open_round && !y.reservation_open) {
                std::size_t n = 0, w = 0;
                FUZZ_CHECK(dspark_snapshot_size(st, s, &n) == DSPARK_OK);
                std::vector<std::uint8_t> snap(n);
                FUZZ_CHECK(dspark_snapshot(st, s, snap.data(), n, &w) == DSPARK_OK);
                FUZZ_CHECK(snap == cpp->snapshot(s));
            }
        }
    }
};

// -- configuration -----------------------------------------------------------

struct SizedConfig {
    dspark_config c;
    std::uint8_t tail[16];  // fields a later version might append
};

// Reads a configuration from the input, creates it through the C ABI and
// checks the status against what the C++ constructor and the C layer's own
// rules say. Returns true with fx.st / fx.cpp set when it was created.
bool create(Reader& r, Fixture& fx, Stager*& cpp_holder) {
    SizedConfig sc;
    std::memset(&sc, 0, sizeof sc);
    dspark_config& c = sc.c;
    dspark_config_init(&c);
    const std::uint8_t b0 = r.u8(), b1 = r.u8(), b2 = r.u8(), b3 = r.u8(), b4 = r.u8(), b5 = r.u8();
    c.storage = b0 % 16 < 14 ? (b0 >> 4) % 5 : static_cast<std::int32_t>(b0 % 16) - 20;  // mostly valid codes
    const bool q = c.storage == DSPARK_STORAGE_Q8_0 || c.storage == DSPARK_STORAGE_Q4_0;
    static const std::int64_t dims[8] = {32, 64, 32, 64, 1, 7, 0, -32};
    c.feature_dim = dims[q ? b0 % 4 + (b0 % 32 == 31 ? 4 : 0) : b0 % 8];
    c.block_size = b1 % 32 == 31 ? -1 : 1 + b1 % 8;
    c.window = b2 >= 250 ? 2 * c.block_size - (b2 - 250) : 2 * c.block_size + 1 + b2 % 40;
    c.max_seqs = b3 % 32 == 31 ? pick(r, {0, -1, 65536, 65537}) : 1 + b3 % 3;
    c.max_failures = 1 + (b3 >> 5) % 3;
    c.nonfinite = b4 % 16 == 15 ? 4 : b4 % 4;
    c.stage_dtype = b4 % 32 == 30 ? 3 : (b4 >> 2) % 3;
    c.strict = b4 >= 224 ? (b4 == 255 ? 2 : 1) : 0;
    c.rows_mode = b5 % 2;
    if (b5 % 64 == 63) c.rows_mode = 2;
    c.kind = (b5 >> 1) % 4 == 3 ? DSPARK_KIND_CHAIN : DSPARK_KIND_BLOCK;  // a chain stager: every process carries ids
    if (b5 >= 250) c.kind = b5 == 255 ? -1 : 2;
    // struct_size: as compiled (most), too small, or longer with a zero / non-zero tail.
    const std::uint8_t sz = r.u8();
    dspark_status want_layer = DSPARK_OK;  // what read_config says before any value check
    switch (sz % 16) {
        case 13: c.struct_size = static_cast<std::uint32_t>(offsetof(dspark_config, kind) - 8); want_layer = DSPARK_E_INVALID_ARGUMENT; break;
        case 12: c.struct_size = static_cast<std::uint32_t>(offsetof(dspark_config, kind)); c.kind = DSPARK_KIND_BLOCK; break;  // the first version: kind defaults
        case 14: c.struct_size = static_cast<std::uint32_t>(sizeof(dspark_config) + 8); if (sz & 0x80) { sc.tail[3] = 1; want_layer = DSPARK_E_UNSUPPORTED; } break;
        case 15: c.struct_size = sz >> 4; want_layer = DSPARK_E_INVALID_ARGUMENT; break;
        default: break;
    }
    dspark_stager* st = reinterpret_cast<dspark_stager*>(std::uintptr_t(1));  // must be overwritten (NULL on failure)
    const std::uint8_t nul = r.u8();
    if (nul == 0xfe) {
        check_same(dspark_stager_create(nullptr, &st), DSPARK_E_NULL_POINTER, "create(NULL config)");
        FUZZ_CHECK(st == nullptr);
        return false;
    }
    if (nul == 0xff) {
        check_same(dspark_stager_create(&c, nullptr), DSPARK_E_NULL_POINTER, "create(NULL out)");
        return false;
    }
    const dspark_status s = dspark_stager_create(&c, &st);
    check_status(s);
    dspark_status want = want_layer;
    StagerOptions o;
    if (want == DSPARK_OK) {
        // The C layer's own rules (c_api.cpp), then the core's constructor.
        if (c.rows_mode != DSPARK_ROWS_HELD && c.rows_mode != DSPARK_ROWS_EXTERNAL) want = DSPARK_E_CONFIG;
        else if (c.max_seqs > 65536) want = DSPARK_E_CONFIG;
        else if (c.storage < 0 || c.storage > 4 || c.nonfinite < 0 || c.nonfinite > 3) want = DSPARK_E_CONFIG;
        else if (c.stage_dtype < 0 || c.stage_dtype > 2 || (c.strict != 0 && c.strict != 1)) want = DSPARK_E_CONFIG;
        else if (c.kind != DSPARK_KIND_BLOCK && c.kind != DSPARK_KIND_CHAIN) want = DSPARK_E_CONFIG;
        else {
            o.feature_dim = c.feature_dim;
            o.block_size = c.block_size;
            o.window = c.window;
            o.max_seqs = c.max_seqs;
            o.storage = static_cast<Storage>(c.storage);
            o.max_failures = c.max_failures;
            o.nonfinite = static_cast<NonFinite>(c.nonfinite);
            o.stage = static_cast<ElemType>(c.stage_dtype);
            o.rows = c.rows_mode ? RowMode::External : RowMode::Held;
            o.strict = c.strict == 1;  // strict mode is the core's: the oracle has it too
            o.kind = c.kind == DSPARK_KIND_CHAIN ? DrafterKind::Chain : DrafterKind::Block;
            want = expect_of([&] { cpp_holder = new Stager(o); });
        }
    }
    if (s != want) {
        std::fprintf(stderr, "create: C ABI %s (%s), expected %s\n", dspark_status_name(s), dspark_last_error(),
                     dspark_status_name(want));
        FUZZ_CHECK(s == want);
    }
    if (s != DSPARK_OK) {
        FUZZ_CHECK(st == nullptr);
        return false;
    }
    FUZZ_CHECK(st != nullptr && cpp_holder != nullptr);
    fx.st = st;
    fx.cpp = cpp_holder;
    // The effective config comes back whole (struct_size as the caller's).
    dspark_config back;
    dspark_config_init(&back);
    FUZZ_CHECK(dspark_stager_config(st, &back) == DSPARK_OK);
    FUZZ_CHECK(back.feature_dim == c.feature_dim && back.block_size == c.block_size && back.window == c.window &&
               back.max_seqs == c.max_seqs && back.storage == c.storage && back.nonfinite == c.nonfinite &&
               back.stage_dtype == c.stage_dtype && back.strict == c.strict && back.rows_mode == c.rows_mode &&
               back.kind == c.kind);
    dspark_config small;
    std::memset(&small, 0xab, sizeof small);
    small.struct_size = 12;  // only the first 12 bytes may be written
    FUZZ_CHECK(dspark_stager_config(st, &small) == DSPARK_OK && small.struct_size == 12);
    FUZZ_CHECK(reinterpret_cast<const std::uint8_t*>(&small)[12] == 0xab);
    small.struct_size = 2;
    check_same(dspark_stager_config(st, &small), DSPARK_E_INVALID_ARGUMENT, "stager_config(struct_size 2)");
    fx.c = back;
    FUZZ_CHECK(dspark_stager_row_bytes(st, &fx.rb) == DSPARK_OK && fx.rb == fx.cpp->row_bytes());
    FUZZ_CHECK(dspark_ring_rows(st, &fx.ring) == DSPARK_OK && fx.ring == fx.cpp->ring_rows());
    std::int64_t mpr = 0;
    FUZZ_CHECK(dspark_stager_max_plan_rows(st, &mpr) == DSPARK_OK && mpr == c.window - c.block_size);
    fx.external = c.rows_mode == DSPARK_ROWS_EXTERNAL;
    return true;
}

// -- rows ----------------------------------------------------------------------

std::vector<float> rows_of(std::size_t n, std::size_t dim, std::uint8_t seed, std::uint8_t special) {
    std::vector<float> x(n * dim);
    std::uint32_t h = 0x9E3779B1u * (seed + 1u);
    for (std::size_t i = 0; i < x.size(); ++i) {
        h ^= h << 13, h ^= h >> 17, h ^= h << 5;
        x[i] = (static_cast<float>(h >> 8) / 16777216.0f - 0.5f) * 4.0f;
        if (i % dim == 3 % dim) x[i] *= 1e3f * static_cast<float>(1 + seed % 90);  // a massive channel
    }
    if (special % 8 == 7 && !x.empty()) {
        const float sv[3] = {NAN, INFINITY, 1e30f};
        x[(special >> 3) % x.size()] = sv[(special >> 3) % 3];
    }
    return x;
}

std::vector<std::int64_t> positions(const Fixture& fx, std::int64_t seq, std::size_t n, std::uint8_t mode) {
    const std::int64_t end = fx.end_of(seq);
    std::int64_t p0 = end;
    switch (mode % 12) {
        case 8: p0 = end + 1; break;
        case 9: p0 = end - 1; break;
        case 10: p0 = -1; break;
        case 11: p0 = MAXP - 2 - static_cast<std::int64_t>(n); break;
        default: break;
    }
    std::vector<std::int64_t> p(n);
    for (std::size_t i = 0; i < n; ++i) p[i] = p0 + static_cast<std::int64_t>(i);
    return p;
}

std::int64_t n_past_of(const Fixture& fx, std::int64_t seq, std::uint8_t mode) {
    const std::int64_t end = fx.end_of(seq);
    switch (mode % 12) {
        case 8: return end + 1;
        case 9: return end - 1;
        case 10: return -1;
        case 11: return MAXP;
        default: return end;
    }
}

// -- calls ---------------------------------------------------------------------

// A malformed call (one defect): the defect's status when the sequence is
// ready, else the sequence's own error or the defect's (either check may come
// first); never OK; nothing changed.
void malformed(Fixture& fx, std::int64_t seq, dspark_status defect, const std::function<dspark_status()>& call,
               bool needs_open = false) {
    const dspark_status seq_err = expect_of([&] { needs_open ? fx.cpp->check_open(seq) : fx.cpp->check_ready(seq); });
    const auto before = fx.fingerprint();
    const dspark_status s = call();
    check_status(s);
    const bool ok = seq_err == DSPARK_OK ? s == defect : (s == defect || s == seq_err);
    if (!ok) {
        std::fprintf(stderr, "malformed call: %s (%s), expected %s (sequence check: %s)\n", dspark_status_name(s),
                     dspark_last_error(), dspark_status_name(defect), dspark_status_name(seq_err));
        FUZZ_CHECK(ok);
    }
    FUZZ_CHECK(fx.fingerprint() == before);
}

// A chain stager's ids of the sequence's stageable rows: the same through both APIs
// (a block stager's, and an unknown sequence's: the same error).
void check_tokens(Fixture& fx, std::int64_t seq) {
    std::int64_t lo = 0, hi = 0;
    if (seq >= 0 && seq < fx.c.max_seqs) {
        const SeqState st = fx.cpp->state(seq);
        lo = st.started ? st.horizon : 0;
        hi = st.started ? st.end : 0;
    }
    std::vector<std::int32_t> got(static_cast<std::size_t>(hi - lo) + 1, -7), want(got.size(), -7);
    check_same(dspark_tokens(fx.st, seq, lo, hi, got.data()),
               expect_of([&] { fx.cpp->tokens(seq, lo, hi, want.data()); }), "tokens");
    FUZZ_CHECK(got == want);
}

// Token ids of n rows drawn from a byte (the calls that append rows but op_process): a chain
// stager's, mostly valid, now and then one negative (tok % 8 == 7) or none at all (tok % 16 ==
// 15), both refused with nothing changed; a block stager's none, now and then some (tok % 32 ==
// 31), refused. Through both APIs the same pointer, so the core's checks are compared.
struct Ids {
    std::vector<std::int32_t> v;
    const std::int32_t* p = nullptr;
};

Ids ids_of(const Fixture& fx, std::size_t n, std::uint8_t seed, std::uint8_t tok) {
    Ids out;
    out.v.resize(n + 1);  // never empty: a pointer even for no rows
    for (std::size_t i = 0; i < n; ++i) out.v[i] = static_cast<std::int32_t>((seed * 131u + i * 7u + 11u) % 50000u);
    if (fx.c.kind == DSPARK_KIND_CHAIN) {
        if (tok % 16 == 15) return out;
        if (n && tok % 8 == 7) out.v[(tok >> 4) % n] = -1 - (tok >> 7);
        out.p = out.v.data();
    } else if (tok % 32 == 31) {
        out.p = out.v.data();
    }
    return out;
}

// The rows a round appends: a chain stager's with valid ids, a block stager's without.
const std::int32_t* round_ids(const Fixture& fx, Ids& ids) {
    return fx.c.kind == DSPARK_KIND_CHAIN ? ids.v.data() : nullptr;
}

void op_process(Reader& r, Fixture& fx, std::int64_t seq) {
    const std::size_t n = r.u8() % 10;
    const std::uint8_t pmode = r.u8(), tmode = r.u8(), seed = r.u8(), special = r.u8(), bad = r.u8();
    const auto pos = positions(fx, seq, n, pmode);
    const std::size_t D = static_cast<std::size_t>(fx.c.feature_dim);
    const auto x = rows_of(n, D, seed, special);
    const std::int32_t dtype = tmode % 3;
    std::vector<std::uint8_t> in(n * D * elem_bytes(static_cast<ElemType>(dtype)));
    if (!in.empty() && dtype == DSPARK_DTYPE_F32) std::memcpy(in.data(), x.data(), in.size());
    else if (!in.empty())
        encode_rows(x.data(), ElemType::F32, in.data(), static_cast<Storage>(dtype), n, D, NonFinite::Clamp);
    std::vector<std::uint8_t> enc(n * fx.rb);  // storage bytes for process_encoded
    if (n) encode_rows(x.data(), ElemType::F32, enc.data(), static_cast<Storage>(fx.c.storage), n, D,
                       static_cast<NonFinite>(fx.c.nonfinite));
    // Token ids: a chain stager's (mostly valid, sometimes a negative one or none), and now and
    // then a block stager's (refused): the core's checks, through both APIs.
    std::vector<std::int32_t> ids(n);
    for (std::size_t i = 0; i < n; ++i) ids[i] = static_cast<std::int32_t>((seed * 131u + i * 7u) % 50000u);
    if (n && special % 8 == 7) ids[special / 8 % n] = -1 - special / 64;
    const bool chain = fx.c.kind == DSPARK_KIND_CHAIN;
    const std::int32_t* tp = (chain ? special % 16 != 15 : special % 32 == 31) ? ids.data() : nullptr;
    if (fx.external) {
        std::vector<std::int64_t> slots(n, -7), want(n, -7);
        if (bad % 8 == 7 && n) {
            malformed(fx, seq, DSPARK_E_NULL_POINTER,
                      [&] { return dspark_process_external(fx.st, seq, pos.data(), n, nullptr); });
            return;
        }
        if (bad % 8 == 6) {  // rows to an external stager: the mode is named
            malformed(fx, seq, DSPARK_E_INVALID_ARGUMENT,
                      [&] { return dspark_process(fx.st, seq, pos.data(), n, in.data(), dtype, in.size()); });
            return;
        }
        check_same(dspark_process_external_tokens(fx.st, seq, pos.data(), n, slots.data(), tp),
                   expect_of([&] { fx.cpp->process_external(seq, pos.data(), n, want.data(), tp); }), "process_external");
        FUZZ_CHECK(slots == want);  // the same slots, written on success only
        check_tokens(fx, seq);
        return;
    }
    switch (bad % 16) {
        case 10: malformed(fx, seq, DSPARK_E_INVALID_ARGUMENT,
                           [&] { return dspark_process(fx.st, seq, pos.data(), n, in.data(), dtype, in.size() + 1); });
            return;
        case 11: malformed(fx, seq, DSPARK_E_TYPE,
                           [&] { return dspark_process(fx.st, seq, pos.data(), n, in.data(), 3 + bad / 16, in.size()); });
            return;
        case 12: if (n) malformed(fx, seq, DSPARK_E_NULL_POINTER,
                                  [&] { return dspark_process(fx.st, seq, nullptr, n, in.data(), dtype, in.size()); });
            return;
        case 13: if (n) malformed(fx, seq, DSPARK_E_NULL_POINTER,
                                  [&] { return dspark_process(fx.st, seq, pos.data(), n, nullptr, dtype, in.size()); });
            return;
        case 14: {  // encoded rows: through the C ABI and the C++ API
            const std::size_t nbytes = enc.size() - (bad & 0x80 && !enc.empty() ? 1 : 0);
            check_same(dspark_process_encoded_tokens(fx.st, seq, pos.data(), n, enc.empty() ? nullptr : enc.data(),
                                                     nbytes, tp),
                       expect_of([&] { fx.cpp->process_encoded(seq, pos.data(), n, enc.data(), nbytes, tp); }),
                       "process_encoded");
            check_tokens(fx, seq);
            return;
        }
        case 15: {  // slots of a held stager: the mode is named
            std::vector<std::int64_t> slots(n);
            malformed(fx, seq, DSPARK_E_INVALID_ARGUMENT,
                      [&] { return dspark_process_external(fx.st, seq, pos.data(), n, slots.data()); });
            return;
        }
        default: break;
    }
    check_same(dspark_process_tokens(fx.st, seq, pos.data(), n, in.empty() ? nullptr : in.data(), dtype, in.size(), tp),
               expect_of([&] { fx.cpp->process(seq, pos.data(), n, in.data(), static_cast<ElemType>(dtype), tp); }),
               "process");
    check_tokens(fx, seq);
}

// The C++ oracle's rows of a plan in `dtype` (DSPARK_DTYPE_STORAGE: as stored).
std::vector<std::uint8_t> as_dtype(const Fixture& fx, const ByteVec& stored, std::int64_t n_rows, std::int32_t dtype) {
    if (dtype == DSPARK_DTYPE_STORAGE) return std::vector<std::uint8_t>(stored.begin(), stored.end());
    const std::size_t D = static_cast<std::size_t>(fx.c.feature_dim);
    std::vector<std::uint8_t> out(static_cast<std::size_t>(n_rows) * D * elem_bytes(static_cast<ElemType>(dtype)));
    if (n_rows) decode_rows(stored.data(), static_cast<Storage>(fx.c.storage), out.data(), static_cast<ElemType>(dtype),
                            static_cast<std::size_t>(n_rows), D);
    return out;
}

bool same_plan(const dspark_plan& a, const RoundPlan& b) {
    return a.seq == b.seq && a.start == b.start && a.pos_base == b.pos_base && a.first_row == b.first_row &&
           a.n_rows == b.n_rows && a.crop_from == b.crop_from && a.skip == static_cast<std::int32_t>(b.skip) &&
           a.rebase == b.rebase && a.clear_cache == b.clear_cache && a.slot_first[0] == b.slot_runs[0].first &&
           a.slot_count[0] == b.slot_runs[0].count && a.slot_first[1] == b.slot_runs[1].first &&
           a.slot_count[1] == b.slot_runs[1].count && a.round == b.round && a.reserved[0] == 0;
}

// The C++ draft: the same outcome the C ABI promises (strict mode included:
// the core's, after every argument check).
dspark_status oracle_draft(Fixture& fx, std::int64_t seq, std::int64_t n_past, RoundPlan& p, ByteVec& rows) {
    return expect_of([&] { p = fx.cpp->draft(seq, n_past, rows); });
}

// dspark_draft_view: the C++ copying draft's plan, and its rows in the runs,
// split as the plan's slots are (held); the C++ draft_view's refusal (external).
void op_draft_view(Fixture& fx, std::int64_t seq, std::int64_t n_past) {
    dspark_plan plan;
    std::memset(&plan, 0x5a, sizeof plan);
    const void* data[2] = {nullptr, nullptr};
    std::size_t run_rows[2] = {7, 7};
    const auto before = fx.fingerprint();
    const dspark_status s = dspark_draft_view(fx.st, seq, n_past, &plan, data, run_rows);
    check_status(s);
    RoundPlan p;
    ByteVec rows;
    RowView view;
    const dspark_status want = fx.external ? expect_of([&] { p = fx.cpp->draft_view(seq, n_past, view); })
                                           : oracle_draft(fx, seq, n_past, p, rows);
    check_same(s, want, "draft_view");
    if (s != DSPARK_OK) {
        FUZZ_CHECK(fx.fingerprint() == before);
        return;
    }
    FUZZ_CHECK(!fx.external && same_plan(plan, p));
    FUZZ_CHECK(static_cast<std::int64_t>(run_rows[0]) == p.slot_runs[0].count &&
               static_cast<std::int64_t>(run_rows[1]) == p.slot_runs[1].count);
    std::vector<std::uint8_t> got;
    for (int k = 0; k < 2; ++k) {
        const auto* run = static_cast<const std::uint8_t*>(data[k]);
        if (run_rows[k]) got.insert(got.end(), run, run + run_rows[k] * fx.rb);
    }
    FUZZ_CHECK(got.size() == rows.size() && std::equal(got.begin(), got.end(), rows.begin()));
}

void op_draft(Reader& r, Fixture& fx, std::int64_t seq) {
    const std::uint8_t mode = r.u8(), dt = r.u8(), cap = r.u8();
    const std::int64_t n_past = n_past_of(fx, seq, mode);
    const std::int32_t dtype = dt % 8 == 7 ? 5 : static_cast<std::int32_t>(dt % 4) - 1;  // STORAGE, F32, F16, BF16, bad
    // dspark_draft_size first: what it says is what a draft needs now.
    std::size_t size = 7;
    const dspark_status zs = dspark_draft_size(fx.st, seq, n_past, dtype, &size);
    check_status(zs);
    const std::size_t row = fx.external ? 0 : dtype == 5 ? 0 : dtype == DSPARK_DTYPE_STORAGE ? fx.rb
                          : static_cast<std::size_t>(fx.c.feature_dim) * elem_bytes(static_cast<ElemType>(dtype));
    std::vector<std::uint8_t> buf(cap % 4 == 3 ? 0 : (zs == DSPARK_OK ? size : 0) + (cap % 4 == 2 ? 64 : 0), 0xcd);
    if (cap % 4 == 1 && !buf.empty()) buf.pop_back();  // one byte short
    dspark_plan plan;
    std::memset(&plan, 0x5a, sizeof plan);
    std::size_t written = 12345;
    if (cap == 0xff) {  // no plan: NULL_POINTER, nothing changed
        malformed(fx, seq, DSPARK_E_NULL_POINTER, [&] {
            return dspark_draft(fx.st, seq, n_past, dtype, buf.data(), buf.size(), nullptr, &written);
        });
        return;
    }
    if ((cap & 0xf0) == 0xa0) {
        op_draft_view(fx, seq, n_past);
        return;
    }
    const auto before = fx.fingerprint();
    const dspark_status s = dspark_draft(fx.st, seq, n_past, dtype, buf.empty() ? nullptr : buf.data(), buf.size(),
                                         &plan, &written);
    check_status(s);
    if (!fx.external && dtype == 5) {  // an unknown dtype is a TypeError, whatever else is wrong
        FUZZ_CHECK(s == DSPARK_E_TYPE || s == expect_of([&] { fx.cpp->check_ready(seq); }));
        FUZZ_CHECK(zs == DSPARK_E_TYPE || zs != DSPARK_OK);
        FUZZ_CHECK(fx.fingerprint() == before);
        return;
    }
    RoundPlan p;
    ByteVec rows;
    if (s == DSPARK_E_BUFFER_TOO_SMALL) {  // nothing changed; the size needed is the plan's
        FUZZ_CHECK(fx.fingerprint() == before);
        const RoundPlan peek = fx.cpp->peek(seq, n_past);
        FUZZ_CHECK(written == static_cast<std::size_t>(peek.n_rows) * row && written > buf.size());
        FUZZ_CHECK(zs == DSPARK_OK && size == written);
        return;
    }
    const dspark_status want = oracle_draft(fx, seq, n_past, p, rows);
    check_same(s, want, "draft");
    if (s != DSPARK_OK) {
        FUZZ_CHECK(fx.fingerprint() == before);
        return;
    }
    FUZZ_CHECK(same_plan(plan, p));
    FUZZ_CHECK(plan.rows_mode == (fx.external ? DSPARK_ROWS_EXTERNAL : DSPARK_ROWS_HELD));
    const auto want_rows = fx.external ? std::vector<std::uint8_t>() : as_dtype(fx, rows, p.n_rows, dtype);
    FUZZ_CHECK(written == want_rows.size() && (want_rows.empty() || std::memcmp(buf.data(), want_rows.data(), written) == 0));
    FUZZ_CHECK(zs == DSPARK_OK && size == written);
}

void op_draft_many(Reader& r, Fixture& fx) {
    const std::size_t k = r.u8() % 5;
    const std::uint8_t mode = r.u8(), dt = r.u8();
    std::vector<std::int64_t> seqs(k), pasts(k);
    for (std::size_t i = 0; i < k; ++i) {
        seqs[i] = fx.seq_of(r.u8());
        pasts[i] = n_past_of(fx, seqs[i], mode);
    }
    const std::int32_t dtype = static_cast<std::int32_t>(dt % 4) - 1;
    std::vector<dspark_plan> plans(k);
    const std::size_t cap = static_cast<std::size_t>(std::max<std::int64_t>(0, fx.c.window)) * 4 *
                            static_cast<std::size_t>(fx.c.feature_dim) * 4 + 64;
    std::vector<std::uint8_t> buf(cap);
    std::size_t written = 0;
    const auto before = fx.fingerprint();
    // dt's high bit: dspark_draft_many_view, whose runs laid end to end are
    // the storage rows a copying draft_many stages (held mode).
    const bool view = dt & 0x80;
    std::vector<const void*> run_data(2 * k, nullptr);
    std::vector<std::size_t> run_rows(2 * k, 7);
    const dspark_status s =
        view ? dspark_draft_many_view(fx.st, seqs.data(), pasts.data(), k, plans.data(), run_data.data(),
                                      run_rows.data())
             : dspark_draft_many(fx.st, seqs.data(), pasts.data(), k, dtype, buf.data(), buf.size(), plans.data(),
                                 &written);
    check_status(s);
    // The oracle: C++ draft_many (strict mode included: the core's, after
    // every argument check: an unknown or busy sequence, a repeated id, an
    // n_past out of range); the views' refusal in external mode.
    std::vector<RoundPlan> out;
    ByteVec rows;
    std::vector<RowView> views;
    const dspark_status want = expect_of([&] {
        if (view && fx.external)
            fx.cpp->draft_many_view(seqs.data(), pasts.data(), k, out, views);
        else
            fx.cpp->draft_many(seqs.data(), pasts.data(), k, out, rows);
    });
    check_same(s, want, view ? "draft_many_view" : "draft_many");
    if (s != DSPARK_OK) {
        FUZZ_CHECK(fx.fingerprint() == before);
        return;
    }
    FUZZ_CHECK(out.size() == k);
    std::int64_t n_rows = 0;
    for (std::size_t i = 0; i < k; ++i) {
        FUZZ_CHECK(same_plan(plans[i], out[i]));
        n_rows += out[i].n_rows;
    }
    if (view) {
        FUZZ_CHECK(!fx.external);
        std::vector<std::uint8_t> got;
        for (std::size_t i = 0; i < 2 * k; ++i) {
            FUZZ_CHECK(static_cast<std::int64_t>(run_rows[i]) == out[i / 2].slot_runs[i % 2].count);
            FUZZ_CHECK((run_rows[i] == 0) == (run_data[i] == nullptr));
            const auto* run = static_cast<const std::uint8_t*>(run_data[i]);
            if (run_rows[i]) got.insert(got.end(), run, run + run_rows[i] * fx.rb);
        }
        FUZZ_CHECK(got.size() == rows.size() && std::equal(got.begin(), got.end(), rows.begin()));
        return;
    }
    const auto want_rows = fx.external ? std::vector<std::uint8_t>() : as_dtype(fx, rows, n_rows, dtype);
    FUZZ_CHECK(written == want_rows.size() && (want_rows.empty() || std::memcmp(buf.data(), want_rows.data(), written) == 0));
}

void check_moves(const std::vector<SlotMove>& want) {
    const dspark_slot_move* m = reinterpret_cast<const dspark_slot_move*>(std::uintptr_t(8));
    std::size_t n = 99;
    FUZZ_CHECK(dspark_last_moves(&m, &n) == DSPARK_OK);
    FUZZ_CHECK(n == want.size());
    for (std::size_t i = 0; i < n; ++i)
        FUZZ_CHECK(m[i].src == want[i].src && m[i].dst == want[i].dst && m[i].count == want[i].count);
    if (n == 0) FUZZ_CHECK(m == nullptr);
}

void op_restore(Reader& r, Fixture& fx, std::int64_t seq) {
    const std::uint8_t which = r.u8(), damage = r.u8(), at = r.u8();
    std::vector<std::uint8_t> data;
    if (!fx.snaps.empty()) data = fx.snaps[which % fx.snaps.size()];
    switch (damage % 8) {
        case 1: if (!data.empty()) data[at % data.size()] ^= static_cast<std::uint8_t>(1u << (damage >> 5)); break;
        case 2: if (!data.empty()) data.pop_back(); break;
        case 3: data.resize(at % 120); if (damage & 0x80) dspark_fuzz::fix_crc(data); break;
        case 4: if (data.size() >= 96) { data[32 + at % 48] ^= 1; dspark_fuzz::fix_crc(data); } break;
        default: break;
    }
    if (damage % 16 == 15 && !data.empty()) {  // NULL data with a byte count
        malformed(fx, seq, DSPARK_E_NULL_POINTER, [&] { return dspark_restore(fx.st, seq, nullptr, data.size()); });
    } else {
        SlotRun runs[2];
        const dspark_status want = expect_of([&] { fx.cpp->restore(seq, data.data(), data.size(), runs); });
        check_same(dspark_restore(fx.st, seq, data.empty() ? nullptr : data.data(), data.size()), want, "restore");
        std::int64_t first[2], count[2];
        FUZZ_CHECK(dspark_last_restore_runs(first, count) == DSPARK_OK);
        for (int k = 0; k < 2; ++k) {
            const SlotRun w = want == DSPARK_OK ? runs[k] : SlotRun{};
            FUZZ_CHECK(first[k] == w.first && count[k] == w.count);
        }
    }
    check_same(dspark_last_restore_runs(nullptr, nullptr), DSPARK_E_NULL_POINTER, "last_restore_runs(NULL)");
}

void op_snapshot(Reader& r, Fixture& fx, std::int64_t seq) {
    const std::uint8_t cap = r.u8();
    std::size_t size = 0;
    const dspark_status zs = dspark_snapshot_size(fx.st, seq, &size);
    check_same(zs, expect_of([&] { (void)fx.cpp->snapshot_size(seq); }), "snapshot_size");
    if (zs != DSPARK_OK) return;
    std::vector<std::uint8_t> out(cap % 4 == 1 && size ? size - 1 : size + (cap % 4 == 2 ? 16 : 0), 0xee);
    std::size_t written = 0;
    const dspark_status s = dspark_snapshot(fx.st, seq, out.data(), out.size(), &written);
    check_status(s);
    if (cap % 4 == 1) {
        FUZZ_CHECK(s == DSPARK_E_BUFFER_TOO_SMALL && written == size);
        return;
    }
    FUZZ_CHECK(s == DSPARK_OK && written == size);
    out.resize(size);
    FUZZ_CHECK(out == fx.cpp->snapshot(seq));
    fx.snaps.push_back(out);
    if (fx.snaps.size() > 6) fx.snaps.erase(fx.snaps.begin());
}

// The row-format calls (no stager): the C++ conversions are the oracle.
void op_formats(Reader& r) {
    const std::uint8_t a = r.u8(), b = r.u8(), c = r.u8(), d = r.u8();
    const std::int32_t storage = a % 8 < 5 ? a % 8 : static_cast<std::int32_t>(a % 8) + 2;
    const std::int32_t dtype = b % 4 < 3 ? b % 4 : 7;
    const std::int32_t policy = c % 5;
    const std::size_t dim = (storage == 3 || storage == 4) && d % 4 ? 32 * (d % 4) : 1 + d % 40;
    const std::size_t n = c % 4;
    std::size_t rb = 0;
    const dspark_status rs = dspark_row_bytes(storage, dim, &rb);
    check_same(rs, expect_of([&] { if (storage > 4) throw TypeError("storage"); (void)row_bytes(static_cast<Storage>(storage), dim); }),
               "row_bytes");
    check_same(dspark_row_bytes(0, dim, nullptr), DSPARK_E_NULL_POINTER, "row_bytes(NULL)");
    if (rs != DSPARK_OK || dtype > 2 || policy > 3) {
        std::vector<std::uint8_t> src(64), dst(64);
        const dspark_status s = dspark_encode_rows(src.data(), dtype, 0, 0, dim, storage, policy, dst.data(), dst.size(), nullptr);
        check_status(s);
        FUZZ_CHECK(s != DSPARK_OK);
        return;
    }
    const auto x = rows_of(n, dim, a, b);
    std::vector<std::uint8_t> in(n * dim * elem_bytes(static_cast<ElemType>(dtype)));
    if (!in.empty() && dtype == DSPARK_DTYPE_F32) std::memcpy(in.data(), x.data(), in.size());
    else if (!in.empty()) encode_rows(x.data(), ElemType::F32, in.data(), static_cast<Storage>(dtype), n, dim, NonFinite::Clamp);
    std::vector<std::uint8_t> got(n * rb + 3, 0x11), want(n * rb + 3, 0x11);
    std::int64_t gb = 42, wb = -1;
    check_same(dspark_encode_rows(in.data(), dtype, in.size(), n, dim, storage, policy, got.data(), d & 0x80 ? n * rb : got.size(), &gb),
               expect_of([&] { if (n) wb = encode_rows(in.data(), static_cast<ElemType>(dtype), want.data(), static_cast<Storage>(storage), n, dim, static_cast<NonFinite>(policy)); }),
               "encode_rows");
    FUZZ_CHECK(gb == wb && got == want);
    if (n && rb) {  // too small: the size needed, nothing written
        std::size_t dummy = 0;
        (void)dummy;
        std::vector<std::uint8_t> small(n * rb - 1, 0x33);
        check_same(dspark_encode_rows(in.data(), dtype, in.size(), n, dim, storage, policy, small.data(), small.size(), nullptr),
                   DSPARK_E_BUFFER_TOO_SMALL, "encode_rows(small)");
        for (std::uint8_t v : small) FUZZ_CHECK(v == 0x33);
        // In place (overlapping): refused.
        check_same(dspark_encode_rows(in.data(), dtype, in.size(), n, dim, storage, policy, in.data(), n * rb, nullptr),
                   in.size() ? DSPARK_E_INVALID_ARGUMENT : DSPARK_OK, "encode_rows(overlap)");
    }
    // Decode back, in every element type.
    const std::int32_t out = d % 3;
    std::vector<std::uint8_t> back(n * dim * elem_bytes(static_cast<ElemType>(out)) + 5, 0x22), wback(back.size(), 0x22);
    check_same(dspark_decode_rows(got.data(), storage, n * rb, n, dim, back.data(), out, back.size()),
               expect_of([&] { if (n) decode_rows(got.data(), static_cast<Storage>(storage), wback.data(), static_cast<ElemType>(out), n, dim); }),
               "decode_rows");
    FUZZ_CHECK(back == wback);
    check_same(dspark_decode_rows(got.data(), storage, n * rb + 1, n, dim, back.data(), out, back.size()),
               DSPARK_E_INVALID_ARGUMENT, "decode_rows(bytes + 1)");
    check_same(dspark_encode_rows(in.data(), dtype, in.size() + 1, n, dim, storage, policy, got.data(), got.size(), nullptr),
               DSPARK_E_INVALID_ARGUMENT, "encode_rows(bytes + 1)");
    if (n && dim) {  // a short destination: the size needed, nothing written
        std::vector<std::uint8_t> small(n * dim * elem_bytes(static_cast<ElemType>(out)) - 1, 0x44);
        check_same(dspark_decode_rows(got.data(), storage, n * rb, n, dim, small.data(), out, small.size()),
                   DSPARK_E_BUFFER_TOO_SMALL, "decode_rows(small)");
        for (std::uint8_t v : small) FUZZ_CHECK(v == 0x44);
    }
}

// Every call that takes a stager, given NULL: DSPARK_E_NULL_POINTER, no crash.
void op_null_stager() {
    dspark_stager* st = nullptr;
    std::int64_t i64 = 0, first[2], count[2], pos = 0, slot = 0;
    std::size_t sz = 0;
    dspark_plan plan;
    dspark_config c;
    dspark_config_init(&c);
    dspark_state x;
    dspark_state_init(&x);
    dspark_stats t;
    dspark_stats_init(&t);
    const dspark_status all[] = {
        dspark_stager_config(st, &c), dspark_stager_row_bytes(st, &sz), dspark_stager_max_plan_rows(st, &i64),
        dspark_ring_rows(st, &i64), dspark_begin(st, 0), dspark_process(st, 0, &pos, 0, nullptr, 0, 0),
        dspark_process_encoded(st, 0, &pos, 0, nullptr, 0), dspark_process_external(st, 0, &pos, 1, &slot),
        dspark_draft_size(st, 0, 0, DSPARK_DTYPE_STORAGE, &sz),
        dspark_draft(st, 0, 0, DSPARK_DTYPE_STORAGE, nullptr, 0, &plan, &sz),
        dspark_draft_many(st, nullptr, nullptr, 0, DSPARK_DTYPE_STORAGE, nullptr, 0, nullptr, &sz),
        dspark_commit(st, 0), dspark_fail(st, 0, 0, &i64), dspark_accept(st, 0, 0), dspark_rollback(st, 0, 0),
        dspark_shift(st, 0, 0, 0), dspark_fork(st, 0, 1), dspark_live_slots(st, 0, first, count),
        dspark_snapshot_size(st, 0, &sz), dspark_snapshot(st, 0, nullptr, 0, &sz), dspark_restore(st, 0, nullptr, 0),
        dspark_state_get(st, 0, &x), dspark_stats_get(st, 0, &t),
    };
    for (dspark_status s : all) FUZZ_CHECK(s == DSPARK_E_NULL_POINTER);
    dspark_stager_destroy(nullptr);  // a no-op
}

struct Run {
    Fixture fx;
    Stager* cpp = nullptr;
    ~Run() {
        dspark_stager_destroy(fx.st);
        delete cpp;
    }
};

void round_of(Fixture& fx, std::int64_t seq, std::uint8_t acc, std::uint8_t seed) {
    if (!fx.valid(seq)) return;
    const std::int64_t end = fx.end_of(seq);
    dspark_plan plan;
    std::size_t size = 0, written = 0;
    if (dspark_draft_size(fx.st, seq, end, DSPARK_DTYPE_STORAGE, &size) != DSPARK_OK) return;
    std::vector<std::uint8_t> buf(size);
    RoundPlan p;
    ByteVec rows;
    const dspark_status s = dspark_draft(fx.st, seq, end, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, &written);
    check_same(s, oracle_draft(fx, seq, end, p, rows), "round draft");
    if (s == DSPARK_OK && plan.skip == DSPARK_SKIP_NONE) {
        FUZZ_CHECK(same_plan(plan, p) && written == rows.size() && (written == 0 || std::memcmp(buf.data(), rows.data(), written) == 0));
        check_same(dspark_commit(fx.st, seq), expect_of([&] { fx.cpp->commit(seq); }), "round commit");
    }
    const std::size_t n = static_cast<std::size_t>(fx.c.block_size + 1), D = static_cast<std::size_t>(fx.c.feature_dim);
    const auto x = rows_of(n, D, seed, 0);
    Ids ids = ids_of(fx, n, seed, 0);
    const std::int32_t* tp = round_ids(fx, ids);
    std::vector<std::int64_t> pos(n), slots(n), want(n);
    for (std::size_t i = 0; i < n; ++i) pos[i] = end + static_cast<std::int64_t>(i);
    if (fx.external)
        check_same(dspark_process_external_tokens(fx.st, seq, pos.data(), n, slots.data(), tp),
                   expect_of([&] { fx.cpp->process_external(seq, pos.data(), n, want.data(), tp); }), "round process");
    else
        check_same(dspark_process_tokens(fx.st, seq, pos.data(), n, x.data(), DSPARK_DTYPE_F32, x.size() * 4, tp),
                   expect_of([&] { fx.cpp->process(seq, pos.data(), n, x.data(), ElemType::F32, tp); }), "round process");
    check_tokens(fx, seq);
    const std::int64_t a = acc % (fx.c.block_size + 1);
    check_same(dspark_accept(fx.st, seq, a), expect_of([&] { fx.cpp->accept(seq, a); }), "round accept");
}

// A round verified as a tree (docs/design.md 2.11): draft, commit, a tree of
// fuzzed parents (mostly valid), a fuzzed path (mostly root-to-node), each
// call through the C ABI and the C++ oracle, statuses, slots and moves alike.
void tree_round_of(Reader& r, Fixture& fx, std::int64_t seq) {
    const std::uint8_t size = r.u8(), shape = r.u8(), pick_node = r.u8(), damage = r.u8(), seed = r.u8(), tok = r.u8();
    if (!fx.valid(seq)) return;
    const std::int64_t end = fx.end_of(seq);
    dspark_plan plan;
    std::size_t need = 0, written = 0;
    if (dspark_draft_size(fx.st, seq, end, DSPARK_DTYPE_STORAGE, &need) == DSPARK_OK) {
        std::vector<std::uint8_t> buf(need);
        RoundPlan p;
        ByteVec rows;
        const dspark_status s = dspark_draft(fx.st, seq, end, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, &written);
        check_same(s, oracle_draft(fx, seq, end, p, rows), "tree draft");
        if (s == DSPARK_OK && plan.skip == DSPARK_SKIP_NONE)
            check_same(dspark_commit(fx.st, seq), expect_of([&] { fx.cpp->commit(seq); }), "tree commit");
    }
    const std::size_t n = size % static_cast<std::size_t>(fx.c.block_size + 3), D = static_cast<std::size_t>(fx.c.feature_dim);
    std::vector<std::int64_t> parents(n);
    for (std::size_t i = 0; i < n; ++i)
        parents[i] = i == 0 ? -1 : static_cast<std::int64_t>((shape + 31 * i) % i);
    if (n && damage % 8 == 1) parents[(damage >> 3) % n] = static_cast<std::int64_t>(n);  // a parent after its child
    const std::int64_t root = damage % 8 == 2 ? end + 1 : end;
    const auto x = rows_of(n, D, seed, 0);
    // Each node's token id (a chain stager's: the _tokens forms; a block stager's: the plain
    // forms, now and then a _tokens form, refused).
    const Ids ids = ids_of(fx, n, seed, tok);
    const std::int32_t* tp = ids.p;
    std::vector<std::int64_t> slots(n, -9), want(n, -9);
    const std::int64_t cu[2] = {0, static_cast<std::int64_t>(n)};
    const auto before = fx.fingerprint();
    dspark_status ts = DSPARK_OK;
    if (damage & 0x80) {  // the batched form, one sequence
        if (fx.external)
            check_same(ts = dspark_process_tree_external_many_tokens(fx.st, &seq, 1, cu, &root, parents.data(), n, slots.data(), tp),
                       expect_of([&] { fx.cpp->process_tree_external_many(&seq, 1, cu, &root, parents.data(), n, want.data(),
                                                                          "process_tree_external_many", tp); }),
                       "process_tree_external_many");
        else
            check_same(ts = dspark_process_tree_many_tokens(fx.st, &seq, 1, cu, &root, parents.data(), n, x.data(), DSPARK_DTYPE_F32,
                                                            x.size() * 4, tp),
                       expect_of([&] { fx.cpp->process_tree_many(&seq, 1, cu, &root, parents.data(), n, x.data(), ElemType::F32, tp); }),
                       "process_tree_many");
    } else if (fx.external) {
        check_same(ts = dspark_process_tree_external_tokens(fx.st, seq, root, parents.data(), n, slots.data(), tp),
                   expect_of([&] { fx.cpp->process_tree_external(seq, root, parents.data(), n, want.data(), tp); }),
                   "process_tree_external");
    } else {
        check_same(ts = dspark_process_tree_tokens(fx.st, seq, root, parents.data(), n, x.data(), DSPARK_DTYPE_F32, x.size() * 4, tp),
                   expect_of([&] { fx.cpp->process_tree(seq, root, parents.data(), n, x.data(), ElemType::F32, tp); }),
                   "process_tree");
    }
    FUZZ_CHECK(slots == want);
    // A refused id (negative, missing, or given to a block stager) is refused with nothing changed.
    const bool bad_ids = fx.c.kind == DSPARK_KIND_CHAIN ? (tp == nullptr && n) || std::any_of(ids.v.begin(), ids.v.begin() + static_cast<std::ptrdiff_t>(n), [](std::int32_t v) { return v < 0; })
                                                        : tp != nullptr;
    if (bad_ids) FUZZ_CHECK(ts != DSPARK_OK);
    if (ts != DSPARK_OK) FUZZ_CHECK(fx.fingerprint() == before);
    check_tokens(fx, seq);
    // The path from a node up to the root, reversed; sometimes spoiled.
    std::vector<std::int64_t> path;
    if (n) {
        for (std::int64_t v = static_cast<std::int64_t>(pick_node % n); v >= 0; v = parents[static_cast<std::size_t>(v)]) {
            path.insert(path.begin(), v);
            if (v >= static_cast<std::int64_t>(n) || path.size() > n) break;  // a damaged tree
        }
    }
    if (damage % 8 == 3 && path.size() > 1) path.erase(path.begin() + 1);
    if (damage % 8 == 4) path.push_back(static_cast<std::int64_t>(n));
    std::vector<SlotMove> moved;
    if (damage & 0x40) {  // the batched form, one sequence
        const std::int64_t pcu[2] = {0, static_cast<std::int64_t>(path.size())};
        const dspark_status w = expect_of([&] { moved = fx.cpp->accept_path_many(&seq, 1, pcu, path.data(), path.size()); });
        check_same(dspark_accept_path_many(fx.st, &seq, 1, pcu, path.data(), path.size()), w, "accept_path_many");
    } else {
        const dspark_status w = expect_of([&] { moved = fx.cpp->accept_path(seq, path.data(), path.size()); });
        check_same(dspark_accept_path(fx.st, seq, path.data(), path.size()), w, "accept_path");
    }
    check_moves(moved);
    check_tokens(fx, seq);  // the kept nodes' ids moved with their rows
    if (fx.cpp->state(seq).tree_nodes) {  // a bad path left the tree: keep the root alone
        const std::int64_t just_root = 0;
        check_same(dspark_accept_path(fx.st, seq, &just_root, 1), expect_of([&] { fx.cpp->accept_path(seq, &just_root, 1); }),
                   "accept_path(root)");
        check_tokens(fx, seq);
    }
}

// The C++ outcome of fn as the C ABI reports it: its status and message.
template <class Fn>
std::pair<dspark_status, std::string> outcome_of(Fn&& fn) {
    std::string what;
    const dspark_status s = expect_of([&] {
        try {
            fn();
        } catch (const std::exception& e) {
            what = e.what();
            throw;
        }
    });
    return {s, what};
}

// The batch calls, reservations and end: the same status and message as the
// C++ call, the same slots / disabled counts, and a rejected batch changes
// nothing. Ids may repeat or be unknown, offsets may be broken, positions
// may skip; k = 0 is an empty batch.
void op_batch(Reader& r, Fixture& fx) {
    const std::uint8_t kind = r.u8(), shape = r.u8(), mode = r.u8(), seed = r.u8(), tok = r.u8();
    const std::size_t k = shape % 5, D = static_cast<std::size_t>(std::max<std::int64_t>(0, fx.c.feature_dim));
    std::vector<std::int64_t> seqs(k), cu{0}, pos, vals(k);
    for (std::size_t i = 0; i < k; ++i) {
        seqs[i] = fx.seq_of(r.u8());
        const std::size_t c = r.u8() % 4;
        const auto p = positions(fx, seqs[i], c, i + 1 == k ? mode : 0);
        pos.insert(pos.end(), p.begin(), p.end());
        cu.push_back(static_cast<std::int64_t>(pos.size()));
        vals[i] = pick(r, {0, 1, 2, 3, 7, -1});
    }
    if (shape >= 240 && k) cu[shape % k + 1] += shape % 2 ? 1 : -1;  // broken offsets
    const std::size_t total = pos.size();
    std::vector<std::int64_t> slots(total + 1, -9), want(total + 1, -9), dis(k + 1, -9), want_dis(k + 1, -9);
    const auto x = rows_of(total, D, seed, 0);
    std::vector<std::int32_t> stages(k);
    std::vector<FailStage> fstages(k);
    for (std::size_t i = 0; i < k; ++i) {
        stages[i] = static_cast<std::int32_t>((vals[i] + 1) % 3);  // 0, 1 and 2 (bad)
        fstages[i] = static_cast<FailStage>(stages[i]);
    }
    const std::int64_t seq = k ? seqs[0] : fx.seq_of(seed);
    // The rows' token ids, flat as the rows (the calls that append rows: process_many,
    // process_external_many, reserve_many, reserve); the _tokens forms with ids_of's draws.
    const Ids ids = ids_of(fx, total, seed, tok);
    const std::int32_t* tp = ids.p;
    bool appends = false;  // the call takes ids
    std::size_t n_ids = total;  // how many of them it reads
    const auto before = fx.fingerprint();
    dspark_status s = DSPARK_OK;
    std::pair<dspark_status, std::string> w;
    const char* name = "";
    switch (kind % 12) {
        case 0:
            name = "process_many";
            appends = true;
            s = dspark_process_many_tokens(fx.st, seqs.data(), k, cu.data(), pos.data(), total, x.data(), DSPARK_DTYPE_F32,
                                           x.size() * 4, tp);
            w = outcome_of([&] { fx.cpp->process_many(seqs.data(), k, cu.data(), pos.data(), total, x.data(), ElemType::F32, tp); });
            break;
        case 1:
            name = "process_external_many";
            appends = true;
            s = dspark_process_external_many_tokens(fx.st, seqs.data(), k, cu.data(), pos.data(), total, slots.data(), tp);
            w = outcome_of([&] {
                fx.cpp->process_external_many(seqs.data(), k, cu.data(), pos.data(), total, want.data(), "process_external_many", tp);
            });
            break;
        case 2:
            name = "accept_many";
            s = dspark_accept_many(fx.st, seqs.data(), vals.data(), k);
            w = outcome_of([&] { fx.cpp->accept_many(seqs.data(), vals.data(), k); });
            break;
        case 3:
            name = "commit_many";
            s = dspark_commit_many(fx.st, seqs.data(), k);
            w = outcome_of([&] { fx.cpp->commit_many(seqs.data(), k); });
            break;
        case 4:
            name = "fail_many";
            s = dspark_fail_many(fx.st, seqs.data(), stages.data(), k, dis.data());
            w = outcome_of([&] { fx.cpp->fail_many(seqs.data(), fstages.data(), k, want_dis.data()); });
            break;
        case 5:
            name = "reserve_many";
            appends = true;
            s = dspark_reserve_many_tokens(fx.st, seqs.data(), k, cu.data(), pos.data(), total, slots.data(), tp);
            w = outcome_of([&] { fx.cpp->reserve_many(seqs.data(), k, cu.data(), pos.data(), total, want.data(), tp); });
            break;
        case 6:
            name = "confirm_many";
            s = dspark_confirm_many(fx.st, seqs.data(), k);
            w = outcome_of([&] { fx.cpp->confirm_many(seqs.data(), k); });
            break;
        case 7:
            name = "cancel_many";
            s = dspark_cancel_many(fx.st, seqs.data(), k);
            w = outcome_of([&] { fx.cpp->cancel_many(seqs.data(), k); });
            break;
        case 8:
            name = "end_many";
            s = dspark_end_many(fx.st, seqs.data(), k);
            w = outcome_of([&] { fx.cpp->end_many(seqs.data(), k); });
            break;
        case 9: {
            name = "reserve";
            // The first sequence's rows (cu may have been broken above: clamp to the array).
            const std::size_t n = k ? std::min<std::size_t>(static_cast<std::size_t>(std::max<std::int64_t>(cu[1], 0)), total) : 0;
            appends = true;
            n_ids = n;
            s = dspark_reserve_tokens(fx.st, seq, pos.data(), n, slots.data(), tp);
            w = outcome_of([&] { fx.cpp->reserve(seq, pos.data(), n, want.data(), tp); });
            break;
        }
        case 10:  // drafting per request: one sequence or the batch, off or on
            switch (mode % 4) {
                case 0:
                    name = "disable";
                    s = dspark_disable(fx.st, seq);
                    w = outcome_of([&] { fx.cpp->disable(seq); });
                    break;
                case 1:
                    name = "enable";
                    s = dspark_enable(fx.st, seq);
                    w = outcome_of([&] { fx.cpp->enable(seq); });
                    break;
                case 2:
                    name = "disable_many";
                    s = dspark_disable_many(fx.st, seqs.data(), k);
                    w = outcome_of([&] { fx.cpp->disable_many(seqs.data(), k); });
                    break;
                default:
                    name = "enable_many";
                    s = dspark_enable_many(fx.st, seqs.data(), k);
                    w = outcome_of([&] { fx.cpp->enable_many(seqs.data(), k); });
                    break;
            }
            break;
        default:
            switch (mode % 3) {
                case 0:
                    name = "confirm";
                    s = dspark_confirm(fx.st, seq);
                    w = outcome_of([&] { fx.cpp->confirm(seq); });
                    break;
                case 1:
                    name = "cancel";
                    s = dspark_cancel(fx.st, seq);
                    w = outcome_of([&] { fx.cpp->cancel(seq); });
                    break;
                default:
                    name = "end";
                    s = dspark_end(fx.st, seq);
                    w = outcome_of([&] { fx.cpp->end(seq); });
                    break;
            }
    }
    check_same(s, w.first, name);
    if (w.second != dspark_last_error()) {
        std::fprintf(stderr, "%s: C ABI \"%s\", C++ API \"%s\"\n", name, dspark_last_error(), w.second.c_str());
        FUZZ_CHECK(w.second == dspark_last_error());
    }
    // A refused id (negative, missing, or given to a block stager) is refused with nothing changed.
    if (appends && (fx.c.kind == DSPARK_KIND_CHAIN
                        ? (tp == nullptr && n_ids) || std::any_of(ids.v.begin(), ids.v.begin() + static_cast<std::ptrdiff_t>(n_ids),
                                                       [](std::int32_t v) { return v < 0; })
                        : tp != nullptr))
        FUZZ_CHECK(s != DSPARK_OK);
    if (s != DSPARK_OK) {
        FUZZ_CHECK(fx.fingerprint() == before);
        FUZZ_CHECK(slots[0] == -9 && dis[0] == -9);  // outputs untouched
        return;
    }
    FUZZ_CHECK(slots == want && dis == want_dis);
    if (appends)  // the ids beside the rows, through both APIs
        for (std::size_t i = 0; i < std::max<std::size_t>(k, 1); ++i) check_tokens(fx, k ? seqs[i] : seq);
}

// The op code of a round verified as a tree: one that no recorded finding
// uses (it was another rounds code), so the findings replay as written.
constexpr std::uint8_t TREE_CODE = 239;
// The op code of the device step (op_device_step), chosen the same way.
constexpr std::uint8_t DEVICE_STEP_CODE = 237;
// The most slot-token-table ids an op allocates (max_seqs * ring_rows): larger
// configurations skip the device step's op.
constexpr std::int64_t MAX_TABLE_IDS = 1 << 18;

// Now and then one field of a handed-over sequence's step state, the same in
// both APIs' states, set to a value a careless server's copy back could leave
// there (the rules of step_math.hpp's damage_of, their edges and beyond):
// the steps that follow must agree, with no write out of bounds (ASan).
void damage_step_state(Reader& r, Fixture& fx, const std::vector<std::int64_t>& seqs) {
    const std::uint8_t when = r.u8();
    if (when % 8 != 7) return;
    const std::uint8_t which = r.u8(), field = r.u8(), value = r.u8();
    const std::int64_t q = seqs[which % seqs.size()];
    if (!fx.valid(q)) return;
    std::int64_t* sc = nullptr;
    FUZZ_CHECK(dspark_step_state(fx.st, &sc) == DSPARK_OK);
    std::int64_t* sp = fx.cpp->step_state();
    const std::int64_t cols = dspark::device_step::columns(fx.cpp->step_config()), m = fx.c.max_seqs;
    const std::size_t at = static_cast<std::size_t>((field % cols) * m + q);
    const std::int64_t now = sp[at];
    auto plus = [](std::int64_t a, std::int64_t b) {  // wrapping: the value is garbage on purpose
        return static_cast<std::int64_t>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
    };
    const std::int64_t values[] = {-1, 0, 1, 2, plus(now, 1), plus(now, -1), plus(now, fx.ring), 200000,
                                   std::int64_t{1} << 40,
                                   (std::int64_t{1} << 62) + 1, INT64_MAX, INT64_MIN};
    sc[at] = sp[at] = values[value % (sizeof values / sizeof values[0])];
}

// Now and then a misaligned buffer (one fuzzed byte).
bool misaligned(Reader& r) { return r.u8() % 32 == 31; }

// The device step through the C ABI against the C++ API: a hand-over of up to
// three sequences (a chain stager's through the _tokens forms, each API with its
// own slot token table; a block stager's through the plain forms; now and then
// the other form, refused), a few steps with fuzzed accept counts (bad ones:
// sticky faults), the verify rows' ids written into both tables as a server
// does (now and then one left unwritten: to_host refuses, naming it), and a
// hand-back with fuzzed outcomes; whatever is still handed over then comes
// back with the missing ids written, and a reservation left is cancelled or
// confirmed. Every call's status and message, every answer and table compared;
// check_twins after the op compares the sequences, ids included.
void op_device_step(Reader& r, Fixture& fx) {
    const std::uint8_t pick_b = r.u8(), form = r.u8(), n_steps = r.u8(), outcome_b = r.u8(), hole = r.u8();
    std::vector<std::int64_t> seqs;
    for (int k = 0; k < 1 + pick_b % 3; ++k) seqs.push_back(fx.seq_of(r.u8()));
    const std::int64_t table_ids = fx.c.max_seqs * fx.ring;
    if (fx.ring <= 0 || table_ids > MAX_TABLE_IDS) return;
    const bool chain = fx.c.kind == DSPARK_KIND_CHAIN;
    const bool with_ids = chain != (form % 16 == 15);  // now and then the other form
    const std::size_t nt = static_cast<std::size_t>(table_ids) - (form % 64 == 62 ? 1 : 0);  // now and then short
    std::vector<std::int32_t> tc(nt, -1), tp(nt, -1);
    const std::size_t n = seqs.size();
    auto to_device = [&] {
        const dspark_status s = with_ids ? dspark_to_device_tokens(fx.st, seqs.data(), n, tc.data(), nt)
                                         : dspark_to_device(fx.st, seqs.data(), n);
        check_same(s, expect_of([&] { fx.cpp->to_device(seqs.data(), n, with_ids ? tp.data() : nullptr, with_ids ? nt : 0); }),
                   "to_device");
        FUZZ_CHECK(tc == tp);
        return s;
    };
    auto to_host = [&](const std::vector<std::int32_t>& outcomes) {
        std::vector<std::int64_t> dc(n, -5), dp(n, -5);
        const dspark_status s =
            with_ids ? dspark_to_host_tokens(fx.st, seqs.data(), n, outcomes.data(), dc.data(), tc.data(), nt)
                     : dspark_to_host(fx.st, seqs.data(), n, outcomes.data(), dc.data());
        check_same(s, expect_of([&] {
                       fx.cpp->to_host(seqs.data(), n, outcomes.data(), dp.data(), with_ids ? tp.data() : nullptr,
                                       with_ids ? nt : 0);
                   }),
                   "to_host");
        if (s == DSPARK_OK) FUZZ_CHECK(dc == dp);
        return s;
    };
    if (to_device() != DSPARK_OK) return;
    const std::size_t b = static_cast<std::size_t>(fx.c.block_size), mr = static_cast<std::size_t>(fx.cpp->step_config().max_rows);
    // The hand-back's outcomes: a failure is a round whose drafter failed, which builds
    // no verify batch: the last step's verify rows of that entry stay unwritten.
    std::vector<std::int32_t> outcomes(n, -1);
    for (std::size_t i = 0; i < n; ++i)
        if (outcome_b >> i & 1) outcomes[i] = static_cast<std::int32_t>((outcome_b >> 4 >> i) % 3) - (i == 2 ? 1 : 0);
    bool holed = hole % 8 != 7;  // the hole: in the first drafted verify batch of entry 0
    std::vector<std::int64_t> last_verify;  // entry 0's verify slots in the last step
    const int steps = 1 + n_steps % 4;
    for (int k = 0; k < steps; ++k) {
        std::vector<std::int64_t> counts;
        for (std::size_t i = 0; i < n; ++i)
            counts.push_back(pick(r, {0, 1, 2, 3, fx.c.block_size, -1, 0, fx.c.block_size + 1}));
        step_test::StepAnswers x(n, mr, b), y(n, mr, b);
        const dspark_step_out out = x.c();
        damage_step_state(r, fx, seqs);
        if (misaligned(r)) {  // a misaligned typed buffer: refused, nothing changes
            alignas(8) unsigned char raw[8 * 4 + 8] = {};
            const auto* odd = reinterpret_cast<const std::int64_t*>(raw + 1);
            FUZZ_CHECK(dspark_step_many(fx.st, odd, counts.data(), 1, &out) == DSPARK_E_INVALID_ARGUMENT);
        }
        check_same(dspark_step_many(fx.st, seqs.data(), counts.data(), n, &out),
                   expect_of([&] { fx.cpp->step_many(seqs.data(), counts.data(), n, y.cpp()); }), "step_many");
        FUZZ_CHECK(x == y);
        check_same(dspark_check_step(fx.st, seqs.data(), x.status.data(), n),
                   expect_of([&] { fx.cpp->check_step(seqs.data(), y.status.data(), n); }), "check_step");
        last_verify.assign(x.verify_slots.begin(), x.verify_slots.begin() + static_cast<std::ptrdiff_t>(b + 1));
        const bool hole_now = !holed && x.status[0] == DSPARK_STEP_OK && x.skip[0] == DSPARK_SKIP_NONE;
        holed = holed || hole_now;
        for (std::size_t i = 0; i < n && with_ids; ++i)  // the verify batch's ids at its verify slots
            for (std::size_t j = 0; j <= b; ++j) {
                const std::int64_t g = x.verify_slots[i * (b + 1) + j];
                if (g < 0 || static_cast<std::size_t>(g) >= nt || (hole_now && i == 0 && j == hole % (b + 1)) ||
                    (k == steps - 1 && outcomes[i] != -1))
                    continue;
                tc[static_cast<std::size_t>(g)] = tp[static_cast<std::size_t>(g)] =
                    static_cast<std::int32_t>((x.start[i] * 31 + static_cast<std::int64_t>(j) * 7 + k) % 50000);
            }
    }
    if (to_host(outcomes) != DSPARK_OK) {
        // Still handed over (a refused hand-back changes nothing): bring them back with the
        // holes filled but entry 0's last verify rows (a reservation comes back unwritten:
        // confirm refuses it below); a step's fault is raised after every sequence is back.
        bool any = false;
        for (std::int64_t q : seqs) {
            std::int32_t on = 0;
            if (fx.valid(q) && dspark_on_device(fx.st, q, &on) == DSPARK_OK && on) any = true;
        }
        if (any) {
            for (std::int64_t q : seqs)
                if (fx.valid(q))
                    for (std::int64_t g = q * fx.ring; g < (q + 1) * fx.ring && static_cast<std::size_t>(g) < nt; ++g)
                        if (tc[static_cast<std::size_t>(g)] < 0 &&
                            std::find(last_verify.begin(), last_verify.end(), g) == last_verify.end())
                            tc[static_cast<std::size_t>(g)] = tp[static_cast<std::size_t>(g)] = 9;
            (void)to_host(std::vector<std::int32_t>(n, -1));
        }
    }
    for (std::int64_t q : seqs) {  // a damaged state never comes back: end frees it (no sequence is stranded)
        std::int32_t on = 0;
        if (fx.valid(q) && dspark_on_device(fx.st, q, &on) == DSPARK_OK && on)
            check_same(dspark_end(fx.st, q), expect_of([&] { fx.cpp->end(q); }), "end (damaged)");
    }
    for (std::int64_t q : seqs) {
        if (!fx.valid(q)) continue;
        std::int32_t on = 1;
        FUZZ_CHECK(dspark_on_device(fx.st, q, &on) == DSPARK_OK && on == 0 && !fx.cpp->on_device(q));
        if (fx.cpp->state(q).reservation_open) {
            const bool confirm = (form >> 4) & 1;
            check_same(confirm ? dspark_confirm(fx.st, q) : dspark_cancel(fx.st, q),
                       expect_of([&] { confirm ? fx.cpp->confirm(q) : fx.cpp->cancel(q); }), "confirm / cancel");
            if (fx.cpp->state(q).reservation_open)  // refused: an unwritten verify row's id
                check_same(dspark_cancel(fx.st, q), expect_of([&] { fx.cpp->cancel(q); }), "cancel");
        }
        check_tokens(fx, q);
    }
}

void step(Reader& r, Fixture& fx) {
    const std::uint8_t code = r.u8();
    const std::int64_t seq = fx.seq_of(r.u8());
    // The batch calls take the top codes: every code below keeps its meaning, so the
    // recorded findings (no code >= 240 in them) replay as they were written.
    if (code >= 240) {
        op_batch(r, fx);
        return;
    }
    if (code == TREE_CODE) {
        tree_round_of(r, fx, seq);
        return;
    }
    if (code == DEVICE_STEP_CODE) {
        op_device_step(r, fx);
        return;
    }
    switch (code % 20) {
        case 0: check_same(dspark_begin(fx.st, seq), expect_of([&] { fx.cpp->begin(seq); }), "begin"); break;
        case 1: case 2: op_process(r, fx, seq); break;
        case 3: {  // a long decode: the ring wraps
            const std::size_t chunk = static_cast<std::size_t>(std::max<std::int64_t>(1, fx.c.window / 2));
            const std::size_t D = static_cast<std::size_t>(fx.c.feature_dim);
            for (std::int64_t k = 0; k * static_cast<std::int64_t>(chunk) <= fx.ring; ++k) {
                const auto pos = positions(fx, seq, chunk, 0);
                const auto x = rows_of(chunk, D, static_cast<std::uint8_t>(k), 0);
                Ids ids = ids_of(fx, chunk, static_cast<std::uint8_t>(k), 0);
                const std::int32_t* tp = round_ids(fx, ids);
                std::vector<std::int64_t> slots(chunk), want(chunk);
                const dspark_status s = fx.external ? dspark_process_external_tokens(fx.st, seq, pos.data(), chunk, slots.data(), tp)
                                                    : dspark_process_tokens(fx.st, seq, pos.data(), chunk, x.data(), DSPARK_DTYPE_F32, x.size() * 4, tp);
                const dspark_status w = expect_of([&] {
                    if (fx.external) fx.cpp->process_external(seq, pos.data(), chunk, want.data(), tp);
                    else fx.cpp->process(seq, pos.data(), chunk, x.data(), ElemType::F32, tp);
                });
                check_same(s, w, "long decode");
                if (s != DSPARK_OK) break;
            }
            break;
        }
        case 4: op_draft(r, fx, seq); break;
        case 5: op_draft_many(r, fx); break;
        case 6: check_same(dspark_commit(fx.st, seq), expect_of([&] { fx.cpp->commit(seq); }), "commit"); break;
        case 7: {
            const std::int32_t stage = static_cast<std::int32_t>(r.u8() % 4) - 1;
            std::int64_t disabled = -5, want_d = 0;
            const dspark_status w = expect_of([&] {
                fx.cpp->check_open(seq);
                if (stage != 0 && stage != 1) throw std::invalid_argument("stage");
                want_d = fx.cpp->fail(seq, static_cast<FailStage>(stage));
            });
            check_same(dspark_fail(fx.st, seq, stage, &disabled), w, "fail");
            FUZZ_CHECK(w != DSPARK_OK || disabled == want_d);
            break;
        }
        case 8: {
            const std::int64_t n = pick(r, {0, 1, 2, 3, 5, 8, -1, std::numeric_limits<std::int64_t>::max()});
            check_same(dspark_accept(fx.st, seq, n), expect_of([&] { fx.cpp->accept(seq, n); }), "accept");
            break;
        }
        case 9: {
            const std::uint8_t b = r.u8();
            const std::int64_t np = b >= 250 ? (b == 250 ? -1 : MAXP) : std::max<std::int64_t>(0, fx.end_of(seq) - b % 40);
            check_same(dspark_rollback(fx.st, seq, np), expect_of([&] { fx.cpp->rollback(seq, np); }), "rollback");
            break;
        }
        case 10: {
            const std::uint8_t a = r.u8(), b = r.u8();
            const std::int64_t end = fx.end_of(seq);
            const auto frac = [](std::int64_t x, std::uint8_t k) {  // x * k / 256 without overflow
                return static_cast<std::int64_t>(static_cast<__int128>(x) * k / 256);
            };
            const std::int64_t keep = b == 255 ? -1 : frac(end + 1, a), discard = b == 254 ? MAXP : frac(end - keep + 1, b);
            std::vector<SlotMove> want;
            const dspark_status w = expect_of([&] { want = fx.cpp->shift(seq, keep, discard); });
            check_same(dspark_shift(fx.st, seq, keep, discard), w, "shift");
            check_moves(want);
            break;
        }
        case 11: {
            const std::int64_t dst = fx.seq_of(r.u8());
            std::vector<SlotMove> want;
            const dspark_status w = expect_of([&] { want = fx.cpp->fork(seq, dst); });
            check_same(dspark_fork(fx.st, seq, dst), w, "fork");
            check_moves(want);
            const dspark_slot_move* m = nullptr;
            check_same(dspark_last_moves(&m, nullptr), DSPARK_E_NULL_POINTER, "last_moves(NULL)");
            break;
        }
        case 12: op_snapshot(r, fx, seq); break;
        case 13: op_restore(r, fx, seq); break;
        case 14: {  // introspection with caller struct sizes: only struct_size bytes are written
            const std::uint8_t b = r.u8();
            struct { dspark_state s; std::uint8_t guard[8]; } xs;
            std::memset(&xs, 0x77, sizeof xs);
            xs.s.struct_size = b % 4 == 0 ? 4 : b % 4 == 1 ? 24 : static_cast<std::uint32_t>(sizeof(dspark_state) + 8 * (b % 4 == 3));
            const dspark_status s = dspark_state_get(fx.st, seq, &xs.s);
            check_same(s, expect_of([&] { (void)fx.cpp->state(seq); }), "state_get");
            const std::size_t lim = std::min<std::size_t>(xs.s.struct_size, sizeof(dspark_state));
            const auto* raw = reinterpret_cast<const std::uint8_t*>(&xs);
            for (std::size_t i = s == DSPARK_OK ? lim : 4; i < sizeof xs; ++i) FUZZ_CHECK(raw[i] == 0x77);
            dspark_stats t;
            dspark_stats_init(&t);
            t.struct_size = 3;
            check_same(dspark_stats_get(fx.st, seq, &t), fx.valid(seq) ? DSPARK_E_INVALID_ARGUMENT : DSPARK_E_INVALID_ARGUMENT, "stats_get(struct_size 3)");
            std::int64_t first[2];
            check_same(dspark_live_slots(fx.st, seq, first, nullptr), DSPARK_E_NULL_POINTER, "live_slots(NULL)");
            break;
        }
        case 15: op_formats(r); break;
        case 16: op_null_stager(); break;
        default: {
            const std::uint8_t acc = r.u8(), seed = r.u8(), rounds = r.u8();
            for (int k = 0; k < 1 + rounds % 4; ++k) round_of(fx, seq, static_cast<std::uint8_t>(acc + k), seed);
            break;
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    Reader r(data, size);
    Run run;
    if (!create(r, run.fx, run.cpp)) return 0;
    // Status names and the version for any code.
    FUZZ_CHECK(dspark_abi_version() == DSPARK_ABI_VERSION && dspark_version()[0] != '\0');
    for (dspark_status code = -1; code <= DSPARK_E_INTERNAL + 1; ++code) {
        const char* name = dspark_status_name(code);
        FUZZ_CHECK(name != nullptr && std::strncmp(name, "DSPARK_", 7) == 0);
        FUZZ_CHECK((std::strcmp(name, "DSPARK_E_UNKNOWN") == 0) == (code < DSPARK_OK || code > DSPARK_E_INTERNAL));
    }
    int ops = 0;
    std::vector<std::int64_t> last = run.fx.totals_of();
    while (r.more() && ops++ < 64) {
        step(r, run.fx);
        run.fx.check_twins();
        if (ops % 16 == 0 || !r.more()) {  // the Stager's metrics: every counter only grows
            // The batched histogram: every checked sequence at once, as one by one.
            std::vector<std::int64_t> ids(static_cast<std::size_t>(run.fx.checked()));
            for (std::size_t q = 0; q < ids.size(); ++q) ids[q] = static_cast<std::int64_t>(q);
            const std::size_t buckets = static_cast<std::size_t>(run.fx.c.block_size) + 1;
            std::vector<std::int64_t> many(ids.size() * buckets, -1);
            FUZZ_CHECK(dspark_accepted_many(run.fx.st, ids.data(), ids.size(), many.data(), many.size()) == DSPARK_OK);
            for (std::size_t q = 0; q < ids.size(); ++q)
                FUZZ_CHECK(std::equal(many.begin() + static_cast<std::ptrdiff_t>(q * buckets),
                                      many.begin() + static_cast<std::ptrdiff_t>((q + 1) * buckets),
                                      run.fx.accepted_of(ids[q]).begin()));
            const std::vector<std::int64_t> now = run.fx.totals_of();
            const StagerTotals want = run.fx.cpp->totals();
            FUZZ_CHECK(std::equal(want.accepted.begin(), want.accepted.end(), now.begin()));
            FUZZ_CHECK(now.back() == want.started);
            std::size_t at = want.accepted.size();
            for (std::size_t k = 0; k < at; ++k) FUZZ_CHECK(now[k] >= last[k]);
            // Every stats field equals the C++ API's; every one but a gauge never goes back.
            auto is_gauge = [](const char* name) {
                for (const char* const* g = SEQ_STATS_GAUGES; *g; ++g)
                    if (std::strcmp(*g, name) == 0) return true;
                return false;
            };
#define DSPARK_GROWS(type, name)                                     \
    FUZZ_CHECK(now[at] == want.stats.name);                          \
    FUZZ_CHECK(is_gauge(#name) || now[at] >= last[at]);              \
    ++at;
            DSPARK_SEQ_STATS_FIELDS(DSPARK_GROWS)
#undef DSPARK_GROWS
            last = now;
        }
    }
    return 0;
}
