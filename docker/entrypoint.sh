#!/bin/sh
# Container entrypoint: `pagedserve serve` configured from PAGEDSERVE_* environment variables.
#
#   docker run IMAGE                      -> pagedserve serve --host 0.0.0.0 --port 8000 [env flags]
#   docker run IMAGE --max-num-seqs 8     -> ... [env flags] --max-num-seqs 8  (later flags win)
#   docker run IMAGE /models/m.gguf       -> ... [env flags] /models/m.gguf  (vllm serve MODEL's)
#   docker run IMAGE pagedserve generate "Hi" / docker run IMAGE sh
#                                         -> runs that command as it is (a command on PATH)
#
# Each variable maps to the serve flag of the same name (PAGEDSERVE_MAX_MODEL_LEN ->
# --max-model-len); an unset or empty variable leaves the server's default. The server is
# started with `exec`, so it is the container's main process and receives SIGTERM itself.
set -eu

# Threads: torch sizes its pool from the host's cores, not from the container's CPU quota,
# and oversubscribes a limited container. Unless set, use the quota (cgroup v2 or v1),
# capped by the CPUs this process may run on.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cpus=$(nproc 2>/dev/null || echo 1)
    quota=0 period=0
    if [ -r /sys/fs/cgroup/cpu.max ]; then                  # cgroup v2: "max 100000" or "150000 100000"
        read -r quota period < /sys/fs/cgroup/cpu.max || true
    elif [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then   # cgroup v1: -1 when unlimited
        quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)
        period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
    fi
    case "$quota$period" in
        *[!0-9]*|"") ;;  # "max", "-1" or unreadable: no quota
        *)
            if [ "$quota" -gt 0 ] && [ "$period" -gt 0 ]; then
                limit=$(( (quota + period - 1) / period ))
                [ "$limit" -lt "$cpus" ] && cpus=$limit
            fi ;;
    esac
    OMP_NUM_THREADS=$cpus
    export OMP_NUM_THREADS
fi
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-$OMP_NUM_THREADS}"

