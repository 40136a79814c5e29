// Whether this test binary was built with AddressSanitizer (the `asan` preset of scripts/test).
// The tests that repeat one check many times (the batch-invariance compositions, the CLI's
// invariance checks) run fewer repetitions there, and the CPU direct decode's Llama-shape batch
// shorter contexts (tests/cpu/test_cpu_decode.cpp, which names the cases that keep the path
// covered): that run looks for memory errors and undefined
// behaviour, which the first repetitions already exercise, and each costs 5-10x under ASan; the
// Release run of the same tests keeps the full counts (the bars the issues set).
#pragma once

namespace pagedattn::test_env {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitizedBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif
#else
inline constexpr bool kSanitizedBuild = false;
#endif

}  // namespace pagedattn::test_env
