//! The glibc baseline of the library the manager mounts (issue 13): libvcuda.so is listed in
//! every container's /etc/ld.so.preload, so if the dynamic loader of an image cannot load it
//! (`version 'GLIBC_2.34' not found`), every process of the pod fails to start. The manager
//! checks the library before it registers with the kubelet, and refuses to start with one
//! that an image at the baseline could not load, so no pod is ever admitted with it.
//!
//! The rule is tests/portable/test_glibc_baseline.py's, as the loader applies it: every
//! `GLIBC_x.y[.z]` symbol version the library requires (its GNU version-needs section) is no
//! newer than the baseline, and the shared objects it needs (`DT_NEEDED`) are ones every
//! glibc image has — glibc's own. Pure: [`check`] reads bytes; the daemon reads the file.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use object::elf;
use object::read::elf::FileHeader as _;
use object::LittleEndian;

/// The default baseline: glibc 2.17 (CentOS 7, manylinux2014), what scripts/build-portable
/// builds for.
pub const DEFAULT: (u32, u32) = (2, 17);

/// The shared objects an image with glibc always has: glibc's own. (libgcc_s is not one:
/// minimal and distroless images lack it.)
pub const ALLOWED_NEEDED: [&str; 6] = [
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "ld-linux-x86-64.so.2",
    "librt.so.1",
];

/// What an accepted library needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The newest `GLIBC_` symbol version it requires (e.g. `GLIBC_2.14`); None if none.
    pub highest: Option<String>,
    /// Its `DT_NEEDED` shared objects, in file order.
    pub needed: Vec<String>,
}

impl Report {
    /// "needs at most GLIBC_2.14", for the start-up log line.
    pub fn summary(&self) -> String {
        match &self.highest {
            Some(v) => format!("needs at most {v}"),
            None => "needs no GLIBC symbol version".into(),
        }
    }
}

/// Why the library is refused. Each message names the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error(
        "cannot read the library {} (--library): {source}; point --library at libvcuda.so \
         (the portable build: scripts/build-portable makes target/portable/libvcuda.so)",
        path.display()
    )]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the library {} (--library) is not an x86-64 ELF shared object that can be checked \
         ({why}); point --library at libvcuda.so (the portable build: scripts/build-portable \
         makes target/portable/libvcuda.so)",
        path.display()
    )]
    NotElf { path: PathBuf, why: ElfError },
    #[error("{}", outside_message(path, *baseline, newer, unexpected))]
    OutsideBaseline {
        path: PathBuf,
        /// The baseline, (major, minor).
        baseline: (u32, u32),
        /// `GLIBC_` versions newer than the baseline, oldest first, each once.
        newer: Vec<String>,
        /// Needed shared objects that are not glibc's own, in file order.
        unexpected: Vec<String>,
    },
}

fn outside_message(
    path: &Path,
    baseline: (u32, u32),
    newer: &[String],
    unexpected: &[String],
) -> String {
    let (major, minor) = baseline;
    let mut m = format!(
        "the library {} (--library) cannot load in containers whose glibc is {major}.{minor} \
         (the baseline, --library-baseline): it ",
        path.display()
    );
    if !newer.is_empty() {
        let _ = write!(m, "requires {}", newer.join(", "));
    }
    if !unexpected.is_empty() {
        if !newer.is_empty() {
            m.push_str(" and ");
        }
        let _ = write!(
            m,
            "needs {}, which {} not part of glibc (images may lack {})",
            unexpected.join(", "),
            if unexpected.len() == 1 { "is" } else { "are" },
            if unexpected.len() == 1 { "it" } else { "them" },
        );
    }
    m.push_str(
        "; every process of a pod given it would fail to start. Build it with \
         scripts/build-portable and point --library at that build (target/portable/libvcuda.so)",
    );
    // A newer baseline helps only with versions, and is MAJOR.MINOR (a GLIBC_x.y.z is older
    // than any baseline worth offering).
    let newest = newer.last().map(|n| n.trim_start_matches("GLIBC_"));
    if let Some(v) = newest.filter(|v| unexpected.is_empty() && parse_version(v).is_some()) {
        let _ = write!(
            m,
            ", or, if every image on this node has glibc {v} or newer, say so with \
             --library-baseline {v}"
        );
    }
    m
}

