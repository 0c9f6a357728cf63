//! Who the caller is, and this thread acting as them.
//!
//! A FUSE request carries only uid, gid and pid: the supplementary groups come from
//! `/proc/<pid>/status`. Acting as the caller is per thread: only the FUSE thread answering
//! takes on the caller's fsuid, fsgid and groups (raw syscalls: Linux credentials are per
//! thread, and glibc's `setgroups` would change every thread of the daemon), and restores its
//! own before anything else runs on it, or aborts the daemon, which must never go on as
//! someone else. Kept apart from [`super::access`] so the unsafe calls that change
//! credentials sit in one small place.

use std::io;

use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("{call}: {source}")]
    Call {
        call: &'static str,
        source: io::Error,
    },
    #[error("{call} did not take (still {now})")]
    NotTaken { call: &'static str, now: u32 },
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StatusError {
    #[error("no {0} line")]
    Missing(&'static str),
    #[error("malformed {0} line")]
    Malformed(&'static str),
}

/// The fields of `/proc/<pid>/status` a decision needs.
#[derive(Debug, PartialEq, Eq)]
pub struct Status {
    pub tgid: u32,
    pub fsuid: u32,
    pub fsgid: u32,
    /// Supplementary groups, sorted.
    pub groups: Vec<u32>,
}

/// Parses `/proc/<pid>/status`. `Uid:`/`Gid:` list real, effective, saved and fs ids; the fs
/// ones are what permission checks use, and what a FUSE request carries.
pub fn parse_status(text: &[u8]) -> Result<Status, StatusError> {
    let mut tgid = None;
    let mut fsuid = None;
    let mut fsgid = None;
    let mut groups = None;
    for line in text.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (key, rest) = (&line[..colon], &line[colon + 1..]);
        let numbers = || {
            rest.split(|b| b.is_ascii_whitespace())
                .filter(|w| !w.is_empty())
                .map(|w| std::str::from_utf8(w).ok()?.parse::<u32>().ok())
        };
        match key {
            b"Tgid" => {
                tgid = Some(
                    numbers()
                        .next()
                        .flatten()
                        .ok_or(StatusError::Malformed("Tgid"))?,
                )
            }
            b"Uid" => {
                fsuid = Some(
                    numbers()
                        .nth(3)
                        .flatten()
                        .ok_or(StatusError::Malformed("Uid"))?,
                )
            }
            b"Gid" => {
                fsgid = Some(
                    numbers()
                        .nth(3)
                        .flatten()
                        .ok_or(StatusError::Malformed("Gid"))?,
                )
            }
            b"Groups" => {
                let g: Option<Vec<u32>> = numbers().collect();
                groups = Some(g.ok_or(StatusError::Malformed("Groups"))?);
            }
            _ => {}
        }
    }
    let mut groups = groups.ok_or(StatusError::Missing("Groups"))?;
    groups.sort_unstable();
    groups.dedup();
    Ok(Status {
        tgid: tgid.ok_or(StatusError::Missing("Tgid"))?,
        fsuid: fsuid.ok_or(StatusError::Missing("Uid"))?,
        fsgid: fsgid.ok_or(StatusError::Missing("Gid"))?,
        groups,
    })
}

/// A caller's file-system identity: what SOURCE's permission checks look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    pub uid: u32,
    pub gid: u32,
    /// Sorted, without duplicates.
    pub groups: Vec<u32>,
}

#[cfg(test)]
impl Credential {
    /// A user whose primary group has its uid's number, in `groups`.
    pub(super) fn for_tests(uid: u32, groups: &[u32]) -> Credential {
        Credential {
            uid,
            gid: uid,
            groups: groups.to_vec(),
        }
    }
}

/// `/proc/<pid>/status`, read without `fs::read`'s extra stat: it is on every open of
/// another user.
pub(super) fn read_status(pid: u32) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(format!("/proc/{pid}/status"))?;
    let mut text = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        match file.read(&mut chunk) {
            Ok(0) => return Ok(text),
            Ok(n) => text.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// This thread's file-system credentials, as they were before [`AsCaller::enter`].
struct Saved {
    fsuid: u32,
    fsgid: u32,
    groups: Vec<u32>,
}

/// This thread, and only it, acting with a caller's fsuid, fsgid and groups until dropped.
pub(super) struct AsCaller {
    saved: Saved,
}

impl AsCaller {
    pub(super) fn enter(cred: &Credential) -> Result<AsCaller, SwitchError> {
        let saved = Saved {
            fsuid: sys::fsuid(),
            fsgid: sys::fsgid(),
            groups: groups_now()?,
        };
        // From here on, Drop restores whatever was changed.
        let guard = AsCaller { saved };
        // Groups and fsgid first: changing them needs CAP_SETGID, which leaving fsuid 0 keeps,
        // but the fsuid is the switch that drops the file capabilities.
        set_groups(&cred.groups)?;
        set_fsgid(cred.gid)?;
        set_fsuid(cred.uid)?;
        Ok(guard)
    }
}

impl Drop for AsCaller {
    fn drop(&mut self) {
        let restored = set_fsuid(self.saved.fsuid)
            .and_then(|()| set_fsgid(self.saved.fsgid))
            .and_then(|()| set_groups(&self.saved.groups));
        if let Err(e) = restored {
            // Going on would serve and stage as another user.
            log::error!("cannot restore the FUSE thread's credentials ({e}); aborting");
            std::process::abort();
        }
    }
}

/// setfsuid reports no error: the result is verified by reading it back.
fn set_fsuid(uid: u32) -> Result<(), SwitchError> {
    sys::set_fsuid(uid);
    match sys::fsuid() {
        now if now == uid => Ok(()),
        now => Err(SwitchError::NotTaken {
            call: "setfsuid",
            now,
        }),
    }
}

fn set_fsgid(gid: u32) -> Result<(), SwitchError> {
    sys::set_fsgid(gid);
    match sys::fsgid() {
        now if now == gid => Ok(()),
        now => Err(SwitchError::NotTaken {
            call: "setfsgid",
            now,
        }),
    }
}

/// Only this thread's groups (see [`sys::set_thread_groups`]).
fn set_groups(groups: &[u32]) -> Result<(), SwitchError> {
    sys::set_thread_groups(groups).map_err(|source| SwitchError::Call {
        call: "setgroups",
        source,
    })?;
    match groups_now()? {
        now if now == groups => Ok(()),
        now => Err(SwitchError::NotTaken {
            call: "setgroups",
            now: now.len() as u32,
        }),
    }
}

/// This thread's supplementary groups, sorted as the kernel keeps them.
fn groups_now() -> Result<Vec<u32>, SwitchError> {
    sys::thread_groups().map_err(|source| SwitchError::Call {
        call: "getgroups",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::access::check_on_source;
    use crate::sys;
    use std::os::fd::AsFd;
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};

    const STATUS: &[u8] =
        b"Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\n\
Pid:\t4243\nPPid:\t1\nTracerPid:\t0\nUid:\t1000\t1000\t1000\t1001\nGid:\t100\t100\t100\t101\n\
FDSize:\t64\nGroups:\t27 4 100 4 \nNStgid:\t4242\n";

    #[test]
    fn status_gives_tgid_fs_ids_and_sorted_groups() {
        assert_eq!(
            parse_status(STATUS),
            Ok(Status {
                tgid: 4242,
                fsuid: 1001,
                fsgid: 101,
                groups: vec![4, 27, 100],
            })
        );
    }

    #[test]
    fn empty_groups_line_is_no_groups() {
        let s = parse_status(b"Tgid:\t1\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\n").unwrap();
        assert!(s.groups.is_empty());
    }

    /// A status that cannot be understood must refuse, never mean "no groups".
    #[test]
    fn missing_or_malformed_lines_are_errors() {
        let without_groups = b"Tgid:\t1\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(
            parse_status(without_groups),
            Err(StatusError::Missing("Groups"))
        );
        let bad_group = b"Tgid:\t1\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t1 x\n";
        assert_eq!(
            parse_status(bad_group),
            Err(StatusError::Malformed("Groups"))
        );
        let short_uid = b"Tgid:\t1\nUid:\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\n";
        assert_eq!(parse_status(short_uid), Err(StatusError::Malformed("Uid")));
        assert_eq!(parse_status(b""), Err(StatusError::Missing("Groups")));
    }

    #[test]
    fn this_process_status_parses() {
        let s = parse_status(&read_status(std::process::id()).unwrap()).unwrap();
        assert_eq!(s.tgid, std::process::id());
    }

    /// Root only (CI runs as root): the switch changes this thread alone, SOURCE's kernel
    /// then answers for the caller, and everything is restored.
    #[test]
    fn switch_is_per_thread_and_restored() {
        if crate::sys::euid() != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"x").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = sys::open_directory(dir.path()).unwrap();
        let (before_uid, before_groups) = (sys::fsuid(), groups_now().unwrap());
        let nobody = Credential::for_tests(65534, &[]);
        let in_group_0 = Credential {
            uid: 65534,
            gid: 65534,
            groups: vec![0],
        };
        let (switched, main_sees) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            s.spawn(|| {
                let guard = AsCaller::enter(&nobody).unwrap();
                assert_eq!((sys::fsuid(), sys::fsgid()), (65534, 65534));
                switched.store(true, Ordering::SeqCst);
                while !main_sees.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                let e = check_on_source(root.as_fd(), Path::new("secret"), libc::R_OK).unwrap_err();
                assert_eq!(e.raw_os_error(), Some(libc::EACCES));
                check_on_source(root.as_fd(), Path::new(""), libc::R_OK | libc::X_OK).unwrap();
                drop(guard);
                assert_eq!(
                    (sys::fsuid(), groups_now().unwrap()),
                    (before_uid, before_groups.clone())
                );
                let _as_member = AsCaller::enter(&in_group_0).unwrap();
                check_on_source(root.as_fd(), Path::new("secret"), libc::R_OK).unwrap();
            });
            while !switched.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            // Meanwhile this thread is still itself.
            assert_eq!(
                (sys::fsuid(), groups_now().unwrap()),
                (before_uid, before_groups.clone())
            );
            main_sees.store(true, Ordering::SeqCst);
        });
        assert_eq!(sys::fsuid(), before_uid);
    }
}
