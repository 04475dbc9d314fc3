//! How a serve ends: after a child (or a remote process) failed, after a stop request
//! (SIGINT/SIGTERM), or after the lead process finished on its own; and the stop sequence
//! they share (STOP_SIGNAL in role order, grace period, SIGKILL). A remote process that
//! dies while the serve stops for another reason is still reported, and the exit code is 1.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::frame::{self, kind};
use crate::remote::RemoteDeath;
use crate::report::{self, secs, Failure, Phase};
use crate::spawn::Exit;
use crate::spec::{Role, WIRE_VERSION};
use crate::supervisor::{Supervisor, DRAIN_AFTER_EXIT};

/// How long the lead gets to flush (error events to clients) after PEER_DIED.
const PEER_DIED_FLUSH: Duration = Duration::from_secs(1);
/// After its grace period the draining lead gets this long to exit on its own: it ends the
/// requests still running with an error event shortly before the grace period ends, then
/// exits with a code that says whether it had to.
const LEAD_EXIT: Duration = Duration::from_secs(2);
/// A role group signalled after the shared grace deadline still gets this long.
const MIN_GROUP_GRACE: Duration = Duration::from_secs(1);
/// SIGKILL cannot be refused; this only bounds a wait on a stuck kernel.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

const STOP_ORDER: [Role; 3] = [Role::Frontend, Role::EngineCore, Role::Worker];

/// How the supervisor stops a child. Not SIGTERM: children ignore SIGTERM and SIGINT, which
/// an operator's `kill -- -PGID`, systemd or Ctrl-C deliver to every process at once; the
/// supervisor turns those into a drain and then stops the children itself.
pub const STOP_SIGNAL: Signal = Signal::SIGUSR1;

/// Whether a child ended the way a requested stop should end it.
pub fn is_clean(exit: &Exit, killed: bool) -> bool {
    let stop = [Signal::SIGTERM as i32, Signal::SIGINT as i32, STOP_SIGNAL as i32];
    !killed
        && match exit {
            Exit::Code(code) => *code == 0 || stop.iter().any(|s| *code == 128 + s),
            Exit::Signal(sig) => stop.contains(sig),
            Exit::Unknown(_) => false,
        }
}

/// The deaths a serve that is ending still reports: only the first, as while it runs.
#[derive(Debug, Default)]
pub struct Deaths {
    /// A death was seen: the serve ends because of it (a child's or a remote process's),
    /// or it is `while_stopping`.
    seen: bool,
    /// The first remote death reported while stopping for another reason (a stop request,
    /// the lead finished): reported once every child has stopped.
    while_stopping: Option<RemoteDeath>,
}

impl Deaths {
    /// The serve ends because of a death: no later one is reported.
    pub fn ending_by_death(&mut self) {
        self.seen = true;
    }

    /// A REMOTE_DIED while stopping: kept, and true, when it is the first death.
    pub fn keep(&mut self, death: RemoteDeath) -> bool {
        if self.seen {
            return false;
        }
        self.seen = true;
        self.while_stopping = Some(death);
        true
    }

    /// The death to report after the stop sequence, once.
    pub fn take(&mut self) -> Option<RemoteDeath> {
        self.while_stopping.take()
    }
}

impl Supervisor {
    /// A child died, missed a deadline or sent a bad HELLO: tell the lead, stop the
    /// rest, print one report. Always exit code 1.
    pub(crate) async fn on_failure(&mut self, failure: Failure) -> i32 {
        self.deaths.ending_by_death();
        let idx = failure.idx;
        if !self.children[idx].alive() {
            self.settle_stderr(idx).await;
        }
        if self.lead != idx {
            let tail = self.children[idx].spawned.stderr_tail.lines();
            let body = report::peer_died_body(&self.children[idx].who(), &failure, &tail);
            self.tell_lead_peer_died(&body).await;
        }
        self.stop_in_order().await;
        self.settle_stderr(idx).await;
        let child = &self.children[idx];
        let others = self.children.len() - 1;
        let text =
            report::render(&child.who(), &failure, child.exit.as_ref(), &child.spawned.stderr_tail.lines(), others);
        self.print_report(text)
    }

    /// The engine core reported that a remote process (a Ray actor) died: the serve ends
    /// as after a child's death, with every child stopped and exit code 1.
    pub(crate) async fn on_remote_death(&mut self, death: RemoteDeath) -> i32 {
        self.deaths.ending_by_death();
        self.tell_lead_peer_died(&death.peer_died_body()).await;
        self.stop_in_order().await;
        let text = death.render(self.children.len());
        self.print_report(text)
    }

