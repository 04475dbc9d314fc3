//! `loom_supervisor._native`: the supervisor for Python (PyO3 0.17).
//!
//! Every `Error` variant surfaces as its own subclass of `SupervisorError`, so callers
//! can tell a bad plan from a program that cannot start. A failed serve is not an
//! exception: `run` returns its exit code (1) after printing the report.

// pyo3 0.17's `create_exception!` expands to `cfg(addr_of)`, a cfg newer rustc checks.
#![allow(unexpected_cfgs)]

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::Error;
use crate::spec::{Plan, WIRE_VERSION};

create_exception!(loom_supervisor, SupervisorError, PyException, "Base class of every supervisor error.");
create_exception!(loom_supervisor, PlanError, SupervisorError, "The launch plan is invalid, or could not be built.");
create_exception!(loom_supervisor, SpawnError, SupervisorError, "A child process could not be started.");
create_exception!(
    loom_supervisor,
    SetupError,
    SupervisorError,
    "The run directory, its socket, the signal handlers or the event loop could not be set up."
);

fn to_py(err: Error) -> PyErr {
    let text = err.to_string();
    match err {
        Error::Plan(_) | Error::PlanCommand { .. } | Error::PlanBuilderFailed { .. } => PlanError::new_err(text),
        Error::Spawn { .. } => SpawnError::new_err(text),
        Error::RunDir { .. } | Error::Os { .. } => SetupError::new_err(text),
    }
}

/// run(plan: bytes) -> int
/// --
///
/// Supervises a msgpack-encoded launch plan until the serve ends; returns the exit code
/// to use. The GIL is released meanwhile. `loom_supervisor.run` wraps this and also
/// accepts a `loom_supervisor.Plan` or a mapping.
#[pyfunction]
fn run(py: Python<'_>, plan: &[u8]) -> PyResult<i32> {
    let plan = Plan::from_msgpack(plan).map_err(to_py)?;
    py.allow_threads(move || crate::run(plan)).map_err(to_py)
}

/// main(argv: list[str], default_python: str | None = None) -> int
/// --
///
/// The `loom-supervisor` command line; `argv[0]` is the program name. Returns the exit
/// code. `default_python` runs the plan builder when `$LOOM_PYTHON` is unset.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>, default_python: Option<String>) -> i32 {
    py.allow_threads(move || crate::cli::main(argv, default_python))
}

#[pymodule]
fn _native(py: Python<'_>, m: &PyModule) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add("SupervisorError", py.get_type::<SupervisorError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("SpawnError", py.get_type::<SpawnError>())?;
    m.add("SetupError", py.get_type::<SetupError>())?;
    m.add("WIRE_VERSION", WIRE_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
