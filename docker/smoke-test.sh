#!/usr/bin/env bash
# Smoke test of the CPU image with real OCI tooling and real clients:
#   1. build docker/Dockerfile with buildah (layers cached, so a rerun is quick);
#   2. run it with podman on a free loopback port, configured through PAGEDSERVE_* variables;
#   3. wait for /health, check the image's own HEALTHCHECK, the non-root user, the server
#      being the container's main process (PID 1), the API key, /v1/models and /metrics;
#   4. one chat completion and one streaming completion with the `openai` SDK;
#   5. graceful stop: SIGTERM during a longer streaming request, which must still complete,
#      and exit status 0;
# then prints image size and timings. Exits non-zero on any failure; always removes its
# container (trap), so it can be run again as it is.
#
# Needs: root, podman + buildah + runc (bash /work/shared/tools/oci-setup.sh installs them and
# prints the flags this sandbox needs; they are the defaults below), and a Python with the
# `openai` package (default: the project's .venv, `make install`).
#
# Settings (environment):
#   IMAGE=localhost/pagedserve:smoke   CONTAINER=pagedserve-smoke   PYTHON=.venv/bin/python
#   WHEELS_DIR     local wheels folder for the build (default: pip's find-links setting, if
#                  any); when set, torch comes from there and not from PyTorch's index
#   PIP_CA         CA bundle pip needs inside the build (default: pip's cert setting);
#                  handed over as a build secret, never stored in the image
#   SMOKE_NO_CACHE=1        rebuild every layer
#   SMOKE_REMOVE_IMAGE=1    remove the image at the end
#   HEALTH_TIMEOUT=600      seconds to wait for /health
#   REQUEST_TIMEOUT=600     seconds per request
#   LONG_TOKENS             tokens of the request that SIGTERM interrupts (default: about
#                           20 s worth at the decode rate of the streaming request, 24..512)
#   GRACE=300               the server's graceful-shutdown timeout; podman stop waits GRACE+30
#   BUILDAH_FLAGS, PODMAN_FLAGS, RUN_FLAGS   tool flags (defaults: this sandbox's, see below)
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-localhost/pagedserve:smoke}
CONTAINER=${CONTAINER:-pagedserve-smoke}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-600}
LONG_TOKENS=${LONG_TOKENS:-}
GRACE=${GRACE:-300}
API_KEY=smoke-test-key
MODEL_NAME=smollm2-smoke

if [ -z "${CONTAINERS_CONF:-}" ] && [ -f /var/tmp/oci-setup/containers.conf ]; then
    export CONTAINERS_CONF=/var/tmp/oci-setup/containers.conf  # written by oci-setup.sh
fi
read -r -a BUILDAH_FLAGS <<< "${BUILDAH_FLAGS:---isolation chroot --network host}"
read -r -a PODMAN_FLAGS <<< "${PODMAN_FLAGS:---runtime runc --cgroup-manager=cgroupfs}"
read -r -a RUN_FLAGS <<< "${RUN_FLAGS:---network host}"
podman_() { podman "${PODMAN_FLAGS[@]}" "$@"; }

log() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { log "FAIL: $*"; exit 1; }
now() { printf '%s' "$EPOCHREALTIME"; }
since() { "$PYTHON" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

for tool in buildah podman; do
    command -v "$tool" > /dev/null || fail "$tool not found (bash /work/shared/tools/oci-setup.sh)"
done
[ -x "$PYTHON" ] || fail "no Python at $PYTHON (make install, or set PYTHON)"
"$PYTHON" -c 'import openai' 2> /dev/null || fail "$PYTHON has no openai package"

WORK=$(mktemp -d)
CLIENT_PID=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$CLIENT_PID" ]; then kill "$CLIENT_PID" 2> /dev/null || true; fi
    if [ "$rc" -ne 0 ] && podman_ container exists "$CONTAINER" 2> /dev/null; then
        log "container log (last 40 lines):"
        podman_ logs --tail 40 "$CONTAINER" 2>&1 | sed 's/^/    /' || true
    fi
    podman_ rm -f -i "$CONTAINER" > /dev/null 2>&1 || true
    if [ "${SMOKE_REMOVE_IMAGE:-0}" = 1 ]; then podman_ rmi -f "$IMAGE" > /dev/null 2>&1 || true; fi
    rm -rf "$WORK"
    if [ "$rc" -eq 0 ]; then log "PASS"; else log "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A leftover from an interrupted run would hold the name.
podman_ rm -f -i "$CONTAINER" > /dev/null 2>&1 || true

# ---- 1. build -----------------------------------------------------------------------------
build_args=(--format docker --layers -f "$ROOT/docker/Dockerfile" -t "$IMAGE")
[ "${SMOKE_NO_CACHE:-0}" = 1 ] && build_args+=(--no-cache)
# pip's own setting (from the environment or a config file), e.g. pip_setting cert
pip_setting() {
    { pip config list 2> /dev/null || true; } | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" | head -n 1
}
WHEELS_DIR=${WHEELS_DIR-$(pip_setting find-links)}
if [ -n "$WHEELS_DIR" ] && [ -d "$WHEELS_DIR" ]; then
    build_args+=(--build-context "wheels=$WHEELS_DIR" --build-arg TORCH_INDEX_URL=)
    log "local wheels: $WHEELS_DIR"
fi
PIP_CA=${PIP_CA-$(pip_setting cert)}
if [ -n "$PIP_CA" ] && [ -f "$PIP_CA" ]; then
    build_args+=(--secret "id=pip_ca,src=$PIP_CA")
    log "CA bundle for pip in the build (a secret, not stored): $PIP_CA"
fi
log "building $IMAGE"
t0=$(now)
buildah bud "${BUILDAH_FLAGS[@]}" "${build_args[@]}" "$ROOT" > "$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log"; fail "build failed"; }
BUILD_S=$(since "$t0")
SIZE_B=$(podman_ image inspect --format '{{.Size}}' "$IMAGE")
SIZE_MB=$(( SIZE_B / 1000000 ))
CACHED=$(grep -c '^--> Using cache' "$WORK/build.log" || true)
STEPS=$(grep -c '^\[[0-9]*/[0-9]*\] STEP' "$WORK/build.log" || true)
log "built in ${BUILD_S}s (${CACHED} of ${STEPS} steps from cache); image size ${SIZE_MB} MB"

# ---- 2. run ------------------------------------------------------------------------------
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BASE=http://127.0.0.1:$PORT
log "starting $CONTAINER on $BASE"
t0=$(now)
podman_ run -d --name "$CONTAINER" "${RUN_FLAGS[@]}" \
    -e PAGEDSERVE_HOST=127.0.0.1 -e PAGEDSERVE_PORT="$PORT" \
    -e PAGEDSERVE_API_KEY="$API_KEY" -e PAGEDSERVE_SERVED_MODEL_NAME="$MODEL_NAME" \
    -e PAGEDSERVE_TIMEOUT_GRACEFUL_SHUTDOWN="$GRACE" \
    "$IMAGE" > /dev/null 2> "$WORK/run.err" || { cat "$WORK/run.err"; fail "podman run"; }
# (podman without systemd complains that it cannot schedule the image's health checks:
# harmless here, where `podman healthcheck run` below runs the check itself.)

# ---- 3. health and the container itself ---------------------------------------------------
"$PYTHON" - "$BASE" "$HEALTH_TIMEOUT" "$CONTAINER" "${PODMAN_FLAGS[@]}" <<'PY' || fail "not healthy"
import subprocess, sys, time, urllib.error, urllib.request
base, timeout, name, flags = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
deadline = time.monotonic() + timeout
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    state = subprocess.run(["podman", *flags, "inspect", "-f", "{{.State.Status}}", name],
                           capture_output=True, text=True).stdout.strip()
    if state not in ("running", "created", "configured"):
        sys.exit(f"container is {state!r} before it became healthy")
    if time.monotonic() > deadline:
        sys.exit(f"no healthy /health within {timeout:.0f}s")
    time.sleep(1)
