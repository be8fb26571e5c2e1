#!/usr/bin/env bash
# How long each process of the stack waits for a core once woken, during the replayed trace through N
# ingress processes: `perf sched latency` over a window of the trace (needs perf and root, or
# kernel.perf_event_paranoid <= -1).
#
#     bench/sched_latency.sh 1; bench/sched_latency.sh 4     # run them one after the other, paired
#
# It starts `bench/trace_replay.py --modes flotilla-kv --ingresses N --replica-sync on`, waits for the N
# ingresses ("flotilla gateway") and RECORD_AFTER_S more (the stack coming up, the trace's first
# seconds), records RECORD_S seconds of scheduler events on every CPU, then prints, per program, its
# CPU time in the window, its switches and its average and longest wait from wake-up to running
# ("Avg delay"), and the replay's own summary line. On 2 cores more ingress processes make every
# process wait longer for a core: that delay, paid at each hop of a request, is what a host with cores
# to spare would not show.
#
# Environment: RECORD_AFTER_S, RECORD_S (above); PYTHON, the interpreter (default .venv/bin/python);
# REPLAY_ARGS, more flags for trace_replay.py (a smoke run: "--duration 4 --rate 8 --warmup 0").
set -euo pipefail
N=${1:?usage: bench/sched_latency.sh INGRESSES}
RECORD_AFTER_S=${RECORD_AFTER_S:-8}
RECORD_S=${RECORD_S:-12}
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
read -r -a replay_args <<<"${REPLAY_ARGS:-}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" bench/trace_replay.py --modes flotilla-kv --ingresses "$N" --replica-sync on "${replay_args[@]}" \
    >"$work/replay.log" 2>&1 &
replay=$!
for _ in $(seq 1 240); do
    [ "$(pgrep -f 'flotilla gateway' | wc -l)" -ge "$N" ] && break
    kill -0 "$replay" 2>/dev/null || { cat "$work/replay.log"; exit 1; }
    sleep 0.5
done
sleep "$RECORD_AFTER_S"
perf sched record -a -o "$work/sched.data" -- sleep "$RECORD_S" >"$work/perf.log" 2>&1 || { cat "$work/perf.log"; exit 1; }
wait "$replay" || { cat "$work/replay.log"; exit 1; }
echo "through $N ingress process(es), $RECORD_S s of the trace:"
perf sched latency -i "$work/sched.data" --sort avg 2>/dev/null |
    grep -E "Task|flotilla gatewa|flotilla worker|nats-server|python|TOTAL"
grep -E "^\[" "$work/replay.log"