/// Checks the library `bytes` (read from `path`, which messages name) against `baseline`
/// (major, minor).
pub fn check(path: &Path, bytes: &[u8], baseline: (u32, u32)) -> Result<Report, BaselineError> {
    let needs = read(bytes).map_err(|why| BaselineError::NotElf {
        path: path.to_owned(),
        why,
    })?;
    let limit = [baseline.0, baseline.1];
    let mut glibc: Vec<(Vec<u32>, &str)> = needs
        .versions
        .iter()
        .filter_map(|v| Some((glibc_version(v)?, v.as_str())))
        .collect();
    glibc.sort();
    glibc.dedup();
    let newer: Vec<String> = glibc
        .iter()
        .filter(|(v, _)| v.as_slice() > limit.as_slice())
        .map(|(_, name)| name.to_string())
        .collect();
    let unexpected: Vec<String> = needs
        .needed
        .iter()
        .filter(|n| !ALLOWED_NEEDED.contains(&n.as_str()))
        .cloned()
        .collect();
    if !newer.is_empty() || !unexpected.is_empty() {
        return Err(BaselineError::OutsideBaseline {
            path: path.to_owned(),
            baseline,
            newer,
            unexpected,
        });
    }
    Ok(Report {
        highest: glibc.last().map(|(_, name)| name.to_string()),
        needed: needs.needed,
    })
}

/// `2.17` → (2, 17): a baseline as `--library-baseline` gives it.
pub fn parse_version(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once('.')?;
    Some((number(major)?, number(minor)?))
}

/// `GLIBC_2.3.4` → [2, 3, 4]; None for what is not `GLIBC_x.y` or `GLIBC_x.y.z` (e.g.
/// `GLIBC_PRIVATE`, `GCC_3.0`), which the rule does not compare. Compared as a sequence, so
/// 2.17.1 is newer than 2.17.
fn glibc_version(name: &str) -> Option<Vec<u32>> {
    let parts: Vec<&str> = name.strip_prefix("GLIBC_")?.split('.').collect();
    if !(2..=3).contains(&parts.len()) {
        return None;
    }
    parts.into_iter().map(number).collect()
}

/// Decimal digits only (no sign); too large a number saturates (still compares as newest).
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u32, |n, b| {
        n.saturating_mul(10).saturating_add(u32::from(b - b'0'))
    }))
}

/// Why a file is not an ELF shared object this check can read (the part of
/// [`BaselineError::NotElf`] that says what is wrong with the bytes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    #[error("not a 64-bit little-endian ELF file: {0}")]
    Header(object::read::Error),
    #[error("{0}")]
    Endian(object::read::Error),
    #[error("built for ELF machine {machine}, not x86-64 ({})", elf::EM_X86_64)]
    Machine { machine: u16 },
    #[error("ELF type {e_type}, not a shared object ({})", elf::ET_DYN)]
    NotShared { e_type: u16 },
    #[error("section headers: {0}")]
    Sections(object::read::Error),
    #[error("dynamic section: {0}")]
    Dynamic(object::read::Error),
    #[error("it has no dynamic section")]
    NoDynamic,
    #[error("dynamic section: DT_NEEDED: {0}")]
    Needed(object::read::Error),
    #[error("version-needs section: {0}")]
    VersionNeeds(object::read::Error),
    #[error("version-needs section's strings: {0}")]
    VersionStrings(object::read::Error),
}

impl ElfError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ElfError::Header(_) => "elf-header",
            ElfError::Endian(_) => "elf-endian",
            ElfError::Machine { .. } => "elf-machine",
            ElfError::NotShared { .. } => "elf-not-shared",
            ElfError::Sections(_) => "elf-sections",
            ElfError::Dynamic(_) => "elf-dynamic",
            ElfError::NoDynamic => "elf-no-dynamic",
            ElfError::Needed(_) => "elf-needed",
            ElfError::VersionNeeds(_) => "elf-version-needs",
            ElfError::VersionStrings(_) => "elf-version-strings",
        }
    }
}

