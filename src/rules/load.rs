//! Rule file text → compiled rules, collecting *every* problem with its path.
//!
//! Protects the gateway from a rule file that is only partly right: each list item is
//! checked on its own, and each field of an item on its own, so one broken rule (or
//! field) never hides the problems of the others, and a path such as
//! `rules[3].cooldown_s` names exactly what to fix. Unknown keys are errors at every
//! level (the file's top level and each rule), reported one by one. A rule with any
//! problem is dropped; the caller only builds a `RuleSet` when no problem was found.

use super::{
    ClassificationRule, HeaderMatch, Marker, ProviderMatch, RestatementRule, DEFAULT_RETRY_AFTER_S,
    MAX_RULES,
};
use crate::config::Problem;
use crate::policy::{Reason, Scope, TerminalState};
use http::HeaderName;
use serde::de::DeserializeOwned;
use serde_yaml::{Mapping, Value};
use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;

const RESTATEMENT_KEYS: &[&str] = &[
    "id",
    "provider",
    "from_statuses",
    "to_status",
    "text_markers",
    "exclude_markers",
    "retry_after_s",
];

const CLASSIFICATION_KEYS: &[&str] = &[
    "id",
    "provider",
    "status",
    "match",
    "header",
    "reason",
    "scope",
    "cooldown_s",
    "terminal",
    "retryable",
];

/// Longest restated `retry_after_s` (24 h, the default `max_hint`).
const MAX_RETRY_AFTER_S: u64 = 86_400;
/// Rule cooldown bounds (SPEC §5.11): 1 s – 30 days.
const MIN_COOLDOWN_S: u64 = 1;
const MAX_COOLDOWN_S: u64 = 30 * 86_400;

/// Parses `restatement.yaml` text; problems are appended to `out`.
pub(super) fn restatement(file: &str, text: &str, out: &mut Vec<Problem>) -> Vec<RestatementRule> {
    let mut cx = Cx::new(file, out);
    let mut seen = HashSet::new();
    let mut rules = Vec::new();
    for (path, value) in cx.items(text) {
        let before = cx.out.len();
        let Some(item) = cx.item(path, value, RESTATEMENT_KEYS) else {
            continue;
        };
        let id = cx.id(&item, &mut seen);
        let provider = cx.provider(&item);
        let from_statuses = cx.statuses(&item, "from_statuses", true);
        let to_status = cx
            .get::<u64>(&item, "to_status", true)
            .and_then(|s| cx.status_value(&item.at("to_status"), s));
        let text_markers = cx.markers(&item, "text_markers", true);
        let exclude_markers = cx.markers(&item, "exclude_markers", false);
        let retry_after_s = cx
            .get::<u64>(&item, "retry_after_s", false)
            .unwrap_or(DEFAULT_RETRY_AFTER_S);
        if !(1..=MAX_RETRY_AFTER_S).contains(&retry_after_s) {
            cx.err(
                &item.at("retry_after_s"),
                format!("must be between 1 and {MAX_RETRY_AFTER_S} seconds"),
            );
        }
        if let (
            Some(id),
            Some(provider),
            Some(from_statuses),
            Some(to_status),
            Some(text_markers),
        ) = (id, provider, from_statuses, to_status, text_markers)
        {
            if cx.out.len() == before {
                rules.push(RestatementRule {
                    id,
                    provider,
                    from_statuses,
                    to_status,
                    text_markers,
                    exclude_markers: exclude_markers.unwrap_or_default(),
                    retry_after_s,
                });
            }
        }
    }
    rules
}

