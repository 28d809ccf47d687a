// Which sequence locks a call takes, and in which order, shown without
// relying on a race (stager.hpp, "Thread safety"). A draft's row sink runs
// under the locks of its sequences, so a Holder keeps a chosen set of
// sequences locked while other calls are watched: a call that needs one of
// them must not complete before the Holder lets go; a call that does not
// must complete at once. (A random four-thread race caught the two mutants
// below only now and then: a hang in 4 of 40 runs, a crash in 1 of 40.)
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "check.hpp"
#include "dspark/stager.hpp"

using namespace dspark;
using namespace std::chrono_literals;

namespace {

// How long a blocked call is watched before it counts as waiting, and how
// long a free one may take (a loaded CI machine: generous).
constexpr auto BLOCKED_FOR = 300ms;
constexpr auto FREE_WITHIN = 10s;

StagerOptions opts() {
    StagerOptions o;
    o.feature_dim = 32;
    o.block_size = 2;
    o.window = 16;
    o.max_seqs = 4;
    return o;
}

struct Rejected {};

// Holds the locks of `seqs` (a draft_many_into whose sink waits, then
// rejects the call: nothing changes) until release().
class Holder {
public:
    Holder(Stager& st, std::vector<std::int64_t> seqs) : seqs_(std::move(seqs)), n_pasts_(seqs_.size(), 0) {
        std::promise<void> entered;
        auto inside = entered.get_future();
        thread_ = std::thread([this, &st, p = std::move(entered)]() mutable {
            std::vector<RoundPlan> plans;
            try {
                st.draft_many_into(seqs_.data(), n_pasts_.data(), seqs_.size(), plans,
                                   [&](const RoundPlan*, std::size_t) -> std::uint8_t* {
                                       p.set_value();
                                       go_.get_future().wait();
                                       throw Rejected{};
                                   });
            } catch (const Rejected&) {
            }
        });
        inside.wait();
    }
    void release() {
        if (thread_.joinable()) {
            go_.set_value();
            thread_.join();
        }
    }
    ~Holder() { release(); }

private:
    std::vector<std::int64_t> seqs_, n_pasts_;
    std::promise<void> go_;
    std::thread thread_;
};

template <class F>
std::future<void> start(F&& f) {
    return std::async(std::launch::async, std::forward<F>(f));
}

bool waits(std::future<void>& f) { return f.wait_for(BLOCKED_FOR) == std::future_status::timeout; }
bool completes(std::future<void>& f) { return f.wait_for(FREE_WITHIN) == std::future_status::ready; }

}  // namespace

// A batch takes its locks in increasing id order: with sequence 1 held, a
// batch over {1, 0} waits on 1 while holding 0, so a call on 0 waits too. (A
// batch locking in decreasing order would wait on 1 holding nothing, and two
// such batches could deadlock against one locking the other way.)
TEST_CASE(a_batch_locks_in_increasing_id_order) {
    Stager st(opts());
    Holder hold(st, {1});
    const std::int64_t both[] = {1, 0};
    std::uint64_t rounds[2];
    auto batch = start([&] { st.open_round_ids(both, 2, rounds); });
    // Probe sequence 0 until a probe waits: the batch has taken 0 by then.
    std::vector<std::future<void>> probes;
    bool zero_held = false;
    const auto deadline = std::chrono::steady_clock::now() + FREE_WITHIN;
    while (!zero_held && std::chrono::steady_clock::now() < deadline) {
        probes.push_back(start([&] { (void)st.state(0); }));
        zero_held = waits(probes.back());
    }
    CHECK(zero_held);
    CHECK(waits(batch));
    hold.release();
    CHECK(completes(batch));
    for (auto& p : probes) CHECK(completes(p));
}

// Sequences outside a held batch are free.
TEST_CASE(other_sequences_are_free_while_a_batch_is_held) {
    Stager st(opts());
    Holder hold(st, {0, 2});
    auto free_call = start([&] { (void)st.state(3); });
    CHECK(completes(free_call));
    auto other_fork = start([&] { (void)st.fork(1, 3); });
    CHECK(completes(other_fork));
    auto held_call = start([&] { (void)st.state(2); });
    CHECK(waits(held_call));
    hold.release();
    CHECK(completes(held_call));
}

// fork locks both its source and its child.
TEST_CASE(fork_locks_its_source_and_its_child) {
    for (const std::int64_t held : {std::int64_t(0), std::int64_t(2)}) {
        Stager st(opts());
        Holder hold(st, {held});
        auto fork = start([&] { (void)st.fork(0, 2); });
        CHECK(waits(fork));
        hold.release();
        CHECK(completes(fork));
    }
}

TEST_MAIN()