    /// A REMOTE_DIED while the serve is ending (events taken by `wait_for`). After a death
    /// it is not the first one: not reported. While stopping for another reason it is: the
    /// lead hears of it at once, as while running (a draining lead ends the requests still
    /// in flight with an error naming the process), and the report comes after the stop
    /// sequence, which goes on as it was (no wait here: this runs inside one of its waits).
    pub(crate) fn on_remote_death_while_stopping(&mut self, death: RemoteDeath) {
        let (named, body) = (death.who.named(), death.peer_died_body());
        if !self.deaths.keep(death) {
            log::debug!("REMOTE_DIED for {named} while the serve ends after an earlier death: not reported");
            return;
        }
        self.console.say(&format!(
            "engine_core reported that {named} died while the serve was stopping; its report follows once every process has stopped"
        ));
        self.send_peer_died(&body);
    }

    /// PEER_DIED to the lead, if it listens, and a moment for it to end its requests with
    /// an error naming the dead process and exit.
    async fn tell_lead_peer_died(&mut self, body: &[u8]) {
        let lead = self.lead;
        if self.send_peer_died(body) {
            self.wait_for(move |s| !s.children[lead].alive(), Instant::now() + PEER_DIED_FLUSH).await;
        }
    }

    /// PEER_DIED to the lead if it listens (alive, past its HELLO); whether it was queued.
    fn send_peer_died(&self, body: &[u8]) -> bool {
        let lead = &self.children[self.lead];
        let listens = lead.alive() && lead.phase >= Phase::Hello;
        listens && self.send_to_lead(&lead.address.to_string(), kind::PEER_DIED, body)
    }

    fn print_report(&mut self, text: String) -> i32 {
        self.console.write(text.clone().into_bytes());
        self.report = Some(text);
        1
    }

    /// SIGINT/SIGTERM: SHUTDOWN to the lead (it stops accepting and drains), up to one
    /// grace period for it to exit, then the stop sequence. 0 when every child ended
    /// cleanly.
    pub(crate) async fn on_stop_request(&mut self, sig: i32) -> i32 {
        let name = Exit::signal_name(sig);
        let lead = self.lead;
        let grace = self.plan.grace_period;
        let lead_listens = self.children[lead].alive() && self.children[lead].phase >= Phase::Hello;
        let dst = self.children[lead].address.to_string();
        if lead_listens && self.send_to_lead(&dst, kind::SHUTDOWN, b"") {
            self.console.say(&format!("{name} received: {dst} is draining (up to {})", secs(grace)));
            self.wait_for(move |s| !s.children[lead].alive(), Instant::now() + grace + LEAD_EXIT).await;
        } else {
            self.console.say(&format!("{name} received: stopping every process"));
        }
        self.stop_in_order().await;
        self.end_stop().await
    }

    /// The lead exited 0 on its own: the serve is over; the others are stopped.
    pub(crate) async fn on_lead_finished(&mut self) -> i32 {
        let lead = &self.children[self.lead];
        self.console.say(&format!("{} (pid {}) finished; stopping the other processes", lead.address, lead.pid));
        self.stop_in_order().await;
        self.end_stop().await
    }

    /// After the stop sequence of a stop that no death caused: the verdict on the
    /// children's exits, then the report of a remote process that died meanwhile, if one
    /// did (exit code 1 then, however the children ended).
    async fn end_stop(&mut self) -> i32 {
        // A frame sent just before its sender exited (a REMOTE_DIED) is relayed before that
        // connection's end is: wait, briefly, for every connection to end.
        let ended = |s: &Supervisor| s.children.iter().all(|c| !c.connected || c.disconnected);
        self.wait_for(ended, Instant::now() + DRAIN_AFTER_EXIT).await;
        let code = self.judge_stop();
        match self.deaths.take() {
            Some(death) => {
                let text = death.render(self.children.len());
                self.print_report(text)
            }
            None => code,
        }
    }

    fn send_to_lead(&self, dst: &str, kind: &str, body: &[u8]) -> bool {
        match frame::encode(WIRE_VERSION, "supervisor", dst, kind, body) {
            Ok(bytes) => self.relay.routes.try_deliver(self.lead, Arc::new(bytes)),
            Err(e) => {
                log::warn!("cannot encode {kind} for {dst}: {e}");
                false
            }
        }
    }

