//! Routing frames between children: one connection per child, identified by its peer pid
//! and its HELLO; every later frame is checked (version, `src` = the connection's own
//! address, known `dst`) and its bytes are queued, unchanged, to the destination's outbox.
//!
//! Each planned child has an outbox from the start, so a frame for a child that has not
//! connected yet waits for it instead of being lost. A full outbox (1024 frames) makes the
//! sender's reader wait: back-pressure, as a direct socket pair would give.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use crate::frame::{self, kind, Frame, FrameError, FrameReader, Header};
use crate::hello::{check_hello, Expected};
use crate::remote;
use crate::spec::{Address, Plan, ProcessSpec, Role, WIRE_VERSION};
use crate::supervisor::Event;

const OUTBOX_FRAMES: usize = 1024;
const IO_BUFFER: usize = 64 * 1024;

type Bytes = Arc<Vec<u8>>;

/// Why a well-formed frame was not relayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("wire version {0}; this supervisor speaks {WIRE_VERSION}")]
    Version(u32),
    #[error("src {claimed:?} is not the sender, which registered as {actual}")]
    Spoofed { claimed: String, actual: Address },
    #[error("unknown dst {0:?}")]
    UnknownDst(String),
}

/// Where a frame goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Supervisor,
    /// One child, by plan index.
    One(usize),
    /// Every worker except the sender, by plan index.
    Workers(Vec<usize>),
}

struct Outbox {
    tx: mpsc::Sender<Bytes>,
    rx: Mutex<Option<mpsc::Receiver<Bytes>>>,
}

/// The routing table of a plan; fixed for the whole serve.
pub struct Routes {
    addresses: Vec<Address>,
    index: HashMap<Address, usize>,
    workers: Vec<usize>,
    outboxes: Vec<Outbox>,
}

impl Routes {
    pub fn new(plan: &Plan) -> Routes {
        let addresses: Vec<Address> = plan.processes.iter().map(ProcessSpec::address).collect();
        let index = addresses.iter().enumerate().map(|(i, a)| (*a, i)).collect();
        let workers = (0..addresses.len()).filter(|&i| plan.processes[i].role == Role::Worker).collect();
        let outboxes = addresses
            .iter()
            .map(|_| {
                let (tx, rx) = mpsc::channel(OUTBOX_FRAMES);
                Outbox { tx, rx: Mutex::new(Some(rx)) }
            })
            .collect();
        Routes { addresses, index, workers, outboxes }
    }

    pub fn address(&self, idx: usize) -> Address {
        self.addresses[idx]
    }

    /// Decides where a frame from child `sender` goes.
    pub fn route(&self, sender: usize, header: &Header) -> Result<Route, RouteError> {
        if header.version != WIRE_VERSION {
            return Err(RouteError::Version(header.version));
        }
        let actual = self.addresses[sender];
        if Address::parse(&header.src) != Some(actual) {
            return Err(RouteError::Spoofed { claimed: header.src.clone(), actual });
        }
        let unknown = || RouteError::UnknownDst(header.dst.clone());
        match Address::parse(&header.dst).ok_or_else(unknown)? {
            Address::Supervisor => Ok(Route::Supervisor),
            Address::Workers if self.workers.is_empty() => Err(unknown()),
            Address::Workers => Ok(Route::Workers(self.workers.iter().copied().filter(|&i| i != sender).collect())),
            dst => self.index.get(&dst).map(|&i| Route::One(i)).ok_or_else(unknown),
        }
    }

    /// Queues bytes for child `idx`; false when its connection is gone for good.
    pub async fn deliver(&self, idx: usize, bytes: Bytes) -> bool {
        self.outboxes[idx].tx.send(bytes).await.is_ok()
    }

    /// Queues without waiting (supervisor messages); false when full or gone.
    pub fn try_deliver(&self, idx: usize, bytes: Bytes) -> bool {
        self.outboxes[idx].tx.try_send(bytes).is_ok()
    }

    /// The receiving end of `idx`'s outbox, once: a second connection gets `None`.
    fn claim(&self, idx: usize) -> Option<mpsc::Receiver<Bytes>> {
        self.outboxes[idx].rx.lock().ok()?.take()
    }
}

/// What every connection task shares.
pub struct Relay {
    pub routes: Routes,
    pub by_pid: HashMap<u32, usize>,
    roles: Vec<(Role, u32)>,
    messages_version: u32,
    config: Vec<u8>,
    max_frame_bytes: usize,
    events: mpsc::UnboundedSender<Event>,
}

