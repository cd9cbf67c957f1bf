#!/usr/bin/env bash
# A local precast stack for development and tests: a Prefect server (SQLite, or PostgreSQL when
# DATABASE_URL is set), an S3-compatible endpoint (moto), the two work pools of prefect.yaml, a
# per-node GPU concurrency limit, and one process worker per pool, each in its own empty working
# directory (they share nothing but the S3 root). With DASK_WORKERS=N, also a Dask scheduler and N
# `dask worker` processes ("nodes" of encoders, each in its own folder) for `execution.cluster`,
# over mutual TLS with a CA of the stack's own (STACK_DIR/tls: `execution.cluster_tls`).
#
#   bash infra/local-stack.sh up      # prints the environment to use; state under $STACK_DIR
#   bash infra/local-stack.sh down
#
# Settings (environment): STACK_DIR (default .stack), PREFECT_PORT (4200), S3_PORT (5555),
# S3_BUCKET (precast), DATABASE_URL (postgresql+asyncpg://… ; default SQLite in STACK_DIR),
# DASK_WORKERS (0), DASK_PORT (8786), PREFECT_API_AUTH_STRING (user:password; default: one made
# for the stack, in STACK_DIR/auth-string): the server refuses every request without it (401).
# S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (moto accepts any).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
STACK_DIR=$(mkdir -p "${STACK_DIR:-.stack}" && cd "${STACK_DIR:-.stack}" && pwd)
PREFECT_PORT=${PREFECT_PORT:-4200}
S3_PORT=${S3_PORT:-5555}
S3_BUCKET=${S3_BUCKET:-precast}
DASK_WORKERS=${DASK_WORKERS:-0}
DASK_PORT=${DASK_PORT:-8786}
BIN=${PRECAST_BIN:-$ROOT/.venv/bin}
POOLS=(precast-encode precast-train)

export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export PREFECT_HOME="$STACK_DIR/prefect-home"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
if [ -n "${PREFECT_API_AUTH_STRING:-}" ]; then  # kept beside the stack, readable by its owner alone
  (umask 077 && printf '%s\n' "$PREFECT_API_AUTH_STRING" >"$STACK_DIR/auth-string")
elif [ ! -s "$STACK_DIR/auth-string" ]; then  # made once per stack
  (umask 077 && "$BIN/python" -c "import secrets; print('precast:' + secrets.token_urlsafe(24))" >"$STACK_DIR/auth-string")
fi
PREFECT_API_AUTH_STRING=$(cat "$STACK_DIR/auth-string")
# the server checks it; every client of it started here (workers, Dask workers, the CLI) sends it
export PREFECT_API_AUTH_STRING PREFECT_SERVER_API_AUTH_STRING=$PREFECT_API_AUTH_STRING
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-precast-local} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-precast-local}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}

wait_for() {  # url, what, pid, log: fails at once, with the end of its log, if the process has exited
  for _ in $(seq 1 120); do
    if "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then
      return 0
    fi
    if ! kill -0 "$3" 2>/dev/null; then
      echo "local-stack: $2 exited before it answered at $1; the end of $4:" >&2
      tail -n 20 "$4" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "local-stack: $2 did not come up at $1 (logs in $STACK_DIR)" >&2
  return 1
}

