//! The job's key-value rendezvous: a blocking client ([`Rendezvous`]) and a small TCP
//! server ([`RendezvousServer`]) with a token, caps and timeouts (protocol in the crate docs).

use crate::{err, LaunchError, Token};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long `exchange_unique_id` waits for rank 0's id, and a `GET` without its own timeout.
pub(crate) const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a client retries a refused connection (the server may still be starting).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request or answer line.
const MAX_LINE: u64 = 64 * 1024;
/// How long the server waits to write one answer before it drops the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err("a key must be non-empty, without whitespace".into())
    } else {
        Ok(())
    }
}

/// A blocking client of a [`RendezvousServer`] (the protocol is in the crate docs).
#[derive(Debug)]
pub struct Rendezvous {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Rendezvous {
    /// Connects (retrying a refused connection for up to 10 s) and shows `token`.
    ///
    /// ```
    /// use moefuse_launch::{Rendezvous, RendezvousServer, Token};
    /// let token = Token::generate()?;
    /// let server = RendezvousServer::start("127.0.0.1:0", token.clone())?;
    /// assert!(Rendezvous::connect(server.addr(), &token).is_ok());
    /// assert!(Rendezvous::connect(server.addr(), &Token::generate()?).is_err());
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn connect(addr: SocketAddr, token: &Token) -> Result<Self, LaunchError> {
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(stream) => break stream,
                Err(e)
                    if e.kind() == std::io::ErrorKind::ConnectionRefused
                        && Instant::now() < deadline =>
                {
                    thread::sleep(Duration::from_millis(100))
                }
                Err(e) => return Err(err(format!("rendezvous {addr}: cannot connect: {e}"))),
            }
        };
        let _ = stream.set_nodelay(true);
        let writer = stream
            .try_clone()
            .map_err(|e| err(format!("rendezvous {addr}: {e}")))?;
        let mut client = Rendezvous {
            addr,
            reader: BufReader::new(stream),
            writer,
        };
        match client.exchange(&format!("AUTH {}", token.as_str()), None) {
            Ok(answer) if answer == "OK" => {}
            Ok(answer) => return Err(client.fail("AUTH", "-", &answer)),
            Err(why) => return Err(client.fail("AUTH", "-", &why)),
        }
        tracing::debug!(%addr, "rendezvous connected");
        Ok(client)
    }

    /// Stores `value` under `key`; fails if the key is already set.
    ///
    /// ```
    /// # use moefuse_launch::{Rendezvous, RendezvousServer, Token};
    /// # let token = Token::generate()?;
    /// # let server = RendezvousServer::start("127.0.0.1:0", token.clone())?;
    /// let mut client = Rendezvous::connect(server.addr(), &token)?;
    /// client.set("job/x", "one")?;
    /// assert!(client.set("job/x", "two").is_err()); // write-once
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), LaunchError> {
        if value.contains(['\n', '\r']) {
            return Err(self.fail("SET", key, "the value holds a line break"));
        }
        match self.request("SET", key, &format!("SET {key} {value}"), None)? {
            answer if answer == "OK" => Ok(()),
            answer => Err(self.fail("SET", key, &answer)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for some process to set it.
    ///
    /// ```
    /// # use moefuse_launch::{Rendezvous, RendezvousServer, Token};
    /// # use std::time::Duration;
    /// # let token = Token::generate()?;
    /// # let server = RendezvousServer::start("127.0.0.1:0", token.clone())?;
    /// let mut client = Rendezvous::connect(server.addr(), &token)?;
    /// let missing = client.get("job/never", Duration::from_millis(10));
    /// assert!(missing.unwrap_err().to_string().contains("job/never"));
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<String, LaunchError> {
        let ms = timeout.as_millis().max(1);
        match self.request("GET", key, &format!("GET {key} {ms}"), Some(timeout))? {
            answer if answer.starts_with("VALUE ") => Ok(answer["VALUE ".len()..].to_string()),
            answer => Err(self.fail("GET", key, &answer)),
        }
    }

    fn request(
        &mut self,
        verb: &str,
        key: &str,
        line: &str,
        wait: Option<Duration>,
    ) -> Result<String, LaunchError> {
        check_key(key).map_err(|why| self.fail(verb, key, &why))?;
        let answer = self
            .exchange(line, wait)
            .map_err(|why| self.fail(verb, key, &why))?;
        tracing::debug!(addr = %self.addr, verb, key, answer = %answer, "rendezvous");
        Ok(answer)
    }

    /// One line out, one line back. The server answers a GET by its timeout; the socket's
    /// read timeout is a backstop.
    fn exchange(&mut self, line: &str, wait: Option<Duration>) -> Result<String, String> {
        let backstop = wait.unwrap_or_default() + Duration::from_secs(30);
        let io = |e: std::io::Error| e.to_string();
        self.reader
            .get_ref()
            .set_read_timeout(Some(backstop))
            .map_err(io)?;
        // A server that refuses the connection answers and closes at once: when the write
        // fails, its answer may still be there to read, and says more than the write error.
        let written = writeln!(self.writer, "{line}").map_err(io);
        match read_line(&mut self.reader) {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(written
                .err()
                .unwrap_or_else(|| "the server closed the connection".into())),
            Err(e) => Err(written.err().unwrap_or_else(|| io(e))),
        }
    }

    fn fail(&self, verb: &str, key: &str, why: &str) -> LaunchError {
        err(format!("rendezvous {}: {verb} {key}: {why}", self.addr))
    }
}

/// One line without its line break; `None` at end of stream.
fn read_line(reader: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    reader.take(MAX_LINE).read_until(b'\n', &mut buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    if buf.pop() != Some(b'\n') {
        return Err(std::io::Error::other("line too long or cut off"));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

/// What one [`RendezvousServer`] allows. A job of N ranks needs N connections at once,
/// two keys per NVSHMEM initialisation and a few hundred bytes each: the defaults leave
/// room for thousands of ranks and still bound what a stray client can take.
///
/// ```
/// use std::time::Duration;
/// let limits = moefuse_launch::ServerLimits { max_connections: 8, ..Default::default() };
/// assert_eq!(limits.idle_timeout, Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections served at once; more are answered `ERR` and closed.
    pub max_connections: usize,
    /// Keys stored; a `SET` beyond is refused.
    pub max_keys: usize,
    /// Bytes of keys and values stored; a `SET` beyond is refused.
    pub max_bytes: usize,
    /// A new connection must authenticate within this long.
    pub auth_timeout: Duration,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// The longest a `GET` waits, whatever it asks for.
    pub max_wait: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 1024,
            max_keys: 16 * 1024,
            max_bytes: 16 << 20,
            auth_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(600),
        }
    }
}

#[derive(Default)]
struct State {
    values: HashMap<String, String>,
    bytes: usize,
    stopped: bool,
}

struct Store {
    state: Mutex<State>,
    changed: Condvar,
    token: Token,
    limits: ServerLimits,
    connections: AtomicUsize,
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn answer(&self, line: &str) -> String {
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("SET"), Some(key), value) => {
                if let Err(why) = check_key(key) {
                    return format!("ERR {why}");
                }
                let value = value.unwrap_or("");
                let mut state = self.lock();
                if state.values.contains_key(key) {
                    return format!("ERR {key} is already set (keys are write-once)");
                }
                let bytes = key.len() + value.len();
                if state.values.len() >= self.limits.max_keys
                    || state.bytes + bytes > self.limits.max_bytes
                {
                    return format!(
                        "ERR the store is full ({} keys, {} bytes; at most {} keys, {} bytes)",
                        state.values.len(),
                        state.bytes,
                        self.limits.max_keys,
                        self.limits.max_bytes
                    );
                }
                state.bytes += bytes;
                state.values.insert(key.to_string(), value.to_string());
                self.changed.notify_all();
                "OK".into()
            }
            (Some("GET"), Some(key), timeout) => {
                let timeout = match timeout.map(str::parse::<u64>) {
                    None => EXCHANGE_TIMEOUT,
                    Some(Ok(ms)) => Duration::from_millis(ms),
                    Some(Err(_)) => return "ERR GET <key> [<timeout_ms>]".into(),
                }
                .min(self.limits.max_wait);
                let state = self.lock();
                let (state, _) = self
                    .changed
                    .wait_timeout_while(state, timeout, |s| {
                        !s.values.contains_key(key) && !s.stopped
                    })
                    .unwrap_or_else(|p| p.into_inner());
                match state.values.get(key) {
                    Some(value) => format!("VALUE {value}"),
                    None if state.stopped => "ERR the rendezvous server stopped".into(),
                    None => format!("ERR {key} not set within {} ms", timeout.as_millis()),
                }
            }
            _ => "ERR expected SET <key> <value> or GET <key> [<timeout_ms>]".into(),
        }
    }

    /// One connection: `AUTH` first, within `auth_timeout`; then requests until the client
    /// leaves, stays silent for `idle_timeout`, or the server stops.
    fn serve(&self, stream: TcpStream) {
        let Ok(mut writer) = stream.try_clone() else {
            return;
        };
        let _ = writer.set_write_timeout(Some(WRITE_TIMEOUT));
        let _ = stream.set_read_timeout(Some(self.limits.auth_timeout));
        let mut reader = BufReader::new(stream);
        let authenticated = match read_line(&mut reader) {
            Ok(Some(line)) => line
                .strip_prefix("AUTH ")
                .is_some_and(|offered| self.token.matches(offered)),
            _ => false,
        };
        if !authenticated {
            tracing::warn!(peer = ?reader.get_ref().peer_addr().ok(), "rendezvous: refused a client without the job's token");
            let _ = writeln!(
                writer,
                "ERR authentication failed: the first line must be AUTH <the job's token>"
            );
            return;
        }
        if writeln!(writer, "OK").is_err() {
            return;
        }
        let _ = reader
            .get_ref()
            .set_read_timeout(Some(self.limits.idle_timeout));
        while let Ok(Some(line)) = read_line(&mut reader) {
            if self.lock().stopped {
                let _ = writeln!(writer, "ERR the rendezvous server stopped");
                break;
            }
            let answer = self.answer(&line);
            if writeln!(writer, "{answer}").is_err() {
                break;
            }
        }
    }
}

