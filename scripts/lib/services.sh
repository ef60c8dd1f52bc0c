# shellcheck shell=bash
# scripts/lib/services.sh — sourced by scripts/test.
#
# Makes the toolchain and local services the tests need available on a plain Debian 12 machine
# without Docker, installing (apt) and starting whatever is missing. Each function prints one line.
#
#   ensure_rust [fmt] [clippy]  cargo on PATH (never downloads a toolchain), optional components
#   ensure_build_libs           the C libraries txinbox-kafka's features link (OpenSSL, Cyrus SASL,
#                               libcurl) with their headers, and pkg-config to find them
#   ensure_postgres             PostgreSQL on 127.0.0.1:5432, trust auth; exports DATABASE_URL and
#                               TXINBOX_PG_BIN (initdb/pg_ctl for tests that run a private cluster)
#   ensure_rabbitmq             RabbitMQ on 127.0.0.1:5672; exports AMQP_URL
#   ensure_rabbitmq_tls         a second RabbitMQ node (txinbox-tls@localhost), TLS only, on
#                               127.0.0.1:5671, with the certificates of ensure_test_certs
#                               (scripts/lib/tls.sh; call that first); exports AMQPS_URL
#
# Variables already set by the caller (DATABASE_URL, AMQP_URL, AMQPS_URL, TXINBOX_PG_BIN) are
# respected.
# Safe under `set -euo pipefail`.

# Run a command as root: directly when root, else through sudo.
_txinbox_as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        echo "error: need root (or sudo) to run: $*" >&2
        return 1
    fi
}

# apt-get install, with at most one `apt-get update` per script run.
_txinbox_apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: $* missing and apt-get not available; install it by hand" >&2
        return 1
    fi
    if [ -z "${_TXINBOX_APT_UPDATED:-}" ]; then
        _txinbox_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
        _TXINBOX_APT_UPDATED=1
    fi
    _txinbox_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
}

