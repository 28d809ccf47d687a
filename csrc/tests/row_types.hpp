// Test data in every row element type, for the CUDA kernels' host tests.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "dspark/row_format.hpp"

namespace dspark_test {

// The values `x` in element type `et` (f16 / bf16 via the CPU's encoder,
// keeping NaN / Inf).
inline std::vector<std::uint8_t> as_type(const std::vector<float>& x, dspark::ElemType et) {
    std::vector<std::uint8_t> out(x.size() * dspark::elem_bytes(et));
    if (et == dspark::ElemType::F32) std::memcpy(out.data(), x.data(), out.size());
    else
        dspark::encode_rows(x.data(), dspark::ElemType::F32, out.data(), static_cast<dspark::Storage>(et), 1, x.size(),
                            dspark::NonFinite::Error);
    return out;
}

}  // namespace dspark_test
