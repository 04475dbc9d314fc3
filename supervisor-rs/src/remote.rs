//! REMOTE_DIED: the engine core reports the death of a process the supervisor did not
//! spawn (a worker rank running as a Ray actor, maybe on another machine). The supervisor
//! cannot see such a process, so it takes the engine core's word and handles the death as
//! a child's: the same report, PEER_DIED to the lead, every child stopped, exit code 1.
//!
//! The body is a PEER_DIED body (`report::PeerDiedBody`), `node` included where known.

use crate::logs::TAIL_LINES;
use crate::report::{self, PeerDiedBody, Phase, Who};
use crate::spec::{Address, Role};

/// How much of a body that does not decode a warning shows.
const SHOWN_BYTES: usize = 256;

/// A death the engine core reported, checked, with its text made safe to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteDeath {
    pub who: Who,
    pub body: PeerDiedBody,
}

/// Takes the body of a REMOTE_DIED frame from `sender`, or says why not (for a warning;
/// the frame is then dropped and the serve goes on). Only the engine core owns remote
/// processes: from anyone else the frame would let one child stop the serve in another's
/// name.
pub fn accept(sender: Address, body: &[u8]) -> Result<RemoteDeath, String> {
    if sender != Address::EngineCore {
        return Err(format!("only engine_core reports the death of a remote process, not {sender}"));
    }
    decode(body).map_err(|e| {
        let shown = &body[..body.len().min(SHOWN_BYTES)];
        let more = if body.len() > SHOWN_BYTES { "..." } else { "" };
        format!("its body is not a PEER_DIED map ({e}): b\"{}\"{more}", shown.escape_ascii())
    })
}

fn decode(bytes: &[u8]) -> Result<RemoteDeath, String> {
    let mut body: PeerDiedBody = rmp_serde::from_slice(bytes).map_err(|e| one_line(&e.to_string()))?;
    // Only ranks run away from the supervisor: the front end and the engine core are its children.
    let role = Role::parse(&body.role).filter(|r| *r == Role::Worker).ok_or_else(|| {
        format!("role {:?} is not worker (only a worker rank runs outside the supervisor)", body.role)
    })?;
    // Everything below is printed in the report: one line per line, no terminal controls.
    let lines: Vec<String> = body.stderr_tail.iter().flat_map(|l| l.lines().map(one_line)).collect();
    body.stderr_tail = lines[lines.len().saturating_sub(TAIL_LINES)..].to_vec();
    body.reason = one_line(&body.reason);
    body.phase = one_line(&body.phase);
    body.signal = body.signal.as_deref().map(one_line);
    body.node = body.node.as_deref().map(one_line).filter(|n| !n.is_empty());
    let who =
        Who { address: Address::of(role, body.rank), role, rank: body.rank, pid: body.pid, node: body.node.clone() };
    Ok(RemoteDeath { who, body })
}

