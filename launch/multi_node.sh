#!/usr/bin/env bash
# Train on several nodes listed in a DeepSpeed hostfile ("host slots=GPUS" per line).
#
#   launch/multi_node.sh HOSTFILE CONFIG.yaml [KEY=VALUE ...]
#
# By default this is run once, on the first host, and DeepSpeed starts the other nodes over passwordless ssh
# (pdsh). Without ssh, run it once on every node with NODE_RANK set (0 on the first host of the hostfile):
#   NODE_RANK=1 MASTER_ADDR=node0 launch/multi_node.sh hostfile configs/x.yaml
#
# Environment:
#   MASTER_ADDR  address of the first node (default: the first host in HOSTFILE)
#   MASTER_PORT  rendezvous port (default 29500)
#   NODE_RANK    set to launch this node only (adds --no_ssh --node_rank)
#   LAUNCHER     DeepSpeed multi-node backend when using ssh: pdsh (default), openmpi, mvapich, slurm, ...
#   DS_ARGS      extra launcher flags
#   PYTHON       interpreter that checks the hostfile first (default python3)
#   TAPETRAIN_WAIT_REPORT_S  seconds between the ranks' "still waiting for ..." lines at start-up (default 60)
#
# Stop: `kill PID` (this script's pid; SIGTERM) or Ctrl-C. With NODE_RANK (one script per node) signal every
# node's script: its ranks save their part of the checkpoint and exit. Over ssh/pdsh, DeepSpeed's runner forwards
# the signal to all nodes.
set -euo pipefail

if [[ $# -lt 2 || $1 == -h || $1 == --help ]]; then
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
hostfile=$1
config=$2
shift 2
for f in "$hostfile" "$config"; do
    if [[ ! -f $f ]]; then
        echo "error: file not found: $f" >&2
        exit 2
    fi
done

# Check the hostfile before DeepSpeed reads it: DeepSpeed raises a traceback on a malformed line and accepts one with
# trailing junk, after which rank 0 waits silently. On a bad line this prints one message naming it and exits 2.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! summary=$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m tapetrain.hostfile "$hostfile"); then
    exit 2
fi
first_host=${summary%%$'\n'*}
# Every rank's start-up names these nodes while it waits for the others to join (tapetrain.distributed).
export TAPETRAIN_NODES=${summary#*$'\n'}
echo "tapetrain: $hostfile: $TAPETRAIN_NODES; rendezvous at ${MASTER_ADDR:-$first_host}:${MASTER_PORT:-29500}" \
    "${NODE_RANK:+(this node: NODE_RANK=$NODE_RANK; start this script on every other node with its NODE_RANK)}" >&2

launcher=(deepspeed --hostfile "$hostfile" --master_addr "${MASTER_ADDR:-$first_host}"
    --master_port "${MASTER_PORT:-29500}")
if [[ -n ${NODE_RANK:-} ]]; then
    launcher+=(--no_ssh --node_rank "$NODE_RANK")
else
    launcher+=(--launcher "${LAUNCHER:-pdsh}")
fi
# shellcheck disable=SC2206  # DS_ARGS is deliberately word-split
launcher+=(${DS_ARGS:-})

# Not exec: this script stays to turn SIGTERM/SIGINT into a clean stop (checkpoint, exit 0); see _forward_signals.sh.
# shellcheck source=launch/_forward_signals.sh
source "$(dirname "${BASH_SOURCE[0]}")/_forward_signals.sh"
run_forwarding_signals "${launcher[@]}" --module tapetrain.train "$config" "$@"
