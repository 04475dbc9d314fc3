//! What the supervisor says about a process that failed: the one report on stderr and the
//! PEER_DIED body sent to the lead process. The process is a child, or a remote one the
//! engine core reported (`remote.rs`); both get the same report.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::logs::SELF;
use crate::spawn::Exit;
use crate::spec::{Address, Role};

/// Where a child was in its life when it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Started; no HELLO yet.
    Spawned,
    /// HELLO accepted; CONFIG not yet written.
    Hello,
    /// CONFIG written; no READY yet.
    Config,
    /// READY; some other process is still starting.
    Ready,
    /// Every process is ready: serving.
    Running,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Spawned => "spawned",
            Phase::Hello => "hello",
            Phase::Config => "config",
            Phase::Ready => "ready",
            Phase::Running => "running",
        }
    }

    pub fn parse(name: &str) -> Option<Phase> {
        [Phase::Spawned, Phase::Hello, Phase::Config, Phase::Ready, Phase::Running]
            .into_iter()
            .find(|p| p.as_str() == name)
    }

    pub fn describe(self) -> &'static str {
        match self {
            Phase::Spawned => "start-up phase 'spawned' (before its HELLO)",
            Phase::Hello => "start-up phase 'hello' (HELLO received, before its CONFIG)",
            Phase::Config => "start-up phase 'config' (CONFIG sent, before its READY)",
            Phase::Ready => "phase 'ready' (waiting for the other processes)",
            Phase::Running => "phase 'running'",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    Exited(Exit),
    /// A start-up phase took longer than `startup_timeout_s`.
    Deadline {
        phase: Phase,
        timeout: Duration,
    },
    BadHello(String),
    /// No HEARTBEAT for the plan's heartbeat timeout; `state` is its /proc state then.
    NotResponding {
        silent: Duration,
        state: String,
    },
    /// Its connection to the supervisor closed while the process kept running.
    Disconnected,
    /// It sent what the frame protocol cannot follow (a length over the limit); its
    /// connection was closed.
    Protocol(String),
}

impl Cause {
    pub fn describe(&self) -> String {
        match self {
            Cause::Exited(exit) => exit.to_string(),
            Cause::Deadline { phase, timeout } => {
                let what = match phase {
                    Phase::Spawned => "sent no HELLO within",
                    Phase::Hello => "did not take its CONFIG within",
                    _ => "sent no READY within",
                };
                format!("missed its start-up deadline: {what} {}", secs(*timeout))
            }
            Cause::BadHello(reason) => format!("was stopped at HELLO: {reason}"),
            Cause::NotResponding { silent, state } => {
                format!("is not responding: no heartbeat for {} (process state: {state})", secs(*silent))
            }
            Cause::Disconnected => "closed its connection to the supervisor but kept running".to_string(),
            Cause::Protocol(reason) => format!("broke the frame protocol ({reason}); its connection was closed"),
        }
    }
}

/// The failed process, as far as the report is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub address: Address,
    pub role: Role,
    pub rank: u32,
    pub pid: u32,
    /// The machine a remote process ran on (a Ray node), where the engine core said; a
    /// child has none, and its report reads as it always did.
    pub node: Option<String>,
}

impl Who {
    /// `worker:1 (pid 42)`, or `worker:1 (pid 42 on node 10.0.0.2)`: a pid alone does not
    /// find a process on another machine.
    pub(crate) fn named(&self) -> String {
        match &self.node {
            Some(node) => format!("{} (pid {} on node {node})", self.address, self.pid),
            None => format!("{} (pid {})", self.address, self.pid),
        }
    }
}

pub struct Failure {
    pub idx: usize,
    pub cause: Cause,
    pub phase: Phase,
}

/// The single report printed when a child fails. `final_exit` is how the child ended in
/// the end (it may have been alive at the failure and stopped afterwards).
pub fn render(who: &Who, failure: &Failure, final_exit: Option<&Exit>, tail: &[String], others: usize) -> String {
    let what = format!("{} in {}", failure.cause.describe(), failure.phase.describe());
    let then = match (&failure.cause, final_exit) {
        (Cause::Exited(_), _) | (_, None) => vec![],
        (_, Some(exit)) => vec![format!("it was then stopped: it {exit}")],
    };
    compose(who, &what, &then, tail, "its stderr was empty", others)
}

