//! The wire format: a 4-byte big-endian length, then a msgpack array
//! `[version: int, src: str, dst: str, kind: str, body: bin]`, `version` being
//! `spec::WIRE_VERSION`.
//!
//! The supervisor parses only the header to route a frame and forwards the received bytes
//! unchanged (length prefix included), so relaying never re-encodes a body.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt};

/// Kinds the supervisor itself sends or handles; every other kind is relayed as is.
pub mod kind {
    pub const HELLO: &str = "HELLO";
    pub const CONFIG: &str = "CONFIG";
    pub const READY: &str = "READY";
    pub const SHUTDOWN: &str = "SHUTDOWN";
    pub const PEER_DIED: &str = "PEER_DIED";
    /// A child to the supervisor, about every second once READY: it is alive and not stopped.
    pub const HEARTBEAT: &str = "HEARTBEAT";
    /// The engine core to the supervisor: a process it runs elsewhere (a Ray actor) died;
    /// the body is a PEER_DIED body (see `remote.rs`).
    pub const REMOTE_DIED: &str = "REMOTE_DIED";
}

const PREFIX: usize = 4;

/// Why a frame was not taken. After `Malformed` the stream stays in sync (its length
/// prefix was honoured); after `TooLarge` nothing of it was read, and the connection must
/// be closed: a prefix of 0xFFFFFFFF would otherwise swallow every later frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a frame of {len} bytes is over the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// The routing part of a frame; `body` is where the body lies in the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub src: String,
    pub dst: String,
    pub kind: String,
    pub body: Range<usize>,
}

impl Header {
    /// Parses the msgpack payload (the bytes after the length prefix).
    pub fn parse(payload: &[u8]) -> Result<Header, FrameError> {
        let bad = |what: &str| FrameError::Malformed(what.to_string());
        let mut rd = payload;
        let len = rmp::decode::read_array_len(&mut rd).map_err(|_| bad("not a msgpack array"))?;
        if len != 5 {
            return Err(FrameError::Malformed(format!(
                "array of {len} items; expected [version, src, dst, kind, body]"
            )));
        }
        let version: u32 = rmp::decode::read_int(&mut rd).map_err(|_| bad("version is not an integer"))?;
        let mut text = |field: &str| -> Result<String, FrameError> {
            let (s, rest) = rmp::decode::read_str_from_slice(rd)
                .map_err(|_| FrameError::Malformed(format!("{field} is not a UTF-8 string")))?;
            rd = rest;
            Ok(s.to_string())
        };
        let src = text("src")?;
        let dst = text("dst")?;
        let kind = text("kind")?;
        let body_len = rmp::decode::read_bin_len(&mut rd).map_err(|_| bad("body is not bin"))?;
        let body_len = usize::try_from(body_len).map_err(|_| bad("body length"))?;
        if rd.len() != body_len {
            return Err(FrameError::Malformed(format!("body says {body_len} bytes but {} follow", rd.len())));
        }
        let start = payload.len() - rd.len();
        Ok(Header { version, src, dst, kind, body: start..payload.len() })
    }
}

/// A received frame: its bytes as they came (prefix included), shared by every
/// destination of a fan-out, and its parsed header.
#[derive(Debug, Clone)]
pub struct Frame {
    pub raw: Arc<Vec<u8>>,
    pub header: Header,
}

impl Frame {
    pub fn body(&self) -> &[u8] {
        let r = &self.header.body;
        &self.raw[PREFIX + r.start..PREFIX + r.end]
    }
}

/// Encodes one frame, length prefix included.
pub fn encode(version: u32, src: &str, dst: &str, kind: &str, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let too_large = |_| FrameError::TooLarge { len: body.len(), max: u32::MAX as usize };
    let mut out = Vec::with_capacity(PREFIX + 16 + src.len() + dst.len() + kind.len() + body.len());
    out.extend_from_slice(&[0; PREFIX]);
    let written: Result<(), rmp::encode::ValueWriteError> = (|| {
        rmp::encode::write_array_len(&mut out, 5)?;
        rmp::encode::write_uint(&mut out, u64::from(version))?;
        rmp::encode::write_str(&mut out, src)?;
        rmp::encode::write_str(&mut out, dst)?;
        rmp::encode::write_str(&mut out, kind)?;
        rmp::encode::write_bin(&mut out, body)
    })();
    written.map_err(|e| FrameError::Malformed(e.to_string()))?;
    let len = u32::try_from(out.len() - PREFIX).map_err(too_large)?;
    out[..PREFIX].copy_from_slice(&len.to_be_bytes());
    Ok(out)
}

