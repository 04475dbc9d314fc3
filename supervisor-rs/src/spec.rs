//! The launch plan: which processes a serve runs and the limits it runs them under.
//!
//! The CLI process (`loom serve`) builds the plan in Python and hands it over as msgpack
//! (`loom_supervisor.run` packs a dict; `loom-supervisor serve` reads it from
//! `python -m loom.entrypoints.plan`). Field names are the wire names; the Python side is
//! the `loom_supervisor.Plan` dataclass, whose defaults are the ones applied here.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Version of the wire format: the frame header's first item, and nothing else. (It is
/// also the default of the plan's `messages_version`, which versions loom's messages.)
pub const WIRE_VERSION: u32 = 1;

/// Environment variables the supervisor sets in every child, over the plan's `env`.
pub const ENV_SOCKET: &str = "LOOM_SUPERVISOR_SOCKET";
pub const ENV_ROLE: &str = "LOOM_ROLE";
pub const ENV_RANK: &str = "LOOM_RANK";

const DEFAULT_STARTUP_TIMEOUT_S: f64 = 300.0;
const DEFAULT_GRACE_PERIOD_S: f64 = 10.0;
const DEFAULT_MAX_FRAME_BYTES: u64 = 64 << 20;
/// Below this a HELLO or a PEER_DIED report would not fit.
const MIN_MAX_FRAME_BYTES: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Frontend,
    EngineCore,
    Worker,
}

impl Role {
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "frontend" => Some(Role::Frontend),
            "engine_core" => Some(Role::EngineCore),
            "worker" => Some(Role::Worker),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Frontend => "frontend",
            Role::EngineCore => "engine_core",
            Role::Worker => "worker",
        }
    }
}

/// A frame's `src` or `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Address {
    Frontend,
    EngineCore,
    Worker(u32),
    /// Fan-out to every worker (a destination only).
    Workers,
    Supervisor,
}

impl Address {
    pub fn parse(text: &str) -> Option<Address> {
        match text {
            "frontend" => Some(Address::Frontend),
            "engine_core" => Some(Address::EngineCore),
            "workers" => Some(Address::Workers),
            "supervisor" => Some(Address::Supervisor),
            _ => {
                let rank = text.strip_prefix("worker:")?;
                // Only canonical decimal ranks ("worker:01" would alias "worker:1").
                if rank.is_empty() || (rank.len() > 1 && rank.starts_with('0')) {
                    return None;
                }
                rank.parse().ok().map(Address::Worker)
            }
        }
    }

    /// The address of one process: frontends and engine cores are unique, so their rank
    /// does not appear in it.
    pub fn of(role: Role, rank: u32) -> Address {
        match role {
            Role::Frontend => Address::Frontend,
            Role::EngineCore => Address::EngineCore,
            Role::Worker => Address::Worker(rank),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Frontend => f.write_str("frontend"),
            Address::EngineCore => f.write_str("engine_core"),
            Address::Worker(rank) => write!(f, "worker:{rank}"),
            Address::Workers => f.write_str("workers"),
            Address::Supervisor => f.write_str("supervisor"),
        }
    }
}

/// One child of the serve.
#[derive(Clone, Debug)]
pub struct ProcessSpec {
    pub role: Role,
    pub rank: u32,
    /// `argv[0]` is the program (an absolute interpreter path in practice: the child's
    /// environment is replaced, so `PATH` lookup uses the plan's `PATH`, if any).
    pub argv: Vec<String>,
    /// The child's complete environment, before the supervisor adds `LOOM_*` variables.
    pub env: BTreeMap<String, String>,
}