# True when something accepts TCP connections on 127.0.0.1:$1.
_txinbox_port_open() {
    timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

# "a, b and c" from the arguments, for the one-line summaries.
_txinbox_join() {
    local out=$1
    shift
    while [ $# -gt 1 ]; do out+=", $1"; shift; done
    [ $# -eq 1 ] && out+=" and $1"
    echo "$out"
}

ensure_rust() {
    local cargo_bin="${CARGO_HOME:-${HOME:-/root}/.cargo}/bin"
    case ":$PATH:" in *":$cargo_bin:"*) ;; *) export PATH="$cargo_bin:$PATH" ;; esac
    if ! command -v cargo >/dev/null 2>&1; then
        echo "error: cargo not found (looked on PATH and in $cargo_bin)." >&2
        echo "       This project uses the preinstalled rustup toolchain; install Rust via rustup first." >&2
        return 1
    fi
    local c
    for c in "$@"; do
        if ! cargo "$c" --version >/dev/null 2>&1; then
            echo "error: 'cargo $c' unavailable; run: rustup component add ${c/fmt/rustfmt}" >&2
            return 1
        fi
    done
    echo "rust: $(cargo --version)${*:+ (with $*)}"
}

ensure_build_libs() {
    # pkg-config module => Debian package: `ssl` (default) links OpenSSL, `gssapi` Cyrus SASL,
    # `oidc` libcurl; CI builds with --all-features, so all of them.
    local wanted=(openssl:libssl-dev libsasl2:libsasl2-dev libcurl:libcurl4-openssl-dev) missing=() w
    if ! command -v pkg-config >/dev/null 2>&1; then missing+=(pkg-config); fi
    for w in "${wanted[@]}"; do
        if ! command -v pkg-config >/dev/null 2>&1 || ! pkg-config --exists "${w%%:*}"; then
            missing+=("${w#*:}")
        fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        _txinbox_apt_install "${missing[@]}" || return 1
        echo "build libs: installed $(_txinbox_join "${missing[@]}")"
    else
        echo "build libs: OpenSSL, Cyrus SASL and libcurl headers present"
    fi
}

ensure_postgres() {
    local did=() latest ver name status hba

    # Server binaries (also needed for the private clusters some tests start).
    if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; then
        _txinbox_apt_install postgresql
        did+=(installed)
    fi
    latest=$(printf '%s\n' /usr/lib/postgresql/*/bin/postgres | cut -d/ -f5 | sort -V | tail -n1)
    export TXINBOX_PG_BIN="${TXINBOX_PG_BIN:-/usr/lib/postgresql/$latest/bin}"

    # A caller-provided DATABASE_URL that answers wins; no local cluster needed.
    if [ -n "${DATABASE_URL:-}" ] && pg_isready -q -d "$DATABASE_URL" 2>/dev/null; then
        echo "postgres: using DATABASE_URL (reachable); TXINBOX_PG_BIN=$TXINBOX_PG_BIN"
        return 0
    fi

    # Pick the cluster on port 5432, else <ver>/main, else create <ver>/main.
    read -r ver name < <(pg_lsclusters -h | awk '$3 == 5432 { print $1, $2; exit }') || true
    if [ -z "${name:-}" ]; then
        ver=$latest
        name=main
        if pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main" { f = 1 } END { exit !f }'; then
            _txinbox_as_root pg_conftool "$ver" main set port 5432
            did+=("moved $ver/main to port 5432")
        else
            _txinbox_as_root pg_createcluster --port 5432 "$ver" main >/dev/null
            did+=("created cluster $ver/main")
        fi
    fi

    # Listen on 127.0.0.1 (default 'localhost' covers it).
    case "$(_txinbox_as_root pg_conftool -s "$ver" "$name" show listen_addresses 2>/dev/null || echo localhost)" in
        *localhost* | *127.0.0.1* | *'*'* | *0.0.0.0*) ;;
        *)
            _txinbox_as_root pg_conftool "$ver" "$name" set listen_addresses localhost
            did+=("set listen_addresses")
            ;;
    esac

    # Trust auth for local sockets and 127.0.0.1 (first matching line wins, so prepend).
    hba=$(_txinbox_as_root pg_conftool -s "$ver" "$name" show hba_file 2>/dev/null || echo "/etc/postgresql/$ver/$name/pg_hba.conf")
    if ! _txinbox_as_root grep -Eq '^[[:space:]]*host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust' "$hba"; then
        _txinbox_as_root sed -i -e '1i local all all trust' -e '1i host all all 127.0.0.1/32 trust' "$hba"
        did+=("configured trust auth")
    fi

    # Start (or restart to apply listen/port changes, or reload for pg_hba changes).
    status=$(pg_lsclusters -h | awk -v v="$ver" -v n="$name" '$1 == v && $2 == n { print $4 }')
    if ! pg_isready -q -h 127.0.0.1 -p 5432; then
        if [ "$status" = online ]; then
            _txinbox_as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" restart
            did+=(restarted)
        else
            _txinbox_as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start
            did+=(started)
        fi
    elif [[ " ${did[*]} " == *"trust auth"* ]]; then
        _txinbox_as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" reload
    fi

    local i
    for ((i = 0; i < 60; i++)); do
        pg_isready -q -h 127.0.0.1 -p 5432 && break
        sleep 1
    done
    if ! pg_isready -q -h 127.0.0.1 -p 5432; then
        echo "error: PostgreSQL $ver/$name not ready on 127.0.0.1:5432 after 60s; log tail:" >&2
        _txinbox_as_root tail -n 20 "/var/log/postgresql/postgresql-$ver-$name.log" >&2 || true
        return 1
    fi

    export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
    if ! psql "$DATABASE_URL" -Atqc 'select 1' >/dev/null; then
        echo "error: cannot connect with DATABASE_URL=$DATABASE_URL" >&2
        return 1
    fi
    if [ ${#did[@]} -eq 0 ]; then
        echo "postgres: already running ($ver/$name on 127.0.0.1:5432)"
    else
        echo "postgres: $(_txinbox_join "${did[@]}") ($ver/$name on 127.0.0.1:5432)"
    fi
}

ensure_rabbitmq() {
    local did=()
    if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
        _txinbox_apt_install rabbitmq-server
        did+=(installed)
    fi
    case ":$PATH:" in *:/usr/sbin:*) ;; *) export PATH="$PATH:/usr/sbin" ;; esac

    # Anything answering on 5672 counts as running (it may be a container, not this node).
    if ! _txinbox_port_open 5672; then
        if _txinbox_as_root rabbitmqctl -q ping >/dev/null 2>&1; then
            _txinbox_as_root rabbitmqctl -q start_app >/dev/null 2>&1 || true # node up, app stopped
        else
            _txinbox_as_root rabbitmq-server -detached >/dev/null
        fi
        did+=(started)
        local i
        for ((i = 0; i < 90; i++)); do
            _txinbox_port_open 5672 && break
            sleep 1
        done
        if ! _txinbox_port_open 5672; then
            echo "error: RabbitMQ not listening on 127.0.0.1:5672 after 90s; see /var/log/rabbitmq/" >&2
            return 1
        fi
        _txinbox_as_root rabbitmqctl -q -t 30 await_startup >/dev/null
    fi

    export AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
    if [ ${#did[@]} -eq 0 ]; then
        echo "rabbitmq: already running (127.0.0.1:5672)"
    else
        echo "rabbitmq: $(_txinbox_join "${did[@]}") (127.0.0.1:5672)"
    fi
}

# The TLS node's files: config, plugins, data, logs (owned by the rabbitmq user, who runs it).
_txinbox_rabbitmq_tls_dir() {
    echo "${TXINBOX_RABBITMQ_TLS_DIR:-/var/lib/txinbox/rabbitmq-tls}"
}

_TXINBOX_RABBITMQ_TLS_NODE=txinbox-tls@localhost

# rabbitmqctl against the TLS node (the Debian wrapper runs it as the rabbitmq user, whose
# Erlang cookie both nodes share).
_txinbox_rabbitmq_tls_ctl() {
    _txinbox_as_root rabbitmqctl -q -n "$_TXINBOX_RABBITMQ_TLS_NODE" "$@"
}

# Starts the TLS node with its own node name, data, logs, config and plugins, so the shared node
# on 5672 is never touched. RABBITMQ_CONF_ENV_FILE points away from /etc/rabbitmq/rabbitmq-env.conf
# (which names the shared node); the distribution port is fixed and free (the shared node's is
# 25672); the management plugin stays off.
_txinbox_rabbitmq_tls_start() {
    local dir=$1
    _txinbox_as_root env \
        RABBITMQ_NODENAME="$_TXINBOX_RABBITMQ_TLS_NODE" \
        RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" \
        RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
        RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$dir/mnesia" \
        RABBITMQ_LOG_BASE="$dir/log" \
        RABBITMQ_PID_FILE="$dir/pid" \
        RABBITMQ_DIST_PORT=25671 \
        ERL_EPMD_ADDRESS=127.0.0.1 \
        ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}" \
        rabbitmq-server -detached >/dev/null
}

# The TLS node's rabbitmq.conf for certificates in $1. TLS only: no plaintext listener.
# verify_peer checks a client certificate when one is sent (EXTERNAL logs in as its CN);
# fail_if_no_peer_cert = false lets PLAIN clients connect without one.
_txinbox_rabbitmq_tls_conf() {
    printf '%s\n' \
        'listeners.tcp = none' \
        'listeners.ssl.default = 127.0.0.1:5671' \
        "ssl_options.cacertfile = $1/ca.pem" \
        "ssl_options.certfile = $1/server.pem" \
        "ssl_options.keyfile = $1/server.key" \
        'ssl_options.verify = verify_peer' \
        'ssl_options.fail_if_no_peer_cert = false' \
        'auth_mechanisms.1 = PLAIN' \
        'auth_mechanisms.2 = AMQPLAIN' \
        'auth_mechanisms.3 = EXTERNAL' \
        'ssl_cert_login_from = common_name'
}

ensure_rabbitmq_tls() {
    local dir tls did=() i stamp
    dir=$(_txinbox_rabbitmq_tls_dir)
    tls=${TXINBOX_TLS_DIR:-/var/lib/txinbox/tls}
    if [ -n "${AMQPS_URL:-}" ]; then
        echo "rabbitmq-tls: using AMQPS_URL (given)"
        return 0
    fi
    if [ ! -s "$tls/server.pem" ] || [ ! -s "$tls/ca.pem" ]; then
        echo "error: no test certificates in $tls; run ensure_test_certs (scripts/lib/tls.sh) first" >&2
        return 1
    fi
    if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
        _txinbox_apt_install rabbitmq-server
        did+=(installed)
    fi
    case ":$PATH:" in *:/usr/sbin:*) ;; *) export PATH="$PATH:/usr/sbin" ;; esac

    _txinbox_as_root mkdir -p "$dir/log" "$dir/mnesia"
    _txinbox_rabbitmq_tls_conf "$tls" | _txinbox_as_root tee "$dir/rabbitmq.conf" >/dev/null
    echo '[rabbitmq_auth_mechanism_ssl].' | _txinbox_as_root tee "$dir/enabled_plugins" >/dev/null
    echo '[].' | _txinbox_as_root tee "$dir/advanced.config" >/dev/null
    _txinbox_as_root touch "$dir/rabbitmq-env.conf"
    _txinbox_as_root chown -R rabbitmq:rabbitmq "$dir"
    # What the running node was started with: a change of configuration or certificates
    # restarts it (this node only).
    stamp=$({ _txinbox_rabbitmq_tls_conf "$tls"; cat "$tls/ca.pem" "$tls/server.pem"; } | sha256sum | cut -c1-16)

    if _txinbox_port_open 5671 && [ "$(cat "$dir/started" 2>/dev/null || true)" != "$stamp" ] &&
        _txinbox_rabbitmq_tls_ctl ping >/dev/null 2>&1; then
        _txinbox_rabbitmq_tls_ctl stop >/dev/null 2>&1 || true
        for ((i = 0; i < 30; i++)); do
            _txinbox_port_open 5671 || break
            sleep 1
        done
        did+=("restarted (configuration or certificates changed)")
    fi
    if ! _txinbox_port_open 5671; then
        _txinbox_rabbitmq_tls_start "$dir"
        [[ " ${did[*]} " == *restarted* ]] || did+=(started)
        for ((i = 0; i < 90; i++)); do
            _txinbox_port_open 5671 && break
            sleep 1
        done
        if ! _txinbox_port_open 5671; then
            echo "error: the TLS RabbitMQ node is not listening on 127.0.0.1:5671 after 90s; see $dir/log/" >&2
            return 1
        fi
        _txinbox_rabbitmq_tls_ctl -t 30 await_startup >/dev/null
        echo "$stamp" | _txinbox_as_root tee "$dir/started" >/dev/null
    fi

    # The client certificate's CN logs in with EXTERNAL: a user without a password.
    if ! _txinbox_rabbitmq_tls_ctl list_users --no-table-headers 2>/dev/null | grep -q '^txinbox-client[[:space:]]'; then
        _txinbox_rabbitmq_tls_ctl add_user txinbox-client "$(head -c 24 /dev/urandom | base64)" >/dev/null
        _txinbox_rabbitmq_tls_ctl clear_password txinbox-client >/dev/null
        _txinbox_rabbitmq_tls_ctl set_permissions -p / txinbox-client '.*' '.*' '.*' >/dev/null
        did+=("added user txinbox-client")
    fi

    export AMQPS_URL="${AMQPS_URL:-amqps://guest:guest@127.0.0.1:5671/%2f}"
    if [ ${#did[@]} -eq 0 ]; then
        echo "rabbitmq-tls: already running ($_TXINBOX_RABBITMQ_TLS_NODE, TLS only on 127.0.0.1:5671)"
    else
        echo "rabbitmq-tls: $(_txinbox_join "${did[@]}") ($_TXINBOX_RABBITMQ_TLS_NODE, TLS only on 127.0.0.1:5671)"
    fi
}
