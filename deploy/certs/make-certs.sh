#!/usr/bin/env bash
# Make the certificates that secure kube-scheduler -> vcuda-scheduler (mutual TLS).
#
# Why: the extender's bind writes reservations on Nodes and creates Bindings with the
# scheduler's service account. Over plain HTTP anyone who can reach the Service (every pod
# in the cluster, tenants included) could ask it to bind any pod to any node. With these
# certificates the extender answers only a client that presents a certificate signed by
# this CA, with the clientAuth purpose: kube-scheduler, whose key stays on the control plane.
#
# What it writes into DIR (keys 0600, never group- or world-readable; certificates 0644):
#   ca.crt, ca.key        a CA of its own, for this one purpose (ECDSA P-256, 2 years by
#                         default). Keep ca.key offline: it is needed only to issue new
#                         certificates (re-run with --force), never by the cluster.
#                         Not the cluster's CA: the extender must accept kube-scheduler
#                         only, not every client the cluster CA has signed (kubelets, users).
#   tls.crt, tls.key      the extender's server certificate (serverAuth only), for the
#                         Service's names vcuda-scheduler.vcuda-system.svc,
#                         vcuda-scheduler.vcuda-system.svc.cluster.local and vcuda-scheduler.
#                         These two and ca.crt go into the Secret vcuda-scheduler-tls that
#                         deploy/base/scheduler/vcuda-scheduler.yaml mounts (--tls-cert, --tls-key,
#                         --client-ca).
#   client.crt, client.key
#                         kube-scheduler's client certificate (CN system:kube-scheduler,
#                         clientAuth only). Copy these two and ca.crt to every control-plane
#                         node, to /etc/kubernetes/vcuda-scheduler/ (root-owned, key 0600),
#                         where the extender entry of kube-scheduler's configuration reads
#                         them (tlsConfig certFile, keyFile, caFile).
#
# Each certificate carries one purpose (extended key usage), so the server's certificate
# cannot be used as a client's and the reverse.
set -euo pipefail

NAMESPACE=vcuda-system
SERVICE=vcuda-scheduler
SECRET=vcuda-scheduler-tls
CLIENT_CN=system:kube-scheduler
KUBE_SCHEDULER_DIR=/etc/kubernetes/vcuda-scheduler
ca_days=730
cert_days=365
force=0
apply=0
dir=

usage() {
    cat <<USAGE
Usage: $(basename "$0") [--force] [--apply] [--ca-days N] [--days N] DIR

Makes a CA, the server certificate of the vcuda-scheduler extender and the client
certificate of kube-scheduler (mutual TLS between them), with openssl, into DIR:

  ca.crt ca.key          the CA (${ca_days} days); keep ca.key offline
  tls.crt tls.key        the extender's server certificate (${cert_days} days), for
                         ${SERVICE}.${NAMESPACE}.svc, ${SERVICE}.${NAMESPACE}.svc.cluster.local
                         and ${SERVICE}
  client.crt client.key  kube-scheduler's client certificate (CN ${CLIENT_CN})

Then prints the kubectl command that creates the Secret ${NAMESPACE}/${SECRET}
(tls.crt, tls.key, ca.crt) that deploy/base/scheduler/vcuda-scheduler.yaml mounts, and where
kube-scheduler's files go (${KUBE_SCHEDULER_DIR}/ on every control-plane node).

Options:
  --apply      create or replace the Secret with kubectl (current context) instead of
               printing the command
  --force      make a new CA even if DIR already holds one (every certificate it signed
               is then replaced too: update the Secret and kube-scheduler's files together)
  --ca-days N  validity of the CA in days (default ${ca_days})
  --days N     validity of the server and client certificates in days (default ${cert_days})
  -h, --help   this text

Keys are written mode 0600. Without --force it refuses to overwrite an existing CA, so a
second run cannot silently invalidate the certificates kube-scheduler holds.
USAGE
}

die() { echo "make-certs: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --force) force=1 ;;
        --apply) apply=1 ;;
        --ca-days) [ $# -ge 2 ] || die "--ca-days needs a number"; ca_days=$2; shift ;;
        --days) [ $# -ge 2 ] || die "--days needs a number"; cert_days=$2; shift ;;
        --) shift; [ $# -eq 1 ] || die "one DIR expected"; dir=$1 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$dir" ] || die "one DIR expected, got '$dir' and '$1'"; dir=$1 ;;
    esac
    shift
done
[ -n "$dir" ] || { usage >&2; exit 2; }
case "$ca_days$cert_days" in *[!0-9]*) die "--ca-days and --days take a number of days" ;; esac
command -v openssl >/dev/null || die "openssl is required"
if [ "$apply" = 1 ]; then command -v kubectl >/dev/null || die "--apply needs kubectl"; fi

