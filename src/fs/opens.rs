//! Open files: the handle table, and how each inode is open (passthrough or not).
//!
//! The kernel requires every open of an inode already open in passthrough to be passthrough
//! with the same backing file, and refuses passthrough while it is open any other way; it
//! fails the open with EIO otherwise. So the first open of an inode decides and the others
//! follow until the last is released. Registering a backing file is the kernel's business, so
//! it is asked through [`OpenReply`], which tests fake.

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use dashmap::DashMap;
use dashmap::mapref::one::Ref;

use super::error::FsError;
use crate::stager::Opened;

/// How an open is answered: the FUSE reply, or a test's stand-in for it.
pub trait OpenReply: Send + 'static {
    /// What the kernel hands back for a registered backing file.
    type Backing: Send + Sync + 'static;
    /// Registers `file` with the kernel as the backing file of a passthrough open.
    fn open_backing(&self, file: &File) -> std::io::Result<Self::Backing>;
    /// Grants handle `fh`, in passthrough to `backing` if given.
    fn opened(self, fh: u64, backing: Option<&Self::Backing>);
    fn error(self, error: FsError);
}

pub struct Handle<B> {
    /// A file read through from SOURCE is checked at each read to be still the version
    /// catalogued, so a file changed in place while open is never served mixed.
    pub opened: Opened,
    /// Shared by the inode's passthrough handles: the kernel reads that file directly.
    backing: Option<Arc<B>>,
}

/// How an inode is open.
struct InodeOpens<B> {
    /// Handles answered with passthrough, and their backing file.
    passthrough: usize,
    backing: Option<Arc<B>>,
    /// Handles answered without: their reads come to the daemon.
    plain: usize,
}

impl<B> Default for InodeOpens<B> {
    fn default() -> Self {
        InodeOpens {
            passthrough: 0,
            backing: None,
            plain: 0,
        }
    }
}

pub struct Opens<B> {
    handles: DashMap<u64, Handle<B>>,
    /// Inodes with open handles, by inode number.
    inodes: DashMap<u64, InodeOpens<B>>,
    next_handle: AtomicU64,
    /// Decided at init from the kernel's capabilities, turned off for good if the kernel
    /// refuses a backing file (e.g. not privileged). Shared with the statistics.
    passthrough: Arc<AtomicBool>,
}

