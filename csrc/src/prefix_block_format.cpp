// PrefixStore's export / import (dspark/prefix_store.hpp): a block as
// checksummed bytes another process's store imports. The byte layout is
// documented in src/dspark_core/prefix/block_format.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "dspark/crc32c.hpp"
#include "dspark/errors.hpp"
#include "dspark/prefix_store.hpp"
#include "le_bytes.hpp"
#include "prefix_store_detail.hpp"

namespace dspark {

using le::put;  // little-endian fields (le_bytes.hpp)
using le::take;
using prefix_detail::bad;
using prefix_detail::fingerprint_text;

namespace {

// Format v1 (prefix/block_format.py).
constexpr char BLOCK_MAGIC[4] = {'D', 'S', 'P', 'B'};
constexpr std::uint16_t BLOCK_VERSION = 1;
constexpr std::size_t BLOCK_HEADER_BYTES = 64;
constexpr std::size_t OFF_BODY_CRC = 56, OFF_HEADER_CRC = 60;

}  // namespace

std::size_t PrefixStore::export_size(std::string_view key) const {
    std::lock_guard<std::mutex> lock(mu_);
    return BLOCK_HEADER_BYTES + key.size() + static_cast<std::size_t>(held(key).rows()) * row_bytes_;
}

std::size_t PrefixStore::export_into(std::string_view key, std::uint8_t* dst, std::size_t cap, const std::uint8_t* rows,
                                     std::size_t rows_bytes) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Block& b = held(key);
    const std::size_t body = static_cast<std::size_t>(b.rows()) * row_bytes_;
    if (external() && (!rows || rows_bytes != body))
        bad("an external-row store exports the rows its owner read from block_slots(key): " + std::to_string(b.rows()) +
            " rows of " + std::to_string(row_bytes_) + " bytes (" + std::to_string(body) + " bytes), got " +
            (rows ? std::to_string(rows_bytes) + " bytes" : std::string("none")));
    if (!external() && (rows || rows_bytes)) bad("a held-row store exports its own rows: pass no rows");
    const std::size_t need = BLOCK_HEADER_BYTES + key.size() + body;
    if (cap < need)
        throw BufferTooSmall("export buffer of " + std::to_string(cap) + " bytes is too small: the block needs " +
                                 std::to_string(need),
                             need);
    std::uint8_t* h = dst;
    std::memset(h, 0, BLOCK_HEADER_BYTES);
    std::memcpy(h, BLOCK_MAGIC, 4);
    put<std::uint16_t>(h + 4, BLOCK_VERSION);
    put<std::uint16_t>(h + 6, static_cast<std::uint16_t>(BLOCK_HEADER_BYTES));
    put<std::uint32_t>(h + 8, static_cast<std::uint32_t>(opt_.feature_dim));
    put<std::uint8_t>(h + 12, static_cast<std::uint8_t>(opt_.storage));
    put<std::uint8_t>(h + 13, static_cast<std::uint8_t>(opt_.nonfinite));
    put<std::uint8_t>(h + 14, static_cast<std::uint8_t>(opt_.stage));
    put<std::uint8_t>(h + 15, static_cast<std::uint8_t>(key.size()));
    put<std::uint32_t>(h + 16, static_cast<std::uint32_t>(opt_.window));
    put<std::uint32_t>(h + 20, static_cast<std::uint32_t>(opt_.block_size));
    put<std::uint32_t>(h + 24, static_cast<std::uint32_t>(row_bytes_));
    put<std::uint32_t>(h + 28, static_cast<std::uint32_t>(opt_.block_tokens));
    put<std::int64_t>(h + 32, b.start);
    put<std::int64_t>(h + 40, b.end);
    put<std::uint32_t>(h + 48, static_cast<std::uint32_t>(b.rows()));
    // 52..55 reserved, zero
    std::uint8_t* out = dst + BLOCK_HEADER_BYTES;
    std::memcpy(out, key.data(), key.size());
    std::uint32_t crc = crc32c(0, out, key.size());
    out += key.size();
    if (external()) {
        crc = crc32c_copy(crc, out, rows, body);
    } else {
        for_each_piece(b.kept, b.pages, [&](const Piece& pc) {
            const std::size_t n = static_cast<std::size_t>(pc.count) * row_bytes_;
            crc = crc32c_copy(crc, out, page_data(pc.page) + static_cast<std::size_t>(pc.off) * row_bytes_, n);
            out += n;
        });
    }
    put<std::uint32_t>(h + OFF_BODY_CRC, crc);
    put<std::uint32_t>(h + OFF_HEADER_CRC, crc32c(0, h, OFF_HEADER_CRC));
    return need;
}