/// Reads frames from one connection, enforcing the size limit.
pub struct FrameReader<R> {
    inner: R,
    max_frame_bytes: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R, max_frame_bytes: usize) -> Self {
        FrameReader { inner, max_frame_bytes }
    }

    /// The next frame, a rejected frame (a malformed one is skipped; after one too large
    /// the reader must not be used again), or `None` at a clean end of stream. An `Err`
    /// means the stream itself broke (EOF inside a frame, I/O error).
    pub async fn next(&mut self) -> io::Result<Option<Result<Frame, FrameError>>> {
        let mut prefix = [0u8; PREFIX];
        if self.inner.read(&mut prefix[..1]).await? == 0 {
            return Ok(None);
        }
        self.inner.read_exact(&mut prefix[1..]).await?;
        let len = u32::from_be_bytes(prefix) as usize;
        if len > self.max_frame_bytes {
            return Ok(Some(Err(FrameError::TooLarge { len, max: self.max_frame_bytes })));
        }
        let mut raw = vec![0u8; PREFIX + len];
        raw[..PREFIX].copy_from_slice(&prefix);
        self.inner.read_exact(&mut raw[PREFIX..]).await?;
        Ok(Some(Header::parse(&raw[PREFIX..]).map(|header| Frame { raw: Arc::new(raw), header })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    fn read_all(bytes: &[u8], max: usize) -> Vec<Result<Frame, FrameError>> {
        block_on(async {
            let mut reader = FrameReader::new(bytes, max);
            let mut out = Vec::new();
            while let Some(item) = reader.next().await.unwrap() {
                out.push(item);
            }
            out
        })
    }

    /// A frame built by hand from a msgpack payload (the way a foreign client would).
    fn framed(payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn round_trip_keeps_the_bytes() {
        let raw = encode(1, "worker:1", "engine_core", "ECHO", b"\x00\x01payload").unwrap();
        let frames = read_all(&raw, 1 << 20);
        let frame = frames[0].as_ref().unwrap();
        assert_eq!(frame.header.version, 1);
        assert_eq!(frame.header.src, "worker:1");
        assert_eq!(frame.header.dst, "engine_core");
        assert_eq!(frame.header.kind, "ECHO");
        assert_eq!(frame.body(), b"\x00\x01payload");
        assert_eq!(frame.raw.as_slice(), raw.as_slice());
    }

    #[test]
    fn empty_and_large_bodies() {
        for size in [0usize, 255, 256, 65_535, 65_536, 300_000] {
            let body = vec![7u8; size];
            let raw = encode(1, "frontend", "workers", "X", &body).unwrap();
            let frames = read_all(&raw, 1 << 20);
            assert_eq!(frames[0].as_ref().unwrap().body(), body.as_slice());
        }
    }

    #[test]
    fn an_oversized_frame_is_refused_before_its_body_is_read() {
        // 0xFFFFFFFF: skipping it would swallow 4 GiB of later frames
        let stream =
            [&[0xff, 0xff, 0xff, 0xff][..], &encode(1, "frontend", "engine_core", "SMALL", b"ok").unwrap()].concat();
        let first = block_on(async { FrameReader::new(stream.as_slice(), 4096).next().await.unwrap() });
        assert_eq!(first.unwrap().unwrap_err(), FrameError::TooLarge { len: u32::MAX as usize, max: 4096 });
    }

    #[test]
    fn malformed_frames_are_rejected_and_the_stream_stays_in_sync() {
        let mut stream = Vec::new();
        stream.extend(framed(b"\xc1garbage")); // 0xc1 is never valid msgpack
        stream.extend(framed(b"\x93\x01\xa1a\xa1b")); // 3-item array
        stream.extend(framed(b"\x95\xa1x\xa1a\xa1b\xa1k\xc4\x00")); // version is a string
        stream.extend(framed(b"\x95\x01\xa1a\xa1b\xa1k\xa2no")); // body is str, not bin
        stream.extend(framed(b"\x95\x01\xa1a\xa1b\xa1k\xc4\x05ab")); // body shorter than it says
        stream.extend(framed(b""));
        stream.extend(encode(1, "frontend", "engine_core", "OK", b"").unwrap());
        let frames = read_all(&stream, 4096);
        assert_eq!(frames.len(), 7);
        for f in &frames[..6] {
            assert!(matches!(f, Err(FrameError::Malformed(_))), "{f:?}");
        }
        assert_eq!(frames[6].as_ref().unwrap().header.kind, "OK");
    }

    use proptest::prelude::*;

    /// One item of a stream a peer may send: a valid frame, or a payload that is not one.
    #[derive(Debug, Clone)]
    enum Item {
        Good { version: u32, src: String, dst: String, kind: String, body: Vec<u8> },
        Garbage(Vec<u8>),
    }

    fn item() -> impl Strategy<Value = Item> {
        prop_oneof![
            (any::<u32>(), ".{0,12}", ".{0,12}", "[A-Z_]{0,12}", prop::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(version, src, dst, kind, body)| Item::Good { version, src, dst, kind, body }),
            prop::collection::vec(any::<u8>(), 0..64).prop_map(Item::Garbage),
        ]
    }

    proptest! {
        /// Frames and garbage payloads, each behind a true length prefix: every valid frame
        /// comes back exactly, each garbage payload is one error, and the stream stays in sync.
        #[test]
        fn frames_among_garbage_stay_in_sync(items in prop::collection::vec(item(), 0..20)) {
            let mut stream = Vec::new();
            for it in &items {
                match it {
                    Item::Good { version, src, dst, kind, body } => {
                        stream.extend(encode(*version, src, dst, kind, body).unwrap())
                    }
                    Item::Garbage(payload) => stream.extend(framed(payload)),
                }
            }
            let frames = read_all(&stream, 1 << 20);
            prop_assert_eq!(frames.len(), items.len());
            for (it, got) in items.iter().zip(&frames) {
                match (it, got) {
                    (Item::Good { version, src, dst, kind, body }, Ok(f)) => {
                        prop_assert_eq!(
                            (f.header.version, &f.header.src, &f.header.dst, &f.header.kind, f.body()),
                            (*version, src, dst, kind, body.as_slice())
                        );
                    }
                    (Item::Garbage(_), Err(FrameError::Malformed(_))) => {}
                    // a random payload can be a well-formed frame; then it must re-encode to itself
                    (Item::Garbage(payload), Ok(f)) => prop_assert_eq!(&f.raw[PREFIX..], payload.as_slice()),
                    (it, got) => prop_assert!(false, "{:?} read as {:?}", it, got),
                }
            }
        }

        /// Any bytes at all: the reader ends (clean end, an error, or a refused frame) and never panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
            block_on(async {
                let mut reader = FrameReader::new(bytes.as_slice(), 4096);
                for _ in 0..=bytes.len() {
                    match reader.next().await {
                        Ok(None) | Err(_) | Ok(Some(Err(FrameError::TooLarge { .. }))) => break,
                        Ok(Some(_)) => {}
                    }
                }
            });
        }

        /// A length prefix over the limit is refused at once, whatever follows.
        #[test]
        fn any_prefix_over_the_limit_is_refused(len in 4097u32.., tail in prop::collection::vec(any::<u8>(), 0..64)) {
            let stream = [&len.to_be_bytes()[..], &tail].concat();
            let got = block_on(async { FrameReader::new(stream.as_slice(), 4096).next().await.unwrap() });
            prop_assert_eq!(got.unwrap().unwrap_err(), FrameError::TooLarge { len: len as usize, max: 4096 });
        }
    }

    #[test]
    fn eof_inside_a_frame_is_an_error() {
        let raw = encode(1, "frontend", "engine_core", "OK", b"abc").unwrap();
        let cut = &raw[..raw.len() - 1];
        let err = block_on(async { FrameReader::new(cut, 4096).next().await.unwrap_err() });
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
