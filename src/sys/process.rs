//! The process and its relatives: processes held by pidfd (so neither a signal nor a wait
//! reaches another process that got a pid after its holder exited), the termination signals
//! taken synchronously, a daemon detached into its own session, the descriptor limit, the
//! allocator's tuning and thread ids.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::check;

/// The process's descriptor limits (RLIMIT_NOFILE), if they can be read.
fn descriptor_limits() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// How many descriptors the process may open (the soft limit; 1024, Linux's default, if it
/// cannot be read).
pub fn descriptor_limit() -> usize {
    descriptor_limits().map_or(1024, |l| usize::try_from(l.rlim_cur).unwrap_or(usize::MAX))
}

/// Raises the soft descriptor limit to the hard one, as far as the daemon needs: it keeps
/// cached copies open between opens (the default soft limit, often 1024, would keep few).
pub fn raise_descriptor_limit() {
    if let Some(mut limit) = descriptor_limits()
        && limit.rlim_cur < limit.rlim_max
    {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads the struct we own; a refusal leaves the limit as it was.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}

/// The fields of a `/proc/PID/stat` line after the command name (state first), which is in
/// parentheses and may itself hold spaces and parentheses.
pub fn proc_stat_fields(stat: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
    let after_name = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    Some(after_name.split(|&b| b == b' ').filter(|f| !f.is_empty()))
}

/// Waits at most `timeout` for `fd` to become readable (a pidfd: its process exited); whether
/// it did.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one pollfd we own.
    check(unsafe { libc::poll(&mut poll, 1, millis) } as _).map(|n| n > 0)
}

/// A descriptor of process `pid` (pidfd_open(2), Linux 5.3): it names that process even
/// after it exits and its pid goes to another.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open has no memory arguments.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends `signal` (0: none, only whether it still runs) to the process of `pidfd`.
pub fn pidfd_signal(pidfd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    let no_info = std::ptr::null::<libc::siginfo_t>();
    // SAFETY: a pidfd, a signal number and no siginfo.
    check(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            no_info,
            0,
        )
    })
    .map(drop)
}

/// The termination signals (SIGTERM, SIGINT, SIGHUP), blocked in the thread that made this
/// and in every thread started after it, so that one thread takes them synchronously.
pub struct TerminationSignals(libc::sigset_t);

impl TerminationSignals {
    /// Blocks them in this thread (and so in the threads it starts from now on).
    pub fn block() -> TerminationSignals {
        // SAFETY: sigset_t is plain data, for which all zeroes is a valid value.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid sigset_t owned here.
        unsafe { libc::sigemptyset(&mut set) };
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            // SAFETY: a valid sigset_t and a valid signal number.
            unsafe { libc::sigaddset(&mut set, s) };
        }
        // SAFETY: a valid set; the previous mask is not wanted.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        TerminationSignals(set)
    }

    /// Waits at most `timeout` for one of them; its number, or None if none came.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<i32> {
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a valid signal set and timeout; no siginfo wanted.
        let signal = unsafe { libc::sigtimedwait(&self.0, std::ptr::null_mut(), &timeout) };
        (signal > 0).then_some(signal)
    }

    /// Waits for one of them; its number, or None if the wait failed.
    pub fn wait(&self) -> Option<i32> {
        let mut signal = 0;
        // SAFETY: a valid signal set and out pointer.
        (unsafe { libc::sigwait(&self.0, &mut signal) } == 0).then_some(signal)
    }
}

/// Restores SIGPIPE's default disposition (Rust ignores it), so a write to a pipe whose
/// reader went away ends the process quietly. Call it before any other thread exists.
pub fn restore_default_sigpipe() {
    // SAFETY: restoring a default disposition; no handler is installed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Makes `cmd` start its program in a new session (setsid: no terminal's signals reach it)
/// with `keep` left open across exec, where it would otherwise be closed (close-on-exec).
/// `keep` must stay open until the command is spawned.
pub fn detach_keeping(cmd: &mut Command, keep: BorrowedFd<'_>) {
    let fd = keep.as_raw_fd();
    let detach = move || {
        // SAFETY: setsid has no memory arguments; it only fails if already a group leader.
        unsafe { libc::setsid() };
        // SAFETY: fcntl on the descriptor this child inherited.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) };
        Ok(())
    };
    // SAFETY: the closure makes only async-signal-safe calls between fork and exec.
    unsafe { cmd.pre_exec(detach) };
}

/// The descriptor this process inherited under the number the environment variable `var`
/// holds (a pipe its parent left open for it, see [`detach_keeping`]); None if there is no
/// such number. Taken at most once in the process's life, so it has one owner.
pub fn inherited_fd(var: &str) -> Option<OwnedFd> {
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let fd: RawFd = std::env::var(var).ok()?.parse().ok()?;
    if fd < 0 || TAKEN.swap(true, Ordering::SeqCst) {
        return None;
    }
    // SAFETY: the parent created this descriptor for this process and named it in `var`;
    // nothing else here owns it (it is taken once, and nothing else reads `var`).
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Keeps allocations of at least `bytes` in their own mappings, returned to the system when
/// freed (glibc otherwise raises its threshold after the first large free and keeps later
/// large buffers in per-thread arenas).
pub fn set_mmap_threshold(bytes: i32) {
    // SAFETY: mallopt only tunes the allocator.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) };
}

/// The calling thread's id (the kernel's, as a FUSE request names its caller).
pub fn thread_id() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}
