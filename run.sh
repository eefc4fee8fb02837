#!/usr/bin/env bash
# One-command recipe: LSTM acoustic model trained with DeepSpeed (SYNC / ADPSGD / HYBRID from the JSON config).
#
#   ./run.sh                                   # everything, built-in synthesized corpus, SYNC on 2 learners
#   ./run.sh --stage 3 --stop-stage 3 --ds-config ds_configs/tuning/sync_bf16.json train.epochs=20
#
# Stages, each logged to EXP/log/stage-N.log and skipped once EXP/.done/stage-N exists, unless --stage is
# given explicitly (then stages N.. run again):
#   0 set up the virtual environment (.venv: torch==2.13.0, then requirements.txt)
#   1 prepare data     synthesize the built-in corpus, or check --train-dir/--test-dir[/--dev-dir]; write EXP/data
#                      (train, dev, test: the dev set carved out of training when the corpus has none)
#   2 features         log-mel + deltas, in parallel, cached by feature config
#   3 train            the deepspeed launcher starts the learners (python -m recipe.train), and starts them
#                      again from the last checkpoint when one is lost (recipe/elastic.py, train.max_restarts)
#   4 evaluate         choose the decoder on the dev set, then decode the test set once: EXP/decode
#   5 report           table on the terminal, EXP/report.png
set -euo pipefail
cd "$(dirname "$0")"

stage=0
stage_given=false  # an explicit --stage N reruns stages N.. even if they are done
stop_stage=5
conf=recipe/conf/default.yaml
ds_config=ds_configs/sync.json
learners=2
nodes=1
hostfile=
node_rank=
master_addr=
exp=exp/sync
train_dir=
test_dir=
dev_dir=
resume=false
freeze=false
master_port=29500
python=${PYTHON:-$(command -v python3.11 || command -v python3)}

usage() {
  cat <<USAGE
Usage: ./run.sh [options] [key=value ...]

Options:
  --stage N          first stage to run (default $stage); stages: 0 setup, 1 data, 2 features, 3 train,
                     4 evaluate, 5 report
  --stop-stage M     last stage to run (default $stop_stage)
  --conf FILE        recipe YAML: data, features, model, optimizer, schedule (default $conf)
  --ds-config FILE   DeepSpeed JSON: engine settings and the strategy ("comm" section) (default $ds_config)
  --learners N       learner processes on this machine (default $learners)
  --nodes M          split the learners on this machine into M emulated nodes (HYBRID on one machine)
  --hostfile FILE    multi-node: DeepSpeed hostfile ("host slots=N" lines); the launcher starts the learners
                     on every host (passwordless ssh, same path on every host); --learners is then ignored
  --node-rank K      multi-node without ssh (SLURM, Kubernetes): run this on every node, K = its line in the
                     hostfile (0 first); each node prepares its own data (stages 1-2) and starts its own learners;
                     node 0 also decodes and reports (stages 4-5: its disk holds the checkpoints)
  --master-addr HOST with --node-rank: the address of node 0, where learner 0 serves the rendezvous
  --exp DIR          experiment folder (default $exp); corpora and feature caches go to its parent folder
  --train-dir DIR    your own Kaldi-style data dir for training (wav.scp, text, [utt2spk], [segments])
  --test-dir DIR     your own Kaldi-style test data dir: decoded once, at the end
  --dev-dir DIR      your own Kaldi-style dev data dir: every choice of training and decoding is made on it
                     (default: the corpus's own, else carved out of the training data: data.dev_share)
  --resume           stage 3 continues from the latest checkpoint in EXP/checkpoints
  --freeze           write constraints.txt from .venv (every installed version, as tested) and exit
  --master-port P    rendezvous port for the learners (default $master_port)
  -h, --help         this help
  key=value          overrides of the YAML, e.g. train.epochs=20 model.hidden=512 features.cmvn=global

A stage that has finished is skipped when the recipe runs again (marker EXP/.done/stage-N), so an
interrupted ./run.sh resumes at the stage it was in; --stage N runs stages N.. again whatever is done. Python: \$PYTHON (default python3.11, else python3) makes the virtual environment .venv.
USAGE
}

overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) stage=$2; stage_given=true; shift 2 ;;
    --stop-stage) stop_stage=$2; shift 2 ;;
    --conf) conf=$2; shift 2 ;;
    --ds-config) ds_config=$2; shift 2 ;;
    --learners) learners=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --master-addr) master_addr=$2; shift 2 ;;
    --exp) exp=$2; shift 2 ;;
    --train-dir) train_dir=$2; shift 2 ;;
    --test-dir) test_dir=$2; shift 2 ;;
    --dev-dir) dev_dir=$2; shift 2 ;;
    --resume) resume=true; shift ;;
    --freeze) freeze=true; shift ;;
    --master-port) master_port=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "run.sh: unknown option '$1' (see ./run.sh --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$train_dir$test_dir" ]; then
  if [ -z "$train_dir" ] || [ -z "$test_dir" ]; then echo "run.sh: give both --train-dir and --test-dir" >&2; exit 2; fi
  overrides=(data.corpus=kaldi "data.train_dir=$(realpath "$train_dir")" "data.test_dir=$(realpath "$test_dir")" ${overrides[@]+"${overrides[@]}"})
