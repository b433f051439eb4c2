//! Resource and environment variable names, exactly as the components on the other side
//! compute them, and the `pci.ids` lookup the passthrough names come from.
//!
//! **Passthrough GPUs** are advertised by model, under the name NVIDIA's
//! kubevirt-gpu-device-plugin gives them (`getDeviceName` in
//! `NVIDIA/kubevirt-gpu-device-plugin`, `pkg/device_plugin/device_plugin.go`): the device's
//! line in the NVIDIA (`10de`) block of `pci.ids`, trimmed, upper-cased, `/` and `.` replaced
//! by `_`, every run of white space (Go's `\s+`) replaced by one `_`, and then every character
//! outside `[a-zA-Z0-9_.]` deleted. Seed 004's `TU106 [GeForce RTX 2060 Rev. A]` becomes
//! `TU106_GEFORCE_RTX_2060_REV__A` (the `.` and the space after it make the double `_`).
//! When `pci.ids` does not know the device, or the name leaves nothing, the plugin uses the
//! device id as sysfs shows it (`1f08`): [`passthrough_resource`] does the same. Existing
//! pod and VM specs written against NVIDIA's plugin therefore run unchanged.
//!
//! **The environment** KubeVirt's virt-launcher reads is named by `ResourceNameToEnvVar`
//! (`kubevirt/kubevirt`, `pkg/util/util.go`): the resource name upper-cased, `/` and `.`
//! replaced by `_`, after a prefix and `_`. The prefixes are `PCI_RESOURCE` for PCI devices
//! and `MDEV_PCI_RESOURCE` for mediated devices
//! (`pkg/virt-launcher/virtwrap/device/hostdevice/generic/addresspool.go`); the value is the
//! comma-separated list of PCI addresses or mdev UUIDs, which virt-launcher's `AddressPool`
//! (`pkg/virt-launcher/virtwrap/device/hostdevice/addresspool.go`) splits on `,` and hands
//! out in order. `-` is *not* replaced: KubeVirt's own documentation shows
//! `MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q`, and a name that differs from virt-launcher's by
//! one character is a variable it never reads.
//!
//! **mdev types** are named per [`MdevNaming`]: seed 000's `tencent.com/vgpu-<n>` for type
//! `nvidia-<n>` (`nvidia-492` → `tencent.com/vgpu-492`), or KubeVirt's
//! `nvidia.com/<type name, white space runs to _>` (`GRID T4-1Q` → `nvidia.com/GRID_T4-1Q`),
//! as NVIDIA's plugin names vGPU resources (`readVgpuIDFromFileFunc`) and KubeVirt's
//! `permittedHostDevices.mediatedDevices` example spells them.

use std::collections::BTreeMap;

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;
/// The domain of passthrough resources and of KubeVirt-style vGPU resources.
pub const NVIDIA_DOMAIN: &str = "nvidia.com";
/// virt-launcher's prefix for PCI host devices.
pub const PCI_RESOURCE_PREFIX: &str = "PCI_RESOURCE";
/// virt-launcher's prefix for mediated devices.
pub const MDEV_RESOURCE_PREFIX: &str = "MDEV_PCI_RESOURCE";

/// Go's `unicode.ToUpper` on one character: the *simple* case mapping. Rust's
/// `char::to_uppercase` is the full mapping (`ß` → `SS`); where it yields more than one
/// character the simple mapping has none, so the character stays (and, not being ASCII,
/// is later deleted, as in Go).
fn go_upper(c: char) -> char {
    let mut up = c.to_uppercase();
    match (up.next(), up.next()) {
        (Some(u), None) => u,
        _ => c,
    }
}

/// Go's `\s` in RE2: `[\t\n\f\r ]`, the same set as [`char::is_ascii_whitespace`].
fn go_space(c: char) -> bool {
    c.is_ascii_whitespace()
}

/// The model part of a passthrough resource name, from a `pci.ids` device name, as
/// `getDeviceName` computes it (see the module documentation). The result holds only
/// `[A-Z0-9_]`; it may be empty (a name of punctuation only), which callers replace by the
/// device id as the plugin does.
pub fn model_name(pci_name: &str) -> String {
    let upper: String = pci_name.trim().chars().map(go_upper).collect();
    let mut out = String::with_capacity(upper.len());
    let mut in_space = false;
    for c in upper.chars() {
        let c = match c {
            '/' | '.' => '_',
            c => c,
        };
        if go_space(c) {
            if !in_space {
                out.push('_');
            }
            in_space = true;
            continue;
        }
        in_space = false;
        // `[^a-zA-Z0-9_.]+` deleted; after the replacements above no `.` is left and
        // lower-case ASCII only survives upper-casing if it was not a letter.
        if c.is_ascii_alphanumeric() || c == '_' {
            out.push(c.to_ascii_uppercase());
        }
    }
    out
}

