//! Operator rules: compiled, immutable restatement and classification rules (SPEC §5.10,
//! §5.11), loaded from `rules_dir/restatement.yaml` and `rules_dir/classification.yaml`.
//!
//! Protects the classifier from half-valid rule files: a `RuleSet` only exists after
//! every rule of both files passed validation (otherwise the caller gets every
//! `Problem`, with file and path, and keeps its previous `RuleSet` — rules are
//! hot-reloaded, SPEC §6). Once built, a `RuleSet` never changes, so a request can pin
//! one and see one generation throughout. Invariants: at most `MAX_RULES` rules per
//! kind; ids are unique per file; every marker is non-empty; every status is in
//! 100..=599; a classification rule has at least one condition (status, match or
//! header); a rule with `terminal` has `scope: connection`. Matching is first match
//! wins, in file order; all conditions a rule states must hold. Body markers are byte
//! substrings, ASCII case-insensitive, over at most the first 64 KiB (see `text`).
//! This module does no I/O after loading and knows nothing of connections or cooldowns.

mod load;
pub mod text;

use crate::config::Problem;
use crate::policy::{Classification, Reason, Scope, TerminalState};
use http::{HeaderMap, HeaderName};
use std::path::Path;
use std::time::Duration;
pub use text::{Haystack, Marker, MAX_SCAN_BYTES};

/// Most rules of one kind (one file).
pub const MAX_RULES: usize = 500;
/// Restated `retry_after_s` when a rule does not say.
pub const DEFAULT_RETRY_AFTER_S: u64 = 60;
/// Name of the restatement rule file inside `rules_dir`.
pub const RESTATEMENT_FILE: &str = "restatement.yaml";
/// Name of the classification rule file inside `rules_dir`.
pub const CLASSIFICATION_FILE: &str = "classification.yaml";

/// The outcome of a firing restatement rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restated {
    pub rule: String,
    pub to_status: u16,
    pub retry_after_s: u64,
}

/// Which providers a rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ProviderMatch {
    Any,
    Exact(String),
}

impl ProviderMatch {
    fn parse(text: &str) -> ProviderMatch {
        if text == "*" {
            ProviderMatch::Any
        } else {
            ProviderMatch::Exact(text.to_string())
        }
    }

    fn matches(&self, provider: &str) -> bool {
        match self {
            ProviderMatch::Any => true,
            ProviderMatch::Exact(p) => p == provider,
        }
    }
}

/// A compiled restatement rule (SPEC §5.10).
#[derive(Clone, Debug)]
pub struct RestatementRule {
    id: String,
    provider: ProviderMatch,
    from_statuses: Vec<u16>,
    to_status: u16,
    text_markers: Vec<Marker>,
    exclude_markers: Vec<Marker>,
    retry_after_s: u64,
}

impl RestatementRule {
    pub fn id(&self) -> &str {
        &self.id
    }

    fn fires(&self, provider: &str, status: u16, body: &Haystack<'_>) -> bool {
        self.provider.matches(provider)
            && self.from_statuses.contains(&status)
            && body.contains_any(&self.text_markers)
            && !body.contains_any(&self.exclude_markers)
    }
}

/// `header: "name"` (present) or `header: "name=value"` (some value equal, ignoring
/// ASCII case and surrounding whitespace).
#[derive(Clone, Debug)]
struct HeaderMatch {
    name: HeaderName,
    value: Option<String>,
}

impl HeaderMatch {
    fn matches(&self, headers: Option<&HeaderMap>) -> bool {
        let Some(headers) = headers else {
            return false;
        };
        let mut values = headers.get_all(&self.name).iter();
        match &self.value {
            None => values.next().is_some(),
            Some(want) => values.any(|v| {
                v.as_bytes()
                    .trim_ascii()
                    .eq_ignore_ascii_case(want.as_bytes())
            }),
        }
    }
}

/// A compiled classification rule (SPEC §5.11).
#[derive(Clone, Debug)]
pub struct ClassificationRule {
    id: String,
    provider: ProviderMatch,
    statuses: Option<Vec<u16>>,
    markers: Option<Vec<Marker>>,
    header: Option<HeaderMatch>,
    reason: Reason,
    scope: Scope,
    cooldown: Option<Duration>,
    terminal: Option<TerminalState>,
    retryable: bool,
}

