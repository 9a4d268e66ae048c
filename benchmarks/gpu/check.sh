#!/usr/bin/env bash
# Every GPU measurement of the issues "Fast decoding and training steps on a GPU" and "Warm stage
# workers", on one GPU within --budget seconds (480: 8 minutes, the policy's build included), as
# JSON under --out:
#   decode.json     benchmarks/bench_decode.py: otbflow's decode loops (rollout.hf_decode eager,
#                   static, compiled) against transformers' sampling (dynamic and static KV cache)
#                   on the same rows, and a profile of the compiled loop's decode steps
#   iteration.json  benchmarks/bench_iteration.py: the workflow chain with warm workers and with a
#                   process per job, at s = 0 then s = 1 (--settings; default grpo_s0_workers:4,
#                   grpo_s0:2,grpo_s1_workers:4,grpo_s1:2, NAME:ITERATIONS, as far as the budget goes);
#                   no TRL
#   mfu.json        benchmarks/bench_train_mfu.py: the train step's tokens/s and MFU, from the
#                   chain's train jobs (cold) and two more jobs of --warm-steps steps (warm),
#                   padded and packed (train.packing)
#   check.json      each step's command, exit status and seconds (the `gpu` tests among them:
#                   pytest -m gpu), the GPU, the versions, the date
#   check.log       everything the steps printed
# The policy: benchmarks/make_policy.py --shape qwen2.5-0.5b (random, bf16); the setting:
# config/examples/gpu_qwen2.5-0.5b.yaml with benchmarks/gpu/learning.yaml (a reward the random
# policy learns from: the weights change every iteration). Run from the checkout's root with the python3 on PATH
# (PYTHON=... for another); no `make setup`: src/ goes on PYTHONPATH. On an offline machine whose
# Python has torch and transformers, --bundle DIR first installs DIR/part*/*.whl (written by
# benchmarks/gpu/bundle.sh) into that Python; --install-only stops there (docs/environments.md, "The GPU check").
#   bash benchmarks/gpu/check.sh --bundle .gpu-bundle --out results/gpu_check
#   bash benchmarks/gpu/check.sh --device cpu --tiny --out results/gpu_check   # every step, tiny, on CPU
#                   (the chain at s = 0 as stage jobs and at s = 1 on workers only)
# Options: --settings LIST (above; tiny: grpo_s0,grpo_s1_workers), --configfile FILE (layered over the
# setting's configs), --iterations N (a setting's without
# :N; 2, tiny: 1), --warm-steps N (3; tiny: 2), --steps LIST (the steps to run, of policy, decode,
# gpu_tests, chain, mfu; default all: the others are recorded as skipped), --budget S, --work DIR
# (the policy and the runs, kept; default: a new folder under $TMPDIR or /tmp, never under --out,
# whose files come back from a lent machine). Exit status 1 if a step failed.
set -u
cd "$(dirname "$0")/../.."
out=results/gpu_check bundle="" install_only=0 device=cuda tiny=0 iterations="" warm="" budget=480
work="" settings="" steps=policy,decode,gpu_tests,chain,mfu extra=()
command="bash benchmarks/gpu/check.sh $*"
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2 && shift 2 ;;
    --bundle) bundle=$2 && shift 2 ;;
    --install-only) install_only=1 && shift ;;
    --device) device=$2 && shift 2 ;;
    --tiny) tiny=1 && shift ;;
    --iterations) iterations=$2 && shift 2 ;;
    --warm-steps) warm=$2 && shift 2 ;;
    --budget) budget=$2 && shift 2 ;;
    --settings) settings=$2 && shift 2 ;;
    --configfile) extra+=("$2") && shift 2 ;;
    --steps) steps=$2 && shift 2 ;;
    --work) work=$2 && shift 2 ;;
    *) echo "check.sh: unknown argument '$1' (see the comment at the top of $0)" >&2 && exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ -n $bundle ]]; then
  wheels=("$bundle"/part*/*.whl)
  [[ -e ${wheels[0]} ]] || { echo "check.sh: no wheels in $bundle/part*/" >&2 && exit 2; }
  echo "installing ${#wheels[@]} wheels from $bundle into $("$PY" -c 'import sys; print(sys.prefix)')"
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check "${wheels[@]}" || exit
fi
((install_only)) && exit 0
if ! "$PY" -c "import omegaconf, polars, snakemake, deepspeed" > /dev/null 2>&1; then
  echo "check.sh: $PY lacks otbflow's dependencies: install the bundle (--bundle DIR; docs/environments.md, 'The GPU check')" >&2
  exit 2
fi

if ((tiny)); then
  shape=(--layers 2 --vocab 4096 --hidden 64)
  decode=(--dtype float32 --prompts 4 --group-size 2 --max-new-tokens 8 --repeats 1 --profile-steps 2)
  configs=(config/examples/gpu_qwen2.5-0.5b.yaml benchmarks/gpu/learning.yaml benchmarks/gpu/tiny.yaml)
  iterations=${iterations:-1} warm=${warm:-2} settings=${settings:-grpo_s0,grpo_s1_workers}
  export OTBFLOW_THREADS=${OTBFLOW_THREADS:-1}
else
  shape=() decode=() configs=(config/examples/gpu_qwen2.5-0.5b.yaml benchmarks/gpu/learning.yaml) iterations=${iterations:-2} warm=${warm:-3}
  settings=${settings:-grpo_s0_workers:4,grpo_s0:2,grpo_s1_workers:4,grpo_s1:2}
fi
[[ -n $work ]] || work=$(mktemp -d "${TMPDIR:-/tmp}/otbflow-gpu-check.XXXXXX")
mkdir -p "$out" "$work" || exit
rm -f "$out"/{decode,iteration,mfu,check}.json
log=$out/check.log steps_tsv=$work/steps.tsv start=$SECONDS failed=0
: > "$log"
: > "$steps_tsv"

# step NAME LIMIT COMMAND...: run COMMAND for at most LIMIT seconds (and what is left of the budget),
# its output into check.log, its status into steps.tsv; skipped when no budget is left or --steps
# leaves it out
step() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS left
  shift 2
  if [[ ,$steps, != *,$name,* ]]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$steps_tsv"
    echo "== $name: skipped (--steps $steps)" | tee -a "$log"
    return
  fi
  left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$steps_tsv"
    echo "== $name: skipped, the budget is spent" | tee -a "$log"
    return
  fi
  echo "== $name (at most ${limit} s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1 || rc=$?
  ((rc != 0)) && failed=1
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$steps_tsv"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
}