/// Control characters escaped (`\n`, `\u{1b}`), the rest as it was.
fn one_line(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

impl RemoteDeath {
    /// What the lead is told: the body as received, cleaned, `node` kept.
    pub fn peer_died_body(&self) -> Vec<u8> {
        self.body.encode()
    }

    /// The death report, in the format of a child's; `others` is how many children were stopped.
    pub fn render(&self, others: usize) -> String {
        let b = &self.body;
        let how = match (&b.signal, b.exit_code) {
            (Some(sig), _) => format!("was killed by {sig}"),
            (None, Some(code)) => format!("exited with code {code}"),
            (None, None) => "died".to_string(),
        };
        let phase = Phase::parse(&b.phase).map_or_else(|| format!("phase '{}'", b.phase), |p| p.describe().into());
        let notes = if b.reason.is_empty() { vec![] } else { vec![format!("engine_core reported: {}", b.reason)] };
        let no_tail = "no lines of its stderr came with the report";
        report::compose(&self.who, &format!("{how} in {phase}"), &notes, &b.stderr_tail, no_tail, others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(node: Option<&str>) -> PeerDiedBody {
        PeerDiedBody {
            role: "worker".into(),
            rank: 1,
            pid: 1234,
            exit_code: None,
            signal: Some("SIGKILL".into()),
            phase: "running".into(),
            reason: "worker:1 died: the actor's node was lost".into(),
            stderr_tail: vec!["loading".into(), "CUDA error: out of memory".into()],
            node: node.map(Into::into),
        }
    }

    #[test]
    fn a_body_with_a_node_is_taken_as_sent() {
        let death = accept(Address::EngineCore, &body(Some("10.0.0.2")).encode()).unwrap();
        assert_eq!(death.body, body(Some("10.0.0.2")));
        let who =
            Who { address: Address::Worker(1), role: Role::Worker, rank: 1, pid: 1234, node: Some("10.0.0.2".into()) };
        assert_eq!(death.who, who);
        // The lead gets the same map back, node included.
        let told: PeerDiedBody = rmp_serde::from_slice(&death.peer_died_body()).unwrap();
        assert_eq!(told, body(Some("10.0.0.2")));
    }

    #[test]
    fn a_body_without_a_node_is_a_plain_peer_died_body() {
        let death = accept(Address::EngineCore, &body(None).encode()).unwrap();
        assert_eq!(death.who.node, None);
        let told: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
            rmp_serde::from_slice(&death.peer_died_body()).unwrap();
        let keys: Vec<&str> = told.keys().map(String::as_str).collect();
        assert_eq!(keys, ["exit_code", "phase", "pid", "rank", "reason", "role", "signal", "stderr_tail"]);
        // An empty node is no node.
        assert_eq!(accept(Address::EngineCore, &body(Some("")).encode()).unwrap().who.node, None);
    }

    #[test]
    fn only_the_engine_core_may_report() {
        for sender in [Address::Frontend, Address::Worker(0)] {
            let err = accept(sender, &body(None).encode()).unwrap_err();
            assert_eq!(err, format!("only engine_core reports the death of a remote process, not {sender}"));
        }
    }

    #[test]
    fn a_body_that_does_not_decode_is_refused_and_shown_escaped() {
        let no_pid = {
            #[derive(serde::Serialize)]
            struct B {
                role: &'static str,
                rank: u32,
            }
            rmp_serde::to_vec_named(&B { role: "worker", rank: 1 }).unwrap()
        };
        let gpu = PeerDiedBody { role: "gpu".into(), ..body(None) }.encode();
        let frontend = PeerDiedBody { role: "frontend".into(), ..body(None) }.encode();
        let cases: [(&[u8], &str); 5] = [
            (b"\xc1\x1b[31mred", "b\"\\xc1\\x1b[31mred\""),
            (&no_pid, "missing field `pid`"),
            (&gpu, "role \"gpu\" is not worker"),
            (&frontend, "role \"frontend\" is not worker"),
            (b"\xc3", "invalid type: boolean `true`"),
        ];
        for (bytes, expected) in cases {
            let err = accept(Address::EngineCore, bytes).unwrap_err();
            assert!(err.starts_with("its body is not a PEER_DIED map ("), "{err}");
            assert!(err.contains(expected), "{expected:?} not in {err}");
            assert!(!err.contains('\x1b'), "{err}");
        }
        let long = accept(Address::EngineCore, &[0xc1; 1000]).unwrap_err();
        assert!(long.ends_with("\"...") && long.len() < 4 * SHOWN_BYTES + 200, "{long}");
    }

    #[test]
    fn what_is_printed_is_one_line_each_and_the_tail_is_bounded() {
        let mut b = body(Some("node\n1"));
        b.reason = "worker:1 died\n\x1b[2Jcleared".into();
        b.stderr_tail = (0..TAIL_LINES + 5).map(|i| format!("line {i}")).collect();
        b.stderr_tail.push("two\nlines".into());
        let death = accept(Address::EngineCore, &b.encode()).unwrap();
        assert_eq!(death.body.reason, "worker:1 died\\n\\u{1b}[2Jcleared");
        assert_eq!(death.who.node.as_deref(), Some("node\\n1"));
        assert_eq!(death.body.stderr_tail.len(), TAIL_LINES);
        assert_eq!(death.body.stderr_tail[TAIL_LINES - 2..], ["two", "lines"]);
    }

    #[test]
    fn the_report_names_the_remote_process_and_its_node() {
        let death = accept(Address::EngineCore, &body(Some("10.0.0.2")).encode()).unwrap();
        let text = death.render(2);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "loom-supervisor: worker:1 (pid 1234 on node 10.0.0.2) was killed by SIGKILL in phase 'running'",
                "loom-supervisor:   role: worker, rank: 1, pid: 1234, node: 10.0.0.2",
                "loom-supervisor:   engine_core reported: worker:1 died: the actor's node was lost",
                "loom-supervisor:   last 2 lines of its stderr:",
                "loom-supervisor:   | loading",
                "loom-supervisor:   | CUDA error: out of memory",
                "loom-supervisor: stopped the other 2 processes; exiting with code 1",
            ]
        );
    }

    #[test]
    fn the_report_without_node_code_or_signal() {
        let b = PeerDiedBody {
            signal: None,
            phase: "starting".into(),
            reason: String::new(),
            stderr_tail: vec![],
            ..body(None)
        };
        let text = accept(Address::EngineCore, &b.encode()).unwrap().render(1);
        assert!(text.starts_with("loom-supervisor: worker:1 (pid 1234) died in phase 'starting'\n"), "{text}");
        assert!(text.contains("  no lines of its stderr came with the report\n"), "{text}");
        assert!(!text.contains("engine_core reported"), "{text}");
        let coded = PeerDiedBody { signal: None, exit_code: Some(3), phase: "config".into(), ..body(None) };
        let text = accept(Address::EngineCore, &coded.encode()).unwrap().render(1);
        assert!(text.contains("worker:1 (pid 1234) exited with code 3 in start-up phase 'config'"), "{text}");
    }
}
