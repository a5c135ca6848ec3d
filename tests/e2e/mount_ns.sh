# Sourced first (before anything else runs) by a test that needs small, really full file systems:
# re-executes the calling script, with its arguments, in a private mount namespace (root, or an
# unprivileged user namespace) where it may mount tmpfs file systems of any size, which vanish with
# the namespace. Exits 77 (skipped) where this machine cannot mount a tmpfs.
if [ "${T3D_IN_MOUNT_NS:-}" != 1 ]; then
  t3d_ns=(unshare -m)
  [ "$(id -u)" -eq 0 ] || t3d_ns=(unshare -rm)
  t3d_probe=$(mktemp -d)
  if ! "${t3d_ns[@]}" sh -c "mount -t tmpfs -o size=64k tmpfs '$t3d_probe'" 2>"$t3d_probe.err"; then
    echo "SKIP: cannot mount a tmpfs in a private mount namespace here ($(head -1 "$t3d_probe.err"))"
    rm -rf "$t3d_probe" "$t3d_probe.err"
    exit 77
  fi
  rm -rf "$t3d_probe" "$t3d_probe.err"
  exec env T3D_IN_MOUNT_NS=1 "${t3d_ns[@]}" "$0" "$@"
fi
# full_tmpfs DIR KB: a tmpfs of KB KiB mounted at DIR (created).
full_tmpfs() { mkdir -p "$1" && mount -t tmpfs -o size="$2"k tmpfs "$1"; }
# small_ext4 DIR KB: an ext4 file system of KB KiB (an image file DIR.img on a loop device, no
# blocks reserved for root) mounted at DIR, for what a tmpfs does not show (blocks allocated ahead,
# kept past a failed fallocate). Fails, saying why on stderr, where no loop device can be mounted
# (an unprivileged user namespace, a container without /dev/loop*): the caller skips.
small_ext4() {
  mkdir -p "$1" && rm -f "$1.img" && truncate -s "$2"k "$1.img" &&
    mkfs.ext4 -q -F -m 0 "$1.img" && mount -o loop "$1.img" "$1"
}
# fill DIR: takes every free block of DIR's file system (the file `fill`), so the next write fails.
fill() { dd if=/dev/zero of="$1/fill" bs=4k >/dev/null 2>&1; true; }
