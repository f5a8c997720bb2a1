#!/usr/bin/env bash
# A minimal Debian base image built from the Debian package archive, for machines that reach the
# Debian archive but no image registry (so `python:3.11-slim` cannot be pulled).
#
#   sudo ops/build_base_image.sh [--mirror URL] [--suite SUITE] [--tag IMAGE]
#
# debootstrap (minbase) installs python3, python3-venv (pip comes from Debian's python3-pip-whl)
# and ca-certificates into a fresh root filesystem, apt inside it is pointed at the same archive
# (plus the suite's -updates and -security sources when this machine's apt uses them), and the
# tree is `docker import`ed as IMAGE (default pagedkv-base:SUITE). ops/Dockerfile builds on it with
# `--build-arg BASE_IMAGE=pagedkv-base:SUITE`.
#
# The mirror and suite default to the Debian archive this machine's apt already uses
# (`apt-get indextargets`); where apt has none, debootstrap's own default mirror is used.
# Needs root, debootstrap, the debian-archive-keyring and a running Docker daemon.
set -euo pipefail

mirror="" suite="" tag=""
while [ $# -gt 0 ]; do
    case "$1" in
        --mirror) mirror="${2:?--mirror needs a URL}"; shift 2 ;;
        --suite) suite="${2:?--suite needs a suite name, e.g. bookworm}"; shift 2 ;;
        --tag) tag="${2:?--tag needs an image name}"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "build_base_image.sh: unknown argument '$1' (--mirror URL, --suite SUITE, --tag IMAGE)" >&2; exit 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || { echo "build_base_image.sh: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build_base_image.sh: install debootstrap (apt-get install debootstrap)" >&2; exit 1; }

# "SITE RELEASE" of every Debian binary-package source apt knows, e.g. "<mirror>/debian bookworm-updates".
apt_sources() {
    apt-get indextargets --format '$(SITE) $(RELEASE)' 'Created-By: Packages' 2>/dev/null | sort -u
}

if [ -z "$suite" ]; then
    # the host's own release, when the archive apt uses carries it
    suite=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
    suite=${suite:-$(apt_sources | awk '$2 !~ /-/ {print $2; exit}')}
    [ -n "$suite" ] || { echo "build_base_image.sh: cannot tell the Debian suite; give --suite" >&2; exit 2; }
fi
if [ -z "$mirror" ]; then
    mirror=$(apt_sources | awk -v s="$suite" '$2 == s {print $1; exit}')
fi
tag=${tag:-pagedkv-base:$suite}

rootfs=$(mktemp -d /tmp/pagedkv-rootfs.XXXXXX)
trap 'rm -rf --one-file-system "$rootfs"' EXIT

echo "== debootstrap $suite from ${mirror:-the default mirror of debootstrap} into $rootfs"
start=$SECONDS
debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv \
    "$suite" "$rootfs" ${mirror:+"$mirror"}

# apt inside the image: the archive it was built from, plus this suite's updates and security
# sources where this machine's apt has them.
{
    apt_sources | awk -v s="$suite" -v m="$mirror" '
        $2 == s || $2 == s "-updates" || $2 == s "-security" {print "deb " $1 " " $2 " main"; seen[$2] = 1}
        END {if (!seen[s] && m != "") print "deb " m " " s " main"}'
} > "$rootfs/etc/apt/sources.list.new"
if [ -s "$rootfs/etc/apt/sources.list.new" ]; then
    mv "$rootfs/etc/apt/sources.list.new" "$rootfs/etc/apt/sources.list"
else
    rm "$rootfs/etc/apt/sources.list.new"  # keep the one debootstrap wrote
fi
echo "== apt sources in the image:"; cat "$rootfs/etc/apt/sources.list"
chroot "$rootfs" apt-get update -q
DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get upgrade -y -q
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/* "$rootfs"/tmp/*

echo "== docker import $tag"
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $suite ${mirror:-(default mirror)} + python3, python3-venv" \
    - "$tag"
docker image ls "$tag"
echo "== $tag built in $((SECONDS - start)) s"
