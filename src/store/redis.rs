//! The shared state store on Redis (SPEC §7.1, `state.backend: redis`): the same
//! table-grouped key → JSON persistence as redb, in one Redis hash per table
//! (`<key_prefix><table>`), so several nodes load and keep one durable image.
//!
//! What it protects: the resilience state a restarted or newly added node starts from.
//! Invariants: a batch is applied in one `MULTI`/`EXEC` (all of it or none); every call
//! has a connect and I/O timeout, so a Redis that does not answer fails the batch (the
//! writer keeps it and retries) instead of hanging the writer; a broken connection is
//! reopened on the next call; the URL is never logged or shown (it may hold a password),
//! and errors name the host only. This is the durable half of sharing; the live half
//! (propagating changes between running nodes, cluster-wide leases and permits) is built
//! on top of it.

use super::{empty_image, Change, Image, StateStore, StoreError, Table};
use std::sync::Mutex;
use std::time::Duration;

/// Connect and per-command timeout.
const TIMEOUT: Duration = Duration::from_secs(2);

pub struct RedisStore {
    client: redis::Client,
    prefix: String,
    /// This process's id in the change stream: its own entries are skipped when read.
    node: String,
    /// Where the store is, for messages: host and port, never the password.
    place: String,
    conn: Mutex<Option<redis::Connection>>,
}

impl RedisStore {
    /// A store on `url` (not connected yet: the first call connects).
    pub fn new(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(|_| StoreError::Open {
            path: "redis".into(),
            message: "the state.redis URL is not a valid redis:// URL".into(),
        })?;
        let place = match &client.get_connection_info().addr {
            redis::ConnectionAddr::Tcp(h, p)
            | redis::ConnectionAddr::TcpTls {
                host: h, port: p, ..
            } => {
                format!("redis {h}:{p}")
            }
            redis::ConnectionAddr::Unix(p) => format!("redis {}", p.display()),
        };
        Ok(RedisStore {
            client,
            prefix: prefix.to_owned(),
            node: format!("{}-{:016x}", std::process::id(), rand::random::<u64>()),
            place,
            conn: Mutex::new(None),
        })
    }

    /// Where the store is (host and port), for logs.
    pub fn place(&self) -> &str {
        &self.place
    }

    fn key(&self, table: Table) -> String {
        format!("{}{}", self.prefix, table.as_str())
    }

    fn stream(&self) -> String {
        format!("{}changes", self.prefix)
    }

    /// Another handle on the same store and node id, with its own connection (the change
    /// reader polls on it, so the writer's commits never wait behind a read).
    pub fn reader(&self) -> RedisStore {
        RedisStore {
            client: self.client.clone(),
            prefix: self.prefix.clone(),
            node: self.node.clone(),
            place: self.place.clone(),
            conn: Mutex::new(None),
        }
    }

    /// The id of the newest entry of the change stream (`0-0` when it is empty): where a
    /// node that just loaded the image starts reading.
    pub fn stream_end(&self) -> Result<String, StoreError> {
        let key = self.stream();
        let last: Vec<(String, Vec<(String, String)>)> = self.with(|c| {
            redis::cmd("XREVRANGE")
                .arg(&key)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query(c)
        })?;
        Ok(last
            .into_iter()
            .next()
            .map_or_else(|| "0-0".to_owned(), |(id, _)| id))
    }

    /// The changes other nodes committed after stream entry `after`, oldest first, and
    /// the id to read from next.
    pub fn changes_after(&self, after: &str) -> Result<(String, Vec<Change>), StoreError> {
        let key = self.stream();
        type Entries = Vec<(String, Vec<(String, String)>)>;
        let entries: Entries = self.with(|c| {
            redis::cmd("XRANGE")
                .arg(&key)
                .arg(format!("({after}"))
                .arg("+")
                .arg("COUNT")
                .arg(STREAM_READ)
                .query(c)
        })?;
        let mut next = after.to_owned();
        let mut out = Vec::new();
        for (id, fields) in entries {
            next = id;
            let field = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            if field("node") == Some(self.node.as_str()) {
                continue;
            }
            let (Some(table), Some(k)) = (field("table"), field("key")) else {
                continue;
            };
            let Some(table) = Table::ALL.into_iter().find(|t| t.as_str() == table) else {
                continue;
            };
            let value = match field("value") {
                Some("") | None => None,
                Some(v) => match serde_json::from_str(v) {
                    Ok(v) => Some(v),
                    // Not a delete: an entry nobody can read is skipped.
                    Err(_) => continue,
                },
            };
            out.push(Change {
                table,
                key: k.to_owned(),
                value,
            });
        }
        Ok((next, out))
    }

