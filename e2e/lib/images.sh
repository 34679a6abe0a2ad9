# shellcheck shell=bash
# Shared by e2e/images and e2e/cluster-images: buildah and debootstrap, a slim debootstrap
# rootfs cached as a tar, and its import as an image. The caller defines `log` and may set
# `mirror` (DBOPS_DEBIAN_MIRROR, default deb.debian.org).

mirror=${mirror:-${DBOPS_DEBIAN_MIRROR:-http://deb.debian.org/debian}}
# Debian's buildah runs crun, which refuses this kind of host (cgroup v1 hybrid: "cgroups
# in hybrid mode not supported, drop all controllers from cgroupv2"), so RUN steps and
# `buildah run` use chroot isolation.
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}

# Installs Debian's buildah and debootstrap with apt-get when missing.
ensure_tools() {
  local need=()
  command -v buildah >/dev/null 2>&1 || need+=(buildah)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  if [ ${#need[@]} -gt 0 ]; then
    log "installing Debian packages: ${need[*]}"
    local sudo=
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >&2
  fi
}

# The controllers' base image (e2e/images: BUILDER_IMAGE and RUNTIME_IMAGE), also under
# e2e/cluster-images's s3s-fs: `debootstrap --variant=minbase trixie` with these packages.
base_suite=trixie
base_pkgs=ca-certificates,postgresql-client-17
base_key=minbase-slim-$(printf '%s' "$base_pkgs" | sha256sum | cut -c1-12)
base_image=localhost/dbops-test-base:$base_suite-$base_key

# `buildah run ARGS...` with its output, again (up to 3 times) when it failed before the
# container started because buildah's re-exec could not seal the memfd copy of itself
# (containers/storage's unshare: "sealing memfd copy: Device or resource busy", seen once in
# a CI run on this kernel, 6.18). Any other failure is returned as it is.
brun() {
  local attempt err out rc
  err=$(mktemp)
  for attempt in 1 2 3; do
    rc=0
    out=$(buildah run "$@" 2>"$err") || rc=$?
    if [ "$rc" != 0 ] && [ "$attempt" -lt 3 ] && grep -q 'sealing memfd copy' "$err"; then
      log "buildah run: $(tr '\n' ' ' <"$err")(attempt $attempt; again)"
      continue
    fi
    cat "$err" >&2
    rm -f "$err"
    [ -z "$out" ] || printf '%s\n' "$out"
    return "$rc"
  done
}

image_exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# The value of label $2 of image $1 (empty when the image or the label is missing).
image_label() {
  buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$2\"}}" "$1" 2>/dev/null || true
}

# rootfs_tar SUITE PACKAGES TAR [HOOK]: unless TAR exists, `debootstrap --variant=minbase
# --include=PACKAGES SUITE`, slimmed as Debian's slim images are, then `HOOK <dir>` when
# given (a shell function: more to remove, users to renumber), archived as TAR.
rootfs_tar() {
  local suite=$1 pkgs=$2 tar=$3 hook=${4:-}
  [ -s "$tar" ] && return 0
  local t0 tmp
  t0=$(date +%s)
  tmp="$(dirname "$tar")/rootfs-$suite.partial.$$"
  mkdir -p "$(dirname "$tar")"
  log "debootstrap --variant=minbase --include=$pkgs $suite (first time only)"
  rm -rf "$tmp"
  debootstrap --variant=minbase --include="$pkgs" "$suite" "$tmp" "$mirror" >&2
  # As Debian's slim images: no package archives, no apt lists, and no documentation,
  # manual pages or translations (debuerreotype's slimify), kept out of later installs too.
  rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/cache/apt/*.bin "$tmp"/var/lib/apt/lists/*
  rm -rf "$tmp"/usr/share/doc/* "$tmp"/usr/share/man/* "$tmp"/usr/share/info/* \
    "$tmp"/usr/share/groff/* "$tmp"/usr/share/lintian/* "$tmp"/usr/share/locale/*
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-exclude /usr/share/man/*' \
    'path-exclude /usr/share/info/*' 'path-exclude /usr/share/groff/*' \
    'path-exclude /usr/share/lintian/*' 'path-exclude /usr/share/locale/*' \
    > "$tmp/etc/dpkg/dpkg.cfg.d/docker-slim"
  printf 'deb %s %s main\n' "$mirror" "$suite" > "$tmp/etc/apt/sources.list"
  [ -z "$hook" ] || "$hook" "$tmp"
  tar --numeric-owner --xattrs -C "$tmp" -cf "$tar.partial" .
  mv "$tar.partial" "$tar"
  rm -rf "$tmp"
  log "rootfs $tar: $(du -h "$tar" | cut -f1), $(( $(date +%s) - t0 )) s"
}

# import_rootfs TAR IMAGE: TAR as the one layer of IMAGE (CMD /bin/bash).
import_rootfs() {
  local tar=$1 image=$2 ctr
  log "importing $tar as $image"
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$tar" / >/dev/null
  buildah config --cmd /bin/bash "$ctr"
  buildah commit -q --rm "$ctr" "$image" >/dev/null
}

# ensure_base: the controllers' base image, from its cached rootfs tar
# ($imgcache/rootfs-trixie-<key>.tar), debootstrapped the first time.
ensure_base() {
  local tar="$imgcache/rootfs-$base_suite-$base_key.tar"
  rootfs_tar "$base_suite" "$base_pkgs" "$tar"
  image_exists "$base_image" || import_rootfs "$tar" "$base_image"
}
