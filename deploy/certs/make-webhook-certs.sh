#!/usr/bin/env bash
# Make the serving certificate of vcuda-webhook, and a kustomization that installs the
# webhook with it: the Secret vcuda-webhook-tls and the caBundle the API server checks the
# webhook's certificate against (deploy/webhook carries none).
#
# Why a CA of its own: the API server trusts a webhook's certificate only if it verifies
# against the webhook configuration's caBundle. Any CA would do; this one signs nothing but
# this serving certificate (ECDSA P-256, serverAuth only, for the Service's names), so its key
# is useless for anything else, and the cluster's own CA key is never needed.
#
# What it writes into DIR (keys 0600; certificates and the kustomization 0644):
#   ca.crt, ca.key        the CA (2 years by default). ca.key is needed only to make a new
#                         serving certificate; keep it offline, or delete it (the next run
#                         then needs --force, which makes a new CA).
#   tls.crt, tls.key      the webhook's certificate (1 year by default), for
#                         vcuda-webhook.vcuda-system.svc and
#                         vcuda-webhook.vcuda-system.svc.cluster.local, and its key.
#   kustomization.yaml    deploy/webhook (or --base) plus the Secret vcuda-system/vcuda-webhook-tls
#   + patch files         (tls.crt, tls.key: a secretGenerator), ca.crt as the caBundle of both
#                         webhook configurations (JSON 6902 patches), and the certificate's
#                         SHA-256 on the webhook's pod template, so re-applying with a new
#                         certificate restarts the webhook's pods (they read it at start).
#                         Renders with kustomize v2.0.3 (kubectl 1.14-1.20) and v5.
# Install with `kubectl apply -k DIR` (or --apply). It holds the private key: keep DIR out
# of version control, or commit only what your secret management allows.
set -euo pipefail

NAMESPACE=vcuda-system
SERVICE=vcuda-webhook
SECRET=vcuda-webhook-tls
VALIDATING=vcuda-pods
MUTATING=vcuda-vm-pods
here=$(cd "$(dirname "$0")" && pwd)
base=$here/../webhook
ca_days=730
cert_days=365
force=0
apply=0
dir=