// Every check of an exported block, in order: length of the header, magic,
// version, header size, header checksum, the configuration (fingerprint and
// block_tokens), reserved bytes, the fields' consistency (key length,
// positions, kept rows), total length, the key and rows' checksum.
PrefixStore::ImportPlan PrefixStore::check_import(const std::uint8_t* d, std::size_t n) const {
    if (!d && n) bad("block data is missing");
    if (n < BLOCK_HEADER_BYTES)
        bad("prefix block is truncated: " + std::to_string(n) + " bytes, its header needs " +
            std::to_string(BLOCK_HEADER_BYTES));
    if (std::memcmp(d, BLOCK_MAGIC, 4) != 0) bad("not a dspark_core prefix block (bad magic)");
    const auto version = take<std::uint16_t>(d + 4);
    if (version != BLOCK_VERSION)
        bad("unsupported prefix block version " + std::to_string(version) + " (this build reads " +
            std::to_string(BLOCK_VERSION) + ")");
    if (take<std::uint16_t>(d + 6) != BLOCK_HEADER_BYTES)
        bad("bad prefix block header size " + std::to_string(take<std::uint16_t>(d + 6)));
    if (crc32c(0, d, OFF_HEADER_CRC) != take<std::uint32_t>(d + OFF_HEADER_CRC))
        bad("prefix block header checksum mismatch (damaged data)");
    const std::uint32_t dim = take<std::uint32_t>(d + 8);
    const std::uint8_t st = d[12], nf = d[13], stage = d[14];
    const std::uint32_t window = take<std::uint32_t>(d + 16), block = take<std::uint32_t>(d + 20);
    const bool same_config = dim == opt_.feature_dim && st == static_cast<std::uint8_t>(opt_.storage) &&
                             nf == static_cast<std::uint8_t>(opt_.nonfinite) &&
                             stage == static_cast<std::uint8_t>(opt_.stage) && window == opt_.window &&
                             block == opt_.block_size && take<std::uint32_t>(d + 24) == row_bytes_;
    if (!same_config) {
        const bool known = st < STORAGE_COUNT && nf < NONFINITE_COUNT && stage < ELEM_TYPE_COUNT;
        bad("prefix block was exported with (" +
            (known ? fingerprint_text(dim, static_cast<Storage>(st), static_cast<NonFinite>(nf),
                                      static_cast<ElemType>(stage), window, block)
                   : std::string("unknown storage / policy / dtype codes")) +
            ") but this store has (" +
            fingerprint_text(opt_.feature_dim, opt_.storage, opt_.nonfinite, opt_.stage, opt_.window, opt_.block_size) +
            ")");
    }
    if (take<std::uint32_t>(d + 28) != static_cast<std::uint32_t>(opt_.block_tokens))
        bad("prefix block was exported with block_tokens=" + std::to_string(take<std::uint32_t>(d + 28)) +
            " but this store has block_tokens=" + std::to_string(opt_.block_tokens));
    if (take<std::uint32_t>(d + 52) != 0) bad("prefix block has reserved bytes set");
    ImportPlan ip;
    ip.key_len = d[15];
    ip.start = take<std::int64_t>(d + 32);
    ip.end = take<std::int64_t>(d + 40);
    ip.n_rows = take<std::uint32_t>(d + 48);
    if (ip.key_len < 1 || ip.key_len > PREFIX_MAX_KEY_BYTES || ip.start < 0 || ip.end <= ip.start ||
        ip.end >= MAX_POSITION || ip.start % opt_.block_tokens != 0 || ip.end - ip.start > opt_.block_tokens ||
        static_cast<std::int64_t>(ip.n_rows) != kept_run(ip.start, ip.end).count)
        bad("prefix block fields are inconsistent");
    const std::size_t body = static_cast<std::size_t>(ip.n_rows) * row_bytes_;
    if (n != BLOCK_HEADER_BYTES + ip.key_len + body)
        bad("prefix block length " + std::to_string(n) + " does not match its header (" +
            std::to_string(BLOCK_HEADER_BYTES + ip.key_len + body) + " bytes)");
    if (crc32c(0, d + BLOCK_HEADER_BYTES, ip.key_len + body) != take<std::uint32_t>(d + OFF_BODY_CRC))
        bad("prefix block checksum mismatch (damaged data)");
    ip.rows = d + BLOCK_HEADER_BYTES + ip.key_len;
    return ip;
}

void PrefixStore::import_block(const std::uint8_t* data, std::size_t n, const SlotSink& slots) {
    // A private copy first: the caller's buffer may change while we run (the
    // binding releases the GIL), and the bytes checked must be the bytes kept.
    const std::vector<std::uint8_t> own(data, data + n);
    const std::uint8_t* d = own.data();
    std::lock_guard<std::mutex> lock(mu_);
    const ImportPlan ip = check_import(d, n);
    const std::size_t offsets[2] = {0, ip.key_len};
    const KeyChain chain{d + BLOCK_HEADER_BYTES, offsets, 1};
    const std::vector<PlannedBlock> plan = plan_publish(chain, ip.start, ip.end);
    // The data's rows are the kept rows in position order: row t at t * row_bytes.
    const std::int64_t first = ip.end - static_cast<std::int64_t>(ip.n_rows);
    auto row = [&](std::int64_t pos) { return ip.rows + static_cast<std::size_t>(pos - first) * row_bytes_; };
    check_same_rows(plan, [&](const Piece& pc, const std::uint8_t* held_rows) {
        return std::memcmp(held_rows, row(pc.pos), static_cast<std::size_t>(pc.count) * row_bytes_) == 0;
    }, "");
    // Every check passed: room for the slots (external), then the pages.
    std::int64_t* out = external() ? slots(ip.n_rows) : nullptr;
    reserve_pages(new_pages(plan));
    if (out) std::fill(out, out + ip.n_rows, std::int64_t(-1));
    commit_publish(plan, [&](const Piece& pc, std::uint8_t* dst) {
        if (dst)
            std::memcpy(dst, row(pc.pos), static_cast<std::size_t>(pc.count) * row_bytes_);
        else
            for (std::int64_t i = 0; i < pc.count; ++i) out[pc.pos - first + i] = pc.page * page_rows_ + pc.off + i;
    });
}

std::vector<std::int64_t> PrefixStore::import_block(const std::uint8_t* data, std::size_t n) {
    std::vector<std::int64_t> out;
    import_block(data, n, [&](std::size_t rows) {
        out.resize(rows);
        return out.data();
    });
    return out;
}

}  // namespace dspark