fi
if [ -n "$dev_dir" ]; then overrides=("data.dev_dir=$(realpath "$dev_dir")" ${overrides[@]+"${overrides[@]}"}); fi
if [ -n "$node_rank$master_addr" ] && { [ -z "$node_rank" ] || [ -z "$master_addr" ] || [ -z "$hostfile" ]; }; then
  echo "run.sh: --node-rank and --master-addr go together, with --hostfile" >&2; exit 2
fi
for f in "$conf" "$ds_config" ${hostfile:+"$hostfile"}; do
  [ -f "$f" ] || { echo "run.sh: file not found: $f" >&2; exit 2; }
done

mkdir -p "$exp/log" "$exp/.done"
# progress bars draw on the terminal while stage output is teed into the logs (recipe/lib/progress.py)
if [ -t 2 ]; then export RECIPE_TTY=1; fi
venv=.venv
py="$venv/bin/python"
conf_args=(--conf "$conf" ${overrides[@]+"${overrides[@]}"})

# run_stage N NAME COMMAND...: log to EXP/log/stage-N.log (and the terminal), mark done on success
run_stage() {
  local n=$1 name=$2; shift 2
  if [ "$n" -lt "$stage" ] || [ "$n" -gt "$stop_stage" ]; then return 0; fi
  if [ -f "$exp/.done/stage-$n" ] && [ "$stage_given" = false ]; then
    echo "== stage $n ($name): done before, skipped (./run.sh --stage $n redoes it)"; return 0
  fi
  rm -f "$exp/.done/stage-$n"
  echo "== stage $n ($name): $(date '+%F %T')"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$exp/log/stage-$n.log"
  touch "$exp/.done/stage-$n"
  echo "== stage $n ($name) finished in $((SECONDS - t0)) s"
}

setup() {
  # Keyed on requirements.txt, constraints.txt and pyproject.toml, so a changed pin reinstalls; the venv is shared by every experiment.
  local key; key=$(cat requirements.txt constraints.txt pyproject.toml | sha1sum | cut -c1-12)
  if [ -f "$venv/.setup-$key" ]; then echo "virtual environment $venv is up to date"; return 0; fi
  [ -x "$py" ] || "$python" -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
  # torch first and alone: the pinned CPU build comes from the local wheel cache on our machines
  "$py" -m pip install -q torch==2.13.0
  # every transitive version as tested (constraints.txt; ./run.sh --freeze rewrites it from .venv)
  "$py" -m pip install -q -r requirements.txt -c constraints.txt
  # the recipe itself (recipe, model, comm), editable: imports work from any folder, no sys.path edits
  "$py" -m pip install -q --no-deps --no-build-isolation -e .
  touch "$venv/.setup-$key"
}

train() {  # the elastic agent runs the deepspeed launcher, and runs it again when a learner is lost
  local args=(--exp "$exp" --ds-config "$ds_config" --nodes "$nodes" --master-port "$master_port")
  if [ -n "$hostfile" ]; then args+=(--hostfile "$hostfile"); else args+=(--learners "$learners"); fi
  if [ -n "$node_rank" ]; then args+=(--node-rank "$node_rank" --master-addr "$master_addr"); fi
  if [ "$resume" = true ]; then args+=(--resume); fi
  "$py" -m recipe.elastic "${args[@]}" "${conf_args[@]}"
}

if [ "$freeze" = true ]; then  # after changing requirements.txt and running the tests in the new .venv
  { sed -n '/^#/p' constraints.txt; "$py" -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
  mv constraints.txt.new constraints.txt; echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages"; exit 0
fi
# stage 0 always checks the venv (cheaply), so later stages never run without it
if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  echo "== stage 0 (setup): $(date '+%F %T')"; setup 2>&1 | tee "$exp/log/stage-0.log"
fi
[ -x "$py" ] || { echo "run.sh: no virtual environment in $venv; run stage 0 first" >&2; exit 2; }
if [ -n "$hostfile" ]; then  # learners in all: the slots of every host; the real nodes are the hosts
  hosts=$("$py" -c 'import sys
from deepspeed.launcher.runner import fetch_hostfile  # read as the launcher reads it: comments, blank lines
hosts = fetch_hostfile(sys.argv[1])
if len(set(hosts.values())) > 1:  # the strategies need equal nodes: refused here, before stages 1-2
    sys.exit(f"run.sh: {sys.argv[1]}: the hosts have different slot counts {dict(hosts)}; give every node the same")
print(sum(hosts.values()), len(hosts))' "$hostfile" | tail -n 1)
  read -r world check_nodes <<< "$hosts"
else
  world=$learners
  check_nodes=$nodes
fi
if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 1 ]; then  # a bad JSON or layout fails before hours of preparation
  "$py" -m recipe.train --check --ds-config "$ds_config" --world-size "$world" --nodes "$check_nodes" "${conf_args[@]}"
fi
run_stage 1 "prepare data" "$py" -m recipe.prepare data --exp "$exp" "${conf_args[@]}"
run_stage 2 "features" "$py" -m recipe.prepare features --exp "$exp" "${conf_args[@]}"
run_stage 3 "train" train
if [ "${node_rank:-0}" != 0 ]; then  # learner 0's node holds the checkpoints: it decodes and reports
  echo "== stages 4-5 run on node 0 (this is node $node_rank)"; exit 0
fi
run_stage 4 "evaluate" "$py" -m recipe.evaluate --exp "$exp"
if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then  # the report is cheap: always redrawn
  "$py" -m recipe.report --exp "$exp"
fi
