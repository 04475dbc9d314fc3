//! loom's process supervisor: spawns every process of a serve, relays their msgpack
//! frames over one private Unix socket, watches them, and stops them all together.
//!
//! `run` is the whole thing for one plan; the binary (`main.rs`, `cli.rs`) and the
//! Python module (`python.rs`, feature `python`) are thin layers over it.

pub mod cli;
pub mod error;
pub mod frame;
mod hello;
pub mod logs;
pub mod relay;
pub mod remote;
pub mod report;
pub mod rundir;
pub mod shutdown;
pub mod signals;
pub mod spawn;
pub mod spec;
pub mod supervisor;
pub mod timeline;

#[cfg(feature = "python")]
mod python;

use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

pub use error::{Error, Result};
pub use spec::{Plan, WIRE_VERSION};
pub use supervisor::{supervise, Outcome};

/// Supervises `plan` until it ends and returns the exit code to use: 0 after a requested
/// stop (SIGINT/SIGTERM) or a finished lead process where every child ended cleanly,
/// 1 after a child failed. Blocks the calling thread, which must stay alive for the
/// whole serve (the children's parent-death signal is tied to it).
pub fn run(plan: Plan) -> Result<i32> {
    logs::init_logger();
    let mut signals = signals::SignalGuard::install()?;
    let console = logs::ConsoleThread::start().map_err(Error::os("cannot start the console thread"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::os("cannot start the event loop"))?;
    let result = runtime.block_on(async {
        let (stop_tx, stop_rx) = mpsc::unbounded_channel();
        if let Some(reader) = signals.take_reader() {
            tokio::spawn(forward_signals(reader, stop_tx));
        }
        supervise(plan, console.console(), stop_rx).await
    });
    drop(runtime);
    console.finish();
    drop(signals);
    result.map(|outcome| outcome.code)
}

async fn forward_signals(reader: std::os::unix::net::UnixStream, stops: mpsc::UnboundedSender<i32>) {
    let Ok(mut stream) = tokio::net::UnixStream::from_std(reader) else {
        log::warn!("cannot watch for SIGINT/SIGTERM; stop the serve by killing it");
        return;
    };
    let mut buf = [0u8; 16];
    while let Ok(n @ 1..) = stream.read(&mut buf).await {
        for &sig in &buf[..n] {
            if stops.send(i32::from(sig)).is_err() {
                return;
            }
        }
    }
}
