//! One serve from spawn to exit: start-up (HELLO → CONFIG → READY with a deadline per
//! phase), then watching until a child fails, the lead process finishes, or a stop is
//! requested; `shutdown.rs` holds how each of those ends.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::net::UnixListener;
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::logs::Console;
use crate::relay::{self, Relay};
use crate::remote::RemoteDeath;
use crate::report::{Cause, Failure, Phase, Who};
use crate::rundir::RunDir;
use crate::shutdown::Deaths;
use crate::spawn::{self, Exit, Spawned};
use crate::spec::{Address, Plan, Role};
use crate::timeline::Timeline;

/// How long the frames a child sent just before exiting may take to be processed.
pub(crate) const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);
/// A child whose connection closed gets this long to exit before it is reported as a
/// process that lost its connection (a dying child closes the socket before it is reaped).
const EXIT_AFTER_DISCONNECT: Duration = Duration::from_secs(1);

/// What a deadline of the watch loop is for.
#[derive(Clone, Copy, Debug)]
enum Due {
    /// Judge an exit once its last frames are processed.
    Judge,
    /// A start-up phase took too long.
    Startup,
    /// No HEARTBEAT within the plan's heartbeat timeout.
    Silent,
    /// Its connection closed and it is still running.
    Disconnected,
}

/// What connection and child tasks tell the supervisor.
#[derive(Debug)]
pub enum Event {
    Exited {
        idx: usize,
        exit: Exit,
    },
    Hello {
        idx: usize,
    },
    /// Fatal for that child (wrong wire or messages version, wrong identity, bad body).
    BadHello {
        idx: usize,
        reason: String,
    },
    ConfigSent {
        idx: usize,
    },
    Ready {
        idx: usize,
    },
    Disconnected {
        idx: usize,
    },
    Heartbeat {
        idx: usize,
    },
    /// It sent a frame the protocol cannot follow; its connection is closed.
    Protocol {
        idx: usize,
        reason: String,
    },
    /// The engine core reported the death of a remote process (checked by `remote::accept`).
    RemoteDied(RemoteDeath),
}

/// The result of a serve that ran: the exit code to use and, for tests and callers, the
/// failure report and the run directory that was used (gone by now).
#[derive(Debug)]
pub struct Outcome {
    pub code: i32,
    pub report: Option<String>,
    pub run_dir: PathBuf,
}

pub(crate) struct Child {
    pub address: Address,
    pub role: Role,
    pub rank: u32,
    pub pid: u32,
    pub phase: Phase,
    pub deadline: Option<Instant>,
    pub exit: Option<Exit>,
    /// Its connection is registered / has reached EOF.
    pub connected: bool,
    pub disconnected: bool,
    /// Exited while its connection still had unread frames (a READY sent just before a
    /// clean exit): judged once the connection is drained, or at this instant.
    pub judge_at: Option<Instant>,
    /// The supervisor sent SIGKILL (after the grace period or on a second stop request).
    pub killed: bool,
    /// Its last HEARTBEAT (set for every child when the serve starts running).
    pub last_beat: Option<Instant>,
    /// Its connection closed while it lived: reported at this instant unless it exits first.
    pub gone_at: Option<Instant>,
    pub spawned: Spawned,
}

impl Child {
    pub fn alive(&self) -> bool {
        self.exit.is_none()
    }

    pub fn who(&self) -> Who {
        Who { address: self.address, role: self.role, rank: self.rank, pid: self.pid, node: None }
    }
}

pub(crate) enum Ending {
    Failed(Failure),
    /// A process outside the supervisor's children died: a failure all the same.
    RemoteDied(RemoteDeath),
    Stop(i32),
    LeadFinished,
}

pub(crate) struct Supervisor {
    pub plan: Plan,
    pub children: Vec<Child>,
    pub lead: usize,
    pub console: Console,
    pub relay: Arc<Relay>,
    pub report: Option<String>,
    pub escalated: bool,
    /// Which deaths are still reported once the serve is ending.
    pub deaths: Deaths,
    events: UnboundedReceiver<Event>,
    stops: UnboundedReceiver<i32>,
    run_dir: RunDir,
    accept: JoinHandle<()>,
    connected: usize,
    /// The start-up instants, when the plan asks for a start-up trace.
    timeline: Option<Timeline>,
}

