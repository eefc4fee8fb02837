#!/usr/bin/env bash
# The prepared GPU check: everything a lent GPU is for, in one call of at most 9 minutes.
#
#   bash recipe/tools/gpu_check.sh --wheels      # before the loan, here (PyPI reachable): .whl/ for the device
#   bash recipe/tools/gpu_check.sh OUT           # on the GPU machine, from the repository root (.whl carried)
#   bash recipe/tools/gpu_check.sh --smoke OUT   # the same path on a CPU, tiny, in about a minute
#
# On the GPU machine (a bare image: python3 with its own CUDA torch, no registry):
#   0. .venv over that python (--system-site-packages: its torch stays), the carried wheels of what the image
#      lacks (.whl/), and the recipe itself, editable; run.sh then finds the venv it expects;
#   1. python -m recipe.tools.gpu_check: frames/s and MFU by model, precision and micro batch; gossip's cost to the
#      step; a merge kept through a bf16 step (OUT/gpu_check.json); the scaling model's projection with the
#      measured rate (OUT/projection.txt);
#   2. the recipe end to end on CUDA: stages 1-4 of run.sh, one epoch of the built-in corpus each, its CER in
#      OUT/summary.txt: SYNC with one learner on NCCL, then two learners sharing the GPU (gloo between them, as
#      NCCL refuses two ranks on one GPU: comm/distributed.py gpus_shared) for SYNC, ADPSGD, HYBRID (2 nodes of
#      1) and LOCALSGD.
# Every log lands in OUT (default: $OUT where the device tool sets it, else gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/../.."

smoke=false
if [ "${1:-}" = "--wheels" ]; then
  # what the device image (KINDS.md: torch, numpy, rich, matplotlib, tensorboard, psutil, pyyaml, pytest ... are
  # there) lacks of requirements.txt, for its Python 3.12; deepspeed is an sdist, built here as a pure wheel
  mkdir -p .whl
  for name in librosa soundfile soxr omegaconf jiwer RapidFuzz kaldiio kaldi-native-fbank espeakng-loader \
              audioread pooch decorator hjson pydantic pydantic_core annotated-types typing-inspection; do
    pin=$(grep -ihE "^$name==" requirements.txt constraints.txt | head -1 | sed 's/ .*//')  # the tested version
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${pin:-$name}" || echo "gpu_check.sh: no wheel for ${pin:-$name}" >&2
  done
  python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
  du -sh .whl; exit 0
fi
if [ "${1:-}" = "--smoke" ]; then smoke=true; shift; fi
out=$(realpath -m "${1:-${OUT:-gpu_check_out}}")
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
t0=$SECONDS
step() { echo "== $1 (at $((SECONDS - t0)) s)"; }

if [ "$smoke" = false ]; then
  step "0 environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
    .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
  fi
fi
py=.venv/bin/python
"$py" -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
"deepspeed", deepspeed.__version__)' || { echo "gpu_check.sh: the environment is not usable"; exit 1; }

step "1 throughput, gossip, merge"
if [ "$smoke" = true ]; then smoke_flag=--smoke; else smoke_flag=; fi
PYTHONUNBUFFERED=1 timeout 360 "$py" -m recipe.tools.gpu_check $smoke_flag --out "$out/gpu_check.json"
# the scaling model's projection with the compute rate just measured (recipe/tools/simulate.py)
"$py" -m recipe.tools.simulate project --gpu-check "$out/gpu_check.json" > "$out/projection.txt" 2>&1

step "2 the recipe end to end"
# a corpus small enough for the time: 1,000 training and 100 held-out utterances; the smoke: 40 and 8, a tiny
# model, and two of the runs (the 1-learner path and the 2-node one)
runs=("sync 1 1" "sync 2 1" "adpsgd 2 1" "hybrid 2 2" "localsgd 2 1")  # strategy, learners, nodes
corpus=(data.synth_train=1000 data.synth_dev=100 data.synth_test=100)
if [ "$smoke" = true ]; then
  runs=("sync 1 1" "hybrid 2 2")
  corpus=(data.synth_train=40 data.synth_dev=8 data.synth_test=8 model.layers=1 model.hidden=32)
fi
plan=(optim.schedule=fixed train.epochs=1 train.min_updates=0)
: > "$out/summary.txt"
for run in "${runs[@]}"; do
  read -r strategy learners nodes <<< "$run"
  exp="exp/gpu_check/$strategy-$learners"
  port=$("$py" -c 'from recipe.tools.local_learners import free_port; print(free_port())')
  timeout 240 ./run.sh --stage 1 --stop-stage 4 --exp "$exp" --learners "$learners" --nodes "$nodes" \
    --ds-config "ds_configs/$strategy.json" --master-port "$port" "${corpus[@]}" "${plan[@]}" \
    > "$out/run_$strategy-$learners.log" 2>&1
  code=$?
  scores=$("$py" -c 'import json, sys; s = json.load(open(sys.argv[1]))
print("CER %.2f%% WER %.2f%%" % (100 * s["cer"], 100 * s["wer"]))' "$exp/decode/scores.json" 2>/dev/null)
  device=$(grep -o 'device=[^ ]*' "$exp/log/stage-3.log" | head -1)
  echo "$strategy, $learners learner(s): exit $code ${scores:-no scores} $device" | tee -a "$out/summary.txt"
done
step "done"
