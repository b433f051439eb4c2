//! vcuda-smi's pure parts: picking GPUs and drawing the table; the self-test's decisions
//! (`selftest`). The binary (`main.rs`) asks vcuda-manager over its socket and prints what
//! these return, and runs the self-test's workload and measurements.

#![forbid(unsafe_code)]

use std::fmt::Write as _;

/// The glibc baseline rule, shared with vcuda-manager (which refuses to mount a library
/// outside it): the same file, compiled here, so the self-test and the manager cannot
/// disagree. Pure: it reads bytes.
#[path = "../../../manager/src/baseline.rs"]
pub mod baseline;
pub mod selftest;

use vcuda_contract::view::{GpuModeView, View};

/// Keep only GPUs whose index is in `ids` (and the containers on them, with only those
/// GPUs). An empty `ids` keeps everything.
pub fn filter(mut v: View, ids: &[u32]) -> View {
    if ids.is_empty() {
        return v;
    }
    v.gpus.retain(|g| ids.contains(&g.index));
    let kept: Vec<&str> = v.gpus.iter().map(|g| g.uuid.as_str()).collect();
    v.modes.retain(|m| kept.contains(&m.uuid.as_str()));
    for c in &mut v.containers {
        c.gpus.retain(|g| ids.contains(&g.index));
    }
    v.containers.retain(|c| !c.gpus.is_empty());
    v
}

fn mib(bytes: u64) -> String {
    format!("{}MiB", bytes >> 20)
}

fn pct(p: Option<u32>) -> String {
    p.map_or_else(|| "N/A".into(), |p| format!("{p}%"))
}

fn secs(ns: u64) -> String {
    format!("{:.1}s", ns as f64 / 1e9)
}

/// A table: a header row and data rows, columns padded to fit, `|` between them.
pub(crate) fn table(out: &mut String, header: &[&str], rows: &[Vec<String>], right: &[bool]) {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let rule: String = width
        .iter()
        .map(|w| "-".repeat(w + 2))
        .collect::<Vec<_>>()
        .join("+");
    let line = |out: &mut String, cells: &[String]| {
        let body: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if right.get(i).copied().unwrap_or(false) {
                    format!(" {c:>w$} ", w = width[i])
                } else {
                    format!(" {c:<w$} ", w = width[i])
                }
            })
            .collect();
        let _ = writeln!(out, "|{}|", body.join("|"));
    };
    let _ = writeln!(out, "+{rule}+");
    line(
        out,
        &header.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
    );
    let _ = writeln!(out, "+{rule}+");
    for r in rows {
        line(out, r);
    }
    let _ = writeln!(out, "+{rule}+");
}

/// A GPU's `Mode` cell: `whole`, `slice 1/2` (slices held / slices per GPU), `shared`, or
/// `-` while it is locked to no mode; `N/A` if the view names no mode for it.
fn mode_cell(m: Option<&GpuModeView>) -> String {
    match m {
        None => "N/A".into(),
        Some(m) if m.mode.is_empty() => "-".into(),
        Some(m) if m.mode == "slice" => format!("slice {}/{}", m.slices_held, m.slices),
        Some(m) => m.mode.clone(),
    }
}