/// Runs one serve. `stops` carries stop requests (signal numbers: SIGINT/SIGTERM); a
/// second one while stopping kills every child at once.
///
/// Must run on a current-thread runtime driven by a thread that lives for the whole serve
/// (see `spawn::spawn`).
pub async fn supervise(plan: Plan, console: Console, stops: UnboundedReceiver<i32>) -> Result<Outcome> {
    let mut timeline = plan.startup_trace_dir.clone().map(|dir| Timeline::new(dir, &plan));
    let (run_dir, listener) = RunDir::create()?;
    let listener = UnixListener::from_std(listener)
        .map_err(|source| Error::RunDir { path: run_dir.path().to_path_buf(), source })?;
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let deadline = Instant::now() + plan.startup_timeout;
    let mut children: Vec<Child> = Vec::with_capacity(plan.processes.len());
    for (idx, spec) in plan.processes.iter().enumerate() {
        let tx = events_tx.clone();
        let on_exit = move |exit| {
            let _ = tx.send(Event::Exited { idx, exit });
        };
        if let Some(t) = timeline.as_mut() {
            t.spawning(idx);
        }
        let result = spawn::spawn(spec, run_dir.socket(), &console, on_exit);
        if let (Some(t), Ok(spawned)) = (timeline.as_mut(), &result) {
            t.spawned(idx, spawned.pid);
        }
        match result {
            Ok(spawned) => children.push(Child {
                address: spec.address(),
                role: spec.role,
                rank: spec.rank,
                pid: spawned.pid,
                phase: Phase::Spawned,
                deadline: Some(deadline),
                exit: None,
                connected: false,
                disconnected: false,
                judge_at: None,
                killed: false,
                last_beat: None,
                gone_at: None,
                spawned,
            }),
            Err(e) => {
                kill_spawned(&mut children, &mut events).await;
                if let Some(t) = timeline.as_mut() {
                    t.finish("failed");
                }
                return Err(e);
            }
        }
    }
    let pids: Vec<u32> = children.iter().map(|c| c.pid).collect();
    let relay = Arc::new(Relay::new(&plan, &pids, events_tx));
    let accept = tokio::spawn(relay::accept_loop(listener, relay.clone()));
    let lead = plan.lead();
    let mut supervisor = Supervisor {
        plan,
        children,
        lead,
        console,
        relay,
        report: None,
        escalated: false,
        deaths: Deaths::default(),
        events,
        stops,
        run_dir,
        accept,
        connected: 0,
        timeline,
    };
    let ending = supervisor.watch().await;
    if let Some(t) = supervisor.timeline.as_mut() {
        // written here only if start-up never finished (at all-READY otherwise)
        t.finish(match ending {
            Ending::Failed(_) | Ending::RemoteDied(_) => "failed",
            Ending::Stop(_) => "stopped",
            Ending::LeadFinished => "finished",
        });
    }
    let code = match ending {
        Ending::Failed(failure) => supervisor.on_failure(failure).await,
        Ending::RemoteDied(death) => supervisor.on_remote_death(death).await,
        Ending::Stop(sig) => supervisor.on_stop_request(sig).await,
        Ending::LeadFinished => supervisor.on_lead_finished().await,
    };
    supervisor.close();
    Ok(Outcome { code, report: supervisor.report.take(), run_dir: supervisor.run_dir.path().to_path_buf() })
}

/// A process's state from /proc (`T (stopped)`, `D (disk sleep)`, ...), for a report.
fn process_state(pid: u32) -> String {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return "unknown: /proc has no entry".into();
    };
    let code = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()).unwrap_or('?');
    let name = match code {
        'R' => "running",
        'S' => "sleeping",
        'D' => "disk sleep",
        'T' => "stopped",
        't' => "stopped by a tracer",
        'Z' => "zombie",
        _ => "other",
    };
    format!("{code} ({name})")
}