    /// Runs `f` on the connection, opening it when there is none; a failed call drops
    /// the connection so the next one reconnects.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            let c = self
                .client
                .get_connection_with_timeout(TIMEOUT)
                .map_err(|e| self.error(&e))?;
            c.set_read_timeout(Some(TIMEOUT))
                .map_err(|e| self.error(&e))?;
            c.set_write_timeout(Some(TIMEOUT))
                .map_err(|e| self.error(&e))?;
            *slot = Some(c);
        }
        let Some(conn) = slot.as_mut() else {
            return Err(StoreError::Io(format!("{}: not connected", self.place)));
        };
        match f(conn) {
            Ok(v) => Ok(v),
            Err(e) => {
                *slot = None;
                Err(self.error(&e))
            }
        }
    }

    fn error(&self, e: &redis::RedisError) -> StoreError {
        // The error's own text never holds the URL; its kind and detail say what failed.
        StoreError::Io(format!(
            "{}: {:?}: {}",
            self.place,
            e.kind(),
            e.detail().unwrap_or("")
        ))
    }
}

/// Most stream entries read per poll.
const STREAM_READ: usize = 1_000;
/// The change stream keeps about this many entries (trimmed as it grows).
const STREAM_KEEP: usize = 10_000;

impl RedisStore {
    /// Adds one change to the stream other nodes read (in the batch's transaction).
    fn announce(&self, pipe: &mut redis::Pipeline, c: &Change, value: &str) {
        pipe.cmd("XADD")
            .arg(self.stream())
            .arg("MAXLEN")
            .arg("~")
            .arg(STREAM_KEEP)
            .arg("*")
            .arg("node")
            .arg(&self.node)
            .arg("table")
            .arg(c.table.as_str())
            .arg("key")
            .arg(&c.key)
            .arg("value")
            .arg(value)
            .ignore();
    }
}

impl StateStore for RedisStore {
    fn load(&self) -> Result<Image, StoreError> {
        let mut image = empty_image();
        for table in Table::ALL {
            let key = self.key(table);
            let rows: Vec<(String, String)> =
                self.with(|c| redis::cmd("HGETALL").arg(&key).query(c))?;
            let map = image.entry(table).or_default();
            for (k, v) in rows {
                match serde_json::from_str(&v) {
                    Ok(v) => {
                        map.insert(k, v);
                    }
                    Err(e) => {
                        tracing::warn!(table = table.as_str(), key = %k, error = %e, "state: skipping an undecodable entry in redis")
                    }
                }
            }
        }
        Ok(image)
    }

    fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        if changes.iter().all(|c| c.table == Table::Leases) {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        // Leases stay in each node's memory until they are shared by compare-and-set:
        // every node writes its whole lease table, which would overwrite the others'.
        for c in changes.iter().filter(|c| c.table != Table::Leases) {
            let key = self.key(c.table);
            match &c.value {
                Some(v) => {
                    let text =
                        serde_json::to_string(v).map_err(|e| StoreError::Encode(e.to_string()))?;
                    pipe.cmd("HSET").arg(key).arg(&c.key).arg(&text).ignore();
                    self.announce(&mut pipe, c, &text);
                }
                None => {
                    pipe.cmd("HDEL").arg(key).arg(&c.key).ignore();
                    self.announce(&mut pipe, c, "");
                }
            }
        }
        self.with(|conn| pipe.query::<()>(conn))
    }
}
