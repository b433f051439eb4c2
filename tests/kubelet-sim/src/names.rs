//! What the kubelet accepts in a `RegisterRequest` (kubelet.md §1.3).
//!
//! Mirrors `v1helper.IsExtendedResourceName`: the name must contain a `/` (else it is a native
//! resource), must not contain `kubernetes.io/` (native prefixed), must not start with
//! `requests.`, and `requests.<name>` must be a Kubernetes qualified name (DNS-1123 subdomain
//! prefix, `/`, a name segment of at most 63 characters).

/// The API versions the kubelet supports (`SupportedVersions` in constants.go).
pub const SUPPORTED_VERSIONS: [&str; 1] = ["v1beta1"];

/// `errUnsupportedVersion` of the kubelet's plugin server.
pub fn check_version(version: &str) -> Result<(), String> {
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(format!(
            "requested API version {version:?} is not supported by kubelet. Supported versions are {SUPPORTED_VERSIONS:?}"
        ))
    }
}

/// `errInvalidResourceName` unless `name` is a valid extended resource name.
pub fn check_resource_name(name: &str) -> Result<(), String> {
    if is_extended_resource_name(name) {
        Ok(())
    } else {
        Err(format!("the ResourceName {name:?} is invalid"))
    }
}

/// `v1helper.IsExtendedResourceName`.
pub fn is_extended_resource_name(name: &str) -> bool {
    let native = !name.contains('/') || name.contains("kubernetes.io/");
    if native || name.starts_with("requests.") {
        return false;
    }
    is_qualified_name(&format!("requests.{name}"))
}

fn is_qualified_name(value: &str) -> bool {
    let parts: Vec<&str> = value.split('/').collect();
    let (prefix, name) = match parts.as_slice() {
        [name] => (None, *name),
        [prefix, name] => (Some(*prefix), *name),
        _ => return false,
    };
    if let Some(prefix) = prefix {
        if !is_dns1123_subdomain(prefix) {
            return false;
        }
    }
    is_name_segment(name)
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, at most 63 characters.
fn is_name_segment(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Lower-case RFC 1123 labels joined by dots, at most 253 characters.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && is_lower_alnum(b[0])
                && is_lower_alnum(b[b.len() - 1])
                && b.iter().all(|c| is_lower_alnum(*c) || *c == b'-')
        })
}

fn is_lower_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        for ok in [
            "tencent.com/vcuda-core",
            "tencent.com/vcuda-memory",
            "nvidia.com/gpu",
            "example.com/a.b_c",
        ] {
            assert!(is_extended_resource_name(ok), "{ok}");
        }
        for bad in [
            "vcuda-core",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "requests.example.com/gpu",
            "Example.com/gpu",
            "example.com/",
            "example.com/-gpu",
            "a/b/c",
            "",
        ] {
            assert!(!is_extended_resource_name(bad), "{bad}");
        }
    }

    #[test]
    fn versions() {
        assert!(check_version("v1beta1").is_ok());
        let e = check_version("v1alpha").unwrap_err();
        assert!(e.contains("not supported"), "{e}");
    }
}