/// Counts a served connection while it lives.
struct Seat(Arc<Store>);

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The key-value store of one job, served on a TCP port by background threads until dropped.
pub struct RendezvousServer {
    addr: SocketAddr,
    store: Arc<Store>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RendezvousServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousServer")
            .field("addr", &self.addr)
            .field("limits", &self.store.limits)
            .finish()
    }
}

impl RendezvousServer {
    /// Binds `addr` (port 0: the OS picks one) and serves clients that show `token`, with
    /// the default [`ServerLimits`].
    ///
    /// ```
    /// let token = moefuse_launch::Token::generate()?;
    /// let server = moefuse_launch::RendezvousServer::start("127.0.0.1:0", token)?;
    /// assert_ne!(server.addr().port(), 0);
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn start(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: Token,
    ) -> Result<Self, LaunchError> {
        Self::start_with(addr, token, ServerLimits::default())
    }

    /// [`RendezvousServer::start`] with explicit limits.
    ///
    /// ```
    /// use moefuse_launch::{RendezvousServer, ServerLimits, Token};
    /// let limits = ServerLimits { max_keys: 4, ..Default::default() };
    /// let server = RendezvousServer::start_with("127.0.0.1:0", Token::generate()?, limits)?;
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn start_with(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: Token,
        limits: ServerLimits,
    ) -> Result<Self, LaunchError> {
        let listener = TcpListener::bind(&addr)
            .map_err(|e| err(format!("rendezvous: cannot listen on {addr:?}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| err(format!("rendezvous: {e}")))?;
        let store = Arc::new(Store {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            token,
            limits,
            connections: AtomicUsize::new(0),
        });
        let shared = Arc::clone(&store);
        let accept = thread::Builder::new()
            .name("rendezvous".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.lock().stopped {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    if shared.connections.fetch_add(1, Ordering::SeqCst)
                        >= shared.limits.max_connections
                    {
                        shared.connections.fetch_sub(1, Ordering::SeqCst);
                        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                        let _ = writeln!(
                            stream,
                            "ERR too many connections (at most {})",
                            shared.limits.max_connections
                        );
                        // Take what the client already sent (its AUTH line) before closing:
                        // unread data would make the close a reset that can destroy the
                        // answer in flight. A short bound keeps the accept loop moving.
                        let _ = stream.shutdown(std::net::Shutdown::Write);
                        let _ = stream.set_read_timeout(Some(Duration::from_millis(20)));
                        let _ = std::io::Read::read(&mut stream, &mut [0u8; 512]);
                        continue;
                    }
                    let seat = Seat(Arc::clone(&shared));
                    let spawned = thread::Builder::new()
                        .name("rendezvous-conn".into())
                        .spawn(move || seat.0.serve(stream));
                    if let Err(e) = spawned {
                        tracing::warn!(%e, "rendezvous: cannot start a connection thread");
                    }
                }
            })
            .map_err(|e| err(format!("rendezvous: cannot start a thread: {e}")))?;
        tracing::debug!(%addr, "rendezvous serving");
        Ok(RendezvousServer {
            addr,
            store,
            accept: Some(accept),
        })
    }

    /// The address clients connect to.
    ///
    /// ```
    /// let token = moefuse_launch::Token::generate()?;
    /// let server = moefuse_launch::RendezvousServer::start("127.0.0.1:0", token)?;
    /// assert!(server.addr().ip().is_loopback());
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections being served now.
    ///
    /// ```
    /// let token = moefuse_launch::Token::generate()?;
    /// let server = moefuse_launch::RendezvousServer::start("127.0.0.1:0", token)?;
    /// assert_eq!(server.connections(), 0);
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn connections(&self) -> usize {
        self.store.connections.load(Ordering::SeqCst)
    }
}

impl Drop for RendezvousServer {
    /// Stops accepting, and answers pending `GET`s with an error.
    fn drop(&mut self) {
        self.store.lock().stopped = true;
        self.store.changed.notify_all();
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
            if let Some(accept) = self.accept.take() {
                let _ = accept.join();
            }
        }
    }
}
