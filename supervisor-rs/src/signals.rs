//! SIGINT/SIGTERM for the length of one serve.
//!
//! The handlers are installed when a serve starts and the previous ones restored when it
//! ends, so that `loom_supervisor.run` can be called again in the same Python process and
//! a Ctrl-C the supervisor already turned into an orderly stop does not resurface as a
//! `KeyboardInterrupt` afterwards. (A chaining registry such as signal-hook's keeps its
//! handler forever and calls the previous one too, which gives exactly those two
//! problems inside Python.) The handler only writes the signal number to a socket pair
//! that the event loop reads.

use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::error::{Error, Result};

const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// Write end of the current serve's socket pair; -1 when no serve runs.
static PIPE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    // SAFETY: errno is thread-local; write(2) is async-signal-safe. A full pipe drops
    // the byte, which is fine: one pending stop request is as good as many.
    unsafe {
        let errno = *libc::__errno_location();
        let fd = PIPE_FD.load(Ordering::Relaxed);
        if fd >= 0 {
            let byte = sig as u8;
            libc::write(fd, (&byte as *const u8).cast(), 1);
        }
        *libc::__errno_location() = errno;
    }
}

pub struct SignalGuard {
    previous: Vec<(libc::c_int, libc::sigaction)>,
    reader: Option<UnixStream>,
    _writer: UnixStream,
}

impl SignalGuard {
    pub fn install() -> Result<SignalGuard> {
        let os = |source| Error::Os { context: "cannot set up signal handling", source };
        let (reader, writer) = UnixStream::pair().map_err(os)?;
        reader.set_nonblocking(true).map_err(os)?;
        writer.set_nonblocking(true).map_err(os)?;
        if PIPE_FD.compare_exchange(-1, writer.as_raw_fd(), Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Err(Error::Os {
                context: "cannot start a serve",
                source: io::Error::other("another serve is running in this process"),
            });
        }
        let mut guard = SignalGuard { previous: Vec::new(), reader: Some(reader), _writer: writer };
        for sig in SIGNALS {
            // SAFETY: plain sigaction(2) with a zeroed struct and a valid handler.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) != 0 {
                    return Err(os(io::Error::last_os_error())); // Drop restores the rest
                }
                guard.previous.push((sig, old));
            }
        }
        Ok(guard)
    }

    /// The end the event loop reads signal numbers from (one byte each).
    pub fn take_reader(&mut self) -> Option<UnixStream> {
        self.reader.take()
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in self.previous.drain(..) {
            // SAFETY: restores the action saved by install().
            unsafe {
                libc::sigaction(sig, &old, std::ptr::null_mut());
            }
        }
        PIPE_FD.store(-1, Ordering::SeqCst);
    }
}
