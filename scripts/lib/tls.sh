# shellcheck shell=bash
# scripts/lib/tls.sh — sourced by scripts/test (after services.sh, for _txinbox_as_root).
#
#   ensure_test_certs   a private test CA and the certificates the TLS listeners and tests use;
#                       exports TXINBOX_TLS_DIR
#
# Files in $TXINBOX_TLS_DIR (default /var/lib/txinbox/tls, readable by every user, because the
# brokers run as their own users; these are throw-away test keys, never production ones):
#
#   ca.pem                  the test CA (the one a client must trust)
#   server.pem, server.key  signed by it, for DNS:localhost and IP:127.0.0.1
#   client.pem, client.key  signed by it, CN=txinbox-client (client-certificate auth)
#   other-ca.pem            an unrelated CA: trusting it instead must be refused
#
# Keys are EC P-256 in PKCS#8 PEM (rustls, OpenSSL and Erlang all read it). Certificates are
# made once and kept for ten years; a missing or expiring file remakes the whole set.
# Idempotent, prints one line, safe under `set -euo pipefail`.

_txinbox_tls_cert() { # name subject ca-name [extfile]
    local dir=$1 name=$2 subject=$3 ca=$4 ext=$5
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/$name.key" 2>/dev/null
    openssl req -new -key "$dir/$name.key" -subj "$subject" -out "$dir/$name.csr" 2>/dev/null
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/$ca.pem" -CAkey "$dir/$ca.key" \
        -CAcreateserial -days 3650 -sha256 -extfile "$ext" -out "$dir/$name.pem" 2>/dev/null
    rm -f "$dir/$name.csr"
}

_txinbox_tls_ca() { # dir name subject
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -sha256 \
        -subj "$3" -keyout "$1/$2.key" -out "$1/$2.pem" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}

ensure_test_certs() {
    local dir=${TXINBOX_TLS_DIR:-/var/lib/txinbox/tls} f fresh=1
    export TXINBOX_TLS_DIR=$dir
    for f in ca.pem server.pem server.key client.pem client.key other-ca.pem; do
        if [ ! -s "$dir/$f" ]; then fresh=0; fi
    done
    if [ $fresh -eq 1 ] && openssl x509 -checkend $((30 * 86400)) -noout -in "$dir/server.pem" >/dev/null 2>&1; then
        echo "tls: test certificates in $dir"
        return 0
    fi
    if ! command -v openssl >/dev/null 2>&1; then
        _txinbox_apt_install openssl
    fi
    if [ ! -d "$dir" ] || [ ! -w "$dir" ]; then
        _txinbox_as_root mkdir -p "$dir"
        _txinbox_as_root chown "$(id -u):$(id -g)" "$dir"
    fi
    chmod 755 "$dir"
    rm -f "$dir"/*.pem "$dir"/*.key "$dir"/*.srl "$dir"/*.ext

    _txinbox_tls_ca "$dir" ca "/CN=txinbox test CA"
    _txinbox_tls_ca "$dir" other-ca "/CN=txinbox other test CA"
    rm -f "$dir/other-ca.key"
    printf '%s\n' 'subjectAltName=DNS:localhost,IP:127.0.0.1' 'extendedKeyUsage=serverAuth' \
        'basicConstraints=critical,CA:FALSE' >"$dir/server.ext"
    printf '%s\n' 'extendedKeyUsage=clientAuth' 'basicConstraints=critical,CA:FALSE' >"$dir/client.ext"
    _txinbox_tls_cert "$dir" server "/CN=localhost" ca "$dir/server.ext"
    _txinbox_tls_cert "$dir" client "/CN=txinbox-client" ca "$dir/client.ext"
    rm -f "$dir"/*.ext "$dir"/*.srl
    chmod 644 "$dir"/*.pem "$dir"/*.key
    echo "tls: made test certificates in $dir (CA, localhost server, client, other CA)"
}