PY
HEALTHY_S=$(since "$t0")
log "healthy after ${HEALTHY_S}s"

podman_ healthcheck run "$CONTAINER" > /dev/null || fail "the image's HEALTHCHECK reports unhealthy"
log "image HEALTHCHECK: healthy"
uid=$(podman_ exec "$CONTAINER" id -u)
[ "$uid" != 0 ] || fail "the server runs as root"
pid1=$(podman_ exec "$CONTAINER" cat /proc/1/cmdline | tr '\0' ' ' | sed "s/$API_KEY/***/")
case "$pid1" in
    *pagedserve\ serve*) ;;
    *) fail "PID 1 is not the server: $pid1" ;;
esac
log "runs as uid $uid; PID 1: $pid1"
kernels=$(podman_ exec "$CONTAINER" python3 -c \
    "from pagedserve.kernels import cpu; print(cpu.load() is not None)")
[ "$kernels" = True ] || fail "the prebuilt C++ CPU kernels do not load: $kernels"
log "prebuilt C++ CPU kernels load"

"$PYTHON" - "$BASE" "$API_KEY" "$MODEL_NAME" <<'PY' || fail "API key, /v1/models or /metrics"
import json, sys, urllib.error, urllib.request
base, key, model = sys.argv[1:4]
try:
    urllib.request.urlopen(base + "/v1/models", timeout=30)
    sys.exit("/v1/models answered without the API key")
except urllib.error.HTTPError as e:
    assert e.code == 401, e.code
req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {key}"})
with urllib.request.urlopen(req, timeout=30) as r:
    ids = [m["id"] for m in json.load(r)["data"]]
assert model in ids, ids
with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
    text = r.read().decode()
assert r.status == 200 and "# TYPE" in text, text[:200]
print(f"    401 without key; /v1/models {ids}; /metrics {len(text.splitlines())} lines")
PY

# ---- 4. requests with the openai SDK ------------------------------------------------------
cat > "$WORK/client.py" <<'PY'
"""openai-SDK checks against the smoke container:
chat | stream LONG_TOKENS_OUT | long OUT_JSON STARTED_FILE MAX_TOKENS."""
import json, sys, time
from openai import OpenAI

base, key, model, timeout, mode = sys.argv[1:6]
client = OpenAI(base_url=base + "/v1", api_key=key, timeout=float(timeout), max_retries=0)


def check_usage(usage, max_tokens=None):
    assert usage is not None, "no usage"
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    if max_tokens is not None:
        assert usage.completion_tokens <= max_tokens, usage


if mode == "chat":
    t = time.perf_counter()
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip(), c
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    check_usage(r.usage, 16)
    print(f"    chat: {time.perf_counter() - t:.1f}s finish_reason={c.finish_reason} "
          f"usage={r.usage.prompt_tokens}+{r.usage.completion_tokens} "
          f"text={c.message.content.strip()[:60]!r}")