impl Relay {
    pub fn new(plan: &Plan, pids: &[u32], events: mpsc::UnboundedSender<Event>) -> Relay {
        Relay {
            routes: Routes::new(plan),
            by_pid: pids.iter().enumerate().map(|(i, &pid)| (pid, i)).collect(),
            roles: plan.processes.iter().map(|p| (p.role, p.rank)).collect(),
            messages_version: plan.messages_version,
            config: plan.config.clone(),
            max_frame_bytes: plan.max_frame_bytes,
            events,
        }
    }

    fn event(&self, event: Event) {
        // The receiver lives as long as the serve; after it, nothing matters.
        let _ = self.events.send(event);
    }
}

pub async fn accept_loop(listener: UnixListener, relay: Arc<Relay>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, relay.clone()));
            }
            Err(e) => {
                log::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

async fn connection(stream: UnixStream, relay: Arc<Relay>) {
    let pid = match stream.peer_cred().map(|c| c.pid()) {
        Ok(Some(pid)) => pid as u32,
        other => {
            log::warn!("rejected a connection: cannot read its peer credentials ({other:?})");
            return;
        }
    };
    let Some(&idx) = relay.by_pid.get(&pid) else {
        log::warn!("rejected a connection from pid {pid}: not a process of this serve");
        return;
    };
    let me = relay.routes.address(idx);
    let (rd, wr) = stream.into_split();
    let mut reader = FrameReader::new(BufReader::with_capacity(IO_BUFFER, rd), relay.max_frame_bytes);

    // Start-up: nothing but a valid HELLO registers the connection.
    loop {
        let frame = match reader.next().await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e @ FrameError::TooLarge { .. }))) => {
                relay.event(Event::Protocol { idx, reason: e.to_string() });
                return;
            }
            Ok(Some(Err(e))) => {
                log::warn!("{me} (pid {pid}): {e}");
                continue;
            }
            Ok(None) | Err(_) => return, // the child's exit is reported by its wait task
        };
        if frame.header.kind != kind::HELLO {
            log::warn!("{me} (pid {pid}): {} frame before HELLO dropped", frame.header.kind);
            continue;
        }
        let expected = Expected { address: me, role: relay.roles[idx], pid, messages_version: relay.messages_version };
        if let Err(reason) = check_hello(&frame, &expected) {
            relay.event(Event::BadHello { idx, reason });
            return;
        }
        break;
    }
    let Some(outbox) = relay.routes.claim(idx) else {
        log::warn!("{me} (pid {pid}): second connection rejected");
        return;
    };
    relay.event(Event::Hello { idx });
    let config = match frame::encode(WIRE_VERSION, "supervisor", &me.to_string(), kind::CONFIG, &relay.config) {
        Ok(bytes) => bytes,
        Err(e) => {
            relay.event(Event::BadHello { idx, reason: format!("cannot encode its CONFIG: {e}") });
            return;
        }
    };
    tokio::spawn(write_loop(wr, outbox, config, relay.clone(), idx));

    loop {
        let frame = match reader.next().await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e @ FrameError::TooLarge { .. }))) => {
                // Nothing after it can be found in the stream: close, and let the supervisor report it.
                relay.event(Event::Protocol { idx, reason: e.to_string() });
                break;
            }
            Ok(Some(Err(e))) => {
                log::warn!("{me}: {e}");
                continue;
            }
            Ok(None) => break,
            Err(e) => {
                log::debug!("{me}: connection broke: {e}");
                break;
            }
        };
        relay_frame(&relay, idx, frame).await;
    }
    relay.event(Event::Disconnected { idx });
}

async fn relay_frame(relay: &Relay, idx: usize, frame: Frame) {
    let me = relay.routes.address(idx);
    let route = match relay.routes.route(idx, &frame.header) {
        Ok(route) => route,
        Err(e) => {
            log::warn!("{} frame from {me} rejected: {e}", frame.header.kind);
            return;
        }
    };
    let targets = match route {
        Route::Supervisor => {
            match frame.header.kind.as_str() {
                kind::READY => relay.event(Event::Ready { idx }),
                kind::HEARTBEAT => relay.event(Event::Heartbeat { idx }),
                kind::REMOTE_DIED => match remote::accept(me, frame.body()) {
                    Ok(death) => relay.event(Event::RemoteDied(death)),
                    Err(why) => log::warn!("REMOTE_DIED frame from {me} dropped: {why}"),
                },
                kind::HELLO => log::warn!("{me}: second HELLO ignored"),
                other => log::warn!("{me}: the supervisor does not handle {other} frames; dropped"),
            }
            return;
        }
        Route::One(i) => vec![i],
        Route::Workers(all) => all,
    };
    for target in targets {
        if !relay.routes.deliver(target, frame.raw.clone()).await {
            log::debug!("{} frame from {me} dropped: {} is gone", frame.header.kind, relay.routes.address(target));
        }
    }
}

