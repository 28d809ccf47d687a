// Snapshots of one sequence: format v2 written, versions 1 and 2 read. The
// byte layout is documented in src/dspark_core/stager/snapshot_format.py, which the
// reference twin implements; tests compare the bytes of both.
//
// v2 layout in short: a 96-byte header (fields at v1's offsets; the
// nonfinite policy and a content-flags word in v1's reserved bytes 13..15,
// the staged element type in v1's reserved byte 76), then the rows. Two CRC-32C's: one of the rows (offset 88) and one of the
// header before it (offset 92). The header is checked first (a damaged
// header reports damage, not a foreign config), then the rows are
// checksummed while they are copied, in one pass (crc32c_copy_shared: the
// caller's buffer may change meanwhile, and the checksum is of the rows kept).
#include <array>
#include <cstring>
#include <new>
#include <string>

#include "dspark/byte_buffer.hpp"
#include "dspark/crc32c.hpp"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"
#include "le_bytes.hpp"

namespace dspark {

namespace {

constexpr char MAGIC[4] = {'D', 'S', 'P', 'K'};
constexpr std::uint16_t VERSION = 2;
constexpr std::uint16_t VERSION_1 = 1;
constexpr std::size_t HEADER_BYTES = 96;
constexpr std::size_t V1_HEADER_BYTES = 88;
constexpr std::size_t V1_TRAILER_BYTES = 4;  // v1: CRC-32 (zlib) of everything before it
// Enough to read magic, version and header size.
constexpr std::size_t PREAMBLE_BYTES = 8;
constexpr std::size_t OFF_ROWS_CRC = 88, OFF_HEADER_CRC = 92;
// FLAG_DRAFTING_OFF (the request's switch, disable): a reader that predates it
// rejects the snapshot as having reserved bits set, rather than drafting for a
// request that asked for none.
constexpr std::uint32_t FLAG_STARTED = 1, FLAG_DISABLED = 2, FLAG_OWED = 4, FLAG_FIRST_ROUND = 8,
                        FLAG_ACCEPT_OPEN = 16, FLAG_DRAFTING_OFF = 32;
constexpr std::uint32_t FLAG_BITS = 63;
// Content flags (v2, offset 14): which parts the snapshot carries. Bit 0:
// the rows are held outside the snapshot (external-row mode: bookkeeping
// only, n_rows still says how many rows the owner keeps). A reader rejects
// bits it does not know.
constexpr std::uint16_t CONTENT_EXTERNAL_ROWS = 1;
// Bit 1: n_rows token ids (int32, little-endian) follow the rows (or the
// header, bit 0 set), one per row in position order: the snapshot of a
// chain drafter's Stager. The rows' checksum (offset 88) runs on over them.
constexpr std::uint16_t CONTENT_TOKENS = 2;
constexpr std::uint16_t CONTENT_FLAGS_KNOWN = CONTENT_EXTERNAL_ROWS | CONTENT_TOKENS;
constexpr std::size_t TOKEN_BYTES = 4;
constexpr const char* NEGATIVE_TOKEN = "snapshot token ids are inconsistent (a negative id)";

// CRC-32 (IEEE 802.3, zlib's crc32), table-driven: version 1 only.
std::uint32_t crc32_v1(const std::uint8_t* p, std::size_t n) {
    static const std::array<std::uint32_t, 256> table = [] {
        std::array<std::uint32_t, 256> t{};
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    std::uint32_t c = 0xFFFFFFFFu;
    for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

using le::put;  // little-endian fields (le_bytes.hpp)
using le::take;

[[noreturn]] void bad(const std::string& why) { throw std::invalid_argument(why); }

// A code's name from one of the core's tables, or "code N" for a value past it.
template <class E, class Name>
std::string code_name(std::uint8_t code, int count, Name name) {
    return code < count ? std::string(name(static_cast<E>(code))) : "code " + std::to_string(code);
}

// The configuration a snapshot was taken under (v1 has no nonfinite policy).
struct Fingerprint {
    std::uint32_t feature_dim, window, block, row_bytes;
    std::uint8_t storage, nonfinite, stage;
    bool v2;  // v1 records neither the nonfinite policy nor the staged type

    std::string str() const {
        std::string s = "feature_dim=" + std::to_string(feature_dim) +
                        ", storage=" + code_name<Storage>(storage, STORAGE_COUNT, storage_name) +
                        ", window=" + std::to_string(window) + ", block_size=" + std::to_string(block);
        if (v2) {
            s += ", nonfinite=" + code_name<NonFinite>(nonfinite, NONFINITE_COUNT, nonfinite_name) +
                 ", stage_dtype=" + code_name<ElemType>(stage, ELEM_TYPE_COUNT, elem_name);
        }
        return s;
    }
    bool operator==(const Fingerprint& o) const {
        return feature_dim == o.feature_dim && window == o.window && block == o.block && row_bytes == o.row_bytes &&
               storage == o.storage && (!v2 || (nonfinite == o.nonfinite && stage == o.stage));
    }
};

}  // namespace

std::size_t Stager::snapshot_bytes(const Seq& s) const noexcept {
    const auto n_rows = static_cast<std::size_t>(s.started ? s.end - s.horizon : 0);
    const std::size_t ids = opt_.kind == DrafterKind::Chain ? n_rows * TOKEN_BYTES : 0;
    if (external()) return HEADER_BYTES + ids;  // bookkeeping (and the ids) only
    return HEADER_BYTES + n_rows * row_bytes_ + ids;
}

void Stager::write_snapshot(const Seq& s, std::uint8_t* dst) const noexcept {
    const std::int64_t n_rows = s.started ? s.end - s.horizon : 0;
    std::uint8_t* h = dst;
    std::memset(h, 0, HEADER_BYTES);
    std::memcpy(h, MAGIC, 4);
    put<std::uint16_t>(h + 4, VERSION);
    put<std::uint16_t>(h + 6, static_cast<std::uint16_t>(HEADER_BYTES));
    put<std::uint32_t>(h + 8, static_cast<std::uint32_t>(opt_.feature_dim));
    put<std::uint8_t>(h + 12, static_cast<std::uint8_t>(opt_.storage));
    put<std::uint8_t>(h + 13, static_cast<std::uint8_t>(opt_.nonfinite));
    const bool ids = opt_.kind == DrafterKind::Chain;
    put<std::uint16_t>(h + 14, static_cast<std::uint16_t>((external() ? CONTENT_EXTERNAL_ROWS : 0) |
                                                          (ids ? CONTENT_TOKENS : 0)));  // content flags
    put<std::uint32_t>(h + 16, static_cast<std::uint32_t>(opt_.window));
    put<std::uint32_t>(h + 20, static_cast<std::uint32_t>(opt_.block_size));
    put<std::uint32_t>(h + 24, static_cast<std::uint32_t>(row_bytes_));
    const std::uint32_t flags = (s.started ? FLAG_STARTED : 0) | (s.disabled ? FLAG_DISABLED : 0) |
                                (s.restage_owed ? FLAG_OWED : 0) | (s.first_round ? FLAG_FIRST_ROUND : 0) |
                                (s.accept_open ? FLAG_ACCEPT_OPEN : 0) | (s.drafting_off ? FLAG_DRAFTING_OFF : 0);
    put<std::uint32_t>(h + 28, flags);
    put<std::int64_t>(h + 32, s.end);
    put<std::int64_t>(h + 40, s.horizon);
    put<std::int64_t>(h + 48, s.n_cache);
    put<std::int64_t>(h + 56, s.pos_base);
    put<std::int64_t>(h + 64, s.tentative);
    put<std::uint32_t>(h + 72, static_cast<std::uint32_t>(s.failures));
    put<std::uint8_t>(h + 76, static_cast<std::uint8_t>(opt_.stage));  // 77..79 reserved, zero
    put<std::uint64_t>(h + 80, static_cast<std::uint64_t>(n_rows));
    // One pass over the rows: each ring run is checksummed and copied together.
    std::uint32_t rows_crc = 0;
    std::uint8_t* out = dst + HEADER_BYTES;
    if (n_rows && !external())
        s.buf.for_each_run(s.horizon, s.end, [&](const std::uint8_t* run, std::size_t bytes) {
            rows_crc = crc32c_copy(rows_crc, out, run, bytes);
            out += bytes;
        });
    if (ids && n_rows) {
        std::vector<std::int32_t> tokens(static_cast<std::size_t>(n_rows));
        s.buf.copy_tokens_out(s.horizon, s.end, tokens.data());
        for (std::int32_t t : tokens) {
            put<std::int32_t>(out, t);
            out += TOKEN_BYTES;
        }
        const std::size_t bytes = tokens.size() * TOKEN_BYTES;
        rows_crc = crc32c(rows_crc, out - bytes, bytes);
    }
    put<std::uint32_t>(h + OFF_ROWS_CRC, rows_crc);
    put<std::uint32_t>(h + OFF_HEADER_CRC, crc32c(0, h, OFF_HEADER_CRC));
}

std::size_t Stager::snapshot_size(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    return snapshot_bytes(ready(seq));
}

std::size_t Stager::snapshot_into(std::int64_t seq, std::uint8_t* dst, std::size_t cap) const {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    const std::size_t need = snapshot_bytes(s);
    if (cap < need)
        throw BufferTooSmall("snapshot buffer of " + std::to_string(cap) +
                             " bytes is too small: the snapshot of sequence " + std::to_string(seq) + " needs " +
                             std::to_string(need), need);
    write_snapshot(s, dst);
    return need;
}

std::size_t Stager::snapshot_alloc(std::int64_t seq, SnapshotAlloc alloc, void* ctx) const {
    for (;;) {
        const std::size_t n = snapshot_size(seq);
        std::uint8_t* dst = alloc(n, ctx);  // no lock held: see stager.hpp
        if (!dst) throw std::bad_alloc();
        auto lock = lock_seq(seq);
        const Seq& s = ready(seq);
        if (snapshot_bytes(s) != n) continue;  // changed in between: size it again
        write_snapshot(s, dst);
        return n;
    }
}

std::vector<std::uint8_t> Stager::snapshot(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    std::vector<std::uint8_t> out;
    out.reserve(snapshot_bytes(s));
    advise_huge_pages(out.data(), out.capacity());  // before resize() first touches it
    out.resize(snapshot_bytes(s));
    write_snapshot(s, out.data());
    return out;
}

// A snapshot's fields, every check of its header made (the rows' checksum
// aside: v2 checks it while copying them).
struct Stager::SnapshotFields {
    bool v1 = false;
    std::size_t header = 0;
    std::uint64_t n_rows = 0;
    std::int64_t end = 0, horizon = 0, n_cache = 0, pos_base = 0, tentative = 0;
    std::uint32_t failures = 0, flags = 0;
    bool started = false;
    bool tokens = false;  // n_rows token ids follow the rows (CONTENT_TOKENS)
};

Stager::SnapshotFields Stager::read_snapshot(const std::uint8_t* d, std::size_t n) const {
    if (n < PREAMBLE_BYTES)
        bad("snapshot is truncated: " + std::to_string(n) + " bytes, a header needs " + std::to_string(HEADER_BYTES));
    if (std::memcmp(d, MAGIC, 4) != 0) bad("not a dspark_core snapshot (bad magic)");
    const auto version = take<std::uint16_t>(d + 4);
    if (version != VERSION && version != VERSION_1)
        bad("unsupported snapshot version " + std::to_string(version) + " (this build reads 1 and " +
            std::to_string(VERSION) + ")");
    const bool v1 = version == VERSION_1;
    const std::size_t header = v1 ? V1_HEADER_BYTES : HEADER_BYTES;
    const std::size_t trailer = v1 ? V1_TRAILER_BYTES : 0;
    if (n < header + trailer)
        bad("snapshot is truncated: " + std::to_string(n) + " bytes, a header needs " + std::to_string(header + trailer));
    if (take<std::uint16_t>(d + 6) != header) bad("bad snapshot header size " + std::to_string(take<std::uint16_t>(d + 6)));
    if (v1) {
        if (crc32_v1(d, n - 4) != take<std::uint32_t>(d + n - 4)) bad("snapshot checksum mismatch (damaged data)");
    } else {
        if (crc32c(0, d, OFF_HEADER_CRC) != take<std::uint32_t>(d + OFF_HEADER_CRC))
            bad("snapshot header checksum mismatch (damaged data)");
        const auto content = take<std::uint16_t>(d + 14);
        if (content & ~CONTENT_FLAGS_KNOWN)
            bad("snapshot content flags " + std::to_string(content) + " are not supported by this build");
    }
    // Rows inline (held mode, every v1) or with their owner (external mode):
    // the snapshot must come from a Stager of this Stager's mode.
    const bool snap_external = !v1 && (take<std::uint16_t>(d + 14) & CONTENT_EXTERNAL_ROWS);
    if (snap_external && !external())
        bad("snapshot holds no rows (taken in external-row mode: the rows stayed with their owner); this Stager "
            "holds its rows (rows='held'): restore it into an external-row Stager");
    if (!snap_external && external())
        bad("snapshot carries its rows (taken in held mode); this Stager runs in external-row mode "
            "(rows='external') and cannot take them: restore it into a held-mode Stager");
    // Token ids beside the rows exactly when this Stager keeps them (a chain drafter's).
    const bool tokens = !v1 && (take<std::uint16_t>(d + 14) & CONTENT_TOKENS);
    if (tokens && opt_.kind != DrafterKind::Chain)
        bad("snapshot carries token ids (taken by a chain drafter's Stager, kind=\"chain\"); this Stager's "
            "drafter kind is \"" + std::string(drafter_kind_name(opt_.kind)) + "\"");
    if (!tokens && opt_.kind == DrafterKind::Chain)
        bad("snapshot carries no token ids (taken by a block drafter's Stager); this Stager serves a chain "
            "drafter (kind=\"chain\"), whose rows need theirs");

    const Fingerprint theirs{take<std::uint32_t>(d + 8), take<std::uint32_t>(d + 16), take<std::uint32_t>(d + 20),
                             take<std::uint32_t>(d + 24), d[12], d[13], d[76], !v1};
    const Fingerprint mine{static_cast<std::uint32_t>(opt_.feature_dim), static_cast<std::uint32_t>(opt_.window),
                           static_cast<std::uint32_t>(opt_.block_size), static_cast<std::uint32_t>(row_bytes_),
                           static_cast<std::uint8_t>(opt_.storage), static_cast<std::uint8_t>(opt_.nonfinite),
                           static_cast<std::uint8_t>(opt_.stage), !v1};
    if (!(theirs == mine))
        bad("snapshot was taken with (" + theirs.str() + ") but this Stager has (" + mine.str() + ")");
    const std::uint32_t flags = take<std::uint32_t>(d + 28);
    // v1: bytes 13..15 and 76..79 reserved; v2: 77..79.
    const bool reserved_set = v1 ? (d[13] || d[14] || d[15] || take<std::uint32_t>(d + 76)) : (d[77] || d[78] || d[79]);
    if (reserved_set || (flags & ~FLAG_BITS)) bad("snapshot has reserved bits set");
    const std::uint64_t n_rows = take<std::uint64_t>(d + 80);
    // Overflow-safe: n_rows must fit the bytes actually present (none in external mode).
    const std::size_t per_row = (external() ? 0 : row_bytes_) + (tokens ? TOKEN_BYTES : 0);
    if (per_row == 0) {
        if (n != header) bad("snapshot length " + std::to_string(n) + " is not its header's " + std::to_string(header) +
                             " bytes (an external-row snapshot holds no rows)");
    } else if (n_rows > (n - header - trailer) / per_row || header + n_rows * per_row + trailer != n)
        bad("snapshot length " + std::to_string(n) + " does not match its " + std::to_string(n_rows) + " rows of " +
            std::to_string(per_row) + " bytes" + (tokens ? " (with their token ids)" : ""));
    const std::int64_t end = take<std::int64_t>(d + 32), horizon = take<std::int64_t>(d + 40);
    const std::int64_t n_cache = take<std::int64_t>(d + 48), pos_base = take<std::int64_t>(d + 56);
    const std::int64_t tentative = take<std::int64_t>(d + 64);
    const std::uint32_t failures = take<std::uint32_t>(d + 72);
    const bool started = flags & FLAG_STARTED;
    bool ok;
    if (started) {
        ok = 0 <= horizon && horizon <= end && 0 <= pos_base && pos_base <= n_cache && n_cache <= end &&
             static_cast<std::uint64_t>(end - horizon) == n_rows &&
             n_rows <= static_cast<std::uint64_t>(opt_.window + opt_.block_size + 1) && 0 <= tentative &&
             tentative <= opt_.block_size + 1 && tentative <= end - n_cache &&
             (tentative == 0 || (flags & FLAG_ACCEPT_OPEN)) &&
             // an accept may leave end as low as this: the horizon must not pass it
             horizon <= (tentative ? end - tentative + 1 : end) && end < MAX_POSITION;
    } else {
        ok = end == 0 && horizon == 0 && n_cache == 0 && pos_base == 0 && tentative == 0 && n_rows == 0 &&
             (flags & ~FLAG_DRAFTING_OFF) == FLAG_FIRST_ROUND && failures == 0;  // a fresh sequence
    }
    if (!ok) bad("snapshot fields are inconsistent");
    return SnapshotFields{v1, header, n_rows, end, horizon, n_cache, pos_base, tentative, failures, flags, started,
                          tokens};
}

std::int64_t Stager::check_restore(std::int64_t seq, const std::uint8_t* d, std::size_t n) const {
    auto lock = lock_seq(seq);
    (void)ready(seq);
    const SnapshotFields f = read_snapshot(d, n);
    const std::size_t rows_bytes = external() ? 0 : static_cast<std::size_t>(f.n_rows) * row_bytes_;
    const std::size_t ids_bytes = f.tokens ? static_cast<std::size_t>(f.n_rows) * TOKEN_BYTES : 0;
    if (!f.v1 && (!external() || f.tokens) &&
        crc32c(crc32c(0, d + f.header, rows_bytes), d + f.header + rows_bytes, ids_bytes) !=
            take<std::uint32_t>(d + OFF_ROWS_CRC))
        bad("snapshot rows checksum mismatch (damaged data)");
    for (std::size_t i = 0; i < ids_bytes; i += TOKEN_BYTES)
        if (take<std::int32_t>(d + f.header + rows_bytes + i) < 0) bad(NEGATIVE_TOKEN);
    return static_cast<std::int64_t>(f.n_rows);
}

void Stager::restore(std::int64_t seq, const std::uint8_t* d, std::size_t n, SlotRun* runs_out,
                     std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    Seq& target = mut(ready(seq));
    if (serial) *serial = 0;
    const SnapshotFields fields = read_snapshot(d, n);
    const bool v1 = fields.v1;
    const std::size_t header = fields.header;
    const std::uint64_t n_rows = fields.n_rows;
    const std::int64_t end = fields.end, horizon = fields.horizon, n_cache = fields.n_cache,
                       pos_base = fields.pos_base, tentative = fields.tentative;
    const std::uint32_t failures = fields.failures, flags = fields.flags;
    const bool started = fields.started;

    // Rows of v2 are checksummed while they are copied (one pass), always
    // into slots that hold no stageable row of this sequence, so damaged data
    // spoils nothing: a ring whose live rows all lie outside slots [0, n) (an
    // emptied one, or one whose rows sit further on) takes them in its own
    // slots; any other takes them in the Stager's spare ring, which is then
    // swapped in, the replaced ring becoming the spare (one per Stager,
    // reused, so memory stays bounded and no restore faults in fresh pages).
    // Either way the rows end at slots [0, n), the layout ring_for gives (the
    // reference's RingModel). Version 1 checksums the whole blob first.
    const std::uint8_t* rows = d + header;
    const std::size_t count = external() ? 0 : static_cast<std::size_t>(n_rows);
    const std::size_t rows_bytes = count * row_bytes_;
    // The token ids (a chain drafter's), copied privately and checksummed
    // after the rows (the caller's buffer may change meanwhile too).
    std::vector<std::int32_t> ids;
    auto take_ids = [&](std::uint32_t crc) {
        if (!fields.tokens || n_rows == 0) return crc;
        ids.resize(static_cast<std::size_t>(n_rows));
        auto* raw = reinterpret_cast<std::uint8_t*>(ids.data());
        crc = crc32c_copy_shared(crc, raw, rows + rows_bytes, ids.size() * TOKEN_BYTES);
        for (std::int32_t& t : ids) t = take<std::int32_t>(reinterpret_cast<const std::uint8_t*>(&t));
        return crc;
    };
    if (v1 && count) {  // checked above, with the header: copy into the ring as it will be
        FeatureBuffer ring = ring_for(target.buf, horizon, count);
        append_rows(ring, rows, count);
        target.buf = std::move(ring);
    } else if (count) {
        FeatureBuffer fresh;
        FeatureBuffer* into = &target.buf;
        std::unique_lock<std::mutex> spare_lock(spare_mu_, std::defer_lock);  // after the sequence's lock
        if (target.buf.capacity() < count) {  // never used: a ring of its own (dropped if the data is bad)
            fresh = new_ring();
            fresh.reserve_back(count, ring_rows_);
            into = &fresh;
        } else if (target.started) {
            // Stageable rows [max(horizon, head), end) in slots [0, count)?
            // (Rows below the horizon are dead: nothing stages, snapshots or
            // brings them back, so they may be overwritten.)
            SlotRun live[2];
            target.buf.runs(std::max(target.horizon, target.buf.head()), target.buf.end(), 0, live);
            const bool clear = (live[0].count == 0 || live[0].first >= static_cast<std::int64_t>(count)) &&
                               live[1].count == 0;  // a second run starts at slot 0
            if (!clear) {
                spare_lock.lock();
                if (spare_.capacity() < count) {
                    spare_ = new_ring();
                    spare_.reserve_back(count, ring_rows_);
                }
                into = &spare_;
            }
        }
        // The caller's buffer may change meanwhile: the checksum must be of the rows kept.
        if (take_ids(crc32c_copy_shared(0, into->front_slots(count), rows, rows_bytes)) !=
            take<std::uint32_t>(d + OFF_ROWS_CRC))
            bad("snapshot rows checksum mismatch (damaged data)");
        if (into == &spare_) std::swap(spare_, target.buf);
        else if (into == &fresh) target.buf = std::move(fresh);
    } else if (!v1 && (!external() || fields.tokens) && take_ids(0) != take<std::uint32_t>(d + OFF_ROWS_CRC)) {
        bad("snapshot rows checksum mismatch (damaged data)");
    }
    for (std::int32_t t : ids)
        if (t < 0) bad(NEGATIVE_TOKEN);

    // Build the new state completely, then swap it in: bad data never
    // leaves the slot half-restored (nothing below can fail).
    Seq s;
    s.started = started;
    s.disabled = flags & FLAG_DISABLED;
    s.restage_owed = started;  // the drafter cache of this slot is unknown
    s.first_round = flags & FLAG_FIRST_ROUND;
    s.accept_open = flags & FLAG_ACCEPT_OPEN;
    s.drafting_off = flags & FLAG_DRAFTING_OFF;
    s.end = end;
    s.horizon = horizon;
    s.n_cache = n_cache;
    s.pos_base = pos_base;
    s.tentative = tentative;
    s.failures = failures;
    s.mismatch_reported = target.mismatch_reported;  // the slot's report, until its begin()
    if (external() || !count) {
        s.buf = ring_for(target.buf, horizon, static_cast<std::size_t>(n_rows));
        if (external() && n_rows) {  // the owner puts the rows back: take their slots, write nothing
            FeatureBuffer::Span x, y;
            s.buf.back_spans(static_cast<std::size_t>(n_rows), x, y);
            s.buf.commit_back(static_cast<std::size_t>(n_rows));
        }
    } else {
        s.buf = std::move(target.buf);  // the rows are in slots [0, count)
        s.buf.reset(horizon);
        s.buf.commit_back(count);
    }
    s.buf.set_tokens(horizon, ids.data(), ids.size());
    if (runs_out) s.buf.runs(horizon, end, slot_base(seq), runs_out);
    retire_stats(target);  // the restored sequence's counters start afresh
    target = std::move(s);
    advance_horizon(target);
    // The owner writes the rows back at those slots: a table change, in order.
    if (external() && n_rows) {
        const std::uint64_t k = next_serial("restore", seq);
        if (serial) *serial = k;
    }
}

}  // namespace dspark
