//! Our protos and constants against the upstream reference copies in `../shared/upstream/`
//! (kubelet `v0.36.3`). The protos are compared as compiled descriptors, not as text, so what is
//! checked is what reaches the wire and the generated code: every message, field (name, number,
//! type, label, proto3 `optional`, oneof), nested type, enum value and service method. The
//! comparator is itself tested against mutated descriptors: a checker that cannot fail proves
//! nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, EnumValueDescriptorProto, FileDescriptorSet,
};

/// Our protos, relative to this crate (the include root `build.rs` uses too).
const OUR_PROTOS: [&str; 2] = [
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
];

/// The reference directory. The repository does not carry it: CI clones `shared` beside it.
fn upstream_dir() -> PathBuf {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/upstream"
    ));
    assert!(
        dir.is_dir(),
        "upstream reference directory not found: looked in {} (CI clones the `shared` \
         repository to ../shared beside this repository; clone it there to run the \
         conformance tests)",
        dir.display()
    );
    dir.to_owned()
}

fn our_descriptors() -> FileDescriptorSet {
    protox::compile(OUR_PROTOS, [env!("CARGO_MANIFEST_DIR")]).expect("compile our protos")
}

/// Every `*.proto` in the reference directory, so a proto added upstream shows up as missing.
fn upstream_descriptors() -> FileDescriptorSet {
    let dir = upstream_dir();
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("read_dir entry").file_name())
        .filter_map(|name| name.into_string().ok())
        .filter(|name| name.ends_with(".proto"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .proto files in {}", dir.display());
    protox::compile(&files, [&dir]).expect("compile upstream protos")
}

// ---- the comparator ----

/// A descriptor set flattened to facts: a key naming one element (`message .v1beta1.Device
/// field ID`) and the wire-relevant description of it. Two sets conform when their facts are
/// equal; a flat map makes every difference one readable line.
type Facts = BTreeMap<String, String>;

fn facts(fds: &FileDescriptorSet) -> Facts {
    let mut facts = Facts::new();
    for file in &fds.file {
        let package = file.package();
        facts.insert(
            format!("package {package}"),
            format!("syntax={}", file.syntax()),
        );
        let prefix = format!(".{package}");
        for message in &file.message_type {
            message_facts(&mut facts, &prefix, message);
        }
        for e in &file.enum_type {
            enum_facts(&mut facts, &prefix, e);
        }
        for service in &file.service {
            let name = format!("{prefix}.{}", service.name());
            facts.insert(format!("service {name}"), String::new());
            for method in &service.method {
                facts.insert(
                    format!("service {name} method {}", method.name()),
                    format!(
                        "input={} output={} client_streaming={} server_streaming={}",
                        method.input_type(),
                        method.output_type(),
                        method.client_streaming(),
                        method.server_streaming()
                    ),
                );
            }
        }
    }
    facts
}

fn message_facts(facts: &mut Facts, prefix: &str, message: &DescriptorProto) {
    let name = format!("{prefix}.{}", message.name());
    // map<K, V> fields are nested `…Entry` messages marked map_entry.
    let map_entry = message.options.as_ref().is_some_and(|o| o.map_entry());
    facts.insert(format!("message {name}"), format!("map_entry={map_entry}"));
    for oneof in &message.oneof_decl {
        facts.insert(
            format!("message {name} oneof {}", oneof.name()),
            String::new(),
        );
    }
    for field in &message.field {
        let oneof = field
            .oneof_index
            .and_then(|i| message.oneof_decl.get(usize::try_from(i).ok()?))
            .map_or("-", |o| o.name());
        let r#type = Type::try_from(field.r#type.unwrap_or_default()).map_or_else(
            |_| format!("{:?}", field.r#type),
            |t| t.as_str_name().to_owned(),
        );
        let label = Label::try_from(field.label.unwrap_or_default()).map_or_else(
            |_| format!("{:?}", field.label),
            |l| l.as_str_name().to_owned(),
        );
        facts.insert(
            format!("message {name} field {}", field.name()),
            format!(
                "number={} type={type} type_name={} label={label} proto3_optional={} oneof={oneof}",
                field.number(),
                field.type_name(),
                field.proto3_optional(),
            ),
        );
    }
    for nested in &message.nested_type {
        message_facts(facts, &name, nested);
    }
    for e in &message.enum_type {
        enum_facts(facts, &name, e);
    }
}

fn enum_facts(facts: &mut Facts, prefix: &str, e: &EnumDescriptorProto) {
    let name = format!("{prefix}.{}", e.name());
    facts.insert(format!("enum {name}"), String::new());
    for value in &e.value {
        facts.insert(
            format!("enum {name} value {}", value.name()),
            format!("number={}", value.number()),
        );
    }
}

/// Every difference between the two sets, one line each; empty when they conform.
fn differences(upstream: &FileDescriptorSet, ours: &FileDescriptorSet) -> Vec<String> {
    let (upstream, ours) = (facts(upstream), facts(ours));
    let mut out = Vec::new();
    for (key, theirs) in &upstream {
        match ours.get(key) {
            None => out.push(format!("missing in ours:    {key}  [{theirs}]")),
            Some(mine) if mine != theirs => out.push(format!(
                "differs:            {key}\n    upstream: {theirs}\n    ours:     {mine}"
            )),
            Some(_) => {}
        }
    }
    for (key, mine) in &ours {
        if !upstream.contains_key(key) {
            out.push(format!("not in upstream:    {key}  [{mine}]"));
        }
    }
    out
}

// ---- the tests ----

#[test]
fn protos_conform_to_upstream() {
    let upstream = upstream_descriptors();
    // Guard against a vacuous pass (two empty sets are equal).
    let upstream_facts = facts(&upstream);
    for service in [
        "service .v1beta1.Registration",
        "service .v1beta1.DevicePlugin",
        "service .v1.PodResourcesLister",
    ] {
        assert!(
            upstream_facts.contains_key(service),
            "upstream lacks {service}"
        );
    }

    let diffs = differences(&upstream, &our_descriptors());
    assert!(
        diffs.is_empty(),
        "our protos differ from {} in {} place(s):\n{}",
        upstream_dir().display(),
        diffs.len(),
        diffs.join("\n")
    );
}

fn message_mut<'a>(
    fds: &'a mut FileDescriptorSet,
    package: &str,
    name: &str,
) -> &'a mut DescriptorProto {
    fds.file
        .iter_mut()
        .filter(|f| f.package() == package)
        .flat_map(|f| f.message_type.iter_mut())
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("no message {package}.{name}"))
}

