// What the native unit tests share: CHECK (a failed condition ends the test with its file,
// line and text) and throws<E>(f) (whether f throws an E). Each test is one executable built
// with CMake, linking the engine library, with sanitizers (tests/harness.py: build_native_test).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

template <class E, class F>
bool throws(F f) {
  try {
    f();
  } catch (const E&) {
    return true;
  }
  return false;
}
