# shellcheck shell=bash
# Shared by e2e/images and e2e/cluster: a release's commit. The caller defines `die`.

# release_commit REPO REF: prints REF's commit. A release listed in e2e/releases is found
# by its recorded commit when the clone has no tags (and must match its tag when it has);
# any other REF is whatever git resolves.
release_commit() {
  local repo=$1 ref=$2 recorded tagged
  recorded=$(awk -v ref="$ref" '!/^#/ && $1 == ref { print $2 }' "$repo/e2e/releases")
  tagged=$(git -C "$repo" rev-parse --verify --quiet "$ref^{commit}" || true)
  if [ -n "$recorded" ]; then
    if [ -n "$tagged" ] && [ "$tagged" != "$recorded" ]; then
      die "$ref names $tagged here but e2e/releases records $recorded"
    fi
    git -C "$repo" cat-file -e "$recorded^{commit}" 2>/dev/null \
      || die "release $ref ($recorded) is not in this clone's history (a shallow clone? git fetch --unshallow)"
    printf '%s\n' "$recorded"
  elif [ -n "$tagged" ]; then
    printf '%s\n' "$tagged"
  else
    die "no commit $ref in $repo, and e2e/releases does not list it"
  fi
}