impl<B: Send + Sync + 'static> Opens<B> {
    pub fn new() -> Opens<B> {
        Opens {
            handles: DashMap::new(),
            inodes: DashMap::new(),
            next_handle: AtomicU64::new(1),
            passthrough: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn passthrough(&self) -> &Arc<AtomicBool> {
        &self.passthrough
    }

    /// Grants a handle on `opened` for inode `ino` and answers `reply` with it.
    pub fn grant<R: OpenReply<Backing = B>>(&self, ino: u64, opened: Opened, reply: R) {
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        // Held until the reply is sent, so opens of one inode decide in turn.
        let mut inode = self.inodes.entry(ino).or_default();
        let backing = if let Some(b) = &inode.backing {
            // Already open in passthrough: this open must be too, whether the stager found the
            // file cached or not (the backing file is the verified cached copy).
            Some(b.clone())
        } else if let Opened::Cache(copy) = &opened
            && inode.plain == 0
            && self.passthrough.load(Ordering::Relaxed)
        {
            // Registered by the copy's first open, and kept with the copy for the next ones.
            match copy.registration(|file| reply.open_backing(file)) {
                Ok(b) => Some(b),
                Err(e) => {
                    if self.passthrough.swap(false, Ordering::SeqCst) {
                        log::warn!(
                            "kernel refused a passthrough backing file ({e}); serving cache hits with pread from now on"
                        );
                    }
                    None
                }
            }
        } else {
            None
        };
        match &backing {
            Some(b) => {
                inode.passthrough += 1;
                inode.backing = Some(b.clone());
            }
            None => inode.plain += 1,
        }
        // Registered before the kernel learns the handle: its first read may come at once, on
        // another thread.
        self.handles.insert(fh, Handle { opened, backing });
        let handle = self.handles.get(&fh).expect("just inserted");
        reply.opened(fh, handle.backing.as_deref());
        drop(handle);
        drop(inode);
    }

    pub fn get(&self, fh: u64) -> Option<Ref<'_, u64, Handle<B>>> {
        self.handles.get(&fh)
    }

    /// Forgets handle `fh` of inode `ino`; the inode's last release frees its way of opening.
    pub fn release(&self, ino: u64, fh: u64) {
        let Some((_, handle)) = self.handles.remove(&fh) else {
            return;
        };
        let closed = self.inodes.get_mut(&ino).is_some_and(|mut inode| {
            if handle.backing.is_some() {
                inode.passthrough = inode.passthrough.saturating_sub(1);
                if inode.passthrough == 0 {
                    inode.backing = None;
                }
            } else {
                inode.plain = inode.plain.saturating_sub(1);
            }
            inode.passthrough == 0 && inode.plain == 0
        });
        if closed {
            self.inodes
                .remove_if(&ino, |_, i| i.passthrough == 0 && i.plain == 0);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::cache::OpenCopy;
    use std::sync::mpsc;

    /// A backing file as a test sees it: which registration made it.
    #[derive(Debug, PartialEq, Eq)]
    pub struct FakeBacking(pub u32);

    /// What a fake reply was answered with: the handle and its backing's number, or an errno.
    pub type Answer = Result<(u64, Option<u32>), i32>;

    /// Stands in for the kernel's reply: registers backings (numbered from `next`) unless
    /// told to fail, and sends its answer down a channel.
    pub struct FakeReply {
        pub answer: mpsc::Sender<Answer>,
        pub refuse_backing: bool,
        pub next: Arc<AtomicU64>,
    }

    impl OpenReply for FakeReply {
        type Backing = FakeBacking;
        fn open_backing(&self, _file: &File) -> std::io::Result<FakeBacking> {
            if self.refuse_backing {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
            Ok(FakeBacking(self.next.fetch_add(1, Ordering::SeqCst) as u32))
        }
        fn opened(self, fh: u64, backing: Option<&FakeBacking>) {
            let _ = self.answer.send(Ok((fh, backing.map(|b| b.0))));
        }
        fn error(self, error: FsError) {
            let _ = self.answer.send(Err(error.errno()));
        }
    }

    /// Grants an open of `ino` on a fresh temporary file, as the stager would answer it;
    /// registrations are numbered from `ino` * 100.
    fn grant(opens: &Opens<FakeBacking>, ino: u64, from_cache: bool, refuse: bool) -> Answer {
        let file = tempfile::tempfile().unwrap();
        let opened = if from_cache {
            Opened::Cache(Arc::new(OpenCopy::new(file)))
        } else {
            Opened::Source(file)
        };
        grant_opened(
            opens,
            ino,
            opened,
            refuse,
            &Arc::new(AtomicU64::new(ino * 100)),
        )
    }

    /// Grants an open of `ino` on `opened`, numbering registrations from `next`.
    fn grant_opened(
        opens: &Opens<FakeBacking>,
        ino: u64,
        opened: Opened,
        refuse: bool,
        next: &Arc<AtomicU64>,
    ) -> Answer {
        let (tx, rx) = mpsc::channel();
        let reply = FakeReply {
            answer: tx,
            refuse_backing: refuse,
            next: next.clone(),
        };
        opens.grant(ino, opened, reply);
        rx.recv().unwrap()
    }

    fn passthrough_opens() -> Opens<FakeBacking> {
        let opens = Opens::new();
        opens.passthrough.store(true, Ordering::SeqCst);
        opens
    }

    #[test]
    fn later_opens_share_the_first_backing_even_when_not_cached() {
        let opens = passthrough_opens();
        let (fh1, b1) = grant(&opens, 5, true, false).unwrap();
        assert_eq!(b1, Some(500));
        // Answered from SOURCE, and a registration that would fail: still the same backing.
        let (fh2, b2) = grant(&opens, 5, false, true).unwrap();
        assert_eq!(b2, Some(500));
        assert_ne!(fh1, fh2);
        assert!(
            opens.passthrough.load(Ordering::SeqCst),
            "nothing was asked"
        );
        // Another inode decides on its own.
        assert_eq!(grant(&opens, 6, true, false).unwrap().1, Some(600));
        opens.release(5, fh1);
        assert_eq!(grant(&opens, 5, false, false).unwrap().1, Some(500));
    }

    #[test]
    fn a_copy_kept_open_is_registered_once_for_all_its_opens() {
        let opens = passthrough_opens();
        let registrations = Arc::new(AtomicU64::new(1));
        let copy = Arc::new(OpenCopy::new(tempfile::tempfile().unwrap()));
        let reopen = |opens: &Opens<FakeBacking>| {
            let opened = Opened::Cache(copy.clone());
            let (fh, backing) = grant_opened(opens, 7, opened, false, &registrations).unwrap();
            opens.release(7, fh);
            backing
        };
        assert_eq!(reopen(&opens), Some(1));
        // Released in between, so the inode was no longer open: the copy's registration
        // still serves, and no other is made.
        assert_eq!(reopen(&opens), Some(1));
        assert_eq!(reopen(&opens), Some(1));
        assert_eq!(registrations.load(Ordering::SeqCst), 2);
        // Another copy of the same file (staged again after an eviction) is registered anew.
        let restaged = Opened::Cache(Arc::new(OpenCopy::new(tempfile::tempfile().unwrap())));
        let (_, backing) = grant_opened(&opens, 7, restaged, false, &registrations).unwrap();
        assert_eq!(backing, Some(2));
    }

    #[test]
    fn a_plain_open_blocks_passthrough_until_released() {
        let opens = passthrough_opens();
        let (plain, b) = grant(&opens, 3, false, false).unwrap();
        assert_eq!(b, None);
        let (cached, b) = grant(&opens, 3, true, false).unwrap();
        assert_eq!(b, None, "the inode is open without passthrough");
        opens.release(3, plain);
        assert_eq!(grant(&opens, 3, true, false).unwrap().1, None);
        opens.release(3, cached);
        opens.release(3, cached);
        // Released twice: counted once. One plain handle is still open.
        assert_eq!(grant(&opens, 3, true, false).unwrap().1, None);
        assert_eq!(opens.inodes.get(&3).unwrap().plain, 2);
    }

    #[test]
    fn the_last_release_frees_the_inode() {
        let opens = passthrough_opens();
        let (a, _) = grant(&opens, 9, true, false).unwrap();
        let (b, _) = grant(&opens, 9, true, false).unwrap();
        opens.release(9, a);
        assert!(opens.inodes.contains_key(&9));
        opens.release(9, b);
        assert!(!opens.inodes.contains_key(&9));
        assert!(opens.get(b).is_none());
        assert_eq!(grant(&opens, 9, false, false).unwrap().1, None);
    }

    #[test]
    fn a_refused_backing_turns_passthrough_off_for_good() {
        let opens = passthrough_opens();
        let (fh, b) = grant(&opens, 4, true, true).unwrap();
        assert_eq!(b, None);
        assert!(!opens.passthrough.load(Ordering::SeqCst));
        assert!(matches!(opens.get(fh).unwrap().opened, Opened::Cache(_)));
        // Other inodes, and this one once released, are no longer offered to the kernel.
        assert_eq!(grant(&opens, 8, true, false).unwrap().1, None);
        opens.release(4, fh);
        assert_eq!(grant(&opens, 4, true, false).unwrap().1, None);
    }

    #[test]
    fn without_passthrough_every_open_is_plain() {
        let opens = Opens::<FakeBacking>::new();
        assert_eq!(grant(&opens, 1, true, false).unwrap().1, None);
    }
}
