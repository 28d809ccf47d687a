// Records whose fields are listed once, as X-macros of X(type, name) rows
// (DSPARK_SEQ_STATE_FIELDS, DSPARK_PREFIX_STATS_FIELDS, ...): the C++ struct,
// the C ABI's copy, the binding's dicts and the tests all expand the same
// list, so a field added to it reaches every surface.
#pragma once
#include <cstddef>
#include <type_traits>

namespace dspark {

// One field of a listed record: its name, byte offset and whether it is a
// bool (else std::int64_t). A record's table ends with a {nullptr, 0, false}
// row; the binding walks it to build its dicts and name tuples.
struct FieldInfo {
    const char* name;
    std::size_t offset;
    bool is_bool;
};

}  // namespace dspark

// The struct member of one list row (`DSPARK_FIELDS(type, name)` rows).
#define DSPARK_DECLARE_FIELD(type, name) type name{};
// The FieldInfo row of one field of record T.
#define DSPARK_FIELD_INFO(T, type, name) {#name, offsetof(T, name), std::is_same<type, bool>::value},
// Copies one field between two records of the same list (`to` and `from` in
// scope), converting to the destination's type (the C ABI's int32 flags).
#define DSPARK_COPY_FIELD(type, name) to.name = static_cast<decltype(to.name)>(from.name);
