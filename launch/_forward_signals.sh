# Sourced by the launch scripts (not run directly). `run_forwarding_signals CMD...` runs the deepspeed launcher so
# that stopping the script stops the job cleanly:
#
#   kill PID_OF_THE_SCRIPT   (SIGTERM, or SIGINT / Ctrl-C)  ->  every training rank on this node gets SIGTERM,
#   finishes its step, saves a checkpoint and exits 0; then the launcher exits and so does the script (status 0).
#
# Why not just exec deepspeed: the `deepspeed` command is a runner that starts deepspeed.launcher.launch, which
# starts one process per rank. SIGTERM to the runner kills it at once: the ranks notice their launcher's end within
# a second and stop with a checkpoint, but a script waiting for the runner could not wait for that nor report it;
# SIGTERM to launch.launch makes it SIGKILL the ranks 30 s later, whether or not their checkpoint is written. So
# the launcher runs in its own session (a terminal's Ctrl-C reaches only this script) and the signal goes to the
# ranks themselves: the children of each deepspeed.launcher.launch process under it. With no such process on this
# node (multi-node over ssh/pdsh: the ranks are remote), the signal goes to DeepSpeed's runner, which forwards it
# to every node with pkill. To stop at once without a checkpoint, SIGKILL the launcher's process group (its id is
# printed at start): kill -KILL -- -PGID.

_tt_children() {  # pids whose parent is $1, read from /proc (no procps needed)
    local stat line rest state ppid pid
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        rest=${line##*) }
        read -r state ppid _ <<<"$rest"
        if [[ $ppid == "$1" ]]; then
            pid=${stat#/proc/}
            echo "${pid%/stat}"
        fi
    done
}

_tt_rank_pids() {  # children of every deepspeed.launcher.launch process below $1
    local queue=("$1") pid args
    while ((${#queue[@]})); do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        mapfile -d '' args 2>/dev/null </proc/"$pid"/cmdline || continue
        if [[ " ${args[*]} " == *" deepspeed.launcher.launch "* ]]; then
            _tt_children "$pid"
        else
            # shellcheck disable=SC2207
            queue+=($(_tt_children "$pid"))
        fi
    done
}

_tt_forward() {  # $1: the signal received
    local pids
    pids=$(_tt_rank_pids "$_tt_launcher_pid" | tr '\n' ' ')
    if [[ -n ${pids// /} ]]; then
        echo "tapetrain: SIG$1 received: sending SIGTERM to the training ranks (pids ${pids% }); they save a" \
            "checkpoint and exit" >&2
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
    else
        echo "tapetrain: SIG$1 received: no training rank on this node, forwarding SIGTERM to the launcher" >&2
        kill -TERM "$_tt_launcher_pid" 2>/dev/null || true
    fi
}

run_forwarding_signals() {
    if command -v setsid >/dev/null; then
        setsid --wait "$@" &
    else
        "$@" &
    fi
    _tt_launcher_pid=$!
    echo "tapetrain: launcher pid $_tt_launcher_pid (process group $_tt_launcher_pid); stop the job with" \
        "kill $$ (checkpoint, then exit)" >&2
    trap '_tt_forward TERM' TERM
    trap '_tt_forward INT' INT
    local status
    # `wait` returns early (status > 128) when a trapped signal arrives; keep waiting while the ranks save.
    while :; do
        wait "$_tt_launcher_pid" && status=0 || status=$?
        if ((status > 128)) && kill -0 "$_tt_launcher_pid" 2>/dev/null; then
            continue
        fi
        break
    done
    trap - TERM INT
    return "$status"
}