/// Parses `classification.yaml` text; problems are appended to `out`.
pub(super) fn classification(
    file: &str,
    text: &str,
    out: &mut Vec<Problem>,
) -> Vec<ClassificationRule> {
    let mut cx = Cx::new(file, out);
    let mut seen = HashSet::new();
    let mut rules = Vec::new();
    for (path, value) in cx.items(text) {
        let before = cx.out.len();
        let Some(item) = cx.item(path, value, CLASSIFICATION_KEYS) else {
            continue;
        };
        let id = cx.id(&item, &mut seen);
        let provider = cx.provider(&item);
        let statuses = cx.statuses(&item, "status", false);
        let markers = cx.markers(&item, "match", false);
        let header = cx.header(&item);
        if !["status", "match", "header"].iter().any(|k| item.has(k)) {
            cx.err(
                &item.path,
                "a rule needs at least one of status, match or header",
            );
        }
        let reason = cx.named::<Reason>(&item, "reason", true);
        let scope = cx.named::<Scope>(&item, "scope", true);
        let terminal = cx.named::<TerminalState>(&item, "terminal", false);
        let cooldown = cx.get::<u64>(&item, "cooldown_s", false).map(|s| {
            if !(MIN_COOLDOWN_S..=MAX_COOLDOWN_S).contains(&s) {
                cx.err(
                    &item.at("cooldown_s"),
                    format!(
                        "must be between {MIN_COOLDOWN_S} and {MAX_COOLDOWN_S} seconds (30 days)"
                    ),
                );
            }
            Duration::from_secs(s)
        });
        if terminal.is_some() && scope.is_some_and(|s| s != Scope::Connection) {
            cx.err(
                &item.at("terminal"),
                "a terminal state belongs to a connection: set scope: connection",
            );
        }
        let retryable = cx.get::<bool>(&item, "retryable", false);
        if let (Some(id), Some(provider), Some(reason), Some(scope)) = (id, provider, reason, scope)
        {
            if cx.out.len() == before {
                rules.push(ClassificationRule {
                    id,
                    provider,
                    statuses,
                    markers,
                    header,
                    reason,
                    scope,
                    cooldown,
                    terminal,
                    retryable: retryable.unwrap_or(scope != Scope::Request && terminal.is_none()),
                });
            }
        }
    }
    rules
}

/// One rule: its path (`rules[3]`) and its mapping.
struct Item {
    path: String,
    map: Mapping,
}

