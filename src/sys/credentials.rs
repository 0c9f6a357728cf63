//! Whose credentials the process and its threads act with: the effective user, a user's uid
//! by name, and a FUSE thread's own file-system ids and groups, which it switches to a
//! caller's to check SOURCE's permissions as that caller (only that thread's change: the raw
//! system calls, not glibc's wrappers, which would change every thread's).

use std::ffi::CString;
use std::io;

use super::check;

/// The process's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the user named `name` in the password database, if there is one.
pub fn uid_of_user(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: passwd is plain data, for which all zeroes is a valid value.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a valid C string, an out struct, a buffer of the stated length for its strings
    // and an out pointer; all outlive the call.
    let rc = unsafe {
        libc::getpwnam_r(
            c.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some(entry.pw_uid)
}

/// This thread's file-system uid.
pub fn fsuid() -> u32 {
    // SAFETY: setfsuid with an invalid id (-1) changes nothing and returns the current fsuid.
    unsafe { libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 }
}

/// This thread's file-system gid.
pub fn fsgid() -> u32 {
    // SAFETY: setfsgid with an invalid id (-1) changes nothing and returns the current fsgid.
    unsafe { libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32 }
}

/// Asks for `uid` as this thread's file-system uid. setfsuid reports no error: read it back
/// with [`fsuid`] to know whether it was taken.
pub fn set_fsuid(uid: u32) {
    // SAFETY: setfsuid takes any id; it changes only this thread's credentials.
    unsafe { libc::syscall(libc::SYS_setfsuid, uid) };
}

/// Asks for `gid` as this thread's file-system gid (read it back with [`fsgid`]).
pub fn set_fsgid(gid: u32) {
    // SAFETY: setfsgid takes any id; it changes only this thread's credentials.
    unsafe { libc::syscall(libc::SYS_setfsgid, gid) };
}

/// Sets this thread's supplementary groups (the raw system call: glibc's wrapper would set
/// the groups of every thread).
pub fn set_thread_groups(groups: &[u32]) -> io::Result<()> {
    // SAFETY: a valid array of `groups.len()` gid_t; only this thread's credentials change.
    check(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) }).map(drop)
}

/// This thread's supplementary groups, sorted as the kernel keeps them.
pub fn thread_groups() -> io::Result<Vec<u32>> {
    // SAFETY: a size of 0 asks only for the count; the pointer is not used.
    let count =
        check(unsafe { libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<u32>()) })?;
    let mut groups = vec![0u32; count as usize];
    // SAFETY: a buffer of `groups.len()` gid_t; this thread alone changes its groups.
    let n =
        check(unsafe { libc::syscall(libc::SYS_getgroups, groups.len(), groups.as_mut_ptr()) })?;
    groups.truncate(n as usize);
    Ok(groups)
}
