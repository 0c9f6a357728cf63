//! What the kernel recorded about a Unix socket's peer (its credentials and groups when it
//! connected) and whether it has hung up: the control channel decides with these, never
//! with what a client says about itself.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

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

/// Most descriptors one message carries (the kernel's SCM_MAX_FD).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

/// Room for a control message of [`MAX_FDS_PER_MESSAGE`] descriptors (CMSG_SPACE(253 * 4) is
/// 1,032 bytes on 64-bit Linux), aligned as cmsghdr requires: on the stack, so a forked
/// child can send without allocating.
#[repr(C, align(8))]
struct FdsControl([u8; 1040]);

/// Sends `bytes` on a connected Unix socket with `fds` attached to them (SCM_RIGHTS; at most
/// [`MAX_FDS_PER_MESSAGE`]); returns how many bytes went. The descriptors travel with the
/// first byte, so a partial send still delivers them all; the caller sends the rest plainly.
/// Allocates nothing (a forked child's answer uses it).
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS_PER_MESSAGE || bytes.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut control = FdsControl([0; 1040]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * std::mem::size_of::<libc::c_int>()) as u32;
        msg.msg_control = control.0.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a size (at most the buffer's, for 253 fds).
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload) } as _;
        // SAFETY: the control buffer holds CMSG_SPACE(payload) bytes, 8-aligned, so the first
        // header and its `payload` bytes of data fit in it.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(payload) as _;
            let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: msg points at the live iovec and control buffer above.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    super::check(sent as libc::c_long).map(|n| n as usize)
}

/// Receives what has arrived on a Unix socket into `buf`, with the descriptors attached to it
/// (close-on-exec, owned by the caller): (bytes read, descriptors). More than `max_fds`
/// attached is an error, the descriptors received closed.
pub fn recv_with_fds(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let max_fds = max_fds.clamp(1, MAX_FDS_PER_MESSAGE);
    let mut control = FdsControl([0; 1040]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size (at most the buffer's).
    msg.msg_controllen = unsafe { libc::CMSG_SPACE((max_fds * 4) as u32) } as _;
    // SAFETY: msg points at live buffers of the sizes it states.
    let read = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let read = super::check(read as libc::c_long)? as usize;
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with well-formed headers up to msg_controllen;
    // each SCM_RIGHTS header's data is that many descriptors, now ours.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
                for i in 0..bytes / 4 {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("more descriptors than asked for"));
    }
    Ok((read, fds))
}
