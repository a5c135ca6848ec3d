#!/usr/bin/env bash
# Expert parallelism (docs/moe.md, docs/parallelism.md): the EP degree changes nothing but speed
# and memory. lib.sh's tiny mixture of experts, fp32 with oneDNN's GEMMs, 50 steps.
#  1. Bit for bit, the same losses, gradient norms and final parameters as ep = 1 on the same
#     layout, with one micro-batch per step on dp2 (ZeRO 0, 1 and 3) and on dp2 × tp2 with SP: the
#     experts' weight gradients are summed per source rank in rank order, which is the order and
#     the rounding of the 2-rank reduction without EP, and a row's product does not depend on the
#     other rows of its GEMM. That holds for oneDNN's fp32 GEMMs; OpenBLAS's tail kernels round
#     a row differently by its place in the GEMM, so with OpenBLAS the pair agrees within the
#     tolerance of 2. Activation checkpointing and a capacity factor: the same bits, each slot
#     counted once, and the capacity shrinks the activations an expert rank keeps.
#  2. Within the dense layout-parity tolerance (1e-5 relative), losses and gradient norms, where
#     the order of additions must differ: dp4 with ep 2 and 4 (Open MPI adds 4 ranks' gradients
#     in another order than one rank adds its sources), 2 micro-batches (gradient accumulation
#     adds a micro-batch's sources at once), pp2 × dp2. Each would fail with expert gradients
#     ep times too large or a norm counting experts twice or not at all. bf16 (rows travel in
#     bf16): within twice the dense model's own pp2-against-pp1 drift.
#  3. The auxiliary loss of step 1 is ep=1's with 2 micro-batches and with pp2.
#  4. Snapshots hold every expert once under its global name: ep2 and ep1 snapshots of the same
#     training export the same bytes and resume on 1 rank to the same bits (a missing expert fails
#     the resume, another rank's experts or moments change the losses); an ep4 snapshot resumes
#     bit for bit on ep4 and within the tolerance on dp2 ep2, pp2 × dp2 ep2 and dp2 ep1 with
#     ZeRO-3.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir; [ -n "${KEEP:-}" ] && { trap - EXIT; echo "work: $work"; }
steps=50
common=(--set data.path="$corpus" "${tiny_moe[@]}" --set train.micro_batches=1
        --set train.steps=$steps --set hardware.gemm=onednn --set snapshot.every=25)
metrics() { echo "$work/$1/metrics.jsonl"; }
identical() {  # identical RUN REFERENCE WHAT: bit for bit where GEMM rows are computed alone
  [ $rows_alone = 1 ] || { within "$1" "$2"; return; }
  bit_identical "$@"
}
bit_identical() {  # bit_identical RUN REFERENCE WHAT: losses and gradient norms bit for bit
  check "diff <(field $(metrics $1) loss; field $(metrics $1) grad_norm) <(field $(metrics $2) loss; field $(metrics $2) grad_norm) > /dev/null && [ \$(losses $(metrics $1) | wc -l) -eq $steps ]" \
    "$3: losses and gradient norms bit-identical to $2"
}
within() {  # within RUN REFERENCE: losses and gradient norms within the parity tolerance
  printf '%-24s loss:      ' "$1"
  compare_losses "$(metrics $1)" "$(metrics $2)" 1e-5 || fail=1
  printf '%-24s grad_norm: ' "$1"
  compare_losses "$(metrics $1)" "$(metrics $2)" 1e-5 grad_norm || fail=1
}
dp2=(--set parallel.dp=2)
dp4=(--set parallel.dp=4)
# oneDNN's fp32 GEMMs compute each row alone with their AVX-512 kernels only. Without AVX-512 (AMD
# Zen 3, or ONEDNN_MAX_CPU_ISA below AVX512_CORE, which titan3d honours too) its AVX2 kernels
# round a row by its place in the GEMM, as OpenBLAS's tails do, so every "bit for bit" pair of 1
# and 4 is checked within the tolerance of 2 instead (test_model_ep_mpi probes the property).
rows_alone=1
for flag in avx512f avx512bw avx512vl; do grep -qw $flag /proc/cpuinfo || rows_alone=0; done
case "$(echo "${ONEDNN_MAX_CPU_ISA:-${DNNL_MAX_CPU_ISA:-}}" | tr a-z A-Z)" in
  SSE41 | AVX | AVX2 | AVX2_VNNI) rows_alone=0 ;;
