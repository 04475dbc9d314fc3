//! The HELLO check: a child must be exactly what the supervisor spawned under its pid,
//! speaking this wire format and stating the plan's messages version.

use serde::Deserialize;

use crate::frame::Frame;
use crate::spec::{Address, Role, WIRE_VERSION};

#[derive(Deserialize)]
struct HelloBody {
    role: String,
    rank: u32,
    pid: u32,
    messages_version: u32,
}

/// What a child's HELLO must say: who the supervisor spawned under that pid.
pub(crate) struct Expected {
    pub address: Address,
    pub role: (Role, u32),
    pub pid: u32,
    /// The plan's `messages_version`.
    pub messages_version: u32,
}

/// Checks a HELLO against what the supervisor spawned for that pid. Any mismatch is fatal
/// for the child: a process that is not what the plan says cannot be trusted to serve.
pub(crate) fn check_hello(frame: &Frame, expected: &Expected) -> Result<(), String> {
    let h = &frame.header;
    let me = expected.address;
    if h.version != WIRE_VERSION {
        return Err(format!("its frames use wire format version {}; this supervisor speaks {WIRE_VERSION}", h.version));
    }
    let body: HelloBody = rmp_serde::from_slice(frame.body())
        .map_err(|e| format!("its HELLO body is not a msgpack map {{role, rank, pid, messages_version}}: {e}"))?;
    if body.messages_version != expected.messages_version {
        return Err(format!(
            "it speaks messages version {}; the plan expects {}",
            body.messages_version, expected.messages_version
        ));
    }
    if Address::parse(&h.src) != Some(me) || h.dst != "supervisor" {
        return Err(format!("its HELLO goes from {:?} to {:?}; expected {me} to supervisor", h.src, h.dst));
    }
    let (role, rank) = expected.role;
    if Role::parse(&body.role) != Some(role) || body.rank != rank {
        return Err(format!("its HELLO says role {} rank {}; it was spawned as {me}", body.role, body.rank));
    }
    if body.pid != expected.pid {
        return Err(format!("its HELLO says pid {}; the socket peer is pid {}", body.pid, expected.pid));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::frame::{self, kind, Header};

    fn hello(src: &str, role: &str, rank: u32, pid: u32, version: u32) -> Frame {
        hello_with(src, role, rank, pid, version, version)
    }

    fn hello_with(src: &str, role: &str, rank: u32, pid: u32, wire: u32, version: u32) -> Frame {
        #[derive(serde::Serialize)]
        struct H<'a> {
            role: &'a str,
            rank: u32,
            pid: u32,
            messages_version: u32,
        }
        let body = rmp_serde::to_vec_named(&H { role, rank, pid, messages_version: version }).unwrap();
        let raw = frame::encode(wire, src, "supervisor", kind::HELLO, &body).unwrap();
        let header = Header::parse(&raw[4..]).unwrap();
        Frame { raw: Arc::new(raw), header }
    }

    #[test]
    fn hello_must_match_the_spawned_process() {
        let ok = Expected { address: Address::Worker(1), role: (Role::Worker, 1), pid: 42, messages_version: 1 };
        assert!(check_hello(&hello("worker:1", "worker", 1, 42, 1), &ok).is_ok());
        let err = check_hello(&hello_with("worker:1", "worker", 1, 42, 1, 2), &ok).unwrap_err();
        assert!(err.contains("messages version 2; the plan expects 1"), "{err}");
        let err = check_hello(&hello("worker:1", "worker", 1, 42, 2), &ok).unwrap_err();
        assert!(err.contains("wire format version 2"), "{err}");
        let err = check_hello(&hello("worker:1", "worker", 2, 42, 1), &ok).unwrap_err();
        assert!(err.contains("spawned as worker:1"), "{err}");
        let err = check_hello(&hello("worker:1", "worker", 1, 43, 1), &ok).unwrap_err();
        assert!(err.contains("pid 43"), "{err}");
        let err = check_hello(&hello("engine_core", "worker", 1, 42, 1), &ok).unwrap_err();
        assert!(err.contains("expected worker:1"), "{err}");
        // The plan decides which message version the children must speak.
        let v7 = Expected { messages_version: 7, ..ok };
        assert!(check_hello(&hello_with("worker:1", "worker", 1, 42, 1, 7), &v7).is_ok());
    }

    #[test]
    fn a_hello_with_the_old_version_key_names_the_missing_one() {
        #[derive(serde::Serialize)]
        struct Old {
            role: &'static str,
            rank: u32,
            pid: u32,
            protocol_version: u32,
        }
        let body = rmp_serde::to_vec_named(&Old { role: "worker", rank: 1, pid: 42, protocol_version: 1 }).unwrap();
        let raw = frame::encode(WIRE_VERSION, "worker:1", "supervisor", kind::HELLO, &body).unwrap();
        let frame = Frame { header: Header::parse(&raw[4..]).unwrap(), raw: Arc::new(raw) };
        let ok = Expected { address: Address::Worker(1), role: (Role::Worker, 1), pid: 42, messages_version: 1 };
        let err = check_hello(&frame, &ok).unwrap_err();
        assert!(err.contains("missing field `messages_version`"), "{err}");
    }
}
