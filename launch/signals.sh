# Sourced by launch scripts that do more after training than exec it (main_job.sh, slurm_dgx2.sbatch).
#   run_forwarding_signals CMD [ARGS...]   runs CMD, passes SIGTERM and SIGINT on to it, returns its
#                                          exit status
# bash runs a foreground command to its end before any trap of its own fires, so a SIGTERM to the
# script would stop bash and leave the job running unsupervised. Here CMD runs in the background, in
# a process group of its own (job control on), so a terminal's Ctrl-C reaches it once, through the
# trap, and bash waits for it again after every trapped signal.
run_forwarding_signals() {
    local pid status
    set -m
    "$@" &
    pid=$!
    set +m
    trap 'kill -TERM "$pid" 2>/dev/null || true' TERM
    trap 'kill -INT "$pid" 2>/dev/null || true' INT
    while :; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    if [ "$status" -gt 128 ]; then   # the last wait may have been cut short as CMD ended
        wait "$pid" 2>/dev/null && status=0 || { local last=$?; [ "$last" -eq 127 ] || status=$last; }
    fi
    trap - TERM INT
    return "$status"
}
