//! Errors that stop the supervisor before or outside a serve.
//!
//! A child that dies, misses a deadline or sends a bad HELLO is not an `Error`: it is the
//! normal end of a failed serve, reported on stderr and turned into exit code 1. These
//! variants are the cases where no serve could run at all (a bad plan, a socket that cannot
//! be bound, a program that cannot be spawned). Python sees each variant as its own
//! subclass of `loom_supervisor.SupervisorError` (see `python.rs`).

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plan is not usable: a missing field, a wrong type, a duplicate process.
    #[error("invalid plan: {0}")]
    Plan(String),

    /// The private run directory or its socket could not be set up.
    #[error("cannot set up the run directory {path}: {source}")]
    RunDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// A child could not be started (its program is missing, not executable, ...).
    #[error("cannot spawn {who} ({program}): {source}")]
    Spawn {
        who: String,
        program: String,
        #[source]
        source: io::Error,
    },

    /// Asking Python for the plan (`loom-supervisor serve`) failed.
    #[error("cannot get the launch plan from `{command}`: {reason}")]
    PlanCommand { command: String, reason: String },

    /// The plan builder ran and failed (it prints its own error).
    #[error("`{command}` failed with exit code {code}")]
    PlanBuilderFailed { command: String, code: i32 },

    /// Anything else the operating system refused (runtime, signal handlers, ...).
    #[error("{context}: {source}")]
    Os {
        context: &'static str,
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub fn os(context: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Os { context, source }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