/// The nvidia-smi style text of a view. `inside`: shown inside a container (pids are the
/// container's own). A `Mode` column (issue 19's sharing modes) appears only when the view
/// carries modes: a manager before modes, and a container's view, show the table as before.
pub fn render(v: &View, inside: bool) -> String {
    let mut out = String::new();
    let scope = if v.scope == "container" {
        "this container"
    } else {
        "node"
    };
    let _ = writeln!(out, "vcuda-smi — {scope}");
    let modes = !v.modes.is_empty();
    let gpus: Vec<Vec<String>> = v
        .gpus
        .iter()
        .map(|g| {
            let mut row = vec![
                g.index.to_string(),
                g.name.clone(),
                g.uuid.clone(),
                format!(
                    "{} / {}",
                    mib(g.memory_used_bytes),
                    mib(g.memory_total_bytes)
                ),
                pct(g.utilization_percent),
                format!(
                    "{}% / {}",
                    g.core_allocated_percent,
                    mib(g.memory_allocated_bytes)
                ),
                if g.healthy { "ok" } else { "UNHEALTHY" }.into(),
            ];
            if modes {
                row.push(mode_cell(v.modes.iter().find(|m| m.uuid == g.uuid)));
            }
            row
        })
        .collect();
    let mut header = vec![
        "GPU",
        "Name",
        "UUID",
        "Memory used / total",
        "Util",
        "Allocated core / memory",
        "Health",
    ];
    let mut right = vec![true, false, false, true, true, true, false];
    if modes {
        header.push("Mode");
        right.push(false);
    }
    table(&mut out, &header, &gpus, &right);
    if v.containers.is_empty() {
        let _ = writeln!(out, "No containers.");
        return out;
    }
    let mut rows = Vec::new();
    for c in &v.containers {
        let procs: Vec<String> = c
            .processes
            .iter()
            .map(|p| {
                let pid = if inside { p.pid } else { p.host_pid };
                if pid == 0 {
                    format!("{} (unregistered)", p.host_pid)
                } else {
                    pid.to_string()
                }
            })
            .collect();
        for (i, g) in c.gpus.iter().enumerate() {
            rows.push(vec![
                if i == 0 {
                    format!("{}/{}/{}", c.namespace, c.pod, c.container)
                } else {
                    String::new()
                },
                g.index.to_string(),
                if g.core_limit_percent > g.core_share_percent {
                    format!(
                        "{}% (up to {}%)",
                        g.core_share_percent, g.core_limit_percent
                    )
                } else {
                    format!("{}%", g.core_share_percent)
                },
                pct(g.utilization_percent),
                format!(
                    "{} / {}",
                    mib(g.memory_used_bytes),
                    mib(g.memory_quota_bytes)
                ),
                secs(g.throttled_ns),
                g.oom_refusals.to_string(),
                if i == 0 {
                    if procs.is_empty() {
                        "-".into()
                    } else {
                        procs.join(", ")
                    }
                } else {
                    String::new()
                },
            ]);
        }
    }
    table(
        &mut out,
        &[
            "Namespace/pod/container",
            "GPU",
            "Core share",
            "Util",
            "Memory used / quota",
            "Throttled",
            "OOM refused",
            if inside { "PIDs" } else { "Host PIDs" },
        ],
        &rows,
        &[false, true, true, true, true, true, true, false],
    );
    out
}

