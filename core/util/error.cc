#include "core/util/error.h"

#include <cstring>

namespace dflash {

int exit_code_for(const std::exception& e) {
  if (auto* de = dynamic_cast<const Error*>(&e)) return de->code();
  const char* w = e.what();
  if (std::strstr(w, "CUDA out of memory") || std::strstr(w, "OutOfMemoryError")) return kExitOom;
  return kExitFailure;
}

}  // namespace dflash
