#!/usr/bin/env bash
# The layering, checked on every #include: a folder (or a room of runtime/) includes only itself
# and the rooms below it (an entry may also name one header of a folder: the recipe types
# parallel.schedule with parallel/schedule_kind.h, header-only, and nothing else of parallel/). The CMake link graph says the same (runtime/CMakeLists.txt); this catches
# a header-only reach upwards, which links without complaint.
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
declare -A allowed=(
  [kernels]="kernels kernels/cuda"  # the CPU ops dispatch to their CUDA twins (kernels/exec.h)
  [kernels/cuda]="kernels/cuda kernels"
  [parallel]="parallel kernels"
  [checkpoint]="checkpoint kernels"
  [runtime/recipe]="runtime/recipe runtime/data parallel/schedule_kind.h kernels"
  [runtime/data]="runtime/data checkpoint/paths.h kernels"
  [runtime/launch]="runtime/launch runtime/recipe runtime/data parallel kernels"
  [runtime/provenance]="runtime/provenance runtime/recipe runtime/data checkpoint kernels"
  [runtime/supervise]="runtime/supervise runtime/launch runtime/recipe parallel checkpoint kernels"
  [runtime/model]="runtime/model runtime/recipe parallel kernels"
  [runtime/machine]="runtime/machine runtime/launch runtime/recipe parallel checkpoint kernels"
  [runtime/stage]="runtime/stage runtime/machine runtime/model runtime/launch runtime/data runtime/recipe parallel kernels"
  [runtime/train]="runtime/train runtime/stage runtime/provenance runtime/machine runtime/model runtime/launch runtime/data runtime/recipe parallel checkpoint kernels"
  [runtime/cost]="runtime/cost runtime/model runtime/machine runtime/launch runtime/data runtime/recipe parallel checkpoint kernels"
  [runtime/plan]="runtime/plan runtime/cost runtime/stage runtime/machine runtime/model runtime/launch runtime/data runtime/recipe parallel checkpoint kernels"
  [runtime/use]="runtime/use runtime/stage runtime/provenance runtime/machine runtime/model runtime/launch runtime/data runtime/recipe parallel checkpoint kernels"
  [runtime/selfcheck]="runtime/selfcheck runtime/cost runtime/stage runtime/machine runtime/model runtime/launch runtime/data runtime/recipe parallel checkpoint kernels"
)
fail=0 checked=0
for folder in "${!allowed[@]}"; do
  [ -d "$repo/$folder" ] || { echo "FAIL: $folder is in the layering but not in the tree"; fail=1; continue; }
  for file in "$repo/$folder"/*.h "$repo/$folder"/*.cpp "$repo/$folder"/*.inc "$repo/$folder"/*.cu \
    "$repo/$folder"/*.cuh; do
    [ -f "$file" ] || continue
    while IFS= read -r inc; do
      checked=$((checked + 1))
      target=${inc%/*}
      case " ${allowed[$folder]} " in
        *" $target "* | *" $inc "*) ;;  # a whole folder, or one named header of it
        *) echo "FAIL: ${file#$repo/} includes \"$inc\": $folder may include only ${allowed[$folder]}"; fail=1 ;;
      esac
    done < <(sed -n 's/^#include "\([a-z_]*\(\/[a-z_]*\)*\/[a-z_0-9]*\.\(h\|inc\|cuh\)\)".*/\1/p' "$file")
  done
done
# Every room of runtime/ is in the table above (a new room states its place).
for dir in "$repo"/runtime/*/; do
  room=runtime/$(basename "$dir")
  [ -n "${allowed[$room]:-}" ] || { echo "FAIL: $room has no place in the layering of $0"; fail=1; }
done
# Inside a room of runtime/ no two parts with code of their own (a.h + a.cpp, b.h + b.cpp)
# include each other: one concept per part, and such a cycle is two concepts that belong together
# or apart. (A header without a .cpp that extends another, like model_scratch.h, is part of it.)
pairs=0
for dir in "$repo"/runtime/*/; do
  folder=${dir#$repo/}
  folder=${folder%/}
  declare -A uses=()
  for file in "$dir"*.h "$dir"*.cpp; do
    [ -f "$file" ] || continue
    stem=$(basename "${file%.*}")
    while IFS= read -r inc; do
      other=$(basename "${inc%.*}")
      [ "$other" != "$stem" ] && uses[$stem]+=" $other "
    done < <(sed -n "s|^#include \"$folder/\([a-z_0-9]*\)\.h\".*|\1.h|p" "$file")
  done
  for a in "${!uses[@]}"; do
    for b in ${uses[$a]}; do
      pairs=$((pairs + 1))
      if [[ "$a" < "$b" && "${uses[$b]:-}" == *" $a "* && -f "$dir$a.cpp" && -f "$dir$b.cpp" ]]; then
        echo "FAIL: $folder/$a.* and $folder/$b.* include each other"; fail=1
      fi
    done
  done
  unset uses
done
[ "$pairs" -gt 20 ] || { echo "FAIL: only $pairs includes inside rooms found: the pattern is broken"; exit 1; }
[ "$checked" -gt 100 ] || { echo "FAIL: only $checked includes found: the pattern is broken"; exit 1; }
[ "$fail" = 0 ] && echo "$checked includes follow the layering"
exit $fail
