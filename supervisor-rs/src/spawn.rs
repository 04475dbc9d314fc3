//! Starting one child: a fresh program with an explicit environment, its output piped to
//! the console, a parent-death signal, and a task that owns the `Child` so that signals
//! are only ever sent to a pid that has not been reaped yet.

use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::logs::{self, Console, Tail};
use crate::spec::{ProcessSpec, ENV_RANK, ENV_ROLE, ENV_SOCKET};

/// How a child ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// `wait` itself failed; should not happen for our own children.
    Unknown(String),
}

impl Exit {
    pub fn from_status(status: io::Result<ExitStatus>) -> Exit {
        match status {
            Ok(s) => match (s.code(), s.signal()) {
                (Some(code), _) => Exit::Code(code),
                (None, Some(sig)) => Exit::Signal(sig),
                (None, None) => Exit::Unknown(format!("{s}")),
            },
            Err(e) => Exit::Unknown(e.to_string()),
        }
    }

    pub fn signal_name(sig: i32) -> String {
        Signal::try_from(sig).map(|s| s.as_str().to_string()).unwrap_or_else(|_| format!("signal {sig}"))
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exited with code {code}"),
            Exit::Signal(sig) => write!(f, "was killed by {}", Exit::signal_name(*sig)),
            Exit::Unknown(why) => write!(f, "ended in an unknown way ({why})"),
        }
    }
}

/// A running child as the supervisor sees it.
pub struct Spawned {
    pub pid: u32,
    /// Signals to deliver; the owning task drops them once the child is reaped.
    pub signals: mpsc::UnboundedSender<Signal>,
    pub stderr_tail: Tail,
    /// Ends at the child's stderr EOF; awaited (briefly) before a report is written.
    pub stderr_done: JoinHandle<()>,
}

/// Spawns `spec`; `on_exit` receives the exit once the child has been reaped.
///
/// Must run on the thread that lives for the whole serve: `PR_SET_PDEATHSIG` fires when
/// the *thread* that forked the child exits, not the process.
pub fn spawn<F>(spec: &ProcessSpec, socket: &Path, console: &Console, on_exit: F) -> Result<Spawned>
where
    F: FnOnce(Exit) + Send + 'static,
{
    let who = spec.address().to_string();
    let mut cmd = Command::new(&spec.argv[0]);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(&spec.env)
        .env(ENV_SOCKET, socket)
        .env(ENV_ROLE, spec.role.as_str())
        .env(ENV_RANK, spec.rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let parent = nix::unistd::getpid().as_raw();
    // SAFETY: runs between fork and exec; it only makes async-signal-safe syscalls and
    // builds io::Errors from raw codes (no allocation).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The supervisor may have died between fork and prctl: then nobody would
            // ever kill this child.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            // Ctrl-C in a terminal reaches the whole foreground group, and systemd, docker
            // and `kill -- -PGID` send SIGTERM to every process; the supervisor alone turns
            // either into an orderly SHUTDOWN (drain first), so children ignore both and
            // are stopped with STOP_SIGNAL.
            for sig in [libc::SIGINT, libc::SIGTERM] {
                if libc::signal(sig, libc::SIG_IGN) == libc::SIG_ERR {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child =
        cmd.spawn().map_err(|source| Error::Spawn { who: who.clone(), program: spec.argv[0].clone(), source })?;
    let pid = child.id().unwrap_or(0);
    let stderr_tail = Tail::default();
    if let Some(out) = child.stdout.take() {
        logs::pump(out, who.clone(), console.clone(), None);
    }
    let stderr_done = match child.stderr.take() {
        Some(err) => logs::pump(err, who, console.clone(), Some(stderr_tail.clone())),
        None => tokio::spawn(async {}),
    };
    let (signals, mut requests) = mpsc::unbounded_channel::<Signal>();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                status = child.wait() => {
                    on_exit(Exit::from_status(status));
                    return;
                }
                Some(sig) = requests.recv() => {
                    // `id()` is None once reaped, so this never hits a recycled pid.
                    if let Some(pid) = child.id() {
                        let _ = signal::kill(Pid::from_raw(pid as i32), sig);
                    }
                }
            }
        }
    });
    Ok(Spawned { pid, signals, stderr_tail, stderr_done })
}
