// A tiny self-contained test harness for the core's ctest executables (no
// third-party framework: nothing is downloaded at build time).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace dspark_test {
struct Case { const char* name; std::function<void()> fn; };
inline std::vector<Case>& registry() { static std::vector<Case> r; return r; }
inline int& failures() { static int f = 0; return f; }
struct Register { Register(const char* n, std::function<void()> f) { registry().push_back({n, std::move(f)}); } };
inline int run_all() {
    int failed_cases = 0;
    for (auto& c : registry()) {
        int before = failures();
        try { c.fn(); } catch (const std::exception& e) {
            std::printf("  unexpected exception in %s: %s\n", c.name, e.what()); ++failures();
        }
        bool ok = failures() == before;
        if (!ok) ++failed_cases;
        std::printf("%s %s\n", ok ? "[ OK ]" : "[FAIL]", c.name);
    }
    std::printf("%zu passed, %d failed\n", registry().size() - failed_cases, failed_cases);
    return failed_cases ? 1 : 0;
}
}  // namespace dspark_test

#define DSPARK_CAT2(a, b) a##b
#define DSPARK_CAT(a, b) DSPARK_CAT2(a, b)
#define TEST_CASE(name) \
    static void name(); \
    static dspark_test::Register DSPARK_CAT(reg_, name)(#name, name); \
    static void name()
#define CHECK(cond) do { if (!(cond)) { std::printf("  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); ++dspark_test::failures(); } } while (0)
#define CHECK_EQ(a, b) do { auto _va = (a); auto _vb = (b); if (!(_va == _vb)) { std::printf("  %s:%d: CHECK_EQ(%s, %s) failed: %lld vs %lld\n", __FILE__, __LINE__, #a, #b, (long long)_va, (long long)_vb); ++dspark_test::failures(); } } while (0)
#define CHECK_THROWS(expr, Exc) do { bool _thrown = false; try { (void)(expr); } catch (const Exc&) { _thrown = true; } catch (...) {} if (!_thrown) { std::printf("  %s:%d: %s did not throw %s\n", __FILE__, __LINE__, #expr, #Exc); ++dspark_test::failures(); } } while (0)
#define TEST_MAIN() int main() { return dspark_test::run_all(); }
