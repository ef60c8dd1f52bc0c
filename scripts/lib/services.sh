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
#
# Variables already set by the caller (DATABASE_URL, AMQP_URL, TXINBOX_PG_BIN) are respected.
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