# A first argument that names a command is run as it is (same thread settings); any other
# is the server's, as vLLM's image takes its model (a file, a folder or a name) first.
is_command() {
    case "$1" in
        -*|*.gguf) return 1 ;;
        */*) [ -f "$1" ] && [ -x "$1" ] ;;
        *) command -v "$1" >/dev/null 2>&1 ;;
    esac
}
if [ "$#" -gt 0 ] && is_command "$1"; then
    exec "$@"
fi

# The flags from the environment go first and the container's arguments after them, so an
# argument given on the command line overrides the same setting from the environment.
nargs=$#
if [ -n "${PAGEDSERVE_SERVED_MODEL_NAME:-}" ]; then
    # several names, separated by spaces; first, so that --host ends the list (last, it took
    # a model given first on the command line for one more name)
    set -f  # no glob: "gpt-?" is a name
    # shellcheck disable=SC2086 # split on purpose
    set -- "$@" --served-model-name $PAGEDSERVE_SERVED_MODEL_NAME
    set +f
fi
set -- "$@" --host "${PAGEDSERVE_HOST:-0.0.0.0}" --port "${PAGEDSERVE_PORT:-8000}"
[ -n "${PAGEDSERVE_MODEL:-}" ] && set -- "$@" --model "$PAGEDSERVE_MODEL"
[ -n "${PAGEDSERVE_DTYPE:-}" ] && set -- "$@" --dtype "$PAGEDSERVE_DTYPE"
[ -n "${PAGEDSERVE_DEVICE:-}" ] && set -- "$@" --device "$PAGEDSERVE_DEVICE"
[ -n "${PAGEDSERVE_NUM_THREADS:-}" ] && set -- "$@" --num-threads "$PAGEDSERVE_NUM_THREADS"
[ -n "${PAGEDSERVE_BLOCK_SIZE:-}" ] && set -- "$@" --block-size "$PAGEDSERVE_BLOCK_SIZE"
[ -n "${PAGEDSERVE_NUM_KV_BLOCKS:-}" ] && set -- "$@" --num-kv-blocks "$PAGEDSERVE_NUM_KV_BLOCKS"
[ -n "${PAGEDSERVE_KV_CACHE_MEMORY_GIB:-}" ] \
    && set -- "$@" --kv-cache-memory-gib "$PAGEDSERVE_KV_CACHE_MEMORY_GIB"
[ -n "${PAGEDSERVE_GPU_MEMORY_UTILIZATION:-}" ] \
    && set -- "$@" --gpu-memory-utilization "$PAGEDSERVE_GPU_MEMORY_UTILIZATION"
[ -n "${PAGEDSERVE_MAX_NUM_BATCHED_TOKENS:-}" ] \
    && set -- "$@" --max-num-batched-tokens "$PAGEDSERVE_MAX_NUM_BATCHED_TOKENS"
[ -n "${PAGEDSERVE_MAX_NUM_SEQS:-}" ] && set -- "$@" --max-num-seqs "$PAGEDSERVE_MAX_NUM_SEQS"
[ -n "${PAGEDSERVE_MAX_MODEL_LEN:-}" ] && set -- "$@" --max-model-len "$PAGEDSERVE_MAX_MODEL_LEN"
[ -n "${PAGEDSERVE_MAX_QUEUE:-}" ] && set -- "$@" --max-queue "$PAGEDSERVE_MAX_QUEUE"
[ -n "${PAGEDSERVE_TRITON_ATTENTION:-}" ] \
    && set -- "$@" --triton-attention "$PAGEDSERVE_TRITON_ATTENTION"
[ -n "${PAGEDSERVE_TENSOR_PARALLEL_SIZE:-}" ] \
    && set -- "$@" --tensor-parallel-size "$PAGEDSERVE_TENSOR_PARALLEL_SIZE"
[ -n "${PAGEDSERVE_DISTRIBUTED_TIMEOUT:-}" ] \
    && set -- "$@" --distributed-timeout "$PAGEDSERVE_DISTRIBUTED_TIMEOUT"
[ -n "${PAGEDSERVE_STREAM_INTERVAL:-}" ] \
    && set -- "$@" --stream-interval "$PAGEDSERVE_STREAM_INTERVAL"
[ -n "${PAGEDSERVE_SCHEDULING_POLICY:-}" ] \
    && set -- "$@" --scheduling-policy "$PAGEDSERVE_SCHEDULING_POLICY"
[ -n "${PAGEDSERVE_CHAT_TEMPLATE:-}" ] \
    && set -- "$@" --chat-template "$PAGEDSERVE_CHAT_TEMPLATE"
[ -n "${PAGEDSERVE_SEED:-}" ] && set -- "$@" --seed "$PAGEDSERVE_SEED"
[ -n "${PAGEDSERVE_TOOL_CALL_PARSER:-}" ] \
    && set -- "$@" --tool-call-parser "$PAGEDSERVE_TOOL_CALL_PARSER"
[ -n "${PAGEDSERVE_REASONING_PARSER:-}" ] \
    && set -- "$@" --reasoning-parser "$PAGEDSERVE_REASONING_PARSER"
[ -n "${PAGEDSERVE_DEFAULT_CHAT_TEMPLATE_KWARGS:-}" ] \
    && set -- "$@" --default-chat-template-kwargs "$PAGEDSERVE_DEFAULT_CHAT_TEMPLATE_KWARGS"
[ -n "${PAGEDSERVE_GENERATION_CONFIG:-}" ] \
    && set -- "$@" --generation-config "$PAGEDSERVE_GENERATION_CONFIG"
[ -n "${PAGEDSERVE_OVERRIDE_GENERATION_CONFIG:-}" ] \
    && set -- "$@" --override-generation-config "$PAGEDSERVE_OVERRIDE_GENERATION_CONFIG"
[ -n "${PAGEDSERVE_ALLOWED_ORIGINS:-}" ] \
    && set -- "$@" --allowed-origins "$PAGEDSERVE_ALLOWED_ORIGINS"
[ -n "${PAGEDSERVE_ALLOWED_METHODS:-}" ] \
    && set -- "$@" --allowed-methods "$PAGEDSERVE_ALLOWED_METHODS"
[ -n "${PAGEDSERVE_ALLOWED_HEADERS:-}" ] \
    && set -- "$@" --allowed-headers "$PAGEDSERVE_ALLOWED_HEADERS"
[ -n "${PAGEDSERVE_API_SERVER_COUNT:-}" ] \
    && set -- "$@" --api-server-count "$PAGEDSERVE_API_SERVER_COUNT"
[ -n "${PAGEDSERVE_MAX_N:-}" ] && set -- "$@" --max-n "$PAGEDSERVE_MAX_N"
[ -n "${PAGEDSERVE_MAX_PROMPTS:-}" ] && set -- "$@" --max-prompts "$PAGEDSERVE_MAX_PROMPTS"
[ -n "${PAGEDSERVE_MAX_REQUEST_BYTES:-}" ] \
    && set -- "$@" --max-request-bytes "$PAGEDSERVE_MAX_REQUEST_BYTES"
[ -n "${PAGEDSERVE_TIMEOUT_READ:-}" ] && set -- "$@" --timeout-read "$PAGEDSERVE_TIMEOUT_READ"
[ -n "${PAGEDSERVE_TIMEOUT_KEEP_ALIVE:-}" ] \
    && set -- "$@" --timeout-keep-alive "$PAGEDSERVE_TIMEOUT_KEEP_ALIVE"
[ -n "${PAGEDSERVE_MAX_CONNECTIONS:-}" ] \
    && set -- "$@" --max-connections "$PAGEDSERVE_MAX_CONNECTIONS"
# The key goes to the server in its environment (vLLM's variable), not on its command line,
# where any process of the host could read it.
if [ -n "${PAGEDSERVE_API_KEY:-}" ]; then
    VLLM_API_KEY=$PAGEDSERVE_API_KEY
    export VLLM_API_KEY
fi
[ -n "${PAGEDSERVE_TIMEOUT_GRACEFUL_SHUTDOWN:-}" ] \
    && set -- "$@" --timeout-graceful-shutdown "$PAGEDSERVE_TIMEOUT_GRACEFUL_SHUTDOWN"
[ -n "${PAGEDSERVE_LOG_LEVEL:-}" ] && set -- "$@" --log-level "$PAGEDSERVE_LOG_LEVEL"
# A boolean variable as --FLAG, --no-FLAG or nothing: bool_flag NAME VALUE FLAG.
bool_flag() {
    case "$2" in
        "") ;;
        1|true|True|TRUE|yes|on) echo "--$3" ;;
        0|false|False|FALSE|no|off) echo "--no-$3" ;;
        *) echo "$1: expected true or false, got '$2'" >&2; return 2 ;;
    esac
}
flag=$(bool_flag PAGEDSERVE_ENABLE_PREFIX_CACHING "${PAGEDSERVE_ENABLE_PREFIX_CACHING:-}" \
    enable-prefix-caching) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_ENFORCE_EAGER "${PAGEDSERVE_ENFORCE_EAGER:-}" enforce-eager) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_PIECEWISE_GRAPHS "${PAGEDSERVE_PIECEWISE_GRAPHS:-}" \
    piecewise-graphs) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_FULL_GRAPHS "${PAGEDSERVE_FULL_GRAPHS:-}" full-graphs) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_ASYNC_SCHEDULING "${PAGEDSERVE_ASYNC_SCHEDULING:-}" \
    async-scheduling) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_FRONTEND_MULTIPROCESSING "${PAGEDSERVE_FRONTEND_MULTIPROCESSING:-}" \
    frontend-multiprocessing) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE \
    "${PAGEDSERVE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE:-}" exclude-tools-when-tool-choice-none) \
    || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_TRUST_REQUEST_CHAT_TEMPLATE \
    "${PAGEDSERVE_TRUST_REQUEST_CHAT_TEMPLATE:-}" trust-request-chat-template) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_ENABLE_REQUEST_ID_HEADERS \
    "${PAGEDSERVE_ENABLE_REQUEST_ID_HEADERS:-}" enable-request-id-headers) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_ALLOW_CREDENTIALS "${PAGEDSERVE_ALLOW_CREDENTIALS:-}" \
    allow-credentials) || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"
flag=$(bool_flag PAGEDSERVE_NATIVE_KERNELS "${PAGEDSERVE_NATIVE_KERNELS:-}" native-kernels) \
    || exit 2
[ -n "$flag" ] && set -- "$@" "$flag"

# Move the container's own arguments (the first $nargs) behind the flags from the environment.
i=0
while [ "$i" -lt "$nargs" ]; do
    set -- "$@" "$1"
    shift
    i=$((i + 1))
done

exec pagedserve serve "$@"