up() {
  mkdir -p "$PREFECT_HOME"
  if [ -n "${DATABASE_URL:-}" ]; then
    export PREFECT_API_DATABASE_CONNECTION_URL=$DATABASE_URL
  else
    export PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STACK_DIR/prefect.db"
  fi
  "$BIN/moto_server" -H 127.0.0.1 -p "$S3_PORT" >"$STACK_DIR/s3.log" 2>&1 &
  echo $! >"$STACK_DIR/s3.pid"
  # the server's database made first, as precast's own temporary server has it (flows/server.py):
  # a first start's migrations are shown, and a database that cannot be made is named at once
  "$BIN/python" -m flows.server
  "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" >"$STACK_DIR/server.log" 2>&1 &
  echo $! >"$STACK_DIR/server.pid"
  wait_for "http://127.0.0.1:$PREFECT_PORT/api/health" "the Prefect server" "$(cat "$STACK_DIR/server.pid")" \
    "$STACK_DIR/server.log"
  wait_for "http://127.0.0.1:$S3_PORT/" "the S3 endpoint" "$(cat "$STACK_DIR/s3.pid")" "$STACK_DIR/s3.log"
  "$BIN/python" -c "import s3fs,sys; s3fs.S3FileSystem(endpoint_url=sys.argv[1]).mkdir(sys.argv[2])" \
    "http://127.0.0.1:$S3_PORT" "$S3_BUCKET"
  for pool in "${POOLS[@]}"; do
    "$BIN/prefect" work-pool create "$pool" --type process >/dev/null 2>&1 || true
  done
  # a node never runs two GPU stages at once: the GPU stages hold a slot of this limit
  "$BIN/prefect" global-concurrency-limit create "gpu-$(hostname)" --limit 1 >/dev/null 2>&1 || true
  for pool in "${POOLS[@]}"; do
    mkdir -p "$STACK_DIR/worker-$pool"
    (cd "$STACK_DIR/worker-$pool" && PRECAST_CACHE="$STACK_DIR/worker-$pool/cache" PREFECT_WORKER_QUERY_SECONDS=1 \
      exec "$BIN/prefect" worker start --pool "$pool" --type process --limit 4) >"$STACK_DIR/worker-$pool.log" 2>&1 &
    echo $! >"$STACK_DIR/worker-$pool.pid"
  done
  if [ "$DASK_WORKERS" -gt 0 ]; then
    # mutual TLS: the stack's own CA; a client or worker without its certificate is refused
    "$BIN/precast" certificates "$STACK_DIR/tls" >/dev/null
    tls=(--tls-ca-file "$STACK_DIR/tls/ca.pem" --tls-cert "$STACK_DIR/tls/cert.pem" --tls-key "$STACK_DIR/tls/key.pem")
    "$BIN/dask" scheduler --host 127.0.0.1 --port "$DASK_PORT" --protocol tls "${tls[@]}" --no-dashboard \
      >"$STACK_DIR/dask-scheduler.log" 2>&1 &
    echo $! >"$STACK_DIR/dask-scheduler.pid"
    for index in $(seq 1 "$DASK_WORKERS"); do  # workers report their task runs to this server
      mkdir -p "$STACK_DIR/dask-worker-$index"
      (cd "$STACK_DIR/dask-worker-$index" && PRECAST_CACHE="$STACK_DIR/dask-worker-$index/cache" \
        exec "$BIN/dask" worker "tls://127.0.0.1:$DASK_PORT" "${tls[@]}" --name "node-$index" --nthreads 1 \
        --no-dashboard) >"$STACK_DIR/dask-worker-$index.log" 2>&1 &
      echo $! >"$STACK_DIR/dask-worker-$index.pid"
    done
    "$BIN/python" -c "import distributed,sys; from flows.credentials import cluster_security as s; c=distributed.Client(sys.argv[1], security=s(sys.argv[3]), timeout=60); c.wait_for_workers(int(sys.argv[2]), timeout=60); c.close()" \
      "tls://127.0.0.1:$DASK_PORT" "$DASK_WORKERS" "$STACK_DIR/tls"
  fi
  cat <<EOF
export PREFECT_API_URL=$PREFECT_API_URL
export PREFECT_API_AUTH_STRING="\$(cat $STACK_DIR/auth-string)"
export AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY=<as set>
# store root for configs: s3://$S3_BUCKET/…  with  storage.options: {endpoint_url: http://127.0.0.1:$S3_PORT}
EOF
  if [ "$DASK_WORKERS" -gt 0 ]; then
    echo "# encoders on the Dask workers: execution: {cluster: tls://127.0.0.1:$DASK_PORT, cluster_tls: $STACK_DIR/tls}"
  fi
}

down() {
  pids=()
  for pidfile in "$STACK_DIR"/*.pid; do
    [ -f "$pidfile" ] || continue
    pids+=("$(cat "$pidfile")")
    rm -f "$pidfile"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for pid in "${pids[@]}"; do pkill -TERM -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 20); do  # a graceful stop first, then no more waiting
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.5
  done
  for pid in "${pids[@]}"; do pkill -KILL -P "$pid" 2>/dev/null || true; kill -KILL "$pid" 2>/dev/null || true; done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
