# Writes OUT (a .cc defining dflash::build_version() and build_commit()) from VERSION and the git
# commit of SOURCE_DIR, at build time; the file is rewritten only when its text changes, so a build
# at the same commit recompiles nothing and a new commit recompiles this one file.
execute_process(COMMAND git -C "${SOURCE_DIR}" describe --always --dirty --abbrev=12 --match=NO-TAGS
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown (not built from a git checkout)")
endif()
set(text "// Generated at build time by cmake/version.cmake; do not edit.\n#include \"core/util/version.h\"\n\nnamespace dflash {\nconst char* build_version() { return \"${VERSION}\"; }\nconst char* build_commit() { return \"${commit}\"; }\n}  // namespace dflash\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
