//! The supervisor's part of a start-up trace: when it spawned each child, and when that
//! child's HELLO, CONFIG and READY happened, in the wall clock (nanoseconds since the UNIX
//! epoch: the clock of Python's `time.time_ns()`, which the children record their own spans
//! in). Only built when the plan names a `startup_trace_dir`.
//!
//! Written once as `<dir>/supervisor.json`: when every child is READY, or when the serve ends
//! before that (with nulls for what did not happen). The process that asked for the trace
//! polls for that file and merges it with the children's; it is written under a temporary
//! name and renamed, so it never sees half of it. A failed write is logged, never fatal.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::spec::Plan;

/// The file name the process that asked for the trace waits for.
pub const FILE_NAME: &str = "supervisor.json";

/// Now, in nanoseconds since the UNIX epoch.
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// One child's start-up instants; `None` until (unless) they happen.
#[derive(Debug, Default)]
struct ChildTimes {
    address: String,
    role: &'static str,
    rank: u32,
    pid: Option<u32>,
    spawn_ns: Option<u64>,
    spawned_ns: Option<u64>,
    hello_ns: Option<u64>,
    config_ns: Option<u64>,
    ready_ns: Option<u64>,
}

/// The start-up instants of one serve, in plan order.
#[derive(Debug)]
pub struct Timeline {
    dir: PathBuf,
    plan_ns: u64,
    children: Vec<ChildTimes>,
    ready_ns: Option<u64>,
    written: bool,
}

impl Timeline {
    /// Starts the timeline of `plan` (call it when supervision starts).
    pub fn new(dir: PathBuf, plan: &Plan) -> Timeline {
        let children = plan
            .processes
            .iter()
            .map(|p| ChildTimes {
                address: p.address().to_string(),
                role: p.role.as_str(),
                rank: p.rank,
                ..Default::default()
            })
            .collect();
        Timeline { dir, plan_ns: now_ns(), children, ready_ns: None, written: false }
    }

    /// Child `idx` is about to be spawned.
    pub fn spawning(&mut self, idx: usize) {
        self.children[idx].spawn_ns = Some(now_ns());
    }

    /// Child `idx` runs as `pid`.
    pub fn spawned(&mut self, idx: usize, pid: u32) {
        let child = &mut self.children[idx];
        child.spawned_ns = Some(now_ns());
        child.pid = Some(pid);
    }

    /// Child `idx`'s HELLO arrived.
    pub fn hello(&mut self, idx: usize) {
        self.children[idx].hello_ns.get_or_insert_with(now_ns);
    }

    /// CONFIG went to child `idx`.
    pub fn config(&mut self, idx: usize) {
        self.children[idx].config_ns.get_or_insert_with(now_ns);
    }

    /// Child `idx`'s READY was accepted.
    pub fn ready(&mut self, idx: usize) {
        self.children[idx].ready_ns.get_or_insert_with(now_ns);
    }

    /// Every child is READY: the end of start-up, and the moment the file is written.
    pub fn all_ready(&mut self) {
        self.ready_ns = Some(now_ns());
        self.write("ready");
    }

    /// The serve ended; writes the file if start-up never finished. `outcome` says how it
    /// ended ("failed", "stopped", ...).
    pub fn finish(&mut self, outcome: &str) {
        if !self.written {
            self.write(outcome);
        }
    }

    fn write(&mut self, outcome: &str) {
        self.written = true;
        if let Err(e) = self.write_file(outcome) {
            log::warn!("could not write the start-up trace into {}: {e}", self.dir.display());
        }
    }