/// The report's lines: `who` and `what` happened, its identity, `notes`, its stderr tail
/// (`no_tail` when there is none) and what the supervisor did about it.
pub(crate) fn compose(
    who: &Who,
    what: &str,
    notes: &[String],
    tail: &[String],
    no_tail: &str,
    others: usize,
) -> String {
    let mut out = String::new();
    let line = |out: &mut String, text: &str| {
        let _ = writeln!(out, "{SELF}: {text}");
    };
    line(&mut out, &format!("{} {what}", who.named()));
    let node = who.node.as_ref().map(|n| format!(", node: {n}")).unwrap_or_default();
    line(&mut out, &format!("  role: {}, rank: {}, pid: {}{node}", who.role.as_str(), who.rank, who.pid));
    for note in notes {
        line(&mut out, &format!("  {note}"));
    }
    if tail.is_empty() {
        line(&mut out, &format!("  {no_tail}"));
    } else {
        let what = if tail.len() == 1 { "last line".to_string() } else { format!("last {} lines", tail.len()) };
        line(&mut out, &format!("  {what} of its stderr:"));
        for l in tail {
            line(&mut out, &format!("  | {l}"));
        }
    }
    let stopped = match others {
        0 => "no other process to stop".to_string(),
        1 => "stopped the other process".to_string(),
        n => format!("stopped the other {n} processes"),
    };
    line(&mut out, &format!("{stopped}; exiting with code 1"));
    out
}

/// The PEER_DIED body: a msgpack map `{role, rank, pid, exit_code, signal, phase, reason,
/// stderr_tail}`, plus `node` for a remote process only (so a child's body is what it always
/// was); `exit_code` and `signal` are nil unless the process ended that way. REMOTE_DIED
/// carries the same map, from the engine core to the supervisor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerDiedBody {
    pub role: String,
    pub rank: u32,
    pub pid: u32,
    pub exit_code: Option<i32>,
    pub signal: Option<String>,
    pub phase: String,
    pub reason: String,
    pub stderr_tail: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl PeerDiedBody {
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings and integers always encodes; an empty body is the fallback.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }
}

/// The PEER_DIED body of a child's failure.
pub fn peer_died_body(who: &Who, failure: &Failure, tail: &[String]) -> Vec<u8> {
    let (exit_code, signal) = match &failure.cause {
        Cause::Exited(Exit::Code(code)) => (Some(*code), None),
        Cause::Exited(Exit::Signal(sig)) => (None, Some(Exit::signal_name(*sig))),
        _ => (None, None),
    };
    let body = PeerDiedBody {
        role: who.role.as_str().to_string(),
        rank: who.rank,
        pid: who.pid,
        exit_code,
        signal,
        phase: failure.phase.as_str().to_string(),
        reason: format!("{} {}", who.address, failure.cause.describe()),
        stderr_tail: tail.to_vec(),
        node: who.node.clone(),
    };
    body.encode()
}

