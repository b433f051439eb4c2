# Sourced by make-certs.sh and make-webhook-certs.sh (not run by itself): the keys and the
# CA both make the same way, with openssl.

# A key: ECDSA P-256 (accepted by Go's crypto/tls in kube-scheduler and the API server, and by
# rustls in vcuda-scheduler and vcuda-webhook), PKCS#8 PEM, mode 0600.
newkey() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
    chmod 600 "$1"
}

# A random 128-bit serial number.
serial() { echo "0x$(openssl rand -hex 16)"; }

# make_ca DIR CN DAYS: DIR/ca.key and DIR/ca.crt, a self-signed CA that signs leaf
# certificates only (pathlen 0), named O=vcuda/CN=CN, valid DAYS days.
make_ca() {
    local dir=$1 cn=$2 days=$3
    newkey "$dir/ca.key"
    cat > "$dir/ca.ext" <<EXT
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
EXT
    openssl req -new -key "$dir/ca.key" -subj "/O=vcuda/CN=$cn" -out "$dir/ca.csr"
    openssl x509 -req -in "$dir/ca.csr" -signkey "$dir/ca.key" -days "$days" \
        -set_serial "$(serial)" -extfile "$dir/ca.ext" -out "$dir/ca.crt" 2>/dev/null
}