umask 077
mkdir -p "$dir"
if [ "$force" != 1 ] && { [ -e "$dir/ca.crt" ] || [ -e "$dir/ca.key" ]; }; then
    die "$dir already holds a CA (ca.crt/ca.key); --force replaces it and every certificate it signed"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# newkey, serial, make_ca
. "$(dirname "$0")/certs-lib.sh"

# The CA.
make_ca "$work" "vcuda-scheduler CA" "$ca_days"

# A leaf certificate signed by the CA: name, CN, extended key usage, extra extensions.
leaf() {
    local name=$1 cn=$2 eku=$3 extra=$4
    newkey "$work/$name.key"
    cat > "$work/$name.ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = $eku
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
$extra
EXT
    openssl req -new -key "$work/$name.key" -subj "/CN=$cn" -out "$work/$name.csr"
    openssl x509 -req -in "$work/$name.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
        -set_serial "$(serial)" -days "$cert_days" -extfile "$work/$name.ext" \
        -out "$work/$name.crt" 2>/dev/null
}
leaf tls "$SERVICE.$NAMESPACE.svc" serverAuth \
    "subjectAltName = DNS:$SERVICE.$NAMESPACE.svc, DNS:$SERVICE.$NAMESPACE.svc.cluster.local, DNS:$SERVICE"
leaf client "$CLIENT_CN" clientAuth ""

openssl verify -CAfile "$work/ca.crt" -purpose sslserver "$work/tls.crt" >/dev/null \
    || die "the server certificate does not verify"
openssl verify -CAfile "$work/ca.crt" -purpose sslclient "$work/client.crt" >/dev/null \
    || die "the client certificate does not verify"

for f in ca.key tls.key client.key; do install -m 600 "$work/$f" "$dir/$f"; done
for f in ca.crt tls.crt client.crt; do install -m 644 "$work/$f" "$dir/$f"; done

abs=$(cd "$dir" && pwd)
secret=(kubectl -n "$NAMESPACE" create secret generic "$SECRET" --type=kubernetes.io/tls
        "--from-file=tls.crt=$abs/tls.crt" "--from-file=tls.key=$abs/tls.key"
        "--from-file=ca.crt=$abs/ca.crt")
echo "Wrote $abs: ca.crt ca.key tls.crt tls.key client.crt client.key"
if [ "$apply" = 1 ]; then
    # create or replace: render the Secret, then apply it
    "${secret[@]}" --dry-run=client -o yaml | kubectl apply -f -
    echo "Secret $NAMESPACE/$SECRET applied; restart the extender to load it:"
    echo "  kubectl -n $NAMESPACE rollout restart deployment/$SERVICE"
else
    echo
    echo "The extender's Secret (the namespace must exist first: kubectl create namespace $NAMESPACE):"
    printf ' %q' "${secret[@]}"
    echo
fi
echo
echo "kube-scheduler's files, on every control-plane node (root-owned, the key 0600):"
echo "  $KUBE_SCHEDULER_DIR/client.crt  <- $abs/client.crt"
echo "  $KUBE_SCHEDULER_DIR/client.key  <- $abs/client.key"
echo "  $KUBE_SCHEDULER_DIR/ca.crt      <- $abs/ca.crt"
echo "Keep $abs/ca.key offline; it is needed only to make new certificates."
