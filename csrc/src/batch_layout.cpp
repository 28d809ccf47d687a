// A batch of plans as flat arrays (dspark/stager.hpp, plan_rows / pad_rows /
// paged_rows): the CSR layout of their context rows, the padded one from it,
// and where those rows' KV lives in a paged cache.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/stager.hpp"

namespace dspark {

namespace {

// The context rows of one plan: drafter positions and global slots, in plan order.
void plan_row_values(const RoundPlan& p, std::int32_t* positions, std::int64_t* slots) noexcept {
    if (positions) {
        const std::int64_t lo = p.first_row - p.pos_base;
        for (std::int64_t r = 0; r < p.n_rows; ++r) positions[r] = static_cast<std::int32_t>(lo + r);
    }
    if (slots)
        for (const SlotRun& run : p.slot_runs)
            for (std::int64_t r = 0; r < run.count; ++r) *slots++ = run.first + r;
}

}  // namespace

void plan_rows(const RoundPlan* plans, std::size_t n, std::int64_t* row_offsets, std::int32_t* positions,
               std::int64_t* slots) noexcept {
    std::int64_t at = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (row_offsets) row_offsets[i] = at;
        plan_row_values(plans[i], positions ? positions + at : nullptr, slots ? slots + at : nullptr);
        at += plans[i].n_rows;
    }
    if (row_offsets) row_offsets[n] = at;
}

#define DSPARK_BATCH_ROW_NAME(column, field) #column,
const char* const BATCH_META_ROWS[] = {DSPARK_BATCH_META_ROWS(DSPARK_BATCH_ROW_NAME) "row_offsets", nullptr};
const char* const BATCH_FLAG_ROWS[] = {DSPARK_BATCH_FLAG_ROWS(DSPARK_BATCH_ROW_NAME) nullptr};
#undef DSPARK_BATCH_ROW_NAME
#define DSPARK_PLAN_FIELD_NAME(type, name) #name,
const char* const ROUND_PLAN_FIELDS[] = {DSPARK_ROUND_PLAN_FIELDS(DSPARK_PLAN_FIELD_NAME) nullptr};
#undef DSPARK_PLAN_FIELD_NAME

namespace {

// One row of a batch plan: get(plans[i]) for each plan, as T; returns where the next row starts.
template <class T, class Get>
T* pack_row(const RoundPlan* plans, std::size_t n, T* row, std::size_t row_length, Get get) noexcept {
    for (std::size_t i = 0; i < n; ++i) row[i] = static_cast<T>(get(plans[i]));
    return row + row_length;
}

}  // namespace

void pack_plans(const RoundPlan* plans, std::size_t n, std::int64_t* meta, std::uint8_t* flags,
                std::int32_t* positions, std::int64_t* slots) noexcept {
    std::int64_t* m = meta;  // rows of n + 1 (the last, row_offsets, fills all of them)
    std::uint8_t* f = flags;  // rows of n
#define DSPARK_PACK_META(column, field) m = pack_row(plans, n, m, n + 1, [](const RoundPlan& p) { return p.field; });
#define DSPARK_PACK_FLAG(column, field) f = pack_row(plans, n, f, n, [](const RoundPlan& p) { return p.field; });
    DSPARK_BATCH_META_ROWS(DSPARK_PACK_META)
    DSPARK_BATCH_FLAG_ROWS(DSPARK_PACK_FLAG)
#undef DSPARK_PACK_META
#undef DSPARK_PACK_FLAG
    plan_rows(plans, n, m, positions, slots);  // m: the row_offsets row
}

