//! Command-line values that need more than clap (pure): durations such as `30s` / `10m`
//! and the quota ConfigMap's `NAMESPACE/NAME`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

/// A value given on the command line that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SettingError {
    #[error("duration {0:?} is not understood; use a whole number with a unit, e.g. 90s, 10m, 1h (a bare number is seconds)")]
    Duration(String),
    #[error("ConfigMap {0:?} is not NAMESPACE/NAME; e.g. vcuda-system/vcuda-quotas")]
    ConfigMap(String),
}

/// A duration: a whole number with `ms`, `s`, `m`, `h` or `d` (several may be chained:
/// `1h30m`); a bare number is seconds. Zero is allowed (every reservation is stale at once).
pub fn parse_duration(text: &str) -> Result<Duration, SettingError> {
    let bad = || SettingError::Duration(text.to_string());
    let t = text.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let ms_per = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        let ms = n.checked_mul(ms_per).ok_or_else(bad)?;
        total = total
            .checked_add(Duration::from_millis(ms))
            .ok_or_else(bad)?;
    }
    Ok(total)
}

/// `NAMESPACE/NAME` of a ConfigMap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigMapRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl FromStr for ConfigMapRef {
    type Err = SettingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || SettingError::ConfigMap(s.to_string());
        let (ns, name) = s.split_once('/').ok_or_else(bad)?;
        let ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 253
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        if !ok(ns) || !ok(name) {
            return Err(bad());
        }
        Ok(ConfigMapRef {
            namespace: ns.to_string(),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for ConfigMapRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_kubectl_ones() {
        let d = |s| parse_duration(s).unwrap();
        assert_eq!(d("30s"), Duration::from_secs(30));
        assert_eq!(d("10m"), Duration::from_secs(600));
        assert_eq!(d("1h30m"), Duration::from_secs(5400));
        assert_eq!(d("250ms"), Duration::from_millis(250));
        assert_eq!(d("45"), Duration::from_secs(45), "bare seconds");
        assert_eq!(d("0s"), Duration::ZERO);
        for bad in ["", "m", "10x", "1.5m", "-1s", "10 m", "s10"] {
            let e = parse_duration(bad).unwrap_err().to_string();
            assert!(e.contains("e.g. 90s, 10m"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_config_map_is_namespace_slash_name() {
        let r: ConfigMapRef = "kube-system/vcuda-quotas".parse().unwrap();
        assert_eq!(
            (r.namespace.as_str(), r.name.as_str()),
            ("kube-system", "vcuda-quotas")
        );
        assert_eq!(r.to_string(), "kube-system/vcuda-quotas");
        for bad in ["vcuda-quotas", "/x", "x/", "a/b/c", "A/b"] {
            let e = bad.parse::<ConfigMapRef>().unwrap_err().to_string();
            assert!(e.contains("NAMESPACE/NAME"), "{bad}: {e}");
        }
    }
}
