//! The supervisor end to end with shell children (no Python needed): failure reports,
//! start-up deadlines, the stop sequence and the run directory's removal. Where a child
//! must speak the protocol (the lead that receives PEER_DIED), it is this test binary run
//! again as `lead_child_process`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use loom_supervisor::frame::{self, Header};
use loom_supervisor::logs::ConsoleThread;
use loom_supervisor::report::PeerDiedBody;
use loom_supervisor::{supervise, Error, Outcome, Plan, WIRE_VERSION};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[derive(Serialize)]
struct Proc {
    role: &'static str,
    rank: u32,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct Doc {
    processes: Vec<Proc>,
    startup_timeout_s: f64,
    grace_period_s: f64,
}

fn sh(role: &'static str, rank: u32, script: &str) -> Proc {
    Proc { role, rank, argv: vec!["/bin/sh".into(), "-c".into(), script.into()], env: BTreeMap::new() }
}

fn plan(processes: Vec<Proc>, startup_timeout_s: f64, grace_period_s: f64) -> Plan {
    let doc = Doc { processes, startup_timeout_s, grace_period_s };
    Plan::from_msgpack(&rmp_serde::to_vec_named(&doc).unwrap()).unwrap()
}

/// Runs `plan` on a current-thread runtime; `stop_after` sends one SIGTERM request.
fn run(plan: Plan, stop_after: Option<Duration>) -> (Result<Outcome, Error>, Duration) {
    run_and_stop(plan, stop_after.map(|after| async move { tokio::time::sleep(after).await }))
}

/// Runs `plan` on a current-thread runtime; one SIGTERM request once `stop` is done.
fn run_and_stop(
    plan: Plan,
    stop: Option<impl std::future::Future<Output = ()> + Send + 'static>,
) -> (Result<Outcome, Error>, Duration) {
    let console = ConsoleThread::start().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let started = Instant::now();
    let (tx, rx) = mpsc::unbounded_channel();
    let c = console.console();
    let result = rt.block_on(async move {
        if let Some(stop) = stop {
            tokio::spawn(async move {
                stop.await;
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
const STUBBORN: &str = "trap '' USR1; exec sleep 30";

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
    assert!(report.contains("it was then stopped: it was killed by SIGUSR1"), "{report}");
    assert!(report.contains("| loading"), "{report}");
    assert!(!outcome.run_dir.exists());
}

#[test]
fn stop_request_with_children_that_honour_the_stop_signal_exits_0() {
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
fn a_child_that_ignores_the_stop_signal_is_killed_after_the_grace_period() {
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
        vec![
            sh("frontend", 0, SLEEPER),
            Proc { role: "worker", rank: 0, argv: vec!["/nonexistent/python".into()], env: BTreeMap::new() },
        ],
        30.0,
        1.0,
    );
    let (outcome, took) = run(plan, None);
    let err = outcome.unwrap_err();
    assert!(matches!(err, Error::Spawn { .. }), "{err}");
    assert!(err.to_string().contains("worker:0"), "{err}");
    assert!(took < Duration::from_secs(5), "the frontend was not stopped: {took:?}");
}

// ---- PEER_DIED, as the lead receives it ----------------------------------------------------

/// Set in the lead child's environment: where it writes the PEER_DIED body it receives.
/// `<path>.ready` appears once it has sent READY, so a peer may die while it listens.
const LEAD_OUT: &str = "SUPERVISE_TEST_LEAD_OUT";
/// Set in the lead child's environment, it drains this many seconds after SHUTDOWN
/// (`<LEAD_OUT>.draining` appears first) and exits 0; a PEER_DIED meanwhile is kept, the
/// drain goes on. Without it the lead ignores SHUTDOWN and exits at PEER_DIED.
const LEAD_DRAIN_S: &str = "SUPERVISE_TEST_LEAD_DRAIN_S";
/// Set in the environment of the engine-core child that reports a remote death: once this
/// path exists it sends REMOTE_DIED (`<path>.reporter` appears once it has sent READY).
const REPORT_WHEN: &str = "SUPERVISE_TEST_REPORT_WHEN";

/// A PEER_DIED body as the lead decodes it: exactly these keys.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerDied {
    role: String,
    rank: u32,
    pid: u32,
    exit_code: Option<i32>,
    signal: Option<String>,
    phase: String,
    reason: String,
    stderr_tail: Vec<String>,
}

/// Not a test of its own: the entry point of the lead child that the PEER_DIED tests spawn
/// (this binary, filtered to this name). Run by the harness directly, it does nothing.
#[test]
fn lead_child_process() {
    let Some(out) = std::env::var_os(LEAD_OUT) else { return };
    let out = PathBuf::from(out);
    let drain = std::env::var(LEAD_DRAIN_S).ok().map(|s| Duration::from_secs_f64(s.parse().unwrap()));
    let mut sock = connect_and_ready("frontend");
    std::fs::write(out.with_extension("ready"), b"").unwrap();
    loop {
        let (header, payload) = read_frame(&mut sock);
        if header.kind == "PEER_DIED" {
            assert_eq!(header.src, "supervisor");
            let partial = out.with_extension("partial");
            std::fs::write(&partial, &payload[header.body.clone()]).unwrap();
            std::fs::rename(partial, &out).unwrap();
            if drain.is_none() {
                std::process::exit(0);
            }
        }
        if let (Some(drain), "SHUTDOWN") = (drain, header.kind.as_str()) {
            std::fs::write(out.with_extension("draining"), b"").unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(drain);
                std::process::exit(0);
            });
        }
    }
}

/// Not a test of its own: the engine-core child that reports the death of a remote worker
/// (worker:1, pid 4242 on node 10.0.0.2) once the path in `REPORT_WHEN` exists.
#[test]
fn reporter_child_process() {
    let Some(when) = std::env::var_os(REPORT_WHEN) else { return };
    let when = PathBuf::from(when);
    let mut sock = connect_and_ready("engine_core");
    std::fs::write(when.with_extension("reporter"), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !when.exists() {
        assert!(Instant::now() < deadline, "{} did not appear", when.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    let body = remote_death().encode();
    sock.write_all(&frame::encode(WIRE_VERSION, "engine_core", "supervisor", "REMOTE_DIED", &body).unwrap()).unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(1)); // until the stop signal
    }
}

fn remote_death() -> PeerDiedBody {
    PeerDiedBody {
        role: "worker".into(),
        rank: 1,
        pid: 4242,
        exit_code: None,
        signal: Some("SIGKILL".into()),
        phase: "running".into(),
        reason: "worker:1 died: its actor was lost with its node".into(),
        stderr_tail: vec!["CUDA error".into()],
        node: Some("10.0.0.2".into()),
    }
}

/// HELLO, CONFIG and READY as `role` (rank 0) on the supervisor's socket.
fn connect_and_ready(role: &'static str) -> UnixStream {
    let mut sock = UnixStream::connect(std::env::var("LOOM_SUPERVISOR_SOCKET").unwrap()).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    #[derive(Serialize)]
    struct Hello {
        role: &'static str,
        rank: u32,
        pid: u32,
        messages_version: u32,
    }
    let hello = Hello { role, rank: 0, pid: std::process::id(), messages_version: WIRE_VERSION };
    let send = |sock: &mut UnixStream, kind: &str, body: &[u8]| {
        sock.write_all(&frame::encode(WIRE_VERSION, role, "supervisor", kind, body).unwrap()).unwrap();
    };
    send(&mut sock, "HELLO", &rmp_serde::to_vec_named(&hello).unwrap());
    assert_eq!(read_frame(&mut sock).0.kind, "CONFIG");
    send(&mut sock, "READY", b"");
    sock
}

/// This test binary run again as the child that `name` is the entry point of.
fn this_binary(role: &'static str, name: &str, env: BTreeMap<String, String>) -> Proc {
    let exe = std::env::current_exe().unwrap().to_string_lossy().into_owned();
    let argv = [exe.as_str(), name, "--exact", "--nocapture", "--test-threads", "1", "-q"].map(String::from).to_vec();
    Proc { role, rank: 0, argv, env }
}

fn read_frame(sock: &mut UnixStream) -> (Header, Vec<u8>) {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).unwrap();
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    sock.read_exact(&mut payload).unwrap();
    (Header::parse(&payload).unwrap(), payload)
}

/// Runs a lead child and `peer` (a shell script started once the lead is ready), and
/// returns the PEER_DIED body the lead received, the report, and the peer's pid.
fn peer_died(peer_role: &'static str, peer_rank: u32, peer_script: &str) -> (PeerDied, String, u32) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("peer_died.msgpack");
    let ready = out.with_extension("ready");
    let env = BTreeMap::from([(LEAD_OUT.to_string(), out.to_string_lossy().into_owned())]);
    let lead = this_binary("frontend", "lead_child_process", env);
    // The peer waits (up to 20 s) for the lead to listen: a lead still starting hears nothing.
    let wait = format!(
        "i=0; while [ ! -e '{}' ]; do i=$((i+1)); [ $i -gt 2000 ] && exit 99; sleep 0.01; done; {peer_script}",
        ready.display()
    );
    let mut peer = sh(peer_role, peer_rank, &wait);
    peer.env.insert("PATH".into(), "/usr/bin:/bin".into());
    let (outcome, _) = run(plan(vec![lead, peer], 30.0, 2.0), None);
    let outcome = outcome.unwrap();
    let report = outcome.report.unwrap();
    assert_eq!(outcome.code, 1, "{report}");
    let bytes = std::fs::read(&out).unwrap_or_else(|e| panic!("the lead got no PEER_DIED ({e}):\n{report}"));
    let address = if peer_role == "worker" { format!("worker:{peer_rank}") } else { peer_role.to_string() };
    let pid = pid_in(&report, &address);
    (rmp_serde::from_slice(&bytes).unwrap(), report, pid)
}

/// The pid the report gives for `address`: "loom-supervisor: worker:1 (pid 123) ...".
fn pid_in(report: &str, address: &str) -> u32 {
    let start = format!("loom-supervisor: {address} (pid ");
    let at = report.find(&start).unwrap_or_else(|| panic!("no {start:?} in {report}")) + start.len();
    report[at..].split(')').next().unwrap().parse().unwrap()
}

#[test]
fn peer_died_tells_the_lead_about_a_signal() {
    let script = "ulimit -c 0; echo 'loading' >&2; echo 'about to fault' >&2; kill -SEGV $$";
    let (body, report, pid) = peer_died("worker", 1, script);
    assert!(report.contains("was killed by SIGSEGV"), "{report}");
    let expected = PeerDied {
        role: "worker".into(),
        rank: 1,
        pid,
        exit_code: None,
        signal: Some("SIGSEGV".into()),
        phase: "spawned".into(),
        reason: "worker:1 was killed by SIGSEGV".into(),
        stderr_tail: vec!["loading".into(), "about to fault".into()],
    };
    assert_eq!(body, expected);
}

#[test]
fn peer_died_tells_the_lead_about_an_exit_code() {
    let (body, report, pid) = peer_died("engine_core", 0, "echo 'ValueError: boom' >&2; exit 7");
    assert!(report.contains("exited with code 7"), "{report}");
    let expected = PeerDied {
        role: "engine_core".into(),
        rank: 0,
        pid,
        exit_code: Some(7),
        signal: None,
        phase: "spawned".into(),
        reason: "engine_core exited with code 7".into(),
        stderr_tail: vec!["ValueError: boom".into()],
    };
    assert_eq!(body, expected);
}

#[test]
fn a_remote_death_during_a_drain_is_reported_and_the_serve_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("peer_died.msgpack");
    let draining = out.with_extension("draining");
    let drain = Duration::from_millis(1500);
    let lead_env = BTreeMap::from([
        (LEAD_OUT.to_string(), out.to_string_lossy().into_owned()),
        (LEAD_DRAIN_S.to_string(), drain.as_secs_f64().to_string()),
    ]);
    let lead = this_binary("frontend", "lead_child_process", lead_env);
    let core_env = BTreeMap::from([(REPORT_WHEN.to_string(), draining.to_string_lossy().into_owned())]);
    let core = this_binary("engine_core", "reporter_child_process", core_env);
    // SIGTERM once both listen: the lead drains, and the engine core reports the death meanwhile.
    let listening = [out.with_extension("ready"), draining.with_extension("reporter")];
    let stop = async move {
        while !listening.iter().all(|p| p.exists()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let started = Instant::now();
    let (outcome, _) = run_and_stop(plan(vec![lead, core], 30.0, 5.0), Some(stop));
    let outcome = outcome.unwrap();
    let report = outcome.report.unwrap_or_default();
    assert_eq!(outcome.code, 1, "a rank died during the drain: {report}");
    assert!(
        report.contains("worker:1 (pid 4242 on node 10.0.0.2) was killed by SIGKILL in phase 'running'"),
        "{report}"
    );
    assert!(report.contains("engine_core reported: worker:1 died: its actor was lost with its node"), "{report}");
    assert!(report.ends_with("stopped the other 2 processes; exiting with code 1\n"), "{report}");
    // The draining lead was told, node included, and drained to its end all the same.
    let told: PeerDiedBody = rmp_serde::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(told, remote_death());
    assert!(started.elapsed() >= drain, "the drain was cut short: {:?}", started.elapsed());
    assert!(!outcome.run_dir.exists());
}
