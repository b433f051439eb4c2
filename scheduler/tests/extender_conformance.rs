//! Our extender types against upstream `extender/v1/types.go`
//! (`../shared/upstream/extender-v1-types.go`): for each struct we implement, the JSON keys
//! of a fully populated value must be exactly the Go field names (the Go types have no json
//! tags, so the field names are the keys). A renamed, missing or extra field fails here.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use vcuda_scheduler::extender::*;

const UPSTREAM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/upstream/extender-v1-types.go"
);

/// `type Name struct { Field Type ... }` → Name → field names. Comments, blank lines and
/// nested braces inside a field type are skipped; embedded (unnamed) fields would show up
/// as a single token and are refused, since we could not know their keys.
fn go_structs(src: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    let mut in_block_comment = false;
    for raw in src.lines() {
        let mut line = raw.trim();
        if in_block_comment {
            if let Some(end) = line.find("*/") {
                in_block_comment = false;
                line = line[end + 2..].trim();
            } else {
                continue;
            }
        }
        if line.starts_with("/*") && !line.contains("*/") {
            in_block_comment = true;
            continue;
        }
        if let Some(i) = line.find("//") {
            line = line[..i].trim();
        }
        if line.is_empty() {
            continue;
        }
        match &mut current {
            None => {
                let t: Vec<&str> = line.split_whitespace().collect();
                if t.len() >= 4 && t[0] == "type" && t[2] == "struct" && t[3] == "{" {
                    current = Some((t[1].to_string(), Vec::new()));
                }
            }
            Some((name, fields)) => {
                if line == "}" {
                    out.insert(std::mem::take(name), std::mem::take(fields));
                    current = None;
                    continue;
                }
                let t: Vec<&str> = line.split_whitespace().collect();
                assert!(
                    t.len() >= 2,
                    "embedded or unparsable field in {name}: {line:?}; extend the parser"
                );
                fields.push(t[0].to_string());
            }
        }
    }
    assert!(current.is_none(), "unterminated struct in {UPSTREAM}");
    out
}

fn keys(v: &impl Serialize) -> BTreeSet<String> {
    match serde_json::to_value(v).unwrap() {
        serde_json::Value::Object(m) => m.keys().cloned().collect(),
        other => panic!("not an object: {other}"),
    }
}

#[test]
fn our_extender_types_have_exactly_the_upstream_keys() {
    let src = std::fs::read_to_string(UPSTREAM)
        .unwrap_or_else(|e| panic!("read {UPSTREAM}: {e} (is ../shared present?)"));
    let go = go_structs(&src);
    let ours: Vec<(&str, BTreeSet<String>)> = vec![
        (
            "ExtenderArgs",
            keys(&ExtenderArgs {
                pod: Some(Pod::default()),
                nodes: Some(NodeList::default()),
                node_names: Some(vec!["n".into()]),
            }),
        ),
        (
            "ExtenderFilterResult",
            keys(&ExtenderFilterResult {
                nodes: Some(NodeList::default()),
                node_names: Some(vec!["n".into()]),
                failed_nodes: BTreeMap::from([("a".into(), "b".into())]),
                failed_and_unresolvable_nodes: BTreeMap::from([("a".into(), "b".into())]),
                error: "e".into(),
            }),
        ),
        (
            "HostPriority",
            keys(&HostPriority {
                host: "n".into(),
                score: 1,
            }),
        ),
        (
            "ExtenderBindingArgs",
            keys(&ExtenderBindingArgs {
                pod_name: "p".into(),
                pod_namespace: "ns".into(),
                pod_uid: "u".into(),
                node: "n".into(),
            }),
        ),
        (
            "ExtenderBindingResult",
            keys(&ExtenderBindingResult { error: "e".into() }),
        ),
    ];
    for (name, ours) in ours {
        let fields = go
            .get(name)
            .unwrap_or_else(|| panic!("struct {name} not found in {UPSTREAM}"));
        let theirs: BTreeSet<String> = fields.iter().cloned().collect();
        assert_eq!(
            ours, theirs,
            "{name}: our JSON keys (left) differ from the Go field names (right); fix the serde renames in src/extender.rs"
        );
    }
}

#[test]
fn the_parser_reads_what_it_must() {
    let go = go_structs(
        "/* c\n type Fake struct {\n */\ntype A struct {\n\t// doc\n\tX string // trailing\n\tY map[string]*B\n}\n",
    );
    assert_eq!(go.len(), 1, "{go:?}");
    assert_eq!(go["A"], vec!["X", "Y"]);
    // the upstream file: the structs we rely on are all there
    let src = std::fs::read_to_string(UPSTREAM).unwrap();
    let go = go_structs(&src);
    assert_eq!(go["HostPriority"], vec!["Host", "Score"]);
    assert!(go.contains_key("ExtenderPreemptionArgs"));
}
