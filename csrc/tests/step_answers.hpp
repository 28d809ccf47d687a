// One device step's answers for n entries, in host vectors: every output of
// the core's list (DSPARK_STEP_OUTPUT_FIELDS), as the C++ API's
// device_step::Outputs and the C ABI's dspark_step_out (which name their
// fields alike) point at them. Shared by the C ABI's device-step test and
// the C ABI fuzz target, which compare the two APIs' answers.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "dspark/dspark.h"
#include "dspark/step_math.hpp"

namespace step_test {

struct StepAnswers {
#define DSPARK_ANSWER_MEMBER(type, name, shape) std::vector<type> name;
    DSPARK_STEP_OUTPUT_FIELDS(DSPARK_ANSWER_MEMBER)
#undef DSPARK_ANSWER_MEMBER

    // Every element `fill` (a value no step writes, so an unwritten one shows).
    StepAnswers(std::size_t n, std::size_t max_rows, std::size_t block, std::int64_t fill = 99) {
        auto elems = [&](const char* shape) {
            if (std::strcmp(shape, "n,max_rows") == 0) return n * max_rows;
            if (std::strcmp(shape, "n,block") == 0) return n * block;
            if (std::strcmp(shape, "n,block+1") == 0) return n * (block + 1);
            return n;
        };
#define DSPARK_ANSWER_SIZE(type, name, shape) name.assign(elems(shape), static_cast<type>(fill));
        DSPARK_STEP_OUTPUT_FIELDS(DSPARK_ANSWER_SIZE)
#undef DSPARK_ANSWER_SIZE
    }
    dspark_step_out c() {
        dspark_step_out o{};
#define DSPARK_ANSWER_PTR(type, name, shape) o.name = name.data();
        DSPARK_STEP_OUTPUT_FIELDS(DSPARK_ANSWER_PTR)
        return o;
    }
    dspark::device_step::Outputs cpp() {
        dspark::device_step::Outputs o;
        DSPARK_STEP_OUTPUT_FIELDS(DSPARK_ANSWER_PTR)
#undef DSPARK_ANSWER_PTR
        return o;
    }
    bool operator==(const StepAnswers& o) const {
        bool same = true;
#define DSPARK_ANSWER_SAME(type, name, shape) same = same && name == o.name;
        DSPARK_STEP_OUTPUT_FIELDS(DSPARK_ANSWER_SAME)
#undef DSPARK_ANSWER_SAME
        return same;
    }
};

}  // namespace step_test
