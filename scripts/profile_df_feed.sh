#!/bin/bash
# Profiles the Spark Python workers of DataFrame feed tasks with py-spy (issue 12).
#
# Runs scripts/bench_feed.py (RDD and DataFrame modes only), attaches py-spy to every
# pyspark.daemon process of that run as soon as the DataFrame phase starts, samples for
# DURATION_S seconds (py-spy's --duration; default 30), and prints the share of feed-task samples spent writing Arrow IPC
# chunks (frames() minus reading Spark's batches from the JVM), authenticating frames
# (GMAC) and sending them.
#
# Usage: scripts/profile_df_feed.sh OUT_PREFIX [TFOS_ROOT] [DURATION_S]
#   OUT_PREFIX: where the logs and raw py-spy stacks go (OUT_PREFIX.log, OUT_PREFIX.<pid>.txt)
#   TFOS_ROOT:  a tfos checkout to profile (put first on PYTHONPATH; default: this one)
# Needs py-spy and ptrace rights over the Spark workers (same user, or root).
set -euo pipefail
out=$1
root=${2:-$(cd "$(dirname "$0")/.." && pwd)}
duration=${3:-30}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python "$here/bench_feed.py" --rows 100000 --partitions 8 --repeat 4 --scale '' \
    --skip infer,small,first,c24,tfdata > "$out.log" 2>&1 &
bp=$!
until grep -q "DataFrame cached" "$out.log"; do
    sleep 0.2
    kill -0 $bp 2>/dev/null || { echo "bench_feed.py ended early, see $out.log" >&2; exit 1; }
done
daemons=$(ps -eo pid=,ppid=,args= | python -c "
import sys
kids = {}
for line in sys.stdin:
    pid, ppid, *args = line.split(None, 2)
    kids.setdefault(ppid, []).append((pid, args[0] if args else ''))
todo, found = ['$bp'], []
while todo:
    for child, args in kids.get(todo.pop(), []):
        todo.append(child)
        if 'pyspark.daemon' in args:
            found.append(child)
print(' '.join(found))")
for d in $daemons; do
    py-spy record --pid "$d" --subprocesses --duration "$duration" --rate 200 --format raw \
        -o "$out.$d.txt" --nonblocking > "$out.$d.err" 2>&1 &
done
wait
python - "$out" <<'PY'
import glob, sys
out = sys.argv[1]
tot = ipc = seal = send = jvm = 0
for f in glob.glob(out + ".*.txt"):
    for line in open(f):
        stack, _, n = line.rstrip().rpartition(" ")
        if "_feed_partition" not in stack:
            continue
        n = int(n)
        tot += n
        if "frames (tfos" in stack:
            if "load_stream" in stack:
                jvm += n
            else:
                ipc += n
        if "seal" in stack:
            seal += n
        if "_sendall_parts" in stack or "sendall" in stack:
            send += n
pct = lambda x: 100.0 * x / max(1, tot)
print(f"feed-task samples: {tot}")
print(f"  writing Arrow IPC chunks: {pct(ipc):.1f}%")
print(f"  reading Spark's batches from the JVM: {pct(jvm):.1f}%")
print(f"  GMAC of frames: {pct(seal):.1f}%")
print(f"  socket sends (incl. waiting for the node): {pct(send):.1f}%")
PY
