//! Everything the supervisor writes: children's output lines (prefixed with who wrote
//! them), its own `loom-supervisor: ...` messages, and the stderr tail kept per child.
//!
//! Lines go through one writer thread so that a slow or blocked stderr never stalls the
//! relay loop, and so that child lines and supervisor messages keep their order.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::task::JoinHandle;

/// Lines of a child's stderr kept for its death report.
pub const TAIL_LINES: usize = 20;

/// Prefix of every message the supervisor itself prints.
pub const SELF: &str = "loom-supervisor";

/// A handle to the writer thread; cloning is cheap. `None` on the channel stops the thread.
#[derive(Clone)]
pub struct Console {
    tx: mpsc::Sender<Option<Vec<u8>>>,
}

pub struct ConsoleThread {
    console: Console,
    thread: thread::JoinHandle<()>,
}

impl ConsoleThread {
    pub fn start() -> std::io::Result<ConsoleThread> {
        let (tx, rx) = mpsc::channel::<Option<Vec<u8>>>();
        let thread = thread::Builder::new().name("loom-console".into()).spawn(move || {
            let stderr = std::io::stderr();
            // A closed stderr is not a reason to stop a serve: write errors are ignored.
            while let Ok(Some(chunk)) = rx.recv() {
                let mut out = stderr.lock();
                let _ = out.write_all(&chunk);
                loop {
                    match rx.try_recv() {
                        Ok(Some(more)) => {
                            let _ = out.write_all(&more);
                        }
                        Ok(None) => {
                            let _ = out.flush();
                            return;
                        }
                        Err(_) => break,
                    }
                }
                let _ = out.flush();
            }
        })?;
        Ok(ConsoleThread { console: Console { tx }, thread })
    }

    pub fn console(&self) -> Console {
        self.console.clone()
    }

    /// Writes out everything queued so far and stops the thread; later messages from
    /// leftover clones are dropped.
    pub fn finish(self) {
        let _ = self.console.tx.send(None);
        let _ = self.thread.join();
    }
}

impl Console {
    /// `loom-supervisor: <text>`; `text` may span several lines.
    pub fn say(&self, text: &str) {
        let mut chunk = Vec::with_capacity(text.len() + SELF.len() + 3);
        for line in text.lines() {
            chunk.extend_from_slice(SELF.as_bytes());
            chunk.extend_from_slice(b": ");
            chunk.extend_from_slice(line.as_bytes());
            chunk.push(b'\n');
        }
        self.write(chunk);
    }

    /// Writes a block exactly as given (used for the single death report).
    pub fn write(&self, chunk: Vec<u8>) {
        // Fails only after `finish`, when nobody reads any more.
        let _ = self.tx.send(Some(chunk));
    }

    fn child_line(&self, prefix: &str, line: &[u8]) {
        let mut chunk = Vec::with_capacity(prefix.len() + line.len() + 4);
        chunk.push(b'[');
        chunk.extend_from_slice(prefix.as_bytes());
        chunk.extend_from_slice(b"] ");
        chunk.extend_from_slice(line);
        chunk.push(b'\n');
        self.write(chunk);
    }
}

/// The last `TAIL_LINES` lines of one child's stderr.
#[derive(Clone, Default)]
pub struct Tail {
    lines: Arc<Mutex<VecDeque<String>>>,
}

impl Tail {
    fn push(&self, line: &[u8]) {
        if let Ok(mut lines) = self.lines.lock() {
            if lines.len() == TAIL_LINES {
                lines.pop_front();
            }
            lines.push_back(String::from_utf8_lossy(line).into_owned());
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().map(|l| l.iter().cloned().collect()).unwrap_or_default()
    }
}

/// Copies a child's pipe to the console line by line, prefixed `[prefix] `; keeps the
/// tail when `tail` is given. The task ends at the pipe's EOF.
pub fn pump<R>(pipe: R, prefix: String, console: Console, tail: Option<Tail>) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    while matches!(line.last(), Some(b'\n' | b'\r')) {
                        line.pop();
                    }
                    console.child_line(&prefix, &line);
                    if let Some(tail) = &tail {
                        tail.push(&line);
                    }
                }
            }
        }
    })
}

/// Routes the `log` crate (frame rejections, debug traces) to stderr as
/// `loom-supervisor: LEVEL: message`; `LOOM_SUPERVISOR_LOG` sets the filter (default
/// `info`). Safe to call more than once.
pub fn init_logger() {
    let env = env_logger::Env::new().filter_or("LOOM_SUPERVISOR_LOG", "info");
    let _ = env_logger::Builder::from_env(env)
        .format(|buf, record| {
            let level = match record.level() {
                log::Level::Error => "ERROR",
                log::Level::Warn => "WARNING",
                log::Level::Info => "INFO",
                log::Level::Debug => "DEBUG",
                log::Level::Trace => "TRACE",
            };
            writeln!(buf, "{SELF}: {level}: {}", record.args())
        })
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let tail = Tail::default();
        for i in 0..(TAIL_LINES + 5) {
            tail.push(format!("line {i}").as_bytes());
        }
        let lines = tail.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 5");
        assert_eq!(lines[TAIL_LINES - 1], format!("line {}", TAIL_LINES + 4));
    }

    #[test]
    fn pump_collects_lines_without_newlines() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let console = ConsoleThread::start().unwrap();
        let tail = Tail::default();
        let (c, t) = (console.console(), Some(tail.clone()));
        rt.block_on(async { pump(&b"one\r\ntwo\nthree"[..], "worker:0".into(), c, t).await }).unwrap();
        drop(rt);
        console.finish();
        assert_eq!(tail.lines(), vec!["one", "two", "three"]);
    }
}
