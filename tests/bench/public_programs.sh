#!/usr/bin/env bash
# A public training program, unmodified, over two "nodes" on this host: a stagefs-run mount
# each (--sampler feed, peers, the hook on), one DDP rank each (gloo), over a root with
# train/ and val/ of real JPEGs. Prints each node's statistics: training hits, mispredictions,
# reads by descriptor, copies from the peer and fallbacks to SOURCE.
#
# Run by hand, as root, after `cargo build --release` (not in CI: the programs need pip's
# torch 2.x in a virtualenv, gigabytes), with the program's script fetched from its repository:
#
#   PROGRAM=imagenet  SCRIPT=examples/imagenet/main.py              PYTHON=venv/bin/python bash tests/bench/public_programs.sh
#   PROGRAM=lightning SCRIPT=lightning/examples/pytorch/domain_templates/imagenet.py ...
#   PROGRAM=timm      SCRIPT=pytorch-image-models/train.py           (one process: NODES=1)
#
# TRAIN (400) and VAL (100) files, EPOCHS (3), NODES (2) and CACHE (40M per node) override the
# defaults. Everything it creates is removed, unless KEEP=1 (then its directory is printed).
set -euo pipefail
cd "$(dirname "$0")/../.."

PROGRAM="${PROGRAM:?PROGRAM=imagenet, lightning or timm}"
SCRIPT="$(readlink -f "${SCRIPT:?SCRIPT=the script of the program}")"
PYTHON="${PYTHON:?PYTHON=a python with torch 2.x, torchvision and the packages of the program}"
TRAIN="${TRAIN:-400}"
VAL="${VAL:-100}"
EPOCHS="${EPOCHS:-3}"
NODES="${NODES:-2}"
CACHE="${CACHE:-40M}"
STAGEFS="${STAGEFS:-$PWD/target/release/stagefs}"
RUN="$PWD/mount-scripts/stagefs-run"
WORK="$(mktemp -d /var/tmp/stagefs-public.XXXXXX)"
BASE_PORT=17600
MASTER_PORT=29600

[ -x "$STAGEFS" ] || { echo "build first: cargo build --release" >&2; exit 1; }
export STAGEFS
if [ "${KEEP:-0}" = 1 ]; then
  echo "work directory: $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

/usr/bin/python3 tests/e2e/common.py make-dataset "$WORK/src/train" --files "$TRAIN" --seed 1 >/dev/null
/usr/bin/python3 tests/e2e/common.py make-dataset "$WORK/src/val" --files "$VAL" --seed 2 >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/secret"
chmod 600 "$WORK/secret"
peers=$(for i in $(seq 0 $((NODES - 1))); do printf '127.0.0.1:%d,' $((BASE_PORT + i)); done)

# The program's command line for node $1 over mount $2.
program() {
  local node=$1 mnt=$2
  case "$PROGRAM" in
    imagenet) echo "$SCRIPT -a squeezenet1_1 --epochs $EPOCHS -b 25 -j 2 -p 4 --world-size $NODES
                    --rank $node --dist-url tcp://127.0.0.1:$MASTER_PORT --dist-backend gloo
                    --multiprocessing-distributed $mnt" ;;
    lightning) echo "$SCRIPT fit --model.data_path $mnt --model.arch squeezenet1_1
                     --model.batch_size 50 --model.workers 4 --trainer.max_epochs $EPOCHS
                     --trainer.accelerator cpu --trainer.devices 1 --trainer.num_nodes $NODES
                     --trainer.strategy ddp" ;;
    timm) echo "$SCRIPT --data-dir $mnt --val-split val --model resnet10t --img-size 96
                --epochs $EPOCHS -b 25 -j 2 --device cpu --no-prefetcher --num-classes 10
                --log-interval 8 --output $WORK/n$node/out" ;;
    *) echo "PROGRAM is imagenet, lightning or timm" >&2; exit 2 ;;
  esac
}

pids=()
for i in $(seq 0 $((NODES - 1))); do
  mkdir -p "$WORK/n$i"
  peer_flags=()
  [ "$NODES" -gt 1 ] && peer_flags=(--peers "${peers%,}" --node "$i" --peer-secret-file "$WORK/secret")
  # shellcheck disable=SC2046 # the program's arguments are words
  (cd "$WORK/n$i" && RANK=$i NODE_RANK=$i LOCAL_RANK=0 WORLD_SIZE=$NODES \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$MASTER_PORT \
    "$RUN" "$WORK/src" "$WORK/n$i/mnt" --cache "$WORK/n$i/cache" --cache-size "$CACHE" \
    --sampler feed "${peer_flags[@]}" --log-file "$WORK/n$i/stagefs.log" -- \
    "$PYTHON" $(program "$i" "$WORK/n$i/mnt") >"$WORK/n$i/job.log" 2>&1) &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
for i in $(seq 0 $((NODES - 1))); do
  echo "node $i ($PROGRAM):"
  grep -E '^(streams|mispredictions|prediction quality|batch opens|from peers|peer fallbacks) ' \
    "$WORK/n$i/job.log" | sed 's/^/  /' || tail -n 20 "$WORK/n$i/job.log"
done
exit "$status"