usage() {
    cat <<USAGE
Usage: $(basename "$0") [--force] [--apply] [--base DIR] [--ca-days N] [--days N] DIR

Bootstraps the TLS of the admission webhook vcuda-webhook (deploy/webhook), with openssl.
Writes into DIR:

  ca.crt ca.key          a CA for this purpose only (ECDSA P-256, ${ca_days} days); keep ca.key
                         offline
  tls.crt tls.key        the webhook's serving certificate (${cert_days} days, serverAuth only) for
                         ${SERVICE}.${NAMESPACE}.svc and ${SERVICE}.${NAMESPACE}.svc.cluster.local
  kustomization.yaml     deploy/webhook plus the Secret ${NAMESPACE}/${SECRET} (tls.crt,
  and its patch files    tls.key) and ca.crt as the caBundle of the ValidatingWebhookConfiguration
                         ${VALIDATING} and the MutatingWebhookConfiguration ${MUTATING}

Install (after the base or an overlay, which create the namespace ${NAMESPACE}):

  kubectl apply -k DIR

Options:
  --apply      run kubectl apply -k DIR (current context) after writing it
  --base DIR   the kustomization to install with the certificate (default: deploy/webhook;
               give your own overlay of it, e.g. one that sets your image)
  --force      make a new CA even if DIR already holds one (re-apply DIR afterwards: the
               caBundle and the Secret change together, and the webhook's pods restart)
  --ca-days N  validity of the CA in days (default ${ca_days})
  --days N     validity of the serving certificate in days (default ${cert_days})
  -h, --help   this text

Without --force it refuses to overwrite an existing CA. To renew before the certificate
expires: run it again with --force and re-apply DIR.
USAGE
}

die() { echo "make-webhook-certs: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --force) force=1 ;;
        --apply) apply=1 ;;
        --base) [ $# -ge 2 ] || die "--base needs a directory"; base=$2; shift ;;
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
[ -f "$base/kustomization.yaml" ] || die "$base has no kustomization.yaml (--base)"

umask 077
mkdir -p "$dir"
if [ "$force" != 1 ] && { [ -e "$dir/ca.crt" ] || [ -e "$dir/ca.key" ]; }; then
    die "$dir already holds a CA (ca.crt/ca.key); --force replaces it (re-apply $dir afterwards)"
fi
abs=$(cd "$dir" && pwd)
base=$(cd "$base" && pwd)
# kustomize v2.0.3 wants the base relative to the kustomization
rel=$(realpath -m --relative-to="$abs" "$base" 2>/dev/null) || rel=$base
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# newkey, serial, make_ca
. "$(dirname "$0")/certs-lib.sh"

# The CA.
make_ca "$work" "vcuda-webhook CA" "$ca_days"

newkey "$work/tls.key"
cat > "$work/tls.ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
subjectAltName = DNS:$SERVICE.$NAMESPACE.svc, DNS:$SERVICE.$NAMESPACE.svc.cluster.local
EXT
openssl req -new -key "$work/tls.key" -subj "/CN=$SERVICE.$NAMESPACE.svc" -out "$work/tls.csr"
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -set_serial "$(serial)" -days "$cert_days" -extfile "$work/tls.ext" -out "$work/tls.crt" 2>/dev/null
openssl verify -CAfile "$work/ca.crt" -purpose sslserver "$work/tls.crt" >/dev/null \
    || die "the serving certificate does not verify"

bundle=$(openssl base64 -A -in "$work/ca.crt")
digest=$(openssl dgst -sha256 -r "$work/tls.crt" | cut -d' ' -f1)
for kind in validating mutating; do
    cat > "$work/ca-bundle-$kind.yaml" <<PATCH
# the caBundle of the $kind webhook (ca.crt, base64), written by make-webhook-certs.sh
- op: add
  path: /webhooks/0/clientConfig/caBundle
  value: $bundle
PATCH
done
cat > "$work/tls-rollout.yaml" <<PATCH
# the serving certificate's SHA-256 on the pod template: a new certificate restarts the pods
apiVersion: apps/v1
kind: Deployment
metadata:
  name: $SERVICE
  namespace: $NAMESPACE
spec:
  template:
    metadata:
      annotations:
        webhook.vcuda.io/tls-sha256: "$digest"
PATCH
cat > "$work/kustomization.yaml" <<KUST
# Written by deploy/certs/make-webhook-certs.sh: the admission webhook with its TLS.
#   kubectl apply -k $abs
# Holds the webhook's private key (tls.key): keep it out of version control.
bases:
  - $rel
secretGenerator:
  - name: $SECRET
    namespace: $NAMESPACE
    type: kubernetes.io/tls
    files:
      - tls.crt
      - tls.key
generatorOptions:
  # the name the Deployment mounts; tls-rollout.yaml restarts the pods on a new certificate
  disableNameSuffixHash: true
patchesJson6902:
  - target: {group: admissionregistration.k8s.io, version: v1, kind: ValidatingWebhookConfiguration, name: $VALIDATING}
    path: ca-bundle-validating.yaml
  - target: {group: admissionregistration.k8s.io, version: v1, kind: MutatingWebhookConfiguration, name: $MUTATING}
    path: ca-bundle-mutating.yaml
patchesStrategicMerge:
  - tls-rollout.yaml
KUST

for f in ca.key tls.key; do install -m 600 "$work/$f" "$dir/$f"; done
for f in ca.crt tls.crt kustomization.yaml ca-bundle-validating.yaml ca-bundle-mutating.yaml tls-rollout.yaml; do
    install -m 644 "$work/$f" "$dir/$f"
done

echo "Wrote $abs: ca.crt ca.key tls.crt tls.key kustomization.yaml (+ its patches)"
if [ "$apply" = 1 ]; then
    kubectl apply -k "$abs"
    echo "Applied. The webhook's pods: kubectl -n $NAMESPACE get pods -l app.kubernetes.io/name=$SERVICE"
else
    echo
    echo "Install the webhook with its certificate (the namespace $NAMESPACE must exist: apply the base first):"
    echo "  kubectl apply -k $abs"
fi
echo "Keep $abs/ca.key offline; it is needed only to make a new serving certificate."
