//! The supervisor end to end with shell children (no Python needed): failure reports,
//! start-up deadlines, the stop sequence and the run directory's removal.

use std::time::{Duration, Instant};

use loom_supervisor::logs::ConsoleThread;
use loom_supervisor::{supervise, Error, Outcome, Plan};
use serde::Serialize;
use tokio::sync::mpsc;

#[derive(Serialize)]
struct Proc {
    role: &'static str,
    rank: u32,
    argv: Vec<String>,
}

#[derive(Serialize)]
struct Doc {
    processes: Vec<Proc>,
    startup_timeout_s: f64,
    grace_period_s: f64,
}

fn sh(role: &'static str, rank: u32, script: &str) -> Proc {
    Proc { role, rank, argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

fn plan(processes: Vec<Proc>, startup_timeout_s: f64, grace_period_s: f64) -> Plan {
    let doc = Doc { processes, startup_timeout_s, grace_period_s };
    Plan::from_msgpack(&rmp_serde::to_vec_named(&doc).unwrap()).unwrap()
}

/// Runs `plan` on a current-thread runtime; `stop_after` sends one SIGTERM request.
fn run(plan: Plan, stop_after: Option<Duration>) -> (Result<Outcome, Error>, Duration) {
    let console = ConsoleThread::start().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let started = Instant::now();
    let (tx, rx) = mpsc::unbounded_channel();
    let c = console.console();
    let result = rt.block_on(async move {
        if let Some(after) = stop_after {
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                let _ = tx.send(libc::SIGTERM);
            });
        } else {
            std::mem::forget(tx); // keep the channel open
        }
        supervise(plan, c, rx).await
    });
    let took = started.elapsed();
    drop(rt);
    console.finish();
    (result, took)
}

const SLEEPER: &str = "exec sleep 30";
const STUBBORN: &str = "trap '' TERM; exec sleep 30";

#[test]
fn a_dead_child_is_reported_and_the_others_stopped() {
    let plan = plan(
        vec![
            sh("frontend", 0, SLEEPER),
            sh("worker", 0, SLEEPER),
            sh("worker", 1, "echo starting; echo 'ValueError: boom' >&2; exit 3"),
        ],
        30.0,
        2.0,
    );
    let (outcome, took) = run(plan, None);
    let outcome = outcome.unwrap();
    assert_eq!(outcome.code, 1);
    let report = outcome.report.unwrap();
    assert!(report.contains("worker:1 (pid "), "{report}");
    assert!(report.contains("exited with code 3 in start-up phase 'spawned'"), "{report}");
    assert!(report.contains("role: worker, rank: 1, pid: "), "{report}");
    assert!(report.contains("| ValueError: boom"), "{report}");
    assert!(!report.contains("starting"), "stdout is not part of the stderr tail: {report}");
    assert!(report.contains("stopped the other 2 processes"), "{report}");
    assert!(!outcome.run_dir.exists());
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_missed_start_up_deadline_is_reported() {
    let plan = plan(vec![sh("engine_core", 0, "echo loading >&2; exec sleep 30")], 0.5, 2.0);
    let (outcome, _) = run(plan, None);
    let outcome = outcome.unwrap();
    assert_eq!(outcome.code, 1);
    let report = outcome.report.unwrap();
    assert!(report.contains("engine_core (pid "), "{report}");
    assert!(report.contains("sent no HELLO within 0.5 s"), "{report}");
    assert!(report.contains("it was then stopped: it was killed by SIGTERM"), "{report}");
    assert!(report.contains("| loading"), "{report}");
    assert!(!outcome.run_dir.exists());
}

#[test]
fn stop_request_with_children_that_honour_sigterm_exits_0() {
    let plan =
        plan(vec![sh("frontend", 0, SLEEPER), sh("engine_core", 0, SLEEPER), sh("worker", 0, SLEEPER)], 30.0, 5.0);
    let (outcome, took) = run(plan, Some(Duration::from_millis(300)));
    let outcome = outcome.unwrap();
    assert_eq!(outcome.code, 0);
    assert!(outcome.report.is_none());
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(!outcome.run_dir.exists());
}

#[test]
fn a_child_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let grace = 1.0;
    let plan = plan(vec![sh("frontend", 0, SLEEPER), sh("worker", 0, STUBBORN)], 30.0, grace);
    let (outcome, took) = run(plan, Some(Duration::from_millis(300)));
    let outcome = outcome.unwrap();
    assert_eq!(outcome.code, 1, "a child had to be killed: not a clean stop");
    assert!(took >= Duration::from_millis(300 + 1000), "SIGKILL came before the grace period: {took:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(!outcome.run_dir.exists());
}

#[test]
fn a_program_that_cannot_start_is_an_error() {
    let plan = plan(
        vec![sh("frontend", 0, SLEEPER), Proc { role: "worker", rank: 0, argv: vec!["/nonexistent/python".into()] }],
        30.0,
        1.0,
    );
    let (outcome, took) = run(plan, None);
    let err = outcome.unwrap_err();
    assert!(matches!(err, Error::Spawn { .. }), "{err}");
    assert!(err.to_string().contains("worker:0"), "{err}");
    assert!(took < Duration::from_secs(5), "the frontend was not stopped: {took:?}");
}
