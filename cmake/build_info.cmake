# Writes OUT (core/util/build_info.h's definitions: dflash::build_info::version(), commit(), dirty())
# from VERSION and the git metadata of SOURCE_DIR. Run by `cmake -P` at every build (target
# dflash_build_info_gen); OUT is rewritten only when its text changes, so a build at the same commit
# recompiles nothing and a new commit recompiles this one file and relinks what links it.
#
# The commit is `git rev-parse HEAD` of the .git found in SOURCE_DIR; "dirty" is whether a tracked
# file differs from that commit (`git status --porcelain --untracked-files=no`). A tree without git
# metadata gets the commit "unknown". A tree copied with an older .git (a GPU host's copy) reports
# that .git's HEAD, and "dirty" as soon as a copied file differs from it.
set(ENV{GIT_OPTIONAL_LOCKS} 0)  # never take index.lock: other git commands may run in the checkout
set(git git -c "safe.directory=${SOURCE_DIR}" -C "${SOURCE_DIR}")
execute_process(COMMAND ${git} rev-parse --verify HEAD
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
set(dirty false)
if(NOT rc EQUAL 0 OR NOT commit MATCHES "^[0-9a-f]+$")
  set(commit "unknown")
else()
  execute_process(COMMAND ${git} status --porcelain --untracked-files=no
                  OUTPUT_VARIABLE changes RESULT_VARIABLE rc ERROR_QUIET)
  if(NOT rc EQUAL 0 OR NOT changes STREQUAL "")
    set(dirty true)
  endif()
endif()
set(text "// Generated at build time by cmake/build_info.cmake from the git metadata; do not edit.
#include \"core/util/build_info.h\"

namespace dflash::build_info {
const char* version() { return \"${VERSION}\"; }
const char* commit() { return \"${commit}\"; }
bool dirty() { return ${dirty}; }
}  // namespace dflash::build_info
")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
