//! What the kernel recorded about a Unix socket's peer (its credentials and groups when it
//! connected) and whether it has hung up: the control channel decides with these, never
//! with what a client says about itself.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The credentials of a Unix socket's peer as the kernel recorded them when it connected
/// (SO_PEERCRED): (pid, uid, gid). Nothing the peer does later changes them.
pub fn peer_credentials(socket: BorrowedFd<'_>) -> io::Result<(u32, u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd and an out buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid, cred.gid))
}

/// The supplementary groups of a Unix socket's peer when it connected (SO_PEERGROUPS),
/// sorted and without duplicates.
pub fn peer_groups(socket: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // Linux allows 65536 groups; start small and grow to what the kernel asks for.
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        // SAFETY: a valid socket fd and an out buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = len as usize / 4;
        match rc {
            0 => {
                groups.truncate(needed);
                groups.sort_unstable();
                groups.dedup();
                return Ok(groups);
            }
            _ if io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE)
                && needed > groups.len() =>
            {
                groups.resize(needed, 0);
            }
            _ => return Err(io::Error::last_os_error()),
        }
    }
}

/// Whether the other end of a connected socket has closed it (both directions: a client
/// that only stopped sending still waits for its answer).
pub fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let mut poll = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and a zero timeout: it only reports.
    let rc = unsafe { libc::poll(&mut poll, 1, 0) };
    rc > 0 && poll.revents & (libc::POLLHUP | libc::POLLERR) != 0
}