async fn write_loop(
    wr: OwnedWriteHalf,
    mut outbox: mpsc::Receiver<Bytes>,
    config: Vec<u8>,
    relay: Arc<Relay>,
    idx: usize,
) {
    let mut out = BufWriter::with_capacity(IO_BUFFER, wr);
    if out.write_all(&config).await.is_err() || out.flush().await.is_err() {
        return;
    }
    relay.event(Event::ConfigSent { idx });
    while let Some(bytes) = outbox.recv().await {
        if out.write_all(&bytes).await.is_err() {
            return;
        }
        // Coalesce what is already queued into one write.
        while let Ok(more) = outbox.try_recv() {
            if out.write_all(&more).await.is_err() {
                return;
            }
        }
        if out.flush().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// frontend, engine_core, worker:0, worker:1, worker:2
    fn plan() -> Plan {
        #[derive(serde::Serialize)]
        struct P {
            role: &'static str,
            rank: u32,
            argv: Vec<&'static str>,
        }
        #[derive(serde::Serialize)]
        struct D {
            processes: Vec<P>,
        }
        let p = |role, rank| P { role, rank, argv: vec!["x"] };
        let d = D {
            processes: vec![p("frontend", 0), p("engine_core", 0), p("worker", 0), p("worker", 1), p("worker", 2)],
        };
        Plan::from_msgpack(&rmp_serde::to_vec_named(&d).unwrap()).unwrap()
    }

    fn header(src: &str, dst: &str) -> Header {
        Header { version: WIRE_VERSION, src: src.into(), dst: dst.into(), kind: "ECHO".into(), body: 0..0 }
    }

    #[test]
    fn routes_to_one_process() {
        let routes = Routes::new(&plan());
        assert_eq!(routes.route(1, &header("engine_core", "worker:1")), Ok(Route::One(3)));
        assert_eq!(routes.route(3, &header("worker:1", "engine_core")), Ok(Route::One(1)));
        assert_eq!(routes.route(0, &header("frontend", "supervisor")), Ok(Route::Supervisor));
    }

    #[test]
    fn fan_out_reaches_every_other_worker() {
        let routes = Routes::new(&plan());
        assert_eq!(routes.route(1, &header("engine_core", "workers")), Ok(Route::Workers(vec![2, 3, 4])));
        assert_eq!(routes.route(3, &header("worker:1", "workers")), Ok(Route::Workers(vec![2, 4])));
    }

    #[test]
    fn unknown_destinations_are_rejected() {
        let routes = Routes::new(&plan());
        for dst in ["worker:3", "worker:01", "gpu", "", "Frontend"] {
            assert_eq!(routes.route(1, &header("engine_core", dst)), Err(RouteError::UnknownDst(dst.into())));
        }
    }

    #[test]
    fn spoofed_sources_are_rejected() {
        let routes = Routes::new(&plan());
        let err = routes.route(2, &header("engine_core", "frontend")).unwrap_err();
        assert_eq!(err, RouteError::Spoofed { claimed: "engine_core".into(), actual: Address::Worker(0) });
        assert!(routes.route(2, &header("supervisor", "frontend")).is_err());
        assert!(routes.route(2, &header("workers", "frontend")).is_err());
    }

    #[test]
    fn other_wire_versions_are_rejected() {
        let routes = Routes::new(&plan());
        let mut h = header("frontend", "engine_core");
        h.version = WIRE_VERSION + 1;
        assert_eq!(routes.route(0, &h), Err(RouteError::Version(WIRE_VERSION + 1)));
    }

    #[test]
    fn fan_out_without_workers_is_unknown() {
        #[derive(serde::Serialize)]
        struct P {
            role: &'static str,
            argv: Vec<&'static str>,
        }
        #[derive(serde::Serialize)]
        struct D {
            processes: Vec<P>,
        }
        let d = D { processes: vec![P { role: "frontend", argv: vec!["x"] }] };
        let routes = Routes::new(&Plan::from_msgpack(&rmp_serde::to_vec_named(&d).unwrap()).unwrap());
        assert!(routes.route(0, &header("frontend", "workers")).is_err());
    }

    #[test]
    fn outboxes_queue_until_claimed_and_claim_once() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let routes = Routes::new(&plan());
        rt.block_on(async {
            assert!(routes.deliver(3, Arc::new(b"frame".to_vec())).await);
            let mut rx = routes.claim(3).unwrap();
            assert!(routes.claim(3).is_none());
            assert_eq!(rx.recv().await.unwrap().as_slice(), b"frame");
        });
    }
}
