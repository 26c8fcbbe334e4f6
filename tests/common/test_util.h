// Shared gtest helpers: error capture and substring checks, plus everything in files.h.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/util/error.h"
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

}  // namespace dflash::testing
