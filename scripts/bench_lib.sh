# Sourced by bench_host.sh and bench_cluster.sh (and shipped beside them in
# scripts/gpu-bundle.sh's bundle): what both need to start sidecars.

# A loopback port the kernel says is free now (as the test kit's free_port).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
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
