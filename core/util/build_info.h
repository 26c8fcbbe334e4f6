// The identity of this build: the project version and the git commit the sources came from. The
// one source of it for `--version`, the dflash_build_info metric and an export's provenance.
// Defined in a .cc generated at every build by cmake/build_info.cmake (library dflash_build_info):
// rewritten only when the commit or the dirty state changes, so a new commit without re-running
// cmake still shows everywhere, and an unchanged one recompiles nothing.
#pragma once

#include <string>

namespace dflash::build_info {
// The project version (CMake's project(VERSION)), e.g. "0.1.0".
const char* version();
// `git rev-parse HEAD` of the source tree at build time (40 hex digits), or "unknown" when the tree
// had no git metadata. A tree copied with its .git reports that .git's HEAD.
const char* commit();
// Whether a tracked file differed from commit() at build time (false when commit() is "unknown").
bool dirty();
// commit() with "-dirty" appended when dirty(): what --version, dflash_build_info{commit} and an
// export's provenance (dflash_commit) show.
inline std::string identity() { return std::string(commit()) + (dirty() ? "-dirty" : ""); }
}  // namespace dflash::build_info
