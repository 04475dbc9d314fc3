//! The `loom-supervisor` command line, shared by the cargo binary and the console script
//! that the Python wheel installs (which calls it through the native module).

use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::{Parser, Subcommand};

use crate::error::{Error, Result};
use crate::logs::SELF;
use crate::spec::Plan;

const PLAN_MODULE: &str = "loom.entrypoints.plan";

#[derive(Parser, Debug)]
#[command(name = "loom-supervisor", version, about = "Spawns, wires and watches every process of a loom serve.")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve a model: `$LOOM_PYTHON -m loom.entrypoints.plan ARGS...` prints the launch
    /// plan (msgpack) on stdout; the supervisor then runs it and exits with its code.
    Serve {
        /// Arguments for the plan builder: the same as `loom serve` takes (`loom serve --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Supervise a launch plan stored as msgpack in FILE (`-` reads stdin).
    RunPlan { file: PathBuf },
}

/// Runs the command line; returns the process exit code. `default_python` is the
/// interpreter for `serve` when `$LOOM_PYTHON` is unset (the console script passes its
/// own; the cargo binary uses `python3`).
pub fn main<I, T>(argv: I, default_python: Option<String>) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let plan = match cli.command {
        Cmd::Serve { args } => {
            let python = std::env::var("LOOM_PYTHON").ok().or(default_python).unwrap_or_else(|| "python3".into());
            plan_from_python(&python, &args)
        }
        Cmd::RunPlan { file } => read_plan(&file),
    };
    let result = plan.and_then(crate::run);
    match result {
        Ok(code) => code,
        // The plan builder already printed its one-line error; keep its exit code.
        Err(Error::PlanBuilderFailed { code, .. }) => code,
        Err(e) => {
            eprintln!("{SELF}: error: {e}");
            if matches!(e, Error::Plan(_) | Error::PlanCommand { .. }) {
                2
            } else {
                1
            }
        }
    }
}

fn plan_from_python(python: &str, args: &[String]) -> Result<Plan> {
    let command = format!("{python} -m {PLAN_MODULE} {}", args.join(" "));
    let fail = |reason: String| Error::PlanCommand { command: command.clone(), reason };
    let output = Command::new(python)
        .arg("-m")
        .arg(PLAN_MODULE)
        .args(args)
        .stdin(Stdio::inherit())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| fail(e.to_string()))?;
    if !output.status.success() {
        return Err(Error::PlanBuilderFailed { command, code: output.status.code().unwrap_or(1) });
    }
    Plan::from_msgpack(&output.stdout)
}

fn read_plan(file: &PathBuf) -> Result<Plan> {
    let mut bytes = Vec::new();
    let read = if file.as_os_str() == "-" {
        std::io::stdin().read_to_end(&mut bytes).map(|_| ())
    } else {
        std::fs::read(file).map(|b| bytes = b)
    };
    read.map_err(|e| Error::Plan(format!("cannot read {}: {e}", file.display())))?;
    Plan::from_msgpack(&bytes)
}