fn field_mut<'a>(
    fds: &'a mut FileDescriptorSet,
    package: &str,
    message: &str,
    field: &str,
) -> &'a mut prost_types::FieldDescriptorProto {
    message_mut(fds, package, message)
        .field
        .iter_mut()
        .find(|f| f.name() == field)
        .unwrap_or_else(|| panic!("no field {package}.{message}.{field}"))
}

/// An enum to give the comparator something to check: our protos have none.
fn with_health_enum(mut fds: FileDescriptorSet, unhealthy: i32) -> FileDescriptorSet {
    let value = |name: &str, number| EnumValueDescriptorProto {
        name: Some(name.into()),
        number: Some(number),
        ..Default::default()
    };
    message_mut(&mut fds, "v1beta1", "Device")
        .enum_type
        .push(EnumDescriptorProto {
            name: Some("Health".into()),
            value: vec![value("HEALTHY", 0), value("UNHEALTHY", unhealthy)],
            ..Default::default()
        });
    fds
}

#[test]
fn comparator_reports_every_kind_of_difference() {
    let base = our_descriptors();
    assert_eq!(differences(&base, &base), Vec::<String>::new());

    type Mutation = fn(&mut FileDescriptorSet);
    let cases: [(&str, Mutation, &str); 9] = [
        (
            "field number",
            |d| field_mut(d, "v1beta1", "RegisterRequest", "endpoint").number = Some(7),
            "differs:            message .v1beta1.RegisterRequest field endpoint",
        ),
        (
            "field type",
            |d| field_mut(d, "v1beta1", "Device", "health").r#type = Some(Type::Bytes as i32),
            "differs:            message .v1beta1.Device field health",
        ),
        (
            "field removed",
            |d| {
                message_mut(d, "v1", "PodResources").field.pop();
            },
            "missing in ours:    message .v1.PodResources field containers",
        ),
        (
            "field renamed",
            |d| field_mut(d, "v1beta1", "NUMANode", "ID").name = Some("id".into()),
            "not in upstream:    message .v1beta1.NUMANode field id",
        ),
        (
            "proto3 optional",
            |d| field_mut(d, "v1", "ClaimResource", "share_id").proto3_optional = Some(false),
            "differs:            message .v1.ClaimResource field share_id",
        ),
        (
            "message renamed",
            |d| message_mut(d, "v1beta1", "Mount").name = Some("MountPoint".into()),
            "missing in ours:    message .v1beta1.Mount ",
        ),
        (
            "map became message",
            |d| {
                message_mut(d, "v1beta1", "ContainerAllocateResponse").nested_type[0].options = None
            },
            "differs:            message .v1beta1.ContainerAllocateResponse.EnvsEntry",
        ),
        (
            "server streaming",
            |d| {
                let svc = d
                    .file
                    .iter_mut()
                    .flat_map(|f| f.service.iter_mut())
                    .find(|s| s.name() == "DevicePlugin")
                    .expect("DevicePlugin");
                svc.method
                    .iter_mut()
                    .find(|m| m.name() == "ListAndWatch")
                    .expect("ListAndWatch")
                    .server_streaming = Some(false);
            },
            "differs:            service .v1beta1.DevicePlugin method ListAndWatch",
        ),
        (
            "method input",
            |d| {
                let svc = d
                    .file
                    .iter_mut()
                    .flat_map(|f| f.service.iter_mut())
                    .find(|s| s.name() == "PodResourcesLister")
                    .expect("PodResourcesLister");
                svc.method[0].input_type = Some(".v1.GetPodResourcesRequest".into());
            },
            "differs:            service .v1.PodResourcesLister method List",
        ),
    ];

    let mut all = base.clone();
    for (what, mutate, expected) in cases {
        let mut mutated = base.clone();
        mutate(&mut mutated);
        mutate(&mut all);
        let diffs = differences(&base, &mutated);
        assert!(
            diffs.iter().any(|d| d.starts_with(expected)),
            "{what}: expected a line starting {expected:?}, got:\n{}",
            diffs.join("\n")
        );
    }
    // One report carries every difference, not just the first.
    let report = differences(&base, &all).join("\n");
    for (_, _, expected) in cases {
        assert!(
            report.contains(expected),
            "combined report lacks {expected:?}:\n{report}"
        );
    }

    // Enums: a value's number.
    let diffs = differences(
        &with_health_enum(base.clone(), 1),
        &with_health_enum(base, 2),
    );
    assert_eq!(
        diffs,
        ["differs:            enum .v1beta1.Device.Health value UNHEALTHY\n    upstream: number=1\n    ours:     number=2"]
    );
}

