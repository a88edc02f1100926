# Sourced by bench_host.sh and bench_cluster.sh (and shipped beside them in
# scripts/gpu-bundle.sh's bundle): what both need to start sidecars.

# A loopback port to listen on, outside the ephemeral range (as the test
# kit's free_port: a port picked by binding port 0 could be taken by an
# outgoing connection before the sidecar binds it); each call is another
# process, and its pid sets where it looks first.
free_port() {
  python3 -c '
import os, socket
low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
lo, hi = (low // 2, low) if low >= 3072 else (high + 1, 65536)
span = hi - lo
for i in range(span):
    p = lo + (os.getpid() * 7919 + i) % span
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            continue
        print(p)
        break
'
}

# Wait until the sidecar just started in the background (pid $!, passed as
# $1) serves its socket $2; else print its log $3 and exit, naming it $4.
wait_serving() {
  local pid=$1 sock=$2 log=$3 what=$4
  for _ in $(seq 600); do
    [ -S "$sock" ] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "$what did not start:" >&2
  tail -20 "$log" >&2
  exit 1
}
