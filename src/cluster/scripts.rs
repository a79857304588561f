//! The Lua scripts behind the cluster's strongly consistent operations (SPEC §7.1).
//!
//! Redis runs a script atomically: nothing else touches the keys between its first read
//! and its last write, which is the compare-and-set a lease and a cluster-wide permit
//! need. Invariants: every lease change a script makes is announced on the change stream
//! in the same script (so other nodes' local views follow it), lease rows are the same
//! JSON the redb store keeps (`policy::lease::Lease`), generations come from one counter
//! row (`next_generation`, the generation the next acquire hands out) that only grows,
//! and time is the caller's `now` (unix ms): nodes are expected to run NTP.

/// Helpers every lease script starts with. `ARGV[1]` is the node id, `ARGV[2]` the
/// stream length to keep, `ARGV[3]` now; `KEYS[1]` the lease hash, `KEYS[2]` the stream.
const LEASE_PRELUDE: &str = r#"
local node, keep, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function announce(key, value)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', keep, '*', 'node', node,
    'table', 'leases', 'key', key, 'value', value)
end
local function num(x) return string.format('%d', x) end
local function encode(owner, client, conn, gen, expires, created)
  return '{"owner_hash":' .. cjson.encode(owner) .. ',"client":' .. cjson.encode(client)
    .. ',"connection":' .. cjson.encode(conn) .. ',"generation":' .. num(gen)
    .. ',"expires_at":' .. num(expires) .. ',"created_at":' .. num(created) .. '}'
end
local function decode(v)
  local ok, l = pcall(cjson.decode, v)
  if not ok or type(l) ~= 'table' or type(l.expires_at) ~= 'number'
    or type(l.generation) ~= 'number' or type(l.connection) ~= 'string'
    or type(l.client) ~= 'string' or type(l.created_at) ~= 'number' then
    return nil
  end
  return l
end
-- Active leases by connection (the latest expiry), dropping expired and unreadable rows.
local function held_by_others(owner)
  local held = {}
  local rows = redis.call('HGETALL', KEYS[1])
  for i = 1, #rows, 2 do
    local k = rows[i]
    if k ~= 'next_generation' then
      local l = decode(rows[i + 1])
      if l == nil or l.expires_at <= now then
        redis.call('HDEL', KEYS[1], k)
        announce(k, '')
      elseif k ~= owner then
        if held[l.connection] == nil or held[l.connection] < l.expires_at then
          held[l.connection] = l.expires_at
        end
      end
    end
  end
  return held
end
-- The owner's active lease, or a status to return.
local function owned(owner, client)
  local v = redis.call('HGET', KEYS[1], owner)
  if not v then return nil, 'unknown' end
  local l = decode(v)
  if l == nil or l.expires_at <= now then return nil, 'unknown' end
  if client ~= nil and l.client ~= client then return nil, 'wrong_client' end
  return l, nil
end
"#;

/// ARGV[4] ttl ms, ARGV[5] client, ARGV[6] owner hash, ARGV[7..] connections in order.
/// Returns `{'ok', lease}`, `{'busy', earliest expiry}`, `{'none'}` or `{'exists'}`.
const ACQUIRE: &str = r#"
local ttl, client, owner = tonumber(ARGV[4]), ARGV[5], ARGV[6]
if redis.call('HEXISTS', KEYS[1], owner) == 1 then
  local l = decode(redis.call('HGET', KEYS[1], owner))
  if l ~= nil and l.expires_at > now then return {'exists'} end
end
local held = held_by_others(owner)
local earliest = nil
for i = 7, #ARGV do
  local conn = ARGV[i]
  local busy = held[conn]
  if busy == nil then
    local gen = tonumber(redis.call('HGET', KEYS[1], 'next_generation') or '1') or 1
    if gen < 1 then gen = 1 end
    redis.call('HSET', KEYS[1], 'next_generation', num(gen + 1))
    local lease = encode(owner, client, conn, gen, now + ttl, now)
    redis.call('HSET', KEYS[1], owner, lease)
    announce(owner, lease)
    return {'ok', lease}
  end
  if earliest == nil or busy < earliest then earliest = busy end
end
if earliest == nil then return {'none'} end
return {'busy', num(earliest)}
"#;

/// ARGV[4] ttl ms, ARGV[5] client, ARGV[6] owner hash.
const RENEW: &str = r#"
local ttl, client, owner = tonumber(ARGV[4]), ARGV[5], ARGV[6]
local l, status = owned(owner, client)
if l == nil then return {status} end
local lease = encode(owner, l.client, l.connection, l.generation, now + ttl, l.created_at)
redis.call('HSET', KEYS[1], owner, lease)
announce(owner, lease)
return {'ok', lease}
"#;

/// ARGV[4] client, ARGV[5] owner hash.
const RELEASE: &str = r#"
local client, owner = ARGV[4], ARGV[5]
local l, status = owned(owner, client)
if l == nil then return {status} end
local v = redis.call('HGET', KEYS[1], owner)
redis.call('HDEL', KEYS[1], owner)
announce(owner, '')
return {'ok', v}
"#;

/// ARGV[4] owner hash, ARGV[5..] eligible connections in order. Moves the lease to the
/// first one no other active lease holds (staying put when that is its own).
const RELOCATE: &str = r#"
local owner = ARGV[4]
local l, status = owned(owner, nil)
if l == nil then return {status} end
local held = held_by_others(owner)
for i = 5, #ARGV do
  local conn = ARGV[i]
  if held[conn] == nil then
    if conn == l.connection then return {'ok', redis.call('HGET', KEYS[1], owner)} end
    local lease = encode(owner, l.client, conn, l.generation, l.expires_at, l.created_at)
    redis.call('HSET', KEYS[1], owner, lease)
    announce(owner, lease)
    return {'ok', lease}
  end
end
return {'none'}
"#;

/// KEYS: one sorted set per limited scope (member → expiry). ARGV[1] now, ARGV[2] the
/// new permits' expiry; then per key its cap, a count n and n member names offered.
/// Takes permits in every scope or in none: expired ones are dropped first (a crashed
/// node's permits come back this way); a scope with no room refuses them all (an empty
/// reply); otherwise as many of the offered names as fit, and the reply says how many
/// per scope (at least 1 each).
const PERMIT: &str = r#"
local now, expires = ARGV[1], ARGV[2]
local plan, a = {}, 3
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local cap, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local room = cap - redis.call('ZCARD', key)
  if room < 1 then return {} end
  plan[i] = {a + 2, math.min(n, room)}
  a = a + 2 + n
end
local out = {}
for i, key in ipairs(KEYS) do
  local first, k = plan[i][1], plan[i][2]
  for j = 0, k - 1 do
    redis.call('ZADD', key, expires, ARGV[first + j])
  end
  out[i] = k
end
return out
"#;

/// The scripts, loaded once per process (Redis caches them by SHA-1).
pub struct Scripts {
    pub acquire: redis::Script,
    pub renew: redis::Script,
    pub release: redis::Script,
    pub relocate: redis::Script,
    pub permit: redis::Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        let lease = |body: &str| redis::Script::new(&format!("{LEASE_PRELUDE}{body}"));
        Scripts {
            acquire: lease(ACQUIRE),
            renew: lease(RENEW),
            release: lease(RELEASE),
            relocate: lease(RELOCATE),
            permit: redis::Script::new(PERMIT),
        }
    }
}