    fn write_file(&self, outcome: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, self.to_json(outcome))?;
        std::fs::rename(&tmp, self.dir.join(FILE_NAME))
    }

    /// The file's text: `{supervisor_pid, plan_ns, ready_ns, outcome, children: [{address,
    /// role, rank, pid, spawn_ns, spawned_ns, hello_ns, config_ns, ready_ns}]}`.
    fn to_json(&self, outcome: &str) -> String {
        let mut out = String::with_capacity(256 + 256 * self.children.len());
        let _ = write!(
            out,
            "{{\"supervisor_pid\":{},\"plan_ns\":{},\"ready_ns\":{},\"outcome\":{},\"children\":[",
            std::process::id(),
            self.plan_ns,
            number(self.ready_ns),
            string(outcome)
        );
        for (i, c) in self.children.iter().enumerate() {
            let _ = write!(
                out,
                "{}{{\"address\":{},\"role\":{},\"rank\":{},\"pid\":{},\"spawn_ns\":{},\"spawned_ns\":{},\
                 \"hello_ns\":{},\"config_ns\":{},\"ready_ns\":{}}}",
                if i == 0 { "" } else { "," },
                string(&c.address),
                string(c.role),
                c.rank,
                number(c.pid.map(u64::from)),
                number(c.spawn_ns),
                number(c.spawned_ns),
                number(c.hello_ns),
                number(c.config_ns),
                number(c.ready_ns),
            );
        }
        out.push_str("]}");
        out
    }
}

fn number(value: Option<u64>) -> String {
    value.map_or_else(|| "null".to_string(), |v| v.to_string())
}

/// A JSON string literal.
fn string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ProcessSpec, Role};
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn plan() -> Plan {
        let process = |role, rank| ProcessSpec { role, rank, argv: vec!["/bin/true".into()], env: BTreeMap::new() };
        Plan {
            processes: vec![process(Role::Frontend, 0), process(Role::Worker, 1)],
            config: vec![],
            startup_timeout: Duration::from_secs(1),
            grace_period: Duration::from_secs(1),
            max_frame_bytes: 1 << 20,
            heartbeat_timeout: None,
            ready_url: None,
            messages_version: 1,
            startup_trace_dir: None,
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("loom-timeline-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn writes_every_instant_once_all_are_ready() {
        let dir = temp_dir("ready");
        let mut t = Timeline::new(dir.join("nested"), &plan());
        for idx in 0..2 {
            t.spawning(idx);
            t.spawned(idx, 40 + idx as u32);
            t.hello(idx);
            t.config(idx);
            t.ready(idx);
        }
        t.all_ready();
        let text = std::fs::read_to_string(dir.join("nested").join(FILE_NAME)).unwrap();
        assert!(text.starts_with(&format!("{{\"supervisor_pid\":{},", std::process::id())), "{text}");
        assert!(text.contains("\"outcome\":\"ready\""), "{text}");
        assert!(text.contains("\"address\":\"worker:1\",\"role\":\"worker\",\"rank\":1,\"pid\":41,"), "{text}");
        assert!(!text.contains("null"), "{text}");
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        // no temporary file is left beside it
        let names: Vec<_> = std::fs::read_dir(dir.join("nested")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(FILE_NAME)]);
        // a later end does not rewrite it
        t.finish("stopped");
        assert!(std::fs::read_to_string(dir.join("nested").join(FILE_NAME)).unwrap().contains("\"ready\""));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_start_up_that_never_finished_is_written_with_nulls() {
        let dir = temp_dir("failed");
        let mut t = Timeline::new(dir.clone(), &plan());
        t.spawning(0);
        t.spawned(0, 7);
        t.finish("failed");
        let text = std::fs::read_to_string(dir.join(FILE_NAME)).unwrap();
        assert!(text.contains("\"ready_ns\":null,\"outcome\":\"failed\""), "{text}");
        assert!(text.contains("\"pid\":7,"), "{text}");
        assert!(text.contains("\"address\":\"worker:1\",\"role\":\"worker\",\"rank\":1,\"pid\":null,\"spawn_ns\":null"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_not_an_error() {
        let mut t = Timeline::new(PathBuf::from("/proc/loom-cannot-write-here"), &plan());
        t.all_ready(); // logged, not raised
    }

    #[test]
    fn strings_are_escaped() {
        assert_eq!(string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
