// Internal: what each kernel family tells the dispatch registry about its
// path tables (dispatch.cpp lists the families and their paths).
#pragma once

namespace dspark {
namespace detail {

// Name of kernel `k` of the family's path tables, or nullptr past the last;
// and the name of the path whose code path `path`'s table runs for it (the
// registry passes supported paths only). Defined next to the tables.
const char* row_format_kernel_name(int k) noexcept;
const char* row_format_kernel_origin(int k, int path) noexcept;
const char* crc32c_kernel_name(int k) noexcept;
const char* crc32c_kernel_origin(int k, int path) noexcept;

}  // namespace detail
}  // namespace dspark