esac
[ $rows_alone = 1 ] ||
  echo "note: oneDNN has no AVX-512 kernels here: the bit-for-bit pairs are checked within 1e-5"

# --- 1. Bit for bit. ---
run dp2_ep1 "${dp2[@]}"
run dp2_ep2 "${dp2[@]}" --set parallel.ep=2
identical dp2_ep2 dp2_ep1 "dp2, ep2"
# The all-to-alls' share of the step (docs/metrics.md): on ep2 every step waits on the ep group,
# on ep1 (a group of one) none does; summary.json reports it too.
check "field $(metrics dp2_ep2) ep_comm_share | awk '\$1 > 0 { n++ } END { exit n != $steps }' && field $(metrics dp2_ep1) ep_comm_share | awk '\$1 != 0 { bad++ } END { exit NR != $steps || bad }' && grep -q '\"ep_comm_share\": ' $work/dp2_ep2/summary.json" \
  "ep_comm_share > 0 on every ep2 step, 0 on every ep1 step, and in summary.json"
eval_loss() {  # eval_loss RUN: its final snapshot's validation loss, on 1 rank
  "$titan3d" eval "$work/$1/snapshots/step_000000$steps.h5" --batches 2 2>&1 | sed -n 's/.*loss \([0-9.]*\) nats.*/\1/p'
}
check "a=\$(eval_loss dp2_ep2) && [ -n \"\$a\" ] && [ \"\$a\" = \"\$(eval_loss dp2_ep1)\" ]" \
  "dp2, ep2: eval of the final snapshot on 1 rank (every expert read back) is ep1's: $(eval_loss dp2_ep2)"
# export: Mixtral's layout holds no shared expert, dense block or selection bias, so a model
# without them, 5 steps on ep1 and ep2: the same bytes.
mixtral=(--set model.n_shared_experts=0 --set model.dense_layers=0 --set model.router_bias_rate=0
         --set train.steps=5 --set snapshot.every=5)
for ep in 1 2; do
  run mixtral_ep$ep "${dp2[@]}" "${mixtral[@]}" --set parallel.ep=$ep
  "$titan3d" export "$work/mixtral_ep$ep/snapshots/step_00000005.h5" --out "$work/mixtral_ep$ep.hf" \
    > "$work/mixtral_ep$ep.export.log" 2>&1
done
exported() { sha256sum < "$work/mixtral_ep$1.hf/model.safetensors" 2>/dev/null | cut -c1-16; }
if [ $rows_alone = 1 ]; then
  check "[ -n \"\$(exported 2)\" ] && [ \"\$(exported 2)\" = \"\$(exported 1)\" ]" \
    "export of an ep2 snapshot (every expert, from both ranks) is the ep1 one's, byte for byte"
else
  # AdamW's first steps move a weight by up to lr whatever its gradient's size, so last-bit
  # differences of tiny gradients become differences of up to 2·lr per step (measured under
  # ONEDNN_MAX_CPU_ISA=AVX2: 3% of a tensor's largest weight after 5 steps). Another expert's,
  # a zero or an initial tensor in an expert's place differs by about the largest weight itself.
  check "/usr/bin/python3 $(dirname "$0")/../use/safetensors_tool.py close $work/mixtral_ep1.hf/model.safetensors $work/mixtral_ep2.hf/model.safetensors 0.1" \
    "export of an ep2 snapshot (every expert, from both ranks) is the ep1 one's, within 10% of each tensor's largest weight"
fi
"$titan3d" generate "$work/dp2_ep2/snapshots/step_000000$steps.h5" --prompt "The " --max-tokens 10 \
  --seed 1 > "$work/gen.out" 2>&1
