//! The binary through a real FUSE mount, read by the manager's own reader (`vcuda_vm::sysfs`)
//! and written with the manager's own plans (`vcuda_vm::mdev::Action`). Needs /dev/fuse (and,
//! when not root, fusermount3).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use vcuda_vm::mdev::Action;
use vcuda_vm::pci::PciAddress;

const GPU: &str = "0000:3b:00.0";
const PASS: &str = "0000:86:00.0";
const U1: &str = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001";

struct Sim {
    child: Child,
    dir: tempfile::TempDir,
}

impl Sim {
    fn start() -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("node.json");
        std::fs::write(
            &config,
            format!(
                r#"{{"devices": [
                  {{"address": "{GPU}", "vendor": "0x10de", "device": "0x1eb8", "class": "0x030200",
                   "driver": "nvidia", "iommu_group": 12, "numa_node": 0,
                   "mdev_types": [{{"id": "nvidia-222", "name": "GRID T4-1B", "max_instances": 1}}]}},
                  {{"address": "{PASS}", "vendor": "0x10de", "device": "0x1f08", "class": "0x030000",
                   "driver": "vfio-pci", "iommu_group": 40}}]}}"#
            ),
        )
        .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_sysfs-sim"))
            .arg("--config")
            .arg(&config)
            .arg("--mount")
            .arg(dir.path().join("sys"))
            .arg("--dev-root")
            .arg(dir.path().join("dev"))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line, "ready\n",
            "sysfs-sim did not mount (its stderr above says why: /dev/fuse, fusermount3)"
        );
        Sim { child, dir }
    }

    fn sys(&self) -> PathBuf {
        self.dir.path().join("sys")
    }

    fn dev(&self) -> PathBuf {
        self.dir.path().join("dev")
    }

    fn stop(mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        assert!(!is_mounted(&self.sys()));
    }
}

fn is_mounted(p: &Path) -> bool {
    let p = p.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
}

fn addr(a: &str) -> PciAddress {
    a.parse().unwrap()
}

fn run(sys: &Path, a: &Action) -> std::io::Result<()> {
    let (path, content) = a.write();
    std::fs::write(sys.join(path), content)
}

#[test]
fn the_managers_reader_and_plans_on_the_mount() {
    let sim = Sim::start();
    let (sys, dev) = (sim.sys(), sim.dev());

    let snap = vcuda_vm::sysfs::pci_snapshot(&sys, &dev).unwrap();
    let pass = snap.device(&addr(PASS)).unwrap();
    assert_eq!(
        (pass.driver.as_deref(), pass.iommu_group, pass.numa_node),
        (Some("vfio-pci"), Some(40), None)
    );
    assert!(snap.health(&addr(PASS)).is_ok());
    let gpu = snap.device(&addr(GPU)).unwrap();
    assert_eq!(
        (gpu.driver.as_deref(), gpu.numa_node),
        (Some("nvidia"), Some(0))
    );

    let create = Action::Create {
        parent: addr(GPU),
        type_id: "nvidia-222".into(),
        uuid: U1.parse().unwrap(),
    };
    run(&sys, &create).unwrap();
    let m = vcuda_vm::sysfs::mdev_snapshot(&sys, &[addr(GPU)]).unwrap();
    assert_eq!(m.types[0].available_instances, 0);
    assert_eq!(m.mdevs.len(), 1);
    let group = m.mdevs[0].iommu_group.unwrap();
    assert!(dev.join("vfio").join(group.to_string()).exists());
    // the kernel's errnos reach the writer
    let e = run(&sys, &create).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST), "{e}");
    let other = Action::Create {
        parent: addr(GPU),
        type_id: "nvidia-222".into(),
        uuid: "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002".parse().unwrap(),
    };
    let e = run(&sys, &other).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EUSERS), "{e}");
    std::fs::write(sys.join("sim/busy"), U1).unwrap();
    let remove = Action::Remove {
        uuid: U1.parse().unwrap(),
    };
    let e = run(&sys, &remove).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EBUSY), "{e}");
    std::fs::write(sys.join("sim/idle"), U1).unwrap();
    run(&sys, &remove).unwrap();
    assert!(vcuda_vm::sysfs::read_mdevs(&sys).unwrap().is_empty());
    assert!(!dev.join("vfio").join(group.to_string()).exists());

    // health follows an unbind, through the manager's reader
    std::fs::write(sys.join("bus/pci/drivers/vfio-pci/unbind"), PASS).unwrap();
    let snap = vcuda_vm::sysfs::pci_snapshot(&sys, &dev).unwrap();
    assert!(snap.health(&addr(PASS)).is_err());
    sim.stop();
}
