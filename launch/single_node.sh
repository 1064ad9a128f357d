#!/usr/bin/env bash
# Train on one node with the DeepSpeed launcher: one rank per GPU.
#
#   launch/single_node.sh CONFIG.yaml [KEY=VALUE ...]
#
# Environment:
#   NUM_GPUS     ranks to start (default: all visible GPUs; set it on CPU-only machines, e.g. NUM_GPUS=2)
#   MASTER_PORT  rendezvous port (default 29500; change it to run two jobs on one node)
#   DS_ARGS      extra launcher flags, e.g. DS_ARGS="--include localhost:0,1"
#
# Stop: `kill PID` (this script's pid; SIGTERM) or Ctrl-C. Every rank saves a checkpoint and exits; status 0.
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
config=$1
shift
if [[ ! -f $config ]]; then
    echo "error: config file not found: $config" >&2
    exit 2
fi

launcher=(deepspeed)
if [[ ${NUM_GPUS:-all} != all ]]; then
    launcher+=(--num_gpus "$NUM_GPUS")
fi
launcher+=(--master_port "${MASTER_PORT:-29500}")
# shellcheck disable=SC2206  # DS_ARGS is deliberately word-split
launcher+=(${DS_ARGS:-})

# Not exec: this script stays to turn SIGTERM/SIGINT into a clean stop (checkpoint, exit 0); see _forward_signals.sh.
# shellcheck source=launch/_forward_signals.sh
source "$(dirname "${BASH_SOURCE[0]}")/_forward_signals.sh"
run_forwarding_signals "${launcher[@]}" --module tapetrain.train "$config" "$@"
