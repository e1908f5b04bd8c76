#!/bin/bash
# Build every commit of the series in an editing repository, one after another, so that each
# pull request of docs/UPSTREAM.md is known to build on its own (not only the whole series).
#
#   scripts/build_each_commit.sh REPO BUILD_DIR [FIRST]
#
# REPO: the editing repository (`patch apply --git` or `source fetch` + `git am` of the series),
#   its first commit the pin and its branch checked out; BUILD_DIR: a CMake build of it, configured
#   once with -G Ninja -DLLAMA_BUILD_TESTS=ON; FIRST: the commit to start from (1 = the first patch).
# Prints one line per commit: its number, subject, OK/FAIL and the count of compiler warnings in
# the files of the tree (src, ggml, include, common, tools, tests); a log per commit in
# BUILD_DIR/each-commit/. The branch is checked out again at the end.
set -u
REPO=$(realpath "$1"); BUILD=$(realpath "$2"); FIRST=${3:-1}
LOGS=$BUILD/each-commit
mkdir -p "$LOGS"
cd "$REPO"
BRANCH=$(git rev-parse --abbrev-ref HEAD)
PIN=$(git rev-list --max-parents=0 HEAD)
i=0
status=0
for commit in $(git rev-list --reverse "$PIN..$BRANCH"); do
  i=$((i + 1))
  [ $i -lt "$FIRST" ] && continue
  git checkout -q "$commit" || { echo "$i checkout failed"; status=1; break; }
  targets="ggml ggml-base ggml-cpu llama llama-common llama-bench llama-fit-params test-backend-ops test-llama-archs"
  [ -f tests/test-backend-sched.cpp ] && targets="$targets test-backend-sched"
  log=$LOGS/$(printf "%02d" $i).log
  if ninja -C "$BUILD" $targets > "$log" 2>&1; then result=OK; else result=FAIL; status=1; fi
  warnings=$(grep -E "^$REPO/(src|ggml|include|common|tools|tests)/.*warning:" "$log" | sort -u | wc -l)
  [ "$warnings" -gt 0 ] && status=1
  echo "$i $(git log -1 --format=%s "$commit") $result warnings=$warnings"
done
git checkout -q "$BRANCH"
exit $status