impl ClassificationRule {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The verdict this rule gives, with `rule` set to its id.
    pub fn classification(&self) -> Classification {
        Classification {
            reason: self.reason,
            scope: self.scope,
            retryable: self.retryable,
            cooldown: self.cooldown,
            terminal: self.terminal,
            rule: Some(self.id.clone()),
        }
    }

    fn matches(
        &self,
        provider: &str,
        status: u16,
        headers: Option<&HeaderMap>,
        body: &Haystack<'_>,
    ) -> bool {
        self.provider.matches(provider)
            && self.statuses.as_ref().is_none_or(|s| s.contains(&status))
            && self.header.as_ref().is_none_or(|h| h.matches(headers))
            && self.markers.as_ref().is_none_or(|m| body.contains_any(m))
    }
}

/// Every operator rule of one generation, validated and compiled.
#[derive(Clone, Debug, Default)]
pub struct RuleSet {
    restatement: Vec<RestatementRule>,
    classification: Vec<ClassificationRule>,
}

impl RuleSet {
    /// No rules: restatement never fires, classification is the built-in table.
    pub fn empty() -> Self {
        RuleSet::default()
    }

    /// Loads and validates `dir/restatement.yaml` and `dir/classification.yaml`. A
    /// missing file (or a missing directory) means no rules of that kind.
    pub fn load_dir(dir: &Path) -> Result<RuleSet, Vec<Problem>> {
        let mut problems = Vec::new();
        if dir.exists() && !dir.is_dir() {
            return Err(vec![Problem {
                file: dir.display().to_string(),
                path: String::new(),
                reason: "rules_dir is not a directory".to_string(),
            }]);
        }
        let mut read = |name: &str| -> Option<(String, String)> {
            let path = dir.join(name);
            let label = path.display().to_string();
            match crate::config::shape::read_file(&path, crate::config::shape::MAX_BYTES) {
                Ok(text) => Some((label, text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    problems.push(Problem {
                        file: label,
                        path: String::new(),
                        reason: format!("cannot read file: {e}"),
                    });
                    None
                }
            }
        };
        let restatement = read(RESTATEMENT_FILE);
        let classification = read(CLASSIFICATION_FILE);
        let parsed = RuleSet::from_texts(
            restatement.as_ref().map(|(l, t)| (l.as_str(), t.as_str())),
            classification
                .as_ref()
                .map(|(l, t)| (l.as_str(), t.as_str())),
        );
        match parsed {
            Ok(set) if problems.is_empty() => Ok(set),
            Ok(_) => Err(problems),
            Err(more) => {
                problems.extend(more);
                Err(problems)
            }
        }
    }

    /// Validates rule texts, each given as `(file label, text)`; `None` = no such file.
    pub fn from_texts(
        restatement: Option<(&str, &str)>,
        classification: Option<(&str, &str)>,
    ) -> Result<RuleSet, Vec<Problem>> {
        let mut problems = Vec::new();
        let restatement = match restatement {
            Some((file, text)) => load::restatement(file, text, &mut problems),
            None => Vec::new(),
        };
        let classification = match classification {
            Some((file, text)) => load::classification(file, text, &mut problems),
            None => Vec::new(),
        };
        if problems.is_empty() {
            Ok(RuleSet {
                restatement,
                classification,
            })
        } else {
            Err(problems)
        }
    }

    pub fn restatement_count(&self) -> usize {
        self.restatement.len()
    }

    pub fn classification_count(&self) -> usize {
        self.classification.len()
    }

    /// SPEC §5.10: the first firing restatement rule, if any.
    pub fn restate(&self, provider: &str, status: u16, body: &[u8]) -> Option<Restated> {
        if self.restatement.is_empty() {
            return None;
        }
        let hay = Haystack::new(body);
        self.restatement
            .iter()
            .find(|r| r.fires(provider, status, &hay))
            .map(|r| Restated {
                rule: r.id.clone(),
                to_status: r.to_status,
                retry_after_s: r.retry_after_s,
            })
    }

    /// SPEC §5.11: the first classification rule matching this HTTP error, if any.
    pub fn classification_rule(
        &self,
        provider: &str,
        status: u16,
        headers: Option<&HeaderMap>,
        body: &Haystack<'_>,
    ) -> Option<&ClassificationRule> {
        self.classification
            .iter()
            .find(|r| r.matches(provider, status, headers, body))
    }
}

#[cfg(test)]
mod tests;
