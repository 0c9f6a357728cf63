//! Reading the text files a user names on the command line (`--order-file`, `--list-file`).
//!
//! They are read whole, so a path that never ends (`/dev/zero`, a terminal, another device)
//! would grow memory until the daemon dies: such paths are refused up front. Regular files
//! and pipes (`--order-file <(python dump_order.py)`) are read.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// The whole content of `path`, which must be a regular file or a pipe.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let kind = file.metadata()?.file_type();
    if !(kind.is_file() || kind.is_fifo()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it is a device or socket, not a file: give a file or a pipe",
        ));
    }
    let mut out = Vec::new();
    file.read_to_end(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_pipes_are_read_devices_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("order.txt");
        std::fs::write(&file, "3\n1\n").unwrap();
        assert_eq!(read(&file).unwrap(), b"3\n1\n");
        for device in ["/dev/zero", "/dev/null"] {
            let err = read(Path::new(device)).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{device}");
        }
        let fifo = dir.path().join("fifo");
        crate::sys::mkfifo(&fifo, 0o600).unwrap();
        let writer = std::thread::spawn({
            let fifo = fifo.clone();
            move || std::fs::write(fifo, "7\n").unwrap()
        });
        assert_eq!(read(&fifo).unwrap(), b"7\n");
        writer.join().unwrap();
    }
}