/// The fallback model name: the device id as sysfs shows it (`device` without `0x`,
/// lower-case hex), which the plugin uses when `pci.ids` has no name.
pub fn device_id_name(device: u16) -> String {
    format!("{device:04x}")
}

/// The resource a passthrough GPU is advertised as: `nvidia.com/<model>`, the model from
/// `pci.ids` or, failing that, the device id.
pub fn passthrough_resource(ids: Option<&PciIds>, device: u16) -> String {
    let model = ids
        .and_then(|ids| ids.device_name(NVIDIA_VENDOR, device))
        .map(model_name)
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| device_id_name(device));
    format!("{NVIDIA_DOMAIN}/{model}")
}

/// The environment variable virt-launcher reads for `resource` (`ResourceNameToEnvVar`).
pub fn env_var_name(prefix: &str, resource: &str) -> String {
    let name: String = resource
        .chars()
        .map(go_upper)
        .map(|c| if c == '/' || c == '.' { '_' } else { c })
        .collect();
    format!("{prefix}_{name}")
}

/// How mdev types are named as resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MdevNaming {
    /// Seed 000: `<domain>/vgpu-<n>` for type id `nvidia-<n>` (`tencent.com/vgpu-492`); a
    /// type id of another driver keeps its whole id (`<domain>/vgpu-i915-GVTg_V5_4`).
    Vgpu { domain: String },
    /// KubeVirt / NVIDIA's plugin: `nvidia.com/<type name>` with white space runs as `_`
    /// (`nvidia.com/GRID_T4-1Q`); the type id when the driver gives no name (`name` is an
    /// optional attribute).
    KubeVirt,
}

impl MdevNaming {
    /// The resource of mdev type `type_id` (the `mdev_supported_types` directory name) with
    /// human-readable `name`.
    pub fn resource(&self, type_id: &str, name: Option<&str>) -> String {
        match self {
            MdevNaming::Vgpu { domain } => {
                let n = type_id.strip_prefix("nvidia-").unwrap_or(type_id);
                format!("{domain}/vgpu-{n}")
            }
            MdevNaming::KubeVirt => {
                let model = name
                    .map(vgpu_type_name)
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| type_id.to_string());
                format!("{NVIDIA_DOMAIN}/{model}")
            }
        }
    }
}

/// A vGPU type name as NVIDIA's plugin turns it into a resource (`readVgpuIDFromFileFunc`):
/// new lines trimmed from both ends, then every run of white space replaced by one `_`.
pub fn vgpu_type_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_space = false;
    for c in name.trim_matches('\n').chars() {
        if go_space(c) {
            if !in_space {
                out.push('_');
            }
            in_space = true;
        } else {
            in_space = false;
            out.push(c);
        }
    }
    out
}

