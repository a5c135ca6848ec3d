#!/usr/bin/env bash
# A snapshot that fits on a nearly full ext4 is written (checkpoint/h5_direct_driver.h): the shard
# writer allocates only its raw bytes ahead, cuts what is left over before the index and `latest`,
# and where even that is refused (ENOSPC; ext4 keeps what a failed fallocate took) releases it and
# writes through the page cache. On small ext4 images (loop devices, a private mount namespace):
#  1. 6 MiB (~4.5 MB free), tiny.toml, two 1.7 MB snapshots (the second beside the first until
#     retention): both commit, exit 0; the shard takes no more blocks than its size.
#  2. Deflated shards on a disk filled to leave less than the shard's uncompressed bytes (what is
#     allocated ahead) but more than the deflated snapshot takes: it commits, exit 0.
# Skipped (exit 77) where this machine cannot mount an ext4 image.
set -u
source "$(dirname "$0")/../e2e/mount_ns.sh"
source "$(dirname "$0")/common.sh"
command -v mkfs.ext4 > /dev/null || { echo "SKIP: mkfs.ext4 is not installed"; exit 77; }
if ! small_ext4 "$work/probe" 1024 2> "$work/probe.err"; then
  echo "SKIP: cannot mount an ext4 image on a loop device here ($(head -1 "$work/probe.err"))"
  exit 77
fi
umount "$work/probe"
base=(train "$recipe" "${common[@]}" --set train.steps=2 --set snapshot.every=1
      --set snapshot.keep=1 --set snapshot.full_every=1)
# committed WHAT RUN_LOG MNT STEP RC: exit 0, no failed snapshot, STEP's index in MNT verifies and
# `latest` names it.
committed() {
  local what=$1 log=$2 mnt=$3 step=$4 rc=$5 idx
  idx=$mnt/$(printf 'step_%08d.h5' "$step")
  check "[ $rc -eq 0 ] && ! grep -qi 'failed\|no space' $log" "$what: exit 0, no snapshot failed (rc $rc)" ||
    tail -5 "$log"
  check "timeout 60 $titan3d export $idx --out $work/hf_$step >/dev/null 2>&1 && rm -rf $work/hf_$step" \
    "$what: $(basename "$idx") is committed and verifies"
  check "[ \"\$(cat $mnt/latest 2>/dev/null)\" = $(basename "$idx") ]" "$what: latest names it"
}
# used_bytes MNT: bytes the file system has allocated.
used_bytes() { df -B1 --output=used "$1" | tail -1; }

# --- 1. Two snapshots on ~4.5 MB. ---
mnt=$work/six_mb
small_ext4 "$mnt" 6144 || { echo "FAIL: mount of a 6 MiB ext4"; exit 1; }
timeout 120 "$titan3d" "${base[@]}" --set run.dir="$work/run1" --set snapshot.dir="$mnt" \
  > "$work/run1.log" 2>&1
committed "6 MiB ext4, two snapshots" "$work/run1.log" "$mnt" 2 $?
shard=$mnt/step_00000002/rank00000.h5
check "[ -f $shard ] && [ \$(( \$(stat -c '%b * %B' $shard) )) -le \$(( (\$(stat -c %s $shard) + 4095) / 4096 * 4096 )) ]" \
  "6 MiB ext4: the shard holds no blocks past its bytes ($(stat -c '%b blocks of %B, %s bytes' "$shard"))"
raw=$(du -B1 "$shard" | cut -f1)  # ~ the raw bytes allocated ahead, plus the used metadata
umount "$mnt"

# --- 2. Deflated: room for the snapshot, not for its uncompressed bytes. ---
mnt=$work/deflate
small_ext4 "$mnt" 6144 || { echo "FAIL: mount of a 6 MiB ext4"; exit 1; }
empty=$(used_bytes "$mnt")
deflated=(--set train.steps=1 --set snapshot.deflate=9)
timeout 120 "$titan3d" "${base[@]}" "${deflated[@]}" --set run.dir="$work/run2" \
  --set snapshot.dir="$mnt" > "$work/run2.log" 2>&1
committed "deflated, room to spare" "$work/run2.log" "$mnt" 1 $?
needed=$(($(used_bytes "$mnt") - empty))
rm -rf "${mnt:?}"/*
# Free space halfway between what the deflated snapshot takes and its raw bytes.
free=$(((needed + raw) / 2))
check "[ $needed -lt $((free - 65536)) ] && [ $((free + 65536)) -lt $raw ]" \
  "the deflated snapshot ($needed bytes on disk) is well below its raw bytes ($raw)"
fallocate -l $(($(df -B1 --output=avail "$mnt" | tail -1) - free)) "$mnt/fill"
timeout 120 "$titan3d" "${base[@]}" "${deflated[@]}" --set run.dir="$work/run3" \
  --set snapshot.dir="$mnt" > "$work/run3.log" 2>&1
committed "deflated, $free bytes free" "$work/run3.log" "$mnt" 1 $?
umount "$mnt"
exit $fail
