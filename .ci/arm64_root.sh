#!/usr/bin/env bash
# An arm64 Debian 12 root with Python 3.11 (interpreter, standard library,
# headers) in DIR, for running and building aarch64 code on an x86-64 host:
# qemu-aarch64 -L DIR DIR/usr/bin/python3.11 runs the interpreter (qemu-user,
# no chroot, no binfmt). debootstrap's first stage downloads the packages
# from the Debian mirror apt is configured with; every package is then only
# unpacked (no maintainer scripts run, nothing needs to execute arm64 code).
#
#   .ci/arm64_root.sh DIR
set -euo pipefail
dir=${1:?target directory}
if [ -x "$dir/usr/bin/python3.11" ] && [ -f "$dir/usr/include/python3.11/Python.h" ]; then
  echo "arm64 root: $dir (exists)"
  exit 0
fi
# The mirror of this machine's apt sources (deb822 or one-line format).
mirror=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[ -n "$mirror" ] || { echo "arm64_root.sh: no Debian mirror in the apt sources" >&2; exit 1; }
rm -rf "$dir"
debootstrap --foreign --arch=arm64 --variant=minbase --include=python3.11,libpython3.11-dev \
  bookworm "$dir" "$mirror" >"$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
for deb in "$dir"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$dir"; done
rm -f "$dir"/var/cache/apt/archives/*.deb
echo "arm64 root: $dir ($(du -sh "$dir" | cut -f1))"
