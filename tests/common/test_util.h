// Shared gtest helpers: error capture, substring checks and scoped switches, plus everything in files.h.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "core/util/error.h"
#include "core/util/switches.h"
#include "tests/common/files.h"

namespace dflash::testing {

// Runs f, expects it to throw ErrT, returns the message ("" and a test failure otherwise).
template <typename ErrT>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ErrT& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A switch set for one scope (the switch registry reads the environment once).
struct ScopedSwitch {
  ScopedSwitch(const char* name, const char* value) : name_(name) {
    ::setenv(name, value, 1);
    switches::reload();
  }
  ~ScopedSwitch() {
    ::unsetenv(name_);
    switches::reload();
  }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;
  const char* name_;
};

}  // namespace dflash::testing