check "[ $? -eq 0 ] && [ \$(wc -c < $work/gen.out) -ge 10 ]" "generate runs on an ep2 snapshot"
for zero in 1 3; do
  run dp2_ep2_zero$zero "${dp2[@]}" --set parallel.ep=2 --set parallel.zero=$zero
  identical dp2_ep2_zero$zero dp2_ep1 "dp2, ep2, ZeRO-$zero"
done
tp_sp=(--set parallel.dp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true)
run dp2_tp2_sp_ep1 "${tp_sp[@]}"
run dp2_tp2_sp_ep2 "${tp_sp[@]}" --set parallel.ep=2
identical dp2_tp2_sp_ep2 dp2_tp2_sp_ep1 "dp2 × tp2 with SP, ep2"
run dp2_ep2_recompute "${dp2[@]}" --set parallel.ep=2 --set train.activation_checkpoint=full
bit_identical dp2_ep2_recompute dp2_ep2 "activation checkpointing, ep2"
# A capacity factor: the same drops on both (capacity is per rank's micro-batch), and it bounds
# the rows an expert rank may take (E times the capacity instead of ep·N·K), so the arena's
# activations shrink.
cap=(--set model.capacity_factor=1.0 --set run.log_level=info)
run dp2_ep1_cap "${dp2[@]}" "${cap[@]}"
run dp2_ep2_cap "${dp2[@]}" "${cap[@]}" --set parallel.ep=2
identical dp2_ep2_cap dp2_ep1_cap "dp2, ep2, capacity factor 1"
run dp2_ep2_info "${dp2[@]}" --set parallel.ep=2 --set run.log_level=info --set train.steps=1
acts() { sed -n 's/.*memory bytes: .* activations \([0-9]*\) .*/\1/p' "$work/$1/logs/rank0.log" | head -1; }
check "[ -n \"\$(acts dp2_ep2_cap)\" ] && [ \$(acts dp2_ep2_cap) -lt \$(acts dp2_ep2_info) ]" \
  "ep2: a capacity factor shrinks the activations an expert rank keeps: $(acts dp2_ep2_cap) < $(acts dp2_ep2_info) bytes"
slots=$((8 * 32 * 2))
check "[ \"\$(field $(metrics dp2_ep2_recompute) routed_slots | sort -u)\" = $slots ]" \
  "activation checkpointing, ep2: each of the $slots slots counted once per block"

# --- 2. Within the tolerance. ---
run dp4_ep1 "${dp4[@]}"
for ep in 2 4; do
  run dp4_ep$ep "${dp4[@]}" --set parallel.ep=$ep
  within dp4_ep$ep dp4_ep1
done
openblas=(--set hardware.gemm=openblas)
run dp2_ep1_openblas "${dp2[@]}" "${openblas[@]}"
run dp2_ep2_openblas "${dp2[@]}" "${openblas[@]}" --set parallel.ep=2
within dp2_ep2_openblas dp2_ep1_openblas
micro2=(--set train.micro_batches=2)
run dp2_micro2_ep1 "${dp2[@]}" "${micro2[@]}"
run dp2_micro2_ep2 "${dp2[@]}" "${micro2[@]}" --set parallel.ep=2
within dp2_micro2_ep2 dp2_micro2_ep1
pp2=(--set parallel.pp=2 --set parallel.dp=2 "${micro2[@]}")
run pp2_dp2_ep1 "${pp2[@]}"
run pp2_dp2_ep2 "${pp2[@]}" --set parallel.ep=2
within pp2_dp2_ep2 pp2_dp2_ep1

# bf16 (stored activations, bf16 rows on the wire, bf16 GEMMs where the CPU has them) rounds what
# fp32 only reorders: as in moe.sh, the dense model's own layout drift over the same steps sets
# the bar.
choose_bf16 "${common[@]}"
run bf16_dp2_ep1 "${dp2[@]}" "${bf16[@]}"
run bf16_dp2_ep2 "${dp2[@]}" "${bf16[@]}" --set parallel.ep=2
dense=(--set model.n_experts=0 "${bf16[@]}")
run dense_bf16_dp2 "${dp2[@]}" "${dense[@]}"
run dense_bf16_pp2_dp2 "${dp2[@]}" "${dense[@]}" --set parallel.pp=2
worst() { compare_losses "$(metrics $1)" "$(metrics $2)" 1 | sed -n 's/.*difference \([^ ]*\) .*/\1/p'; }
ep_worst=$(worst bf16_dp2_ep2 bf16_dp2_ep1) dense_worst=$(worst dense_bf16_pp2_dp2 dense_bf16_dp2)
check "awk -v m=$ep_worst -v d=$dense_worst 'BEGIN { exit !(m <= (2 * d > 1e-3 ? 2 * d : 1e-3)) }'" \
  "bf16 ($bf16_gemm), dp2 ep2 against ep1 over $steps steps: $ep_worst, within max(1e-3, 2 × the dense model's pp2-against-pp1 $dense_worst)"