/// Whether `name` can be an extended resource name: `domain/name`, the name a Kubernetes
/// qualified name (`[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters).
pub fn is_resource_name(name: &str) -> bool {
    let Some((domain, n)) = name.split_once('/') else {
        return false;
    };
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    !domain.is_empty()
        && !domain.contains('/')
        && n.len() <= 63
        && edge(n.chars().next())
        && edge(n.chars().last())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The vendor and device names of a `pci.ids` database (Debian's `pci.ids` / hwdata).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PciIds {
    vendors: BTreeMap<u16, String>,
    devices: BTreeMap<(u16, u16), String>,
}

/// A line of `pci.ids` that is not in its documented format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pci.ids line {line}: {reason} (found {text:?}); use an unmodified pci.ids (Debian's pci.ids or hwdata package), or none: names then fall back to device ids")]
pub struct PciIdsError {
    pub line: usize,
    pub reason: &'static str,
    pub text: String,
}

impl PciIds {
    /// Parse the documented format (the header of `pci.ids`):
    ///
    /// ```text
    /// # comment
    /// vendor  vendor_name
    /// <TAB>device  device_name
    /// <TAB><TAB>subvendor subdevice  subsystem_name
    /// C class  class_name           (the class lists, at the end)
    /// ```
    ///
    /// ids are four lower-case hex digits followed by two spaces. Subsystem lines and the
    /// class lists are skipped; a device line outside a vendor, or a vendor or device line
    /// not in the format, is an error naming the line. A device listed twice keeps its
    /// first name, as NVIDIA's plugin (which stops at the first match) does.
    pub fn parse(text: &str) -> Result<PciIds, PciIdsError> {
        #[derive(Clone, Copy)]
        enum In {
            Nothing,
            Vendor(u16),
            Class,
        }
        let mut ids = PciIds::default();
        let mut state = In::Nothing;
        for (i, line) in text.lines().enumerate() {
            let err = |reason| PciIdsError {
                line: i + 1,
                reason,
                text: line.chars().take(80).collect(),
            };
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            if line.starts_with("\t\t") {
                // a subsystem (or a class's prog-if): skipped, but only where one can be
                if matches!(state, In::Nothing) {
                    return Err(err("a subsystem line outside a vendor"));
                }
                continue;
            }
            if let Some(rest) = line.strip_prefix('\t') {
                match state {
                    In::Nothing => return Err(err("a device line outside a vendor")),
                    In::Class => {}
                    In::Vendor(v) => {
                        let (id, name) =
                            split_entry(rest).ok_or_else(|| err("not `<TAB>xxxx  name`"))?;
                        ids.devices.entry((v, id)).or_insert(name);
                    }
                }
                continue;
            }
            if line.starts_with("C ") {
                state = In::Class;
                continue;
            }
            let (id, name) = split_entry(line).ok_or_else(|| err("not `xxxx  name`"))?;
            ids.vendors.entry(id).or_insert(name);
            state = In::Vendor(id);
        }
        Ok(ids)
    }

    /// The name of device `device` of vendor `vendor`, as written in `pci.ids`.
    pub fn device_name(&self, vendor: u16, device: u16) -> Option<&str> {
        self.devices.get(&(vendor, device)).map(String::as_str)
    }

    pub fn vendor_name(&self, vendor: u16) -> Option<&str> {
        self.vendors.get(&vendor).map(String::as_str)
    }

    /// How many devices it names.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// `xxxx  name`: four lower-case hex digits, two spaces, a non-empty name.
fn split_entry(s: &str) -> Option<(u16, String)> {
    let id = s.get(..4)?;
    let name = s.get(4..)?.strip_prefix("  ")?.trim();
    if !id
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        || name.is_empty()
    {
        return None;
    }
    Some((u16::from_str_radix(id, 16).ok()?, name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An excerpt in the real file's shape (comments, vendors, devices, subsystems, classes).
    const PCI_IDS: &str = "\
#
#\tList of PCI ID's
#
# Syntax:
# vendor  vendor_name
#\tdevice  device_name\t\t\t\t<-- single tab
#\t\tsubvendor subdevice  subsystem_name\t<-- two tabs

0001  SafeNet (wrong ID)
10de  NVIDIA Corporation
\t1db4  GV100GL [Tesla V100 PCIe 16GB]
\t\t10de 1214  Tesla V100 PCIe 16GB
\t1eb8  TU104GL [Tesla T4]
# a comment inside the block
\t1f08  TU106 [GeForce RTX 2060 Rev. A]
\t\t1043 86f0  TUF Gaming GeForce RTX 2060
\t10f9  TU106 High Definition Audio Controller
\t20b5  GA100 [A100 PCIe 80GB]
\t2204  GA102 [GeForce RTX 3090]
\t1f08  a duplicate that must not win
10df  Emulex Corporation
\t1ae5  LP6000 Fibre Channel Host Adapter

C 03  Display controller
\t00  VGA compatible controller
\t\t00  VGA controller
\t02  3D controller
";

    #[test]
    fn the_seeds_example_name() {
        assert_eq!(
            model_name("TU106 [GeForce RTX 2060 Rev. A]"),
            "TU106_GEFORCE_RTX_2060_REV__A"
        );
        let ids = PciIds::parse(PCI_IDS).unwrap();
        assert_eq!(
            passthrough_resource(Some(&ids), 0x1f08),
            "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
        );
        assert_eq!(
            env_var_name(
                PCI_RESOURCE_PREFIX,
                &passthrough_resource(Some(&ids), 0x1f08)
            ),
            "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
        );
    }

    #[test]
    fn names_of_other_models() {
        assert_eq!(model_name("TU104GL [Tesla T4]"), "TU104GL_TESLA_T4");
        assert_eq!(model_name("GA100 [A100 PCIe 80GB]"), "GA100_A100_PCIE_80GB");
        assert_eq!(
            model_name("GV100GL [Tesla V100 PCIe 16GB]"),
            "GV100GL_TESLA_V100_PCIE_16GB"
        );
        // `/` to `_`, white space runs to one `_`, the rest of the punctuation deleted
        assert_eq!(
            model_name("  GK110GL [Tesla K20c/K20X]\t\t(rev a1)+ "),
            "GK110GL_TESLA_K20C_K20X_REV_A1"
        );
        // `-` is deleted, not replaced
        assert_eq!(model_name("AD102GL [L40S-48]"), "AD102GL_L40S48");
    }

    #[test]
    fn upper_casing_is_gos_simple_mapping() {
        // `ß` has no simple upper case: kept, then deleted (Rust's full mapping says SS)
        assert_eq!(model_name("Straße 1"), "STRAE_1");
        // dotless i upper-cases to ASCII I in Go's simple mapping too
        assert_eq!(model_name("ı"), "I");
        assert_eq!(model_name("é"), "");
    }

    #[test]
    fn unknown_devices_fall_back_to_the_device_id() {
        let ids = PciIds::parse(PCI_IDS).unwrap();
        assert_eq!(passthrough_resource(Some(&ids), 0x2331), "nvidia.com/2331");
        assert_eq!(passthrough_resource(None, 0x1f08), "nvidia.com/1f08");
        // a device of another vendor with the same id does not count
        assert_eq!(passthrough_resource(Some(&ids), 0x1ae5), "nvidia.com/1ae5");
        // a name with nothing left falls back too
        let odd = PciIds::parse("10de  NVIDIA Corporation\n\t2999  []()+\n").unwrap();
        assert_eq!(passthrough_resource(Some(&odd), 0x2999), "nvidia.com/2999");
        assert_eq!(
            env_var_name(PCI_RESOURCE_PREFIX, "nvidia.com/1f08"),
            "PCI_RESOURCE_NVIDIA_COM_1F08"
        );
    }

    #[test]
    fn pci_ids_parsing() {
        let ids = PciIds::parse(PCI_IDS).unwrap();
        assert_eq!(ids.vendor_name(0x10de), Some("NVIDIA Corporation"));
        assert_eq!(
            ids.device_name(0x10de, 0x1f08),
            Some("TU106 [GeForce RTX 2060 Rev. A]")
        );
        assert_eq!(
            ids.device_name(0x10df, 0x1ae5),
            Some("LP6000 Fibre Channel Host Adapter")
        );
        // subsystem lines are not devices; class lines are not devices of the last vendor
        assert_eq!(ids.device_name(0x10de, 0x1043), None);
        assert_eq!(ids.device_name(0x10df, 0x0002), None);
        assert_eq!(ids.device_name(0x10df, 0x0000), None);
        assert_eq!(ids.len(), 7);
        assert!(PciIds::parse("").unwrap().is_empty());
    }

    #[test]
    fn pci_ids_errors_name_the_line() {
        let e = PciIds::parse("# c\n\t1f08  orphan device\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert_eq!(e.reason, "a device line outside a vendor");
        let e = PciIds::parse("10de  NVIDIA\n\t1F08  upper-case id\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = PciIds::parse("10de NVIDIA\n").unwrap_err();
        assert_eq!(e.line, 1);
        let e = PciIds::parse("10de  \n").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        assert!(e.to_string().contains("fall back to device ids"), "{e}");
        let e = PciIds::parse("\t\t10de 1214  x\n").unwrap_err();
        assert_eq!(e.reason, "a subsystem line outside a vendor");
    }

    #[test]
    fn mdev_names() {
        let tencent = MdevNaming::Vgpu {
            domain: "tencent.com".into(),
        };
        // seed 000: the types nvidia-277 … nvidia-492 of 0000:81:00.0
        for n in ["277", "278", "279", "490", "491", "492"] {
            assert_eq!(
                tencent.resource(&format!("nvidia-{n}"), Some("GRID T4-1Q")),
                format!("tencent.com/vgpu-{n}")
            );
        }
        assert_eq!(
            tencent.resource("i915-GVTg_V5_4", None),
            "tencent.com/vgpu-i915-GVTg_V5_4"
        );
        // seed 004's permittedHostDevices: mdevNameSelector "GRID T4-1Q" → nvidia.com/GRID_T4-1Q
        let kv = MdevNaming::KubeVirt;
        assert_eq!(
            kv.resource("nvidia-222", Some("GRID T4-1Q\n")),
            "nvidia.com/GRID_T4-1Q"
        );
        assert_eq!(
            kv.resource("nvidia-222", Some("NVIDIA  A2-4Q")),
            "nvidia.com/NVIDIA_A2-4Q"
        );
        assert_eq!(kv.resource("nvidia-222", None), "nvidia.com/nvidia-222");
        assert_eq!(
            kv.resource("nvidia-222", Some("\n")),
            "nvidia.com/nvidia-222"
        );
        // KubeVirt's documentation: MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q (`-` kept);
        // its source: MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A2-4Q
        assert_eq!(
            env_var_name(MDEV_RESOURCE_PREFIX, "nvidia.com/GRID_T4-1Q"),
            "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"
        );
        assert_eq!(
            env_var_name(MDEV_RESOURCE_PREFIX, "nvidia.com/NVIDIA_A2-4Q"),
            "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A2-4Q"
        );
        assert_eq!(
            env_var_name(MDEV_RESOURCE_PREFIX, "tencent.com/vgpu-492"),
            "MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-492"
        );
        // KubeVirt's documented PCI example keeps the case it is given… upper-cased
        assert_eq!(
            env_var_name(PCI_RESOURCE_PREFIX, "nvidia.com/TU104GL_Tesla_T4"),
            "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"
        );
    }

    #[test]
    fn resource_name_shape() {
        assert!(is_resource_name("nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"));
        assert!(is_resource_name("nvidia.com/GRID_T4-1Q"));
        assert!(is_resource_name("tencent.com/vgpu-492"));
        assert!(!is_resource_name("nvidia.com/"));
        assert!(!is_resource_name("nvidia.com/GRID T4-1Q"));
        assert!(!is_resource_name("nvidia.com/_X"));
        assert!(!is_resource_name("gpu"));
        assert!(!is_resource_name(&format!("a/{}", "x".repeat(64))));
    }

    proptest::proptest! {
        #[test]
        fn model_names_are_env_safe_and_stable(name in "\\PC{0,40}") {
            let m = model_name(&name);
            proptest::prop_assert!(m.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'), "{m:?}");
            // a model name is its own name: the plugin's rule applied twice changes nothing
            proptest::prop_assert_eq!(model_name(&m), m.clone());
            if !m.is_empty() {
                let resource = format!("{NVIDIA_DOMAIN}/{m}");
                let var = env_var_name(PCI_RESOURCE_PREFIX, &resource);
                // what NVIDIA's plugin sets (gpuPrefix + "_" + upper(deviceName)) is what
                // virt-launcher reads (ResourceNameToEnvVar of the VM's deviceName)
                proptest::prop_assert_eq!(&var, &format!("PCI_RESOURCE_NVIDIA_COM_{m}"));
                proptest::prop_assert!(var.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'));
                proptest::prop_assert_eq!(env_var_name(PCI_RESOURCE_PREFIX, &resource), var);
            }
        }

        #[test]
        fn pci_ids_round_trip(names in proptest::collection::btree_map(0u16..=0xffff, "[A-Za-z0-9][A-Za-z0-9 \\[\\].,/+-]{0,30}[A-Za-z0-9\\]]", 0..20)) {
            let mut text = String::from("# generated\n10de  NVIDIA Corporation\n");
            for (id, name) in &names {
                text.push_str(&format!("\t{id:04x}  {name}\n\t\t10de 0000  a subsystem\n"));
            }
            text.push_str("C 03  Display controller\n\t02  3D controller\n");
            let ids = PciIds::parse(&text).unwrap();
            proptest::prop_assert_eq!(ids.len(), names.len());
            for (id, name) in &names {
                proptest::prop_assert_eq!(ids.device_name(NVIDIA_VENDOR, *id), Some(name.as_str()));
                let r = passthrough_resource(Some(&ids), *id);
                proptest::prop_assert!(is_resource_name(&r) || model_name(name).starts_with('_') || model_name(name).ends_with('_'), "{r}");
            }
        }

        #[test]
        fn vgpu_env_names_follow_kubevirt(name in "[A-Za-z0-9][A-Za-z0-9 -]{0,20}[A-Za-z0-9]") {
            let r = MdevNaming::KubeVirt.resource("nvidia-1", Some(&name));
            proptest::prop_assert!(is_resource_name(&r), "{r}");
            let var = env_var_name(MDEV_RESOURCE_PREFIX, &r);
            proptest::prop_assert!(var.starts_with("MDEV_PCI_RESOURCE_NVIDIA_COM_"));
            proptest::prop_assert!(var.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-'), "{var}");
        }
    }
}
