// Overflow-checked arithmetic for sizes and offsets read from files and wire buffers.
//
// Every size or offset that comes from bytes we do not control (a shard index, a packed batch
// header, a checkpoint's shapes) goes through these before it is compared, used as an address or
// allocated: a value that wraps 2^64 would otherwise pass a bounds check and point anywhere.
//
// Contract: each function returns the exact mathematical result, or throws dflash::DataError
// (exit code 4) whose message is `what` followed by the operands ("<what>: 18446744073709551615 +
// 2 overflows 64 bits"). `what` (anything an ostream prints) should name the file (or buffer) and
// the field; it is only formatted on failure, so the success path allocates nothing.
#pragma once
#include <cstdint>
#include <type_traits>

#include "core/util/error.h"

namespace dflash {

namespace detail {
// One checked operation: `op` is __builtin_add_overflow or __builtin_mul_overflow's wrapper below.
template <class T, class What, class Op>
T checked(T a, T b, const What& what, const char* sign, Op op) {
  static_assert(std::is_integral<T>::value, "checked arithmetic: integers only");
  T r;
  DFLASH_CHECK(!op(a, b, &r), DataError,
               what << ": " << a << ' ' << sign << ' ' << b << " overflows " << 8 * sizeof(T) << " bits");
  return r;
}
}  // namespace detail

template <class T, class What>
T checked_add(T a, T b, const What& what) {
  return detail::checked(a, b, what, "+", [](T x, T y, T* r) { return __builtin_add_overflow(x, y, r); });
}

template <class T, class What>
T checked_mul(T a, T b, const What& what) {
  return detail::checked(a, b, what, "*", [](T x, T y, T* r) { return __builtin_mul_overflow(x, y, r); });
}

// True when [offset, offset + length) lies inside [0, size); no sum is formed, so nothing wraps.
inline bool range_within(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

}  // namespace dflash