// ---- constants ----

/// The `const` block and `SupportedVersions` of upstream `constants.go`, evaluated: Go string
/// literals (with `\\` and `\"` escapes), integers, and `+` of earlier constants.
fn upstream_constants() -> BTreeMap<String, String> {
    let path = upstream_dir().join("deviceplugin-v1beta1-constants.go");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let unquote = |s: &str| -> String {
        let inner = s.trim().strip_prefix('"').and_then(|s| s.strip_suffix('"'));
        let inner = inner.unwrap_or_else(|| panic!("not a Go string literal: {s}"));
        inner
            .replace("\\\\", "\u{0}")
            .replace("\\\"", "\"")
            .replace('\u{0}', "\\")
    };
    let mut consts = BTreeMap::new();
    let mut in_block = false;
    for line in text.lines().map(str::trim) {
        if line == "const (" {
            in_block = true;
        } else if in_block && line == ")" {
            in_block = false;
        } else if in_block && !line.is_empty() && !line.starts_with("//") {
            let (name, expr) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("unparsed: {line}"));
            let value: String = expr
                .split('+')
                .map(str::trim)
                .map(|term| match term {
                    t if t.starts_with('"') => unquote(t),
                    t if t.chars().all(|c| c.is_ascii_digit()) => t.to_owned(),
                    t => consts
                        .get(t)
                        .cloned()
                        .unwrap_or_else(|| panic!("unknown constant {t}")),
                })
                .collect();
            consts.insert(name.trim().to_owned(), value);
        } else if let Some(rest) = line.strip_prefix("var SupportedVersions = [...]string{") {
            let list = rest
                .strip_suffix('}')
                .expect("SupportedVersions on one line");
            let versions: Vec<String> = list.split(',').map(unquote).collect();
            consts.insert("SupportedVersions".to_owned(), versions.join(","));
        }
    }
    consts
}

#[test]
fn constants_match_upstream() {
    use vcuda_proto::constants as c;
    let ours: BTreeMap<&str, String> = [
        ("Healthy", c::HEALTHY.to_owned()),
        ("Unhealthy", c::UNHEALTHY.to_owned()),
        ("Version", c::VERSION.to_owned()),
        ("DevicePluginPath", c::DEVICE_PLUGIN_PATH.to_owned()),
        ("KubeletSocket", c::KUBELET_SOCKET.to_owned()),
        (
            "DevicePluginPathWindows",
            c::DEVICE_PLUGIN_PATH_WINDOWS.to_owned(),
        ),
        ("KubeletSocketWindows", c::KUBELET_SOCKET_WINDOWS.to_owned()),
        (
            "KubeletPreStartContainerRPCTimeoutInSecs",
            c::KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT_IN_SECS.to_string(),
        ),
        ("SupportedVersions", c::SUPPORTED_VERSIONS.join(",")),
    ]
    .into_iter()
    .collect();
    let upstream = upstream_constants();
    // Both directions: a constant added upstream must be added here too.
    let upstream: BTreeMap<&str, String> = upstream
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    assert_eq!(ours, upstream);
    assert_eq!(
        c::KUBELET_PRE_START_CONTAINER_RPC_TIMEOUT,
        std::time::Duration::from_secs(30)
    );
}
