// UTF-8 checks for text that ends up in JSON (records, summaries, error messages).
//
// JSON text is UTF-8; a string with other bytes cannot be written as JSON (the JSON library throws
// its own exception type). Text from outside (config values, input lines, file names) is checked
// with utf8_error_at at the edge and refused with an error naming the field; utf8_printable makes
// such text safe to quote inside an error message.
#pragma once
#include <cstddef>
#include <cstdio>
#include <string>

namespace dflash {

// Index of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or std::string::npos when the text is well formed.
inline size_t utf8_error_at(const char* data, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string::npos;
}
inline size_t utf8_error_at(const std::string& s) { return utf8_error_at(s.data(), s.size()); }

// `s` with every byte that is not part of well-formed UTF-8 written as "\xNN" (the well-formed
// parts are kept as they are). The result is always well-formed UTF-8.
inline std::string utf8_printable(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t bad = utf8_error_at(s.data() + i, s.size() - i);
    if (bad == std::string::npos) {
      out.append(s, i, std::string::npos);
      break;
    }
    out.append(s, i, bad);
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(s[i + bad]));
    out += buf;
    i += bad + 1;
  }
  return out;
}

}  // namespace dflash
