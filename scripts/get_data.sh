#!/usr/bin/env bash
# Builds the default corpus from Debian's `fortunes` package (English quotations, jokes and
# literature excerpts, ~2.5 MB of text), the only free English prose reachable from this
# project's machines (they reach Debian's registry and npm, nothing else). See docs/data.md.
#
# Writes, under <repo>/data/ (ignored by git):
#   fortunes.txt        the cookies, one blank line between them (`%` separators removed)
#   fortunes_train.bin  byte tokens (vocab 256) in the llm.c uint16 layout, first 95%
#   fortunes_val.bin    the last 5%, held out
# Idempotent: installs the package only if missing, rewrites the outputs only if absent or
# FORCE=1. Usage: scripts/get_data.sh [out_dir]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/data}"
src=/usr/share/games/fortunes

if [[ ! -f "$src/fortunes" ]]; then
  echo "get_data: installing Debian package 'fortunes' (needs root / apt)"
  if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq fortunes >/dev/null
fi

mkdir -p "$out"
txt="$out/fortunes.txt"
if [[ ! -s "$txt" || "${FORCE:-0}" == 1 ]]; then
  # The text databases are the files without an extension (*.dat are strfile indexes, *.u8
  # symlinks). ascii-art is pictures, not language, so it is left out. Sorted for a stable order.
  mapfile -t files < <(find "$src" -maxdepth 1 -type f ! -name '*.*' ! -name 'ascii-art' | sort)
  [[ ${#files[@]} -gt 0 ]] || { echo "get_data: no fortune files under $src" >&2; exit 1; }
  # Drop `%` separator lines (one blank line between cookies instead) and the backspace
  # overstriking some files use for bold/underline (`X\bX`, `_\bX`), keeping the visible char.
  cat "${files[@]}" | perl -pe 's/^%\n/\n/; 1 while s/[^\n\x08]\x08//; s/\x08//g' > "$txt.tmp"
  mv "$txt.tmp" "$txt"
fi

# Byte tokens in the llm.c layout: 256 int32 header {20240520, 1, count}, then uint16 per byte.
# Perl rather than Python: perl-base is part of every Debian install.
write_bin() {  # write_bin <out.bin> <first byte> <length>
  perl -e '
    my ($in, $out, $off, $len) = @ARGV;
    open(my $f, "<:raw", $in) or die "get_data: $in: $!\n";
    local $/; my $all = <$f>; close $f;
    my $part = substr($all, $off, $len);
    open(my $o, ">:raw", "$out.tmp") or die "get_data: $out: $!\n";
    print $o pack("l<3", 20240520, 1, length $part), "\0" x (4 * 253);
    print $o pack("v*", unpack("C*", $part));
    close $o or die "get_data: writing $out failed\n";
    rename("$out.tmp", $out) or die "get_data: $out: $!\n";
  ' "$txt" "$1" "$2" "$3"
}

n=$(stat -c %s "$txt")
n_val=$(( n / 20 ))
n_train=$(( n - n_val ))
if [[ ! -s "$out/fortunes_train.bin" || ! -s "$out/fortunes_val.bin" || "${FORCE:-0}" == 1 ||
      "$txt" -nt "$out/fortunes_train.bin" ]]; then
  write_bin "$out/fortunes_train.bin" 0 "$n_train"
  write_bin "$out/fortunes_val.bin" "$n_train" "$n_val"
fi

for f in "$txt" "$out/fortunes_train.bin" "$out/fortunes_val.bin"; do
  printf 'get_data: %-40s %10d bytes\n' "$f" "$(stat -c %s "$f")"
done
echo "get_data: $n text bytes = $n tokens (byte tokenizer): $n_train train, $n_val val"