/// What an ELF file asks of the dynamic loader.
struct Needs {
    /// DT_NEEDED.
    needed: Vec<String>,
    /// Every version name of the version-needs section, of whichever file.
    versions: Vec<String>,
}

/// Reads the dynamic section and the GNU version-needs section through the section headers
/// (as readelf, and tests/portable, do). An error says what is wrong, for the message.
fn read(bytes: &[u8]) -> Result<Needs, ElfError> {
    let header = elf::FileHeader64::<LittleEndian>::parse(bytes).map_err(ElfError::Header)?;
    let endian = header.endian().map_err(ElfError::Endian)?;
    let machine = header.e_machine(endian);
    if machine != elf::EM_X86_64 {
        return Err(ElfError::Machine { machine });
    }
    let e_type = header.e_type(endian);
    if e_type != elf::ET_DYN {
        return Err(ElfError::NotShared { e_type });
    }
    let sections = header.sections(endian, bytes).map_err(ElfError::Sections)?;
    let dynamic = sections
        .dynamic_table(endian, bytes)
        .map_err(ElfError::Dynamic)?;
    if dynamic.is_empty() {
        return Err(ElfError::NoDynamic);
    }
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut needed = Vec::new();
    for d in dynamic.iter() {
        if d.tag == elf::DT_NEEDED {
            let name = dynamic.string(d).map_err(ElfError::Needed)?;
            needed.push(text(name));
        }
    }
    let mut versions = Vec::new();
    let verneed = sections
        .gnu_verneed(endian, bytes)
        .map_err(ElfError::VersionNeeds)?;
    if let Some((mut files, link)) = verneed {
        let strings = sections
            .strings(endian, bytes, link)
            .map_err(ElfError::VersionStrings)?;
        let bad = ElfError::VersionNeeds;
        while let Some((_, mut names)) = files.next().map_err(bad)? {
            while let Some(aux) = names.next().map_err(bad)? {
                versions.push(text(aux.name(endian, strings).map_err(bad)?));
            }
        }
    }
    Ok(Needs { needed, versions })
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::pod::bytes_of;
    use object::{I64, U16, U32, U64};

    const LE: LittleEndian = LittleEndian;

    /// A minimal x86-64 ELF shared object: a dynamic section (and its PT_DYNAMIC segment, for
    /// `readelf -d`) naming `needed` (DT_NEEDED) and a GNU version-needs section with
    /// `verneed`'s (file, versions). Made here, so a test depends on no toolchain or file;
    /// binutils reads it as this module does.
    fn fixture(needed: &[&str], verneed: &[(&str, &[&str])]) -> Vec<u8> {
        fixture_of(elf::ET_DYN, elf::EM_X86_64, needed, verneed)
    }

    fn fixture_of(
        e_type: u16,
        machine: u16,
        needed: &[&str],
        verneed: &[(&str, &[&str])],
    ) -> Vec<u8> {
        fn pad(out: &mut Vec<u8>) {
            out.resize(out.len().next_multiple_of(8), 0);
        }
        // .dynstr
        let mut dynstr = vec![0u8];
        let mut intern = |s: &str| {
            let at = dynstr.len() as u32;
            dynstr.extend_from_slice(s.as_bytes());
            dynstr.push(0);
            at
        };
        let needed_at: Vec<u32> = needed.iter().map(|n| intern(n)).collect();
        let verneed_at: Vec<(u32, Vec<u32>)> = verneed
            .iter()
            .map(|(file, names)| (intern(file), names.iter().map(|n| intern(n)).collect()))
            .collect();
        // .dynamic
        let mut dynamic = Vec::new();
        for at in &needed_at {
            dynamic.extend_from_slice(bytes_of(&elf::Dyn64 {
                d_tag: I64::new(LE, elf::DT_NEEDED),
                d_val: U64::new(LE, u64::from(*at)),
            }));
        }
        dynamic.extend_from_slice(bytes_of(&elf::Dyn64 {
            d_tag: I64::new(LE, elf::DT_NULL),
            d_val: U64::new(LE, 0),
        }));
        // .gnu.version_r: each file's Verneed followed by its Vernaux entries
        let mut version_r = Vec::new();
        let mut index = 2u16;
        for (i, (file, names)) in verneed_at.iter().enumerate() {
            let size = 16 + 16 * names.len() as u32;
            version_r.extend_from_slice(bytes_of(&elf::Verneed {
                vn_version: U16::new(LE, 1),
                vn_cnt: U16::new(LE, names.len() as u16),
                vn_file: U32::new(LE, *file),
                vn_aux: U32::new(LE, 16),
                vn_next: U32::new(LE, if i + 1 == verneed_at.len() { 0 } else { size }),
            }));
            for (j, name) in names.iter().enumerate() {
                version_r.extend_from_slice(bytes_of(&elf::Vernaux {
                    vna_hash: U32::new(LE, 0),
                    vna_flags: U16::new(LE, 0),
                    vna_other: U16::new(LE, index),
                    vna_name: U32::new(LE, *name),
                    vna_next: U32::new(LE, if j + 1 == names.len() { 0 } else { 16 }),
                }));
                index += 1;
            }
        }
        let shstrtab = b"\0.dynstr\0.dynamic\0.gnu.version_r\0.shstrtab\0";
        // layout: header, program header, the sections (8-aligned), the section headers
        let mut out = vec![0u8; 64 + 56];
        fn place(data: &[u8], out: &mut Vec<u8>) -> (u64, u64) {
            pad(out);
            let at = out.len() as u64;
            out.extend_from_slice(data);
            (at, data.len() as u64)
        }
        let dynstr_at = place(&dynstr, &mut out);
        let dynamic_at = place(&dynamic, &mut out);
        let version_r_at = place(&version_r, &mut out);
        let shstrtab_at = place(shstrtab, &mut out);
        pad(&mut out);
        let shoff = out.len() as u64;
        let section = |name: u32,
                       kind: u32,
                       (offset, size): (u64, u64),
                       link: u32,
                       info: u32,
                       entsize: u64| {
            elf::SectionHeader64 {
                sh_name: U32::new(LE, name),
                sh_type: U32::new(LE, kind),
                sh_flags: U64::new(LE, 0),
                sh_addr: U64::new(LE, 0),
                sh_offset: U64::new(LE, offset),
                sh_size: U64::new(LE, size),
                sh_link: U32::new(LE, link),
                sh_info: U32::new(LE, info),
                sh_addralign: U64::new(LE, 8),
                sh_entsize: U64::new(LE, entsize),
            }
        };
        let mut headers = vec![
            section(0, elf::SHT_NULL, (0, 0), 0, 0, 0),
            section(1, elf::SHT_STRTAB, dynstr_at, 0, 0, 0),
            section(9, elf::SHT_DYNAMIC, dynamic_at, 1, 0, 16),
        ];
        if !verneed.is_empty() {
            headers.push(section(
                18,
                elf::SHT_GNU_VERNEED,
                version_r_at,
                1,
                verneed.len() as u32,
                0,
            ));
        }
        headers.push(section(33, elf::SHT_STRTAB, shstrtab_at, 0, 0, 0));
        for h in &headers {
            out.extend_from_slice(bytes_of(h));
        }
        let header = elf::FileHeader64 {
            e_ident: elf::Ident {
                magic: elf::ELFMAG,
                class: elf::ELFCLASS64,
                data: elf::ELFDATA2LSB,
                version: elf::EV_CURRENT,
                os_abi: elf::ELFOSABI_SYSV,
                abi_version: 0,
                padding: [0; 7],
            },
            e_type: U16::new(LE, e_type),
            e_machine: U16::new(LE, machine),
            e_version: U32::new(LE, u32::from(elf::EV_CURRENT)),
            e_entry: U64::new(LE, 0),
            e_phoff: U64::new(LE, 64),
            e_shoff: U64::new(LE, shoff),
            e_flags: U32::new(LE, 0),
            e_ehsize: U16::new(LE, 64),
            e_phentsize: U16::new(LE, 56),
            e_phnum: U16::new(LE, 1),
            e_shentsize: U16::new(LE, 64),
            e_shnum: U16::new(LE, headers.len() as u16),
            e_shstrndx: U16::new(LE, headers.len() as u16 - 1),
        };
        out[..64].copy_from_slice(bytes_of(&header));
        let segment = elf::ProgramHeader64 {
            p_type: U32::new(LE, elf::PT_DYNAMIC),
            p_flags: U32::new(LE, elf::PF_R),
            p_offset: U64::new(LE, dynamic_at.0),
            p_vaddr: U64::new(LE, dynamic_at.0),
            p_paddr: U64::new(LE, dynamic_at.0),
            p_filesz: U64::new(LE, dynamic_at.1),
            p_memsz: U64::new(LE, dynamic_at.1),
            p_align: U64::new(LE, 8),
        };
        out[64..64 + 56].copy_from_slice(bytes_of(&segment));
        out
    }

    /// What scripts/build-portable's libvcuda.so asks for (its kind, not its exact list).
    fn portable() -> Vec<u8> {
        fixture(
            &[
                "libdl.so.2",
                "libpthread.so.0",
                "libc.so.6",
                "ld-linux-x86-64.so.2",
            ],
            &[
                ("libpthread.so.0", &["GLIBC_2.2.5", "GLIBC_2.3.2"]),
                (
                    "libc.so.6",
                    &["GLIBC_2.2.5", "GLIBC_2.14", "GLIBC_2.3.4", "GLIBC_2.17"],
                ),
                ("ld-linux-x86-64.so.2", &["GLIBC_2.3"]),
            ],
        )
    }

    fn lib() -> &'static Path {
        Path::new("/opt/vcuda/libvcuda.so")
    }

    #[test]
    fn a_library_within_the_baseline_is_accepted() {
        let r = check(lib(), &portable(), DEFAULT).unwrap();
        assert_eq!(r.highest.as_deref(), Some("GLIBC_2.17"));
        assert_eq!(
            r.needed,
            [
                "libdl.so.2",
                "libpthread.so.0",
                "libc.so.6",
                "ld-linux-x86-64.so.2"
            ]
        );
        assert_eq!(r.summary(), "needs at most GLIBC_2.17");
        // compared as numbers, not as text: 2.14 is newer than 2.3.4, older than 2.17
        let r = check(
            lib(),
            &fixture(
                &["libc.so.6"],
                &[("libc.so.6", &["GLIBC_2.14", "GLIBC_2.3.4", "GLIBC_2.2.5"])],
            ),
            DEFAULT,
        )
        .unwrap();
        assert_eq!(r.highest.as_deref(), Some("GLIBC_2.14"));
    }

    #[test]
    fn newer_glibc_versions_are_refused_each_named_once_with_the_fix() {
        let bytes = fixture(
            &["libm.so.6", "libc.so.6"],
            &[
                ("libm.so.6", &["GLIBC_2.29", "GLIBC_2.2.5"]),
                (
                    "libc.so.6",
                    &["GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.29", "GLIBC_2.18"],
                ),
            ],
        );
        let e = check(lib(), &bytes, DEFAULT).unwrap_err();
        let BaselineError::OutsideBaseline {
            newer, unexpected, ..
        } = &e
        else {
            panic!("{e}")
        };
        assert_eq!(newer, &["GLIBC_2.18", "GLIBC_2.29", "GLIBC_2.34"]);
        assert!(unexpected.is_empty());
        let m = e.to_string();
        for part in [
            "/opt/vcuda/libvcuda.so",
            "requires GLIBC_2.18, GLIBC_2.29, GLIBC_2.34",
            "glibc is 2.17",
            "scripts/build-portable",
            "target/portable/libvcuda.so",
            "--library-baseline 2.34",
        ] {
            assert!(m.contains(part), "{part:?} not in {m}");
        }
        // no baseline to offer for a three-part version (--library-baseline is MAJOR.MINOR)
        let e = check(
            lib(),
            &fixture(&[], &[("libc.so.6", &["GLIBC_2.3.4"])]),
            (2, 3),
        );
        assert!(!e
            .unwrap_err()
            .to_string()
            .contains("--library-baseline 2.3.4"));
        // a patch release of the baseline is newer than it
        let e = check(
            lib(),
            &fixture(&["libc.so.6"], &[("libc.so.6", &["GLIBC_2.17.1"])]),
            DEFAULT,
        );
        assert!(
            matches!(e, Err(BaselineError::OutsideBaseline { newer, .. }) if newer == ["GLIBC_2.17.1"])
        );
    }

    #[test]
    fn only_glibcs_own_shared_objects_may_be_needed() {
        let bytes = fixture(
            &["libgcc_s.so.1", "libc.so.6", "libstdc++.so.6"],
            &[("libc.so.6", &["GLIBC_2.2.5"])],
        );
        let e = check(lib(), &bytes, DEFAULT).unwrap_err();
        assert!(
            matches!(&e, BaselineError::OutsideBaseline { newer, unexpected, .. }
                if newer.is_empty() && unexpected == &["libgcc_s.so.1", "libstdc++.so.6"]),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(
            m.contains("needs libgcc_s.so.1, libstdc++.so.6, which are not part of glibc"),
            "{m}"
        );
        assert!(m.contains("scripts/build-portable"), "{m}");
        // a newer baseline would not help: not offered
        assert!(!m.contains("--library-baseline 2"), "{m}");
        // both problems at once: both named, in one message
        let bytes = fixture(&["libgcc_s.so.1"], &[("libc.so.6", &["GLIBC_2.34"])]);
        let m = check(lib(), &bytes, DEFAULT).unwrap_err().to_string();
        assert!(
            m.contains("requires GLIBC_2.34 and needs libgcc_s.so.1, which is not part of glibc"),
            "{m}"
        );
    }

    #[test]
    fn a_newer_baseline_accepts_what_it_covers_and_no_more() {
        let bytes = fixture(
            &["libc.so.6"],
            &[("libc.so.6", &["GLIBC_2.2.5", "GLIBC_2.34"])],
        );
        let r = check(lib(), &bytes, (2, 34)).unwrap();
        assert_eq!(r.highest.as_deref(), Some("GLIBC_2.34"));
        assert!(check(lib(), &bytes, (2, 33)).is_err());
        assert!(check(lib(), &bytes, (3, 0)).is_ok());
    }

    #[test]
    fn only_numbered_glibc_versions_are_compared() {
        // as tests/portable's rule: GLIBC_PRIVATE, other libraries' versions and malformed
        // names are not glibc releases
        let bytes = fixture(
            &["libc.so.6"],
            &[
                (
                    "libc.so.6",
                    &[
                        "GLIBC_PRIVATE",
                        "GLIBC_2",
                        "GLIBC_2.3.4.5",
                        "GLIBC_+2.99",
                        "GLIBC_2.x",
                    ],
                ),
                ("libgcc_s.so.1", &["GCC_3.0", "GCC_4.2.0"]),
            ],
        );
        let r = check(lib(), &bytes, DEFAULT).unwrap();
        assert_eq!(r.highest, None);
        assert_eq!(r.summary(), "needs no GLIBC symbol version");
        // nor is any section required: a library needing no versions loads anywhere
        let r = check(lib(), &fixture(&["libc.so.6"], &[]), DEFAULT).unwrap();
        assert_eq!((r.highest, r.needed), (None, vec!["libc.so.6".to_string()]));
        // absurdly large numbers are newer, not ignored
        let bytes = fixture(&["libc.so.6"], &[("libc.so.6", &["GLIBC_99999999999.0"])]);
        assert!(check(lib(), &bytes, DEFAULT).is_err());
    }

    /// A real linker's output: this test binary, built against the build host's glibc
    /// (Debian 12: 2.36, so GLIBC_2.34 at least) by Rust's toolchain (so libgcc_s).
    #[test]
    fn this_hosts_build_is_refused() {
        let exe = std::env::current_exe().unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        let e = check(&exe, &bytes, DEFAULT).unwrap_err();
        let BaselineError::OutsideBaseline {
            newer, unexpected, ..
        } = &e
        else {
            panic!("{e}")
        };
        assert!(newer.iter().any(|v| v == "GLIBC_2.34"), "{e}");
        assert!(unexpected.iter().any(|n| n == "libgcc_s.so.1"), "{e}");
        assert!(e.to_string().contains(&exe.display().to_string()));
    }

    #[test]
    fn what_is_not_an_x86_64_elf_shared_object_is_refused_by_name() {
        let good = portable();
        let cases: [(&str, Vec<u8>); 5] = [
            ("a script", b"#!/bin/sh\necho hi\n".to_vec()),
            ("empty", Vec::new()),
            ("truncated", good[..good.len() - 40].to_vec()),
            (
                "an executable",
                fixture_of(elf::ET_EXEC, elf::EM_X86_64, &["libc.so.6"], &[]),
            ),
            (
                "for arm64",
                fixture_of(elf::ET_DYN, elf::EM_AARCH64, &["libc.so.6"], &[]),
            ),
        ];
        for (what, bytes) in cases {
            let e = check(lib(), &bytes, DEFAULT).unwrap_err();
            assert!(matches!(e, BaselineError::NotElf { .. }), "{what}: {e:?}");
            let m = e.to_string();
            assert!(
                m.contains("/opt/vcuda/libvcuda.so") && m.contains("scripts/build-portable"),
                "{what}: {m}"
            );
        }
        let why = |bytes: &[u8]| match check(lib(), bytes, DEFAULT) {
            Err(BaselineError::NotElf { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            why(&fixture_of(
                elf::ET_EXEC,
                elf::EM_X86_64,
                &["libc.so.6"],
                &[]
            )),
            ElfError::NotShared {
                e_type: elf::ET_EXEC
            }
        );
        assert_eq!(
            why(&fixture_of(
                elf::ET_DYN,
                elf::EM_AARCH64,
                &["libc.so.6"],
                &[]
            )),
            ElfError::Machine {
                machine: elf::EM_AARCH64
            }
        );
        assert!(matches!(why(b"#!/bin/sh\n"), ElfError::Header(_)));
        let e = BaselineError::Unreadable {
            path: lib().into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert!(e
            .to_string()
            .contains("cannot read the library /opt/vcuda/libvcuda.so"));
    }

    #[test]
    fn baselines_parse_as_major_dot_minor() {
        assert_eq!(parse_version("2.17"), Some((2, 17)));
        assert_eq!(parse_version("2.34"), Some((2, 34)));
        for bad in [
            "", "2", "2.", ".17", "2.17.1", "+2.17", "2.x", "off", " 2.17",
        ] {
            assert_eq!(parse_version(bad), None, "{bad:?}");
        }
    }

    proptest::proptest! {
        /// Whatever the file holds, the check answers and never panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = check(lib(), &bytes, DEFAULT);
        }

        /// Nor does a real-looking file with some bytes changed (past the magic, where
        /// arbitrary bytes rarely get): offsets, counts and links pointing anywhere.
        #[test]
        fn corrupted_libraries_never_panic(
            edits in proptest::collection::vec((proptest::num::usize::ANY, proptest::num::u8::ANY), 1..8),
            cut in proptest::option::of(proptest::num::usize::ANY),
        ) {
            let mut bytes = portable();
            for (at, b) in edits {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut % (bytes.len() + 1));
            }
            let _ = check(lib(), &bytes, DEFAULT);
        }
    }
}
