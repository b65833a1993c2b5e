#!/usr/bin/env bash
# The CPU compose stack end to end, on a machine with a Docker daemon and Compose v2.24.4+:
# build, up, wait for health, then one request through each door, /metrics, and down.
#
#   docker/compose_smoke.sh            # SPECPAIR_PYTHON_IMAGE / SPECPAIR_TORCH_INDEX pass through
#
# Exit status 0 only if every check passed; the stack is taken down whatever happened.
set -euo pipefail
cd "$(dirname "$0")/.."

compose=(docker compose -f docker-compose.yml -f docker-compose.cpu.yml)
need=2.24.4  # the CPU overlay's `!reset`
# Without the Compose v2 plugin `docker compose` is no command, and docker answers the flag:
# "unknown flag: --short". Say what is missing instead.
if ! version=$(docker compose version --short 2>/dev/null); then
    echo "compose_smoke: Docker Compose v2 (the 'docker compose' plugin, ${need} or later) is" \
        "missing: 'docker compose version' fails here. Install docker-compose-plugin;" \
        "Compose v1 ('docker-compose' 1.x) cannot read the CPU overlay." >&2
    exit 2
fi
version=${version#v}
if [ "$(printf '%s\n' "$need" "$version" | sort -V | head -n 1)" != "$need" ]; then
    echo "compose_smoke: Docker Compose ${version} is older than ${need}, the oldest that" \
        "reads the CPU overlay's !reset" >&2
    exit 2
fi
echo "==> Docker Compose ${version} (needs ${need} or later)"

cleanup() { "${compose[@]}" down --timeout 30 >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "==> build and start (the first build downloads torch)"
started=$(date +%s)
"${compose[@]}" up --build --detach --wait --wait-timeout 900
echo "==> healthy after $(( $(date +%s) - started )) s"
"${compose[@]}" ps

echo "==> SDK over gRPC (specpair generate, inside the target's container)"
"${compose[@]}" exec -T target specpair generate "def add(a, b):" --max-tokens 16 --json \
    --address 127.0.0.1:50051 | python3 -c 'import json, sys; r = json.load(sys.stdin); \
assert r["completion_tokens"] > 0, r; print("generate:", r["completion_tokens"], "tokens, accept lengths", r["accept_lengths"])'

echo "==> OpenAI-compatible HTTP on 127.0.0.1:8000"
curl -fsS http://127.0.0.1:8000/v1/models
echo
curl -fsS http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    ${SPECPAIR_API_KEY:+-H "Authorization: Bearer ${SPECPAIR_API_KEY}"} \
    -d '{"model": "target", "max_tokens": 16, "temperature": 0,
         "messages": [{"role": "user", "content": "Write a function that adds two numbers."}]}' \
    | python3 -c 'import json, sys; r = json.load(sys.stdin); \
assert r["usage"]["completion_tokens"] > 0, r; print("chat:", r["usage"])'

echo "==> Prometheus /metrics of the target"
curl -fsS http://127.0.0.1:9451/metrics | grep -E '^specpair_target_(generation_tokens_total|requests_total)'

echo "==> controller status"
"${compose[@]}" exec -T controller specpair ctl --address 127.0.0.1:50053 status

echo "==> all checks passed"