policy=$work/policy
step policy 150 "$PY" benchmarks/make_policy.py --shape qwen2.5-0.5b --out "$policy" "${shape[@]}"
step decode 240 "$PY" benchmarks/bench_decode.py --policy "$policy" --device "$device" "${decode[@]}" \
  --out "$out/decode.json"
step gpu_tests 180 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py
left=$((budget - (SECONDS - start) - 45)) # the MFU after it, from the chain's train jobs at least
step chain "$left" "$PY" benchmarks/bench_iteration.py --settings "$settings" --iterations "$iterations" --no-trl \
  --configfile "${configs[@]}" "${extra[@]}" --policy "$policy" --work "$work/iteration" --cores "$(nproc)" --drop-weights \
  --out "$out/iteration.json"
runs=()
for s in ${settings//,/ }; do runs+=("$work/iteration/${s%%:*}"); done
((budget - (SECONDS - start) < 120)) && warm=0 # no time left for the two extra train jobs
step mfu 180 "$PY" benchmarks/bench_train_mfu.py --runs "${runs[@]}" --warm-steps "$warm" --work "$work/mfu_warm" \
  --out "$out/mfu.json"

"$PY" - "$steps_tsv" "$out/check.json" "$command" "$budget" "$((SECONDS - start))" << 'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from machine import run_record
steps, out, command, budget, seconds = sys.argv[1:]
record = run_record()
record["command"] = command
rows = [line.rstrip("\n").split("\t", 3) for line in open(steps)]
record["budget_s"], record["seconds"] = int(budget), int(seconds)
record["steps"] = [
    {"step": n, "exit": None if rc == "skipped" else int(rc), "seconds": int(s), "command": c} for n, rc, s, c in rows
]
open(out, "w").write(json.dumps(record, indent=1))
print(json.dumps({r["step"]: r["exit"] for r in record["steps"]}))
PY
echo "== done in $((SECONDS - start)) s: $(ls "$out" | tr '\n' ' ')in $out; the policy and the runs in $work"
exit $failed