    fn judge_stop(&self) -> i32 {
        let unclean: Vec<String> = self
            .children
            .iter()
            .filter(|c| !c.exit.as_ref().is_some_and(|e| is_clean(e, c.killed)))
            .map(|c| match &c.exit {
                Some(_) if c.killed => format!("{} (pid {}) had to be killed", c.address, c.pid),
                Some(exit) => format!("{} (pid {}) {exit}", c.address, c.pid),
                None => format!("{} (pid {}) did not exit", c.address, c.pid),
            })
            .collect();
        if unclean.is_empty() {
            self.console.say(&format!("all {} processes stopped", self.children.len()));
            0
        } else {
            self.console.say(&format!("stopped, but not cleanly: {}; exiting with code 1", unclean.join("; ")));
            1
        }
    }

    /// STOP_SIGNAL to every live child, role by role (frontend, engine core, workers), each
    /// group waited for until one shared grace deadline; then SIGKILL to what is left.
    pub(crate) async fn stop_in_order(&mut self) {
        let grace = self.plan.grace_period;
        let deadline = Instant::now() + grace;
        for role in STOP_ORDER {
            let group: Vec<usize> = (0..self.children.len())
                .filter(|&i| self.children[i].role == role && self.children[i].alive())
                .collect();
            if group.is_empty() {
                continue;
            }
            for &i in &group {
                self.signal(i, STOP_SIGNAL);
            }
            let group_deadline = deadline.max(Instant::now() + MIN_GROUP_GRACE.min(grace));
            self.wait_for(move |s| group.iter().all(|&i| !s.children[i].alive()), group_deadline).await;
        }
        let stubborn: Vec<usize> = (0..self.children.len()).filter(|&i| self.children[i].alive()).collect();
        if stubborn.is_empty() {
            return;
        }
        let names: Vec<String> = stubborn.iter().map(|&i| self.children[i].address.to_string()).collect();
        self.console.say(&format!(
            "{} did not exit within {} of {}; sending SIGKILL",
            names.join(", "),
            secs(grace),
            STOP_SIGNAL.as_str()
        ));
        for &i in &stubborn {
            self.signal(i, Signal::SIGKILL);
        }
        self.wait_for(|s| s.children.iter().all(|c| !c.alive()), Instant::now() + REAP_AFTER_KILL).await;
    }

    /// A second stop request while stopping: no more patience.
    pub(crate) fn escalate(&mut self, sig: i32) {
        if !self.escalated {
            self.escalated = true;
            self.console.say(&format!("{} received again: killing every process now", Exit::signal_name(sig)));
        }
        for i in 0..self.children.len() {
            self.signal(i, Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_exits() {
        assert!(is_clean(&Exit::Code(0), false));
        assert!(is_clean(&Exit::Signal(libc::SIGTERM), false));
        assert!(is_clean(&Exit::Signal(libc::SIGUSR1), false));
        assert!(is_clean(&Exit::Code(128 + libc::SIGUSR1), false));
        assert!(is_clean(&Exit::Code(143), false));
        assert!(!is_clean(&Exit::Code(0), true));
        assert!(!is_clean(&Exit::Code(1), false));
        assert!(!is_clean(&Exit::Signal(libc::SIGKILL), false));
        assert!(!is_clean(&Exit::Signal(libc::SIGSEGV), false));
    }

    fn death(rank: u32) -> RemoteDeath {
        let body = report::PeerDiedBody {
            role: "worker".into(),
            rank,
            pid: 4242,
            exit_code: None,
            signal: Some("SIGKILL".into()),
            phase: "running".into(),
            reason: String::new(),
            stderr_tail: vec![],
            node: Some("10.0.0.2".into()),
        };
        crate::remote::accept(crate::spec::Address::EngineCore, &body.encode()).unwrap()
    }

    #[test]
    fn the_first_remote_death_while_stopping_is_kept_for_the_report_once() {
        let mut deaths = Deaths::default();
        assert!(deaths.keep(death(1)));
        assert!(!deaths.keep(death(2)), "only the first death is reported");
        assert_eq!(deaths.take(), Some(death(1)));
        assert_eq!(deaths.take(), None);
        assert!(!deaths.keep(death(3)), "nor one after the report");
    }

    #[test]
    fn no_remote_death_is_kept_once_the_serve_ends_by_a_death() {
        let mut deaths = Deaths::default();
        deaths.ending_by_death();
        assert!(!deaths.keep(death(1)));
        assert_eq!(deaths.take(), None);
    }
}