namespace {

// The padded layout's one rule: a sequence's rows fit in max_rows.
void check_padded(std::int64_t seq, std::size_t i, std::int64_t n_rows, std::size_t max_rows) {
    if (n_rows < 0 || static_cast<std::uint64_t>(n_rows) > max_rows)
        throw std::invalid_argument(batch_context("padded", i, seq) + std::to_string(n_rows) +
                                    " context rows do not fit max_rows (" + std::to_string(max_rows) + ")");
}

template <class T>
void pad_rows_impl(const std::int64_t* seqs, std::size_t n, const std::int64_t* cu, const T* values,
                   std::size_t total, std::size_t max_rows, T* out) {
    bool ok = cu[0] == 0 && static_cast<std::uint64_t>(cu[n]) == total;
    for (std::size_t i = 0; ok && i < n; ++i) ok = cu[i + 1] >= cu[i];
    if (!ok) throw std::invalid_argument("padded: row_offsets must rise from 0 to the " + std::to_string(total) + " rows");
    for (std::size_t i = 0; i < n; ++i) check_padded(seqs[i], i, cu[i + 1] - cu[i], max_rows);
    for (std::size_t i = 0; i < n; ++i) {
        const auto k = static_cast<std::size_t>(cu[i + 1] - cu[i]);
        T* row = out + i * max_rows;
        std::copy(values + cu[i], values + cu[i] + static_cast<std::int64_t>(k), row);
        std::fill(row + k, row + max_rows, T(-1));
    }
}

}  // namespace

void pad_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* row_offsets, const std::int32_t* values,
              std::size_t total, std::size_t max_rows, std::int32_t* out) {
    pad_rows_impl(seqs, n, row_offsets, values, total, max_rows, out);
}

void pad_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* row_offsets, const std::int64_t* values,
              std::size_t total, std::size_t max_rows, std::int64_t* out) {
    pad_rows_impl(seqs, n, row_offsets, values, total, max_rows, out);
}

void paged_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* pos_base, const std::int64_t* row_offsets,
                const std::int32_t* positions, std::size_t total, const std::int32_t* block_tables, std::size_t m,
                std::size_t table_stride, std::int64_t block_tokens, std::int32_t null_block, std::int32_t* shifted_out,
                std::int64_t* slots_out) {
    if (block_tokens < 1) throw std::invalid_argument("paged: block_tokens must be at least 1, got " + std::to_string(block_tokens));
    const std::int64_t* cu = row_offsets;
    bool ok = cu[0] == 0 && static_cast<std::uint64_t>(cu[n]) == total;
    for (std::size_t i = 0; ok && i < n; ++i) ok = cu[i + 1] >= cu[i];
    if (!ok) throw std::invalid_argument("paged: row_offsets must rise from 0 to the " + std::to_string(total) + " rows");
    // Every row checked before anything is written: a refused batch leaves both outputs as they were.
    const auto cols = static_cast<std::int64_t>(m);
    for (std::size_t i = 0; i < n; ++i) {
        if (pos_base[i] < 0 && cu[i + 1] > cu[i])
            throw std::invalid_argument(batch_context("paged", i, seqs[i]) + "a skipped plan (pos_base " +
                                        std::to_string(pos_base[i]) + ") has no rows, got " +
                                        std::to_string(cu[i + 1] - cu[i]));
        for (std::int64_t r = cu[i]; r < cu[i + 1]; ++r) {
            const std::int64_t p = positions[r];
            if (p < 0 || p / block_tokens >= cols)
                throw std::invalid_argument(batch_context("paged", i, seqs[i]) + "drafter position " + std::to_string(p) +
                                            " lies outside the " + std::to_string(m) + " blocks of " +
                                            std::to_string(block_tokens) + " positions of its block table");
        }
    }
    // shift: columns [shift, m) of the table, then null blocks (the window starts past them).
    std::vector<std::int32_t> row(m);
    for (std::size_t i = 0; i < n; ++i) {
        const std::int32_t* table = block_tables + i * table_stride;
        const std::int64_t shift = pos_base[i] < 0 ? cols : std::min(pos_base[i] / block_tokens, cols);
        std::int32_t* shifted = shifted_out ? shifted_out + i * m : row.data();
        std::copy(table + shift, table + cols, shifted);
        std::fill(shifted + (cols - shift), shifted + cols, null_block);
        if (slots_out)
            for (std::int64_t r = cu[i]; r < cu[i + 1]; ++r) {
                const std::int64_t p = positions[r];
                slots_out[r] = static_cast<std::int64_t>(shifted[p / block_tokens]) * block_tokens + p % block_tokens;
            }
    }
}

}  // namespace dspark
