//! The shared state store on Redis (SPEC §7.1, `state.backend: redis`): the same
//! table-grouped key → JSON persistence as redb, in one Redis hash per table
//! (`<key_prefix><table>`), so several nodes load and keep one durable image.
//!
//! What it protects: the resilience state a restarted or newly added node starts from.
//! Invariants: a batch is applied by one script (all of it or none) that never lets a
//! cooldown overwrite a terminal state (only an operator's clear does); every call
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
    apply: redis::Script,
}

impl RedisStore {
    /// A store on `url` (not connected yet: the first call connects).
    pub fn new(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(|_| StoreError::Open {
            path: "redis".into(),
            message: "the state.redis URL is not a valid redis:// URL".into(),
        })?;
        let place = place_of(&client);
        Ok(RedisStore {
            client,
            prefix: prefix.to_owned(),
            node: format!("{}-{:016x}", std::process::id(), rand::random::<u64>()),
            place,
            conn: Mutex::new(None),
            apply: redis::Script::new(APPLY),
        })
    }

    /// Where the store is (host and port), for logs.
    pub fn place(&self) -> &str {
        &self.place
    }

    /// This process's id in the change stream (the cluster's scripts announce with it).
    pub fn node(&self) -> &str {
        &self.node
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
            apply: redis::Script::new(APPLY),
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

/// Where a client connects, for messages: host and port (or socket path), never the
/// password the URL may hold.
pub fn place_of(client: &redis::Client) -> String {
    match &client.get_connection_info().addr {
        redis::ConnectionAddr::Tcp(h, p)
        | redis::ConnectionAddr::TcpTls {
            host: h, port: p, ..
        } => format!("redis {h}:{p}"),
        redis::ConnectionAddr::Unix(p) => format!("redis {}", p.display()),
    }
}

/// Most stream entries read per poll.
const STREAM_READ: usize = 1_000;
/// The change stream keeps about this many entries (trimmed as it grows).
pub(crate) const STREAM_KEEP: usize = 10_000;

/// Applies a batch atomically (a script runs alone) and announces each change on the
/// stream. KEYS[1] is the stream, KEYS[1 + j] change j's hash; ARGV: node, stream length
/// to keep, then (table, key, value) per change, value `''` for a delete. A connection
/// row in a terminal state is never overwritten by one that is not, unless the new row
/// says it is an operator's clear (`"cleared": true`): terminal states are strong.
const APPLY: &str = r#"
local node, keep = ARGV[1], ARGV[2]
local function decode(v)
  local ok, e = pcall(cjson.decode, v)
  if ok and type(e) == 'table' then return e end
  return nil
end
local function terminal(e)
  return e ~= nil and type(e.state) == 'table' and e.state.terminal ~= nil
    and e.state.terminal ~= cjson.null
end
local j = 1
for i = 3, #ARGV, 3 do
  j = j + 1
  local tbl, key, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local keep_old = false
  if tbl == 'connections' and value ~= '' then
    local old = redis.call('HGET', KEYS[j], key)
    local new = decode(value)
    if old and terminal(decode(old)) and not terminal(new)
      and not (new ~= nil and new.cleared == true) then
      keep_old = true
    end
  end
  if not keep_old then
    if value == '' then
      redis.call('HDEL', KEYS[j], key)
    else
      redis.call('HSET', KEYS[j], key, value)
    end
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', keep, '*', 'node', node,
      'table', tbl, 'key', key, 'value', value)
  end
end
return 0
"#;

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
        // Leases are the cluster's compare-and-set scripts' (`cluster::leases`), never a
        // node's whole table: that would overwrite the others'.
        let mut keys = vec![self.stream()];
        let mut args: Vec<String> = vec![self.node.clone(), STREAM_KEEP.to_string()];
        for c in changes.iter().filter(|c| c.table != Table::Leases) {
            let value = match &c.value {
                Some(v) => {
                    serde_json::to_string(v).map_err(|e| StoreError::Encode(e.to_string()))?
                }
                None => String::new(),
            };
            keys.push(self.key(c.table));
            args.extend([c.table.as_str().to_owned(), c.key.clone(), value]);
        }
        if keys.len() == 1 {
            return Ok(());
        }
        let script = &self.apply;
        self.with(|conn| {
            let mut inv = script.prepare_invoke();
            for k in &keys {
                inv.key(k);
            }
            for a in &args {
                inv.arg(a);
            }
            inv.invoke::<i64>(conn).map(|_| ())
        })
    }
}