elif mode == "stream":
    t = time.perf_counter()
    first, text, finish, usage = None, "", None, None
    for chunk in client.completions.create(
            model=model, prompt="The three primary colors are", max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.text and first is None:
                first = time.perf_counter() - t
            text += ch.text or ""
            finish = ch.finish_reason or finish
    assert text.strip(), "empty streamed text"
    assert finish in ("stop", "length"), finish
    check_usage(usage, 16)
    total = time.perf_counter() - t
    rate = (usage.completion_tokens - 1) / max(total - first, 1e-3)
    print(f"    stream: {total:.1f}s (first token {first:.1f}s, {rate:.1f} tokens/s) "
          f"finish_reason={finish} usage={usage.prompt_tokens}+{usage.completion_tokens} "
          f"text={text.strip()[:60]!r}")
    with open(sys.argv[6], "w") as f:  # size of the SIGTERM test: about 20 s of decoding
        f.write(str(min(512, max(24, round(rate * 20)))))

elif mode == "long":  # the request a SIGTERM interrupts: ignore_eos, so it runs max_tokens
    out, started, max_tokens = sys.argv[6], sys.argv[7], int(sys.argv[8])
    text, finish, usage, times = "", None, None, []
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text or ""
            finish = ch.finish_reason or finish
            if ch.text:
                times.append(time.time())
                if len(times) == 1:
                    open(started, "w").close()
    json.dump({"text": text, "finish_reason": finish, "chunks": len(times),
               "last_chunk": times[-1] if times else 0,
               "completion_tokens": usage.completion_tokens if usage else None}, open(out, "w"))
PY

"$PYTHON" "$WORK/client.py" "$BASE" "$API_KEY" "$MODEL_NAME" "$REQUEST_TIMEOUT" chat \
    || fail "chat completion"
"$PYTHON" "$WORK/client.py" "$BASE" "$API_KEY" "$MODEL_NAME" "$REQUEST_TIMEOUT" stream \
    "$WORK/long_tokens" || fail "streaming completion"
LONG_TOKENS=${LONG_TOKENS:-$(cat "$WORK/long_tokens")}

# ---- 5. graceful stop -----------------------------------------------------------------------
log "graceful stop: SIGTERM during a ${LONG_TOKENS}-token streaming request"
"$PYTHON" "$WORK/client.py" "$BASE" "$API_KEY" "$MODEL_NAME" "$REQUEST_TIMEOUT" long \
    "$WORK/long.json" "$WORK/started" "$LONG_TOKENS" > "$WORK/long.log" 2>&1 &
CLIENT_PID=$!
for _ in $(seq "$REQUEST_TIMEOUT"); do
    [ -e "$WORK/started" ] && break
    kill -0 "$CLIENT_PID" 2> /dev/null || { cat "$WORK/long.log"; fail "long request died"; }
    sleep 1
done
[ -e "$WORK/started" ] || fail "long request produced no token in ${REQUEST_TIMEOUT}s"
TERM_AT=$(now)
t0=$(now)
# podman stop sends the image's STOPSIGNAL (SIGTERM), then SIGKILL after --time seconds.
podman_ stop --time "$((GRACE + 30))" "$CONTAINER" > /dev/null 2> "$WORK/stop.err" \
    || { cat "$WORK/stop.err"; fail "podman stop"; }
STOP_S=$(since "$t0")
CLIENT_RC=0
wait "$CLIENT_PID" || CLIENT_RC=$?
CLIENT_PID=""
EXIT_CODE=$(podman_ inspect -f '{{.State.ExitCode}}' "$CONTAINER")
"$PYTHON" - "$WORK/long.json" "$TERM_AT" "$LONG_TOKENS" "$CLIENT_RC" "$EXIT_CODE" "$STOP_S" <<'PY' \
    || { cat "$WORK/long.log"; podman_ logs --tail 15 "$CONTAINER" 2>&1 | sed 's/^/    /'; fail "graceful stop"; }
import json, sys
path, term_at, max_tokens, client_rc, exit_code, stop_s = sys.argv[1:7]
assert client_rc == "0", f"the streaming client failed (exit {client_rc})"
r = json.load(open(path))
after = r["last_chunk"] - float(term_at)
print(f"    in-flight request: finish_reason={r['finish_reason']} "
      f"completion_tokens={r['completion_tokens']}/{max_tokens}, last token {after:.1f}s "
      f"after SIGTERM; container exit code {exit_code} after {stop_s}s")
assert after > 0, "the request had finished before SIGTERM: raise LONG_TOKENS"
assert r["finish_reason"] == "length", r["finish_reason"]
assert r["completion_tokens"] == int(max_tokens), r["completion_tokens"]
assert exit_code == "0", f"container exit code {exit_code}"
PY

log "summary: image ${SIZE_MB} MB; build ${BUILD_S}s; healthy ${HEALTHY_S}s after start;" \
    "SIGTERM to exit ${STOP_S}s (exit code ${EXIT_CODE})"