/// A later spawn failed: the children already started must not outlive the error.
async fn kill_spawned(children: &mut [Child], events: &mut UnboundedReceiver<Event>) {
    for child in children.iter() {
        let _ = child.spawned.signals.send(Signal::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while children.iter().any(Child::alive) {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Event::Exited { idx, exit })) => children[idx].exit = Some(exit),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
}

impl Supervisor {
    /// Start-up and serving, until something ends the serve.
    async fn watch(&mut self) -> Ending {
        loop {
            let next = self.next_deadline();
            let wake = next.map_or_else(|| Instant::now() + Duration::from_secs(3600), |(at, _, _)| at);
            tokio::select! {
                Some(event) = self.events.recv() => {
                    if let Some(ending) = self.on_event(event) {
                        return ending;
                    }
                }
                Some(sig) = self.stops.recv() => return Ending::Stop(sig),
                _ = tokio::time::sleep_until(wake), if next.is_some() => {
                    if let Some((_, idx, due)) = next {
                        let child = &self.children[idx];
                        let phase = child.phase;
                        let cause = match due {
                            Due::Judge => return self.judge_exit(idx),
                            Due::Startup => Cause::Deadline { phase, timeout: self.plan.startup_timeout },
                            Due::Silent => Cause::NotResponding {
                                silent: self.plan.heartbeat_timeout.unwrap_or_default(),
                                state: process_state(child.pid),
                            },
                            Due::Disconnected => Cause::Disconnected,
                        };
                        return Ending::Failed(Failure { idx, cause, phase });
                    }
                }
            }
        }
    }

    fn next_deadline(&self) -> Option<(Instant, usize, Due)> {
        let heartbeat = self.plan.heartbeat_timeout;
        let due = |c: &Child| -> Option<(Instant, Due)> {
            if let Some(judge) = c.judge_at {
                return Some((judge, Due::Judge));
            }
            if let Some(deadline) = c.deadline {
                return Some((deadline, Due::Startup));
            }
            if !c.alive() {
                return None;
            }
            let silent = match (heartbeat, c.last_beat) {
                (Some(timeout), Some(beat)) if c.phase == Phase::Running => Some((beat + timeout, Due::Silent)),
                _ => None,
            };
            let gone = c.gone_at.map(|at| (at, Due::Disconnected));
            [silent, gone].into_iter().flatten().min_by_key(|(at, _)| *at)
        };
        self.children.iter().enumerate().filter_map(|(i, c)| due(c).map(|(at, d)| (at, i, d))).min_by_key(|x| x.0)
    }

    /// A child has exited and its last frames are processed: was that the end of the
    /// serve (the lead finishing after READY) or a failure?
    fn judge_exit(&mut self, idx: usize) -> Ending {
        let child = &mut self.children[idx];
        child.judge_at = None;
        let exit = child.exit.clone().unwrap_or_else(|| Exit::Unknown("not reaped".into()));
        if idx == self.lead && exit == Exit::Code(0) && child.phase >= Phase::Ready {
            return Ending::LeadFinished;
        }
        Ending::Failed(Failure { idx, cause: Cause::Exited(exit), phase: child.phase })
    }

    fn on_event(&mut self, event: Event) -> Option<Ending> {
        let timeout = self.plan.startup_timeout;
        match event {
            Event::Exited { idx, exit } => {
                let child = &mut self.children[idx];
                child.exit = Some(exit);
                child.deadline = None;
                if child.connected && !child.disconnected {
                    child.judge_at = Some(Instant::now() + DRAIN_AFTER_EXIT);
                    return None;
                }
                return Some(self.judge_exit(idx));
            }
            Event::Hello { idx } => {
                if let Some(t) = self.timeline.as_mut() {
                    t.hello(idx);
                }
                let child = &mut self.children[idx];
                child.connected = true;
                child.phase = Phase::Hello;
                child.deadline = Some(Instant::now() + timeout);
                self.connected += 1;
                if self.connected == self.children.len() {
                    // Every child holds its connection: the path is no longer needed, and
                    // removing it now means even a SIGKILLed supervisor leaves nothing.
                    self.run_dir.remove();
                    self.accept.abort();
                }
            }
            Event::ConfigSent { idx } => {
                if let Some(t) = self.timeline.as_mut() {
                    t.config(idx);
                }
                let child = &mut self.children[idx];
                if child.phase == Phase::Hello {
                    child.phase = Phase::Config;
                    child.deadline = Some(Instant::now() + timeout);
                }
            }
            Event::Ready { idx } => self.on_ready(idx),
            Event::BadHello { idx, reason } => {
                return Some(Ending::Failed(Failure { idx, cause: Cause::BadHello(reason), phase: Phase::Hello }));
            }
            Event::Disconnected { idx } => {
                let child = &mut self.children[idx];
                child.disconnected = true;
                log::debug!("{} closed its connection", child.address);
                if child.judge_at.is_some() {
                    return Some(self.judge_exit(idx));
                }
                if child.alive() {
                    child.gone_at = Some(Instant::now() + EXIT_AFTER_DISCONNECT);
                }
            }
            Event::Heartbeat { idx } => self.children[idx].last_beat = Some(Instant::now()),
            Event::Protocol { idx, reason } => {
                let phase = self.children[idx].phase;
                return Some(Ending::Failed(Failure { idx, cause: Cause::Protocol(reason), phase }));
            }
            Event::RemoteDied(death) => return Some(Ending::RemoteDied(death)),
        }
        None
    }

    fn on_ready(&mut self, idx: usize) {
        let child = &mut self.children[idx];
        if !matches!(child.phase, Phase::Hello | Phase::Config) {
            log::warn!("{}: READY in phase '{}' ignored", child.address, child.phase.as_str());
            return;
        }
        child.phase = Phase::Ready;
        child.deadline = None;
        self.console.say(&format!("{} (pid {}) ready", child.address, child.pid));
        if let Some(t) = self.timeline.as_mut() {
            t.ready(idx);
        }
        if self.children.iter().all(|c| c.phase == Phase::Ready) {
            if let Some(t) = self.timeline.as_mut() {
                t.all_ready();
            }
            let now = Instant::now();
            for c in &mut self.children {
                c.phase = Phase::Running;
                c.last_beat = Some(now); // silence is counted from here
            }
            let n = self.children.len();
            match &self.plan.ready_url {
                Some(url) => self.console.say(&format!("all {n} processes ready; serving at {url}")),
                None => self.console.say(&format!("all {n} processes ready")),
            }
        }
    }

    /// Processes events until `done` holds or `deadline` passes; returns `done`'s value.
    /// A stop request meanwhile kills every child at once; a REMOTE_DIED is taken as
    /// `on_remote_death_while_stopping` says.
    pub(crate) async fn wait_for(&mut self, done: impl Fn(&Supervisor) -> bool, deadline: Instant) -> bool {
        loop {
            if done(self) {
                return true;
            }
            tokio::select! {
                Some(event) = self.events.recv() => match event {
                    Event::Exited { idx, exit } => {
                        self.children[idx].exit = Some(exit);
                        self.children[idx].deadline = None;
                    }
                    Event::Hello { idx } => self.children[idx].connected = true,
                    Event::Disconnected { idx } => self.children[idx].disconnected = true,
                    Event::RemoteDied(death) => self.on_remote_death_while_stopping(death),
                    _ => {}
                },
                Some(sig) = self.stops.recv() => self.escalate(sig),
                _ = tokio::time::sleep_until(deadline) => return done(self),
            }
        }
    }

    pub(crate) fn signal(&mut self, idx: usize, sig: Signal) {
        let child = &mut self.children[idx];
        if child.alive() {
            if sig == Signal::SIGKILL {
                child.killed = true;
            }
            let _ = child.spawned.signals.send(sig);
        }
    }

    /// Waits (briefly) until a child's stderr is fully read, so its tail is complete.
    pub(crate) async fn settle_stderr(&mut self, idx: usize) {
        let done = &mut self.children[idx].spawned.stderr_done;
        if !done.is_finished() {
            let _ = tokio::time::timeout(Duration::from_millis(500), done).await;
        }
    }

    fn close(&mut self) {
        self.accept.abort();
        self.run_dir.remove();
    }
}
