// The version and git commit of this build. Defined in a .cc generated at build time
// (cmake/version.cmake, library dflash_version), linked only into the binaries, so a new commit
// recompiles one file and relinks the three binaries, not every test.
#pragma once

namespace dflash {
// The project version (CMake's project(VERSION)), e.g. "0.1.0".
const char* build_version();
// `git describe --always --dirty --abbrev=12` of the source tree at build time: the commit's first
// 12 hex digits, "-dirty" when the tree had uncommitted changes; "unknown (...)" outside a checkout.
const char* build_commit();
}  // namespace dflash