/// Parse `-i 0,2`.
pub fn parse_ids(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| format!("{x:?} is not a GPU index; give indices like 0,1"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_contract::view::{ContainerGpuView, ContainerView, GpuView, ProcessView};

    fn view() -> View {
        let gpu = |i: u32| GpuView {
            index: i,
            uuid: format!("GPU-{i}"),
            name: "NVIDIA A100-SXM4-40GB".into(),
            memory_total_bytes: 40 << 30,
            memory_used_bytes: 10 << 30,
            utilization_percent: Some(99),
            healthy: i == 0,
            core_allocated_percent: 100,
            memory_allocated_bytes: 12 << 30,
        };
        let c = |pod: &str, i: u32, share: u32| ContainerView {
            namespace: "default".into(),
            pod: pod.into(),
            container: "main".into(),
            allocation: format!("a-{pod}"),
            gpus: vec![ContainerGpuView {
                index: i,
                uuid: format!("GPU-{i}"),
                core_share_percent: share,
                core_limit_percent: share,
                utilization_percent: Some(share),
                memory_used_bytes: 3 << 30,
                memory_quota_bytes: 4 << 30,
                memory_driver_bytes: 3 << 30,
                throttled_ns: 1_500_000_000,
                oom_refusals: 2,
                accounting_errors: 0,
                watchdog_violations: 0,
                watchdog_compute_violations: 0,
            }],
            processes: vec![ProcessView {
                host_pid: 4242,
                pid: 7,
                memory_bytes: 3 << 30,
            }],
        };
        View {
            modes: Vec::new(),
            schema: 1,
            scope: "node".into(),
            taken_unix: 0,
            gpus: vec![gpu(0), gpu(1)],
            containers: vec![c("pod-a", 0, 30), c("pod-b", 1, 70)],
        }
    }

    #[test]
    fn the_node_table_shows_gpus_and_containers() {
        let text = render(&view(), false);
        for want in [
            "NVIDIA A100-SXM4-40GB",
            "10240MiB / 40960MiB",
            "UNHEALTHY",
            "default/pod-a/main",
            "3072MiB / 4096MiB",
            "30%",
            "1.5s",
            "4242",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        // The columns line up: every line of a table is as wide as its rules.
        let lines: Vec<&str> = text.lines().collect();
        let mut width = 0;
        for l in &lines {
            if l.starts_with('+') {
                width = l.chars().count();
            } else if l.starts_with('|') {
                assert_eq!(l.chars().count(), width, "{l}");
            }
        }
    }

    fn mode(uuid: &str, mode: &str, slices_held: u32, serves: &str) -> GpuModeView {
        GpuModeView {
            uuid: uuid.into(),
            mode: mode.into(),
            slices_held,
            slices: 2,
            serves: serves.into(),
        }
    }

    /// The GPU table's header row.
    fn gpu_header(text: &str) -> &str {
        text.lines().find(|l| l.starts_with("| GPU ")).unwrap()
    }

    /// The GPU table's row of `uuid`, its cells trimmed.
    fn gpu_row(text: &str, uuid: &str) -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.contains(&format!(" {uuid} ")))
            .unwrap_or_else(|| panic!("no row for {uuid}:\n{text}"));
        line.trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    }

    #[test]
    fn without_modes_the_gpu_table_is_as_before() {
        // A manager before modes sends none: no Mode column.
        let text = render(&view(), false);
        assert_eq!(
            gpu_header(&text),
            "| GPU | Name                  | UUID  | Memory used / total | Util | Allocated core / memory | Health    |"
        );
        assert!(!text.contains("Mode"), "{text}");
    }

    #[test]
    fn each_gpu_shows_its_mode_and_slices() {
        let mut v = view();
        v.gpus.push(GpuView {
            index: 2,
            uuid: "GPU-2".into(),
            ..v.gpus[0].clone()
        });
        v.modes = vec![
            mode("GPU-0", "slice", 1, "slice"),
            mode("GPU-1", "whole", 0, "whole"),
            mode("GPU-2", "", 0, "whole,slice,shared"),
        ];
        let text = render(&v, false);
        assert!(
            gpu_header(&text).ends_with("| Health    | Mode      |"),
            "{text}"
        );
        let last = |uuid| gpu_row(&text, uuid).last().cloned().unwrap();
        assert_eq!(last("GPU-0"), "slice 1/2");
        assert_eq!(last("GPU-1"), "whole");
        assert_eq!(last("GPU-2"), "-");
        // Shared mode, and a GPU the view names no mode for.
        v.modes = vec![mode("GPU-0", "shared", 0, "shared")];
        let text = render(&v, false);
        assert_eq!(gpu_row(&text, "GPU-0").last().unwrap(), "shared");
        assert_eq!(gpu_row(&text, "GPU-1").last().unwrap(), "N/A");
        // Still aligned: every row as wide as its rules.
        let lines: Vec<&str> = text.lines().collect();
        let rule = lines.iter().find(|l| l.starts_with('+')).unwrap();
        assert_eq!(
            gpu_header(&text).chars().count(),
            rule.chars().count(),
            "{text}"
        );
    }

    #[test]
    fn picking_gpus_keeps_only_their_modes() {
        let mut v = view();
        v.modes = vec![
            mode("GPU-0", "slice", 2, "slice"),
            mode("GPU-1", "shared", 0, "shared"),
        ];
        let v = filter(v, &[1]);
        assert_eq!(v.modes, vec![mode("GPU-1", "shared", 0, "shared")]);
        let text = render(&v, false);
        assert_eq!(gpu_row(&text, "GPU-1").last().unwrap(), "shared");
        assert!(!text.contains("slice"), "{text}");
    }

    #[test]
    fn json_carries_the_modes() {
        // What `vcuda-smi --json` prints: the View as serde writes it.
        let mut v = view();
        v.modes = vec![mode("GPU-0", "slice", 1, "slice")];
        let j = serde_json::to_value(&v).unwrap();
        assert_eq!(
            j["modes"],
            serde_json::json!([{"uuid": "GPU-0", "mode": "slice", "slices_held": 1,
                                "slices": 2, "serves": "slice"}])
        );
        // From a manager before modes: an empty list.
        assert_eq!(
            serde_json::to_value(view()).unwrap()["modes"],
            serde_json::json!([])
        );
    }

    #[test]
    fn inside_a_container_pids_are_the_containers() {
        let text = render(&view(), true);
        assert!(text.contains("PIDs") && !text.contains("4242"));
    }

    #[test]
    fn picking_gpus_keeps_only_their_rows() {
        let v = filter(view(), &[1]);
        assert_eq!(v.gpus.len(), 1);
        assert_eq!(v.containers.len(), 1);
        assert_eq!(v.containers[0].pod, "pod-b");
        assert_eq!(filter(view(), &[]).containers.len(), 2);
        assert_eq!(parse_ids("0, 2").unwrap(), vec![0, 2]);
        assert!(parse_ids("x").unwrap_err().contains("GPU index"));
    }
}