pub fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who() -> Who {
        Who { address: Address::Worker(1), role: Role::Worker, rank: 1, pid: 4242, node: None }
    }

    #[test]
    fn report_names_everything() {
        let failure = Failure { idx: 3, cause: Cause::Exited(Exit::Signal(9)), phase: Phase::Config };
        let tail = vec!["Traceback (most recent call last):".to_string(), "ValueError: boom".to_string()];
        let text = render(&who(), &failure, None, &tail, 3);
        assert!(text.contains("worker:1 (pid 4242) was killed by SIGKILL in start-up phase 'config'"), "{text}");
        assert!(text.contains("role: worker, rank: 1, pid: 4242"), "{text}");
        assert!(text.contains("  | ValueError: boom"), "{text}");
        assert!(text.contains("stopped the other 3 processes; exiting with code 1"), "{text}");
        assert!(text.lines().all(|l| l.starts_with("loom-supervisor: ")));
    }

    #[test]
    fn deadline_report_says_how_it_ended() {
        let failure = Failure {
            idx: 0,
            cause: Cause::Deadline { phase: Phase::Spawned, timeout: Duration::from_millis(1500) },
            phase: Phase::Spawned,
        };
        let text = render(&who(), &failure, Some(&Exit::Signal(15)), &[], 1);
        assert!(text.contains("sent no HELLO within 1.5 s"), "{text}");
        assert!(text.contains("it was then stopped: it was killed by SIGTERM"), "{text}");
        assert!(text.contains("its stderr was empty"), "{text}");
        assert!(text.contains("stopped the other process;"), "{text}");
    }

    #[test]
    fn a_remote_process_is_named_with_its_node() {
        let remote = Who { node: Some("10.0.0.2".into()), ..who() };
        let failure = Failure { idx: 0, cause: Cause::Exited(Exit::Code(1)), phase: Phase::Running };
        let text = render(&remote, &failure, None, &[], 2);
        assert!(text.contains("worker:1 (pid 4242 on node 10.0.0.2) exited with code 1 in phase 'running'"), "{text}");
        assert!(text.contains("role: worker, rank: 1, pid: 4242, node: 10.0.0.2\n"), "{text}");
        // A child's report says nothing of a node.
        let local = render(&who(), &failure, None, &[], 2);
        assert!(local.contains("worker:1 (pid 4242) exited") && !local.contains("node"), "{local}");
    }

    #[test]
    fn phases_parse_from_their_names() {
        for p in [Phase::Spawned, Phase::Hello, Phase::Config, Phase::Ready, Phase::Running] {
            assert_eq!(Phase::parse(p.as_str()), Some(p));
        }
        assert_eq!(Phase::parse("Running"), None);
    }

    /// Every field of the PEER_DIED body, decoded as the lead decodes it: a map of exactly
    /// these keys, nil where a value does not apply.
    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        role: String,
        rank: u32,
        pid: u32,
        exit_code: Option<i32>,
        signal: Option<String>,
        phase: String,
        reason: String,
        stderr_tail: Vec<String>,
    }

    fn decode(who: &Who, cause: Cause, phase: Phase, tail: &[String]) -> Body {
        let bytes = peer_died_body(who, &Failure { idx: 3, cause, phase }, tail);
        rmp_serde::from_slice(&bytes).unwrap()
    }

    #[test]
    fn peer_died_body_of_an_exit_code() {
        let body = decode(&who(), Cause::Exited(Exit::Code(3)), Phase::Running, &["x".to_string()]);
        assert_eq!(
            body,
            Body {
                role: "worker".into(),
                rank: 1,
                pid: 4242,
                exit_code: Some(3),
                signal: None,
                phase: "running".into(),
                reason: "worker:1 exited with code 3".into(),
                stderr_tail: vec!["x".into()],
            }
        );
    }

    #[test]
    fn peer_died_body_of_a_signal() {
        let who = Who { address: Address::EngineCore, role: Role::EngineCore, rank: 0, pid: 77, node: None };
        let tail = vec!["loading".to_string(), "Segmentation fault".to_string()];
        let body = decode(&who, Cause::Exited(Exit::Signal(libc::SIGSEGV)), Phase::Config, &tail);
        assert_eq!(
            body,
            Body {
                role: "engine_core".into(),
                rank: 0,
                pid: 77,
                exit_code: None,
                signal: Some("SIGSEGV".into()),
                phase: "config".into(),
                reason: "engine_core was killed by SIGSEGV".into(),
                stderr_tail: tail,
            }
        );
    }

    #[test]
    fn peer_died_body_of_a_deadline_or_a_bad_hello_has_neither_code_nor_signal() {
        let deadline = Cause::Deadline { phase: Phase::Hello, timeout: Duration::from_secs(2) };
        let body = decode(&who(), deadline, Phase::Hello, &[]);
        assert_eq!((body.exit_code, body.signal, body.phase.as_str()), (None, None, "hello"));
        assert_eq!(body.reason, "worker:1 missed its start-up deadline: did not take its CONFIG within 2 s");
        assert!(body.stderr_tail.is_empty());
        let body = decode(&who(), Cause::BadHello("it speaks messages version 9".into()), Phase::Spawned, &[]);
        assert_eq!((body.exit_code, body.signal, body.phase.as_str()), (None, None, "spawned"));
        assert_eq!(body.reason, "worker:1 was stopped at HELLO: it speaks messages version 9");
    }

    #[test]
    fn peer_died_body_names_every_phase() {
        let phases = [Phase::Spawned, Phase::Hello, Phase::Config, Phase::Ready, Phase::Running];
        let names: Vec<String> =
            phases.iter().map(|&p| decode(&who(), Cause::Exited(Exit::Code(1)), p, &[]).phase).collect();
        assert_eq!(names, ["spawned", "hello", "config", "ready", "running"]);
    }
}
