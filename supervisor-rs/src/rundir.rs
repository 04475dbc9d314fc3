//! The private run directory (0700) and the one listening socket (0600) inside it.
//!
//! Nothing of a serve may stay in the file system: the directory is removed as soon as
//! every child has connected (established connections do not need the path), and again,
//! idempotently, on every exit path through `Drop`. Only a SIGKILL during start-up can
//! leave one behind; the next supervisor removes such leftovers (`sweep_stale`).

use std::collections::hash_map::RandomState;
use std::fs::{self, DirBuilder, Permissions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const PREFIX: &str = "loom-";
const SOCKET_NAME: &str = "sup.sock";
/// `sun_path` holds 108 bytes including the NUL.
const MAX_SOCKET_PATH: usize = 100;

pub struct RunDir {
    path: PathBuf,
    socket: PathBuf,
    removed: bool,
}

impl RunDir {
    /// Creates `<base>/loom-<pid>-<random>` and binds the socket in it, where `<base>` is
    /// `$XDG_RUNTIME_DIR` when usable, else the temp dir.
    pub fn create() -> Result<(RunDir, UnixListener)> {
        let base = base_dir();
        sweep_stale(&base);
        let mut last_err = None;
        for _ in 0..8 {
            let path = base.join(format!("{PREFIX}{}-{:016x}", std::process::id(), random()));
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return RunDir::bind(path),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last_err = Some(e),
                Err(source) => return Err(Error::RunDir { path, source }),
            }
        }
        let source = last_err.unwrap_or_else(|| io::ErrorKind::AlreadyExists.into());
        Err(Error::RunDir { path: base, source })
    }

    fn bind(path: PathBuf) -> Result<(RunDir, UnixListener)> {
        let socket = path.join(SOCKET_NAME);
        // From here on Drop removes the directory, whatever fails next.
        let dir = RunDir { path: path.clone(), socket: socket.clone(), removed: false };
        let fail = |source| Error::RunDir { path: path.clone(), source };
        let listener = UnixListener::bind(&socket).map_err(fail)?;
        fs::set_permissions(&socket, Permissions::from_mode(0o600)).map_err(fail)?;
        listener.set_nonblocking(true).map_err(fail)?;
        Ok((dir, listener))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Removes the directory and its socket; later calls do nothing.
    pub fn remove(&mut self) {
        if !self.removed {
            self.removed = true;
            if let Err(e) = fs::remove_dir_all(&self.path) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!("cannot remove the run directory {}: {e}", self.path.display());
                }
            }
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        self.remove();
    }
}

fn base_dir() -> PathBuf {
    let fits = |p: &Path| p.as_os_str().len() + PREFIX.len() + 40 + SOCKET_NAME.len() < MAX_SOCKET_PATH;
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        if xdg.is_absolute() && xdg.is_dir() && fits(&xdg) {
            return xdg;
        }
    }
    let tmp = std::env::temp_dir();
    if fits(&tmp) {
        tmp
    } else {
        PathBuf::from("/tmp")
    }
}

fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    hasher.finish()
}

/// Removes run directories of supervisors that were SIGKILLed during start-up: ours
/// (same owner), named `loom-<pid>-<hex>`, whose pid is gone and whose socket nobody
/// listens on.
pub fn sweep_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else { return };
    let uid = nix::unistd::getuid().as_raw();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(stale_pid) else { continue };
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        if !meta.is_dir() || meta.uid() != uid || process_alive(pid) {
            continue;
        }
        if UnixStream::connect(path.join(SOCKET_NAME)).is_ok() {
            continue;
        }
        if fs::remove_dir_all(&path).is_ok() {
            log::info!("removed {} left by a supervisor that was killed", path.display());
        }
    }
}

fn stale_pid(name: &str) -> Option<i32> {
    let (pid, tag) = name.strip_prefix(PREFIX)?.split_once('-')?;
    if tag.len() != 16 || !tag.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    pid.parse().ok()
}

fn process_alive(pid: i32) -> bool {
    use nix::errno::Errno;
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(Errno::ESRCH) => false,
        Err(_) => true, // EPERM: alive, someone else's
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_dir_and_socket_are_removed() {
        let (mut dir, _listener) = RunDir::create().unwrap();
        let mode = fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let mode = fs::symlink_metadata(dir.socket()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let path = dir.path().to_path_buf();
        dir.remove();
        assert!(!path.exists());
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn drop_removes_the_dir() {
        let (dir, _listener) = RunDir::create().unwrap();
        let path = dir.path().to_path_buf();
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn sweeps_only_dead_leftovers() {
        let base = tempfile::tempdir().unwrap();
        // A pid that cannot exist (above pid_max) and our own, live pid.
        let dead = base.path().join("loom-2147483646-00000000000000aa");
        let live = base.path().join(format!("loom-{}-00000000000000bb", std::process::id()));
        let other = base.path().join("loom-notes");
        for d in [&dead, &live, &other] {
            fs::create_dir(d).unwrap();
        }
        sweep_stale(base.path());
        assert!(!dead.exists());
        assert!(live.exists());
        assert!(other.exists());
    }
}