# --- 3. The auxiliary loss of step 1. ---
aux1() { field "$(metrics $1)" aux_loss | head -1; }
for other in dp2_micro2_ep2 pp2_dp2_ep2; do
  check "awk -v a=$(aux1 dp2_ep1) -v b=$(aux1 $other) 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= 1e-6 * a) }'" \
    "step 1's aux loss: $other $(aux1 $other) = dp2 ep1's $(aux1 dp2_ep1)"
done

# --- 4. Snapshots. ---
resume() {  # resume NAME FROM-RUN [--set ...]: from FROM-RUN's step 25
  local name=$1 from=$2; shift 2
  run "$name" --set snapshot.every=0 \
    --set snapshot.resume="$work/$from/snapshots/step_00000025.h5" "$@"
}
tail_of() { grep '"loss": ' "$(metrics $1)" | tail -25 > "$work/$1_26_50.jsonl"; echo "$work/$1_26_50.jsonl"; }
resume one_from_ep2 dp2_ep2
resume one_from_ep1 dp2_ep1
resume one_from_ep2_zero3 dp2_ep2_zero3
for from in ep2 ep2_zero3; do
  if [ $rows_alone = 1 ]; then
    check "diff <(losses $(metrics one_from_$from)) <(losses $(metrics one_from_ep1)) > /dev/null && [ \$(losses $(metrics one_from_ep1) | wc -l) -eq 25 ]" \
      "the dp2 $from and ep1 snapshots of one training resume on 1 rank without ZeRO to the same 25 losses, bit for bit"
  else
    printf '%-24s loss:      ' one_from_$from
    compare_losses "$(metrics one_from_$from)" "$(metrics one_from_ep1)" 1e-5 || fail=1
  fi
done
printf '%-24s loss:      ' one_from_ep2
compare_losses "$(metrics one_from_ep2)" "$(tail_of dp2_ep1)" 1e-5 || fail=1
resume dp4_ep4_again dp4_ep4 "${dp4[@]}" --set parallel.ep=4
check "diff <(losses $(metrics dp4_ep4_again)) <(losses $(tail_of dp4_ep4)) > /dev/null" \
  "an ep4 snapshot resumes on ep4: steps 26-50 bit for bit"
resume dp2_ep2_from_ep4 dp4_ep4 "${dp2[@]}" --set parallel.ep=2
printf '%-24s loss:      ' dp2_ep2_from_ep4
compare_losses "$(metrics dp2_ep2_from_ep4)" "$(tail_of dp4_ep4)" 1e-5 || fail=1
resume pp2_dp2_ep2_from_ep4 dp4_ep4 --set parallel.pp=2 "${dp2[@]}" --set parallel.ep=2
printf '%-24s loss:      ' pp2_dp2_ep2_from_ep4
compare_losses "$(metrics pp2_dp2_ep2_from_ep4)" "$(tail_of dp4_ep4)" 1e-5 || fail=1
resume dp2_zero3_from_ep4 dp4_ep4 "${dp2[@]}" --set parallel.zero=3
printf '%-24s loss:      ' dp2_zero3_from_ep4
compare_losses "$(metrics dp2_zero3_from_ep4)" "$(tail_of dp4_ep4)" 1e-5 || fail=1
check "h5dump -a layout $work/dp4_ep4/snapshots/step_00000025.h5 2>/dev/null | grep -q 'ep=4'" \
  "the snapshot records the EP layout it was written on"
exit $fail