impl Item {
    fn at(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    /// The field, treating an explicit `null` as absent.
    fn field(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn has(&self, key: &str) -> bool {
        self.field(key).is_some()
    }
}

struct Cx<'a> {
    file: &'a str,
    out: &'a mut Vec<Problem>,
}

/// serde_yaml appends a location relative to the value we fed it; the path we print
/// is the only location that means anything to the operator.
fn serde_reason(e: &serde_yaml::Error) -> String {
    let s = e.to_string();
    match s.find(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl<'a> Cx<'a> {
    fn new(file: &'a str, out: &'a mut Vec<Problem>) -> Self {
        Cx { file, out }
    }

    fn err(&mut self, path: &str, reason: impl Into<String>) {
        self.out.push(Problem {
            file: self.file.to_string(),
            path: path.to_string(),
            reason: reason.into(),
        });
    }

    /// The document's `rules:` items, each with its path (`rules[3]`).
    fn items(&mut self, text: &str) -> Vec<(String, Value)> {
        if let Err(reason) = crate::config::shape::check(text) {
            self.err("", reason);
            return Vec::new();
        }
        let root: Value = match serde_yaml::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                self.err("", format!("not valid YAML: {e}"));
                return Vec::new();
            }
        };
        // An empty file or one without `rules:` is what a truncating save leaves: a
        // file with no rules says so with `rules: []` (SPEC §6 reload safety).
        let root = match root {
            Value::Null => {
                self.err("", "the file is empty; write `rules: []` for no rules");
                return Vec::new();
            }
            Value::Mapping(m) => m,
            _ => {
                self.err("", "the top level must be a mapping with a `rules:` list");
                return Vec::new();
            }
        };
        for key in root.keys() {
            match key.as_str() {
                Some("rules") => {}
                Some(k) => self.err(k, "unknown key; expected rules"),
                None => self.err("", "top-level keys must be strings"),
            }
        }
        let list = match root.get("rules") {
            None => {
                self.err("rules", "missing; write `rules: []` for no rules");
                return Vec::new();
            }
            Some(Value::Null) => return Vec::new(),
            Some(Value::Sequence(list)) => list,
            Some(_) => {
                self.err("rules", "must be a list");
                return Vec::new();
            }
        };
        if list.len() > MAX_RULES {
            self.err(
                "rules",
                format!(
                    "at most {MAX_RULES} rules are allowed, found {}",
                    list.len()
                ),
            );
        }
        list.iter()
            .enumerate()
            .map(|(i, v)| (format!("rules[{i}]"), v.clone()))
            .collect()
    }

    /// One rule as a mapping, every unknown key reported at its own path.
    fn item(&mut self, path: String, value: Value, keys: &[&str]) -> Option<Item> {
        let Value::Mapping(map) = value else {
            self.err(&path, "a rule must be a mapping");
            return None;
        };
        for key in map.keys() {
            match key.as_str() {
                Some(k) if keys.contains(&k) => {}
                Some(k) => self.err(
                    &format!("{path}.{k}"),
                    format!("unknown key; expected one of {}", keys.join(", ")),
                ),
                None => self.err(&path, "keys must be strings"),
            }
        }
        Some(Item { path, map })
    }

    /// A typed field; `None` (after reporting) when missing-but-required or mistyped.
    fn get<T: DeserializeOwned>(&mut self, item: &Item, key: &str, required: bool) -> Option<T> {
        match item.field(key) {
            None => {
                if required {
                    self.err(&item.at(key), "is required");
                }
                None
            }
            Some(v) => match serde_yaml::from_value(v.clone()) {
                Ok(t) => Some(t),
                Err(e) => {
                    self.err(&item.at(key), serde_reason(&e));
                    None
                }
            },
        }
    }

    fn id(&mut self, item: &Item, seen: &mut HashSet<String>) -> Option<String> {
        let id = self.get::<String>(item, "id", true)?;
        if id.trim().is_empty() {
            self.err(&item.at("id"), "must not be empty");
            return None;
        }
        if !seen.insert(id.clone()) {
            self.err(&item.at("id"), format!("duplicate rule id {id:?}"));
            return None;
        }
        Some(id)
    }

    fn provider(&mut self, item: &Item) -> Option<ProviderMatch> {
        let p = self.get::<String>(item, "provider", true)?;
        if p.trim().is_empty() {
            self.err(
                &item.at("provider"),
                "must not be empty; use \"*\" for every provider",
            );
            return None;
        }
        Some(ProviderMatch::parse(&p))
    }

    fn status_value(&mut self, path: &str, status: u64) -> Option<u16> {
        match u16::try_from(status) {
            Ok(s) if (100..=599).contains(&s) => Some(s),
            _ => {
                self.err(
                    path,
                    format!("{status} is not an HTTP status (expected 100..=599)"),
                );
                None
            }
        }
    }

    /// A non-empty list of HTTP statuses, each checked at `key[j]`.
    fn statuses(&mut self, item: &Item, key: &str, required: bool) -> Option<Vec<u16>> {
        let raw = self.get::<Vec<Value>>(item, key, required)?;
        if raw.is_empty() {
            self.err(&item.at(key), "must not be empty");
            return None;
        }
        let mut out = Vec::with_capacity(raw.len());
        let mut ok = true;
        for (j, v) in raw.into_iter().enumerate() {
            let path = format!("{}[{j}]", item.at(key));
            let status = match serde_yaml::from_value::<u64>(v) {
                Ok(n) => self.status_value(&path, n),
                Err(e) => {
                    self.err(&path, serde_reason(&e));
                    None
                }
            };
            match status {
                Some(s) => out.push(s),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A non-empty list of non-empty markers, each checked at `key[j]`.
    fn markers(&mut self, item: &Item, key: &str, required: bool) -> Option<Vec<Marker>> {
        let raw = self.get::<Vec<Value>>(item, key, required)?;
        if raw.is_empty() {
            if required {
                self.err(&item.at(key), "must list at least one marker");
                return None;
            }
            return Some(Vec::new());
        }
        let mut out = Vec::with_capacity(raw.len());
        let mut ok = true;
        for (j, v) in raw.into_iter().enumerate() {
            let path = format!("{}[{j}]", item.at(key));
            match serde_yaml::from_value::<String>(v) {
                Ok(s) => match Marker::new(&s) {
                    Some(m) => out.push(m),
                    None => {
                        self.err(
                            &path,
                            "a marker must not be empty (it would match every body)",
                        );
                        ok = false;
                    }
                },
                Err(e) => {
                    self.err(&path, serde_reason(&e));
                    ok = false;
                }
            }
        }
        ok.then_some(out)
    }

    fn header(&mut self, item: &Item) -> Option<HeaderMatch> {
        let text = self.get::<String>(item, "header", false)?;
        let path = item.at("header");
        let (name, value) = match text.split_once('=') {
            Some((n, v)) => (n.trim(), Some(v.trim())),
            None => (text.trim(), None),
        };
        let name = match HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
            Ok(n) => n,
            Err(_) => {
                self.err(&path, format!("{name:?} is not a valid header name"));
                return None;
            }
        };
        match value {
            Some("") => {
                self.err(
                    &path,
                    "write \"name\" to test presence or \"name=value\" with a value",
                );
                None
            }
            _ => Some(HeaderMatch {
                name,
                value: value.map(str::to_string),
            }),
        }
    }

    /// A field naming a `Reason`, `Scope` or `TerminalState`, parsed with its `FromStr`.
    fn named<T: FromStr<Err = String>>(
        &mut self,
        item: &Item,
        key: &str,
        required: bool,
    ) -> Option<T> {
        let text = self.get::<String>(item, key, required)?;
        match text.parse::<T>() {
            Ok(t) => Some(t),
            Err(e) => {
                self.err(&item.at(key), e);
                None
            }
        }
    }
}