impl ProcessSpec {
    pub fn address(&self) -> Address {
        Address::of(self.role, self.rank)
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// In plan order; this is also the order of `SIGTERM` within a role.
    pub processes: Vec<ProcessSpec>,
    /// Opaque serialized config, sent unchanged to every child in CONFIG.
    pub config: Vec<u8>,
    /// Deadline for each start-up phase (HELLO after spawn, READY after CONFIG).
    pub startup_timeout: Duration,
    /// How long a child gets to exit after SHUTDOWN or SIGTERM before the next step.
    pub grace_period: Duration,
    pub max_frame_bytes: usize,
    /// Once every process is READY, a child silent (no HEARTBEAT) for this long is reported
    /// as not responding, like a death; None: not watched.
    pub heartbeat_timeout: Option<Duration>,
    /// Printed once every process is READY.
    pub ready_url: Option<String>,
    /// The version of the message schema the children exchange (owned by loom, opaque
    /// here): every HELLO must state it, so a child from another installation is stopped
    /// before it misreads a message.
    pub messages_version: u32,
    /// Where to write the supervisor's part of a start-up trace (`timeline.rs`); None: no
    /// trace, and nothing is recorded.
    pub startup_trace_dir: Option<PathBuf>,
}

/// The plan as it arrives on the wire (msgpack map with these keys). An unknown key is
/// an error, not ignored: a misspelt or renamed limit must not silently become a default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    processes: Vec<RawProcess>,
    #[serde(default, with = "serde_bytes")]
    config: Vec<u8>,
    #[serde(default)]
    startup_timeout_s: Option<f64>,
    #[serde(default)]
    grace_period_s: Option<f64>,
    #[serde(default)]
    max_frame_bytes: Option<u64>,
    #[serde(default)]
    heartbeat_timeout_s: Option<f64>,
    #[serde(default)]
    ready_url: Option<String>,
    #[serde(default)]
    messages_version: Option<u32>,
    #[serde(default)]
    startup_trace_dir: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcess {
    role: String,
    #[serde(default)]
    rank: u32,
    argv: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

impl Plan {
    /// Decodes and validates a msgpack plan.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Plan> {
        let raw: RawPlan = rmp_serde::from_slice(bytes).map_err(|e| Error::Plan(e.to_string()))?;
        Plan::from_raw(raw)
    }

    fn from_raw(raw: RawPlan) -> Result<Plan> {
        if raw.processes.is_empty() {
            return Err(Error::Plan("`processes` is empty".into()));
        }
        let mut processes = Vec::with_capacity(raw.processes.len());
        let mut seen = HashSet::new();
        for (i, p) in raw.processes.into_iter().enumerate() {
            let role = Role::parse(&p.role).ok_or_else(|| {
                Error::Plan(format!(
                    "processes[{i}].role is {:?}; expected \"frontend\", \"engine_core\" or \"worker\"",
                    p.role
                ))
            })?;
            if p.argv.is_empty() || p.argv[0].is_empty() {
                return Err(Error::Plan(format!("processes[{i}].argv is empty")));
            }
            if let Some(key) = p.env.keys().find(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
                return Err(Error::Plan(format!("processes[{i}].env has an invalid name {key:?}")));
            }
            let spec = ProcessSpec { role, rank: p.rank, argv: p.argv, env: p.env };
            if !seen.insert(spec.address()) {
                return Err(Error::Plan(format!(
                    "processes[{i}] is a second {}; each address must be unique",
                    spec.address()
                )));
            }
            processes.push(spec);
        }
        let max_frame_bytes = raw.max_frame_bytes.unwrap_or(DEFAULT_MAX_FRAME_BYTES);
        if !(MIN_MAX_FRAME_BYTES..=u64::from(u32::MAX)).contains(&max_frame_bytes) {
            return Err(Error::Plan(format!(
                "max_frame_bytes is {max_frame_bytes}; expected {MIN_MAX_FRAME_BYTES}..={}",
                u32::MAX
            )));
        }
        if raw.startup_trace_dir.as_deref() == Some("") {
            return Err(Error::Plan("startup_trace_dir is empty; name a directory or leave it out".into()));
        }
        let max_frame_bytes = usize::try_from(max_frame_bytes)
            .map_err(|_| Error::Plan("max_frame_bytes does not fit this platform".into()))?;
        Ok(Plan {
            processes,
            config: raw.config,
            startup_timeout: seconds("startup_timeout_s", raw.startup_timeout_s, DEFAULT_STARTUP_TIMEOUT_S, false)?,
            grace_period: seconds("grace_period_s", raw.grace_period_s, DEFAULT_GRACE_PERIOD_S, true)?,
            max_frame_bytes,
            heartbeat_timeout: match raw.heartbeat_timeout_s {
                None => None,
                Some(0.0) => None,
                Some(s) => Some(seconds("heartbeat_timeout_s", Some(s), 0.0, false)?),
            },
            ready_url: raw.ready_url,
            messages_version: raw.messages_version.unwrap_or(WIRE_VERSION),
            startup_trace_dir: raw.startup_trace_dir.map(PathBuf::from),
        })
    }

    /// The process that SHUTDOWN and PEER_DIED go to and whose clean exit ends the serve:
    /// the frontend, else the engine core, else the first process of the plan.
    pub fn lead(&self) -> usize {
        let find = |role| self.processes.iter().position(|p| p.role == role);
        find(Role::Frontend).or_else(|| find(Role::EngineCore)).unwrap_or(0)
    }
}

fn seconds(field: &str, value: Option<f64>, default: f64, zero_ok: bool) -> Result<Duration> {
    let secs = value.unwrap_or(default);
    let valid = secs.is_finite() && (secs > 0.0 || (zero_ok && secs == 0.0));
    if !valid {
        return Err(Error::Plan(format!("{field} is {secs}; expected a positive number of seconds")));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| Error::Plan(format!("{field}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Serialize)]
    struct P<'a> {
        role: &'a str,
        rank: u32,
        argv: Vec<&'a str>,
    }

    #[derive(Serialize)]
    struct Doc<'a> {
        processes: Vec<P<'a>>,
        #[serde(with = "serde_bytes")]
        config: &'a [u8],
        startup_timeout_s: f64,
        max_frame_bytes: u64,
    }

    fn encode(processes: Vec<P>) -> Vec<u8> {
        let doc = Doc { processes, config: b"cfg", startup_timeout_s: 2.5, max_frame_bytes: 1 << 20 };
        rmp_serde::to_vec_named(&doc).unwrap()
    }

    /// A one-process plan with one extra top-level key.
    fn with_key(key: &str, value: u32) -> Vec<u8> {
        let mut doc = std::collections::BTreeMap::new();
        doc.insert(key, value);
        #[derive(Serialize)]
        struct Versioned<'a> {
            processes: Vec<P<'a>>,
            #[serde(flatten)]
            extra: std::collections::BTreeMap<&'a str, u32>,
        }
        let processes = vec![P { role: "worker", rank: 0, argv: vec!["/bin/true"] }];
        rmp_serde::to_vec_named(&Versioned { processes, extra: doc }).unwrap()
    }

    #[test]
    fn addresses_round_trip() {
        for text in ["frontend", "engine_core", "worker:0", "worker:12", "workers", "supervisor"] {
            assert_eq!(Address::parse(text).unwrap().to_string(), text);
        }
        for bad in ["worker:", "worker:-1", "worker:01", "worker:x", "Worker:1", "engine", ""] {
            assert!(Address::parse(bad).is_none(), "{bad:?} parsed");
        }
    }

    #[test]
    fn decodes_a_plan_with_defaults() {
        let plan = Plan::from_msgpack(&encode(vec![
            P { role: "frontend", rank: 0, argv: vec!["/bin/true"] },
            P { role: "worker", rank: 1, argv: vec!["/bin/true"] },
        ]))
        .unwrap();
        assert_eq!(plan.processes.len(), 2);
        assert_eq!(plan.config, b"cfg");
        assert_eq!(plan.startup_timeout, Duration::from_millis(2500));
        assert_eq!(plan.grace_period, Duration::from_secs(10));
        assert_eq!(plan.max_frame_bytes, 1 << 20);
        assert_eq!(plan.processes[1].address(), Address::Worker(1));
        assert_eq!(plan.lead(), 0);
        assert_eq!(plan.messages_version, WIRE_VERSION);
    }

    #[test]
    fn the_plan_sets_the_messages_version() {
        assert_eq!(Plan::from_msgpack(&with_key("messages_version", 7)).unwrap().messages_version, 7);
    }

    #[test]
    fn unknown_keys_are_rejected_by_name() {
        // The old name of `messages_version` must not fall back to the default silently.
        let err = Plan::from_msgpack(&with_key("protocol_version", 7)).unwrap_err().to_string();
        assert!(err.contains("unknown field `protocol_version`"), "{err}");
        assert!(err.contains("`messages_version`"), "{err}");
        #[derive(Serialize)]
        struct Proc<'a> {
            role: &'a str,
            argv: Vec<&'a str>,
            environment: Vec<&'a str>,
        }
        #[derive(Serialize)]
        struct OneProc<'a> {
            processes: Vec<Proc<'a>>,
        }
        let doc = OneProc { processes: vec![Proc { role: "worker", argv: vec!["/bin/true"], environment: vec![] }] };
        let err = Plan::from_msgpack(&rmp_serde::to_vec_named(&doc).unwrap()).unwrap_err().to_string();
        assert!(err.contains("unknown field `environment`"), "{err}");
    }

    #[test]
    fn the_plan_names_the_trace_directory_or_none() {
        assert_eq!(Plan::from_msgpack(&with_key("max_frame_bytes", 4096)).unwrap().startup_trace_dir, None);
        #[derive(Serialize)]
        struct Traced<'a> {
            processes: Vec<P<'a>>,
            startup_trace_dir: &'a str,
        }
        let encode = |dir| {
            let processes = vec![P { role: "worker", rank: 0, argv: vec!["/bin/true"] }];
            rmp_serde::to_vec_named(&Traced { processes, startup_trace_dir: dir }).unwrap()
        };
        let plan = Plan::from_msgpack(&encode("/tmp/t")).unwrap();
        assert_eq!(plan.startup_trace_dir, Some(PathBuf::from("/tmp/t")));
        let err = Plan::from_msgpack(&encode("")).unwrap_err().to_string();
        assert!(err.contains("startup_trace_dir is empty"), "{err}");
    }

    #[test]
    fn a_process_without_env_gets_an_empty_environment() {
        let plan = Plan::from_msgpack(&with_key("max_frame_bytes", 4096)).unwrap();
        assert!(plan.processes[0].env.is_empty());
        assert_eq!(plan.processes[0].rank, 0);
    }

    #[test]
    fn rejects_bad_plans_with_a_reason() {
        let dup = Plan::from_msgpack(&encode(vec![
            P { role: "worker", rank: 0, argv: vec!["a"] },
            P { role: "worker", rank: 0, argv: vec!["b"] },
        ]));
        assert!(dup.unwrap_err().to_string().contains("second worker:0"));
        let role = Plan::from_msgpack(&encode(vec![P { role: "gpu", rank: 0, argv: vec!["a"] }]));
        assert!(role.unwrap_err().to_string().contains("processes[0].role"));
        let argv = Plan::from_msgpack(&encode(vec![P { role: "worker", rank: 0, argv: vec![] }]));
        assert!(argv.unwrap_err().to_string().contains("argv is empty"));
        assert!(Plan::from_msgpack(b"\x01\x02").is_err());
    }
}
